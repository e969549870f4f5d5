"""The trained model as files, logged to MLflow, and loaded back without unpickling.

A model is five plain files:

- `weights.safetensors`: the `JourneyTransformer` state dict (safetensors: tensors only);
- `model_config.json`: `ModelConfig` (architecture and vocabulary sizes);
- `vocab.json`: the train vocabularies (`Vocabularies.save` format);
- `preprocessing.json`: what turns raw events into the journeys the model saw (features,
  time buckets, max_events, conversion/drop events, event map, timezone, ...);
- `calibration.json`: the temperature fitted on the val split.

They are logged as the artifacts of an MLflow models-from-code pyfunc
(`journeys/pyfunc_model.py`), so the model is registrable and servable, while
`load_model` reads the files directly: JSON and safetensors, never pickle.

The logged pyfunc carries a signature and an input example (`journeys.serving`), so
`mlflow models serve` takes journeys as JSON (docs/serving.md).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from journeys.errors import InputError, first_line
from journeys.vocab import VOCAB_FILE

if TYPE_CHECKING:
    import polars as pl

    from journeys.config import Config
    from journeys.encoding import ContinuousInputs, EncodedJourneys, NumericScaling
    from journeys.in_flight import QuietSurvival
    from journeys.model import JourneyTransformer
    from journeys.vocab import Vocabularies

WEIGHTS = "weights.safetensors"
MODEL_CONFIG = "model_config.json"
PREPROCESSING = "preprocessing.json"
CALIBRATION = "calibration.json"
MODEL_FILES = (WEIGHTS, MODEL_CONFIG, VOCAB_FILE, PREPROCESSING, CALIBRATION)
FORMAT_VERSION = 1
MODEL_NAME = "model"  # the artifact name under the run: runs:/<run_id>/model
PYFUNC_FILE = Path(__file__).with_name("pyfunc_model.py")
PREDICT_BATCH_SIZE = 1024

_MODELS_URI = re.compile(r"models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[^/]+))/?")


def preprocessing_settings(
    config: Config,
    numeric_scaling: NumericScaling = (),
    quiet_survival: QuietSurvival | None = None,
    bucket_edges: tuple[tuple[float, ...], ...] = (),
) -> dict[str, Any]:
    """Everything scoring needs to rebuild journeys exactly as training saw them, the
    numeric features' train scaling (`journeys.encoding.numeric_scaling`) and bucket edges
    (`numeric_bucket_edges`) included, and how long journeys stay quiet
    (`journeys.in_flight`) to score the open ones."""
    from journeys.encoding import NUMERIC_INPUTS

    data, journey = config.data, config.journey
    return {
        "format_version": FORMAT_VERSION,
        "features": list(data.features),
        "numeric_features": list(data.numeric_features),
        "numeric_scaling": [list(entry) for entry in numeric_scaling],
        "numeric_bucket_edges": [list(edges) for edges in bucket_edges],
        "n_time_buckets": config.model.time_buckets,
        "max_events": journey.max_events,
        "max_gap": journey.max_gap,
        "after_conversion": journey.after_conversion,
        "conversion_events": list(data.conversion_events),
        "drop_events": list(data.drop_events),
        "event_map": dict(data.event_map),
        "columns": dict(data.columns),
        "header": data.header,
        "separator": data.separator,
        "timezone": data.timezone,
        "timestamp_unit": data.timestamp_unit,
        "time_encodings": config.model.time_encodings,
        "numeric_inputs": len(NUMERIC_INPUTS),  # older models: see `LoadedModel.continuous`
        "quiet_survival": quiet_survival.to_dict() if quiet_survival else None,
    }


@dataclass
class LoadedModel:
    """A model ready to score: weights in eval mode plus everything to encode journeys."""

    model: JourneyTransformer
    vocabs: Vocabularies
    preprocessing: dict[str, Any]
    model_uri: str
    model_version: str | None = None
    temperature: float = 1.0
    model_config: dict[str, Any] = field(default_factory=dict)

    @property
    def numeric_features(self) -> list[str]:
        return list(self.preprocessing.get("numeric_features", []))

    @property
    def event_columns(self) -> list[str]:
        """The per-event columns the model reads besides event types and times (as
        `Data.event_columns`): its features, then its numbers."""
        return [*self.vocabs.features, *self.numeric_features]

    @property
    def continuous(self) -> ContinuousInputs:
        """The continuous inputs the model reads, as training computed them: the time
        encodings in the training log's zone, the numbers with train's scaling."""
        from journeys.encoding import ContinuousInputs

        time = bool(self.preprocessing.get("time_encodings"))
        scaling = tuple(
            (n, float(c), float(s)) for n, c, s in self.preprocessing.get("numeric_scaling", [])
        )
        zone = self.preprocessing.get("timezone", "UTC") if time else None
        edges = tuple(tuple(e) for e in self.preprocessing.get("numeric_bucket_edges", []))
        # Models from before `numeric_inputs` say `numeric_relative` (three) or nothing (two).
        legacy = 3 if self.preprocessing.get("numeric_relative") else 2
        numeric_inputs = int(self.preprocessing.get("numeric_inputs", legacy))
        return ContinuousInputs(zone, scaling, numeric_inputs, edges)

    @property
    def max_gap(self) -> timedelta:
        """The quiet time after which the model's journeys end (`journey.max_gap`)."""
        from journeys.config import Journey, parse_duration

        return parse_duration(self.preprocessing.get("max_gap", Journey().max_gap))

    @property
    def quiet_survival(self) -> QuietSurvival | None:
        """How long journeys stay quiet, by outcome; None for a model trained before it
        was stored (its open journeys keep the model's score)."""
        from journeys.in_flight import QuietSurvival

        return QuietSurvival.from_dict(self.preprocessing.get("quiet_survival"))

    @property
    def max_len(self) -> int:
        """The most recent events of a journey the model reads."""
        return int(self.model.config.max_len)

    def encode(self, frame: pl.DataFrame) -> EncodedJourneys:
        """A journeys frame (ingest schema) as the model's input, with its vocabularies."""
        from journeys.encoding import encode_journeys

        n_time_buckets = self.preprocessing.get("n_time_buckets", self.model.config.n_time_buckets)
        return encode_journeys(
            frame, self.vocabs, int(n_time_buckets), self.max_len, self.continuous
        )

    def predict_logits(
        self, frame: pl.DataFrame, batch_size: int = PREDICT_BATCH_SIZE
    ) -> np.ndarray:
        """Uncalibrated logits for a journeys frame (ingest schema), in the frame's order."""
        from journeys.inference import run_model

        return run_model(self.model, self.encode(frame), batch_size).logits

    def predict_proba(
        self, frame: pl.DataFrame, batch_size: int = PREDICT_BATCH_SIZE, calibrated: bool = True
    ) -> np.ndarray:
        """Conversion probabilities; `calibrated` divides logits by the fitted temperature."""
        from journeys.metrics import sigmoid

        logits = self.predict_logits(frame, batch_size)
        return sigmoid(logits, self.temperature if calibrated else 1.0)


# ----------------------------------------------------------------------------- save


def save_model_files(
    folder: str | Path,
    model: JourneyTransformer,
    vocabs: Vocabularies,
    preprocessing: dict[str, Any],
    temperature: float = 1.0,
) -> dict[str, Path]:
    """Write the five model files into `folder`; return {file name: path}."""
    from safetensors.torch import save_model

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # save_model (not save_file) copes with tied/shared tensors and makes them contiguous.
    save_model(model, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / MODEL_CONFIG).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    vocabs.save(folder)
    (folder / PREPROCESSING).write_text(json.dumps(preprocessing, indent=2, default=str) + "\n")
    (folder / CALIBRATION).write_text(json.dumps({"temperature": float(temperature)}) + "\n")
    return {name: folder / name for name in MODEL_FILES}


def log_model(
    model: JourneyTransformer,
    vocabs: Vocabularies,
    preprocessing: dict[str, Any],
    temperature: float = 1.0,
):
    """Log the model under the active MLflow run as a models-from-code pyfunc.

    Returns MLflow's `ModelInfo` (its `model_uri` is what gets registered).
    """
    import mlflow

    from journeys import serving

    # MLflow serves the input example through the logged model once, reading its files
    # back: per-file progress bars would be noise in the training output.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    with tempfile.TemporaryDirectory(prefix="journeys-model-") as tmp:
        files = save_model_files(tmp, model, vocabs, preprocessing, temperature)
        return mlflow.pyfunc.log_model(
            name=MODEL_NAME,
            python_model=str(PYFUNC_FILE),
            artifacts={name: str(path) for name, path in files.items()},
            # Explicit requirements: inferring them would load the model in a subprocess.
            pip_requirements=_requirements(),
            # Explicit signature: inferring it from the example would run the model once
            # more. MLflow still loads the model in-process and serves the example through
            # it (`_validate_serving_input`, a fraction of a second), warning if it fails.
            signature=serving.signature(preprocessing, causal=bool(model.config.causal)),
            input_example=serving.example(vocabs),
        )


def _requirements() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for package in ("torch", "safetensors", "polars", "numpy", "pandas", "mlflow", "journeys"):
        try:
            out.append(f"{package}=={version(package)}")
        except PackageNotFoundError:
            continue  # e.g. journeys run from a checkout rather than installed
    return out


# ----------------------------------------------------------------------------- load


def load_model_files(
    folder: str | Path, model_uri: str | None = None, model_version: str | None = None
) -> LoadedModel:
    """Build a `LoadedModel` from the five files in `folder` (or its `artifacts/`)."""
    from safetensors.torch import load_model as load_weights

    from journeys.model import JourneyTransformer, ModelConfig
    from journeys.vocab import Vocabularies

    folder = Path(folder)
    if not (folder / WEIGHTS).exists() and (folder / "artifacts" / WEIGHTS).exists():
        folder = folder / "artifacts"  # an MLflow model folder: files live in artifacts/
    missing = [name for name in MODEL_FILES if not (folder / name).exists()]
    if missing:
        raise InputError(f"{model_uri or folder} is not a journeys model: missing {missing}")
    try:
        model_config = json.loads((folder / MODEL_CONFIG).read_text())
        model = JourneyTransformer(ModelConfig.from_dict(model_config))
        load_weights(model, str(folder / WEIGHTS), strict=True, device="cpu")
        preprocessing = json.loads((folder / PREPROCESSING).read_text())
        temperature = float(json.loads((folder / CALIBRATION).read_text())["temperature"])
    except Exception as err:  # safetensors, JSON, shape or key errors: a damaged model
        raise InputError(
            f"{model_uri or folder}: damaged model files ({WEIGHTS}, {MODEL_CONFIG}, ...): "
            f"{first_line(err)}"
        ) from None
    model.eval()
    return LoadedModel(
        model=model,
        vocabs=Vocabularies.load(folder),
        preprocessing=preprocessing,
        model_uri=model_uri or str(folder),
        model_version=model_version,
        temperature=temperature,
        model_config=model_config,
    )


def load_model(model_uri: str, tracking_uri: str | None = None) -> LoadedModel:
    """Load a logged model: `runs:/<id>/model`, `models:/<name>/<version>`,
    `models:/<name>@<alias>`, `models:/<model_id>`, or a local folder.

    Artifacts are downloaded with MLflow and read as JSON and safetensors, so this works
    with `MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false`. A missing model, version or alias
    raises `InputError` with one line.
    """
    if ":/" not in model_uri:
        if not Path(model_uri).is_dir():
            raise InputError(f"model {model_uri} not found: not a model URI nor a folder")
        return load_model_files(model_uri, model_uri)

    import mlflow
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from journeys.tracking import use_tracking_uri

    # Ten small files: per-file progress bars would be noise (the user can turn them on).
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # The registry defaults to the process-wide tracking URI, not the one given here: pass
    # both explicitly, or `models:/` lookups read another store.
    tracking_uri = tracking_uri or mlflow.get_tracking_uri()
    registry_uri = os.environ.get("MLFLOW_REGISTRY_URI") or tracking_uri
    version = None
    tmp = tempfile.mkdtemp(prefix="journeys-model-")
    try:
        match = _MODELS_URI.fullmatch(model_uri)
        if match:  # name the version: scores record which one produced them
            client = MlflowClient(tracking_uri=tracking_uri, registry_uri=registry_uri)
            name = match["name"]
            if match["alias"]:
                version = client.get_model_version_by_alias(name, match["alias"]).version
            else:
                version = client.get_model_version(name, match["version"]).version
        # MLflow 3.17 resolves logged models (`runs:/` -> `models:/m-...`) through the
        # process-wide tracking URI whatever is passed here: point it at ours meanwhile.
        with use_tracking_uri(tracking_uri):
            folder = mlflow.artifacts.download_artifacts(
                artifact_uri=model_uri,
                dst_path=tmp,
                tracking_uri=tracking_uri,
                registry_uri=registry_uri,
            )
        return load_model_files(folder, model_uri, None if version is None else str(version))
    except MlflowException as err:
        raise InputError(f"model {model_uri} not found: {first_line(err)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

"""The trained model: everything it needs to score a journey, in one typed, versioned home.

A `TrainedModel` is the network (`journeys.model.JourneyTransformer`) and what goes with it:

- its `JourneyEncoder` (`journeys.encoding`): the per-event inputs fitted on train
  (`journeys.inputs.EventInputs`: the vocabularies, the time buckets and time encodings,
  each number's scaling) and the most recent events read;
- its `JourneyRules`: how raw events became the journeys it saw (columns, time zone,
  event map, conversion and drop events, `max_gap`, ...), applied unchanged when a raw
  log is scored;
- the temperature fitted on val, and how long journeys stay quiet by outcome
  (`journeys.in_flight.QuietSurvival`), to score the open ones.

Training builds one, scoring, serving and attribution load one, and `predict_proba` is
the one way from a journeys frame to probabilities. On disk it is five plain files:

- `weights.safetensors`: the network's state dict (safetensors: tensors only);
- `model_config.json`: `ModelConfig` (architecture and input sizes);
- `vocab.json`: the train vocabularies (`Vocabularies.save` format);
- `preprocessing.json`: the encoder's other settings, the journey rules and the quiet-time
  survival, with a `format_version`;
- `calibration.json`: the temperature;
- when another candidate of the run gives the probability (`kind`: the `stack`, or a
  `baseline_<name>`, chosen by `journeys.promotion`), `head.json` (that model's fitted
  state, versioned) and, for a boosted one, `head.trees` (its trees, Treelite's
  checkpoint: numbers, never code; `head.json` holds its SHA-256). The network is always
  there: its attention explains the journeys, whatever gives the probability. Models saved
  before Treelite hold `head.skops` (the scikit-learn booster, read back with skops, which
  loads only the types named in `BOOSTER_TYPES`), still read.

They are logged as the artifacts of an MLflow models-from-code pyfunc
(`journeys/pyfunc_model.py`), so the model is registrable and servable, while `load_model`
reads the files directly: JSON and safetensors, never pickle. `TrainedModel.load` is the
only reader of the saved settings: it reads every format this product has written
(`FORMAT_VERSION` and older) and migrates it to the typed objects; nothing else reads the
files by key.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from journeys.config import Config, Data, Journey, parse_duration
from journeys.errors import ConfigError, InputError, first_line
from journeys.promotion import STACK, TRANSFORMER, baseline_kind
from journeys.reference import REFERENCE_FILE, Reference
from journeys.vocab import VOCAB_FILE

if TYPE_CHECKING:
    import polars as pl

    from journeys.baselines import Baseline
    from journeys.encoding import EncodedJourneys, JourneyEncoder
    from journeys.in_flight import QuietSurvival
    from journeys.model import JourneyTransformer, ModelConfig
    from journeys.stacking import Stack
    from journeys.vocab import Vocabularies

WEIGHTS = "weights.safetensors"
MODEL_CONFIG = "model_config.json"
PREPROCESSING = "preprocessing.json"
CALIBRATION = "calibration.json"
MODEL_FILES = (WEIGHTS, MODEL_CONFIG, VOCAB_FILE, PREPROCESSING, CALIBRATION)
# The model that gives the probability when it is not the network (`TrainedModel.kind`).
HEAD_FILE = "head.json"
HEAD_BOOSTER = "head.trees"
# 1: the booster in `head.skops`; 2: its trees in `head.trees`, with their SHA-256.
HEAD_FORMAT_VERSION = 2
SKOPS_BOOSTER = "head.skops"
# Written before the head: a stack's blend and its booster (read back as a `stack` head).
LEGACY_STACK_FILE, LEGACY_BOOSTER = "stack.json", "booster.skops"
# The only types a skops booster file (format 1, legacy) may hold besides skops' defaults
# (a fitted HistGradientBoostingClassifier); a file with others is refused.
BOOSTER_TYPES = (
    "functools.partial",
    "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor",
    "sklearn.utils.validation.check_array",
)
# 1: one flat dictionary (up to December 2026); 2: encoder, rules and survival apart.
FORMAT_VERSION = 2
MODEL_NAME = "model"  # the artifact name under the run: runs:/<run_id>/model
PYFUNC_FILE = Path(__file__).with_name("pyfunc_model.py")
PREDICT_BATCH_SIZE = 1024

# What a format-1 `model_config.json` that lacks a key was built with: the values before
# they became inputs or changed default (`ModelConfig`'s defaults are today's product's).
FORMAT_1_ARCHITECTURE = {
    "pooling": "cls",
    "position_origin": "start",
    "visit_bucket": None,
    "n_continuous": 0,
    "causal": False,
    "attention_dropout": 0.0,
}

# Architecture keys added after format 2 began, with what models saved without them were.
ADDED_SINCE_FORMAT_2 = {"wide": False, "continuous_encoding": "linear", "continuous_bins": 64}

_MODELS_URI = re.compile(r"models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[^/]+))/?")


# The settings, by config section, that define a journey: what `JourneyRules` keeps.
RULES = {
    "data": (
        "features", "numeric_features", "columns", "header", "separator", "timezone",
        "timestamp_unit", "timestamp_format", "event_map", "conversion_events",
        "conversion_flag", "drop_events", "exclude_users", "end_events",
    ),
    "journey": ("max_gap", "max_events", "after_conversion", "repeat_conversions"),
}  # fmt: skip


@dataclass(frozen=True)
class JourneyRules:
    """How raw events became the journeys the model was trained on (the `data` and
    `journey` settings that define a journey). Scoring a raw log ingests it with these,
    so the model sees journeys built as in training."""

    features: tuple[str, ...]
    numeric_features: tuple[str, ...]
    columns: dict[str, str | int | list[str]]
    header: bool
    separator: str | None
    timezone: str
    timestamp_unit: str | None
    event_map: dict[str, str]
    conversion_events: tuple[str, ...]
    drop_events: tuple[str, ...]
    max_gap: str
    max_events: int
    after_conversion: str
    # Added after format 2 began: models saved before them had these values.
    timestamp_format: str | None = None
    conversion_flag: dict[str, Any] | None = None
    exclude_users: tuple[str, ...] = ()
    repeat_conversions: str = "with_previous"
    end_events: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: Config) -> JourneyRules:
        settings = {
            key: getattr(getattr(config, section), key)
            for section, keys in RULES.items()
            for key in keys
        }
        flag = config.data.conversion_flag
        settings["conversion_flag"] = None if flag is None else flag.model_dump()
        return cls.from_dict(settings)

    @classmethod
    def from_dict(cls, settings: dict[str, Any]) -> JourneyRules:
        """From settings by name; lists (from a config or JSON) become tuples."""
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()})

    @property
    def max_gap_delta(self) -> timedelta:
        """The quiet time after which the model's journeys end (`journey.max_gap`)."""
        return parse_duration(self.max_gap)

    def ingest_config(self, config: Config) -> Config:
        """`config` with these rules, for ingesting a raw log to score.

        The model decides what a journey is. Column names describe the file being read, so
        the current configuration's `data.columns` override the model's per logical name;
        when it names none, the model's header and separator describe the file too. A mix
        that cannot be read is one line (exit 2), not a traceback.
        """
        from pydantic import ValidationError

        tree = config.model_dump()
        for section, keys in RULES.items():
            tree[section] |= {key: getattr(self, key) for key in keys}
        data = tree["data"]
        data["columns"] = {**self.columns, **config.data.columns}
        if config.data.columns:  # they describe the file: so do its header and separator
            data["header"], data["separator"] = config.data.header, config.data.separator
        # A log to score may hold no conversion yet: its journeys are the open ones.
        tree["ingest"]["require_conversions"] = False
        try:
            return Config.model_validate(tree)
        except ValidationError as err:
            problem = err.errors()[0]["msg"].removeprefix("Value error, ")
            raise ConfigError(
                f"the model's journey rules and this configuration disagree on the log to "
                f"score: {problem}; pass the configuration the model was trained with (--config)"
            ) from None


@dataclass
class TrainedModel:
    """A model ready to score: the network in eval mode plus everything to encode journeys.

    `model_uri` and `model_version` say where it was loaded from (scores record them).
    """

    model: JourneyTransformer
    encoder: JourneyEncoder
    rules: JourneyRules
    temperature: float = 1.0
    quiet_survival: QuietSurvival | None = None
    model_uri: str = ""
    model_version: str | None = None
    # What gives the probability when it is not the network (at most one of the two): the
    # stack (gradient boosting on aggregates blended with the network's logit), or a
    # baseline's model. The network's attention explains the journeys either way.
    stack: Stack | None = None
    baseline: Baseline | None = None
    # What it was judged on (val events, journeys, probabilities), for `journeys monitor`.
    reference: Reference | None = None

    @property
    def kind(self) -> str:
        """Which candidate gives the probability: `transformer`, `stack` or `baseline_<name>`."""
        if self.stack is not None:
            return STACK
        if self.baseline is not None:
            return baseline_kind(self.baseline.name)
        return TRANSFORMER

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def max_len(self) -> int:
        """The most recent events of a journey the model reads."""
        return int(self.model.config.max_len)

    @property
    def max_gap(self) -> timedelta:
        return self.rules.max_gap_delta

    def encode(self, frame: pl.DataFrame) -> EncodedJourneys:
        """A journeys frame (ingest schema) as the model's input."""
        return self.encoder.encode(frame)

    def predict_logits(
        self, frame: pl.DataFrame, batch_size: int = PREDICT_BATCH_SIZE
    ) -> np.ndarray:
        """Uncalibrated logits for a journeys frame (ingest schema), in the frame's order."""
        from journeys.inference import run_model

        return run_model(self.model, self.encode(frame), batch_size).logits

    def predict_proba(
        self, frame: pl.DataFrame, batch_size: int = PREDICT_BATCH_SIZE, calibrated: bool = True
    ) -> np.ndarray:
        """Conversion probabilities (`probabilities` of the network's logits)."""
        return self.probabilities(self.predict_logits(frame, batch_size), frame, calibrated)

    def probabilities(
        self, logits: np.ndarray, frame: pl.DataFrame, calibrated: bool = True
    ) -> np.ndarray:
        """What is served, from the network's logits for `frame`: the stack's blend or the
        baseline's probability when the model serves one (calibrated as they are), else the
        logits divided by the fitted temperature (`calibrated`) or as they are."""
        from journeys.metrics import sigmoid

        if frame.height == 0:  # every journey of a chunk kept its earlier score
            return np.empty(0)  # (nothing for a booster to predict)
        if self.stack is not None:
            return sigmoid(self.stack.combine(logits, frame))
        if self.baseline is not None:
            return self.baseline.predict_proba(frame)
        return sigmoid(logits, self.temperature if calibrated else 1.0)

    # ------------------------------------------------------------------------- files

    def settings(self) -> dict[str, Any]:
        """What `preprocessing.json` holds (format `FORMAT_VERSION`). The encoder's inputs
        (`journeys.inputs.EventInputs`): the time's and the numbers' fitted state here,
        the event type's and the categorical features' vocabularies in `vocab.json`."""
        from journeys.inputs import NUMERIC_INPUTS, NumericInput

        inputs = self.encoder.inputs
        numbers = inputs.of_kind(NumericInput)
        # One count for all numbers: they were fitted together.
        n_inputs = {number.n_inputs for number in numbers} or {len(NUMERIC_INPUTS)}
        if len(n_inputs) > 1:
            raise ValueError(f"numeric features read {sorted(n_inputs)} inputs: one count only")
        return {
            "format_version": FORMAT_VERSION,
            "encoder": {
                "n_time_buckets": inputs.time.n_buckets,
                "max_len": self.encoder.max_len,
                "timezone": inputs.time.timezone,
                "journey_so_far": inputs.time.journey_so_far,
                "numeric_scaling": [[n.name, n.centre, n.scale] for n in numbers],
                "numeric_inputs": n_inputs.pop(),
                "numeric_bucket_edges": [list(edges) for n in numbers for edges in n.bucket_edges],
            },
            "rules": asdict(self.rules),
            "quiet_survival": self.quiet_survival.to_dict() if self.quiet_survival else None,
        }

    def save(self, folder: str | Path) -> dict[str, Path]:
        """Write the five model files into `folder`; return {file name: path}."""
        from safetensors.torch import save_model

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        # The optional files of a model saved here before go: a head or a reference left
        # behind would be loaded as this model's.
        for name in (
            HEAD_FILE, HEAD_BOOSTER, SKOPS_BOOSTER, LEGACY_STACK_FILE, LEGACY_BOOSTER, REFERENCE_FILE
        ):  # fmt: skip
            (folder / name).unlink(missing_ok=True)
        # save_model (not save_file) copes with tied/shared tensors and makes them contiguous.
        save_model(self.model, str(folder / WEIGHTS), metadata={"format": "pt"})
        (folder / MODEL_CONFIG).write_text(json.dumps(self.model.config.to_dict(), indent=2) + "\n")
        self.encoder.vocabs.save(folder)
        (folder / PREPROCESSING).write_text(json.dumps(self.settings(), indent=2) + "\n")
        (folder / CALIBRATION).write_text(
            json.dumps({"temperature": float(self.temperature)}) + "\n"
        )
        files = {name: folder / name for name in MODEL_FILES}
        if self.reference is not None:
            files[REFERENCE_FILE] = self.reference.save(folder)
        return files | self._save_head(folder)

    def _save_head(self, folder: Path) -> dict[str, Path]:
        """`head.json` (and `head.trees`) when another model gives the probability."""
        baseline = self.stack.baseline if self.stack is not None else self.baseline
        if baseline is None:
            return {}
        head = {
            # Format 1 readers read a head without trees as well: only trees need 2.
            "format_version": HEAD_FORMAT_VERSION if baseline.booster is not None else 1,
            "kind": self.kind,
            "baseline": baseline.state(),
            "blend": self.stack.blend_state() if self.stack is not None else None,
        }
        files = {HEAD_FILE: folder / HEAD_FILE}
        if baseline.booster is not None:
            trees = baseline.booster.to_bytes()
            (folder / HEAD_BOOSTER).write_bytes(trees)
            head["trees_sha256"] = hashlib.sha256(trees).hexdigest()
            files[HEAD_BOOSTER] = folder / HEAD_BOOSTER
        (folder / HEAD_FILE).write_text(json.dumps(head, indent=2) + "\n")
        return files

    @classmethod
    def load(
        cls, folder: str | Path, model_uri: str | None = None, model_version: str | None = None
    ) -> TrainedModel:
        """Read the five files in `folder` (or its `artifacts/`), of any format version."""
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
            stored = json.loads((folder / PREPROCESSING).read_text())
            version = int(stored.get("format_version", 1))
            if version > FORMAT_VERSION:
                raise ValueError(
                    f"format {version} is newer than this version of journeys reads "
                    f"({FORMAT_VERSION}): upgrade journeys"
                )
            architecture = json.loads((folder / MODEL_CONFIG).read_text())
            if version < 2:  # keys added to ModelConfig since: what older models were
                architecture = {**FORMAT_1_ARCHITECTURE, **architecture}
            architecture = {**ADDED_SINCE_FORMAT_2, **architecture}
            model = JourneyTransformer(ModelConfig.from_dict(architecture))
            load_weights(model, str(folder / WEIGHTS), strict=True, device="cpu")
            temperature = float(json.loads((folder / CALIBRATION).read_text())["temperature"])
            if version < 2:
                stored = _migrate_format_1(stored, model.config)
            encoder, rules, survival = _read_settings(
                stored, Vocabularies.load(folder), model.config
            )
            _check_sized_by(model.config, encoder)
            stack, baseline = _read_head(folder)
            reference = Reference.load(folder)  # None: trained before monitoring
        except Exception as err:  # safetensors, JSON, shape or key errors: a damaged model
            raise InputError(
                f"{model_uri or folder}: damaged model files ({WEIGHTS}, {PREPROCESSING}, ...): "
                f"{first_line(err)}"
            ) from None
        model.eval()
        return cls(
            model=model,
            encoder=encoder,
            rules=rules,
            stack=stack,
            baseline=baseline,
            temperature=temperature,
            quiet_survival=survival,
            reference=reference,
            model_uri=model_uri or str(folder),
            model_version=model_version,
        )


def _read_settings(
    stored: dict[str, Any], vocabs: Vocabularies, config: ModelConfig
) -> tuple[JourneyEncoder, JourneyRules, QuietSurvival | None]:
    """The typed settings of a format-2 `preprocessing.json`; the encoder's inputs in
    `journeys.inputs.KINDS` order, as they were trained: the vocabularies' features, then
    the numbers (whose bucket counts, with bucket edges, are their tables' sizes in
    `config`, after the features')."""
    from journeys.encoding import JourneyEncoder
    from journeys.in_flight import QuietSurvival
    from journeys.inputs import (
        BUCKETED_INPUTS,
        CategoricalInput,
        EventInputs,
        NumericInput,
        TimeInput,
    )

    encoder = stored["encoder"]
    edges = [tuple(float(e) for e in edges) for edges in encoder["numeric_bucket_edges"]]
    tables = config.feature_vocab_sizes[len(vocabs.features) :]
    per_number = len(BUCKETED_INPUTS)
    numbers = []
    for i, (name, centre, scale) in enumerate(encoder["numeric_scaling"]):
        own = slice(i * per_number, (i + 1) * per_number)
        numbers.append(
            NumericInput(
                str(name),
                float(centre),
                float(scale),
                n_inputs=int(encoder["numeric_inputs"]),
                n_buckets=tables[own.start] - 2 if edges else 0,  # padding and missing
                bucket_edges=tuple(edges[own]),
            )
        )
    inputs = EventInputs(
        vocabs.event_type,
        TimeInput(
            int(encoder["n_time_buckets"]),
            encoder["timezone"],
            journey_so_far=bool(encoder.get("journey_so_far", False)),  # absent: older
        ),
        (*(CategoricalInput(n, vocabs.by_column[n]) for n in vocabs.features), *numbers),
    )
    return (
        JourneyEncoder(inputs, int(encoder["max_len"]), vocabs.min_count),
        JourneyRules.from_dict(stored["rules"]),
        QuietSurvival.from_dict(stored.get("quiet_survival")),
    )


def _check_sized_by(config: ModelConfig, encoder: JourneyEncoder) -> None:
    """The network is the one its encoder sizes (`journeys.encoding.model_config_from`)."""
    inputs = encoder.inputs
    sizes = (len(inputs.event_type), inputs.embedding_sizes, inputs.n_continuous)
    network = (config.vocab_size, config.feature_vocab_sizes, config.n_continuous)
    if sizes != network or inputs.time.n_buckets != config.n_time_buckets:
        raise ValueError(
            f"the encoder's inputs (event types, tables, continuous inputs: {sizes}) do not "
            f"fit the network's {network}"
        )


def _read_head(folder: Path) -> tuple[Stack | None, Baseline | None]:
    """The stack or the baseline a saved model serves (neither: the network's own).

    A booster's trees are read with Treelite (checked against the SHA-256 its head
    recorded); skops, and with it scikit-learn, only for a model saved before them.
    """
    from journeys.baselines import (
        BaselineSettings,
        HgbAggregates,
        JourneyAggregates,
        Trees,
        load_baseline,
    )
    from journeys.stacking import Stack

    def booster(name: str, sha256: str | None = None) -> Trees | None:
        if not (folder / name).exists():
            return None
        if name == HEAD_BOOSTER:
            trees = (folder / name).read_bytes()
            if hashlib.sha256(trees).hexdigest() != sha256:
                raise ValueError(f"{name} is not the file {HEAD_FILE} was saved with")
            return Trees.from_bytes(trees)
        from skops.io import load

        return Trees.of(load(folder / name, trusted=list(BOOSTER_TYPES)))

    if (folder / HEAD_FILE).exists():
        head = json.loads((folder / HEAD_FILE).read_text())
        if int(head["format_version"]) > HEAD_FORMAT_VERSION:
            raise ValueError(f"{HEAD_FILE} is newer than this version of journeys reads")
        trees = (
            booster(HEAD_BOOSTER, head["trees_sha256"])
            if "trees_sha256" in head
            else booster(SKOPS_BOOSTER)
        )
        baseline = load_baseline(head["baseline"], trees)
        if head["kind"] != STACK:
            return None, baseline
        blend = head["blend"]
        weights = tuple(float(w) for w in blend["weights"])
        return Stack(baseline, (weights[0], weights[1]), float(blend["intercept"])), None  # type: ignore[arg-type]
    if (folder / LEGACY_STACK_FILE).exists():  # a stack saved before the head
        stored = json.loads((folder / LEGACY_STACK_FILE).read_text())
        aggregates = JourneyAggregates.from_dict(stored["aggregates"])
        settings = BaselineSettings(
            columns=aggregates.columns,
            timezone=aggregates.timezone,
            visit_gap_s=aggregates.visit_gap_s,
        )
        legacy = HgbAggregates(settings)
        legacy.aggregates, legacy.booster = aggregates, booster(LEGACY_BOOSTER)
        weights = tuple(float(w) for w in stored["weights"])
        return Stack(legacy, (weights[0], weights[1]), float(stored["intercept"])), None
    return None, None


def _migrate_format_1(flat: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
    """A format-1 `preprocessing.json` (one flat dictionary, keys added over time) in
    format 2. A key older models lack takes the value those models were built with."""
    data, journey = Data(), Journey()
    time_encodings = bool(flat.get("time_encodings"))
    # Before `numeric_inputs` models said `numeric_relative` (three inputs) or nothing (two).
    numeric_inputs = flat.get("numeric_inputs", 3 if flat.get("numeric_relative") else 2)
    rules = {
        "features": flat.get("features", []),
        "numeric_features": flat.get("numeric_features", []),
        "columns": flat.get("columns", {}),
        "header": flat.get("header", data.header),
        "separator": flat.get("separator", data.separator),
        "timezone": flat.get("timezone", data.timezone),
        "timestamp_unit": flat.get("timestamp_unit", data.timestamp_unit),
        "event_map": flat.get("event_map", {}),
        "conversion_events": flat.get("conversion_events", data.conversion_events),
        "drop_events": flat.get("drop_events", []),
        "max_gap": flat.get("max_gap", journey.max_gap),
        "max_events": flat.get("max_events", config.max_len),
        "after_conversion": flat.get("after_conversion", journey.after_conversion),
    }
    return {
        "format_version": 2,
        "encoder": {
            "n_time_buckets": flat.get("n_time_buckets", config.n_time_buckets),
            "max_len": config.max_len,
            "timezone": flat.get("timezone", data.timezone) if time_encodings else None,
            "numeric_scaling": flat.get("numeric_scaling", []),
            "numeric_inputs": numeric_inputs,
            "numeric_bucket_edges": flat.get("numeric_bucket_edges", []),
        },
        "rules": rules,
        "quiet_survival": flat.get("quiet_survival"),
    }


# ----------------------------------------------------------------------------- MLflow


def log_model(trained: TrainedModel) -> Any:
    """Log the model under the active MLflow run (`tracking.mlflow_run`) as a
    models-from-code pyfunc. Returns MLflow's `ModelInfo` (its `model_uri` is what gets
    registered)."""
    import mlflow

    from journeys import serving

    # MLflow serves the input example through the logged model once, reading its files
    # back: per-file progress bars would be noise in the training output.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    trained.model.cpu()  # weights are saved from CPU tensors
    with tempfile.TemporaryDirectory(prefix="journeys-model-") as tmp:
        files = trained.save(tmp)
        return mlflow.pyfunc.log_model(
            name=MODEL_NAME,
            python_model=str(PYFUNC_FILE),
            artifacts={name: str(path) for name, path in files.items()},
            # Explicit requirements: inferring them would load the model in a subprocess.
            pip_requirements=_requirements(),
            # Explicit signature: inferring it from the example would run the model once
            # more. MLflow still loads the model in-process and serves the example through
            # it (`_validate_serving_input`, a fraction of a second), warning if it fails.
            signature=serving.signature(
                trained.encoder.inputs.columns, causal=bool(trained.config.causal)
            ),
            input_example=serving.example(trained.encoder.inputs),
        )


def _requirements() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for package in (
        "torch", "safetensors", "polars", "numpy", "pandas", "scikit-learn", "skops", "treelite",
        "mlflow", "journeys",
    ):  # fmt: skip
        try:
            out.append(f"{package}=={version(package)}")
        except PackageNotFoundError:
            continue  # e.g. journeys run from a checkout rather than installed
    return out


def load_model(model_uri: str, tracking_uri: str | None = None) -> TrainedModel:
    """Load a logged model: `runs:/<id>/model`, `models:/<name>/<version>`,
    `models:/<name>@<alias>`, `models:/<model_id>`, or a local folder.

    Artifacts are downloaded with MLflow and read as JSON and safetensors, so this works
    with `MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false`. A missing model, version or alias
    raises `InputError` with one line.
    """
    if ":/" not in model_uri:
        if not Path(model_uri).is_dir():
            raise InputError(f"model {model_uri} not found: not a model URI nor a folder")
        # Scores name their model: one folder is one name however it was spelled, so a
        # nightly run given it relative and then absolute keeps its earlier scores.
        return TrainedModel.load(model_uri, str(Path(model_uri).resolve()))

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
        return TrainedModel.load(folder, model_uri, None if version is None else str(version))
    except MlflowException as err:
        raise InputError(f"model {model_uri} not found: {first_line(err)}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

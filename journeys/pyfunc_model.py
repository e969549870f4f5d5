"""MLflow models-from-code entry point for the conversion transformer.

MLflow copies this file into the logged model and runs it on `mlflow.pyfunc.load_model`;
`load_context` then reads the model's files (JSON + safetensors) via
`journeys.packaging.load_model_files`. Nothing is pickled, so the model loads with
`MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false`.

`predict` takes journeys in the ingest schema (a Polars or pandas DataFrame, or a list of
dicts, with `event_type`, `event_time` and one list column per feature) and returns a
pandas DataFrame with `conversion_probability` (temperature-calibrated).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow.pyfunc
from mlflow.models import set_model


class JourneyConversionModel(mlflow.pyfunc.PythonModel):
    # Journeys are nested lists, validated by `encode_journeys`; this opts out of MLflow's
    # type-hint input validation (and its "add type hints" warning), as its ChatModel does.
    _skip_type_hint_validation = True

    def load_context(self, context: Any) -> None:
        from journeys.packaging import WEIGHTS, load_model_files

        self.loaded = load_model_files(Path(context.artifacts[WEIGHTS]).parent)

    def predict(self, context, model_input, params=None):
        import pandas as pd
        import polars as pl

        if isinstance(model_input, pl.DataFrame):
            frame = model_input
        elif isinstance(model_input, pd.DataFrame):
            frame = pl.from_pandas(model_input)
        else:
            frame = pl.DataFrame(model_input)
        probs = self.loaded.predict_proba(frame)
        return pd.DataFrame({"conversion_probability": probs})


set_model(JourneyConversionModel())

"""MLflow models-from-code entry point for the conversion transformer.

MLflow copies this file into the logged model and runs it on `mlflow.pyfunc.load_model`;
`load_context` then reads the model's files (JSON + safetensors) via
`journeys.trained_model.TrainedModel.load`. Nothing is pickled, so the model loads with
`MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false`.

`predict` takes journeys, one row per journey (a pandas or Polars DataFrame, records, or
the JSON body `mlflow models serve` receives): `event_type`, `event_time` (ISO 8601 text
or epoch numbers) and one list column per per-event input of the model (its features and
numbers, `journeys.inputs`; read by `journeys.serving`). Per journey it returns what
`journeys score` writes for it, through the same `score_frame`: `conversion_probability`
(temperature-calibrated), `n_events` (the most recent events the model read), `attention`
(one weight per event read) and, for causal models, `prefix_probability`. Bad input raises
an `MlflowException` with one line, which the scoring server answers with HTTP 400
(docs/serving.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow.pyfunc
from mlflow.models import set_model


class JourneyConversionModel(mlflow.pyfunc.PythonModel):
    # Journeys are nested lists, validated by `journeys_from_request`; this opts out of
    # MLflow's type-hint input validation (and its "add type hints" warning), as its
    # ChatModel does. The logged signature describes the columns instead, so `predict`
    # carries no type hints either: MLflow would try to infer a schema from them and log
    # "Unsupported type hint" at every save and load.
    _skip_type_hint_validation = True

    def load_context(self, context: Any) -> None:
        from journeys.trained_model import WEIGHTS, TrainedModel

        self.trained = TrainedModel.load(Path(context.artifacts[WEIGHTS]).parent)

    def predict(self, context, model_input, params=None):  # -> pandas.DataFrame
        import polars as pl
        from mlflow.exceptions import MlflowException

        from journeys.config import Score
        from journeys.errors import JourneysError, first_line
        from journeys.score import score_frame
        from journeys.serving import SERVED_COLUMNS, journeys_from_request

        trained = self.trained
        try:
            frame = journeys_from_request(
                model_input, trained.encoder.inputs.columns, trained.rules.timezone
            )
        except JourneysError as err:
            # Only an MlflowException keeps its message: the scoring server answers any
            # other exception with a generic 400 and the message buried in a stack trace.
            raise MlflowException.invalid_parameter_value(first_line(err)) from None
        # score_frame copies ids through to the scores; a request has none.
        ids = [pl.lit(None, pl.String).alias(name) for name in ("journey_id", "user_id")]
        scored = score_frame(trained, frame.with_columns(ids), attention=Score().attention)
        return scored.select(c for c in SERVED_COLUMNS if c in scored.columns).to_pandas()


set_model(JourneyConversionModel())

"""Serving the model over HTTP with `mlflow models serve` (docs/serving.md).

The logged pyfunc (`journeys/pyfunc_model.py`) carries `signature` and `example`: one
record per journey, a list per event attribute. `journeys_from_request` turns such records
into the ingest schema, with ingest's own timestamp parser, and one-line errors that the
scoring server answers with HTTP 400. Which list columns a journey may carry besides its
event types and times, and how each is read, comes from the model's per-event inputs
(`journeys.inputs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from journeys.errors import InputError, first_line

if TYPE_CHECKING:
    import pandas as pd
    import polars as pl
    from mlflow.models import ModelSignature

    from journeys.inputs import EventInput, EventInputs

# What `mlflow models serve` answers per journey: the columns `journeys score` writes for it.
SERVED_COLUMNS = ("conversion_probability", "n_events", "attention", "prefix_probability")
# The event times of the serving input example (its events come from the vocabularies).
EXAMPLE_TIMES = ("2026-01-01T09:00:00Z", "2026-01-01T09:05:00Z", "2026-01-01T09:20:00Z")


def signature(columns: Sequence[EventInput], causal: bool = False) -> ModelSignature:
    """The pyfunc's signature: one row per journey, a list column per event attribute,
    named after the model's own per-event `columns` (optional: one left out is missing on
    every event).

    Lists are `Array(Any)`, not `Array(string)`: event times are ISO 8601 text or epoch
    numbers; MLflow's string check turns a null list element into a truncated "None"
    string ("n") and refuses a list of numbers, where ingest reads values as text and a
    null as missing (a feature) or invalid (an event type). `journeys_from_request`
    checks and casts the lists itself, with one-line errors.
    """
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, Schema
    from mlflow.types.schema import AnyType, Array

    inputs = [
        ColSpec(Array(AnyType()), "event_type"),
        ColSpec(Array(AnyType()), "event_time"),
        *(ColSpec(Array(AnyType()), column.name, required=False) for column in columns),
    ]
    outputs = [
        ColSpec(DataType.double, "conversion_probability"),
        ColSpec(DataType.integer, "n_events"),
        ColSpec(Array(DataType.float), "attention"),
    ]
    if causal:
        outputs.append(ColSpec(Array(DataType.double), "prefix_probability"))
    return ModelSignature(inputs=Schema(inputs), outputs=Schema(outputs))


def example(inputs: EventInputs) -> pd.DataFrame:
    """One made-up journey for the pyfunc's input example, of the vocabularies' most
    frequent tokens (`EventInput.example`: the numbers are left out): no real user's
    events end up in the model's artifacts."""
    import pandas as pd

    from journeys.inputs import frequent_tokens

    n = len(EXAMPLE_TIMES)
    record = {
        "event_type": frequent_tokens(inputs.event_type, n),
        "event_time": list(EXAMPLE_TIMES),
    }
    for column in inputs.columns:
        values = column.example(n)
        if values is not None:
            record[column.name] = values
    return pd.DataFrame([record])


def journeys_from_request(
    model_input: Any, columns: Sequence[EventInput], timezone: str = "UTC"
) -> pl.DataFrame:
    """Journeys to serve (one row per journey) -> `event_type`, `event_time` and the
    model's per-event `columns`, in the ingest schema (docs/contract.md, journeys), ready
    for `score_frame`.

    `model_input` is a pandas or Polars DataFrame, a list of records or one record.
    `event_time` holds ISO 8601 text (`Z`, an offset, or none: then `timezone`, the model's
    `data.timezone`, as ingest reads it), epoch numbers (s, ms, us or ns, told apart by
    magnitude: ingest's `timestamp_unit: auto`) or datetimes. A column that is absent, or
    null for a journey, is a missing value on every event; values are read as text, as
    ingest reads them, then as each column's kind reads text (`EventInput.from_text`: a
    feature's as they are, a number's as numbers, null: missing). Anything else raises
    `InputError` with one line.
    """
    import polars as pl

    if isinstance(model_input, pl.DataFrame):
        frame = model_input
    else:
        sent = _request_columns(model_input)
        try:
            frame = pl.DataFrame(
                [pl.Series(name, values, strict=False) for name, values in sent.items()]
            )
        except (pl.exceptions.PolarsError, TypeError, ValueError) as err:
            raise InputError(
                f"journeys to score are not lists per journey: {first_line(err)}"
            ) from None
    for name in ("event_type", "event_time"):
        if name not in frame.columns:
            raise InputError(f"journeys to score lack the {name} column (a list per journey)")
    per_event = [column.name for column in columns]
    lists = [name for name in ("event_type", "event_time", *per_event) if name in frame.columns]
    # A column null on every journey (or an empty request) has no list type yet.
    frame = frame.with_columns(
        pl.col(name).cast(pl.List(pl.String)) for name in lists if frame.schema[name] == pl.Null
    )
    for name in lists:
        if not isinstance(frame.schema[name], pl.List):
            raise InputError(f"{name} must be a list per journey, not {frame.schema[name]}")

    events = pl.col("event_type").list.len()
    _fail_first(
        frame,
        (pl.col("event_type").is_null(), "event_type is missing"),
        (events == 0, "no events"),
        (
            pl.col("event_type").list.eval(pl.element().is_null()).list.any(),
            "event_type has a null",
        ),
        (pl.col("event_time").is_null(), "event_time is missing"),
        (pl.col("event_time").list.len() != events, "needs one event_time per event_type"),
        *(
            (pl.col(name).list.len() != events, f"needs one {name} value per event_type")
            for name in per_event
            if name in frame.columns
        ),
    )
    event_types = pl.col("event_type").cast(pl.List(pl.String))
    # A column the request leaves out: null on every event, as ingest leaves a value the
    # log lacks (the vocabularies map it to the unknown id).
    missing = event_types.list.eval(pl.when(pl.lit(False)).then(pl.element()))

    def read(column: EventInput) -> pl.Expr:
        nothing = missing.cast(pl.List(column.dtype))
        if column.name not in frame.columns:
            return nothing.alias(column.name)
        text = pl.col(column.name).cast(pl.List(pl.String))
        return pl.coalesce(column.from_text(text), nothing).alias(column.name)

    try:
        frame = frame.select(
            event_types, _parse_event_times(frame, timezone), *(read(c) for c in columns)
        )
    except pl.exceptions.PolarsError as err:  # e.g. a feature list of lists
        raise InputError(f"journeys to score do not fit the model: {first_line(err)}") from None
    _fail_first(
        frame,
        (
            pl.col("event_time")
            .list.eval(pl.element().diff().dt.total_microseconds() < 0)
            .list.any(),
            "event_time goes back in time: send events oldest first",
        ),
    )
    return frame


def _request_columns(model_input: Any) -> dict[str, list[Any]]:
    """Column name -> one plain Python list (or None) per journey."""
    import numpy as np
    import pandas as pd

    if isinstance(model_input, dict):  # one journey, as MLflow reads a dict with lists
        model_input = [model_input]
    if isinstance(model_input, list):
        model_input = pd.DataFrame(model_input)
    if not isinstance(model_input, pd.DataFrame):
        raise InputError(
            f"journeys to score come as a DataFrame or records, not {type(model_input).__name__}"
        )

    def plain(cell: Any) -> Any:
        if isinstance(cell, np.ndarray):
            if np.issubdtype(cell.dtype, np.datetime64):
                # numpy times carry no zone and mean UTC (how pandas receives tz-aware lists
                # from Polars or Arrow): written out with `Z` so they are not read as local.
                return np.datetime_as_string(cell, unit="us", timezone="UTC").tolist()
            return cell.tolist()
        if isinstance(cell, float) and np.isnan(cell):
            return None  # pandas' filler for a key missing from some records
        return cell

    return {str(name): [plain(cell) for cell in model_input[name]] for name in model_input}


def _parse_event_times(frame: pl.DataFrame, timezone: str) -> pl.Series:
    """`event_time` as UTC datetimes with ingest's own timestamp parser; one line naming
    the first value it cannot read."""
    import polars as pl

    from journeys.config import Data
    from journeys.events import parse_timestamp  # ingest's reading of every timestamp form

    raw = frame.schema["event_time"]
    inner = raw.inner if isinstance(raw, pl.List) else pl.Null()
    if not (inner.is_numeric() or isinstance(inner, (pl.String, pl.Datetime, pl.Null))):
        raise InputError(f"event_time must hold ISO 8601 text or epoch numbers, not {inner}")
    data = Data(timezone=timezone, timestamp_unit="auto")
    parsed = pl.col("event_time").list.eval(parse_timestamp(pl.element(), inner, data))
    try:
        times = frame.select(parsed.alias("parsed"), pl.col("event_time").alias("raw"))
    except pl.exceptions.PolarsError as err:  # e.g. a naive datetime in a DST gap
        raise InputError(f"cannot read event_time: {first_line(err)}") from None
    bad = (
        times.with_row_index("journey")
        .with_columns(event=pl.int_ranges(pl.col("raw").list.len()))
        .explode("raw", "parsed", "event")
        .filter(pl.col("parsed").is_null())
    )
    if bad.height:
        journey, event, value = bad.row(0)[0], bad["event"][0], bad["raw"][0]
        raise InputError(
            f"journey {journey}, event {event}: cannot read event_time {value!r} (ISO 8601 "
            "with or without an offset, or epoch seconds or milliseconds)"
        )
    return pl.Series("event_time", times.get_column("parsed"))


def _fail_first(frame: pl.DataFrame, *checks: tuple[pl.Expr, str]) -> None:
    """Raise `InputError` for the first check that holds on some journey, naming it."""
    import polars as pl

    flags = frame.select(
        pl.when(check).then(pl.int_range(pl.len())).min().alias(str(i))
        for i, (check, _) in enumerate(checks)
    ).row(0)
    for (_, problem), journey in zip(checks, flags, strict=True):
        if journey is not None:
            raise InputError(f"journey {journey}: {problem}")

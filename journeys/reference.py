"""What a model was judged on, kept with it for monitoring (`reference.json`).

A `Profile` holds what a set of events and journeys looks like as counts and sketches,
never rows: event types' and every feature's category counts, the values the model's
vocabularies lack, numeric features', gaps' and journey lengths' quantiles, the served
probabilities' quantiles and the busiest user. The `Reference` is the profile of the val
split (the latest labelled window, the one the vocabularies did not see) with the ingest's
rates; `journeys.monitor` profiles each night the same way and compares.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from journeys.datasets import MISSING_VALUE, IngestReport

if TYPE_CHECKING:
    from journeys.vocab import Vocabularies

REFERENCE_FILE = "reference.json"  # saved with the model
QUANTILES = np.linspace(0.0, 1.0, 51)  # a sketch keeps the distribution at these levels
TOP_UNKNOWN = 5  # the commonest values the model lacks, kept to name them
# The conversion delay's levels: every 5% to 90%, then the tail to 1 in 10,000 and the max.
DELAY_LEVELS = np.r_[np.linspace(0.0, 0.9, 19), 1.0 - np.geomspace(0.05, 1e-4, 16), 1.0]


@dataclass(frozen=True)
class Sketch:
    """A distribution kept small: its size, mean, spread and quantiles at `QUANTILES`."""

    n: int = 0
    mean: float = math.nan
    std: float = math.nan
    quantiles: tuple[float, ...] = ()

    @classmethod
    def of(cls, values: np.ndarray) -> Sketch:
        values = np.asarray(values, dtype=np.float64)
        values = values[np.isfinite(values)]
        if values.size == 0:
            return cls()
        return cls(
            int(values.size),
            float(values.mean()),
            float(values.std()),
            tuple(float(q) for q in np.quantile(values, QUANTILES)),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sketch:
        def number(value: float | None) -> float:
            return math.nan if value is None else float(value)

        quantiles = tuple(number(q) for q in data["quantiles"])
        return cls(data["n"], number(data["mean"]), number(data["std"]), quantiles)


@dataclass(frozen=True)
class Profile:
    """What a set of events and journeys looks like: counts and sketches, never rows."""

    events: int = 0
    categories: dict[str, dict[str, int]] = field(default_factory=dict)  # column -> value -> n
    unknown: dict[str, int] = field(default_factory=dict)  # column -> values the model lacks
    unknown_top: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    numeric: dict[str, Sketch] = field(default_factory=dict)
    gap_hours: Sketch = field(default_factory=Sketch)  # log10(1 + hours) since the last event
    length: Sketch = field(default_factory=Sketch)  # events per journey (closed journeys)
    probability: Sketch = field(default_factory=Sketch)  # served, closed journeys
    busiest_user: tuple[str, int] = ("", 0)  # the user with the most events (a day's, for
    # the reference)

    def to_dict(self) -> dict[str, Any]:
        return finite(asdict(self))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        sketches = ("gap_hours", "length", "probability")
        return cls(
            events=data["events"],
            categories=data["categories"],
            unknown=data["unknown"],
            unknown_top={k: [tuple(v) for v in vs] for k, vs in data["unknown_top"].items()},
            numeric={k: Sketch.from_dict(v) for k, v in data["numeric"].items()},
            **{name: Sketch.from_dict(data[name]) for name in sketches},
            busiest_user=tuple(data["busiest_user"]),
        )


def event_rows(
    journeys: pl.LazyFrame, categorical: list[str], numeric: list[str], since: datetime | None
) -> pl.LazyFrame:
    """One row per event (after `since`): user, day, the gap since the journey's previous
    event (in log10(1 + hours)) and the categorical and numeric columns."""
    lists = ["event_type", "event_time", *categorical, *numeric]
    hours = (
        pl.col("event_time") - pl.col("event_time").shift(1).over("journey_id")
    ).dt.total_seconds() / 3600.0
    rows = (
        journeys.select("journey_id", "user_id", *lists)
        .explode(lists)
        .with_columns(gap_hours=(1.0 + hours).log10(), day=pl.col("event_time").dt.date())
    )
    return rows if since is None else rows.filter(pl.col("event_time") > since)


def profile(
    events: pl.DataFrame,
    closed: pl.DataFrame,
    categorical: list[str],
    numeric: list[str],
    vocabularies: Vocabularies | None,
    probabilities: np.ndarray,
    busiest_by_day: bool,
) -> Profile:
    """The profile of `events` (from `event_rows`) and of the `closed` journeys."""
    categories, unknown, unknown_top = {}, {}, {}
    for column in ["event_type", *categorical]:
        values = events.get_column(column).cast(pl.String).fill_null(MISSING_VALUE)
        counts = values.value_counts(sort=True)
        categories[column] = dict(counts.iter_rows())  # type: ignore[arg-type]
        vocabulary = vocabularies.by_column.get(column) if vocabularies else None
        if vocabulary is not None:
            known = pl.Series(vocabulary.tokens, dtype=pl.String)
            lacked = counts.filter(
                ~pl.col(column).is_in(known.implode()) & (pl.col(column) != MISSING_VALUE)
            )
            unknown[column] = int(lacked.get_column("count").sum())
            unknown_top[column] = [
                (str(v), int(n)) for v, n in lacked.head(TOP_UNKNOWN).iter_rows()
            ]
    keys = ["user_id", "day"] if busiest_by_day else ["user_id"]
    per_user = events.group_by(keys).len().sort("len", descending=True)
    busiest = (str(per_user.item(0, "user_id")), int(per_user.item(0, "len"))) if per_user.height else ("", 0)  # fmt: skip
    return Profile(
        events=events.height,
        categories=categories,
        unknown=unknown,
        unknown_top=unknown_top,
        numeric={name: Sketch.of(events.get_column(name).to_numpy()) for name in numeric},
        gap_hours=Sketch.of(events.get_column("gap_hours").to_numpy()),
        length=Sketch.of(closed.get_column("n_events_total").to_numpy()),
        probability=Sketch.of(probabilities),
        busiest_user=busiest,
    )


@dataclass(frozen=True)
class DelayCurve:
    """The distribution of the delay D from an event to its journey's conversion, in hours,
    kept at `DELAY_LEVELS` (dense in the tail, where long-quiet journeys sit)."""

    levels: tuple[float, ...] = ()
    hours: tuple[float, ...] = ()

    @classmethod
    def of(cls, hours: np.ndarray) -> DelayCurve:
        """The curve of these delays (negative or missing ones left out)."""
        hours = np.asarray(hours, dtype=np.float64)
        hours = hours[np.isfinite(hours) & (hours >= 0)]
        if hours.size == 0:
            return cls()
        return cls(tuple(DELAY_LEVELS.tolist()), tuple(np.quantile(hours, DELAY_LEVELS).tolist()))

    def share(self, quiet_hours: np.ndarray, elapsed_hours: np.ndarray) -> np.ndarray:
        """Of the journeys that will convert, quiet `quiet_hours` since their last event,
        the share whose conversion arrives within `elapsed_hours` more: P(D <= q + t | D > q).
        NaN without a curve."""
        q = np.asarray(quiet_hours, dtype=np.float64)
        if not self.hours:
            return np.full(q.shape, math.nan)
        # D's distribution function, interpolated on log hours (delays span minutes to
        # weeks); past the longest delay seen every conversion has arrived.
        grid = np.log1p(np.maximum.accumulate(np.asarray(self.hours)))

        def cdf(hours: np.ndarray) -> np.ndarray:
            return np.interp(np.log1p(np.maximum(hours, 0.0)), grid, self.levels)

        before = cdf(q)
        arrived = cdf(q + np.asarray(elapsed_hours, dtype=np.float64)) - before
        waiting = 1.0 - before
        return np.where(waiting > 0, arrived / np.where(waiting > 0, waiting, 1.0), 1.0)


@dataclass(frozen=True)
class Reference:
    """What the champion was judged on, kept with it (`reference.json`)."""

    profile: Profile
    conversions_per_row: float | None = None  # conversions per valid row at training
    quarantined_share: dict[str, float] = field(default_factory=dict)  # reason -> of rows
    roc_auc: float | None = None  # the served model's val ROC AUC
    # How long conversions take to arrive (empty in references saved before it was kept).
    conversion_delay: DelayCurve = field(default_factory=lambda: DelayCurve())

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "profile": self.profile.to_dict()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Reference:
        delay = data.get("conversion_delay")
        return cls(**{
            **data,
            "profile": Profile.from_dict(data["profile"]),
            "conversion_delay": DelayCurve(tuple(delay["levels"]), tuple(delay["hours"]))
            if delay
            else DelayCurve(),
        })  # fmt: skip

    def save(self, folder: Path) -> Path:
        path = folder / REFERENCE_FILE
        path.write_text(json.dumps(finite(self.to_dict()), indent=1, allow_nan=False) + "\n")
        return path

    @classmethod
    def load(cls, folder: Path) -> Reference | None:
        path = folder / REFERENCE_FILE
        return cls.from_dict(json.loads(path.read_text())) if path.exists() else None


def build_reference(
    val: pl.DataFrame,
    probabilities: np.ndarray,
    vocabularies: Vocabularies,
    numeric: list[str],
    report: IngestReport | None,
    roc_auc: float | None,
) -> Reference:
    """The reference from the val split (its journeys as `journeys.datasets` holds them and
    the served model's probabilities on them) and the ingest report of the training data."""
    categorical = [name for name in vocabularies.features]
    events = event_rows(val.lazy(), categorical, numeric, None).collect()
    shares: dict[str, float] = {}
    per_row = None
    if report is not None and report.rows_read:
        shares = {reason: n / report.rows_read for reason, n in report.quarantined.items()}
        conversions = sum(s.get("conversions", 0) for s in report.by_source.values())
        valid = report.rows_read - report.quarantined_total
        per_row = conversions / valid if valid else None
    return Reference(
        profile(events, val, categorical, numeric, vocabularies, probabilities, True),
        per_row,
        shares,
        roc_auc,
        DelayCurve.of(conversion_delays(val)),
    )


def conversion_delays(journeys: pl.DataFrame) -> np.ndarray:
    """Hours from each event of the converting `journeys` to their conversion (`end_time`
    is the conversion's moment): the delay curve of the conversions still to come."""
    delays = (
        journeys.filter(pl.col("label") == 1)
        .select("end_time", "event_time")
        .explode("event_time")
        .select((pl.col("end_time") - pl.col("event_time")).dt.total_seconds() / 3600.0)
    )
    return delays.to_series().to_numpy()


def finite(value: Any) -> Any:
    """`value` with every float that is not finite, however deep, as None (valid JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value

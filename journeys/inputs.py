"""What the model reads of each event: one typed description of the per-event inputs.

An event is its type, its time and the per-event columns the configuration lists, each of
one kind (as Transformers4Rec's tagged schema picks one input module per kind of feature):

- `CategoricalInput` (`data.features`: a channel, a device): ids from the column's train
  vocabulary (unknown and missing: 1), one embedding table;
- `NumericInput` (`data.numeric_features`: a price, an amount): `NUMERIC_INPUTS`, asinh of
  the value centred and scaled by the train split's events, as continuous inputs; with
  `model.numeric_encoding: buckets` two embedded train-quantile bucket ids instead;
- `TimeInput`: the gap since the previous event by log bucket (`model.time_buckets`) and,
  with `model.time_encodings`, the `TIME_ENCODINGS` read in `data.timezone`; with
  `model.journey_so_far`, `JOURNEY_SO_FAR` (the journey's counts and gaps up to the event).

`EventInputs` holds them all, fitted on the train split: the event type's vocabulary, the
time and the columns, in the order the model reads them (`KINDS` order: categorical, then
numeric). Each consumer asks it, and nothing else, what the events carry:
`journeys.encoding.encode_journeys` asks each column for its lists, ids and continuous
inputs; `journeys.encoding.model_config_from` sizes `ModelConfig` by each column's
embedding tables and continuous inputs; the baselines ask which columns are tokens (the
bag of events and the last touch count them) and what each adds to `hgb_aggregates`;
serving asks each column how to read a request's values; `journeys.trained_model` saves
and loads it.

A new kind of per-event input is one class here, a subclass of `EventInput` listed in
`KINDS` with the `data` setting that names its columns, and its tests; ingest reads its
column (`journeys.events`) and the saved model keeps its fitted state
(`journeys.trained_model`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar, Self, TypeVar

import numpy as np
import polars as pl

from journeys.errors import InputError
from journeys.vocab import PAD, UNK, Vocabulary

if TYPE_CHECKING:
    from journeys.config import Data, Model
    from journeys.vocab import Vocabularies

# ----------------------------------------------------------------------------- time

# Time since the previous event -> bucket 1 + floor(log_GROWTH(1 + gap / UNIT)), so bucket 1
# is [0, (GROWTH - 1) UNIT) (and the first event). The buckets always span UNIT ..
# 2^SPAN_DOUBLINGS UNIT (34 years); `model.time_buckets` sets the resolution:
# GROWTH = 2^(SPAN_DOUBLINGS / (n - 2)).
# With 32 buckets each is a doubling (bucket 2 [1 s, 3 s), 3 [3 s, 7 s), ...; 7 days lands in
# bucket 20); with 62, each is a factor sqrt(2).
TIME_BUCKET_UNIT_SECONDS = 1.0
TIME_BUCKET_SPAN_DOUBLINGS = 30
# log() of an exact power of the growth may come out a hair low; this keeps it in its bucket.
_LOG_EPSILON = 1e-9

# Continuous inputs per event when `model.time_encodings` is on, in this order.
TIME_ENCODINGS = (
    "log_gap",
    "log_since_start",
    "hour_sin",
    "hour_cos",
    "weekday_sin",
    "weekday_cos",
)
# log1p(seconds) / log1p(30 days): durations from a second to a month land in [0, 1].
LOG_SECONDS_SCALE = math.log1p(30 * 86400)
# With `model.journey_so_far`, per event, the journey up to it as a few of the aggregates
# gradient boosting wins with (`hgb_aggregates`): its events so far, those of this event's
# type (as logged), and the largest and the mean log gap so far (`log_gap`'s scale, the
# first event's gap counting 0). On the last event, the one the default pooling reads, they
# are the journey's counts and gap statistics, which attention would otherwise add up one
# event at a time; over the events the model reads (the most recent `journey.max_events`),
# not those cut before. They read only the journey up to the event, so prefixes (in-flight
# scoring, causal models) see what they would.
JOURNEY_SO_FAR = (
    "log_events_so_far",
    "log_type_so_far",
    "max_log_gap_so_far",
    "mean_log_gap_so_far",
)
# log1p(count) / log1p(100): counts from 1 to 100 land in (0, 1].
LOG_COUNT_SCALE = math.log1p(100)


def time_bucket_expr(seconds: pl.Expr, n_time_buckets: int) -> pl.Expr:
    """Seconds since the previous event -> log-scaled bucket id in [1, n_time_buckets - 1].

    Id 0 is left for padding. Negative gaps (clock skew) count as 0.
    """
    growth = 2.0 ** (TIME_BUCKET_SPAN_DOUBLINGS / max(1, n_time_buckets - 2))
    scaled = 1.0 + seconds.cast(pl.Float64).clip(lower_bound=0.0) / TIME_BUCKET_UNIT_SECONDS
    bucket = 1 + (scaled.log(growth) + _LOG_EPSILON).floor()
    return bucket.clip(1, max(1, n_time_buckets - 1)).cast(pl.Int64)


def log_seconds(seconds: pl.Expr) -> pl.Expr:
    """log1p(seconds) on `LOG_SECONDS_SCALE` (negative gaps, clock skew, count as 0)."""
    return (seconds.clip(lower_bound=0) + 1).log() / LOG_SECONDS_SCALE


def time_encoding_exprs(
    gap: pl.Expr, since_start: pl.Expr, time: pl.Expr, timezone: str
) -> list[pl.Expr]:
    """Per event: `TIME_ENCODINGS` from the seconds since the previous and the first event
    and the event's UTC time (read in `timezone` for the hour and weekday)."""
    local = time.dt.convert_time_zone(timezone)
    hour = (local.dt.hour() + local.dt.minute() / 60) * (2 * math.pi / 24)
    weekday = (local.dt.weekday() - 1) * (2 * math.pi / 7)
    return [
        log_seconds(gap).alias("log_gap"),
        log_seconds(since_start).alias("log_since_start"),
        hour.sin().alias("hour_sin"),
        hour.cos().alias("hour_cos"),
        weekday.sin().alias("weekday_sin"),
        weekday.cos().alias("weekday_cos"),
    ]


@dataclass(frozen=True)
class TimeInput:
    """Each event's time: the gap since the previous event as one of `n_buckets` log
    buckets (`time_bucket_expr`, one embedding table; the model also embeds the gap that
    opened the event's visit), and with `timezone` the `TIME_ENCODINGS`, hours read there
    (None: no time encodings)."""

    n_buckets: int = 32
    timezone: str | None = None
    journey_so_far: bool = False  # `JOURNEY_SO_FAR` after the time encodings

    @property
    def n_continuous(self) -> int:
        encodings = len(TIME_ENCODINGS) if self.timezone else 0
        return encodings + (len(JOURNEY_SO_FAR) if self.journey_so_far else 0)

    def bucket(self, gap: pl.Expr) -> pl.Expr:
        """The gap's bucket id (seconds since the previous event)."""
        return time_bucket_expr(gap, self.n_buckets)

    def continuous(
        self, gap: pl.Expr, since_start: pl.Expr, time: pl.Expr, journey: str, event: str
    ) -> list[pl.Expr]:
        """Per event, its `n_continuous` inputs (see `time_encoding_exprs` and
        `journey_so_far_exprs`; `journey` and `event` name the columns that say which
        journey an event is in, in time order, and its type)."""
        encodings = (
            time_encoding_exprs(gap, since_start, time, self.timezone) if self.timezone else []
        )
        if self.journey_so_far:
            encodings += journey_so_far_exprs(gap, journey, event)
        return encodings


def journey_so_far_exprs(gap: pl.Expr, journey: str, event: str) -> list[pl.Expr]:
    """Per event: `JOURNEY_SO_FAR`, over the events of its journey up to it."""
    log_gap = log_seconds(gap)
    events = pl.int_range(1, pl.len() + 1).over(journey)
    same_type = pl.int_range(1, pl.len() + 1).over(journey, event)
    return [
        (events.cast(pl.Float64).log1p() / LOG_COUNT_SCALE).alias("log_events_so_far"),
        (same_type.cast(pl.Float64).log1p() / LOG_COUNT_SCALE).alias("log_type_so_far"),
        log_gap.cum_max().over(journey).alias("max_log_gap_so_far"),
        (log_gap.cum_sum().over(journey) / events).alias("mean_log_gap_so_far"),
    ]


# ----------------------------------------------------------------------------- numbers

# Continuous inputs per numeric feature, in this order: its value (asinh, scaled with train's
# statistics; 0 where missing), a flag where it is missing, its value against the journey's
# earlier values (asinh(value) minus their mean, same scale; 0 where missing or first), and
# that relative value carried forward to the events after it (the latest known; 0 before
# any). The third makes "a price above the user's usual" one input, not a mean the network
# must learn to take over the journey; the fourth puts it on every later event, the last
# included, so the model need not search the journey for the latest priced event. Models
# read the first `NumericInput.n_inputs` of them (older ones: two or three).
NUMERIC_INPUTS = ("value", "missing", "relative", "carried")
# With `model.numeric_encoding: buckets` these two are embedded by their train-quantile
# bucket instead, as embedding tables after the categorical features' (id 0: padding,
# 1: missing or no earlier value, then the buckets); missing needs no flag of its own.
BUCKETED_INPUTS = ("value", "relative")
# What `hgb_aggregates` adds per numeric feature and journey (null where all are missing).
NUMERIC_AGGREGATES = ("mean", "min", "max", "last", "sum", "missing")

# (name, centre, scale) of asinh(value) over the train events, per numeric feature: asinh is
# log-like for prices and amounts, whose tails span orders of magnitude, and keeps zero and
# signs.
NumericScaling = tuple[tuple[str, float, float], ...]


def numeric_scaling(frame: pl.DataFrame, names: Sequence[str]) -> NumericScaling:
    """(name, centre, scale) of asinh(value) over every non-missing event of `frame` (the
    train split): what scoring applies unchanged. A constant column gets scale 1."""
    out = []
    for name in names:
        values = frame.select(pl.col(name).explode().drop_nulls().arcsinh()).to_series()
        centre = float(values.mean()) if values.len() else 0.0
        spread = float(values.std()) if values.len() > 1 else 0.0
        out.append((name, centre, spread if spread > 0 else 1.0))
    return tuple(out)


def numeric_bucket_edges(
    frame: pl.DataFrame, names: Sequence[str], n_buckets: int
) -> tuple[tuple[float, ...], ...]:
    """Inner edges of `n_buckets` equal-count buckets of each of `BUCKETED_INPUTS` over the
    non-missing events of `frame` (the train split), feature by feature: what scoring
    applies unchanged. Ties merge buckets, so a column may get fewer."""
    quantiles = np.arange(1, n_buckets) / n_buckets
    out = []
    for name in names:
        value = pl.col(name).cast(pl.List(pl.Float64))
        inputs = frame.select(
            value.list.eval(pl.element().arcsinh()).explode().alias("value"),
            value.list.eval(relative_to_earlier(pl.element().arcsinh()))
            .explode()
            .alias("relative"),
        )
        for column in BUCKETED_INPUTS:
            known = inputs.get_column(column).drop_nulls().to_numpy()
            edges = np.unique(np.quantile(known, quantiles)) if known.size else np.empty(0)
            out.append(tuple(float(edge) for edge in edges))
    return tuple(out)


def relative_to_earlier(value: pl.Expr) -> pl.Expr:
    """Per event of a list: the value minus the mean of the earlier non-missing values of
    the list (null where missing or where none came before). Uses the past only, so a
    causal model's prefixes see what they would see alone."""
    seen = value.is_not_null().cast(pl.Float64)
    filled = value.fill_null(0.0)
    earlier = seen.cum_sum() - seen
    mean_before = (filled.cum_sum() - filled) / earlier
    return pl.when(value.is_not_null() & (earlier > 0)).then(value - mean_before)


def bucket_id_expr(values: pl.Expr, edges: Sequence[float]) -> pl.Expr:
    """Bucket id per value: 1 where missing, else 2 + the number of `edges` at or below it."""
    below = pl.lit(pl.Series(list(edges), dtype=pl.Float64)).search_sorted(values, side="right")
    return pl.when(values.is_null() | values.is_nan()).then(1).otherwise(below.cast(pl.Int64) + 2)


# ----------------------------------------------------------------------------- the kinds


@dataclass(frozen=True)
class EventInput:
    """A per-event column of one kind, read by `name`: what every consumer asks of it.

    Subclasses set `setting` (the `data` list that names columns of the kind, and the key
    its names are saved under), `dtype` (the type of its values in the journeys, a list per
    journey) and `tokens`, and override what the kind adds. The encoder renames the
    column `key` (and its derived lists `key_*`), so a user's column name never meets an
    internal one.
    """

    name: str

    setting: ClassVar[str]
    dtype: ClassVar[type[pl.DataType]]
    # Whether the baselines count its values as tokens (bag of events, last touch).
    tokens: ClassVar[bool] = False

    def fit(self, train: pl.DataFrame, vocabs: Vocabularies, settings: Model) -> Self:
        """This input with what it learns from the train split (`train`'s journeys and the
        train vocabularies), for `settings` (the `model` section)."""
        return self

    @property
    def embedding_sizes(self) -> tuple[int, ...]:
        """The embedding tables it adds to the event (ids per table, padding included)."""
        return ()

    @property
    def n_continuous(self) -> int:
        """The continuous inputs it adds to the event."""
        return 0

    def lists(self, values: pl.Expr, key: str) -> list[list[pl.Expr]]:
        """Per journey, before its events are spread out: list columns named `key` (the
        column's values, `values` being the column cut to the events read) and `key_*`, in
        steps, each step's reading the earlier steps' columns."""
        return [[values.cast(pl.List(self.dtype)).alias(key)]]

    def ids(self, key: str) -> list[pl.Expr]:
        """Per event: one id per embedding table (`embedding_sizes`), from `key`'s lists."""
        return []

    def continuous(self, key: str) -> list[pl.Expr]:
        """Per event: its `n_continuous` inputs, from `key`'s lists."""
        return []

    def aggregates(self) -> list[pl.Expr]:
        """Per journey (the journeys frame): what `hgb_aggregates` adds for this column."""
        return []

    def from_text(self, values: pl.Expr) -> pl.Expr:
        """A request's list of text (serving) as this column's values."""
        return values.list.eval(pl.element().cast(self.dtype))

    def example(self, n: int) -> list | None:
        """`n` made-up values for the serving input example (None: left out)."""
        return None


# Before fitting a categorical input knows no token: everything is unknown.
UNFITTED = Vocabulary((PAD, UNK))


@dataclass(frozen=True)
class CategoricalInput(EventInput):
    """A per-event category (`data.features`): ids from the column's train `vocabulary`
    (unknown and missing: 1), one embedding table; the baselines count its values as
    tokens."""

    vocabulary: Vocabulary = UNFITTED

    setting: ClassVar[str] = "features"
    dtype: ClassVar[type[pl.DataType]] = pl.String
    tokens: ClassVar[bool] = True

    def fit(self, train: pl.DataFrame, vocabs: Vocabularies, settings: Model) -> Self:
        if self.name not in vocabs.by_column:
            raise InputError(
                f"no vocabulary for feature {self.name!r} (the vocabularies hold "
                f"{vocabs.features}): re-run `journeys ingest`"
            )
        return replace(self, vocabulary=vocabs.by_column[self.name])

    @property
    def embedding_sizes(self) -> tuple[int, ...]:
        return (len(self.vocabulary),)

    def lists(self, values: pl.Expr, key: str) -> list[list[pl.Expr]]:
        return [[values.alias(key)]]

    def ids(self, key: str) -> list[pl.Expr]:
        return [self.vocabulary.ids(pl.col(key))]

    def from_text(self, values: pl.Expr) -> pl.Expr:
        return values

    def example(self, n: int) -> list | None:
        return frequent_tokens(self.vocabulary, n)


@dataclass(frozen=True)
class NumericInput(EventInput):
    """A per-event number (`data.numeric_features`): the first `n_inputs` of
    `NUMERIC_INPUTS`, asinh(value) centred by `centre` and divided by `scale` (the train
    split's events), as continuous inputs; with `n_buckets` (`model.numeric_encoding:
    buckets`) the `BUCKETED_INPUTS` as ids of two embedding tables instead, by
    `bucket_edges` (each one's inner edges, train quantiles). `hgb_aggregates` adds its
    `NUMERIC_AGGREGATES`."""

    centre: float = 0.0
    scale: float = 1.0
    n_inputs: int = len(NUMERIC_INPUTS)
    n_buckets: int = 0
    bucket_edges: tuple[tuple[float, ...], ...] = ()

    setting: ClassVar[str] = "numeric_features"
    dtype: ClassVar[type[pl.DataType]] = pl.Float64

    def fit(self, train: pl.DataFrame, vocabs: Vocabularies, settings: Model) -> Self:
        ((_, centre, scale),) = numeric_scaling(train, [self.name])
        buckets = settings.numeric_buckets if settings.numeric_encoding == "buckets" else 0
        edges = numeric_bucket_edges(train, [self.name], buckets) if buckets else ()
        return replace(self, centre=centre, scale=scale, n_buckets=buckets, bucket_edges=edges)

    @property
    def bucketed(self) -> bool:
        return self.n_buckets > 0

    @property
    def read(self) -> tuple[str, ...]:
        """Which inputs it computes: `BUCKETED_INPUTS` or the first `n_inputs`."""
        return BUCKETED_INPUTS if self.bucketed else NUMERIC_INPUTS[: self.n_inputs]

    @property
    def embedding_sizes(self) -> tuple[int, ...]:
        # padding, missing, then the buckets
        return (self.n_buckets + 2,) * len(BUCKETED_INPUTS) if self.bucketed else ()

    @property
    def n_continuous(self) -> int:
        return 0 if self.bucketed else self.n_inputs

    def lists(self, values: pl.Expr, key: str) -> list[list[pl.Expr]]:
        steps = [[values.cast(pl.List(pl.Float64)).alias(key)]]
        if "relative" in self.read:
            relative = pl.col(key).list.eval(relative_to_earlier(pl.element().arcsinh()))
            steps.append([relative.alias(f"{key}_relative")])
        if "carried" in self.read:
            carried = pl.col(f"{key}_relative").list.eval(pl.element().forward_fill())
            steps.append([carried.alias(f"{key}_carried")])
        return steps

    def ids(self, key: str) -> list[pl.Expr]:
        if not self.bucketed:
            return []
        value_edges, relative_edges = self.bucket_edges
        return [
            bucket_id_expr(pl.col(key).arcsinh(), value_edges),
            bucket_id_expr(pl.col(f"{key}_relative"), relative_edges),
        ]

    def continuous(self, key: str) -> list[pl.Expr]:
        if self.bucketed:
            return []
        value = pl.col(key)
        inputs = {
            "value": ((value.arcsinh() - self.centre) / self.scale).fill_null(0.0),
            "missing": value.is_null(),
            "relative": (pl.col(f"{key}_relative") / self.scale).fill_null(0.0),
            "carried": (pl.col(f"{key}_carried") / self.scale).fill_null(0.0),
        }
        return [inputs[name] for name in self.read]

    def aggregates(self) -> list[pl.Expr]:
        name = self.name
        values = pl.col(name)
        present = values.list.drop_nulls()
        return [
            present.list.mean().alias(f"{name}_mean"),
            present.list.min().alias(f"{name}_min"),
            present.list.max().alias(f"{name}_max"),
            values.list.last().alias(f"{name}_last"),
            present.list.sum().alias(f"{name}_sum"),
            (values.list.len() - present.list.len()).cast(pl.Float64).alias(f"{name}_missing"),
        ]


# Every kind, in the order the model reads their columns (embedding tables, continuous
# inputs): a saved model's inputs are read back in this order.
KINDS: tuple[type[EventInput], ...] = (CategoricalInput, NumericInput)

Column = TypeVar("Column", bound=EventInput)


def columns_from_names(names: Mapping[str, Sequence[str]]) -> tuple[EventInput, ...]:
    """The per-event columns, unfitted, from {setting: names} (`data.features`,
    `data.numeric_features`, or a saved copy of them), in `KINDS` order."""
    return tuple(kind(name) for kind in KINDS for name in names.get(kind.setting, ()))


def columns_of(data: Data) -> tuple[EventInput, ...]:
    """The per-event columns the `data` section declares, unfitted, in `KINDS` order."""
    return columns_from_names({kind.setting: getattr(data, kind.setting) for kind in KINDS})


def names_by_setting(columns: Sequence[EventInput]) -> dict[str, list[str]]:
    """{setting: names} of `columns` (`columns_from_names` reads it back), every kind's."""
    return {kind.setting: [c.name for c in columns if type(c) is kind] for kind in KINDS}


def frequent_tokens(vocabulary: Vocabulary, n: int) -> list[str]:
    """`n` tokens, the vocabulary's most frequent first and round again (unknown when it
    knows none): made-up values that no real journey gave."""
    tokens = list(vocabulary.tokens[2:])  # after padding and unknown
    return [tokens[i % len(tokens)] if tokens else UNK for i in range(n)]


@dataclass(frozen=True)
class EventInputs:
    """Everything the model reads of an event: the event type (its train vocabulary), the
    time, and the per-event `columns` in the order the model reads them (`KINDS` order),
    each fitted on the train split. The one description the encoder, `ModelConfig`'s
    sizes, the baselines and serving read."""

    event_type: Vocabulary
    time: TimeInput = TimeInput()
    columns: tuple[EventInput, ...] = ()

    @classmethod
    def fit(
        cls,
        train: pl.DataFrame,
        vocabs: Vocabularies,
        settings: Model,
        *,
        timezone: str,
        columns: Sequence[EventInput] | None = None,
    ) -> EventInputs:
        """The inputs of `columns` (default: the vocabularies' features, categorical)
        fitted on the train split: `train`'s journeys and the train `vocabs`; time
        encodings read in `timezone` when `model.time_encodings` is on."""
        if columns is None:
            columns = [CategoricalInput(name) for name in vocabs.features]
        return cls(
            vocabs.event_type,
            TimeInput(
                settings.time_buckets,
                timezone if settings.time_encodings else None,
                journey_so_far=settings.journey_so_far,
            ),
            tuple(column.fit(train, vocabs, settings) for column in columns),
        )

    @property
    def names(self) -> list[str]:
        """The columns' names: what is read of each event besides its type and time."""
        return [column.name for column in self.columns]

    def of_kind(self, kind: type[Column]) -> list[Column]:
        return [column for column in self.columns if isinstance(column, kind)]

    @property
    def embedding_sizes(self) -> tuple[int, ...]:
        """Every column's embedding tables, in order (`ModelConfig.feature_vocab_sizes`)."""
        return tuple(size for column in self.columns for size in column.embedding_sizes)

    @property
    def n_continuous(self) -> int:
        """Continuous inputs per event: the time's, then every column's."""
        return self.time.n_continuous + sum(column.n_continuous for column in self.columns)

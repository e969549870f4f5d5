"""Journeys Parquet -> tensors -> padded batches for `journeys.model.JourneyTransformer`.

- `encode_journeys` turns a journeys frame into flat int tensors (all events back to back)
  plus offsets, with Polars expressions only: no Python loop over journeys or events.
- `JourneyDataset` yields journey indices; `JourneyCollator` pads a batch of them to the
  batch's longest journey (right padding, id 0) in a few vectorised gathers.
- `LengthGroupedBatchSampler` sorts journeys by length inside large random buckets so that
  batches hold journeys of similar length and little compute goes to padding.
- `journeys.lightning_parts.JourneyDataModule` (Lightning) serves these loaders for train/val/test;
  this module itself does not import Lightning, so scoring starts fast.
- `model_config_from` sizes a `ModelConfig` from the `model` config section and the
  vocabularies (the model file itself knows nothing of the configuration).

Distributed training: the length-grouped batch sampler does not shard by itself. It groups
whatever index sampler it wraps, and under DDP that is a `DistributedSampler`: Lightning
injects one automatically (its default `use_distributed_sampler=True` re-instantiates this
`BatchSampler` subclass with `sampler=DistributedSampler(...)`, shuffling when the original
sampler was a `RandomSampler`, seeded by `seed_everything`'s PL_GLOBAL_SEED); with
`use_distributed_sampler=False` or without Lightning, pass one as `sampler` yourself. With
`group_by_length=False` the loader uses a plain `BatchSampler`, which Lightning handles the
same way. `DistributedSampler` pads every rank to the same number of journeys (repeating at
most world_size - 1), so every rank runs the same number of batches and DDP never waits on
a rank that ran out; evaluation metrics under DDP therefore count those few twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence, Sized
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import polars as pl
import torch
from torch import Tensor
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from journeys.config import Model
from journeys.errors import InputError
from journeys.model import ModelConfig
from journeys.vocab import PAD_ID, Vocabularies

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

# A length-grouping bucket holds this many batches: large enough that sorted batches are
# nearly uniform in length, small enough that batch composition still varies by epoch.
DEFAULT_BUCKET_BATCHES = 50


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


# (name, centre, scale) of asinh(value) over the train events, per numeric feature: asinh is
# log-like for prices and amounts, whose tails span orders of magnitude, and keeps zero and
# signs.
NumericScaling = tuple[tuple[str, float, float], ...]


# Continuous inputs per numeric feature, in this order: its value (asinh, scaled with train's
# statistics; 0 where missing), a flag where it is missing, its value against the journey's
# earlier values (asinh(value) minus their mean, same scale; 0 where missing or first), and
# that relative value carried forward to the events after it (the latest known; 0 before
# any). The third makes "a price above the user's usual" one input, not a mean the network
# must learn to take over the journey; the fourth puts it on every later event, the last
# included, so the model need not search the journey for the latest priced event. Models
# read the first `ContinuousInputs.numeric_inputs` of them (older ones: two or three).
NUMERIC_INPUTS = ("value", "missing", "relative", "carried")
# With `model.numeric_encoding: buckets` these two are embedded by their train-quantile
# bucket instead, as extra categorical features after the model's own (id 0: padding,
# 1: missing or no earlier value, then the buckets); missing needs no flag of its own.
BUCKETED_INPUTS = ("value", "relative")


@dataclass(frozen=True)
class ContinuousInputs:
    """The continuous inputs `encode_journeys` adds per event, in this order: the time
    encodings (when `timezone` is set: hours are read there), then `NUMERIC_INPUTS` for
    each numeric feature (`continuous_count` of them), the first `numeric_inputs` of them
    (fewer for models trained before the later ones existed). With `bucket_edges`
    (`numeric_bucket_edges`) the numbers are bucket ids instead (`BUCKETED_INPUTS`), not
    continuous inputs."""

    timezone: str | None = None
    numeric: NumericScaling = ()
    numeric_inputs: int = len(NUMERIC_INPUTS)
    bucket_edges: tuple[tuple[float, ...], ...] = ()

    @property
    def numeric_names(self) -> list[str]:
        return [name for name, _, _ in self.numeric]


def numeric_scaling(frame: pl.DataFrame, names: list[str]) -> NumericScaling:
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
    frame: pl.DataFrame, names: list[str], n_buckets: int
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


def continuous_count(
    time_encodings: bool,
    n_numeric: int,
    numeric_inputs: int = len(NUMERIC_INPUTS),
    buckets: bool = False,
) -> int:
    """How many continuous inputs a model reads per event (`ContinuousInputs`)."""
    if buckets:
        n_numeric = 0  # embedded as bucket ids instead
    return (len(TIME_ENCODINGS) if time_encodings else 0) + numeric_inputs * n_numeric


def relative_to_earlier(value: pl.Expr) -> pl.Expr:
    """Per event of a list: the value minus the mean of the earlier non-missing values of
    the list (null where missing or where none came before). Uses the past only, so a
    causal model's prefixes see what they would see alone."""
    seen = value.is_not_null().cast(pl.Float64)
    filled = value.fill_null(0.0)
    earlier = seen.cum_sum() - seen
    mean_before = (filled.cum_sum() - filled) / earlier
    return pl.when(value.is_not_null() & (earlier > 0)).then(value - mean_before)


def gap_seconds_expr(event_time: pl.Expr) -> pl.Expr:
    """List of event timestamps -> list of seconds since the previous event (0 for the first)."""
    return event_time.list.eval(pl.element().diff().dt.total_microseconds().fill_null(0) / 1e6)


def time_encoding_exprs(
    gap: pl.Expr, since_start: pl.Expr, time: pl.Expr, timezone: str
) -> list[pl.Expr]:
    """Per event: `TIME_ENCODINGS` from the seconds since the previous and the first event
    and the event's UTC time (read in `timezone` for the hour and weekday)."""
    local = time.dt.convert_time_zone(timezone)
    hour = (local.dt.hour() + local.dt.minute() / 60) * (2 * math.pi / 24)
    weekday = (local.dt.weekday() - 1) * (2 * math.pi / 7)
    return [
        ((gap.clip(lower_bound=0) + 1).log() / LOG_SECONDS_SCALE).alias("log_gap"),
        ((since_start.clip(lower_bound=0) + 1).log() / LOG_SECONDS_SCALE).alias("log_since_start"),
        hour.sin().alias("hour_sin"),
        hour.cos().alias("hour_cos"),
        weekday.sin().alias("weekday_sin"),
        weekday.cos().alias("weekday_cos"),
    ]


def time_bucket_expr(seconds: pl.Expr, n_time_buckets: int) -> pl.Expr:
    """Seconds since the previous event -> log-scaled bucket id in [1, n_time_buckets - 1].

    Id 0 is left for padding. Negative gaps (clock skew) count as 0.
    """
    growth = 2.0 ** (TIME_BUCKET_SPAN_DOUBLINGS / max(1, n_time_buckets - 2))
    scaled = 1.0 + seconds.cast(pl.Float64).clip(lower_bound=0.0) / TIME_BUCKET_UNIT_SECONDS
    bucket = 1 + (scaled.log(growth) + _LOG_EPSILON).floor()
    return bucket.clip(1, max(1, n_time_buckets - 1)).cast(pl.Int64)


def visit_bucket(settings: Model) -> int | None:
    """The time bucket of `model.visit_gap` (None when off): gaps in it or above open a visit."""
    seconds = settings.visit_gap_s
    if seconds is None:
        return None
    return int(pl.select(time_bucket_expr(pl.lit(seconds), settings.time_buckets)).item())


def model_config_from(
    settings: Model, vocabs: Vocabularies, max_len: int, n_numeric: int = 0
) -> ModelConfig:
    """The `ModelConfig` of the `model` config section, sized by the vocabularies.

    `max_len` is the longest journey the model will see (`journey.max_events`);
    `n_numeric` the number of numeric features (`data.numeric_features`).
    """
    feature_sizes = tuple(len(vocabs.by_column[name]) for name in vocabs.features)
    return model_config_from_sizes(
        settings, len(vocabs.event_type), feature_sizes, max_len, n_numeric
    )


def model_config_from_sizes(
    settings: Model,
    vocab_size: int,
    feature_vocab_sizes: tuple[int, ...],
    max_len: int,
    n_numeric: int = 0,
) -> ModelConfig:
    """The `ModelConfig` of the `model` config section with explicit vocabulary sizes."""
    buckets = settings.numeric_encoding == "buckets"
    if buckets:  # padding, missing, then the buckets (`BUCKETED_INPUTS`)
        bucket_vocab = settings.numeric_buckets + 2
        feature_vocab_sizes = (
            *feature_vocab_sizes,
            *(bucket_vocab,) * (len(BUCKETED_INPUTS) * n_numeric),
        )
    return ModelConfig(
        vocab_size=vocab_size,
        feature_vocab_sizes=feature_vocab_sizes,
        n_time_buckets=settings.time_buckets,
        d_model=settings.d_model,
        n_heads=settings.n_heads,
        n_layers=settings.n_layers,
        dropout=settings.dropout,
        attention_dropout=settings.attention_dropout,
        positional=settings.positional,
        position_origin=settings.resolved_position_origin,
        norm=settings.norm,
        pooling=settings.pooling,
        causal=settings.causal,
        max_len=max_len,
        visit_bucket=visit_bucket(settings),
        n_continuous=continuous_count(settings.time_encodings, n_numeric, buckets=buckets),
        wide=settings.wide,
        continuous_encoding=settings.continuous_encoding,
    )


@dataclass(frozen=True)
class EncodedJourneys:
    """All journeys' events back to back; journey i is events `offsets[i]:offsets[i + 1]`.

    Events are stored as int32 (half the memory of int64); batches come out as int64.
    """

    tokens: Tensor  # [N] event-type ids
    features: Tensor  # [F, N] feature ids, features in vocabulary order
    time_buckets: Tensor  # [N] time-since-previous-event buckets
    offsets: Tensor  # [n + 1] int64
    labels: Tensor  # [n] float32 (0 where the frame has no label)
    journey_ids: pl.Series | None  # [n] kept aside for joining scores back
    feature_names: tuple[str, ...] = ()
    continuous: Tensor | None = None  # [C, N] float32 (`ContinuousInputs`), None: none

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def lengths(self) -> Tensor:
        """Events per journey [n], int64."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def n_events(self) -> int:
        return self.tokens.numel()


def numeric_input_exprs(i: int, centre: float, scale: float) -> dict[str, pl.Expr]:
    """The `NUMERIC_INPUTS` of the i-th numeric feature, on the exploded events of
    `encode_journeys` (its value `n{i}`, relative value `r{i}` and that carried `l{i}`)."""
    return {
        "value": ((pl.col(f"n{i}").arcsinh() - centre) / scale).fill_null(0.0),
        "missing": pl.col(f"n{i}").is_null(),
        "relative": (pl.col(f"r{i}") / scale).fill_null(0.0),
        "carried": (pl.col(f"l{i}") / scale).fill_null(0.0),
    }


def encode_journeys(
    frame: pl.DataFrame,
    vocabs: Vocabularies,
    n_time_buckets: int,
    max_len: int | None = None,
    continuous: ContinuousInputs | None = None,
) -> EncodedJourneys:
    """Journeys frame (the ingest schema) -> `EncodedJourneys`, in the frame's row order.

    Unknown tokens and missing values map to id 1. With `max_len`, only the most recent
    `max_len` events of a journey are kept (as ingest does); time gaps are measured within
    the kept events, so the first kept event always gets bucket 1. With `continuous`,
    its inputs are computed too (`EncodedJourneys.continuous`, in its order).
    """
    features = vocabs.features
    sequences = ["event_type", *features]
    continuous = continuous or ContinuousInputs()
    zone, numeric = continuous.timezone, continuous.numeric_names
    needed = ["event_time", *sequences, *numeric]
    missing = [c for c in needed if c not in frame.columns]
    if missing:
        raise InputError(f"journeys frame lacks column(s) {missing}")

    def kept(column: str) -> pl.Expr:
        return pl.col(column).list.tail(max_len) if max_len else pl.col(column)

    # Renamed so that a feature cannot collide with our own column names.
    times = kept("event_time")
    lists = frame.select(
        *(kept(c).alias(f"s{i}") for i, c in enumerate(sequences)),
        times.alias("time"),
        *(kept(name).cast(pl.List(pl.Float64)).alias(f"n{i}") for i, name in enumerate(numeric)),
        # Per journey, repeated on each of its events by the explode: which, and its start.
        pl.int_range(pl.len()).alias("journey"),
        times.list.first().alias("start"),
    )
    bucketed = bool(continuous.bucket_edges)
    read = () if bucketed else NUMERIC_INPUTS[: continuous.numeric_inputs]
    if bucketed or "relative" in read:
        lists = lists.with_columns(
            pl.col(f"n{i}").list.eval(relative_to_earlier(pl.element().arcsinh())).alias(f"r{i}")
            for i in range(len(numeric))
        )
    if "carried" in read:
        lists = lists.with_columns(
            pl.col(f"r{i}").list.eval(pl.element().forward_fill()).alias(f"l{i}")
            for i in range(len(numeric))
        )
    list_columns = [c for c in lists.columns if c not in ("journey", "start")]
    lengths = lists.select(pl.col(c).list.len().fill_null(0).cast(pl.Int64) for c in list_columns)
    ragged = lengths.filter(
        pl.any_horizontal(pl.col(c) != pl.col("s0") for c in list_columns[1:])
    ).height
    if ragged:
        raise InputError(
            f"{ragged} journey(s) have event_time or feature lists of another length than "
            "event_type"
        )

    inputs = [
        *(
            time_encoding_exprs(pl.col("gap"), pl.col("since_start"), pl.col("time"), zone)
            if zone
            else []
        ),
        *(
            numeric_input_exprs(i, centre, scale)[name]
            for i, (_, centre, scale) in enumerate(() if bucketed else continuous.numeric)
            for name in read
        ),
    ]
    # Gaps on the flat events, not per list (`gap_seconds_expr`): 2x faster, same values.
    same_journey = pl.col("journey") == pl.col("journey").shift(1)
    time_diff = pl.col("time").diff().dt.total_microseconds().fill_null(0) / 1e6
    flat = (
        lists.explode(list_columns, keep_nulls=False, empty_as_null=False).with_columns(
            pl.when(same_journey).then(time_diff).otherwise(0.0).alias("gap"),
            ((pl.col("time") - pl.col("start")).dt.total_microseconds() / 1e6).alias("since_start"),
        )
    ).select(
        vocabs.event_type.ids(pl.col("s0")).cast(pl.Int32).alias("token"),
        *(
            vocabs.by_column[name].ids(pl.col(f"s{i + 1}")).cast(pl.Int32).alias(f"f{i}")
            for i, name in enumerate(features)
        ),
        time_bucket_expr(pl.col("gap"), n_time_buckets).cast(pl.Int32).alias("time_bucket"),
        # In `ContinuousInputs` order, under names of ours (a feature may be called "token").
        *(expr.cast(pl.Float32).alias(f"c{k}") for k, expr in enumerate(inputs)),
        *(
            column
            for i in range(len(numeric) if bucketed else 0)
            for column in (
                pl.col(f"n{i}").arcsinh().alias(f"bv{i}"),
                pl.col(f"r{i}").alias(f"br{i}"),
            )
        ),
    )
    n_events = flat.height
    continuous_tensor = None
    if inputs:
        values = flat.select(f"c{k}" for k in range(len(inputs))).to_numpy(writable=True)
        continuous_tensor = torch.from_numpy(np.ascontiguousarray(values.T))
    if features:
        # Fortran order [N, F] transposed is a C-contiguous [F, N]: no copy.
        columns = flat.select(f"f{i}" for i in range(len(features)))
        feature_tensor = torch.from_numpy(np.ascontiguousarray(columns.to_numpy(writable=True).T))
    else:
        feature_tensor = torch.zeros(0, n_events, dtype=torch.int32)
    if bucketed:
        sources = [f"{kind}{i}" for i in range(len(numeric)) for kind in ("bv", "br")]
        ids = [
            bucket_ids(flat.get_column(source).to_numpy(), edges)
            for source, edges in zip(sources, continuous.bucket_edges, strict=True)
        ]
        feature_tensor = torch.cat([feature_tensor, torch.from_numpy(np.stack(ids))])

    journey_lengths = _to_torch(lengths.get_column("s0"))
    offsets = torch.zeros(len(journey_lengths) + 1, dtype=torch.int64)
    torch.cumsum(journey_lengths, dim=0, out=offsets[1:])

    if "label" in frame.columns:
        label_tensor = _to_torch(frame.get_column("label").cast(pl.Float32).fill_null(0.0))
    else:
        label_tensor = torch.zeros(frame.height, dtype=torch.float32)

    return EncodedJourneys(
        tokens=_to_torch(flat.get_column("token")),
        features=feature_tensor,
        time_buckets=_to_torch(flat.get_column("time_bucket")),
        offsets=offsets,
        labels=label_tensor,
        journey_ids=frame.get_column("journey_id") if "journey_id" in frame.columns else None,
        feature_names=tuple(features),
        continuous=continuous_tensor,
    )


@dataclass(frozen=True)
class JourneyEncoder:
    """What turns a journeys frame (ingest schema) into the model's input: the train
    vocabularies, the time-bucket resolution, the most recent events read (`max_len`) and
    the continuous inputs with train's numeric scaling. Fitted on the train split once
    (`fit`), stored with the model (`journeys.trained_model`), applied unchanged when
    scoring: training and scoring encode through this one object."""

    vocabs: Vocabularies
    n_time_buckets: int
    max_len: int
    inputs: ContinuousInputs = ContinuousInputs()

    @classmethod
    def fit(
        cls,
        train: pl.DataFrame,
        vocabs: Vocabularies,
        settings: Model,
        *,
        max_len: int,
        timezone: str,
        numeric_features: Sequence[str] = (),
    ) -> JourneyEncoder:
        """Fit on the train split: numeric scaling (and bucket edges with
        `model.numeric_encoding: buckets`); time encodings read in `timezone` when
        `model.time_encodings` is on."""
        names = list(numeric_features)
        edges = (
            numeric_bucket_edges(train, names, settings.numeric_buckets)
            if settings.numeric_encoding == "buckets"
            else ()
        )
        inputs = ContinuousInputs(
            timezone if settings.time_encodings else None,
            numeric_scaling(train, names),
            bucket_edges=edges,
        )
        return cls(vocabs, settings.time_buckets, max_len, inputs)

    @property
    def features(self) -> list[str]:
        """The categorical features the model reads, in vocabulary order."""
        return self.vocabs.features

    @property
    def numeric_features(self) -> list[str]:
        return self.inputs.numeric_names

    @property
    def event_columns(self) -> list[str]:
        """The per-event columns read besides event types and times (as
        `config.Data.event_columns`): features, then numbers."""
        return [*self.features, *self.numeric_features]

    def encode(self, frame: pl.DataFrame) -> EncodedJourneys:
        """`frame` as the model's input, in the frame's row order."""
        return encode_journeys(frame, self.vocabs, self.n_time_buckets, self.max_len, self.inputs)


def bucket_ids(values: np.ndarray, edges: tuple[float, ...]) -> np.ndarray:
    """int32 bucket id per value: 1 where missing (NaN), else 2 + the edges at or below it."""
    ids = np.searchsorted(np.asarray(edges, dtype=np.float64), values, side="right") + 2
    return np.where(np.isnan(values), 1, ids).astype(np.int32)


def _to_torch(series: pl.Series) -> Tensor:
    # Polars hands out read-only buffers; torch wants to own writable memory.
    return torch.from_numpy(series.to_numpy(writable=True))


class JourneyBatch(NamedTuple):
    """A padded batch; a NamedTuple so Lightning and `pin_memory` move it as a whole."""

    tokens: Tensor  # [B, L] int64
    features: Tensor  # [B, F, L] int64
    time_buckets: Tensor  # [B, L] int64
    mask: Tensor  # [B, L] bool, True on real events (right padding)
    labels: Tensor  # [B] float32
    index: Tensor  # [B] int64, positions in the EncodedJourneys (e.g. for journey ids)
    continuous: Tensor | None = None  # [B, C, L] float32 (`ContinuousInputs`), None: none


class JourneyDataset(Dataset[int]):
    """Yields journey indices (of `subset`, or of all journeys); `JourneyCollator` does the
    gathering for a whole batch."""

    def __init__(self, encoded: EncodedJourneys, subset: Tensor | None = None) -> None:
        self.encoded = encoded
        self.subset = subset

    def __len__(self) -> int:
        return len(self.encoded) if self.subset is None else len(self.subset)

    def __getitem__(self, index: int) -> int:
        return int(index) if self.subset is None else int(self.subset[index])

    def __getitems__(self, indices: Sequence[int]) -> list[int]:
        # The DataLoader hands a whole batch of indices over at once: no per-item calls.
        if self.subset is None:
            return list(indices)
        return self.subset[torch.as_tensor(indices, dtype=torch.int64)].tolist()

    @property
    def lengths(self) -> Tensor:
        """Events per item, in item order."""
        lengths = self.encoded.lengths
        return lengths if self.subset is None else lengths[self.subset]


def fraction_of_negatives(
    positives: int, negatives: int, positive_share: float | None, min_epoch_journeys: int = 0
) -> float:
    """The share of negatives to draw each epoch so that positives make up `positive_share`,
    or more, so that an epoch holds at least `min_epoch_journeys` (all, if there are fewer).

    Why: with a few % conversions most of each batch's gradient is noise from negatives
    that teach little; drawing fewer of them (afresh each epoch, so none is wasted) gives
    more steps on the positives per unit of compute (He et al. 2014, "Practical lessons from
    predicting clicks on ads at Facebook"). On small data compute is cheap and the share
    alone would leave a run too few steps to learn: the floor keeps more negatives there.
    1.0 when off or when positives are that common.
    """
    if positive_share is None or negatives == 0:
        return 1.0
    by_share = positives * (1 - positive_share) / (negatives * positive_share)
    by_floor = (min_epoch_journeys - positives) / negatives
    return min(1.0, max(by_share, by_floor))


def sample_negatives(labels: Tensor, fraction: float, seed: int, epoch: int) -> Tensor:
    """Indices of every positive journey and of `fraction` of the negatives, sorted.

    Which negatives depends only on (seed, epoch), so every DDP rank draws the same ones
    and each epoch sees others. Their number is fixed (rounded), so every epoch has as many
    steps as the learning-rate schedule expects.
    """
    positives = torch.nonzero(labels > 0).flatten()
    negatives = torch.nonzero(labels <= 0).flatten()
    keep = round(fraction * len(negatives))
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    drawn = negatives[torch.randperm(len(negatives), generator=generator)[:keep]]
    return torch.cat([positives, drawn]).sort().values


class JourneyCollator:
    """Journey indices -> `JourneyBatch` padded to the batch's longest journey."""

    def __init__(self, encoded: EncodedJourneys) -> None:
        self.encoded = encoded

    def __call__(self, indices: Sequence[int]) -> JourneyBatch:
        encoded = self.encoded
        continuous = None
        index = torch.as_tensor(indices, dtype=torch.int64)
        starts = encoded.offsets[index]
        lengths = encoded.offsets[index + 1] - starts
        width = max(int(lengths.max()) if len(index) else 0, 1)
        positions = torch.arange(width)
        mask = positions[None, :] < lengths[:, None]
        if encoded.n_events:
            # Padded slots read event 0 and are zeroed below: one gather per tensor.
            flat = torch.where(mask, starts[:, None] + positions[None, :], 0)
            tokens = encoded.tokens[flat].long().masked_fill_(~mask, PAD_ID)
            time_buckets = encoded.time_buckets[flat].long().masked_fill_(~mask, PAD_ID)
            features = encoded.features[:, flat].long().permute(1, 0, 2)
            features = features.masked_fill(~mask[:, None, :], PAD_ID).contiguous()
            if encoded.continuous is not None:
                continuous = encoded.continuous[:, flat].permute(1, 0, 2)
                continuous = continuous.masked_fill(~mask[:, None, :], 0.0).contiguous()
        else:
            tokens = torch.zeros(mask.shape, dtype=torch.int64)
            time_buckets = torch.zeros(mask.shape, dtype=torch.int64)
            features = torch.zeros(len(index), encoded.features.size(0), width, dtype=torch.int64)
            if encoded.continuous is not None:
                continuous = torch.zeros(len(index), encoded.continuous.size(0), width)
        return JourneyBatch(
            tokens, features, time_buckets, mask, encoded.labels[index], index, continuous
        )


class EpochRandomSampler(RandomSampler):
    """A random permutation that depends only on (seed, epoch), like `DistributedSampler`.

    A `RandomSampler` subclass so that Lightning sees the loader as shuffled and, under DDP,
    replaces it with a shuffling `DistributedSampler`.
    """

    def __init__(self, data_source: Sized, seed: int = 0) -> None:
        super().__init__(data_source)
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        yield from torch.randperm(len(self.data_source), generator=generator).tolist()


class LengthGroupedBatchSampler(BatchSampler):
    """Batches of journeys of similar length, in an order fixed by (seed, epoch).

    The wrapped `sampler`'s index stream is cut into buckets of `bucket_batches` batches;
    each bucket is sorted by length (longest first) and cut into batches; with `shuffle`
    the batches of all buckets are then shuffled. Without `shuffle` (evaluation) the whole
    stream is one bucket, so padding is minimal and the longest batch comes first (a batch
    that does not fit in memory fails at once).

    Sharding across DDP ranks comes from the wrapped sampler (a `DistributedSampler`), see
    the module docstring. The epoch is taken from the wrapped sampler when it has one,
    because Lightning calls `set_epoch` on `batch_sampler.sampler`, not on the batch sampler.
    """

    def __init__(
        self,
        sampler: Sampler[int],
        batch_size: int,
        drop_last: bool = False,
        *,
        lengths: Tensor,
        shuffle: bool = True,
        seed: int = 0,
        bucket_batches: int = DEFAULT_BUCKET_BATCHES,
    ) -> None:
        super().__init__(sampler, batch_size, drop_last)
        if bucket_batches < 1:
            raise ValueError("bucket_batches must be at least 1")
        self.lengths = torch.as_tensor(lengths, dtype=torch.int64)
        self.shuffle = shuffle
        self.seed = seed
        self.bucket_batches = bucket_batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)

    @property
    def current_epoch(self) -> int:
        return int(getattr(self.sampler, "epoch", self.epoch))

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        order = torch.as_tensor(list(self.sampler), dtype=torch.int64)
        if self.drop_last:
            # Drop the random tail before sorting, so no particular length is dropped.
            order = order[: len(order) // self.batch_size * self.batch_size]
        if not len(order):
            return
        lengths = self.lengths[order]
        if self.shuffle:
            bucket = torch.arange(len(order)) // (self.batch_size * self.bucket_batches)
        else:
            bucket = torch.zeros(len(order), dtype=torch.int64)
        longest = int(lengths.max())
        # Sort by bucket, then longest first; stable, so ties keep the sampler's order.
        key = bucket * (longest + 1) + (longest - lengths)
        order = order[torch.sort(key, stable=True).indices]
        batches = order.split(self.batch_size)
        if self.shuffle:
            # A different stream from the sampler's (seed + epoch) permutation.
            generator = torch.Generator().manual_seed(
                (self.seed + 1) * 1_000_003 + self.current_epoch
            )
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator)]
        for batch in batches:
            yield batch.tolist()


def make_dataloader(
    encoded: EncodedJourneys,
    batch_size: int,
    *,
    shuffle: bool = False,
    group_by_length: bool = True,
    seed: int = 0,
    num_workers: int = 0,
    drop_last: bool = False,
    bucket_batches: int = DEFAULT_BUCKET_BATCHES,
    subset: Tensor | None = None,
) -> DataLoader:
    """A DataLoader of `JourneyBatch`es over `encoded` (only the journeys in `subset`, if given).

    `group_by_length=False` with `shuffle=False` keeps the journeys' order (scoring);
    otherwise use `batch.index` to map rows back to journeys.
    """
    dataset = JourneyDataset(encoded, subset)
    # RandomSampler refuses an empty dataset; an empty loader needs no shuffling anyway.
    sampler: Sampler[int] = (
        EpochRandomSampler(dataset, seed)
        if shuffle and len(dataset)
        else SequentialSampler(dataset)
    )
    if group_by_length:
        batch_sampler: BatchSampler = LengthGroupedBatchSampler(
            sampler,
            batch_size,
            drop_last,
            lengths=dataset.lengths,
            shuffle=shuffle,
            seed=seed,
            bucket_batches=bucket_batches,
        )
    else:
        batch_sampler = BatchSampler(sampler, batch_size, drop_last)
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=JourneyCollator(encoded),
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
    )

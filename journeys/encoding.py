"""Journeys Parquet -> tensors -> padded batches for `journeys.model.JourneyTransformer`.

- `encode_journeys` turns a journeys frame into flat int tensors (all events back to back)
  plus offsets, with Polars expressions only: no Python loop over journeys or events. What
  it reads of each event, and how, comes from `journeys.inputs.EventInputs` alone.
- `JourneyEncoder` is those inputs fitted on the train split and the most recent events
  read: training, scoring and serving encode through it, and `model_config_from` sizes a
  `ModelConfig` from it (the model file itself knows nothing of the configuration).
- `JourneyDataset` yields journey indices; `JourneyCollator` pads a batch of them to the
  batch's longest journey (right padding, id 0) in a few vectorised gathers.
- `LengthGroupedBatchSampler` sorts journeys by length inside large random buckets so that
  batches hold journeys of similar length and little compute goes to padding.
- `journeys.lightning_parts.JourneyDataModule` (Lightning) serves these loaders for train/val/test;
  this module itself does not import Lightning, so scoring starts fast.

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
from journeys.inputs import (
    CategoricalInput,
    EventInput,
    EventInputs,
    NumericInput,
    time_bucket_expr,
)
from journeys.model import ModelConfig
from journeys.vocab import PAD_ID, Vocabularies

# A length-grouping bucket holds this many batches: large enough that sorted batches are
# nearly uniform in length, small enough that batch composition still varies by epoch.
DEFAULT_BUCKET_BATCHES = 50


def gap_seconds_expr(event_time: pl.Expr) -> pl.Expr:
    """List of event timestamps -> list of seconds since the previous event (0 for the first)."""
    return event_time.list.eval(pl.element().diff().dt.total_microseconds().fill_null(0) / 1e6)


def visit_bucket(settings: Model, n_time_buckets: int) -> int | None:
    """The time bucket of `model.visit_gap` (None when off) among `n_time_buckets`: gaps in
    it or above open a visit."""
    seconds = settings.visit_gap_s
    if seconds is None:
        return None
    return int(pl.select(time_bucket_expr(pl.lit(seconds), n_time_buckets)).item())


def model_config_from(settings: Model, encoder: JourneyEncoder) -> ModelConfig:
    """The `ModelConfig` of the `model` config section, sized by the fitted `encoder` alone:
    its event types, every input's embedding tables and continuous inputs, its time buckets
    and the most recent events it reads (`max_len`). The settings give the architecture."""
    inputs = encoder.inputs
    return model_config_from_sizes(
        settings,
        vocab_size=len(inputs.event_type),
        feature_vocab_sizes=inputs.embedding_sizes,
        n_time_buckets=inputs.time.n_buckets,
        n_continuous=inputs.n_continuous,
        max_len=encoder.max_len,
    )


def model_config_from_sizes(
    settings: Model,
    *,
    vocab_size: int,
    feature_vocab_sizes: tuple[int, ...] = (),
    n_time_buckets: int,
    n_continuous: int,
    max_len: int,
) -> ModelConfig:
    """The `ModelConfig` of the `model` config section with every input size given: for
    models of made-up inputs (benchmarks, tests); `model_config_from` reads them from an
    encoder."""
    return ModelConfig(
        vocab_size=vocab_size,
        feature_vocab_sizes=feature_vocab_sizes,
        n_time_buckets=n_time_buckets,
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
        visit_bucket=visit_bucket(settings, n_time_buckets),
        n_continuous=n_continuous,
        wide=settings.wide,
        continuous_encoding=settings.continuous_encoding,
        continuous_bins=settings.continuous_bins,
    )


@dataclass(frozen=True)
class EncodedJourneys:
    """All journeys' events back to back; journey i is events `offsets[i]:offsets[i + 1]`.

    Events are stored as int32 (half the memory of int64); batches come out as int64.
    """

    tokens: Tensor  # [N] event-type ids
    features: Tensor  # [F, N] ids, one row per embedding table of the inputs, in their order
    time_buckets: Tensor  # [N] time-since-previous-event buckets
    offsets: Tensor  # [n + 1] int64
    labels: Tensor  # [n] float32 (0 where the frame has no label)
    journey_ids: pl.Series | None  # [n] kept aside for joining scores back
    feature_names: tuple[str, ...] = ()  # the input each row of `features` embeds
    continuous: Tensor | None = None  # [C, N] float32 (`EventInputs.n_continuous`), None: none

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def lengths(self) -> Tensor:
        """Events per journey [n], int64."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def n_events(self) -> int:
        return self.tokens.numel()


def encode_journeys(
    frame: pl.DataFrame, inputs: EventInputs, max_len: int | None = None
) -> EncodedJourneys:
    """Journeys frame (the ingest schema) -> `EncodedJourneys`, in the frame's row order.

    Each event's type, time and `inputs.columns`, as `inputs` describes them: ids of the
    event type and of each input's embedding tables (unknown tokens and missing values map
    to id 1), the time bucket, and the time's and the inputs' continuous inputs, in their
    order. With `max_len`, only the most recent `max_len` events of a journey are kept (as
    ingest does); time gaps are measured within the kept events, so the first kept event
    always gets bucket 1.
    """
    columns = inputs.columns
    needed = ["event_time", "event_type", *inputs.names]
    missing = [c for c in needed if c not in frame.columns]
    if missing:
        raise InputError(f"journeys frame lacks column(s) {missing}")

    def kept(column: str) -> pl.Expr:
        return pl.col(column).list.tail(max_len) if max_len else pl.col(column)

    # Renamed so that an input cannot collide with our own column names.
    keyed = [(f"i{k}", column) for k, column in enumerate(columns)]
    steps = [column.lists(kept(column.name), key) for key, column in keyed]
    times = kept("event_time")
    lists = frame.select(
        kept("event_type").alias("s0"),
        *(expr for step in steps for expr in step[0]),
        times.alias("time"),
        # Per journey, repeated on each of its events by the explode: which, and its start.
        pl.int_range(pl.len()).alias("journey"),
        times.list.first().alias("start"),
    )
    for depth in range(1, max((len(step) for step in steps), default=1)):
        lists = lists.with_columns(
            expr for step in steps if len(step) > depth for expr in step[depth]
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

    ids = [expr for key, column in keyed for expr in column.ids(key)]
    continuous = [
        *inputs.time.continuous(
            pl.col("gap"), pl.col("since_start"), pl.col("time"), "journey", "s0"
        ),
        *(expr for key, column in keyed for expr in column.continuous(key)),
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
        inputs.event_type.ids(pl.col("s0")).cast(pl.Int32).alias("token"),
        *(expr.cast(pl.Int32).alias(f"f{j}") for j, expr in enumerate(ids)),
        inputs.time.bucket(pl.col("gap")).cast(pl.Int32).alias("time_bucket"),
        *(expr.cast(pl.Float32).alias(f"c{k}") for k, expr in enumerate(continuous)),
    )
    n_events = flat.height
    continuous_tensor = None
    if continuous:
        values = flat.select(f"c{k}" for k in range(len(continuous))).to_numpy(writable=True)
        continuous_tensor = torch.from_numpy(np.ascontiguousarray(values.T))
    if ids:
        # Fortran order [N, F] transposed is a C-contiguous [F, N]: no copy.
        table_ids = flat.select(f"f{j}" for j in range(len(ids)))
        feature_tensor = torch.from_numpy(np.ascontiguousarray(table_ids.to_numpy(writable=True).T))
    else:
        feature_tensor = torch.zeros(0, n_events, dtype=torch.int32)

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
        feature_names=tuple(c.name for c in columns for _ in c.embedding_sizes),
        continuous=continuous_tensor,
    )


@dataclass(frozen=True)
class JourneyEncoder:
    """What turns a journeys frame (ingest schema) into the model's input: the event inputs
    fitted on train (`journeys.inputs.EventInputs`: the vocabularies, the time, each
    numeric feature's scaling) and the most recent events read (`max_len`). Fitted on the
    train split once (`fit`), stored with the model (`journeys.trained_model`), applied
    unchanged when scoring: training and scoring encode through this one object, and the
    model is sized from it (`model_config_from`)."""

    inputs: EventInputs
    max_len: int
    # `vocab.min_count` of the vocabularies, kept with them in the model's files.
    vocab_min_count: int = 1

    @classmethod
    def fit(
        cls,
        train: pl.DataFrame,
        vocabs: Vocabularies,
        settings: Model,
        *,
        max_len: int,
        timezone: str,
        columns: Sequence[EventInput] | None = None,
    ) -> JourneyEncoder:
        """Fit `columns` (default: the vocabularies' features; `journeys.inputs.columns_of`
        gives a configuration's) on the train split: `train`'s journeys and the train
        `vocabs` (`EventInputs.fit`)."""
        inputs = EventInputs.fit(train, vocabs, settings, timezone=timezone, columns=columns)
        return cls(inputs, max_len, vocabs.min_count)

    @property
    def vocabs(self) -> Vocabularies:
        """The train vocabularies of the event type and the categorical features."""
        by_column = {"event_type": self.inputs.event_type}
        by_column |= {c.name: c.vocabulary for c in self.inputs.of_kind(CategoricalInput)}
        return Vocabularies(by_column=by_column, min_count=self.vocab_min_count)

    @property
    def features(self) -> list[str]:
        """The categorical features the model reads, in order."""
        return [column.name for column in self.inputs.of_kind(CategoricalInput)]

    @property
    def numeric_features(self) -> list[str]:
        return [column.name for column in self.inputs.of_kind(NumericInput)]

    @property
    def event_columns(self) -> list[str]:
        """The per-event columns read besides event types and times (as
        `config.Data.event_columns`): features, then numbers."""
        return self.inputs.names

    def encode(self, frame: pl.DataFrame) -> EncodedJourneys:
        """`frame` as the model's input, in the frame's row order."""
        return encode_journeys(frame, self.inputs, self.max_len)


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

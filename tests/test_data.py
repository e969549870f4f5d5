"""Journeys -> tensors: encoding, time buckets, padding, splits, length-grouped sampling."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import polars as pl
import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, SequentialSampler

from journeys.encoding import (
    EpochRandomSampler,
    JourneyCollator,
    LengthGroupedBatchSampler,
    encode_journeys,
    fraction_of_negatives,
    make_dataloader,
    sample_negatives,
)
from journeys.errors import InputError
from journeys.inputs import CategoricalInput, EventInputs, TimeInput, time_bucket_expr
from journeys.lightning_parts import JourneyDataModule
from journeys.vocab import Vocabularies, Vocabulary

T0 = datetime(2026, 1, 1, tzinfo=UTC)
SCHEMA = {
    "journey_id": pl.String,
    "user_id": pl.String,
    "start_time": pl.Datetime("us", "UTC"),
    "end_time": pl.Datetime("us", "UTC"),
    "n_events": pl.Int32,
    "n_events_total": pl.Int32,
    "label": pl.Int8,
    "censored": pl.Boolean,
    "split": pl.String,
    "event_type": pl.List(pl.String),
    "event_time": pl.List(pl.Datetime("us", "UTC")),
    "channel": pl.List(pl.String),
    "device": pl.List(pl.String),
}
VOCABS = Vocabularies(
    by_column={
        "event_type": Vocabulary(("<pad>", "<unk>", "view", "click")),
        "channel": Vocabulary(("<pad>", "<unk>", "search", "social")),
        "device": Vocabulary(("<pad>", "<unk>", "mobile", "desktop")),
    }
)


def described(timezone: str | None = None) -> EventInputs:
    """The event inputs of `VOCABS` (32 time buckets; time encodings read in `timezone`)."""
    features = (CategoricalInput(name, VOCABS.by_column[name]) for name in VOCABS.features)
    return EventInputs(VOCABS.event_type, TimeInput(32, timezone), tuple(features))


def journey(jid: str, events: list[tuple[str, float, str, str]], label: int, split: str) -> dict:
    """events: (event_type, seconds after T0, channel, device)."""
    times = [T0 + timedelta(seconds=s) for _, s, _, _ in events]
    return {
        "journey_id": jid,
        "user_id": f"user-{jid}",
        "start_time": times[0],
        "end_time": times[-1],
        "n_events": len(events),
        "n_events_total": len(events),
        "label": label,
        "censored": split == "none",
        "split": split,
        "event_type": [e for e, _, _, _ in events],
        "event_time": times,
        "channel": [c for _, _, c, _ in events],
        "device": [d for _, _, _, d in events],
    }


WEEK = 7 * 24 * 3600
ROWS = [
    journey(
        "j1",
        [
            ("view", 0, "search", "mobile"),
            ("click", 1, "social", "mobile"),
            ("banana", 3601, "search", "desktop"),
        ],
        1,
        "train",
    ),
    journey("j2", [("click", 0, "social", "tv")], 0, "train"),
    journey("j3", [("view", 0, "search", "mobile"), ("view", WEEK, "search", "mobile")], 0, "val"),
    journey(
        "j4",
        [
            ("click", 0, "social", "desktop"),
            ("view", 0.5, "social", "desktop"),
            ("click", 2.5, "search", "mobile"),
            ("view", 9.5, "search", "mobile"),
        ],
        1,
        "test",
    ),
    journey("j5", [("view", 0, "search", "mobile"), ("click", 60, "search", "mobile")], 0, "none"),
]


@pytest.fixture
def frame() -> pl.DataFrame:
    return pl.DataFrame(ROWS, schema=SCHEMA)


def test_encode_gives_flat_ids_offsets_and_buckets(frame: pl.DataFrame) -> None:
    encoded = encode_journeys(frame, described())
    assert len(encoded) == 5
    assert encoded.offsets.tolist() == [0, 3, 4, 6, 10, 12]
    assert encoded.lengths.tolist() == [3, 1, 2, 4, 2]
    # banana is not in the vocabulary: unknown id 1
    assert encoded.tokens.tolist() == [2, 3, 1, 3, 2, 2, 3, 2, 3, 2, 2, 3]
    assert encoded.features.shape == (2, 12)
    assert encoded.features[0].tolist() == [2, 3, 2, 3, 2, 2, 3, 3, 2, 2, 2, 2]
    assert encoded.features[1].tolist() == [2, 2, 3, 1, 2, 2, 3, 3, 2, 2, 2, 2]  # tv -> 1
    # gaps 0,1,3600 | 0 | 0,7d | 0,0.5,2,7 | 0,60 seconds
    assert encoded.time_buckets.tolist() == [1, 2, 12, 1, 1, 20, 1, 1, 2, 4, 1, 6]
    assert encoded.labels.tolist() == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert encoded.journey_ids.to_list() == ["j1", "j2", "j3", "j4", "j5"]
    assert encoded.feature_names == ("channel", "device")


def test_time_buckets_are_log_scaled_and_clipped() -> None:
    seconds = pl.Series([0.0, 0.999, 1.0, 2.9, 3.0, 7.0, 15.0, 1023.0, 1e12, -5.0])
    buckets = pl.select(time_bucket_expr(pl.lit(seconds), 32)).to_series().to_list()
    assert buckets == [1, 1, 2, 2, 3, 4, 5, 11, 31, 1]
    # More buckets, finer steps over the same span: 62 buckets step by sqrt(2).
    fine = pl.select(time_bucket_expr(pl.lit(seconds), 62)).to_series().to_list()
    assert fine == [1, 2, 3, 4, 5, 7, 9, 21, 61, 1]
    # Fewer, coarser: 8 buckets step by 2^5 (bucket 2 from 31 s, 3 from 1023 s, ...).
    small = pl.select(time_bucket_expr(pl.lit(seconds), 8)).to_series().to_list()
    assert small == [1, 1, 1, 1, 1, 1, 1, 3, 7, 1]


def test_max_len_keeps_the_most_recent_events(frame: pl.DataFrame) -> None:
    encoded = encode_journeys(frame, described(), max_len=2)
    assert encoded.lengths.tolist() == [2, 1, 2, 2, 2]
    assert encoded.tokens[:2].tolist() == [3, 1]  # j1's click and banana
    assert encoded.time_buckets[:2].tolist() == [1, 12]  # the first kept event starts at 0


def test_bad_frames_are_refused(frame: pl.DataFrame) -> None:
    with pytest.raises(InputError, match="device"):
        encode_journeys(frame.drop("device"), described())
    ragged = frame.with_columns(pl.col("channel").list.head(1))
    with pytest.raises(InputError, match="4 journey"):
        encode_journeys(ragged, described())


def test_collate_pads_to_the_longest_journey_in_the_batch(frame: pl.DataFrame) -> None:
    encoded = encode_journeys(frame, described())
    batch = JourneyCollator(encoded)([1, 2])
    assert batch.tokens.tolist() == [[3, 0], [2, 2]]
    assert batch.mask.tolist() == [[True, False], [True, True]]
    assert batch.time_buckets.tolist() == [[1, 0], [1, 20]]
    assert batch.features.shape == (2, 2, 2)
    assert batch.features[0].tolist() == [[3, 0], [1, 0]]
    assert batch.labels.tolist() == [0.0, 0.0]
    assert batch.index.tolist() == [1, 2]
    assert batch.tokens.dtype == batch.features.dtype == torch.int64

    wide = JourneyCollator(encoded)([3, 1, 0])
    assert wide.tokens.shape == (3, 4)
    assert wide.mask.sum(dim=1).tolist() == [4, 1, 3]
    assert wide.tokens[~wide.mask].abs().sum() == 0
    assert wide.features[~wide.mask[:, None, :].expand_as(wide.features)].abs().sum() == 0


def test_datamodule_excludes_censored_journeys_from_splits(tmp_path, frame) -> None:
    # two files: the module reads every *.parquet in the folder
    frame.head(3).write_parquet(tmp_path / "journeys.parquet")
    frame.tail(2).write_parquet(tmp_path / "journeys-more.parquet")
    VOCABS.save(tmp_path)
    module = JourneyDataModule(tmp_path, max_len=64, batch_size=2, seed=1)
    module.setup("fit")
    assert {s: sorted(e.journey_ids.to_list()) for s, e in module.splits.items()} == {
        "train": ["j1", "j2"],
        "val": ["j3"],
        "test": ["j4"],
    }
    seen = [
        i
        for loader in (module.train_dataloader(), module.val_dataloader(), module.test_dataloader())
        for batch in loader
        for i in loader.dataset.encoded.journey_ids[batch.index.numpy()].to_list()
    ]
    assert sorted(seen) == ["j1", "j2", "j3", "j4"]  # the censored j5 in none of them

    # scoring's loader keeps any frame's order, the censored journey included
    in_order = make_dataloader(module.encoder.encode(frame.reverse()), 2, group_by_length=False)
    index = torch.cat([batch.index for batch in in_order])
    assert index.tolist() == [0, 1, 2, 3, 4]
    assert in_order.dataset.encoded.journey_ids.to_list() == ["j5", "j4", "j3", "j2", "j1"]


def lengths_of(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 65, (n,), generator=torch.Generator().manual_seed(seed))


def grouped(lengths: torch.Tensor, sampler, batch_size: int = 16, **kwargs):
    return LengthGroupedBatchSampler(
        sampler,
        batch_size,
        lengths=lengths,
        bucket_batches=kwargs.pop("bucket_batches", 8),
        **kwargs,
    )


def test_length_grouped_sampler_yields_each_index_once_per_epoch() -> None:
    lengths = lengths_of(1000)
    sampler = grouped(lengths, EpochRandomSampler(range(1000), seed=3), seed=3)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) == 63
        flat = [i for batch in batches for i in batch]
        assert sorted(flat) == list(range(1000))
        epochs.append(flat)
    assert epochs[0] != epochs[1] != epochs[2]
    sampler.set_epoch(1)
    assert [i for batch in sampler for i in batch] == epochs[1]  # deterministic

    # little padding: grouped batches pad far less than the same batches in random order
    def padding(batches: list[list[int]]) -> float:
        widths = [int(lengths[b].max()) * len(b) for b in batches]
        return 1 - sum(int(lengths[b].sum()) for b in batches) / sum(widths)

    shuffled = [list(range(i, min(i + 16, 1000))) for i in range(0, 1000, 16)]
    assert padding(list(sampler)) < 0.2 < 0.4 < padding(shuffled)


def test_evaluation_batches_are_sorted_longest_first() -> None:
    lengths = lengths_of(100)
    batches = list(grouped(lengths, SequentialSampler(range(100)), batch_size=10, shuffle=False))
    flat = [i for batch in batches for i in batch]
    assert sorted(flat) == list(range(100))
    assert lengths[flat].tolist() == sorted(lengths.tolist(), reverse=True)


@pytest.mark.parametrize("n", [1000, 1001])
def test_length_grouped_sampler_shards_across_ranks(n: int) -> None:
    lengths = lengths_of(n)
    shards = []
    for rank in range(2):
        inner = DistributedSampler(range(n), num_replicas=2, rank=rank, shuffle=True, seed=5)
        sampler = grouped(lengths, inner)
        sampler.set_epoch(2)
        shards.append([i for batch in sampler for i in batch])
        assert len(list(sampler)) == len(sampler)
    assert len(shards[0]) == len(shards[1])  # same number of steps on every rank
    assert set(shards[0]) | set(shards[1]) == set(range(n))
    if n % 2 == 0:
        assert not set(shards[0]) & set(shards[1])
    else:  # DistributedSampler repeats one journey to even the ranks out
        assert len(set(shards[0]) & set(shards[1])) == 1


def test_lightning_injects_a_distributed_sampler_into_the_grouped_sampler(frame) -> None:
    """What Lightning does under DDP (`use_distributed_sampler=True`), via its own helpers."""
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _is_dataloader_shuffled, _update_dataloader

    encoded = encode_journeys(pl.concat([frame] * 20), described())
    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        train = make_dataloader(encoded, 8, shuffle=True, seed=0)
        val = make_dataloader(encoded, 8, shuffle=False)
    assert _is_dataloader_shuffled(train)
    assert not _is_dataloader_shuffled(val)

    shards = []
    for rank in range(2):
        inner = DistributedSampler(train.dataset, num_replicas=2, rank=rank, shuffle=True)
        loader = _update_dataloader(train, inner, mode=RunningStage.TRAINING)
        assert isinstance(loader.batch_sampler, LengthGroupedBatchSampler)
        assert loader.batch_sampler.sampler is inner
        shards.append(torch.cat([batch.index for batch in loader]).tolist())
    assert sorted(shards[0] + shards[1]) == list(range(100))


def test_negative_fraction_gives_positives_the_configured_share() -> None:
    # 4% conversions, a quarter wanted: one negative in eight (each epoch 40 + 120 of 1000)
    assert fraction_of_negatives(40, 960, 0.25) == pytest.approx(0.125)
    assert fraction_of_negatives(40, 960, None) == 1.0  # off
    assert fraction_of_negatives(400, 600, 0.25) == 1.0  # positives are already that common
    assert fraction_of_negatives(10, 0, 0.5) == 1.0


def test_negative_fraction_keeps_epochs_above_the_floor() -> None:
    # The share alone gives epochs of 160 journeys; a floor of 400 draws 360 of 960 negatives.
    assert fraction_of_negatives(40, 960, 0.25, min_epoch_journeys=400) == pytest.approx(0.375)
    assert fraction_of_negatives(40, 960, 0.25, min_epoch_journeys=100) == pytest.approx(0.125)
    assert fraction_of_negatives(40, 960, 0.25, min_epoch_journeys=5000) == 1.0  # small data
    assert fraction_of_negatives(40, 960, None, min_epoch_journeys=400) == 1.0


def test_negative_sampling_keeps_every_positive_and_a_fresh_share_of_negatives(frame) -> None:
    labels = (torch.rand(1000, generator=torch.Generator().manual_seed(0)) < 0.1).float()
    positives = set(torch.nonzero(labels).flatten().tolist())
    n_negatives = 1000 - len(positives)
    epochs = [sample_negatives(labels, 0.25, seed=7, epoch=epoch) for epoch in range(3)]
    for subset in epochs:
        assert subset.tolist() == sorted(set(subset.tolist()))  # sorted, no repeats
        assert positives <= set(subset.tolist())
        assert len(subset) == len(positives) + round(0.25 * n_negatives)  # same steps each epoch
    assert not torch.equal(epochs[0], epochs[1])  # other negatives every epoch
    assert torch.equal(epochs[1], sample_negatives(labels, 0.25, seed=7, epoch=1))
    assert len(sample_negatives(labels, 1.0, seed=7, epoch=0)) == 1000

    # The subset's loader serves only its journeys, grouped by their own lengths, and
    # shards across DDP ranks like the full loader (Lightning's injection, as above).
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from lightning.pytorch.trainer.states import RunningStage
    from lightning.pytorch.utilities.data import _update_dataloader

    encoded = encode_journeys(pl.concat([frame] * 200), described())
    encoded = dataclasses.replace(encoded, labels=labels)
    subset = epochs[0]
    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        loader = make_dataloader(encoded, 16, shuffle=True, subset=subset)
    served = torch.cat([batch.index for batch in loader])
    assert sorted(served.tolist()) == subset.tolist()
    assert torch.equal(torch.cat([b.labels for b in loader]).sum(), labels[subset].sum())
    shards = []
    for rank in range(2):
        inner = DistributedSampler(loader.dataset, num_replicas=2, rank=rank, shuffle=True)
        sharded = _update_dataloader(loader, inner, mode=RunningStage.TRAINING)
        shards.append(torch.cat([batch.index for batch in sharded]).tolist())
    assert len(shards[0]) == len(shards[1])
    assert set(shards[0]) | set(shards[1]) == set(subset.tolist())


def test_batches_feed_the_model(tmp_path, frame) -> None:
    from journeys.config import Model
    from journeys.encoding import model_config_from
    from journeys.model import JourneyTransformer

    frame.write_parquet(tmp_path / "journeys.parquet")
    module = JourneyDataModule(
        tmp_path,
        VOCABS,
        max_len=8,
        batch_size=4,  # time encodings in UTC, as by default
    )
    settings = Model(d_model=16, n_heads=2, time_buckets=32)
    model = JourneyTransformer(model_config_from(settings, module.fitted_encoder)).eval()
    assert model.config.n_continuous == 6  # time encodings on, as by default
    batch = next(iter(make_dataloader(module.encoder.encode(frame), 4)))
    out = model(
        batch.tokens, batch.features, batch.time_buckets, batch.mask,
        attention="pooled", continuous=batch.continuous,
    )  # fmt: skip
    assert out.logits.shape == (4,)
    assert out.attention.shape == batch.mask.shape


def test_time_encodings_read_gaps_durations_and_local_time(frame: pl.DataFrame) -> None:
    """The continuous inputs of `model.time_encodings`: log seconds since the previous and
    the first event (kept events only), and the local hour and weekday on a circle."""
    import math

    from journeys.inputs import LOG_SECONDS_SCALE, TIME_ENCODINGS

    encoded = encode_journeys(frame, described("Asia/Kolkata"))
    assert encoded.continuous is not None
    assert encoded.continuous.shape == (len(TIME_ENCODINGS), encoded.n_events)
    values = dict(zip(TIME_ENCODINGS, encoded.continuous.tolist(), strict=True))
    # j1: events at 0 s, 1 s and 3601 s.
    scaled = [math.log1p(s) / LOG_SECONDS_SCALE for s in (0, 1, 3600)]
    assert values["log_gap"][:3] == pytest.approx(scaled, abs=1e-6)
    since = [math.log1p(s) / LOG_SECONDS_SCALE for s in (0, 1, 3601)]
    assert values["log_since_start"][:3] == pytest.approx(since, abs=1e-6)
    local = T0.astimezone(ZoneInfo("Asia/Kolkata"))  # +05:30: the minutes count too
    hour = 2 * math.pi * (local.hour + local.minute / 60) / 24
    weekday = 2 * math.pi * local.weekday() / 7
    assert values["hour_sin"][0] == pytest.approx(math.sin(hour), abs=1e-6)
    assert values["hour_cos"][0] == pytest.approx(math.cos(hour), abs=1e-6)
    assert values["weekday_sin"][0] == pytest.approx(math.sin(weekday), abs=1e-6)
    assert values["weekday_cos"][0] == pytest.approx(math.cos(weekday), abs=1e-6)
    # Off by default; batches carry them padded with zeros when on.
    assert encode_journeys(frame, described()).continuous is None
    batch = JourneyCollator(encoded)([1, 2])
    assert batch.continuous.shape == (2, len(TIME_ENCODINGS), 2)
    assert (batch.continuous[0, :, 1] == 0).all()  # j2's padded slot
    kept = encode_journeys(frame, described("UTC"), max_len=2)
    assert kept.continuous[1, 0] == 0.0  # since the first KEPT event, like the gaps


@pytest.mark.parametrize("max_len", [None, 2])
def test_gaps_and_durations_restart_at_every_journey(max_len: int | None) -> None:
    """Encoding takes gaps and time since the start on the flat events; each journey's
    first kept event must still get gap 0 and its own start, as the per-list reference
    (`gap_seconds_expr`) gives, however long the previous journey ran."""
    import math

    from journeys.encoding import gap_seconds_expr as per_list_gaps
    from journeys.inputs import LOG_SECONDS_SCALE, TIME_ENCODINGS

    starts = [0, 10, 5_000, 3, 86_400]  # later journeys start before earlier ones end too
    rows = [
        journey(f"j{k}", [("view", s + 7.5 * i * (k + 1), "search", "mobile") for i in range(k + 1)], 0, "train")
        for k, s in enumerate(starts)
    ]  # fmt: skip
    frame = pl.DataFrame(rows, schema=SCHEMA)
    times = pl.col("event_time").list.tail(max_len) if max_len else pl.col("event_time")
    reference = frame.select(
        per_list_gaps(times).alias("gap"),
        times.list.eval(
            (pl.element() - pl.element().first()).dt.total_seconds(fractional=True)
        ).alias("since"),
    )
    gaps = reference.get_column("gap").explode().to_list()
    since = reference.get_column("since").explode().to_list()
    assert gaps.count(0.0) == len(starts)  # one first event per journey

    encoded = encode_journeys(frame, described("UTC"), max_len)
    values = dict(zip(TIME_ENCODINGS, encoded.continuous.tolist(), strict=True))
    assert values["log_gap"] == pytest.approx(
        [math.log1p(g) / LOG_SECONDS_SCALE for g in gaps], abs=1e-6
    )
    assert values["log_since_start"] == pytest.approx(
        [math.log1p(s) / LOG_SECONDS_SCALE for s in since], abs=1e-6
    )
    expected_buckets = pl.select(time_bucket_expr(pl.Series(gaps), 32)).to_series().to_list()
    assert encoded.time_buckets.tolist() == expected_buckets

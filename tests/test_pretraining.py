"""`train.pretrain`: masked events before conversion, on the train split's and the open
journeys, never val's or test's (a training run's pre-training curve: `tests/test_train.py`)."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
import torch
from conftest import make_learnable_journeys

from journeys.config import Pretrain, Train, load_config
from journeys.datasets import NO_SPLIT, pretraining_journeys, scan_journeys
from journeys.encoding import EncodedJourneys, JourneyBatch, make_dataloader
from journeys.errors import ConfigError
from journeys.model import JourneyTransformer, ModelConfig
from journeys.pretraining import LOG_EVERY, hide_events, pretrain

VOCAB = 12  # padding, unknown and ten event types


def repeated_journeys(n: int, seed: int = 0) -> EncodedJourneys:
    """Journeys that repeat an event type of their own (a a a ...): a hidden event is named
    by the rest of its journey, and by nothing else (every time bucket is the same)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(4, 13, (n,), generator=generator)
    types = torch.randint(2, VOCAB, (n,), generator=generator)
    tokens = types.repeat_interleave(lengths).int()
    return EncodedJourneys(
        tokens=tokens,
        features=torch.zeros(0, tokens.numel(), dtype=torch.int32),
        time_buckets=torch.ones_like(tokens),
        offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
        labels=torch.zeros(n),
        journey_ids=None,
    )


def tiny_model() -> JourneyTransformer:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=VOCAB, n_time_buckets=4, d_model=32, n_heads=2, max_len=16,
        visit_bucket=None, n_continuous=0,
    )  # fmt: skip
    return JourneyTransformer(config)


def first_batch(journeys: EncodedJourneys) -> JourneyBatch:
    return next(iter(make_dataloader(journeys, len(journeys), group_by_length=False)))


def test_hiding_takes_about_the_share_and_at_least_one_real_event_of_every_journey() -> None:
    batch = first_batch(repeated_journeys(500))
    batch = batch._replace(features=batch.tokens[:, None, :].clone())  # a feature to hide too
    hidden_batch, hidden = hide_events(batch, 0.15, torch.Generator().manual_seed(0))
    assert not (hidden & ~batch.mask).any()  # never padding
    assert hidden.sum(dim=1).min() >= 1  # every journey has one to name
    share = hidden.sum() / batch.mask.sum()
    assert 0.15 < share < 0.25  # the share, plus the one forced on short journeys
    assert (hidden_batch.tokens[hidden] == 0).all() and (
        hidden_batch.features[:, 0][hidden] == 0
    ).all()
    kept = batch.mask & ~hidden
    assert torch.equal(hidden_batch.tokens[kept], batch.tokens[kept])
    assert torch.equal(hidden_batch.time_buckets, batch.time_buckets)  # times stay


def test_pretraining_learns_to_name_hidden_events_from_their_journey() -> None:
    journeys, model = repeated_journeys(400), tiny_model()
    settings, train = Pretrain(steps=300, lr=3e-3), Train(warmup_steps=30)
    done = pretrain(model, journeys, settings, train, 64, torch.device("cpu"))
    assert done.steps == 300 and done.journeys == 400
    assert [step for step, *_ in done.curve] == list(range(LOG_EVERY, 301, LOG_EVERY))
    first_loss, first_accuracy = done.curve[0][1:]
    last_loss, last_accuracy = done.curve[-1][1:]
    # Ten types equally common: 10% by frequency alone; the journey names them.
    assert last_accuracy > 0.9 > first_accuracy and last_loss < first_loss / 3
    # The network (not only the dropped head) learned it: its states tell the types apart.
    batch = first_batch(journeys)
    hidden_batch, _ = hide_events(batch, 0.15, torch.Generator().manual_seed(1))
    model.eval()
    states = model.hidden_states(
        hidden_batch.tokens, hidden_batch.features, hidden_batch.time_buckets, hidden_batch.mask
    )
    assert states.shape == (*batch.mask.shape, 32)
    untrained = (
        tiny_model()
        .eval()
        .hidden_states(
            hidden_batch.tokens, hidden_batch.features, hidden_batch.time_buckets, hidden_batch.mask
        )
    )
    assert not torch.allclose(states, untrained)


def test_pretraining_reads_the_train_split_and_the_open_journeys_never_val_or_test(
    tmp_path: Path,
) -> None:
    make_learnable_journeys(tmp_path / "journeys", n=400, seed=0)
    splits = scan_journeys(tmp_path / "journeys").group_by("split").len().collect()
    assert NO_SPLIT in splits["split"].to_list()  # the fixture has open journeys
    read = pretraining_journeys(tmp_path / "journeys").collect()
    assert set(read["split"]) == {"train", NO_SPLIT}
    every = scan_journeys(tmp_path / "journeys").collect()
    expected = every.filter(pl.col("split").is_in(["train", NO_SPLIT]))
    assert read.height == expected.height
    assert read["journey_id"].to_list() == sorted(read["journey_id"].to_list())
    alone = pretraining_journeys(tmp_path / "journeys", open_journeys=False).collect()
    assert set(alone["split"]) == {"train"}


def test_pretraining_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="mask_share"):
        load_config(None, ["train.pretrain.mask_share=1.5"])
    with pytest.raises(ConfigError, match="pretrain"):
        load_config(None, ["train.pretrain.stepz=10"])

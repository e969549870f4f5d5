"""`train.objective: every_prefix`: the loss at every prefix of a causal model.

Each prefix carries its journey's label; by default each journey weighs the same (mean over
its prefixes, then over journeys). Checked by hand on tiny batches, through configuration
validation, and with a short real fit whose prefix logit at the last event is the journey's.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_journeys_dataset

from journeys.config import load_config
from journeys.encoding import JourneyBatch
from journeys.errors import ConfigError
from journeys.lightning_parts import JourneyModule
from journeys.model import ModelConfig

CAUSAL = ModelConfig(
    vocab_size=8, d_model=8, n_heads=2, n_layers=1, causal=True, position_origin="start",
    max_len=16, n_continuous=0,
)  # fmt: skip
EVERY_PREFIX = ["model.causal=true", "train.objective=every_prefix"]


def module_for(*overrides: str, negative_fraction: float = 1.0) -> JourneyModule:
    torch.manual_seed(0)  # the same weights for every module built here
    settings = load_config(None, [*EVERY_PREFIX, *overrides]).train
    module = JourneyModule(CAUSAL, settings, negative_fraction=negative_fraction)
    module.log = lambda *args, **kwargs: None  # no Trainer attached
    return module


def batch_of(journeys: list[list[int]], labels: list[float]) -> JourneyBatch:
    """Right-padded batch of token lists (no features, time bucket 1)."""
    width = max(len(j) for j in journeys)
    tokens = torch.zeros(len(journeys), width, dtype=torch.long)
    for row, journey in enumerate(journeys):
        tokens[row, : len(journey)] = torch.tensor(journey)
    mask = tokens > 0
    return JourneyBatch(
        tokens=tokens,
        features=torch.zeros(len(journeys), 0, width, dtype=torch.long),
        time_buckets=mask.long(),
        mask=mask,
        labels=torch.tensor(labels),
        index=torch.arange(len(journeys)),
    )


def prefix_logits(module: JourneyModule, batch: JourneyBatch) -> torch.Tensor:
    out = module.model(batch.tokens, batch.features, batch.time_buckets, batch.mask)
    return out.prefix_logits.detach()


def bce(logit: float, target: float, pos_weight: float = 1.0) -> float:
    """-(w t log p + (1 - t) log(1 - p)), written out."""
    p = 1 / (1 + math.exp(-logit))
    return -(pos_weight * target * math.log(p) + (1 - target) * math.log(1 - p))


def test_every_prefix_loss_is_the_mean_over_prefixes_then_journeys() -> None:
    overrides = ["train.label_smoothing=0.1", "train.pos_weight=2"]
    module = module_for(*overrides, negative_fraction=0.5)
    batch = batch_of([[2, 3, 4], [5]], [1.0, 0.0])
    logits = prefix_logits(module, batch)
    offset = -math.log(0.5)  # negative sampling's prior correction, at every prefix
    targets = [1 * 0.9 + 0.05, 0 * 0.9 + 0.05]  # label smoothing 0.1
    first = [bce(logits[0, k].item() + offset, targets[0], 2.0) for k in range(3)]
    second = [bce(logits[1, 0].item() + offset, targets[1], 2.0)]
    expected = (sum(first) / 3 + sum(second) / 1) / 2
    assert module.training_step(batch, 0).item() == pytest.approx(expected, rel=1e-5)

    # The journey objective (same weights) is the loss at each journey's last event only.
    journey = JourneyModule(CAUSAL, load_config(None, overrides).train, negative_fraction=0.5)
    journey.load_state_dict(module.state_dict())
    journey.log = module.log
    on_last = (
        bce(logits[0, 2].item() + offset, targets[0], 2.0)
        + bce(logits[1, 0].item() + offset, targets[1], 2.0)
    ) / 2
    assert journey.training_step(batch, 0).item() == pytest.approx(on_last, rel=1e-5)
    assert abs(on_last - expected) > 1e-3


def test_a_long_and_a_short_journey_weigh_the_same() -> None:
    long_, short = [2, 3, 4, 5, 6, 7, 2, 3, 4, 5], [6, 7]
    module = module_for()
    alone = [
        module.training_step(batch_of([j], [y]), 0).item() for j, y in ((long_, 1.0), (short, 0.0))
    ]
    together = module.training_step(batch_of([long_, short], [1.0, 0.0]), 0).item()
    # Each journey's mean over its own prefixes, then the plain mean of the two.
    assert together == pytest.approx((alone[0] + alone[1]) / 2, rel=1e-5)

    # prefix_weight: prefix weighs every prefix alike: the long journey counts 10 to 2.
    per_prefix = module_for("train.prefix_weight=prefix")
    together = per_prefix.training_step(batch_of([long_, short], [1.0, 0.0]), 0).item()
    assert together == pytest.approx((10 * alone[0] + 2 * alone[1]) / 12, rel=1e-5)


def test_config_refuses_every_prefix_without_a_causal_model() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, ["train.objective=every_prefix"])
    message = str(caught.value)
    assert "\n" not in message
    assert "train.objective" in message and "model.causal" in message

    with pytest.raises(ConfigError, match=r"train\.objective"):
        load_config(None, ["train.objective=every_event"])
    with pytest.raises(ConfigError, match="prefix_weight"):
        load_config(None, ["train.prefix_weight=prefix"])  # only with every_prefix
    with pytest.raises(ConfigError, match="val_prefix_roc_auc"):
        load_config(None, ["train.monitor=val_prefix_roc_auc"])  # likewise

    config = load_config(None, [*EVERY_PREFIX, "train.monitor=val_prefix_roc_auc"])
    assert (config.train.objective, config.train.prefix_weight) == ("every_prefix", "journey")
    # Built without the config's check, the module refuses too.
    with pytest.raises(ConfigError, match=r"model\.causal"):
        JourneyModule(ModelConfig(vocab_size=8, d_model=8, n_heads=2), config.train)


def test_a_short_fit_trains_every_prefix_and_the_last_prefix_is_the_journey(
    tmp_path: Path,
) -> None:
    import lightning as L

    from journeys import metrics as M
    from journeys.encoding import model_config_from
    from journeys.inference import run_model
    from journeys.lightning_parts import JourneyDataModule, build_trainer
    from journeys.vocab import Vocabularies

    make_journeys_dataset(tmp_path / "journeys", n=300, seed=0)
    config = load_config(
        None,
        [
            *EVERY_PREFIX,
            "train.monitor=val_prefix_roc_auc",
            "model.d_model=16",
            "model.n_heads=2",
            "model.n_layers=1",
            "train.batch_size=64",
            "train.warmup_steps=2",
            "train.lr=0.005",
            "train.accelerator=cpu",
            "train.max_epochs=2",
            f"paths.journeys={tmp_path / 'journeys'}",
            f"paths.checkpoints={tmp_path / 'checkpoints'}",
        ],
    )
    L.seed_everything(0, verbose=False)
    vocabs = Vocabularies.load(config.paths.journeys)
    datamodule = JourneyDataModule.from_config(config, vocabs)
    model_config = model_config_from(config.model, datamodule.fitted_encoder)
    module = JourneyModule(model_config, config.train, base_rate=0.3)
    before = [p.detach().clone() for p in module.parameters()]
    trainer, checkpoint = build_trainer(config, False, tmp_path / "checkpoints", progress=False)
    trainer.fit(module, datamodule=datamodule)

    metrics = trainer.callback_metrics
    assert {"train_loss", "val_loss", "val_roc_auc", "val_prefix_roc_auc"} <= set(metrics)
    assert math.isfinite(float(metrics["train_loss"]))
    assert 0.0 <= float(metrics["val_prefix_roc_auc"]) <= 1.0
    assert "val_prefix_roc_auc" in Path(checkpoint.best_model_path).name  # train.monitor
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))

    test = datamodule.splits["test"]
    outputs = run_model(module.model, test, batch_size=32)
    assert outputs.prefix_logits is not None
    at_last_event = outputs.prefix_logits[outputs.offsets[1:] - 1]
    np.testing.assert_allclose(
        M.sigmoid(at_last_event), M.sigmoid(outputs.logits), rtol=0, atol=1e-6
    )


def test_prefix_metrics_by_length_and_weighted_as_the_bpic_protocol() -> None:
    from journeys.train import prefix_metrics

    # Three journeys: 2 events (converted), 3 events (not), 2 events (not).
    offsets = np.array([0, 2, 5, 7])
    labels = np.array([1.0, 0.0, 0.0])
    logits = np.array([0.9, 0.1, 0.5, 0.8, -1.0, 0.2, 0.3])
    got = prefix_metrics("test_", labels, offsets, logits)
    # After event 1: 0.9 vs 0.5, 0.2 -> AUC 1. After event 2: 0.1 vs 0.8, 0.3 -> AUC 0.
    # After event 3 only the second journey is left: one class, no AUC.
    assert got == {
        "test_prefix_roc_auc_weighted": pytest.approx((3 * 1.0 + 3 * 0.0) / 6),
        "test_prefix_roc_auc_len1": 1.0,
        "test_prefix_roc_auc_len2": 0.0,
    }

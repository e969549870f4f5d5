"""The champion rule: chosen on the validation split, never below chance or a baseline."""

from __future__ import annotations

import contextlib
import io
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import make_journeys_dataset, make_learnable_journeys
from mlflow import MlflowClient
from sklearn.metrics import roc_auc_score

from journeys import metrics as M
from journeys import tracking
from journeys.config import Promotion, load_config
from journeys.promotion import decide

SETTINGS = Promotion()


def val_split(n: int = 2000, rate: float = 0.1, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Labels and a latent score that separates them (AUC ~0.85)."""
    rng = np.random.default_rng(seed)
    labels = rng.random(n) < rate
    return labels, labels * 1.5 + rng.normal(size=n)


def noisier(signal: np.ndarray, noise: float, seed: int) -> np.ndarray:
    return signal + noise * np.random.default_rng(seed).normal(size=signal.size)


def test_a_good_candidate_becomes_the_first_champion() -> None:
    labels, signal = val_split()
    decision = decide(labels, signal, {"prior": np.full(labels.size, 0.1)}, None, SETTINGS)
    assert decision.promote and decision.check == "first_champion"
    assert decision.val_roc_auc["transformer"] == pytest.approx(roc_auc_score(labels, signal))


def test_a_candidate_at_chance_is_never_promoted() -> None:
    labels, _ = val_split()
    noise = np.random.default_rng(1).normal(size=labels.size)
    decision = decide(labels, noise, {}, None, SETTINGS)
    assert not decision.promote and decision.check == "not_above_chance"
    assert "train.min_steps" in decision.fix


def test_a_candidate_behind_a_baseline_by_the_paired_test_is_not_promoted() -> None:
    labels, signal = val_split()
    candidate, baseline = noisier(signal, 2.0, 1), noisier(signal, 0.2, 2)
    decision = decide(labels, candidate, {"hgb_aggregates": baseline}, None, SETTINGS)
    assert not decision.promote and decision.check == "below_baseline"
    assert (
        "baseline_hgb_aggregates" in decision.reason and "baseline_hgb_aggregates" in decision.fix
    )
    # A baseline a hair ahead, within the test's doubt, does not block it.
    close = noisier(signal, 0.21, 3)
    level = decide(labels, noisier(signal, 0.2, 4), {"logreg": close}, None, SETTINGS)
    assert level.promote


def test_with_the_guard_off_only_the_champion_is_compared() -> None:
    labels, _ = val_split()
    noise = np.random.default_rng(1).normal(size=labels.size)
    off = Promotion(guard=False)
    decision = decide(labels, noise, {"logreg": labels * 1.0}, None, off)
    assert decision.promote and decision.check == "first_champion"
    assert "(promotion.guard off)" in decision.reason
    assert decide(labels, noise, {}, labels * 1.0, off).check == "not_better_than_champion"


def test_too_few_val_conversions_choose_nothing() -> None:
    labels, signal = val_split(n=100, rate=0.1)
    decision = decide(labels, signal, {}, None, SETTINGS)
    assert not decision.promote and decision.check == "too_few_conversions"
    assert "promotion.min_val_conversions (20)" in decision.reason


def test_the_champion_is_compared_on_the_same_val_journeys() -> None:
    labels, signal = val_split()
    better, worse = noisier(signal, 0.1, 1), noisier(signal, 1.0, 2)
    assert decide(labels, better, {}, worse, SETTINGS).check == "promoted"
    kept = decide(labels, worse, {}, better, SETTINGS)
    assert not kept.promote and kept.check == "not_better_than_champion"
    logged = decide(labels, better, {}, 0.99, SETTINGS)  # a champion of other features
    assert not logged.promote and "(logged)" in logged.reason


def test_the_paired_difference_matches_the_aucs_and_its_doubt_shrinks_with_data() -> None:
    labels, signal = val_split(n=4000)
    a, b = noisier(signal, 0.5, 1), noisier(signal, 1.0, 2)
    difference, upper = M.paired_roc_auc_difference(labels, a, b)
    assert difference == pytest.approx(roc_auc_score(labels, a) - roc_auc_score(labels, b))
    assert upper > difference
    same, bound = M.paired_roc_auc_difference(labels, a, a)
    assert same == 0.0 and bound == pytest.approx(0.0, abs=1e-12)
    small = M.paired_roc_auc_difference(labels[:400], a[:400], b[:400])
    assert small[1] - small[0] > upper - difference  # fewer journeys, more doubt


# ----------------------------------------------------------------------------- in training


def tiny_config(tmp: Path, *overrides: str):
    return load_config(
        None,
        [
            "model.d_model=16", "model.n_heads=2", "model.n_layers=1",
            "train.max_epochs=2", "train.batch_size=64",
            "train.baselines=[prior,logreg]", "promotion.min_val_conversions=5",
            f"paths.journeys={tmp / 'journeys'}", f"paths.checkpoints={tmp / 'checkpoints'}",
            f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
            *overrides,
        ],
    )  # fmt: skip


def train_quietly(config, monkeypatch: pytest.MonkeyPatch, evaluate=None):
    from journeys import train

    if evaluate is not None:
        monkeypatch.setattr(train, "evaluate", evaluate)
    with contextlib.redirect_stdout(io.StringIO()):
        return train.train_command(config)


@pytest.mark.slow
def test_a_broken_candidate_is_registered_but_never_champion(
    tmp_path: Path, mlflow_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from journeys import train

    make_journeys_dataset(tmp_path / "journeys", n=400, seed=0)
    config = tiny_config(tmp_path)
    real = train.evaluate

    def broken(fitted, workdir):  # a model whose scores are noise on val
        evaluation = real(fitted, workdir)
        noise = np.random.default_rng(0).normal(size=evaluation.val_logits.size)
        return replace(evaluation, val_logits=noise)

    result = train_quietly(config, monkeypatch, broken)
    assert not result.promoted and result.champion_version is None
    client = MlflowClient(mlflow_env)
    tags = client.get_run(result.run_id).data.tags
    assert tags[tracking.CHAMPION_CHECK_TAG] == "not_above_chance"
    assert "did not learn" in tags[tracking.CHAMPION_REASON_TAG]
    version = client.get_model_version("journey-conversion", str(result.model_version))
    assert version.tags[tracking.CHAMPION_DECISION_TAG] == "kept_previous"
    with pytest.raises(Exception, match="alias"):
        client.get_model_version_by_alias("journey-conversion", "champion")
    logged = client.download_artifacts(result.run_id, "promotion.json")
    assert '"check": "not_above_chance"' in Path(logged).read_text()


@pytest.mark.slow
def test_the_test_split_never_chooses_the_champion(
    tmp_path: Path, mlflow_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs whose test scores are turned upside down decide the same, on val."""
    from journeys import train

    make_journeys_dataset(tmp_path / "journeys", n=400, seed=0)
    real = train.evaluate

    def upside_down_on_test(fitted, workdir):
        evaluation = real(fitted, workdir)
        flipped = -evaluation.test_logits
        labels = fitted.datamodule.splits["test"].labels.numpy()
        metrics = {**evaluation.metrics, **M.binary_metrics(labels, M.sigmoid(flipped))}
        return replace(evaluation, test_logits=flipped, metrics=metrics)

    decisions = []
    for name, evaluate in (("plain", None), ("flipped", upside_down_on_test)):
        config = tiny_config(tmp_path, f"mlflow.registered_model={name}")
        result = train_quietly(config, monkeypatch, evaluate)
        tags = MlflowClient(mlflow_env).get_run(result.run_id).data.tags
        decisions.append((result.promoted, tags[tracking.CHAMPION_CHECK_TAG], result.metrics))
    (plain, check, plain_metrics), (flipped, flipped_check, flipped_metrics) = decisions
    assert plain_metrics["test_roc_auc"] == pytest.approx(1 - flipped_metrics["test_roc_auc"])
    assert (plain, check) == (flipped, flipped_check)


@pytest.mark.slow
def test_a_150_journey_log_trains_to_a_real_model(
    tmp_path: Path, mlflow_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `train.step_floor` a small log gets its optimiser steps (smaller batches, more
    epochs): the model learns the toy's rule, where 12 steps would not."""
    make_learnable_journeys(tmp_path / "journeys", n=150)
    config = load_config(
        None,
        [
            "train.baselines=[]",
            "train.step_floor=600",
            f"paths.journeys={tmp_path / 'journeys'}",
            f"paths.checkpoints={tmp_path / 'checkpoints'}",
            f"mlflow.tracking_uri={mlflow_env}",
        ],
    )
    result = train_quietly(config, monkeypatch)
    # 12 optimiser steps (one batch an epoch, the old rule) gave 0.47 on test here.
    assert result.metrics["best_val_roc_auc"] > 0.7
    assert result.metrics["test_roc_auc"] > 0.7

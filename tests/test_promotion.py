"""The champion rule: chosen among the run's candidates on the validation split, judged on
figures that did not choose, never below chance."""

from __future__ import annotations

import contextlib
import io
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import make_journeys_dataset, make_learnable_journeys, make_reversed_journeys
from mlflow import MlflowClient
from sklearn.metrics import roc_auc_score

from journeys import metrics as M
from journeys import tracking
from journeys.config import Promotion, load_config
from journeys.errors import ConfigError, InputError
from journeys.promotion import (
    cross_fit,
    cross_fitted_transformer,
    decide,
    ranking,
    val_folds,
)

SETTINGS = Promotion()


def val_split(n: int = 2000, rate: float = 0.1, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Labels and a latent score that separates them (AUC ~0.85)."""
    rng = np.random.default_rng(seed)
    labels = rng.random(n) < rate
    return labels, labels * 1.5 + rng.normal(size=n)


def noisier(signal: np.ndarray, noise: float, seed: int) -> np.ndarray:
    return signal + noise * np.random.default_rng(seed).normal(size=signal.size)


def calibrated(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Probabilities from scores, fitted to the labels (so log loss compares fairly)."""
    from sklearn.linear_model import LogisticRegression

    model = LogisticRegression().fit(scores[:, None], labels)
    return model.predict_proba(scores[:, None])[:, 1]


def test_a_good_candidate_becomes_the_first_champion() -> None:
    labels, signal = val_split()
    candidates = {"transformer": signal, "baseline_prior": np.full(labels.size, 0.1)}
    decision = decide(labels, candidates, None, SETTINGS)
    assert decision.promote and decision.check == "first_champion"
    assert decision.kind == "transformer"
    assert decision.val_roc_auc["transformer"] == pytest.approx(roc_auc_score(labels, signal))
    assert decision.val_metrics["baseline_prior"]["roc_auc"] == pytest.approx(0.5)


def test_when_no_candidate_is_above_chance_nothing_is_served() -> None:
    labels, _ = val_split()
    rng = np.random.default_rng(1)
    candidates = {kind: rng.normal(size=labels.size) for kind in ("transformer", "baseline_hgb")}
    decision = decide(labels, candidates, None, SETTINGS)
    assert not decision.promote and decision.check == "not_above_chance"
    assert not decision.guard_passed
    assert "no candidate" in decision.reason and "no champion is served" in decision.reason
    assert "check the labels and the split" in decision.fix


def test_a_baseline_clearly_ahead_on_val_is_the_one_served() -> None:
    labels, signal = val_split()
    candidates = {
        "transformer": noisier(signal, 2.0, 1),
        "stack": noisier(signal, 1.0, 5),
        "baseline_hgb_aggregates": noisier(signal, 0.2, 2),
    }
    decision = decide(labels, candidates, None, SETTINGS)
    assert decision.promote and decision.kind == "baseline_hgb_aggregates"
    assert decision.reason.startswith("first champion: baseline_hgb_aggregates serves")
    assert "transformer" in decision.reason  # the transformer's figure beside it


def test_a_tie_goes_to_the_transformer_then_the_stack() -> None:
    labels, signal = val_split(n=4000)
    transformer = noisier(signal, 0.5, 1)
    # The baseline ranks a hair better (within promotion.tie_margin): still a tie.
    baseline = transformer + 1e-3 * labels
    gap = roc_auc_score(labels, baseline) - roc_auc_score(labels, transformer)
    assert 0 < gap <= SETTINGS.tie_margin
    tie = decide(labels, {"transformer": transformer, "baseline_logreg": baseline}, None, SETTINGS)
    assert tie.kind == "transformer"
    # Without the transformer's tie, the stack takes it.
    stack = {
        "transformer": noisier(signal, 3.0, 7),
        "stack": transformer,
        "baseline_logreg": baseline,
    }
    assert decide(labels, stack, None, SETTINGS).kind == "stack"
    # Beyond the margin, the best serves.
    wide = decide(
        labels,
        {"transformer": transformer, "baseline_logreg": transformer + 0.2 * labels},
        None,
        SETTINGS,
    )
    assert wide.kind == "baseline_logreg"


def test_the_stack_then_the_strong_booster_serve_unless_a_rival_is_clearly_ahead() -> None:
    """A baseline ahead of the stack by noise on val does not serve; one clearly ahead does."""
    labels, signal = val_split(n=1500)
    stack = noisier(signal, 0.8, 1)
    hair = noisier(signal, 0.8, 3)  # as good a model, ahead by its draw of val noise
    assert roc_auc_score(labels, hair) - roc_auc_score(labels, stack) > SETTINGS.tie_margin
    assert M.paired_roc_auc_difference(labels, stack, hair)[1] > 0
    close = {"transformer": noisier(signal, 3.0, 2), "stack": stack, "baseline_hgb": hair}
    assert decide(labels, close, None, SETTINGS).kind == "stack"
    clear = {**close, "baseline_hgb": stack + 0.6 * labels}
    assert decide(labels, clear, None, SETTINGS).kind == "baseline_hgb"
    # Without the stack, the strong booster goes first the same way.
    booster = {
        "transformer": close["transformer"],
        "baseline_hgb_aggregates": stack,
        "baseline_hgb": hair,
    }
    assert decide(labels, booster, None, SETTINGS).kind == "baseline_hgb_aggregates"


def test_ranking_moves_the_preferred_kinds_ahead_of_what_they_tie_with() -> None:
    metrics = {
        "baseline_a": {"roc_auc": 0.800},
        "baseline_b": {"roc_auc": 0.799},
        "stack": {"roc_auc": 0.7985},
        "transformer": {"roc_auc": 0.790},
    }
    assert ranking(list(metrics), metrics, 0.002) == [
        "stack", "baseline_a", "baseline_b", "transformer",
    ]  # fmt: skip
    assert ranking(list(metrics), metrics, 0.0)[0] == "baseline_a"
    assert ranking(list(metrics), metrics, 0.02)[:2] == ["transformer", "stack"]


def test_a_candidate_clearly_worse_on_log_loss_is_passed_over() -> None:
    """Best ranked, but its probabilities are wrong by a mile: a rival with as good a
    ranking (not clearly behind on ROC AUC) and sound probabilities serves instead."""
    labels, signal = val_split(n=4000)
    ranked_well = noisier(signal, 0.5, 1)
    overconfident = M.sigmoid(4 * ranked_well + 2)  # the same ranking, near 1 everywhere
    rival = calibrated(noisier(signal, 0.52, 2), labels)
    candidates = {"transformer": overconfident, "baseline_logreg": rival}
    decision = decide(labels, candidates, None, SETTINGS)
    assert decision.kind == "baseline_logreg"
    assert "transformer passed over: baseline_logreg is clearly better on val log loss" in (
        decision.reason
    )
    # Judged on ROC AUC alone, the transformer serves.
    roc_only = Promotion(metrics=["roc_auc"])
    assert decide(labels, candidates, None, roc_only).kind == "transformer"
    # A rival clearly behind on ROC AUC cannot pass anyone over, however calibrated.
    weak = {"transformer": overconfident, "baseline_prior": np.full(labels.size, labels.mean())}
    assert decide(labels, weak, None, SETTINGS).kind == "transformer"


def test_promotion_metrics_must_rank_by_roc_auc() -> None:
    with pytest.raises(ConfigError, match="must hold roc_auc"):
        load_config(None, ["promotion.metrics=[pr_auc]"])


def test_with_the_guard_off_only_the_transformer_and_the_champion_are_compared() -> None:
    labels, _ = val_split()
    noise = np.random.default_rng(1).normal(size=labels.size)
    off = Promotion(guard=False)
    decision = decide(labels, {"transformer": noise, "baseline_logreg": labels * 1.0}, None, off)
    assert decision.promote and decision.check == "first_champion"
    assert decision.kind == "transformer"
    assert "(promotion.guard off)" in decision.reason
    assert decide(labels, {"transformer": noise}, labels * 1.0, off).check == (
        "not_better_than_champion"
    )


def test_too_few_val_conversions_choose_nothing() -> None:
    labels, signal = val_split(n=100, rate=0.1)
    decision = decide(labels, {"transformer": signal}, None, SETTINGS)
    assert not decision.promote and decision.check == "too_few_conversions"
    assert "promotion.min_val_conversions (20)" in decision.reason
    assert "`journeys ingest`" in decision.fix  # the split is the ingest's


def test_too_few_val_journeys_without_a_conversion_choose_nothing_either() -> None:
    """30 conversions and one journey without: DeLong's interval has no width there, and a
    perfect-looking AUC of 1 must not make a champion."""
    labels = np.array([True] * 30 + [False])
    decision = decide(labels, {"transformer": labels * 1.0}, None, SETTINGS)
    assert decision.check == "too_few_conversions" and not decision.promote
    assert "fewer journeys without one than promotion.min_val_conversions" in decision.reason


def test_the_champion_meets_the_honest_figure_not_the_one_that_chose() -> None:
    """What a candidate serves on val was chosen on val (its best epoch); the champion's
    scores were not. Met with the served figure, a candidate would win on the luck of its
    choice; with the honest (cross-fitted) figure, it wins on what it learned."""
    labels, signal = val_split()
    honest, lucky = noisier(signal, 1.0, 1), noisier(signal, 0.1, 2)
    champion = noisier(signal, 0.5, 3)  # between the two
    decision = decide(
        labels, {"transformer": honest}, champion, SETTINGS, served={"transformer": lucky}
    )
    assert decision.check == "not_better_than_champion" and not decision.promote
    off = Promotion(guard=False)  # plumbing and demos: what it serves
    assert decide(labels, {"transformer": honest}, champion, off, {"transformer": lucky}).promote


def test_the_champion_is_compared_on_the_same_val_journeys() -> None:
    labels, signal = val_split()
    better, worse = noisier(signal, 0.1, 1), noisier(signal, 1.0, 2)
    assert decide(labels, {"transformer": better}, worse, SETTINGS).check == "promoted"
    kept = decide(labels, {"transformer": worse}, better, SETTINGS)
    assert not kept.promote and kept.check == "not_better_than_champion"
    assert kept.guard_passed and "the champion stays" in kept.reason
    logged = decide(labels, {"transformer": better}, 0.99, SETTINGS)  # other features
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


def test_the_paired_pr_auc_and_log_loss_differences() -> None:
    from sklearn.metrics import average_precision_score, log_loss

    labels, signal = val_split(n=4000)
    a, b = noisier(signal, 0.5, 1), noisier(signal, 1.0, 2)
    difference, upper = M.paired_average_precision_difference(labels, a, b)
    expected = average_precision_score(labels, a) - average_precision_score(labels, b)
    assert difference == pytest.approx(expected)
    assert difference > 0 and upper > difference
    assert M.paired_average_precision_difference(labels, b, a)[1] < 0  # a ahead beyond doubt
    # Ties are one threshold, as scikit-learn counts them.
    tied = np.round(a, 0)
    assert M.paired_average_precision_difference(labels, tied, b)[0] == pytest.approx(
        average_precision_score(labels, tied) - average_precision_score(labels, b)
    )
    pa, pb = calibrated(a, labels), calibrated(b, labels)
    loss, loss_upper = M.paired_log_loss_difference(labels, pa, pb)
    assert loss == pytest.approx(log_loss(labels, pa) - log_loss(labels, pb))
    assert loss_upper < 0  # the better ranking, calibrated, has the lower loss beyond doubt


def test_an_epoch_chosen_on_val_is_judged_on_the_half_that_did_not_choose_it() -> None:
    """Two hundred epochs of noise: the best of them on val is a fluke that clears chance, and
    the cross-fitted figure (each half scored by the other half's choice) does not."""
    rng = np.random.default_rng(3)
    labels = rng.random(600) < 0.2
    history = rng.normal(size=(200, labels.size))
    aucs = [roc_auc_score(labels, epoch) for epoch in history]
    best = history[int(np.argmax(aucs))]
    assert M.roc_auc_interval(labels, best)[0] > 0.5  # chosen and judged on the same val
    folds = val_folds(labels, seed=0)
    assert {int((folds == f).sum()) for f in (0, 1)} == {300}  # halves, each class dealt evenly
    assert (labels[folds == 0].sum() - labels[folds == 1].sum()) in (-1, 0, 1)
    honest = cross_fitted_transformer(history, labels, folds)
    assert M.roc_auc_interval(labels, honest)[0] < 0.5
    decision = decide(labels, {"transformer": honest}, None, SETTINGS)
    assert decision.check == "not_above_chance"
    # A real signal survives cross-fitting: its later epochs learn, both halves choose the
    # last, and each half's probabilities are its logits through the other's temperature.
    learning = np.stack([labels * k * 0.3 + rng.normal(size=labels.size) for k in range(5)])
    fitted = cross_fitted_transformer(learning, labels, folds)
    for fold in (0, 1):
        held, fit = folds == fold, folds != fold
        temperature = M.fit_temperature(learning[-1][fit], labels[fit])
        np.testing.assert_allclose(fitted[held], M.sigmoid(learning[-1][held], temperature))
        assert temperature != pytest.approx(1.0, abs=1e-3)  # a temperature was fitted


def test_what_is_judged_on_one_half_is_chosen_and_fitted_on_the_other() -> None:
    labels, _ = val_split()
    folds = val_folds(labels, seed=1)
    seen = []

    def fit_predict(fit: np.ndarray, held: np.ndarray) -> np.ndarray:
        assert not (fit & held).any()
        seen.append(int(fit.sum()))
        return np.full(int(held.sum()), labels[fit].mean())  # the other half's base rate

    out = cross_fit(labels, folds, fit_predict)
    assert seen == [int((folds != 0).sum()), int((folds != 1).sum())]
    for fold in (0, 1):
        assert np.allclose(out[folds == fold], labels[folds != fold].mean())


def test_the_pr_auc_bootstrap_keeps_every_resample() -> None:
    """A resample that drew none of the top-scored examples still has an AP (precision 0
    where nothing was seen), so the spread is not estimated from the lucky resamples only."""
    from journeys.metrics import _weighted_average_precision

    labels, signal = val_split(n=500)
    weights = np.random.default_rng(0).poisson(1.0, size=(200, labels.size))
    values = _weighted_average_precision(labels.astype(float), signal, weights)
    assert np.isfinite(values).all()


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
def test_when_every_candidate_fails_the_guard_nothing_is_served_and_scoring_says_why(
    tmp_path: Path, mlflow_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log whose rule turns around after train: the transformer's val AUC falls below
    chance as it learns, every baseline's is below chance too; the version is registered,
    never champion, and `journeys score` names the guard's decision, not a missing alias."""
    from journeys.score import score_command

    make_reversed_journeys(tmp_path / "journeys", n=1200, seed=0)
    config = tiny_config(
        tmp_path, "train.max_epochs=6", "train.baselines=[prior,logreg,hgb_aggregates]"
    )
    result = train_quietly(config, monkeypatch)
    assert not result.promoted and result.champion_version is None
    client = MlflowClient(mlflow_env)
    tags = client.get_run(result.run_id).data.tags
    assert tags[tracking.CHAMPION_CHECK_TAG] == "not_above_chance"
    assert "no candidate" in tags[tracking.CHAMPION_REASON_TAG]
    for kind in ("transformer", "baseline_logreg", "baseline_hgb_aggregates"):
        assert result.metrics[f"val_roc_auc_{kind}"] < 0.5  # what learned train ranks val backwards
    # The stack's calibration, fitted on val, may not turn its ranking around.
    assert result.metrics["val_roc_auc_stack"] <= 0.55
    version = client.get_model_version("journey-conversion", str(result.model_version))
    assert version.tags[tracking.CHAMPION_DECISION_TAG] == "kept_previous"
    with pytest.raises(Exception, match="alias"):
        client.get_model_version_by_alias("journey-conversion", "champion")
    logged = client.download_artifacts(result.run_id, "promotion.json")
    assert '"check": "not_above_chance"' in Path(logged).read_text()
    with pytest.raises(InputError, match="served none: no candidate's val ROC AUC is above chance"):
        score_command(config)


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
    # Hundreds of steps, not twelve (early stopping may end it before the floor's 600).
    assert result.metrics["optimizer_steps"] >= 300
    # 12 optimiser steps (one batch an epoch, the old rule) gave 0.47 on test here.
    assert result.metrics["best_val_roc_auc"] > 0.7
    assert result.metrics["test_roc_auc"] > 0.7

"""The stack candidate: the transformer blended with gradient boosting on journey
aggregates, a model the registry holds and the batch scorer runs, with the transformer's
attention."""

from __future__ import annotations

import pickle
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from sklearn.metrics import roc_auc_score

from journeys.config import load_config
from journeys.datasets import labelled, scan_journeys
from journeys.errors import InputError
from journeys.metrics import logit
from journeys.stacking import blended, fit_stack
from journeys.trained_model import HEAD_BOOSTER, HEAD_FILE, TrainedModel, load_model

ROOT = Path(__file__).resolve().parents[1]
AD_CLICKS = ROOT / "data" / "samples" / "shapes" / "ad_clicks" / "clicks.csv"


class NotABooster:
    """A type skops does not trust: a booster file holding it must not load."""


@pytest.fixture(scope="module")
def stacked(tmp_path_factory: pytest.TempPathFactory):
    """The ad-click sample (counts of clicks matter) ingested and trained with a stack."""
    from journeys.ingest import ingest
    from journeys.train import train_command

    tmp = tmp_path_factory.mktemp("stack")
    sets = [
        f"paths.raw={AD_CLICKS}",
        f"paths.journeys={tmp / 'journeys'}",
        f"paths.quarantine={tmp / 'quarantine'}",
        f"paths.checkpoints={tmp / 'checkpoints'}",
        f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
        "train.accelerator=cpu",
        "train.baselines=[hgb_aggregates]",
        "train.stack=true",
        # Whichever candidate serves, these tests read the stack: only it may be chosen.
        "promotion.guard=false",
    ]
    config = load_config(ROOT / "conf" / "ad_clicks.yaml", sets)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        ingest(config)
        result = train_command(config)
    return config, result, tmp


def test_the_stack_serves_what_training_measured(stacked) -> None:
    config, result, tmp = stacked
    metrics = result.metrics
    assert {"stacked_test_roc_auc", "val_roc_auc_stack", "test_roc_auc"} <= set(metrics)
    trained = load_model(result.model_uri, f"sqlite:///{tmp / 'mlflow.db'}")
    trained.stack = stack_of_the_run(config, result, trained)
    assert trained.kind == "stack"
    test = labelled(scan_journeys(config.paths.journeys), ("test",)).collect()
    served = trained.predict_proba(test)
    auc = roc_auc_score(test.get_column("label").to_numpy(), served)
    assert auc == pytest.approx(metrics["stacked_test_roc_auc"], abs=1e-6)
    # The blend is not the transformer alone: both models carry weight.
    weights = trained.stack.weights
    assert weights[0] > 0 and weights[1] > 0


def stack_of_the_run(config, result, trained):
    """The run's stack, refitted as training fits it (the guard was off: the registered
    model is the transformer's)."""
    from journeys.baselines import BaselineSettings, fit_baseline
    from journeys.datasets import training_journeys

    journeys = training_journeys(config.paths.journeys, None).collect()  # training's order
    booster = fit_baseline(
        "hgb_aggregates",
        journeys.filter(pl.col("split") == "train"),
        BaselineSettings.from_config(config),
    )
    val = journeys.filter(pl.col("split") == "val")
    booster_val = logit(booster.predict_proba(val))
    labels = val.get_column("label").to_numpy()
    return fit_stack(booster, labels, trained.predict_logits(val), booster_val, trained.temperature)


def test_attention_stays_the_transformers_and_only_the_probability_changes(stacked) -> None:
    from journeys.score import score_frame

    config, result, tmp = stacked
    trained = load_model(result.model_uri, f"sqlite:///{tmp / 'mlflow.db'}")
    trained.stack = stack_of_the_run(config, result, trained)
    test = labelled(scan_journeys(config.paths.journeys), ("test",)).collect()
    with_stack = score_frame(trained, test)
    stack, trained.stack = trained.stack, None
    alone = score_frame(trained, test)
    trained.stack = stack
    assert with_stack.get_column("attention").equals(alone.get_column("attention"))
    sums = with_stack.select(pl.col("attention").list.sum()).to_series().to_numpy()
    np.testing.assert_allclose(sums, 1.0, rtol=1e-5)
    assert not np.allclose(
        with_stack["conversion_probability"].to_numpy(), alone["conversion_probability"].to_numpy()
    )


def test_a_saved_stack_round_trips_and_a_damaged_booster_is_refused(
    stacked, tmp_path: Path
) -> None:
    config, result, tmp = stacked
    trained = load_model(result.model_uri, f"sqlite:///{tmp / 'mlflow.db'}")
    trained.stack = stack_of_the_run(config, result, trained)
    files = trained.save(tmp_path / "model")
    assert {HEAD_FILE, HEAD_BOOSTER} <= set(files)
    again = TrainedModel.load(tmp_path / "model")
    assert again.kind == "stack"
    test = labelled(scan_journeys(config.paths.journeys), ("test",)).collect()
    np.testing.assert_array_equal(again.predict_proba(test), trained.predict_proba(test))
    # As scoring ships it to worker processes and Dask workers: pickled whole.
    shipped = pickle.loads(pickle.dumps(again))
    np.testing.assert_array_equal(shipped.predict_proba(test), trained.predict_proba(test))

    trees = tmp_path / "model" / HEAD_BOOSTER
    damaged = bytearray(trees.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # Treelite itself would read this as other trees
    trees.write_bytes(bytes(damaged))
    with pytest.raises(InputError, match=r"damaged model files.*head\.trees is not the file"):
        TrainedModel.load(tmp_path / "model")


def test_a_stack_saved_before_treelite_still_serves_and_a_foreign_type_is_refused(
    stacked, tmp_path: Path
) -> None:
    """A head of format 1 (`head.skops`, the scikit-learn booster) loads into the same
    trees: its probabilities are scikit-learn's. A skops file holding a type it does not
    trust is refused."""
    import json

    from skops.io import dump

    from journeys.baselines import Trees, _booster, _labels, with_total_events
    from journeys.trained_model import SKOPS_BOOSTER

    config, result, tmp = stacked
    trained = load_model(result.model_uri, f"sqlite:///{tmp / 'mlflow.db'}")
    trained.stack = stack_of_the_run(config, result, trained)
    aggregates = trained.stack.baseline.aggregates
    journeys = labelled(scan_journeys(config.paths.journeys), ("train",)).collect()
    inputs = aggregates.transform(with_total_events(journeys))
    fitted = _booster(0, aggregates.categorical).fit(inputs, _labels(journeys))
    trained.stack.baseline.booster = Trees.of(fitted)
    folder = tmp_path / "model"
    trained.save(folder)
    head = json.loads((folder / HEAD_FILE).read_text())
    head["format_version"] = 1
    del head["trees_sha256"]
    (folder / HEAD_FILE).write_text(json.dumps(head))
    (folder / HEAD_BOOSTER).unlink()
    dump(fitted, folder / SKOPS_BOOSTER)

    old = TrainedModel.load(folder)
    test = labelled(scan_journeys(config.paths.journeys), ("test",)).collect()
    expected = fitted.predict_proba(aggregates.transform(with_total_events(test)))[:, 1]
    np.testing.assert_allclose(old.stack.baseline.predict_proba(test), expected, rtol=0, atol=1e-12)
    np.testing.assert_allclose(old.predict_proba(test), trained.predict_proba(test), atol=1e-12)

    dump(NotABooster(), folder / SKOPS_BOOSTER)
    with pytest.raises(InputError, match="damaged model files"):
        TrainedModel.load(folder)


def test_the_blend_takes_what_each_model_knows() -> None:
    """Two halves of a signal, one visible to each model: the stack (equal weights on the
    two calibrated log-odds, Platt-scaled on val) ranks test journeys better than either."""
    from journeys.baselines import BaselineSettings, fit_baseline

    rng = np.random.default_rng(0)
    n = 3000
    clicks = rng.integers(1, 8, n)  # what the boosting model sees (the journey's length)
    hidden = rng.normal(size=n)  # what only the "transformer" sees
    log_odds = 0.6 * (clicks - 4) + 1.2 * hidden - 1.0
    labels = (rng.random(n) < 1 / (1 + np.exp(-log_odds))).astype(np.int8)
    frame = pl.DataFrame(
        {
            "journey_id": [f"j{i}" for i in range(n)],
            "event_type": [["click"] * int(c) for c in clicks],
            "n_events_total": clicks,
            "label": labels,
        }
    ).with_columns(  # a click a minute
        event_time=pl.col("event_type").list.eval(
            pl.lit(datetime(2026, 1, 1, tzinfo=UTC)) + pl.duration(minutes=pl.int_range(pl.len()))
        )
    )
    transformer = 1.2 * hidden + rng.normal(scale=0.3, size=n)
    train, val, test = frame[:1500], frame[1500:2250], frame[2250:]
    booster = fit_baseline("hgb_aggregates", train, BaselineSettings())
    booster_val = logit(booster.predict_proba(val))
    stack = fit_stack(booster, val["label"].to_numpy(), transformer[1500:2250], booster_val, 1.0)
    y_test = test.get_column("label").to_numpy()
    stacked = roc_auc_score(y_test, stack.combine(transformer[2250:], test))
    assert stacked > roc_auc_score(y_test, transformer[2250:]) + 0.03
    assert stacked > roc_auc_score(y_test, stack.booster_logits(test)) + 0.03
    # Equal weights on the calibrated log-odds: the ranking is the blend's, whatever Platt
    # scaling fitted on val.
    expected = blended(transformer[2250:], logit(booster.predict_proba(test)))
    assert roc_auc_score(y_test, expected) == pytest.approx(stacked)


def test_a_blend_that_ranks_val_backwards_gets_no_calibration_that_turns_it_around() -> None:
    from journeys.stacking import platt

    rng = np.random.default_rng(0)
    labels = (rng.random(2000) < 0.3).astype(np.int64)
    backwards = -labels + rng.normal(size=labels.size)
    slope, intercept = platt(backwards, labels)
    assert slope == 0.0 and intercept == pytest.approx(np.log(0.3 / 0.7), abs=0.1)
    assert platt(-backwards, labels)[0] > 0

"""`train.stack`: the transformer stacked with gradient boosting on journey aggregates, a
model the registry holds and the batch scorer runs, with the transformer's attention."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from sklearn.metrics import roc_auc_score

from journeys.config import load_config
from journeys.datasets import labelled, scan_journeys
from journeys.errors import InputError
from journeys.stacking import BOOSTER_FILE, fit_stack
from journeys.trained_model import TrainedModel, load_model

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
    ]
    config = load_config(ROOT / "conf" / "ad_clicks.yaml", sets)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        ingest(config)
        result = train_command(config)
    return config, result, tmp


def test_the_registered_stack_serves_what_training_measured(stacked) -> None:
    config, result, _ = stacked
    metrics = result.metrics
    assert {"stacked_test_roc_auc", "stacked_val_roc_auc", "test_roc_auc"} <= set(metrics)
    trained = load_model(result.model_uri, f"sqlite:///{stacked[2] / 'mlflow.db'}")
    assert trained.stack is not None
    test = labelled(scan_journeys(config.paths.journeys), ("test",)).collect()
    served = trained.predict_proba(test)
    auc = roc_auc_score(test.get_column("label").to_numpy(), served)
    assert auc == pytest.approx(metrics["stacked_test_roc_auc"], abs=1e-6)
    # The blend is not the transformer alone: both models carry weight.
    weights = trained.stack.weights
    assert weights[0] > 0 and weights[1] > 0


def test_attention_stays_the_transformers_and_only_the_probability_changes(stacked) -> None:
    from journeys.score import score_frame

    config, result, tmp = stacked
    trained = load_model(result.model_uri, f"sqlite:///{tmp / 'mlflow.db'}")
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


def test_a_saved_stack_round_trips_and_a_foreign_booster_is_refused(
    stacked, tmp_path: Path
) -> None:
    from skops.io import dump

    config, result, tmp = stacked
    trained = load_model(result.model_uri, f"sqlite:///{tmp / 'mlflow.db'}")
    trained.save(tmp_path / "model")
    again = TrainedModel.load(tmp_path / "model")
    test = labelled(scan_journeys(config.paths.journeys), ("test",)).collect()
    np.testing.assert_allclose(again.predict_proba(test), trained.predict_proba(test))

    dump(NotABooster(), tmp_path / "model" / BOOSTER_FILE)
    with pytest.raises(InputError, match="damaged model files"):
        TrainedModel.load(tmp_path / "model")


def test_the_blend_takes_what_each_model_knows() -> None:
    """Two halves of a signal, one visible to each model: the stack, fitted on val, ranks
    test journeys better than either (and its val predictions are cross-fitted)."""
    from journeys.baselines import JourneyAggregates

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
    fitted = fit_stack(
        train, val, test, transformer[1500:2250], transformer[2250:],
        JourneyAggregates([], "UTC", None), seed=0,
    )  # fmt: skip
    y_test = test.get_column("label").to_numpy()
    stacked = roc_auc_score(y_test, fitted.test_logits)
    assert stacked > roc_auc_score(y_test, transformer[2250:]) + 0.03
    assert stacked > roc_auc_score(y_test, fitted.stack.booster_logits(test)) + 0.03
    # Cross-fitted: not the val fit's own scores.
    val_fit = fitted.stack.combine(transformer[1500:2250], val)
    assert not np.allclose(fitted.val_logits, val_fit)

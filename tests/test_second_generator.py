"""The second generator writes a log the product ingests unchanged, with ground truth that
matches what ingest builds, and each of its mechanics shows in the labels."""

from __future__ import annotations

import contextlib
import io
from dataclasses import fields
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from benchmarks.second_generator import (
    CHANNELS,
    LOG_COLUMNS,
    TIMESTAMP_FORMAT,
    TrueModel,
    bayes_roc_auc,
    counts_roc_auc,
    generate,
)
from journeys import simulate
from journeys.config import load_config
from journeys.datasets import labelled, scan_journeys
from journeys.ingest import ingest

ROOT = Path(__file__).resolve().parents[1]
USERS = 5_000  # about 8,000 journeys: enough conversions at 5% for the AUC comparisons
VISIT_GAP = "30m"  # the model's default visit threshold; the generator's visits survive it
ISO_MS = r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$"


def ingest_default(raw: Path, work: Path) -> tuple[dict, pl.DataFrame]:
    """Ingest `raw` with conf/default.yaml as it is (only the paths moved)."""
    config = load_config(
        ROOT / "conf" / "default.yaml",
        [
            f"paths.raw={raw}",
            f"paths.journeys={work / 'j'}",
            f"paths.quarantine={work / 'q'}",
        ],
    )
    with contextlib.redirect_stdout(io.StringIO()):
        report = ingest(config)
    return report, scan_journeys(work / "j").collect()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, pl.DataFrame]:
    raw = generate(tmp_path_factory.mktemp("second"), users=USERS, seed=3)
    report, journeys = ingest_default(raw, tmp_path_factory.mktemp("ingested"))
    return raw, report, journeys


def truth(raw: Path) -> pl.DataFrame:
    return pl.read_parquet(raw / "_truth" / "journeys.parquet")


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    a = generate(tmp_path / "a", users=400, seed=1)
    b = generate(tmp_path / "b", users=400, seed=1)
    c = generate(tmp_path / "c", users=400, seed=2)
    assert (a / "events.csv").read_bytes() == (b / "events.csv").read_bytes()
    assert (a / "events.csv").read_bytes() != (c / "events.csv").read_bytes()
    assert truth(a).equals(truth(b))
    # atomic writes leave no temporaries behind
    assert sorted(p.name for p in a.rglob("*")) == [
        "_truth",
        "events.csv",
        "events.parquet",
        "journeys.parquet",
        "summary.json",
    ]


def test_log_is_what_the_default_configuration_reads(run: tuple[Path, dict, pl.DataFrame]) -> None:
    raw, report, _ = run
    log = pl.read_csv(raw / "events.csv", infer_schema=False)
    assert tuple(log.columns) == LOG_COLUMNS
    assert TIMESTAMP_FORMAT == simulate.TIMESTAMP_FORMAT
    assert log.get_column("timestamp").str.contains(ISO_MS).all()
    assert log.null_count().sum_horizontal().item() == 0
    # every row valid, none quarantined or dropped, every purchase closes a journey
    assert report["rows_read"] == report["rows_valid"] == log.height
    assert report["quarantined_total"] == 0
    assert report["duplicates_dropped"] == 0
    assert report["conversions_without_journey"] == 0
    assert report["journeys_converted"] == log.get_column("event_type").eq("purchase").sum()


def test_realised_conversion_rate_is_near_the_target(
    run: tuple[Path, dict, pl.DataFrame], tmp_path: Path
) -> None:
    journeys = truth(run[0])
    assert journeys.get_column("true_probability").mean() == pytest.approx(0.05, abs=1e-6)
    assert journeys.get_column("converted").mean() == pytest.approx(0.05, abs=0.01)

    other = truth(generate(tmp_path, users=2_000, seed=5, conversion_rate=0.2))
    assert other.get_column("true_probability").mean() == pytest.approx(0.2, abs=1e-6)
    assert other.get_column("converted").mean() == pytest.approx(0.2, abs=0.02)


def test_ingested_journeys_are_the_truth_journeys(run: tuple[Path, dict, pl.DataFrame]) -> None:
    raw, _, journeys = run
    joined = journeys.join(truth(raw), on="journey_id", how="full", coalesce=True)
    assert joined.height == journeys.height == truth(raw).height  # ids match one to one
    assert (joined.get_column("label") == joined.get_column("converted").cast(pl.Int8)).all()
    # no event cut by journey.max_events: the model sees every event the truth used
    assert (joined.get_column("n_events_total") == joined.get_column("n_events_right")).all()
    assert (joined.get_column("n_events") == joined.get_column("n_events_total")).all()
    assert set(journeys.get_column("split").unique()) == {"train", "val", "test", "none"}


def effects_from_log(log_path: Path) -> pl.DataFrame:
    """The true model's inputs recomputed from the raw log alone, by rules read off the
    docstring (visits split at VISIT_GAP): the truth is a function of what the log shows."""
    log = (
        pl.read_csv(log_path)
        .with_columns(
            ts=pl.col("timestamp").str.strptime(pl.Datetime("ms", "UTC"), TIMESTAMP_FORMAT)
        )
        .filter(pl.col("event_type") != "purchase")
        .with_columns(gap=pl.col("ts").diff().over("user_id"))
        .with_columns(
            new_journey=pl.col("gap").is_null() | (pl.col("gap") > pl.duration(days=7)),
            new_visit=pl.col("gap").is_null() | (pl.col("gap") > pl.duration(minutes=30)),
        )
        .with_columns(
            journey=pl.col("new_journey").cum_sum().over("user_id"),
            visit=pl.col("new_visit").cum_sum().over("user_id"),
        )
        .with_columns(
            journey_id=pl.format(
                "{}-{}", "user_id", pl.col("ts").first().over("user_id", "journey").dt.epoch("us")
            ),
            carts_before=(pl.col("event_type") == "add_to_cart")
            .cast(pl.Int32)
            .cum_sum()
            .shift(1, fill_value=0)
            .over("user_id", "visit"),
            cart_rank=(pl.col("event_type") == "add_to_cart")
            .cast(pl.Int32)
            .cum_sum()
            .over("user_id", "journey"),
        )
    )
    is_cart = pl.col("event_type") == "add_to_cart"
    n_carts = is_cart.sum().over("journey_id")
    # checkouts after the journey's last cart, in that cart's visit
    last_cart_visit = pl.col("visit").filter(is_cart).last().over("journey_id")
    rescued = (
        (pl.col("event_type") == "checkout_start")
        & (pl.col("cart_rank") == n_carts)
        & (pl.col("visit") == last_cart_visit)
    )
    log = log.with_columns(rescued=rescued, n_carts=n_carts)
    return log.group_by("journey_id").agg(
        engagement=pl.col("visit").n_unique().log(),
        cart_checkout_in_visit=(
            (pl.col("event_type") == "checkout_start") & (pl.col("carts_before") > 0)
        ).any(),
        abandoned_last_cart=(pl.col("n_carts").first() > 0) & ~pl.col("rescued").any(),
        click_hours=(
            pl.col("ts").last() - pl.col("ts").filter(pl.col("event_type") == "ad_click").last()
        ).dt.total_milliseconds()
        / 3_600_000,
        first_channel=pl.col("channel").first(),
        weekend=pl.col("ts").last().dt.weekday() >= 6,
    )


def test_true_probability_is_a_function_of_the_log(run: tuple[Path, dict, pl.DataFrame]) -> None:
    raw = run[0]
    model = TrueModel()
    got = effects_from_log(raw / "events.csv").join(truth(raw), on="journey_id", validate="1:1")
    assert got.height == truth(raw).height
    for name in ("engagement", "cart_checkout_in_visit", "abandoned_last_cart", "weekend"):
        assert np.allclose(got[name].cast(pl.Float64), got[f"effect_{name}"]), name
    recency = (-got["click_hours"] / model.recency_scale_h).exp().fill_null(0.0)
    assert np.allclose(recency, got["effect_click_recency"])
    for channel in CHANNELS:
        assert (
            (got["first_channel"] == channel)
            == got[f"effect_first_touch_{channel}"].cast(pl.Boolean)
        ).all()


def test_each_mechanic_shows_in_the_labels_with_its_documented_sign(tmp_path: Path) -> None:
    # A logistic regression on the true model's inputs recovers its coefficients from the
    # labels alone: every mechanic is in the data, in the documented direction.
    model = TrueModel()
    journeys = truth(generate(tmp_path, users=8_000, seed=11, conversion_rate=0.25))
    names = [
        c for c in journeys.columns if c.startswith("effect_") and c != "effect_first_touch_direct"
    ]
    fit = LogisticRegression(C=1e6, max_iter=2_000).fit(
        journeys.select(names).to_numpy(), journeys.get_column("converted").to_numpy()
    )
    fitted = dict(zip(names, fit.coef_[0], strict=True))
    expected = {
        f"effect_{f.name}": getattr(model, f.name)
        for f in fields(TrueModel)
        if f.name not in ("first_touch", "recency_scale_h")
    } | {
        f"effect_first_touch_{channel}": value
        for channel, value in zip(CHANNELS, model.first_touch, strict=True)
        if channel != "direct"
    }
    assert set(expected) == set(fitted)
    for name, value in expected.items():
        assert np.sign(fitted[name]) == np.sign(value), (name, fitted[name], value)
        assert fitted[name] == pytest.approx(value, abs=0.35), name


def test_counts_carry_signal_but_leave_room_for_a_sequence_model(
    run: tuple[Path, dict, pl.DataFrame],
) -> None:
    raw, _, journeys = run
    train = labelled(journeys.lazy(), ("train",)).collect()
    held_out = labelled(journeys.lazy(), ("val", "test")).collect()
    counts = counts_roc_auc(train, held_out)
    bayes = bayes_roc_auc(held_out, raw / "_truth")
    length = roc_auc_score(held_out["label"], held_out["n_events"])
    assert length > 0.55  # intent drives length and conversion alike
    assert counts > 0.6
    assert bayes > counts + 0.05  # order, recency, first touch and timing are beyond counts


def test_causal_flags_mark_the_events_that_raised_the_odds(
    run: tuple[Path, dict, pl.DataFrame],
) -> None:
    raw = run[0]
    events = pl.read_parquet(raw / "_truth" / "events.parquet").join(
        truth(raw).select("journey_id", "effect_cart_checkout_in_visit", "effect_click_recency"),
        on="journey_id",
    )
    first = events.filter(pl.col("position") == 0)
    raising = [c for c, v in zip(CHANNELS, TrueModel().first_touch, strict=True) if v > 0]
    assert first.filter(pl.col("channel").is_in(raising))["causal"].all()
    # a direct first visit raised nothing: no first-touch lift, no ad click, no return visit
    assert not first.filter(pl.col("channel") == "direct")["causal"].any()
    paired = events.filter(pl.col("effect_cart_checkout_in_visit") == 1)
    causal_types = paired.filter("causal").group_by("journey_id").agg(pl.col("event_type").unique())
    assert causal_types.height == paired["journey_id"].n_unique()
    assert causal_types["event_type"].list.contains("checkout_start").all()
    assert causal_types["event_type"].list.contains("add_to_cart").all()
    # the weekend is no event's doing, and unpaired abandoned carts raise nothing
    abandoned = events.filter(
        (pl.col("event_type") == "add_to_cart") & (pl.col("effect_cart_checkout_in_visit") == 0)
    )
    assert not abandoned["causal"].any()


def test_bayes_auc_refuses_journeys_of_another_log(
    run: tuple[Path, dict, pl.DataFrame], tmp_path: Path
) -> None:
    raw, _, journeys = run
    test = labelled(journeys.lazy(), ("test",)).collect()
    assert 0.6 < bayes_roc_auc(test, raw / "_truth") <= 1.0
    other = generate(tmp_path, users=300, seed=99)
    with pytest.raises(ValueError, match="in the truth"):
        bayes_roc_auc(test, other / "_truth")

"""The simulator writes the promised files, with the promised structure and ground truth."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from journeys.simulate import (
    DIRTY_KINDS,
    EVENT_TYPES,
    RAW_COLUMNS,
    Behaviour,
    TrueModel,
    simulate,
)

MAX_GAP = timedelta(days=7)
TS_FORMAT = "%Y-%m-%dT%H:%M:%S%.3fZ"


def read_log(paths: list[Path] | Path) -> pl.DataFrame:
    """The raw log as written: every column a string but the price (JSON writes 17.0 as 17),
    empty fields null."""
    paths = [paths] if isinstance(paths, Path) else paths
    frames = []
    for path in paths:
        if path.suffix == ".csv":
            frames.append(pl.read_csv(path, infer_schema=False))
        elif path.suffix == ".jsonl":
            frames.append(pl.read_ndjson(path, schema=dict.fromkeys(RAW_COLUMNS, pl.String)))
        else:
            frames.append(pl.read_parquet(path).cast(pl.String))
    return pl.concat(frames).with_columns(pl.col("price").cast(pl.Float64))


def parsed(log: pl.DataFrame) -> pl.DataFrame:
    """Add `ts` (UTC datetime; null where the text is not a timestamp)."""
    return log.with_columns(
        ts=pl.col("timestamp").str.strptime(pl.Datetime("ms", "UTC"), TS_FORMAT, strict=False)
    )


def rebuild_journeys(log: pl.DataFrame) -> pl.DataFrame:
    """Split a clean log into journeys by the contract: gap > 7 days, or after a purchase."""
    return (
        parsed(log)
        .sort("user_id", "ts")
        .with_columns(
            gap=pl.col("ts").diff().over("user_id"),
            after_purchase=(pl.col("event_type").shift() == "purchase").over("user_id"),
        )
        .with_columns(
            new=pl.col("gap").is_null() | (pl.col("gap") > MAX_GAP) | pl.col("after_purchase")
        )
        .with_columns(number=pl.col("new").cum_sum().over("user_id"))
        .with_columns(
            journey_id=pl.format(
                "{}-{}",
                "user_id",
                pl.col("ts").min().over("user_id", "number").cast(pl.Datetime("us")).dt.epoch("us"),
            )
        )
    )


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pl.DataFrame]:
    out = tmp_path_factory.mktemp("clean")
    result = simulate(out, users=3_000, seed=7)
    return out, read_log(result.events_path)


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    kwargs = {"users": 500, "dirty_rate": 0.05, "shuffle": True}
    first = simulate(tmp_path / "a", seed=3, **kwargs)
    again = simulate(tmp_path / "b", seed=3, **kwargs)
    other = simulate(tmp_path / "c", seed=4, **kwargs)
    for name in ("events.csv", "_truth/journeys.parquet", "_truth/events.parquet"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert first.events_path.read_bytes() != other.events_path.read_bytes()
    assert (first.n_events, first.n_journeys, first.dirty) == (
        again.n_events,
        again.n_journeys,
        again.dirty,
    )


def test_layout_and_columns(clean_run: tuple[Path, pl.DataFrame]) -> None:
    out, log = clean_run
    assert (out / "events.csv").is_file()
    assert {p.name for p in (out / "_truth").iterdir()} == {
        "journeys.parquet",
        "events.parquet",
        "summary.json",
    }
    assert log.columns == list(RAW_COLUMNS)
    assert log["user_id"].str.contains(r"^u\d{6}$").all()
    assert log["timestamp"].str.contains(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$").all()
    assert set(log["event_type"]) == {
        "search",
        "page_view",
        "product_view",
        "click",
        "add_to_cart",
        "checkout",
        "purchase",
    }
    assert set(log["device"]) == {"mobile", "desktop", "tablet"}
    assert log["channel"].null_count() == 0
    assert set(log["channel"]) <= {
        "paid_search",
        "display",
        "social",
        "email",
        "affiliate",
        "direct",
    }
    # campaigns belong to paid touches; direct visits have none
    assert (log["campaign"].is_null() == (log["channel"] == "direct")).all()


def test_sorted_unique_timestamps_inside_the_range(clean_run: tuple[Path, pl.DataFrame]) -> None:
    _, log = clean_run
    frame = parsed(log)
    assert frame["ts"].null_count() == 0
    assert frame.select(pl.struct("user_id", "ts").is_unique().all()).item()
    assert frame.equals(frame.sort("user_id", "ts"))
    start = datetime(2026, 1, 1, tzinfo=UTC)
    assert frame["ts"].min() >= start
    assert frame["ts"].max() < start + timedelta(days=90)


def test_journeys_match_truth_and_gaps(clean_run: tuple[Path, pl.DataFrame]) -> None:
    out, log = clean_run
    rebuilt = rebuild_journeys(log)
    truth = pl.read_parquet(out / "_truth" / "journeys.parquet")

    # gaps: < 7 days inside a journey, > 7 days between journeys of a user
    inner = rebuilt.filter(~pl.col("new"))["gap"]
    between = rebuilt.filter(pl.col("new") & pl.col("gap").is_not_null())["gap"]
    assert inner.max() < MAX_GAP
    assert between.min() > MAX_GAP

    per_journey = (
        rebuilt.group_by("journey_id")
        .agg(
            user_id=pl.col("user_id").first(),
            n_purchases=(pl.col("event_type") == "purchase").sum(),
            last_is_purchase=pl.col("event_type").sort_by("ts").last() == "purchase",
            n_events=(pl.col("event_type") != "purchase").sum().cast(pl.Int64),
            start_time=pl.col("ts").min(),
        )
        .sort("journey_id")
    )
    expected = truth.sort("journey_id")
    assert per_journey["journey_id"].to_list() == expected["journey_id"].to_list()
    assert per_journey["n_events"].to_list() == expected["n_events"].to_list()
    converted = expected["converted"]
    # every converted journey ends with exactly one purchase; others have none
    assert (per_journey["n_purchases"] == converted.cast(pl.UInt32)).all()
    assert (per_journey["last_is_purchase"] == converted).all()
    assert (
        per_journey["start_time"].cast(pl.Datetime("us", "UTC")) == expected["start_time"]
    ).all()
    assert expected["true_probability"].dtype == pl.Float64
    assert expected["true_probability"].is_between(0, 1, closed="none").all()


def test_truth_events_are_the_log_without_purchases(clean_run: tuple[Path, pl.DataFrame]) -> None:
    out, log = clean_run
    events = pl.read_parquet(out / "_truth" / "events.parquet")
    assert events.schema["timestamp"] == pl.Datetime("us", "UTC")
    no_purchase = parsed(log).filter(pl.col("event_type") != "purchase")
    assert events["user_id"].to_list() == no_purchase["user_id"].to_list()
    assert events["event_type"].to_list() == no_purchase["event_type"].to_list()
    assert (events["timestamp"] == no_purchase["ts"].cast(pl.Datetime("us", "UTC"))).all()
    rebuilt = rebuild_journeys(log).filter(pl.col("event_type") != "purchase")
    assert events["journey_id"].to_list() == rebuilt["journey_id"].to_list()
    positions = events.select(pl.int_range(pl.len()).over("journey_id").cast(pl.Int32))
    assert (events["position"] == positions.to_series()).all()


def test_lengths_and_causal_events(clean_run: tuple[Path, pl.DataFrame]) -> None:
    out, _ = clean_run
    journeys = pl.read_parquet(out / "_truth" / "journeys.parquet")
    events = pl.read_parquet(out / "_truth" / "events.parquet")
    lengths = journeys["n_events"]
    assert lengths.min() >= 2
    assert lengths.max() <= 150
    assert 5 <= lengths.median() <= 20
    assert 0.05 < events["causal"].mean() < 0.5
    # causal events explain conversions: converted journeys hold more of them
    causal = events.group_by("journey_id").agg(pl.col("causal").sum()).join(journeys, "journey_id")
    by_label = causal.group_by("converted").agg(pl.col("causal").mean())
    means = dict(zip(by_label["converted"], by_label["causal"], strict=True))
    assert means[True] > 1.5 * means[False]


def test_timing_and_price_effects_are_what_the_log_shows(
    clean_run: tuple[Path, pl.DataFrame],
) -> None:
    """The truth's timing and price effects, recomputed from the events a model sees."""
    out, _ = clean_run
    m, b = TrueModel(), Behaviour()
    journeys = pl.read_parquet(out / "_truth" / "journeys.parquet")
    events = pl.read_parquet(out / "_truth" / "events.parquet")
    priced = pl.col("event_type").is_in([EVENT_TYPES[i] for i in b.priced_events])
    assert events.select((pl.col("price").is_not_null() == priced).all()).item()
    assert events["price"].min() > 0

    gap_s = pl.col("timestamp").diff().over("journey_id").dt.total_seconds(fractional=True)
    last_hour = pl.col("timestamp").last().dt.hour() + pl.col("timestamp").last().dt.minute() / 60
    log_price = pl.col("price").log()
    recomputed = (
        events.sort("journey_id", "position")
        .with_columns(visit=(gap_s.fill_null(0) >= b.event_gap_max_s).cum_sum().over("journey_id"))
        .group_by("journey_id")
        .agg(
            hour=np.cos(
                2
                * np.pi
                * (last_hour + pl.col("timestamp").last().dt.second() / 3600 - m.hour_peak)
                / 24
            ),
            first_visit_min=(
                pl.col("timestamp").filter(pl.col("visit") == 0).max() - pl.col("timestamp").first()
            ).dt.total_seconds(fractional=True)
            / 60,
            premium=pl.when(pl.col("price").count() >= 2)
            .then(log_price.drop_nulls().last() - log_price.mean())
            .otherwise(0.0),
        )
        .join(journeys, on="journey_id")
    )
    assert np.allclose(recomputed["hour"], recomputed["effect_hour_of_day"], atol=1e-4)
    assert np.allclose(recomputed["premium"], recomputed["effect_price_premium"], atol=1e-9)
    first_visit = np.log1p(recomputed["first_visit_min"].to_numpy() / m.first_visit_scale_min)
    # A visit gap clipped to exactly event_gap_max_s reads as one visit here: rare.
    same = np.isclose(first_visit, recomputed["effect_long_first_visit"].to_numpy(), atol=1e-9)
    assert same.mean() > 0.99
    # Each effect varies: a model can learn it, and a model that ignores it loses it.
    for name in ("hour_of_day", "long_first_visit", "price_premium"):
        assert journeys[f"effect_{name}"].std() > 0.2


@pytest.mark.parametrize("rate", [0.04, 0.15])
def test_conversion_rate_near_configured(tmp_path: Path, rate: float) -> None:
    simulate(tmp_path, users=5_000, seed=11, conversion_rate=rate)
    journeys = pl.read_parquet(tmp_path / "_truth" / "journeys.parquet")
    n = journeys.height
    realised = journeys["converted"].mean()
    # the calibrated intercept makes the expected rate exact; allow 4 binomial std devs
    assert journeys["true_probability"].mean() == pytest.approx(rate, abs=1e-6)
    assert abs(realised - rate) < 4 * np.sqrt(rate * (1 - rate) / n)


def test_dirt_counts_match_file_and_clean_rows_unchanged(tmp_path: Path) -> None:
    clean = simulate(tmp_path / "clean", users=2_000, seed=5)
    dirty = simulate(tmp_path / "dirty", users=2_000, seed=5, dirty_rate=0.2)
    log = parsed(read_log(dirty.events_path))
    assert set(dirty.dirty) == set(DIRTY_KINDS)
    assert log.height == dirty.n_events == clean.n_events + sum(dirty.dirty.values())
    assert sum(dirty.dirty.values()) / dirty.n_events == pytest.approx(0.2, abs=0.005)
    assert min(dirty.dirty.values()) > 0.9 * max(dirty.dirty.values())

    missing_user = log["user_id"].is_null()
    missing_type = log["event_type"].is_null()
    bad_ts = log["ts"].is_null()
    assert missing_user.sum() == dirty.dirty["missing_user_id"]
    assert missing_type.sum() == dirty.dirty["missing_event_type"]
    assert bad_ts.sum() == dirty.dirty["bad_timestamp"]
    raw = log.drop("ts")
    assert raw.height - raw.unique().height == dirty.dirty["duplicates"]
    # disjoint kinds: no row has two faults, duplicates are copies of valid rows only
    assert (missing_user.cast(int) + missing_type.cast(int) + bad_ts.cast(int)).max() == 1
    valid = raw.filter(~missing_user & ~missing_type & ~bad_ts)
    assert valid.is_duplicated().sum() == 2 * dirty.dirty["duplicates"]

    # the clean log is the dirty one minus its dirt, in the same order
    assert_frame_equal(valid.unique(maintain_order=True), read_log(clean.events_path))
    for name in ("journeys.parquet", "events.parquet"):
        assert (clean.truth_dir / name).read_bytes() == (dirty.truth_dir / name).read_bytes()


def test_shuffle_keeps_rows(tmp_path: Path) -> None:
    ordered = simulate(tmp_path / "a", users=1_000, seed=2, dirty_rate=0.1)
    shuffled = simulate(tmp_path / "b", users=1_000, seed=2, dirty_rate=0.1, shuffle=True)
    a, b = read_log(ordered.events_path), read_log(shuffled.events_path)
    assert not a.equals(b)
    assert_frame_equal(a.sort(pl.all(), nulls_last=True), b.sort(pl.all(), nulls_last=True))


def test_formats_hold_the_same_rows_and_files_split(tmp_path: Path) -> None:
    kwargs = {"users": 800, "seed": 9, "dirty_rate": 0.1}
    logs = {}
    for fmt in ("csv", "jsonl", "parquet"):
        result = simulate(tmp_path / fmt, format=fmt, **kwargs)
        assert result.events_path == tmp_path / fmt / f"events.{fmt}"
        logs[fmt] = read_log(result.events_path)
        assert logs[fmt].height == result.n_events
    assert_frame_equal(logs["csv"], logs["jsonl"])
    assert_frame_equal(logs["csv"], logs["parquet"])

    split = simulate(tmp_path / "split", n_files=3, **kwargs)
    names = sorted(p.name for p in (tmp_path / "split").glob("events*"))
    assert names == ["events-000.csv", "events-001.csv", "events-002.csv"]
    assert [p.name for p in split.events_paths] == names
    parts = [read_log(p) for p in split.events_paths]
    assert all(part.height > 0 for part in parts)
    assert_frame_equal(pl.concat(parts), logs["csv"])


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    users=st.integers(1, 40),
    seed=st.integers(0, 2**32),
    days=st.integers(1, 60),
    rate=st.floats(0.01, 0.9),
)
def test_any_small_run_rebuilds_into_its_journeys(
    tmp_path_factory: pytest.TempPathFactory, users: int, seed: int, days: int, rate: float
) -> None:
    out = tmp_path_factory.mktemp("prop")
    result = simulate(out, users=users, seed=seed, days=days, conversion_rate=rate)
    rebuilt = rebuild_journeys(read_log(result.events_path))
    truth = pl.read_parquet(out / "_truth" / "journeys.parquet")
    assert rebuilt["journey_id"].n_unique() == truth.height == result.n_journeys
    assert set(rebuilt["journey_id"]) == set(truth["journey_id"])
    assert truth["user_id"].n_unique() == users == result.n_users


@pytest.mark.slow
def test_order_matters_bayes_beats_bag_of_counts(tmp_path: Path) -> None:
    """A bag-of-counts model must fall clearly short of the true probabilities."""
    sklearn = pytest.importorskip("sklearn")
    del sklearn
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import StratifiedKFold, cross_val_predict
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    simulate(tmp_path, users=12_000, seed=1)
    journeys = pl.read_parquet(tmp_path / "_truth" / "journeys.parquet").sort("journey_id")
    events = pl.read_parquet(tmp_path / "_truth" / "events.parquet")
    by_type = events.pivot(
        on="event_type", index="journey_id", values="channel", aggregate_function="len"
    )
    by_channel = events.pivot(
        on="channel", index="journey_id", values="event_type", aggregate_function="len"
    )
    features = (
        journeys.select("journey_id")
        .join(by_type, on="journey_id", how="left")
        .join(by_channel, on="journey_id", how="left")
        .fill_null(0)
        .sort("journey_id")
        .drop("journey_id")
        .to_numpy()
        .astype(float)
    )
    features = np.hstack([features, np.log1p(features)])
    labels = journeys["converted"].to_numpy()

    bayes = roc_auc_score(labels, journeys["true_probability"].to_numpy())
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2_000))
    folds = StratifiedKFold(5, shuffle=True, random_state=0)
    bag = cross_val_predict(model, features, labels, cv=folds, method="predict_proba")[:, 1]
    bag_auc = roc_auc_score(labels, bag)
    assert 0.78 < bayes < 0.92
    assert bayes - bag_auc > 0.05, (bayes, bag_auc)

"""Baselines: bag-of-events counts, last-touch rates, and that the learned ones learn."""

from __future__ import annotations

import pickle
from datetime import UTC, datetime, timedelta

import numpy as np
import polars as pl
import pytest
from conftest import make_journeys_dataset

from journeys import baselines
from journeys.inputs import CategoricalInput
from journeys.metrics import binary_metrics

CHANNEL, DEVICE = CategoricalInput("channel"), CategoricalInput("device")


def frame(rows: list[tuple[list[str], list[str], int]]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "event_type": [events for events, _, _ in rows],
            "channel": [channels for _, channels, _ in rows],
            "n_events_total": [len(events) for events, _, _ in rows],
            "label": [label for _, _, label in rows],
        }
    )


def test_token_counts_cover_events_features_and_bigrams() -> None:
    journeys = frame(
        [
            (["view", "view", "click"], ["search", "email", None], 1),
            ([], [], 0),  # an empty journey contributes no tokens
        ]
    )
    counts = baselines.token_counts(journeys, ["channel"], bigrams=True)
    got = {(r["row"], r["token"]): r["count"] for r in counts.iter_rows(named=True)}
    assert got == {
        (0, "event_type=view"): 2,
        (0, "event_type=click"): 1,
        (0, "channel=search"): 1,
        (0, "channel=email"): 1,
        (0, "channel=(none)"): 1,
        (0, "bigram=view>view"): 1,
        (0, "bigram=view>click"): 1,
    }
    assert baselines.token_counts(journeys, [], bigrams=False).height == 2


def test_bag_of_events_uses_train_tokens_only() -> None:
    train = frame([(["view", "click"], ["search", "search"], 1), (["view"], ["email"], 0)])
    test = frame([(["purchase_intent", "view"], ["tv", "search"], 0)])
    bag = baselines.BagOfEvents(["channel"], bigrams=False).fit(train)
    assert bag.n_columns == 4 + 1  # view, click, search, email + log length
    matrix = bag.transform(test).toarray()
    assert matrix.shape == (1, bag.n_columns)
    # Only `view` and `search` are known: two token columns plus the length column.
    assert np.count_nonzero(matrix) == 3
    assert matrix[0, -1] == pytest.approx(np.log1p(2))


def test_last_touch_shrinks_rare_keys_towards_the_base_rate() -> None:
    train = frame(
        [(["view", "click"], ["search", "email"], 1)] * 2 + [(["view"], ["search"], 0)] * 98
    )
    test = frame([(["x", "click"], ["y", "email"], 0), (["never_seen"], ["search"], 0)])
    probs = baselines.fit_predict("last_touch", train, test, [CHANNEL])
    base = 0.02
    pseudo = baselines.LAST_TOUCH_PSEUDO_COUNT
    assert probs[0] == pytest.approx((2 + pseudo * base) / (2 + pseudo))  # not 100 %
    assert probs[1] == pytest.approx(base)  # unseen key -> base rate
    assert baselines.fit_predict("prior", train, test, [CHANNEL]).tolist() == [base, base]


@pytest.mark.parametrize("bigrams", [False, True])
def test_learned_baselines_beat_the_prior(tmp_path, bigrams: bool) -> None:
    folder = make_journeys_dataset(tmp_path / "journeys", n=800, seed=3)
    journeys = pl.read_parquet(folder / "part-00000.parquet")
    train = journeys.filter(pl.col("split") == "train")
    test = journeys.filter(pl.col("split") == "test")
    labels = test.get_column("label").to_numpy()
    auc = {}
    for name in baselines.BASELINES:
        probs = baselines.fit_predict(name, train, test, [CHANNEL, DEVICE], bigrams=bigrams)
        assert probs.shape == (test.height,) and ((probs >= 0) & (probs <= 1)).all()
        auc[name] = binary_metrics(labels, probs)["test_roc_auc"]
    assert auc["prior"] == pytest.approx(0.5)
    assert auc["logreg"] > 0.6 and auc["hgb"] > 0.6 and auc["last_touch"] > 0.5


def test_timing_aggregates_read_durations_gaps_visits_and_local_hours() -> None:
    """Gaps of 60 s, 2 h and 30 s: duration, gap statistics, two visits at a 30-minute rule,
    and the first and last event's hour and weekday in the configured time zone."""
    start = datetime(2026, 3, 6, 22, 30, tzinfo=UTC)  # a Friday, 23:30 in Paris
    times = [start + timedelta(seconds=s) for s in (0, 60, 60 + 7200, 60 + 7200 + 30)]
    journeys = pl.DataFrame(
        {"event_time": [times, times[:1]], "n_events_total": [4, 1]},
        schema={"event_time": pl.List(pl.Datetime("us", "UTC")), "n_events_total": pl.Int64},
    )
    got = baselines.timing_aggregates(journeys, "Europe/Paris", visit_gap_s=1800).to_dicts()
    assert tuple(got[0]) == baselines.TIMING_AGGREGATES
    assert got[0] == {
        "n_events": 4.0,
        "visits": 2.0,
        "duration_s": 7290.0,
        "gap_mean_s": 2430.0,
        "gap_min_s": 30.0,
        "gap_max_s": 7200.0,
        "gap_last_s": 30.0,
        "first_hour": 23.0,
        "first_weekday": 5.0,
        "last_hour": 1.0,  # two hours later: Saturday
        "last_weekday": 6.0,
    }
    one = got[1]  # a single event: no gaps, one visit, no duration
    assert one["visits"] == 1.0 and one["duration_s"] == 0.0 and one["gap_last_s"] is None


def timing_journeys(n: int, seed: int) -> pl.DataFrame:
    """Journeys whose event types carry no signal: converters come back within a minute for
    their last touch, the others after hours (the shape of a real retargeting log)."""
    rng = np.random.default_rng(seed)
    labels = rng.random(n) < 0.3
    lengths = rng.integers(2, 7, n)
    start = datetime(2026, 1, 1, tzinfo=UTC)
    rows = []
    for label, length in zip(labels, lengths, strict=True):
        gaps = rng.exponential(3600.0, length - 1)
        gaps[-1] = rng.uniform(5, 60) if label else rng.uniform(3600, 7200)
        offsets = np.r_[0.0, np.cumsum(gaps)] + rng.uniform(0, 86400 * 30)
        rows.append(
            {
                "event_type": rng.choice(["view", "click", "search"], length).tolist(),
                "event_time": [start + timedelta(seconds=float(s)) for s in offsets],
                "n_events_total": int(length),
                "label": int(label),
            }
        )
    return pl.DataFrame(rows, schema_overrides={"event_time": pl.List(pl.Datetime("us", "UTC"))})


def test_aggregates_baseline_learns_what_counts_cannot() -> None:
    """When conversion lives in timing alone, bag-of-events boosting is blind to it and
    `hgb_aggregates` is not: the strong baseline a transformer has to beat."""
    train, test = timing_journeys(2000, seed=0), timing_journeys(1000, seed=1)
    labels = test.get_column("label").to_numpy()
    auc = {
        name: binary_metrics(labels, baselines.fit_predict(name, train, test, []))["test_roc_auc"]
        for name in ("hgb", "hgb_aggregates")
    }
    assert auc["hgb"] < 0.6
    assert auc["hgb_aggregates"] > 0.95


def test_a_baseline_is_flagged_only_beyond_the_transformers_interval() -> None:
    transformer = {"test_roc_auc": 0.80, "test_roc_auc_ci_low": 0.78, "test_roc_auc_ci_high": 0.82}
    found = {
        "hgb_aggregates": {"test_roc_auc": 0.83},  # above the interval: flagged
        "hgb": {"test_roc_auc": 0.815},  # better, but within the noise
        "prior": {"test_roc_auc": 0.5},
        "broken": {"test_roc_auc": float("nan")},
    }
    assert baselines.ahead_of_transformer(transformer, found) == ["hgb_aggregates"]
    assert baselines.ahead_of_transformer({"test_roc_auc": 0.8}, found) == []  # no interval


def test_the_trees_give_what_scikit_learn_fitted() -> None:
    """Treelite evaluates the booster scikit-learn fitted: numeric splits, missing values
    and categorical splits included, the probabilities are scikit-learn's to 1e-12, and a
    saved checkpoint reads back to the same trees."""
    from journeys.baselines import Trees, _booster

    rng = np.random.default_rng(0)
    n = 4000
    inputs = rng.normal(size=(n, 6))
    inputs[:, 4] = rng.integers(0, 30, n)  # categorical: a last touch's level
    inputs[:, 5] = rng.integers(0, 4, n)
    inputs[rng.random(n) < 0.15, 1] = np.nan
    inputs[rng.random(n) < 0.05, 4] = np.nan
    signal = inputs[:, 0] + np.isnan(inputs[:, 1]) + (inputs[:, 4] % 5 == 0) * 1.5
    labels = (signal + rng.normal(size=n) > 1).astype(int)
    categorical = np.array([False, False, False, False, True, True])
    fitted = _booster(0, categorical).fit(inputs, labels)
    trees = Trees.of(fitted)

    fresh = rng.normal(size=(1000, 6))
    # Levels the booster never saw come as NaN, as `JourneyAggregates.transform` gives
    # them (scikit-learn reads an unseen level as missing, Treelite as "not on the left").
    fresh[:, 4] = rng.integers(0, 30, 1000)
    fresh[::11, 4] = np.nan
    fresh[:, 5] = rng.integers(0, 4, 1000)
    fresh[::7, 1] = np.nan
    expected = fitted.predict_proba(fresh)[:, 1]
    np.testing.assert_allclose(trees.predict_proba(fresh), expected, rtol=0, atol=1e-12)
    again = Trees.from_bytes(trees.to_bytes())
    np.testing.assert_array_equal(again.predict_proba(fresh), trees.predict_proba(fresh))
    # Pickled with a model to scoring processes and Dask workers: as its checkpoint.
    shipped = pickle.loads(pickle.dumps(trees))
    np.testing.assert_array_equal(shipped.predict_proba(fresh), trees.predict_proba(fresh))
    assert len(np.unique(expected.round(6))) > 20  # the trees split: not one constant

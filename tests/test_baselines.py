"""Baselines: bag-of-events counts, last-touch rates, and that the learned ones learn."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest
from conftest import make_journeys_dataset

from journeys import baselines
from journeys.metrics import binary_metrics


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
    probs = baselines.fit_predict("last_touch", train, test, ["channel"])
    base = 0.02
    pseudo = baselines.LAST_TOUCH_PSEUDO_COUNT
    assert probs[0] == pytest.approx((2 + pseudo * base) / (2 + pseudo))  # not 100 %
    assert probs[1] == pytest.approx(base)  # unseen key -> base rate
    assert baselines.fit_predict("prior", train, test, ["channel"]).tolist() == [base, base]


@pytest.mark.parametrize("bigrams", [False, True])
def test_learned_baselines_beat_the_prior(tmp_path, bigrams: bool) -> None:
    folder = make_journeys_dataset(tmp_path / "journeys", n=800, seed=3)
    journeys = pl.read_parquet(folder / "part-00000.parquet")
    train = journeys.filter(pl.col("split") == "train")
    test = journeys.filter(pl.col("split") == "test")
    labels = test.get_column("label").to_numpy()
    auc = {}
    for name in baselines.BASELINES:
        probs = baselines.fit_predict(name, train, test, ["channel", "device"], bigrams=bigrams)
        assert probs.shape == (test.height,) and ((probs >= 0) & (probs <= 1)).all()
        auc[name] = binary_metrics(labels, probs)["test_roc_auc"]
    assert auc["prior"] == pytest.approx(0.5)
    assert auc["logreg"] > 0.6 and auc["hgb"] > 0.6 and auc["last_touch"] > 0.5

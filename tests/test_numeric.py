"""Numeric per-event features (`data.numeric_features`): read, quarantined when they are
not numbers, missing when empty, scaled with the train split's statistics only, stored
with the model and applied unchanged when scoring, learned from, and aggregated by the
strong baseline."""

from __future__ import annotations

import math
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from test_ingest import assert_accounting, config_for
from test_model import fit_and_test_auc

from journeys.config import Model
from journeys.encoding import JourneyEncoder, encode_journeys, model_config_from
from journeys.errors import InputError
from journeys.ingest import ingest, run_ingest
from journeys.inputs import (
    EventInputs,
    NumericInput,
    NumericScaling,
    TimeInput,
    numeric_bucket_edges,
    numeric_scaling,
)
from journeys.model import JourneyTransformer
from journeys.vocab import Vocabularies, Vocabulary
from tests.test_reliability import ENV, TINY, cli, path_args, sets

START = datetime(2026, 1, 5, tzinfo=UTC)


def priced(
    vocabs: Vocabularies, scaling: NumericScaling, timezone: str | None = None, **number
) -> EventInputs:
    """The event inputs of `vocabs`' event types and the numbers `scaling` scales (each
    with `number`'s settings), without time encodings unless `timezone`."""
    numbers = tuple(NumericInput(name, c, s, **number) for name, c, s in scaling)
    return EventInputs(vocabs.event_type, TimeInput(32, timezone), numbers)


def priced_log(n_users: int, seed: int, missing: float = 0.1) -> pl.DataFrame:
    """An event log with a `price` per event: users shown a price under 20 convert far
    more often; event types and channels carry no signal. Some prices are empty."""
    rng = np.random.default_rng(seed)
    rows = []
    for user in range(n_users):
        t = START + timedelta(days=float(rng.uniform(0, 60)))
        price = float(np.exp(rng.normal(3.2, 0.8)))  # about 25, from ~5 to ~120
        for _ in range(int(rng.integers(1, 5))):
            shown = "" if rng.random() < missing else f"{price * rng.uniform(0.9, 1.1):.2f}"
            kind = str(rng.choice(["view", "click"]))
            rows.append((f"u{user}", t.isoformat(), kind, str(rng.choice(["a", "b"])), shown))
            t += timedelta(minutes=float(rng.exponential(5)))
        if rng.random() < (0.6 if price < 20 else 0.05):
            rows.append((f"u{user}", t.isoformat(), "purchase", "a", ""))
    columns = ["user_id", "timestamp", "event_type", "channel", "price"]
    return pl.DataFrame(rows, schema=columns, orient="row")


def test_numbers_are_read_missing_when_empty_and_quarantined_when_not_numbers(
    tmp_path: Path,
) -> None:
    rows = [
        ("u1", "2026-01-05T10:00:00Z", "view", "a", "12.5"),
        ("u1", "2026-01-05T10:01:00Z", "view", "a", ""),  # missing: kept
        ("u1", "2026-01-05T10:02:00Z", "click", "a", " 3 "),
        ("u1", "2026-01-05T10:03:00Z", "click", "a", "twelve"),  # not a number
        ("u1", "2026-01-05T10:04:00Z", "click", "a", "inf"),  # not a finite number
        ("u1", "2026-01-05T10:05:00Z", "purchase", "a", ""),
    ]
    log = pl.DataFrame(
        rows, schema=["user_id", "timestamp", "event_type", "channel", "price"], orient="row"
    )
    log = log.with_columns(pl.col("price").replace("", None))
    log.write_csv(tmp_path / "log.csv")
    config = config_for(
        tmp_path / "log.csv", tmp_path, "data.features=[channel]", "data.numeric_features=[price]"
    )
    report = ingest(config)
    assert_accounting(report)
    assert report["quarantined"]["bad_numeric"] == 2
    journeys = run_ingest(config).journeys
    assert journeys.schema["price"] == pl.List(pl.Float64)
    assert journeys["price"].to_list() == [[12.5, None, 3.0]]
    quarantined = pl.read_parquet(tmp_path / "quarantine" / "*.parquet")
    assert sorted(quarantined["price"].to_list()) == ["inf", "twelve"]  # original text kept


def test_a_listed_number_the_log_lacks_names_the_setting_to_change(tmp_path: Path) -> None:
    priced_log(5, seed=0).drop("price").write_csv(tmp_path / "log.csv")
    config = config_for(
        tmp_path / "log.csv", tmp_path, "data.features=[channel]", "data.numeric_features=[price]"
    )
    with pytest.raises(InputError, match=r"missing column\(s\) price .*data.numeric_features$"):
        ingest(config)


def test_scaling_comes_from_train_and_is_applied_unchanged() -> None:
    """asinh, centred and scaled by the train events; other splits are encoded with those
    numbers, whatever their own distribution; a missing value is 0 with its flag set."""
    train = pl.DataFrame({"price": [[1.0, 10.0], [100.0, None]]})
    scaling = numeric_scaling(train, ["price"])
    logs = np.arcsinh([1.0, 10.0, 100.0])
    assert scaling[0][0] == "price"
    assert scaling[0][1] == pytest.approx(logs.mean())
    assert scaling[0][2] == pytest.approx(logs.std(ddof=1))
    vocabs = Vocabularies(by_column={"event_type": Vocabulary(("<pad>", "<unk>", "view"))})
    later = pl.DataFrame(
        {
            "event_type": [["view", "view"]],
            "event_time": [[START, START + timedelta(seconds=5)]],
            "price": [[1000.0, 10.0, None]],
        },
        schema_overrides={"event_time": pl.List(pl.Datetime("us", "UTC"))},
    )
    later = later.with_columns(
        event_type=pl.lit(["view"] * 3),
        event_time=pl.lit([START + timedelta(seconds=s) for s in (0, 5, 9)]),
    )
    encoded = encode_journeys(later, priced(vocabs, scaling))
    _, centre, scale = scaling[0]
    relative = (math.asinh(10.0) - math.asinh(1000.0)) / scale
    # [value, flag, against the earlier values, that carried forward] x [1000, 10, missing]
    assert encoded.continuous.tolist() == [
        pytest.approx(
            [(math.asinh(1000.0) - centre) / scale, (math.asinh(10.0) - centre) / scale, 0.0],
            abs=1e-5,
        ),
        [0.0, 0.0, 1.0],
        pytest.approx([0.0, relative, 0.0], abs=1e-5),
        pytest.approx([0.0, relative, relative], abs=1e-5),
    ]
    # Models from before the later inputs read the first two or three only.
    for n in (2, 3):
        older = encode_journeys(later, priced(vocabs, scaling, n_inputs=n))
        assert older.continuous.tolist() == encoded.continuous[:n].tolist()


def test_bucket_edges_come_from_train_and_bucket_ids_are_applied_unchanged() -> None:
    """`model.numeric_encoding: buckets`: train's quantiles of asinh(value) and of the value
    against the journey's earlier ones; other data get ids by those edges (1: missing or
    no earlier value), after the categorical features, and no continuous numbers."""
    train = pl.DataFrame({"price": [[1.0, 10.0], [100.0, None, 1000.0]]})
    edges = numeric_bucket_edges(train, ["price"], n_buckets=2)
    logs = np.arcsinh([1.0, 10.0, 100.0, 1000.0])
    earlier = [logs[1] - logs[0], logs[3] - logs[2]]  # each journey's second price
    assert [len(e) for e in edges] == [1, 1]
    assert [*edges[0], *edges[1]] == pytest.approx([np.median(logs), np.median(earlier)])
    vocabs = Vocabularies(by_column={"event_type": Vocabulary(("<pad>", "<unk>", "view"))})
    later = pl.DataFrame(
        {
            "event_type": [["view"] * 3],
            "event_time": [[START + timedelta(seconds=s) for s in (0, 5, 9)]],
            "price": [[1000.0, None, 2.0]],
        },
        schema_overrides={"event_time": pl.List(pl.Datetime("us", "UTC"))},
    )
    settings = Model(numeric_encoding="buckets", numeric_buckets=2, time_encodings=False)
    encoder = JourneyEncoder.fit(
        train, vocabs, settings, max_len=8, timezone="UTC", columns=[NumericInput("price")]
    )
    (number,) = encoder.inputs.columns
    assert number.bucket_edges == edges and number.n_buckets == 2
    encoded = encoder.encode(later)
    assert encoded.continuous is None
    # value: 1000 above the median, missing, 2 below; relative: none earlier, missing, far down
    assert encoded.features.tolist() == [[3, 1, 2], [1, 1, 2]]
    config = model_config_from(settings, encoder)
    assert config.feature_vocab_sizes == (4, 4) and config.n_continuous == 0


def test_a_number_may_be_called_like_an_internal_column() -> None:
    """Users name their columns: a number called `token` or `log_gap` is just a number."""
    vocabs = Vocabularies(by_column={"event_type": Vocabulary(("<pad>", "<unk>", "view"))})
    frame = pl.DataFrame(
        {
            "event_type": [["view", "view"]],
            "event_time": [[START, START + timedelta(seconds=5)]],
            "token": [[2.0, None]],
            "log_gap": [[None, 7.0]],
        },
        schema_overrides={"event_time": pl.List(pl.Datetime("us", "UTC"))},
    )
    inputs = priced(vocabs, (("token", 0.0, 1.0), ("log_gap", 0.0, 1.0)), "UTC")
    encoded = encode_journeys(frame, inputs)
    assert encoded.tokens.tolist() == [2, 2]
    assert encoded.continuous.shape == (6 + 8, 2)
    # token's value, flag, relative and carried values, then log_gap's, over the two events
    assert encoded.continuous[6:].flatten().tolist() == pytest.approx(
        [math.asinh(2.0), 0, 0, 1, 0, 0, 0, 0, 0, math.asinh(7.0), 1, 0, 0, 0, 0, 0]
    )


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["projection", "buckets"])
def test_a_price_that_drives_conversion_raises_the_models_auc(encoding: str) -> None:
    """The same small transformer, with and without the numeric feature (projected or
    embedded by bucket): only the price carries the signal, so the model with it ranks
    converters far better."""
    frames = {}
    for split, seed in (("train", 0), ("test", 1)):
        log = priced_log(1500, seed).with_columns(
            pl.col("price").replace("", None).cast(pl.Float64),
            pl.col("timestamp").str.to_datetime(time_zone="UTC"),
        )
        frames[split] = log.group_by("user_id", maintain_order=True).agg(
            pl.col("event_type").filter(pl.col("event_type") != "purchase"),
            pl.col("timestamp").filter(pl.col("event_type") != "purchase").alias("event_time"),
            pl.col("price").filter(pl.col("event_type") != "purchase"),
            (pl.col("event_type") == "purchase").any().cast(pl.Int8).alias("label"),
        )
    vocabs = Vocabularies(by_column={"event_type": Vocabulary(("<pad>", "<unk>", "view", "click"))})
    auc = {}
    for with_price in (False, True):
        columns = [NumericInput("price")] if with_price else []
        settings = Model(
            d_model=16, n_heads=2, n_layers=1, time_encodings=False, numeric_encoding=encoding
        )
        encoder = JourneyEncoder.fit(
            frames["train"], vocabs, settings, max_len=8, timezone="UTC", columns=columns
        )
        torch.manual_seed(0)
        model = JourneyTransformer(model_config_from(settings, encoder))
        train, test = encoder.encode(frames["train"]), encoder.encode(frames["test"])
        auc[with_price] = fit_and_test_auc(model, train, test, epochs=4)
    assert auc[True] > auc[False] + 0.15
    assert auc[True] > 0.75


def premium_journeys(
    priced: tuple[int, int], unpriced_after: int = 0
) -> tuple[dict[str, pl.DataFrame], Vocabularies, NumericScaling]:
    """Train and test journeys of views whose conversion depends on the latest price against
    the journey's earlier ones (log-odds -1 - 5 x that premium), with users' price levels a
    hundredfold apart: `priced` (low, high) priced events, then up to `unpriced_after`
    events without a price. Also their vocabularies and train scaling."""
    rng = np.random.default_rng(0)
    frames = {}
    for split, n in (("train", 3000), ("test", 1500)):
        level = np.exp(rng.normal(3.5, 1.2, n))
        n_priced = rng.integers(*priced, n)
        after = rng.integers(0, unpriced_after + 1, n) if unpriced_after else np.zeros(n, int)
        prices = [
            [*(level[i] * np.exp(0.3 * rng.standard_normal(k))), *([None] * a)]
            for i, (k, a) in enumerate(zip(n_priced, after, strict=True))
        ]
        premium = np.array(
            [
                np.log(p[k - 1]) - np.log(p[: k - 1]).mean()
                for p, k in zip(prices, n_priced, strict=True)
            ]
        )
        label = rng.random(n) < 1 / (1 + np.exp(-(-1.0 - 5.0 * premium)))
        lengths = n_priced + after
        frames[split] = pl.DataFrame(
            {
                "event_type": [["view"] * k for k in lengths],
                "event_time": [[START + timedelta(minutes=m) for m in range(k)] for k in lengths],
                "price": prices,
                "label": label.astype(np.int8),
            }
        )
    vocabs = Vocabularies(by_column={"event_type": Vocabulary(("<pad>", "<unk>", "view"))})
    return frames, vocabs, numeric_scaling(frames["train"], ["price"])


def test_a_price_above_the_journeys_usual_is_learned_from_the_relative_input() -> None:
    """Users' price levels differ a hundredfold; whether they convert depends on the last
    price against their own earlier ones. The value against the journey's earlier values
    makes that one input; without it a model that reads the journey through a CLS token
    learns far less of it. (Pooled at the last event, which here is always the latest
    price, the tiny model gets most of it either way: 0.79 against 0.81.)"""
    frames, vocabs, scaling = premium_journeys(priced=(3, 7))
    auc = {}
    for relative in (False, True):
        auc[relative] = fit_with_numeric_inputs(
            frames, vocabs, scaling, 3 if relative else 2, pooling="cls"
        )
    assert auc[True] > auc[False] + 0.05
    assert auc[True] > 0.75


def fit_with_numeric_inputs(
    frames: dict[str, pl.DataFrame],
    vocabs: Vocabularies,
    scaling: NumericScaling,
    numeric_inputs: int,
    max_len: int = 8,
    pooling: str = "last",
) -> float:
    """Test AUC of one small transformer reading the first `numeric_inputs` of each number's
    inputs (`NUMERIC_INPUTS`), trained on frames["train"]."""
    encoder = JourneyEncoder(priced(vocabs, scaling, n_inputs=numeric_inputs), max_len)
    torch.manual_seed(0)
    settings = Model(d_model=16, n_heads=2, n_layers=1, pooling=pooling)
    config = model_config_from(settings, encoder)
    assert config.n_continuous == numeric_inputs  # no time encodings: the number's alone
    train, test = encoder.encode(frames["train"]), encoder.encode(frames["test"])
    return fit_and_test_auc(JourneyTransformer(config), train, test, epochs=4)


def test_the_latest_prices_standing_is_carried_to_the_journeys_end() -> None:
    """Whether users convert depends on their latest price against their earlier ones, but
    after it come up to nine events without a price. The relative value carried
    forward puts it on the last event; without it the model must first find the latest
    priced event, and learns far less."""
    frames, vocabs, scaling = premium_journeys(priced=(2, 5), unpriced_after=9)
    auc = {n: fit_with_numeric_inputs(frames, vocabs, scaling, n, max_len=16) for n in (3, 4)}
    assert auc[4] > auc[3] + 0.05
    assert auc[4] > 0.75


def test_numeric_aggregates_for_the_strong_baseline() -> None:
    frame = pl.DataFrame({"price": [[1.0, None, 3.0], [None]]})
    got = frame.select(NumericInput("price").aggregates()).to_dicts()
    assert got[0] == {
        "price_mean": 2.0,
        "price_min": 1.0,
        "price_max": 3.0,
        "price_last": 3.0,
        "price_sum": 4.0,
        "price_missing": 1.0,
    }
    assert got[1]["price_mean"] is None and got[1]["price_missing"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["projection", "buckets"])
def test_a_run_with_missing_numbers_trains_scores_and_keeps_train_scaling(
    tmp_path: Path, encoding: str
) -> None:
    """ingest, train and score from the CLI on a log with empty prices: the model's stored
    scaling (or bucket edges) is the train split's, and scoring reads it back unchanged."""
    priced_log(400, seed=2, missing=0.3).write_csv(tmp_path / "log.csv")
    env = {**ENV, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    paths = path_args(tmp_path, tmp_path / "log.csv")
    settings = sets(
        *TINY,
        "train.baselines=[hgb_aggregates]",
        "data.features=[channel]",
        "data.numeric_features=[price]",
        "vocab.min_count=1",
        f"model.numeric_encoding={encoding}",
    )
    for command in ("ingest", "train", "score"):
        done = subprocess.run(
            cli(command, *paths, *settings), cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
    from journeys.datasets import scan_journeys
    from journeys.trained_model import load_model

    journeys = scan_journeys(tmp_path / "journeys").collect()
    train = journeys.filter(pl.col("split") == "train")
    expected = numeric_scaling(train, ["price"])
    assert expected != numeric_scaling(journeys, ["price"])  # the other splits differ
    loaded = load_model("models:/journey-conversion@champion", env["MLFLOW_TRACKING_URI"])
    (applied,) = loaded.encoder.inputs.of_kind(NumericInput)
    assert applied.name == "price"
    ((_, centre, scale),) = expected
    np.testing.assert_allclose([applied.centre, applied.scale], [centre, scale])
    edges = numeric_bucket_edges(train, ["price"], 16) if encoding == "buckets" else ()
    assert [len(e) for e in applied.bucket_edges] == [len(e) for e in edges]
    for applied_edges, train_edges in zip(applied.bucket_edges, edges, strict=True):
        np.testing.assert_allclose(applied_edges, train_edges)
    scores = pl.read_parquet(tmp_path / "scores" / "*.parquet")
    assert scores.height == journeys.height
    assert scores["conversion_probability"].is_finite().all()

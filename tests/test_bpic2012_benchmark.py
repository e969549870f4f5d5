"""The BPIC 2012 benchmark (`benchmarks/bpic2012.py`): labels, prefixes, metric, pipeline.

The protocol pieces are checked on hand-made inputs with hand-computed answers; the whole
pipeline runs on the committed 6% sample of the log with a tiny model for one epoch.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from benchmarks import bpic2012 as bench

T0 = datetime(2012, 1, 1, tzinfo=UTC)


def _log(rows: list[tuple[str, str, int]]) -> pl.DataFrame:
    """(case, activity, minutes after T0) rows, in the given (arrival) order."""
    return pl.DataFrame(
        {
            "case_id": [r[0] for r in rows],
            "activity": [r[1] for r in rows],
            "ts": [T0 + timedelta(minutes=r[2]) for r in rows],
            "row": list(range(1, len(rows) + 1)),
        }
    )


def test_outcome_is_the_last_offer_event_and_other_cases_are_left_out():
    events = _log(
        [
            # a: accepted after a cancelled first offer; rows arrive out of time order
            ("a", "O_ACCEPTED", 50),
            ("a", "A_SUBMITTED", 0),
            ("a", "O_CANCELLED", 20),
            ("a", "W_Valideren aanvraag", 60),  # not an O_ event: does not count
            # b: declined
            ("b", "A_SUBMITTED", 5),
            ("b", "O_SENT", 10),
            ("b", "O_DECLINED", 30),
            # c: the last O_ event is O_SENT -> left out
            ("c", "A_SUBMITTED", 1),
            ("c", "O_CANCELLED", 2),
            ("c", "O_SENT", 3),
            # d: no O_ event at all -> left out
            ("d", "A_SUBMITTED", 2),
            ("d", "A_DECLINED", 3),
            # e: an accepted offer, then cancelled: the LAST one decides
            ("e", "A_SUBMITTED", 3),
            ("e", "O_ACCEPTED", 10),
            ("e", "O_CANCELLED", 11),
            # f: two O_ events at the same instant: the later row wins the tie
            ("f", "A_SUBMITTED", 4),
            ("f", "O_DECLINED", 40),
            ("f", "O_CANCELLED", 40),
        ]
    )
    outcomes = bench.case_outcomes(events)
    assert outcomes.get_column("case_id").to_list() == ["a", "e", "f", "b"]  # by start time
    assert dict(outcomes.select("case_id", "outcome").iter_rows()) == {
        "a": "accepted",
        "b": "declined",
        "e": "cancelled",
        "f": "cancelled",
    }
    starts = dict(outcomes.select("case_id", "start_time").iter_rows())
    assert starts["a"] == T0  # the first event of any type, not the first O_ event
    assert starts["b"] == T0 + timedelta(minutes=5)


def test_task_labels_are_one_task_against_the_rest():
    frame = pl.DataFrame({"outcome": ["accepted", "declined", "cancelled", "accepted"]})
    assert bench.task_labels(frame, "accepted").tolist() == [1, 0, 0, 1]
    assert bench.task_labels(frame, "declined").tolist() == [0, 1, 0, 0]
    assert bench.task_labels(frame, "cancelled").tolist() == [0, 0, 1, 0]


def test_temporal_split_and_the_strict_cut_of_train_events():
    cases = pl.DataFrame(
        {
            "case_id": [f"c{i}" for i in range(10)],
            "start_time": [T0 + timedelta(days=i) for i in range(10)],
            "outcome": ["accepted", "declined"] * 5,
        }
    ).reverse()  # arrival order does not matter
    split = bench.temporal_split(cases, train_fraction=0.8, val_fraction=0.25)
    roles = dict(split.cases.select("case_id", "role").iter_rows())
    assert [roles[f"c{i}"] for i in range(10)] == ["train"] * 6 + ["val"] * 2 + ["test"] * 2
    assert split.cutoff == T0 + timedelta(days=8)  # the first test case's start

    # c7 (val) runs past the cutoff: its events at or after it are removed; c9 (test) keeps all.
    def journey(case: str, days: list[float]) -> dict:
        return {
            "user_id": case,
            "event_type": [f"e{i}" for i in range(len(days))],
            "event_time": [T0 + timedelta(days=d) for d in days],
        }

    journeys = pl.DataFrame(
        [
            journey("c7", [7, 7.5, 8, 9]),
            journey("c9", [9, 20, 30]),
            journey("c0", [0.0 + i / 100 for i in range(50)]),
        ]
    )
    kept = bench.prefix_cases(journeys, split, ["event_type", "event_time"], max_prefix=40)
    by_case = {row["case_id"]: row for row in kept.iter_rows(named=True)}
    assert by_case["c7"]["event_type"] == ["e0", "e1"]
    assert by_case["c9"]["n_events"] == 3
    assert by_case["c0"]["n_events"] == 40  # the first 40 events, not the last
    assert by_case["c0"]["event_type"][-1] == "e39"


def test_prefixes_of_every_length_up_to_40():
    prefixes = bench.generate_prefixes([3, 45, 1, 0, 40])
    per_case = prefixes.group_by("case_row").agg(pl.col("prefix_len")).sort("case_row")
    lists = dict(per_case.iter_rows())
    assert lists[0] == [1, 2, 3]
    assert lists[1] == list(range(1, 41))  # capped at 40
    assert lists[2] == [1]
    assert 3 not in lists  # an empty case has no prefix
    assert lists[4] == list(range(1, 41))
    assert prefixes.height == 3 + 40 + 1 + 40
    assert prefixes.get_column("case_row").is_sorted()


def test_weighted_average_of_auc_by_prefix_length():
    # length 1: 4 cases; pairs (pos, neg): (0.8>0.3) (0.8>0.5) (0.4>0.3) (0.4<0.5) -> AUC 3/4
    # length 2: 3 cases; (0.9>0.2) (0.7>0.2) -> AUC 1
    # length 3: 2 cases, both positive: no AUC, left out of the average
    prefix_len = np.array([1, 1, 1, 1, 2, 2, 2, 3, 3])
    labels = np.array([1, 0, 1, 0, 1, 1, 0, 1, 1])
    scores = np.array([0.8, 0.3, 0.4, 0.5, 0.9, 0.7, 0.2, 0.6, 0.1])
    table = bench.auc_by_prefix_length(prefix_len, labels, scores)
    assert table.get_column("n").to_list() == [4, 3, 2]
    assert table.get_column("auc").to_list() == [0.75, 1.0, None]
    expected = (4 * 0.75 + 3 * 1.0) / (4 + 3)
    assert bench.weighted_auc(table) == pytest.approx(expected)
    assert bench.prefix_auc(prefix_len, labels, scores) == pytest.approx(expected)


def test_amount_bands_are_half_octaves():
    amounts = pl.DataFrame({"amount": ["5000", "5001", "8000", "0", None, "100000", "x"]})
    bands = amounts.select(bench.amount_band_expr(pl.col("amount"))).to_series().to_list()
    # 2^12 = 4096 <= 5000, 5001 < 2^12.5 = 5793 <= 8000; 2^16.5 = 92682 <= 100000
    assert bands == ["4096", "4096", "5793", "0", "0", "92682", "0"]


def test_elapsed_bands_are_half_octaves_of_hours():
    elapsed = pl.DataFrame(
        {"elapsed": [timedelta(0), timedelta(hours=1), timedelta(hours=3), timedelta(days=30)]}
    )
    bands = elapsed.select(bench.elapsed_band_expr(pl.col("elapsed"))).to_series().to_list()
    assert bands == ["0", "2", "4", "18"]


@pytest.fixture(scope="module")
def sample_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bench.SettingResult]:
    """Both settings on the sample: two tiny models for one epoch each, 5 boosting rounds."""
    workdir = tmp_path_factory.mktemp("bpic2012")
    tiny = [
        "model.d_model=16",
        "model.n_heads=2",
        "model.n_layers=1",
        "train.max_epochs=1",
        "vocab.min_count=1",
    ]
    return {
        setting: bench.run_setting(
            setting,
            bench.SAMPLE_RAW,
            list(bench.TASKS),
            workdir,
            tiny,
            hgb_max_iter=5,
            seeds=2,
            log=lambda *_: None,
        )
        for setting in bench.SETTINGS
    }


@pytest.mark.slow
@pytest.mark.parametrize("setting", bench.SETTINGS)
def test_every_prefix_of_every_test_case_gets_a_probability(sample_run, setting):
    result = sample_run[setting]
    assert result.cases["test"] > 10
    assert set(result.tasks) == set(bench.TASKS)
    for task in result.tasks.values():
        predictions = task.predictions
        assert predictions.height == result.cases["test_prefixes"]
        per_case = predictions.group_by("case_id").agg(
            pl.col("prefix_len").sort(), pl.len().alias("n")
        )
        assert per_case.height == result.cases["test"]
        for lengths, n in per_case.select("prefix_len", "n").iter_rows():
            assert lengths == list(range(1, n + 1)) and n <= bench.MAX_PREFIX
        for model in ("transformer", "boosting"):
            probs = predictions.get_column(model)
            assert probs.null_count() == 0
            assert ((probs > 0) & (probs < 1)).all()
        assert 0.0 <= task.transformer_auc <= 1.0 and 0.0 <= task.boosting_auc <= 1.0
        assert len(task.details["transformer_auc_per_seed"]) == 2  # the mean of two models
        # The product's checkpoint on train.monitor picked the one epoch each seed ran.
        assert task.details["transformer_best_epoch"] == [1, 1]
        assert all(0.0 <= auc <= 1.0 for auc in task.details["transformer_val_auc"])
        assert task.transformer_by_length.get_column("prefix_len").max() <= bench.MAX_PREFIX


def test_the_transformer_is_trained_by_configuration(tmp_path: Path):
    """The loss at every prefix, weights and monitor are product config keys, not code here."""
    config = bench.make_config("reference", bench.SAMPLE_RAW, tmp_path)
    assert config.model.causal
    assert config.train.objective == "every_prefix"
    assert config.train.prefix_weight == "prefix"  # one row per prefix, as the reference
    assert config.train.monitor == "val_prefix_roc_auc"
    assert not hasattr(bench, "_prefix_module_class") and not hasattr(bench, "_keep_best_class")


def test_leak_free_sequences_hold_no_outcome_event(tmp_path: Path):
    outcome_events = {"O_ACCEPTED", "O_DECLINED", "O_CANCELLED", "A_APPROVED", "A_DECLINED"}
    seen = {}
    for setting in bench.SETTINGS:
        config = bench.make_config(setting, bench.SAMPLE_RAW, tmp_path)
        log = bench.prepare_log(bench.SAMPLE_RAW, tmp_path, config).path
        config = bench.make_config(setting, log, tmp_path)
        journeys = bench.ingest_cases(config)
        seen[setting] = set(journeys.get_column("event_type").explode().unique().to_list())
    assert outcome_events <= seen["reference"]
    assert not outcome_events & seen["leak_free"]


def test_one_causal_pass_scores_each_prefix_as_if_scored_alone(tmp_path: Path):
    from journeys.encoding import model_config_from
    from journeys.model import JourneyTransformer

    config = bench.make_config("reference", bench.SAMPLE_RAW, tmp_path, ["vocab.min_count=1"])
    log = bench.prepare_log(bench.SAMPLE_RAW, tmp_path, config).path
    config = bench.make_config("reference", log, tmp_path, ["vocab.min_count=1"])
    journeys = bench.ingest_cases(config).head(6)
    frame = journeys.with_columns(
        pl.col(c).list.head(bench.MAX_PREFIX) for c in bench.sequence_columns(config)
    )
    vocabs = bench.build_vocabularies(frame, config)
    encoder = bench.fit_encoder(frame, vocabs, config, numeric=False)
    torch.manual_seed(0)
    model = JourneyTransformer(model_config_from(config.model, encoder)).eval()
    one_pass = bench.score_prefixes(model, bench.encode_cases(frame, encoder))
    for row in (0, 3):
        n = min(frame.row(row, named=True)["n_events"], bench.MAX_PREFIX)
        for k in (1, n // 2, n):
            alone = frame.slice(row, 1).with_columns(
                pl.col(c).list.head(k) for c in bench.sequence_columns(config)
            )
            encoded = bench.encode_cases(alone, encoder)
            expected = bench.score_prefixes(model, encoded).get_column("probability")[-1]
            got = one_pass.filter((pl.col("case_row") == row) & (pl.col("prefix_len") == k))
            assert got.get_column("probability")[0] == pytest.approx(expected, abs=1e-5)

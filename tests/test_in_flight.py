"""Open journeys scored as they stand (`journeys score --as-of`, `journeys.in_flight`)."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from test_score import MAX_EVENTS, config_for, journeys_folder, save_tiny_model, settings

from journeys.cli import main
from journeys.in_flight import QuietSurvival
from journeys.score import score_command, score_frame
from journeys.trained_model import TrainedModel, load_model
from journeys.vocab import Vocabularies

T0 = datetime(2026, 3, 1, tzinfo=UTC)
MAX_GAP = timedelta(days=7)


def journeys_frame(rows: list[tuple[int, list[float], float | None]]) -> pl.DataFrame:
    """(label, event offsets in seconds from T0, conversion offset or None) per journey."""
    return pl.DataFrame(
        {
            "label": [label for label, _, _ in rows],
            "event_time": [[T0 + timedelta(seconds=s) for s in times] for _, times, _ in rows],
            "end_time": [
                T0 + timedelta(seconds=end if end is not None else times[-1])
                for _, times, end in rows
            ],
        },
        schema={
            "label": pl.Int8,
            "event_time": pl.List(pl.Datetime("us", "UTC")),
            "end_time": pl.Datetime("us", "UTC"),
        },
    )


def test_quiet_survival_counts_the_wait_after_every_event() -> None:
    # Converting: events at 0 and 60 s, the conversion at 120 s: waits 60, 60.
    # Not converting: events at 0 and 3600 s: waits 3600, then forever.
    survival = QuietSurvival.fit(journeys_frame([(1, [0, 60], 120), (0, [0, 3600], None)]), MAX_GAP)
    assert survival is not None
    at = np.array([30.0, 100.0, 5000.0, MAX_GAP.total_seconds()])
    seconds = np.asarray(survival.seconds)
    assert seconds[0] == 0 and seconds[-1] == pytest.approx(MAX_GAP.total_seconds())

    def quiet(curve: tuple[float, ...], t: float) -> float:
        return float(np.interp(np.log1p(t), np.log1p(seconds), curve))

    # Shares of waits still quiet, with one more wait as long as the longest seen, falling
    # as 1/t past it (two waits each: the converting curve's tail is 1/3 x 60 s / t).
    week = MAX_GAP.total_seconds()
    assert [quiet(survival.converted, t) for t in at] == pytest.approx(
        [1, 60 / 100 / 3, 60 / 5000 / 3, 60 / week / 3], abs=0.02
    )
    # Not converting: the endless wait stays quiet; the extra one falls past 3600 s.
    assert [quiet(survival.not_converted, t) for t in at] == pytest.approx(
        [1, 1, (1 + 3600 / 5000) / 3, (1 + 3600 / week) / 3], abs=0.02
    )
    q = np.full(4, 0.3)
    probability = survival.probability(q, at)
    assert probability[0] == pytest.approx(0.3, abs=0.01)  # nobody has waited that long yet
    # Converters never waited this long: less and less likely, but never exactly 0 ...
    assert 0 < probability[3] < probability[2] < probability[1] < probability[0]
    # ... so open journeys quiet past every converting wait keep the model's ranking.
    ranked = survival.probability(np.array([0.05, 0.2, 0.6]), np.full(3, MAX_GAP.total_seconds()))
    assert 0 < ranked[0] < ranked[1] < ranked[2]
    # Stored with the model as plain JSON and read back unchanged.
    assert QuietSurvival.from_dict(json.loads(json.dumps(survival.to_dict()))) == survival
    assert QuietSurvival.fit(journeys_frame([(0, [0, 5], None)]), MAX_GAP) is None


def test_as_of_in_the_past_ignores_later_events_and_marks_the_open_journeys(
    tmp_path: Path,
) -> None:
    journeys = journeys_folder(tmp_path / "journeys")
    model = save_tiny_model(tmp_path / "model", Vocabularies.load(journeys))
    source = pl.read_parquet(journeys / "part-00000.parquet")
    as_of = source["end_time"].sort()[source.height // 2]  # half the journeys had ended

    args = ["--model", str(model), "--input", str(journeys), "--as-of", as_of.isoformat()]
    code = main(["score", *args, *settings(tmp_path)])
    assert code == 0
    scores = pl.read_parquet(tmp_path / "scores" / "*.parquet")
    assert (scores["as_of"] == as_of).all()

    # What the journeys were at `as_of`, row by row from the source.
    expected = {}
    for row in source.iter_rows(named=True):
        kept = [t for t in row["event_time"] if t <= as_of]
        if not kept:
            continue  # had not started: not scored
        converted = row["label"] == 1 and row["end_time"] <= as_of
        expected[row["journey_id"]] = {
            "event_time": kept[-MAX_EVENTS:],
            "open": not converted and as_of - kept[-1] <= MAX_GAP,
            "quiet_seconds": (as_of - kept[-1]).total_seconds(),
        }
    assert 0 < len(expected) < source.height
    assert sorted(scores["journey_id"]) == sorted(expected)
    for row in scores.iter_rows(named=True):
        want = expected[row["journey_id"]]
        assert row["event_time"] == want["event_time"]
        assert len(row["event_type"]) == len(row["attention"]) == row["n_events"]
        assert row["open"] == want["open"]
        assert row["quiet_seconds"] == pytest.approx(want["quiet_seconds"])
    assert 0 < scores["open"].sum() < scores.height
    # A finished journey is scored exactly as its truncation scored alone.
    loaded = load_model(str(model))
    lists = ("event_type", "event_time", "channel", "device")
    truncated = pl.DataFrame(
        [
            {**row, **{c: row[c][: sum(t <= as_of for t in row["event_time"])] for c in lists}}
            for row in source.iter_rows(named=True)
            if row["journey_id"] in expected
        ],
        schema=source.schema,
    )
    alone = score_frame(loaded, truncated).select("journey_id", "conversion_probability")
    both = scores.join(alone, on="journey_id", suffix="_alone")
    assert np.allclose(both["conversion_probability"], both["conversion_probability_alone"])


def test_open_journeys_quiet_for_longer_are_less_likely_to_convert(tmp_path: Path) -> None:
    journeys = journeys_folder(tmp_path / "journeys")
    model = save_tiny_model(tmp_path / "model", Vocabularies.load(journeys))
    source = pl.read_parquet(journeys / "part-00000.parquet")
    train = source.filter((pl.col("split") == "train") & ~pl.col("censored"))
    survival = QuietSurvival.fit(train, MAX_GAP)
    assert survival is not None
    with_survival = TrainedModel.load(model)
    with_survival.quiet_survival = survival
    with_survival.save(model)

    end = source["end_time"].max()
    by_quiet = {}
    for hours in (0, 6, 24):  # the same events, seen later and later
        out = tmp_path / f"scores-{hours}"
        score_command(
            config_for(tmp_path),
            model_uri=str(model),
            input_path=str(journeys),
            out=out,
            as_of=end + timedelta(hours=hours),
        )
        by_quiet[hours] = pl.read_parquet(out / "*.parquet").sort("journey_id")
    model_score = score_frame(load_model(str(model)), source.sort("journey_id"))
    still_open = by_quiet[24]["open"].to_numpy()
    assert still_open.sum() >= 5
    p = {h: frame["conversion_probability"].to_numpy()[still_open] for h, frame in by_quiet.items()}
    assert np.all(p[6] <= p[0] + 1e-12) and np.all(p[24] <= p[6] + 1e-12)
    assert p[24].mean() < 0.5 * p[0].mean()
    # Finished journeys keep the model's own score.
    finished = ~by_quiet[0]["open"].to_numpy()
    assert np.allclose(
        by_quiet[0]["conversion_probability"].to_numpy()[finished],
        model_score["conversion_probability"].to_numpy()[finished],
    )


def test_a_bad_as_of_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    journeys = journeys_folder(tmp_path / "journeys", n=20)
    model = save_tiny_model(tmp_path / "model", Vocabularies.load(journeys))
    args = ["score", "--model", str(model), "--input", str(journeys), "--as-of", "yesterday"]
    assert main([*args, *settings(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--as-of" in err[0] and "ISO 8601" in err[0]
    assert not (tmp_path / "scores").exists()


@pytest.mark.slow
def test_replay_on_a_small_simulation_runs_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlflow import MlflowClient

    from benchmarks import in_flight

    work = tmp_path / "replay"
    monkeypatch.setattr(
        "sys.argv", ["in_flight.py", "--quick", "--users", "1500", "--workdir", str(work)]
    )
    in_flight.main()
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| ") and "ROC" not in line]
    table = [row for row in rows if "quiet for" not in row and " | under 1h |" not in row]
    assert len([r for r in table if "h |" not in r and "1d |" not in r]) == 4
    assert "journeys open at the cut" in printed
    # By quiet time, open journeys: none scored exactly 0, and the conversions observed after
    # the cut lie within the interval of those expected, for the default objective.
    buckets = [r.split(" | ") for r in rows if r.startswith("| journey (default) | ")]
    assert [b[1] for b in buckets] == ["under 1h", "1h-1d", "over 1d"]
    for _, _, journeys, observed, expected, smallest in buckets:
        low, high = (float(x) for x in expected.split("[")[1].rstrip("]").split(", "))
        if int(journeys.replace(",", "")) >= 50:
            assert low <= float(observed) <= high, expected
        assert float(smallest.rstrip(" |")) > 0
    # Its own MLflow run, with every figure and the reliability plot.
    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("journeys-in-flight")
    (run,) = client.search_runs([experiment.experiment_id], "tags.benchmark = 'in_flight'")
    assert 0 <= run.data.metrics["every_prefix.in-flight.ece"] <= 1
    assert run.data.metrics["journey.in-flight.open_journeys"] > 0
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["reliability.png"]


@pytest.mark.slow
def test_every_prefix_training_logs_prefix_aucs_and_stores_the_quiet_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest import make_journeys_dataset
    from mlflow import MlflowClient
    from test_train import tiny_config

    from journeys.train import train_command

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    make_journeys_dataset(tmp_path / "journeys", n=400, seed=0)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = tiny_config(
        tmp_path,
        uri,
        "model.causal=true",
        "train.objective=every_prefix",
        "train.max_epochs=2",
        "train.baselines=[prior]",
    )
    result = train_command(config)
    metrics = MlflowClient(uri).get_run(result.run_id).data.metrics
    for split in ("val", "test"):
        assert 0 <= metrics[f"{split}_prefix_roc_auc_weighted"] <= 1
        assert 0 <= metrics[f"{split}_prefix_roc_auc_len1"] <= 1
    # The quiet times the logged model carries are those of the train split (with or
    # without a recalibration: this small log's replay may hold too few conversions).
    train = pl.read_parquet(tmp_path / "journeys" / "*.parquet").filter(
        (pl.col("split") == "train") & ~pl.col("censored")
    )
    loaded = load_model(result.model_uri, tracking_uri=uri)
    assert loaded.quiet_survival is not None
    curves = dataclasses.replace(loaded.quiet_survival, recalibration=None)
    assert curves == QuietSurvival.fit(train, MAX_GAP)


# --- recalibration on a replay --------------------------------------------------------------


def test_a_replay_finds_the_journeys_open_at_each_moment_and_what_they_did_next() -> None:
    from journeys.in_flight import replay_open_journeys

    frame = journeys_frame([(1, [0, 3600], 7200), (0, [0], None), (0, [5000], None)])
    frame = frame.with_columns(
        start_time=pl.col("event_time").list.first(),
        event_type=pl.col("event_time").list.eval(pl.lit("page_view")),
    )
    moments = [T0 + timedelta(seconds=1800), T0 + timedelta(seconds=7300)]
    replayed = replay_open_journeys(frame, moments, [], MAX_GAP)
    # At 1800 s: the converting journey (one event so far) and the one-event journey; the
    # third had not begun. At 7300 s the converting one has converted: not open.
    assert replayed.select("quiet_seconds", "converted_after").rows() == [
        (1800.0, True), (1800.0, False), (7300.0, False), (2300.0, False),
    ]  # fmt: skip


def test_recalibration_corrects_what_the_quiet_time_rule_under_states() -> None:
    """Outcomes drawn where long-quiet journeys convert more often than Bayes' rule says:
    the fitted recalibration recovers the distortion, and observed matches expected in
    every quiet-time bucket; with too few conversions, or a fit that would turn the
    ranking round, nothing is recalibrated."""
    survival = QuietSurvival.fit(
        journeys_frame([(1, [0, 60, 4000], 9000), (1, [0, 90_000], 91_000), (0, [0, 7200], None)]),
        MAX_GAP,
    )
    assert survival is not None
    rng = np.random.default_rng(0)
    n = 200_000
    q = rng.beta(1, 12, n)
    quiet = np.exp(rng.uniform(np.log(60), np.log(MAX_GAP.total_seconds()), n))
    bayes = survival.probability(q, quiet)
    log_odds = np.log(bayes) - np.log1p(-bayes)
    truth = 1 / (1 + np.exp(-(-0.5 + 0.9 * log_odds + 0.4 * np.log1p(quiet / 3600))))
    converted = rng.random(n) < truth
    fitted = survival.recalibrated(q, quiet, converted)
    assert fitted.recalibration == pytest.approx((-0.5, 0.9, 0.4), abs=0.08)
    after = fitted.probability(q, quiet)
    long_quiet = quiet > 2 * 86400
    assert converted[long_quiet].sum() > 1.3 * bayes[long_quiet].sum()  # the rule under-states
    for inside in (quiet < 3600, (quiet >= 3600) & (quiet < 86400), quiet >= 86400):
        observed, expected = converted[inside].sum(), after[inside].sum()
        assert abs(observed - expected) < 3 * np.sqrt((after[inside] * (1 - after[inside])).sum())
    # Saved and read back with the model; a model saved before it has none.
    assert QuietSurvival.from_dict(fitted.to_dict()) == fitted
    stored = {k: v for k, v in survival.to_dict().items() if k != "recalibration"}
    assert QuietSurvival.from_dict(stored).recalibration is None

    few = np.zeros(n, bool)
    few[:10] = True
    assert survival.recalibrated(q, quiet, few).recalibration is None
    backwards = rng.random(n) < (1 - q) * 0.1  # the lower the score, the likelier
    assert survival.recalibrated(q, quiet, backwards).recalibration is None

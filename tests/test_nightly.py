"""Nightly (incremental) ingest: a run of nightly ingests over day files equals one full
rebuild of the same files, journey for journey, whatever the days and the late events."""

from __future__ import annotations

import itertools
import json
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal
from test_ingest import config_for as ingest_config_for

from journeys.cli import main
from journeys.config import parse_duration
from journeys.datasets import check_not_stale, training_journeys
from journeys.ingest import run_ingest
from journeys.ingest_state import MANIFEST_FILE
from journeys.staging import read_quarantine
from journeys.vocab import Vocabularies

START = datetime(2026, 1, 1, tzinfo=UTC)
EVENTS = ["view", "search", "click", "add_to_cart", "drop_me", "purchase"]
# Report figures that describe the journeys and rows kept: equal to a full rebuild's.
SAME_AS_FULL = (
    "rows_valid", "duplicates_dropped", "dropped_by_config", "dropped_after_conversion",
    "journeys", "journeys_converted", "journeys_censored", "journeys_by_split",
    "journeys_converted_near_end", "conversions_without_journey", "events_in_journeys",
    "events_kept", "users", "data_start", "data_end", "observed_until",
)  # fmt: skip


def event_log(seed: int, users: int = 60, days: int = 30) -> pl.DataFrame:
    """Events over `days` with gaps from a minute to a week, conversions, copies of rows
    and an event type the configuration drops; `arrival` is the day each row's file is for."""
    rng = np.random.default_rng(seed)
    per_user = rng.integers(1, 30, users)
    ids = np.repeat([f"u{i:03d}" for i in range(users)], per_user)
    gaps = rng.choice([60, 3600, 6 * 3600, 86400, 3 * 86400, 7 * 86400], size=ids.size)
    first = rng.integers(0, days * 86400, users)
    frame = pl.DataFrame({"user_id": ids, "gap": gaps}).with_columns(
        pl.col("gap").cum_sum().over("user_id").alias("offset")
    )
    offsets = frame.get_column("offset").to_numpy() + np.repeat(first, per_user)
    log = pl.DataFrame(
        {
            "user_id": ids,
            "ts": [START + timedelta(seconds=int(s)) for s in offsets],
            "event_type": rng.choice(EVENTS, ids.size, p=[0.3, 0.2, 0.2, 0.1, 0.1, 0.1]),
            "channel": rng.choice(["ads", "email", "seo"], ids.size),
            "device": rng.choice(["mobile", "desktop"], ids.size),
        }
    ).filter(pl.col("ts") < START + timedelta(days=days))
    copies = log.sample(fraction=0.05, seed=seed)
    return pl.concat([log, copies]).with_columns(
        pl.col("ts").dt.strftime("%Y-%m-%dT%H:%M:%SZ").alias("timestamp"),
        ((pl.col("ts") - START).dt.total_days()).alias("arrival"),
    )


def with_late_rows(log: pl.DataFrame, seed: int, share: float, most_days: int) -> pl.DataFrame:
    """A share of the rows arrives 1..`most_days` days after its own day."""
    rng = np.random.default_rng(seed + 1)
    late = rng.random(log.height) < share
    delay = rng.integers(1, most_days + 1, log.height) * late
    return log.with_columns(pl.col("arrival") + pl.Series(delay))


def write_days(log: pl.DataFrame, folder: Path) -> list[Path]:
    """One CSV per arrival day, rows in a shuffled order (arrival order is not time order)."""
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for (day,), rows in log.sort("arrival").group_by("arrival", maintain_order=True):
        path = folder / f"day-{day:03d}.csv"
        rows.sample(fraction=1.0, shuffle=True, seed=int(day)).select(
            "user_id", "timestamp", "event_type", "channel", "device"
        ).write_csv(path)
        files.append(path)
    return files


def config_for(raw: Path, tmp: Path, *extra: str):
    """test_ingest's configuration, with this log's feature, drops and no conversion guard."""
    settings = ["data.features=[channel]", "data.drop_events=[drop_me]"]
    return ingest_config_for(raw, tmp, *settings, "ingest.require_conversions=false", *extra)


def expected_late(log: pl.DataFrame, runs: list[list[int]], late_allowed: timedelta) -> pl.Series:
    """Which rows a nightly run must quarantine as late: older than `late_allowed` before
    the latest row of the earlier runs."""
    late = pl.Series([False] * log.height)
    seen_until = None
    for days in runs:
        arriving = log.get_column("arrival").is_in(days)
        if seen_until is not None:
            late = late | (arriving & (log.get_column("ts") < seen_until - late_allowed))
        latest = log.filter(arriving).get_column("ts").max()
        seen_until = latest if seen_until is None else max(seen_until, latest)
    return late


def assert_same_as_full(nightly_folder: Path, full_folder: Path) -> None:
    nightly = pl.read_parquet(nightly_folder / "*.parquet").sort("journey_id")
    full = pl.read_parquet(full_folder / "*.parquet").sort("journey_id")
    assert nightly.columns == full.columns
    assert nightly.equals(full)
    assert Vocabularies.load(nightly_folder) == Vocabularies.load(full_folder)
    reports = [
        json.loads((f / "ingest_report.json").read_text()) for f in (nightly_folder, full_folder)
    ]
    assert {k: reports[0][k] for k in SAME_AS_FULL} == {k: reports[1][k] for k in SAME_AS_FULL}


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    seed=st.integers(0, 10_000),
    cuts=st.lists(st.integers(1, 40), max_size=8),
    late_share=st.sampled_from([0.0, 0.1, 0.3]),
    max_gap=st.sampled_from(["1d", "2d"]),
    after_conversion=st.sampled_from(["new_journey", "drop"]),
    partitions=st.sampled_from([1, 3]),
)
def test_nightly_ingests_equal_a_full_rebuild(
    tmp_path: Path,
    seed: int,
    cuts: list[int],
    late_share: float,
    max_gap: str,
    after_conversion: str,
    partitions: int,
) -> None:
    """Day files ingested a few days a night, some rows arriving up to 5 days late (the
    bound is 2 days): the journeys, vocabularies and report figures equal a full rebuild
    of the files without the rows quarantined as late, and those are exactly the rows
    older than the bound."""
    work = tmp_path / f"example-{seed}-{len(cuts)}"
    shutil.rmtree(work, ignore_errors=True)
    log = with_late_rows(event_log(seed), seed, late_share, most_days=5)
    days = sorted(log.get_column("arrival").unique().to_list())
    bounds = sorted({0, *[c for c in cuts if c < len(days)], len(days)})
    runs = [days[a:b] for a, b in itertools.pairwise(bounds)]
    settings_ = [
        f"journey.max_gap={max_gap}", f"journey.after_conversion={after_conversion}",
        f"ingest.partitions={partitions}", "ingest.late_allowed=2d",
        "ingest.max_quarantined_share=1",
    ]  # fmt: skip
    landing = work / "landing"
    files = write_days(log, work / "all")
    config = config_for(landing, work / "nightly", *settings_)
    for run in runs:
        landing.mkdir(exist_ok=True)
        for day in run:
            shutil.copy2(files[days.index(day)], landing / files[days.index(day)].name)
        report = run_ingest(config).report
        assert report.ingest.mode == ("full" if run is runs[0] else "incremental")
        assert report.ingest.new_files and len(report.ingest.new_files) == len(run)

    late = expected_late(log, runs, parse_duration("2d"))
    quarantined = read_quarantine(work / "nightly" / "quarantine")
    assert quarantined.filter(pl.col("reason") == "late").height == late.sum()
    assert report.quarantined["late"] == late.sum()
    on_time = write_days(log.filter(~late), work / "on_time")
    full = run_ingest(config_for(on_time[0].parent, work / "full", *settings_)).report
    assert full.ingest.mode == "full"
    assert report.rows_read == full.rows_read + late.sum()
    assert_same_as_full(work / "nightly" / "journeys", work / "full" / "journeys")
    # What training reads is the same, row for row in the same order: same seed, same model.
    nightly_rows = training_journeys(work / "nightly" / "journeys").collect()
    assert nightly_rows.equals(training_journeys(work / "full" / "journeys").collect())


def ingest_args(tmp: Path) -> list[str]:
    """`journeys ingest` of `tmp/landing` into `tmp/journeys`, for the command-line tests."""
    sets = [
        f"paths.raw={tmp / 'landing'}", f"paths.journeys={tmp / 'journeys'}",
        f"paths.quarantine={tmp / 'quarantine'}", "data.features=[channel]", "vocab.min_count=1",
    ]  # fmt: skip
    return ["ingest", *[arg for item in sets for arg in ("--set", item)]]


def test_an_ingested_file_that_changed_or_vanished_stops_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = event_log(seed=3)
    files = write_days(log.filter(pl.col("arrival") < 20), tmp_path / "landing")
    args = ingest_args(tmp_path)
    files[-1].rename(files[-1].with_suffix(".later"))
    assert main(args) == 0
    first = f"full (no earlier ingest in this folder): {len(files) - 1} new file(s)"
    assert first in capsys.readouterr().out
    files[-1].with_suffix(".later").rename(files[-1])
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "incremental (new files since the last ingest): 1 new file(s)" in printed, printed
    assert main(args) == 0
    assert "up to date: no new raw file" in capsys.readouterr().out
    manifest = (tmp_path / "journeys" / MANIFEST_FILE).read_bytes()

    original = files[3].read_text()
    files[3].write_text(original + "u999,2026-01-04T00:00:00Z,view,ads,mobile\n")
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and files[3].name in err and "--full" in err
    assert "changed" in err
    assert (tmp_path / "journeys" / MANIFEST_FILE).read_bytes() == manifest  # untouched

    files[5].unlink()
    files[3].write_text(original)  # restored: a new modification time, the same bytes
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert files[5].name in err and ("gone" in err or "changed" in err) and "--full" in err

    assert main([*args, "--full"]) == 0  # rebuilds from the files there are now
    report = json.loads((tmp_path / "journeys" / "ingest_report.json").read_text())
    assert report["ingest"]["mode"] == "full" and report["ingest"]["why"] == "--full"
    assert len(report["sources"]) == len(files) - 1


def test_a_touched_but_unchanged_file_is_not_a_change(tmp_path: Path) -> None:
    files = write_days(event_log(seed=4).filter(pl.col("arrival") < 10), tmp_path / "landing")
    config = config_for(tmp_path / "landing", tmp_path)
    run_ingest(config)
    files[0].write_bytes(files[0].read_bytes())  # a new modification time, same bytes
    report = run_ingest(config).report
    assert report.ingest.new_files == [] and report.ingest.rows_read == 0


def test_a_changed_configuration_rebuilds_in_full(tmp_path: Path) -> None:
    write_days(event_log(seed=5).filter(pl.col("arrival") < 10), tmp_path / "landing")
    run_ingest(config_for(tmp_path / "landing", tmp_path))
    report = run_ingest(config_for(tmp_path / "landing", tmp_path, "journey.max_gap=2d")).report
    assert report.ingest.mode == "full"
    assert "configuration changed" in report.ingest.why


def test_the_default_column_mapping_spelled_out_is_the_same_configuration(
    tmp_path: Path,
) -> None:
    """`conf/default.yaml` spells out `data.columns` that the code leaves empty (names
    unmapped are read as-is): a night run with either extends the other's journeys instead
    of rebuilding them, and the flows' cache keys agree. A mapping that means something
    (another column, the sequence) still changes the key."""
    from flows.caching import config_digest
    from journeys.ingest_state import config_key

    landing, empty = tmp_path / "landing", "data.columns={}"
    write_days(event_log(seed=6).filter(pl.col("arrival") < 5), landing)
    run_ingest(config_for(landing, tmp_path, empty))
    write_days(event_log(seed=6).filter(pl.col("arrival") == 5), landing)
    spelled = "data.columns={user_id: user_id, timestamp: timestamp, event_type: event_type}"
    report = run_ingest(config_for(landing, tmp_path, spelled)).report
    assert report.ingest.mode == "incremental", report.ingest.why

    plain = config_for(landing, tmp_path, empty)
    spelled_out = config_for(landing, tmp_path, spelled)
    assert plain.data.columns == {} and spelled_out.data.columns != {}
    assert config_key(plain) == config_key(spelled_out)
    assert config_digest(plain, ["data"]) == config_digest(spelled_out, ["data"])
    for meaningful in ("data.columns={user_id: visitor}", "data.columns={sequence: sequence}"):
        assert config_key(config_for(landing, tmp_path, meaningful)) != config_key(plain)


# ----------------------------------------------------------------------------- scoring

# What says when a row was scored rather than what its score is: kept rows keep theirs.
WHEN_SCORED = ("as_of", "quiet_seconds", "scored_at")


def scores_of(folder: Path) -> pl.DataFrame:
    return pl.read_parquet(folder / "*.parquet").drop(WHEN_SCORED).sort("journey_id")


def test_nightly_scoring_keeps_finished_scores_and_equals_scoring_afresh(tmp_path: Path) -> None:
    """After each nightly ingest, scoring re-scores only new, changed and open journeys; the
    scores folder equals scoring everything afresh with the same model (but for when each
    row was scored), and a new model re-scores everything."""
    from test_score import save_tiny_model

    from journeys.score import score_dataset
    from journeys.trained_model import load_model

    log = with_late_rows(event_log(seed=11, users=150, days=40), 11, 0.1, most_days=2)
    files = write_days(log, tmp_path / "all")
    landing = tmp_path / "landing"
    landing.mkdir()
    config = config_for(landing, tmp_path, "journey.max_gap=2d", "journey.max_events=16")
    journeys = tmp_path / "journeys"
    for file in files[:25]:
        shutil.copy2(file, landing / file.name)
    run_ingest(config)
    # The model's journey rules are the ingest's (scoring marks open journeys by them).
    model_dir = save_tiny_model(
        tmp_path / "model", Vocabularies.load(journeys), "journey.max_gap=2d"
    )
    trained = load_model(str(model_dir))
    scores = tmp_path / "scores"
    first = score_dataset(trained, journeys, scores, chunk_journeys=30, progress=False)
    assert first.kept == 0
    kept_shares, still_open = [], []
    for file in files[25:]:
        shutil.copy2(file, landing / file.name)
        before = pl.read_parquet(scores / "*.parquet").select(
            "journey_id", "event_type", "event_time", "n_events_total"
        )
        run_ingest(config)
        nightly = score_dataset(trained, journeys, scores, chunk_journeys=30, progress=False)
        # Every journey unchanged since last night keeps what the model made of its events,
        # even when its part was rewritten (closed tonight, or its day crossed by a split
        # cut); an open one only has its probability adjusted for its quiet time now.
        unchanged = (
            pl.read_parquet(scores / "*.parquet")
            .join(before, on=["journey_id", "n_events_total"], suffix="_then")
            .filter(
                (pl.col("event_type") == pl.col("event_type_then"))
                & (pl.col("event_time") == pl.col("event_time_then"))
            )
        )
        assert nightly.kept >= unchanged.height > 0
        still_open.append(int(unchanged.get_column("open").sum()))
        afresh = score_dataset(
            trained, journeys, tmp_path / "afresh", chunk_journeys=30, progress=False,
            keep_earlier=False,
        )  # fmt: skip
        assert afresh.kept == 0 and nightly.rows == afresh.rows
        # Equal, but for float noise: a journey's padding depends on its batch-mates.
        assert_frame_equal(scores_of(scores), scores_of(tmp_path / "afresh"), abs_tol=1e-6)
        kept_shares.append(nightly.kept / nightly.rows)
        # Open journeys' probabilities are as of now, kept or scored afresh; every row's
        # quiet time is that of its own as_of.
        rows = pl.read_parquet(scores / "*.parquet")
        opened = rows.filter(pl.col("open"))
        assert opened.get_column("as_of").unique().to_list() == [nightly.as_of]
        quiet = (pl.col("as_of") - pl.col("event_time").list.last()).dt.total_seconds()
        assert rows.filter((quiet - pl.col("quiet_seconds")).abs() > 1e-3).height == 0
    assert min(kept_shares) > 0.7  # most journeys were finished and unchanged
    assert sum(still_open) > 0  # open journeys quiet since were not run through the model

    other = save_tiny_model(
        tmp_path / "other", Vocabularies.load(journeys), "journey.max_gap=2d", "model.d_model=32"
    )
    retrained = load_model(str(other))
    changed = score_dataset(retrained, journeys, scores, chunk_journeys=30, progress=False)
    assert changed.kept == 0 and "model changed" in (changed.why_not_kept or "")


def test_a_booster_champion_rescores_a_night_where_every_journey_kept_its_score(
    tmp_path: Path,
) -> None:
    """A chunk whose journeys all keep their earlier scores leaves nothing to predict: a
    model serving a booster (which refuses to predict on no rows) scores the night anyway,
    keeping every journey's score (open ones' events are unchanged too)."""
    from test_score import save_tiny_model

    from journeys.baselines import BaselineSettings, fit_baseline
    from journeys.score import score_dataset
    from journeys.trained_model import load_model

    landing = tmp_path / "landing"
    landing.mkdir()
    for file in write_days(event_log(seed=5, users=60, days=20), tmp_path / "all"):
        shutil.copy2(file, landing / file.name)
    config = config_for(landing, tmp_path, "journey.max_gap=2d", "journey.max_events=16")
    run_ingest(config)
    journeys = tmp_path / "journeys"
    trained = load_model(
        str(save_tiny_model(tmp_path / "model", Vocabularies.load(journeys), "journey.max_gap=2d"))
    )
    frame = pl.read_parquet(journeys / "*.parquet")
    trained.baseline = fit_baseline("hgb_aggregates", frame, BaselineSettings())
    scores = tmp_path / "scores"
    # One journey a chunk: every finished journey's chunk is empty once its score is kept.
    first = score_dataset(trained, journeys, scores, chunk_journeys=1, progress=False)
    again = score_dataset(
        trained, journeys, scores, chunk_journeys=1, progress=False, as_of=first.as_of
    )
    assert first.open > 0 and again.kept == again.rows == frame.height


# ----------------------------------------------------------------------------- the flow


def test_the_nightly_flow_reads_only_the_new_raw_file(tmp_path: Path) -> None:
    """The ingest flow's cache key and its run open no raw file ingested before: a new day
    file is the only one read; with nothing new the run is a cache hit."""
    import builtins

    from test_flows import isolated, orchestrate, tiny_config

    from flows.pipeline import ingest_flow
    from journeys import ingest as ingest_lib

    files = write_days(event_log(seed=6).filter(pl.col("arrival") < 12), tmp_path / "days")
    raw = tmp_path / "raw"
    raw.mkdir()
    for file in files[:-1]:
        shutil.copy2(file, raw / file.name)
    config = tiny_config(tmp_path, "data.features=[channel]", "vocab.min_count=1")
    with isolated(tmp_path) as mp:
        orchestrate(mp, cache=True)
        first = ingest_flow(config=config)
        assert first["ingest"]["mode"] == "full" and not first["cached"]
        assert ingest_flow(config=config)["cached"]  # nothing new: nothing runs

        shutil.copy2(files[-1], raw / files[-1].name)
        opened: list[str] = []
        real_open = builtins.open
        staged: list[list[str]] = []
        real_stage = ingest_lib.stage

        def spy_open(file: Any, *args: Any, **kwargs: Any) -> Any:
            opened.append(str(file))
            return real_open(file, *args, **kwargs)

        def spy_stage(config: Any, folder: Path, sources: list[Path], *args: Any) -> Any:
            staged.append([Path(s).name for s in sources])
            return real_stage(config, folder, sources, *args)

        mp.setattr(builtins, "open", spy_open)
        mp.setattr(ingest_lib, "stage", spy_stage)
        nightly = ingest_flow(config=config)
    assert nightly["ingest"]["mode"] == "incremental" and not nightly["cached"]
    assert staged == [[files[-1].name]]
    old = {str((raw / f.name).absolute()) for f in files[:-1]}
    assert not old & {str(Path(name).absolute()) for name in opened}


# ----------------------------------------------------------------------------- retraining


def test_train_window_bounds_what_training_reads(tmp_path: Path) -> None:
    """`train.window` keeps the journeys that ended within it of the data's end, in the
    data module, the baselines' frame and the split sizes; the split stays the ingest's."""
    from journeys.datasets import split_sizes, training_journeys
    from journeys.lightning_parts import JourneyDataModule

    write_days(event_log(seed=8, users=300, days=40), tmp_path / "landing")
    config = config_for(tmp_path / "landing", tmp_path, "train.window=15d")
    report = run_ingest(config).report
    folder = tmp_path / "journeys"
    everything = training_journeys(folder).collect()
    recent = training_journeys(folder, config.train.window_delta).collect()
    since = report.data_end - timedelta(days=15)
    assert 0 < recent.height < everything.height
    assert recent.equals(everything.filter(pl.col("end_time") >= since))
    sizes = split_sizes(folder, config.train.window_delta)
    assert sum(size["n"] for size in sizes.values()) == recent.height
    assert sizes["test"] == split_sizes(folder)["test"]  # the latest split is all recent
    module = JourneyDataModule.from_config(config)
    module.setup()
    assert sum(len(module.splits[s].labels) for s in module.splits) == recent.height


def test_the_attribution_window_opens_only_recent_scores_files(tmp_path: Path) -> None:
    """`attribution.window`: the report covers journeys whose last event is within it of
    the scores' as-of, and scores files whose latest event is older are not opened."""
    from test_score import save_tiny_model

    from journeys import datasets
    from journeys.score import score_dataset
    from journeys.trained_model import load_model

    write_days(event_log(seed=12, users=200, days=40), tmp_path / "landing")
    config = config_for(tmp_path / "landing", tmp_path, "journey.max_gap=2d")
    run_ingest(config)
    journeys = tmp_path / "journeys"
    model = save_tiny_model(tmp_path / "model", Vocabularies.load(journeys), "journey.max_gap=2d")
    scored = score_dataset(load_model(str(model)), journeys, tmp_path / "scores", chunk_journeys=40,
                           progress=False)  # fmt: skip
    since = datasets.scores_window_start(tmp_path / "scores", parse_duration("10d"))
    assert since == scored.as_of - timedelta(days=10)
    opened: list[list[str]] = []
    real_scan = pl.scan_parquet

    def spy(source: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append([Path(p).name for p in source])
        return real_scan(source, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.pl, "scan_parquet", spy)
        recent = datasets.scan_scores(tmp_path / "scores", since).collect()
    everything = datasets.scan_scores(tmp_path / "scores").collect()
    assert recent.equals(everything.filter(pl.col("event_time").list.last() >= since))
    assert 0 < recent.height < everything.height
    assert len(opened[0]) < len(list((tmp_path / "scores").glob("*.parquet")))


def test_an_old_file_delivered_again_under_a_new_name_stops_and_names_full(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """All its rows are late: more than ingest.max_quarantined_share, so the run stops with
    one line naming the reason and `--full`; the journeys stay as they were."""
    files = write_days(event_log(seed=13).filter(pl.col("arrival") < 20), tmp_path / "landing")
    args = ingest_args(tmp_path)
    assert main(args) == 0
    before = (tmp_path / "journeys" / MANIFEST_FILE).read_bytes()
    capsys.readouterr()
    shutil.copy2(files[0], tmp_path / "landing" / "day-000-resent.csv")
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "most as late" in err and "--full" in err, err
    assert (tmp_path / "journeys" / MANIFEST_FILE).read_bytes() == before
    assert read_quarantine(tmp_path / "quarantine").height == pl.read_csv(files[0]).height


def test_scoring_after_a_stopped_ingest_refuses_the_stale_journeys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A nightly ingest that stops leaves the journeys as they were: `journeys score` run
    after it (its own schedule) refuses them with one line naming the stopped ingest, not
    a quiet exit 0 on yesterday's journeys; the next ingest that succeeds clears it."""
    files = write_days(event_log(seed=13).filter(pl.col("arrival") < 20), tmp_path / "landing")
    args = ingest_args(tmp_path)
    assert main(args) == 0
    resent = tmp_path / "landing" / "day-000-resent.csv"
    shutil.copy2(files[0], resent)
    assert main(args) == 2  # all its rows late: the run stops
    capsys.readouterr()
    score = [
        "score", "--model", str(tmp_path), "--set", f"paths.journeys={tmp_path / 'journeys'}",
        "--set", f"paths.scores={tmp_path / 'scores'}",
    ]  # fmt: skip
    assert main(score) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "the last `journeys ingest`" in err and "stopped" in err and "most as late" in err
    assert not (tmp_path / "scores").exists()
    resent.unlink()
    assert main(args) == 0
    check_not_stale(tmp_path / "journeys")  # cleared: nothing raised


def test_the_manifests_hashing_stops_when_the_ingest_does(tmp_path: Path) -> None:
    """New files are hashed while pass 1 reads them; an ingest that fails (or is stopped)
    does not wait for the rest of the bytes: the hashing stops at its next chunk."""
    import threading
    from concurrent.futures import CancelledError

    from journeys.ingest_state import content_hash, fingerprints_meanwhile

    raw = tmp_path / "big.csv"
    raw.write_bytes(b"x" * (3 << 20))
    stop = threading.Event()
    assert len(content_hash(raw, stop)) == 64
    stop.set()
    with pytest.raises(CancelledError):
        content_hash(raw, stop)
    with fingerprints_meanwhile([raw]) as fingerprints:
        assert fingerprints()[str(raw)]["sha256"] == content_hash(raw)
    with pytest.raises(RuntimeError, match="pass 1 failed"), fingerprints_meanwhile([raw]):
        raise RuntimeError("pass 1 failed")  # the block's error, not the hashing's


def test_a_feature_column_that_leaves_the_export_is_null_there_night_after_night(
    tmp_path: Path,
) -> None:
    """The last days' files lack the `channel` column (an export that dropped it): the
    nightly run takes them, with the channel null there, and equals a full rebuild of the
    same files, which reads them the same way."""
    log = event_log(seed=3)
    days = sorted(log.get_column("arrival").unique().to_list())
    files = write_days(log, tmp_path / "all")
    for path in files[-3:]:  # the column leaves the export
        pl.read_csv(path).drop("channel").write_csv(path)
    landing = tmp_path / "landing"
    config = config_for(landing, tmp_path / "nightly", "ingest.max_quarantined_share=1")
    for cut in (len(days) - 5, len(days) - 2, len(days)):
        landing.mkdir(exist_ok=True)
        for path in files[:cut]:
            shutil.copy2(path, landing / path.name)
        report = run_ingest(config).report
    assert report.ingest.mode == "incremental"
    full = run_ingest(
        config_for(files[0].parent, tmp_path / "full", "ingest.max_quarantined_share=1")
    )
    assert full.report.ingest.mode == "full"
    assert_same_as_full(tmp_path / "nightly" / "journeys", tmp_path / "full" / "journeys")
    journeys = pl.read_parquet(tmp_path / "nightly" / "journeys" / "*.parquet")
    assert (
        journeys.select(pl.col("channel").list.eval(pl.element().is_null()).list.any())
        .to_series()
        .any()
    )

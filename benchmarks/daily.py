"""Benchmark the nightly run: incremental ingest + scoring against a full rebuild.

A simulated log of `--days` days (default 90, 300k users, about 3M events) is cut into one
CSV per day, as an export lands each night. 2% of the rows arrive one or two days late
(within `ingest.late_allowed`, 3 days: they land where a full rebuild puts them) and 0.05%
five days late (quarantined as `late`). From day 1, every night copies that day's file
into the landing folder and runs `journeys ingest` (incremental) and `journeys score`
(journeys whose events did not change keep their model output), with a random model of
the default architecture (speed does not depend on trained weights).

At the checkpoint days (30, 60, 90) the night is measured twice, and so is a full
rebuild of the same files (less the rows quarantined as late, which a full rebuild would
take in) into folders of its own:

- **as the schedule runs it**: the commands as processes, `journeys ingest` then
  `journeys score --model <the model>` (wall time: interpreter start, imports and model
  loading included; `--repeats` runs, 3 by default, each on a fresh copy of the state, and
  their median: one night's processes vary by a second on a shared machine), against
  `journeys ingest --full` and `journeys score` (once: a second is 2% of it); each against
  an MLflow store that exists (the experiment alone, made afresh each run), as a
  deployment's does once it has trained, so `journeys score` logs its scoring run as it
  does there (without a store it logs none; a night that logged none stops the benchmark);
- **the work alone**: in a child process that reports its work time (imports excluded)
  and its peak memory: ingest, scoring and the attribution report `journeys score` writes
  after it (the nightly one reads only the scores files that changed, `_sums/`), and the
  monitor's night beside them.

Each night, nightly and rebuild alike, writes its report into its own folders, as a
deployment does.

The model has the default architecture with random weights and, as a run's champion
often does, a stack head (`hgb_aggregates` fitted on the first night's labelled journeys,
its trees read and evaluated by Treelite). The journeys and the scores of the two are
checked equal (scores but for when each row was scored, probabilities to 1e-6: a
journey's padding depends on its batch-mates).

Target: at day 90 the nightly run takes <= 0.15x the full rebuild as the schedule runs it,
and stays flat from day 30 to day 90 while the rebuild grows.

Usage::

    .venv/bin/python benchmarks/daily.py                  # 300k users, 90 days
    .venv/bin/python benchmarks/daily.py --users 20000 --days 30 --checkpoints 10 30 --no-record

Data and folders live under data/bench/daily/ (git-ignored).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "data" / "bench" / "daily"
LATE_SHARE, VERY_LATE_SHARE, VERY_LATE_DAYS = 0.02, 0.0005, 5
WHEN_SCORED = ("as_of", "quiet_seconds", "scored_at")
TARGET = 0.15


def config_for(landing: Path, out: Path):
    from journeys.config import load_config

    return load_config(
        ROOT / "conf" / "default.yaml",
        [
            f"paths.raw={landing}",
            f"paths.journeys={out / 'journeys'}",
            f"paths.quarantine={out / 'quarantine'}",
            f"paths.scores={out / 'scores'}",
            f"paths.reports={out / 'reports'}",
        ],
    )


def make_days(users: int, days: int) -> int:
    """Simulate the log and cut it into day files (`days/` as they land, `on_time/`
    without the very late rows); returns the number of events."""
    from journeys.simulate import simulate

    stamp = WORK / f"log-{users}-{days}.json"
    if stamp.exists():
        return json.loads(stamp.read_text())["events"]
    shutil.rmtree(WORK, ignore_errors=True)
    simulate(WORK / "log", users=users, days=days, seed=0)
    log = pl.read_csv(next((WORK / "log").glob("*.csv")), infer_schema=False)
    rng = np.random.default_rng(0)
    draw = rng.random(log.height)
    delay = np.where(draw < LATE_SHARE, rng.integers(1, 3, log.height), 0)
    delay = np.where(draw > 1 - VERY_LATE_SHARE, VERY_LATE_DAYS, delay)
    day = pl.col("timestamp").str.to_datetime(time_zone="UTC").dt.date()
    first = log.select(day.min()).item()
    log = log.with_columns(
        ((day - pl.lit(first)).dt.total_days() + pl.Series(delay) + 1).alias("_arrival"),
        pl.Series(delay == VERY_LATE_DAYS).alias("_very_late"),
    )
    for folder, rows in (("days", log), ("on_time", log.filter(~pl.col("_very_late")))):
        (WORK / folder).mkdir(parents=True)
        for (arrival,), part in rows.group_by("_arrival"):
            if arrival <= days:
                part.drop("_arrival", "_very_late").write_csv(
                    WORK / folder / f"day-{arrival:03d}.csv"
                )
    shutil.rmtree(WORK / "log")
    stamp.write_text(json.dumps({"events": log.height}))
    return log.height


def night(landing: Path, out: Path, model: Path, full: bool) -> dict[str, float]:
    """One ingest + scoring with its attribution report, as `journeys score` writes it
    (+ the monitor, on a nightly run): their work times (s) and what they did."""
    from journeys.attribution import attribute_command
    from journeys.ingest import run_ingest
    from journeys.monitor import monitor
    from journeys.score import score_dataset
    from journeys.trained_model import load_model

    config = config_for(landing, out)
    trained = load_model(str(model))
    started = time.perf_counter()
    report = run_ingest(config, full=full).report
    ingested = time.perf_counter()
    scored = score_dataset(
        trained, config.paths.journeys, config.paths.scores, progress=False,
        chunk_journeys=config.score.chunk_journeys, keep_earlier=not full,
        metadata={"model_uri": trained.model_uri, "model_version": trained.model_version},
    )  # fmt: skip
    scored_at = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):  # the report prints its credit tables
        attribute_command(config, trained=trained)
    done = time.perf_counter()
    alerts = 0 if full else len(monitor(config, trained).alerts)
    return {
        "ingest_s": ingested - started,
        "score_s": scored_at - ingested,
        "report_s": done - scored_at,
        "monitor_s": 0.0 if full else time.perf_counter() - done,
        "alerts": alerts,
        "rows_read": report.ingest.rows_read,
        "journeys": report.journeys,
        "scored_now": scored.rows - scored.kept,
        "late": report.quarantined["late"],
    }


def peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(args: argparse.Namespace) -> None:
    # Imports before the clock: the parent's, the plotting library the report and the
    # monitor share (a process imports it once, whichever step comes first), and SciPy's
    # statistics, the monitor's tests (`journeys monitor` pays for them at its start).
    import matplotlib.pyplot  # noqa: F401
    import scipy.stats  # noqa: F401

    import journeys.encoding  # noqa: F401

    result = night(Path(args.landing), Path(args.out), Path(args.model), args.child == "full")
    print(json.dumps({**result, "peak_mb": peak_mb()}))


def in_child(kind: str, landing: Path, out: Path, model: Path) -> dict[str, float]:
    command = [
        sys.executable, __file__, "--child", kind, "--landing", str(landing),
        "--out", str(out), "--model", str(model),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def journeys_command() -> str:
    """The `journeys` command of this interpreter's environment."""
    return str(Path(sys.executable).with_name("journeys"))


STORE = WORK / "mlflow.db"  # the deployment's MLflow store; scheduled nights get a copy


def make_tracking_store() -> None:
    """An MLflow store holding the default experiment alone, made afresh (a store kept from
    an older MLflow could fail to take runs, and scoring would then quietly log none)."""
    from journeys.config import load_config
    from journeys.tracking import get_experiment_id

    STORE.unlink(missing_ok=True)
    experiment = load_config(ROOT / "conf" / "default.yaml", []).mlflow.experiment
    get_experiment_id(f"sqlite:///{STORE}", experiment)


def logged_runs(store: Path) -> int:
    import sqlite3

    with contextlib.closing(sqlite3.connect(store)) as db:
        return db.execute("SELECT COUNT(*) FROM runs").fetchone()[0]


def as_scheduled(landing: Path, out: Path, model: Path, full: bool) -> dict[str, float]:
    """The night as the schedule runs it: `journeys ingest` then `journeys score` as
    processes, `journeys score` logging its run to the deployment's store; their wall
    times (s)."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(STORE, out / "mlflow.db")
    settings = [
        f"paths.raw={landing}",
        f"paths.journeys={out / 'journeys'}",
        f"paths.quarantine={out / 'quarantine'}",
        f"paths.scores={out / 'scores'}",
        f"paths.reports={out / 'reports'}",
        f"mlflow.tracking_uri=sqlite:///{out / 'mlflow.db'}",
    ]
    sets = [arg for setting in settings for arg in ("--set", setting)]
    times = {}
    for name, command in (
        ("ingest_s", ["ingest", *(["--full"] if full else []), *sets]),
        ("score_s", ["score", "--model", str(model), *sets]),
    ):
        started = time.perf_counter()
        subprocess.run([journeys_command(), *command], capture_output=True, check=True)
        times[name] = time.perf_counter() - started
    if logged_runs(out / "mlflow.db") < 1:
        raise SystemExit(f"journeys score logged no run to {out / 'mlflow.db'}: see its stderr")
    return times


def with_stack(model: Path, journeys: Path) -> None:
    """Give the saved model a stack head, `hgb_aggregates` fitted on `journeys` as they
    are on the first night, open ones and all (its fit does not matter here, its loading
    does), and a monitoring reference from those journeys and the model's probabilities."""
    from journeys.baselines import BaselineSettings, fit_baseline
    from journeys.datasets import scan_journeys
    from journeys.inputs import CategoricalInput
    from journeys.stacking import Stack
    from journeys.trained_model import TrainedModel

    train = scan_journeys(journeys).collect()
    trained = TrainedModel.load(model)
    columns = (CategoricalInput("channel"), CategoricalInput("device"))
    booster = fit_baseline("hgb_aggregates", train, BaselineSettings(columns))
    trained.stack = Stack(booster, (0.5, 0.5), 0.0)  # type: ignore[arg-type]
    from journeys.reference import build_reference

    probabilities = trained.probabilities(trained.predict_logits(train), train)
    numeric = trained.encoder.numeric_features
    trained.reference = build_reference(
        train, probabilities, trained.encoder.vocabs, numeric, None, None
    )
    trained.save(model)


def same_outputs(nightly: Path, full: Path) -> bool:
    from polars.testing import assert_frame_equal

    a = pl.read_parquet(nightly / "journeys" / "*.parquet").sort("journey_id")
    b = pl.read_parquet(full / "journeys" / "*.parquet").sort("journey_id")
    scores = [
        pl.read_parquet(f / "scores" / "*.parquet").drop(WHEN_SCORED).sort("journey_id")
        for f in (nightly, full)
    ]
    try:
        assert_frame_equal(*scores, abs_tol=1e-6)
    except AssertionError:
        return False
    return a.equals(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=300_000)
    parser.add_argument("--days", type=int, default=90)
    parser.add_argument("--checkpoints", type=int, nargs="+", default=[30, 60, 90])
    parser.add_argument(
        "--repeats", type=int, default=3,
        help="runs of each checkpoint's night as scheduled, each on a fresh copy of the "
        "state: the median is the figure (a night's processes vary by a second here)",
    )  # fmt: skip
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument(
        "--keep-before", action="store_true",
        help="keep the nightly state as it stood before the last checkpoint's night in "
        "data/bench/daily/before/ (to profile one night again)",
    )  # fmt: skip
    parser.add_argument("--child", choices=["nightly", "full"])
    parser.add_argument("--landing")
    parser.add_argument("--out")
    parser.add_argument("--model")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats: at least 1")
    if args.child:
        child(args)
        return

    from recording import machine, record_section
    from score import random_model

    import journeys.encoding  # noqa: F401

    events = make_days(args.users, args.days)
    make_tracking_store()
    landing, nightly, full = WORK / "landing", WORK / "nightly", WORK / "full"
    for folder in (landing, nightly, full, WORK / "model"):
        shutil.rmtree(folder, ignore_errors=True)
    landing.mkdir()
    model = None
    rows = []
    for day in range(1, args.days + 1):
        for folder in (landing,):
            source = WORK / "days" / f"day-{day:03d}.csv"
            if source.exists():
                shutil.copy2(source, folder / source.name)
        if model is None:  # the first night: a model with its vocabularies
            from journeys.ingest import run_ingest

            run_ingest(config_for(landing, nightly))
            model = random_model(nightly / "journeys")
            with_stack(model, nightly / "journeys")
        if day not in args.checkpoints:
            result = night(landing, nightly, model, full=False)
            print(
                f"day {day:3d}: ingest {result['ingest_s']:5.2f} s, score "
                f"{result['score_s']:5.2f} s ({result['scored_now']:,} scored now), report "
                f"{result['report_s']:5.2f} s, monitor "
                f"{result['monitor_s']:5.2f} s ({result['alerts']} alerts)",
                flush=True,
            )
            continue
        on_time = WORK / "on_time_landing"
        shutil.rmtree(on_time, ignore_errors=True)
        on_time.mkdir()
        for file in sorted(landing.glob("*.csv")):
            shutil.copy2(WORK / "on_time" / file.name, on_time / file.name)
        shutil.rmtree(full, ignore_errors=True)
        # As the schedule runs it, on copies of last night's state; then the work alone.
        scheduled = WORK / "scheduled"
        runs = []
        for _ in range(args.repeats):
            shutil.rmtree(scheduled, ignore_errors=True)
            shutil.copytree(nightly, scheduled)
            runs.append(sum(as_scheduled(landing, scheduled, model, False).values()))
        shutil.rmtree(scheduled)
        if args.keep_before and day == args.checkpoints[-1]:
            shutil.rmtree(WORK / "before", ignore_errors=True)
            shutil.copytree(nightly, WORK / "before")
        incremental = in_child("nightly", landing, nightly, model)
        incremental["processes_s"] = float(np.median(runs))
        incremental["processes_range"] = (min(runs), max(runs))
        rebuild = in_child("full", on_time, full, model)
        rebuild["processes_s"] = sum(as_scheduled(on_time, scheduled, model, True).values())
        shutil.rmtree(scheduled)
        equal = same_outputs(nightly, full)
        rows.append((day, incremental, rebuild, equal))
        print(f"day {day}: nightly {incremental}, full {rebuild}, equal {equal}", flush=True)

    table = [
        "| day | as scheduled: nightly (median of the runs, range) / full rebuild (processes) "
        "| ratio | work alone: nightly "
        "ingest + score + report (scored now) | full rebuild: ingest + score + report | ratio "
        "| peak memory nightly / full | equal | monitor (work alone) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for day, inc, reb, equal in rows:
        steps = ("ingest_s", "score_s", "report_s")
        n_total, f_total = sum(inc[s] for s in steps), sum(reb[s] for s in steps)
        n_proc, f_proc = inc["processes_s"], reb["processes_s"]
        low, high = inc["processes_range"]
        table.append(
            f"| {day} | {n_proc:.1f} s ({low:.1f}-{high:.1f}) / {f_proc:.1f} s "
            f"| **{n_proc / f_proc:.3f}x** "
            f"| {' + '.join(f'{inc[s]:.1f}' for s in steps)} = {n_total:.1f} s "
            f"({inc['scored_now']:,} of {reb['journeys']:,}) | "
            f"{' + '.join(f'{reb[s]:.1f}' for s in steps)} = {f_total:.1f} s | "
            f"{n_total / f_total:.3f}x | "
            f"{inc['peak_mb']:,.0f} / {reb['peak_mb']:,.0f} MB | {'yes' if equal else 'NO'} "
            f"| {inc['monitor_s']:.1f} s ({inc['monitor_s'] / n_total:.0%} of the night's work, "
            f"{inc['alerts']:.0f} alerts) |"
        )
    text = "\n".join(
        [
            f"## Nightly runs ({date.today()}, {args.users:,} users, {events:,} events over "
            f"{args.days} days)",
            "",
            f"`benchmarks/daily.py --users {args.users} --days {args.days} --checkpoints "
            f"{' '.join(map(str, args.checkpoints))}` on {machine()}. Day files as they land "
            f"({LATE_SHARE:.0%} of rows 1-2 days late, {VERY_LATE_SHARE:.2%} "
            f"{VERY_LATE_DAYS} days late: quarantined as `late`); every night `journeys "
            "ingest` (incremental) and `journeys score` (journeys whose events did not change keep "
            "their model output), "
            "against a full rebuild of the same files (less the late-quarantined rows) in "
            "folders of its own. As scheduled: the two commands as processes (imports and "
            "loading the model, a stack with its booster, included), each in its own folders, "
            "`journeys score` logging its run to an MLflow store that exists (SQLite), "
            f"the attribution report too, the night run {args.repeats} times on fresh copies "
            "of its state (the median, and the range), the rebuild once; work alone: in a "
            "child process (imports excluded), "
            "ingest, scoring and the attribution report `journeys score` writes, with its "
            "peak RSS; the monitor beside them. Target: day "
            f"{args.checkpoints[-1]} <= {TARGET}x as scheduled, flat from the first "
            "checkpoint on.",
            "",
            *table,
        ]
    )
    print(text)
    if not args.no_record:
        record_section(text + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()

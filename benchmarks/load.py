"""Load test: one scheduled-batch day at scale through `journeys ingest` and `journeys score`.

Each stage runs as its own child process (the real CLI), so its wall time and peak
memory (the child's max RSS from `getrusage(RUSAGE_CHILDREN)`) are measured alone:

1. simulate: `journeys.simulate.simulate` writes ~20 events per user (cached);
2. model: a tiny transformer trained once on a small simulated log (`journeys train`,
   d_model 16, one layer, one epoch, the prior baseline; SQLite tracking under the
   work folder) - speed and memory of scoring do not depend on model quality;
3. ingest: the big log -> journeys, quarantine and `ingest_report.json`;
4. score: every journey -> scores with per-event attention (`journeys score`).

Checks: nothing lost (the report's row accounting balances; scores rows == journeys
rows, one per journey id) and every stage's peak RSS under `--memory-bound-gb`.

Usage::

    .venv/bin/python benchmarks/load.py                    # 20 M events (~1 M users)
    .venv/bin/python benchmarks/load.py --events 5000000   # scaled down
    .venv/bin/python benchmarks/load.py --events 200000 --no-record   # smoke run

Data live under data/bench/load/; the run replaces the "## Load" section of
benchmarks/RESULTS.md unless `--no-record`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "data" / "bench" / "load"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
EVENTS_PER_USER = 20  # the simulator's default behaviour writes about this many
DEFAULT_EVENTS = 20_000_000
MEMORY_BOUND_GB = 4.0
TINY = [
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=1",
    "train.max_epochs=1",
    "train.baselines=[prior]",
    "train.accelerator=cpu",
]
ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PYTHONUNBUFFERED": "1",
}


def run_stage(name: str, command: list[str], env: dict[str, str]) -> dict[str, float]:
    """Run one stage as a child process; its wall time and peak RSS (GB). Raises on failure.

    A fresh Python process runs the command and reports its own child's max RSS, so
    earlier stages (with larger peaks) never mask a later one.
    """
    probe = (
        "import resource, subprocess, sys, json;"
        "rc = subprocess.call(sys.argv[1:]);"
        "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss;"
        "print(json.dumps({'rc': rc, 'peak_kb': peak}), file=sys.stderr)"
    )
    started = time.perf_counter()
    process = subprocess.run(
        [sys.executable, "-c", probe, *command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    seconds = time.perf_counter() - started
    last = process.stderr.strip().splitlines()[-1]
    stats = json.loads(last)
    if stats["rc"] != 0:
        tail = "\n".join(process.stderr.strip().splitlines()[-15:])
        raise SystemExit(f"{name} failed (exit {stats['rc']}):\n{process.stdout[-2000:]}\n{tail}")
    peak_gb = stats["peak_kb"] / 1024**2
    print(f"{name}: {seconds:,.1f} s, peak RSS {peak_gb:.2f} GB", flush=True)
    return {"seconds": seconds, "peak_gb": peak_gb}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "journeys.cli", *args]


def paths(folder: Path, raw: Path) -> list[str]:
    return [
        "--set",
        f"paths.raw={raw}",
        "--set",
        f"paths.journeys={folder / 'journeys'}",
        "--set",
        f"paths.quarantine={folder / 'quarantine'}",
        "--set",
        f"paths.scores={folder / 'scores'}",
        "--set",
        f"paths.reports={folder / 'reports'}",
        "--set",
        f"paths.checkpoints={folder / 'checkpoints'}",
    ]


def simulated(events: int) -> tuple[Path, float]:
    """A simulated log of about `events` events (cached); (folder, seconds to write it)."""
    from journeys.simulate import simulate

    users = max(100, events // EVENTS_PER_USER)
    out = WORK / f"raw-{users}"
    if (out / "events.csv").exists():
        return out, 0.0
    started = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    result = simulate(out, users=users, seed=0)
    seconds = time.perf_counter() - started
    print(f"simulated {result.n_events:,} events of {users:,} users in {seconds:,.0f} s")
    return out, seconds


def tiny_model(env: dict[str, str]) -> str:
    """Train the tiny model once (cached); its `models:/...@champion` URI."""
    folder = WORK / "model"
    marker = folder / "trained.json"
    if marker.exists():
        return json.loads(marker.read_text())["uri"]
    shutil.rmtree(folder, ignore_errors=True)
    raw, _ = simulated(60_000)
    sets = [arg for item in TINY for arg in ("--set", item)]
    run_stage("model: ingest", cli("ingest", *paths(folder, raw)), env)
    run_stage("model: train", cli("train", *paths(folder, raw), *sets), env)
    uri = "models:/journey-conversion@champion"
    marker.write_text(json.dumps({"uri": uri}))
    return uri


def count_rows(folder: Path) -> tuple[int, int]:
    """(rows, distinct journey ids) of a Parquet folder, lazily."""
    import polars as pl

    frame = pl.scan_parquet(sorted(folder.glob("*.parquet"))).select(
        pl.len().alias("rows"), pl.col("journey_id").n_unique().alias("ids")
    )
    rows, ids = frame.collect().row(0)
    return int(rows), int(ids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=DEFAULT_EVENTS)
    parser.add_argument("--memory-bound-gb", type=float, default=MEMORY_BOUND_GB)
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep journeys and scores")
    args = parser.parse_args(argv)

    WORK.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **ENV, "MLFLOW_TRACKING_URI": f"sqlite:///{WORK / 'model' / 'mlflow.db'}"}
    (WORK / "model").mkdir(parents=True, exist_ok=True)
    model = tiny_model(env)
    raw, simulate_s = simulated(args.events)
    day = WORK / "day"
    shutil.rmtree(day, ignore_errors=True)
    stages = {
        "ingest": run_stage("ingest", cli("ingest", *paths(day, raw)), env),
        "score": run_stage(
            "score",
            cli("score", *paths(day, raw), "--model", model, "--input", str(day / "journeys")),
            env,
        ),
    }

    report = json.loads((day / "journeys" / "ingest_report.json").read_text())
    accounted = (
        report["rows_valid"]
        + report["quarantined_total"]
        + report["duplicates_dropped"]
        + report["dropped_by_config"]
    )
    journeys, journey_ids = count_rows(day / "journeys")
    scores, score_ids = count_rows(day / "scores")
    checks = {
        "row accounting balances": report["rows_read"] == accounted,
        "scores rows == journeys rows": scores == journeys == report["journeys"],
        "one score per journey id": score_ids == journey_ids == scores,
        f"peak RSS < {args.memory_bound_gb:g} GB": all(
            s["peak_gb"] < args.memory_bound_gb for s in stages.values()
        ),
    }
    for name, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    summary = {
        "events": report["rows_read"],
        "users": report["users"],
        "journeys": journeys,
        "scores": scores,
        "simulate_s": simulate_s,
        "stages": stages,
        "checks": checks,
    }
    print(json.dumps(summary, indent=2))
    if not args.no_record:
        record(args, summary, report)
    if not args.keep:
        shutil.rmtree(day, ignore_errors=True)
    return 0 if all(checks.values()) else 1


def record(args: argparse.Namespace, summary: dict, report: dict) -> None:
    """Replace the "## Load" section of benchmarks/RESULTS.md with this run."""
    import torch

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.recording import record_section

    command = "python benchmarks/load.py" + (
        f" --events {args.events}" if args.events != DEFAULT_EVENTS else ""
    )
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores "
        f"(shared, load average {os.getloadavg()[0]:.1f} at the end), no GPU; "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )
    lines = [
        f"## Load ({datetime.now(UTC):%Y-%m-%d})",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine}",
        f"- Input: {summary['events']:,} simulated raw rows (CSV), {summary['users']:,} users "
        f"-> {summary['journeys']:,} journeys; tiny model (d_model 16, 1 layer), "
        "attention `pooled`",
        "",
        "| stage | wall time (s) | peak RSS (GB) | rows/s |",
        "|---|---:|---:|---:|",
    ]
    per = {"ingest": summary["events"], "score": summary["scores"]}
    for name, stats in summary["stages"].items():
        rate = per[name] / stats["seconds"]
        lines.append(f"| {name} | {stats['seconds']:,.1f} | {stats['peak_gb']:.2f} | {rate:,.0f} |")
    lines += ["", "Checks:"]
    lines += [f"- {'ok' if ok else 'FAILED'}: {name}" for name, ok in summary["checks"].items()]
    lines += [
        f"- rows_read {report['rows_read']:,} = valid {report['rows_valid']:,} + quarantined "
        f"{report['quarantined_total']:,} + duplicates {report['duplicates_dropped']:,} + "
        f"dropped by config {report['dropped_by_config']:,}",
        "",
    ]
    record_section("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())

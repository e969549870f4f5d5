"""Benchmark a Dask cluster's scale-out: ingest and scoring on 2 workers against 1.

The docs' recipe on one machine (docs/operations.md, "A Dask cluster"): a scheduler and
`--workers` single-thread workers on 127.0.0.1, each with its share of the cores
(`--nthreads 1`, `POLARS_MAX_THREADS=1`; PyTorch follows `--nthreads`). On the same
simulated log, the ingest flow (`ingest.partitions` partitions mapped over the workers)
and the score stage (chunks of `score.chunk_journeys` mapped the same way, a random model
of the default architecture) run on a cluster of 1 worker, then of 2, then of 1 and 2 again
(A B B A); each figure is the better of its two runs. The journeys and scores of every
run must be equal.

Pass 1 of ingest (reading and cleaning the raw files) and the flow's own work run on the
flow's host, not on the workers: the ratio is the whole stage's, as a user waits for it.

Usage::

    .venv/bin/python benchmarks/dask_workers.py                 # 100k users
    .venv/bin/python benchmarks/dask_workers.py --users 5000 --no-record

Data and folders live under data/bench/dask/ (git-ignored).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import date
from pathlib import Path

import polars as pl

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "data" / "bench" / "dask"
PARTITIONS = 8
CHUNK_JOURNEYS = 20_000
START_TIMEOUT_S = 120


@contextlib.contextmanager
def cluster(workers: int) -> Iterator[str]:
    """A scheduler and `workers` single-thread workers on 127.0.0.1 (the recipe without
    TLS: this measures the work, not the handshake)."""
    from distributed import Client

    from flows.prefect_server import free_port
    from journeys.processes import stop_group

    dask = str(Path(sys.executable).with_name("dask"))
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    loopback = ["--dashboard-address", "127.0.0.1:0"]
    quiet = {
        "stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "cwd": WORK,
        "start_new_session": True,  # a group each, for stop_group
    }  # fmt: skip
    env = {**os.environ, "POLARS_MAX_THREADS": "1"}
    processes = [
        subprocess.Popen(
            [dask, "scheduler", "--host", "127.0.0.1", "--port", str(port), *loopback], **quiet
        )
    ]
    processes += [
        subprocess.Popen([dask, "worker", address, "--nthreads", "1", *loopback], env=env, **quiet)
        for _ in range(workers)
    ]
    try:
        with Client(address, timeout=START_TIMEOUT_S) as client:
            client.wait_for_workers(workers, timeout=START_TIMEOUT_S)
        yield address
    finally:
        for process in reversed(processes):  # a worker's processes go with its group
            stop_group(process)


def one_run(workers: int, raw: Path, model: Path, out: Path) -> dict[str, float]:
    """Ingest and score on a fresh cluster of `workers`; their wall times (s)."""
    from prefect import flow

    from flows import pipeline
    from flows.settings import Orchestration
    from journeys.config import load_config
    from journeys.score import score_dataset
    from journeys.trained_model import load_model

    shutil.rmtree(out, ignore_errors=True)
    trained = load_model(str(model))
    with cluster(workers) as address:
        settings = Orchestration(task_runner="dask", dask_address=address, retries=0)
        config = load_config(
            None,
            [
                f"paths.raw={raw}",
                f"paths.journeys={out / 'journeys'}",
                f"paths.quarantine={out / 'quarantine'}",
                f"paths.scores={out / 'scores'}",
                f"ingest.partitions={PARTITIONS}",
                f"score.chunk_journeys={CHUNK_JOURNEYS}",
                "orchestration.task_runner=dask",
                f"orchestration.dask_address={address}",
                "orchestration.retries=0",
                "orchestration.cache=false",
            ],
        )

        @flow(name="bench-score")
        def score_on_cluster() -> None:
            score_dataset(
                trained,
                out / "journeys",
                out / "scores",
                progress=False,
                chunk_journeys=CHUNK_JOURNEYS,
                map_chunks=pipeline.chunks_as_tasks(settings),
            )

        started = time.perf_counter()
        pipeline.ingest_flow(config=config)
        ingested = time.perf_counter()
        score_on_cluster()
        scored = time.perf_counter()
    return {"ingest_s": ingested - started, "score_s": scored - ingested}


def outputs(out: Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    from journeys.datasets import read_journeys

    journeys = read_journeys(out / "journeys").sort("journey_id")
    scores = pl.read_parquet(out / "scores" / "*.parquet").drop("scored_at").sort("journey_id")
    return journeys, scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()

    from recording import machine, record_section
    from score import random_model

    from flows.prefect_server import run_server
    from journeys.config import load_config
    from journeys.ingest import run_ingest
    from journeys.simulate import simulate

    WORK.mkdir(parents=True, exist_ok=True)
    raw = WORK / f"raw-{args.users}"
    if not raw.exists():
        simulate(raw, users=args.users, seed=0)
    first = WORK / "vocab"
    shutil.rmtree(first, ignore_errors=True)
    report = run_ingest(
        load_config(
            None,
            [
                f"paths.raw={raw}",
                f"paths.journeys={first / 'journeys'}",
                f"paths.quarantine={first / 'quarantine'}",
            ],
        )
    ).report
    events = report.ingest.rows_read
    model = random_model(first / "journeys")

    runs: dict[int, list[dict[str, float]]] = {1: [], 2: []}
    reference = None
    with run_server():  # the workers report to it: no temporary server of their own
        for workers in (1, 2, 2, 1):
            out = WORK / f"out-{workers}"
            runs[workers].append(one_run(workers, raw, model, out))
            produced = outputs(out)
            if reference is None:
                reference = produced
            assert all(a.equals(b) for a, b in zip(reference, produced, strict=True)), workers
            print(workers, "worker(s):", runs[workers][-1], flush=True)

    best = {k: {s: min(r[s] for r in v) for s in ("ingest_s", "score_s")} for k, v in runs.items()}
    ratio = {s: best[2][s] / best[1][s] for s in ("ingest_s", "score_s")}
    total = (best[2]["ingest_s"] + best[2]["score_s"]) / (best[1]["ingest_s"] + best[1]["score_s"])
    text = "\n".join(
        [
            f"## Dask workers ({date.today().isoformat()})",
            "",
            f"`benchmarks/dask_workers.py --users {args.users}`: {events:,} events, "
            f"{reference[0].height:,} journeys, {PARTITIONS} ingest partitions, scoring chunks of "
            f"{CHUNK_JOURNEYS:,}; single-thread workers on 127.0.0.1 (`POLARS_MAX_THREADS=1`), "
            "the better of two runs each (A B B A); journeys and scores equal in every run.",
            f"Machine: {machine(with_load=True)}.",
            "",
            "| stage | 1 worker | 2 workers | 2 / 1 |",
            "|---|---|---|---|",
            f"| ingest flow | {best[1]['ingest_s']:.1f} s | {best[2]['ingest_s']:.1f} s | "
            f"{ratio['ingest_s']:.2f}x |",
            f"| scoring | {best[1]['score_s']:.1f} s | {best[2]['score_s']:.1f} s | "
            f"{ratio['score_s']:.2f}x |",
            f"| both | | | **{total:.2f}x** |",
            "",
            "Pass 1 of ingest (reading and cleaning the raw files) runs on the flow's host; "
            "the workers share this machine's cores with it.",
        ]
    )
    print(text)
    if not args.no_record:
        record_section(text + "\n")


if __name__ == "__main__":
    main()

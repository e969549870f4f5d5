"""A real Dask cluster, as a team runs one: a scheduler and two worker processes on
127.0.0.1, started and stopped here, the workers in a folder of their own. The ingest
partitions and the score chunks run on the workers, and the outputs equal the thread
runner's. The workers' own temporary Prefect servers can outlive them (issue 41, item 2):
the fixture stops whatever the cluster started. Needs the `dask` extra (`make test` installs it)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import polars as pl
import psutil
import pytest
from conftest import free_port
from test_flows import isolated, orchestrate, tiny_config

WORKERS = 2
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 90


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[str]:
    """`tcp://127.0.0.1:<port>` of a scheduler with two single-thread workers; on exit
    every process the cluster started (the workers' Prefect servers too) is stopped."""
    from distributed import Client

    dask = str(Path(sys.executable).with_name("dask"))
    address = f"tcp://127.0.0.1:{free_port()}"
    elsewhere = tmp_path / "workers"  # not the flow's folder: relative paths would miss
    elsewhere.mkdir()
    loopback = ["--dashboard-address", "127.0.0.1:0"]
    started = [
        subprocess.Popen(
            [dask, "scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
             *loopback],
            cwd=elsewhere, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
    ]  # fmt: skip
    started += [
        subprocess.Popen(
            [dask, "worker", address, "--nthreads", "1", "--name", f"w{i}", *loopback],
            cwd=elsewhere, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for i in range(WORKERS)
    ]  # fmt: skip
    try:
        with Client(address, timeout=START_TIMEOUT_S) as client:
            client.wait_for_workers(WORKERS, timeout=START_TIMEOUT_S)
        yield address
    finally:
        family = []
        for process in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                family += psutil.Process(process.pid).children(recursive=True)
        for process in started:
            process.send_signal(signal.SIGTERM)
        for process in started:
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
        # Each worker starts a temporary Prefect server of its own, which can outlive it
        # (issue 41, item 2, open: under the full suite's load it did, after SIGTERM too):
        # stopped here so that no test leaves one behind.
        _, alive = psutil.wait_procs(family, timeout=STOP_TIMEOUT_S)
        for straggler in alive:
            if running(straggler):
                straggler.kill()


def running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def workers(address: str) -> list[str]:
    from distributed import Client

    with Client(address) as client:
        return list(client.scheduler_info()["workers"])


@pytest.mark.slow
def test_ingest_and_scoring_on_a_dask_cluster_equal_the_thread_runner(
    tmp_path: Path, cluster: str
) -> None:
    from distributed import Client, get_task_stream

    from flows.pipeline import ingest_flow, pipeline_flow, score_flow
    from journeys.datasets import read_journeys
    from journeys.simulate import simulate

    simulate(tmp_path / "raw", users=300, seed=5)
    with isolated(tmp_path) as mp:
        # The reference: the whole pipeline on threads (ingest, train, score).
        config = tiny_config(tmp_path, "ingest.partitions=4", "promotion.guard=false")
        orchestrate(mp, task_runner="thread", max_workers=2)
        pipeline_flow(config=config)

        on_dask = tiny_config(
            tmp_path,
            "ingest.partitions=4",
            "promotion.guard=false",
            f"paths.journeys={tmp_path / 'dask' / 'journeys'}",
            f"paths.quarantine={tmp_path / 'dask' / 'quarantine'}",
            f"paths.scores={tmp_path / 'dask' / 'scores'}",
            f"paths.reports={tmp_path / 'dask' / 'reports'}",
        )
        orchestrate(mp, task_runner="dask", dask_address=cluster)
        with Client(cluster) as client, get_task_stream(client) as stream:
            ingest_flow(config=on_dask)
            score_flow(config=on_dask, attribute=False)

    # The 4 partitions and the score chunk(s) ran on the cluster's workers.
    assert len(stream.data) >= 4 + 1, stream.data
    assert {task["worker"] for task in stream.data} <= set(workers(cluster))
    journeys = read_journeys(tmp_path / "journeys").sort("journey_id")
    assert journeys.height > 0
    assert journeys.equals(read_journeys(tmp_path / "dask" / "journeys").sort("journey_id"))

    def scores(folder: Path) -> pl.DataFrame:
        frame = pl.read_parquet(folder / "*.parquet").drop("scored_at")  # the run's moment
        return frame.sort("journey_id")

    assert scores(tmp_path / "scores").equals(scores(tmp_path / "dask" / "scores"))

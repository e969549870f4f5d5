"""A real Dask cluster, as docs/operations.md tells a team to run one: a scheduler and two
worker processes on 127.0.0.1 over TLS (mutual, one self-signed certificate), dashboards on
loopback, the workers in a folder of their own with their secrets and thread limits in
their environment. The ingest partitions and the score chunks run on the workers, and:

- the outputs equal the thread runner's;
- the workers' task runs are recorded by the flow's Prefect API, and no worker starts a
  temporary Prefect server of its own (none is left after a worker is killed with SIGKILL);
- PyTorch on a worker uses the worker's share of the cores (`--nthreads`);
- against a Prefect server that wants credentials, the workers use their own, and no
  secret is in any byte the flow sends to the cluster;
- a worker that cannot see the flow's folders stops the run with one line naming it.

Needs the `dask` extra (`make test` installs it) and `openssl` for the certificate.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import psutil
import pytest
from conftest import free_port
from test_flows import isolated, orchestrate, tiny_config

from flows.prefect_server import api_answers
from journeys.processes import stop_group

pytestmark = pytest.mark.slow

WORKERS = 2
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 90
SERVER_START_TIMEOUT_S = 120
AUTH_SECRET = "prefect-S3cr3t-91d2"
TRACKING_SECRET = "mlflow-S3cr3t-5e7a"
HEADER_SECRET = "header-S3cr3t-0b4c"


@dataclass
class Cluster:
    address: str  # tls://127.0.0.1:<port>
    tls: dict[str, str]  # Dask's configuration for a client of this cluster
    processes: list[subprocess.Popen]  # the scheduler, then one `dask worker` each


def certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (the recipe's openssl line)."""
    cert, key = folder / "cluster.pem", folder / "cluster.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
         "-subj", "/CN=journeys-dask", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@contextlib.contextmanager
def dask_cluster(folder: Path, worker_env: dict[str, str] | None = None) -> Iterator[Cluster]:
    """A scheduler and two single-thread workers, started in `folder` (not the flow's: a
    relative path would miss); on exit every process the cluster started is stopped."""
    from distributed import Client

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: `make test-tools` installs it")
    dask = str(Path(sys.executable).with_name("dask"))
    folder.mkdir()
    cert, key = certificate(folder)
    tls = ["--tls-ca-file", str(cert), "--tls-cert", str(cert), "--tls-key", str(key)]
    loopback = ["--dashboard-address", "127.0.0.1:0"]
    address = f"tls://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_")}
    env |= {"POLARS_MAX_THREADS": "1", **(worker_env or {})}  # as given, nothing else
    quiet: dict[str, Any] = {"cwd": folder, "stdout": subprocess.DEVNULL,
                             "stderr": subprocess.DEVNULL, "start_new_session": True}  # fmt: skip
    processes = [
        subprocess.Popen(
            [dask, "scheduler", "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
             *loopback, *tls],
            **quiet,
        )
    ]  # fmt: skip
    processes += [
        subprocess.Popen(
            [dask, "worker", address, "--nthreads", "1", "--name", f"w{i}", *loopback, *tls],
            env=env, **quiet,
        )
        for i in range(WORKERS)
    ]  # fmt: skip
    config = {
        "distributed.comm.tls.ca-file": str(cert),
        "distributed.comm.tls.client.cert": str(cert),
        "distributed.comm.tls.client.key": str(key),
    }
    try:
        import dask.config

        with dask.config.set(config), Client(address, timeout=START_TIMEOUT_S) as client:
            client.wait_for_workers(WORKERS, timeout=START_TIMEOUT_S)
        yield Cluster(address, config, processes)
    finally:
        for process in reversed(processes):  # each in a group of its own: the worker
            stop_group(process)  # processes under a nanny go with it (SIGTERM, then KILL)


def prefect_servers(processes: list[psutil.Process]) -> list[list[str]]:
    """The command lines of the Prefect API servers (temporary or not) among `processes`
    still running."""
    found = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            line = process.cmdline()
            joined = " ".join(line)
            server = "prefect.server.api.server:create_app" in joined or "server start" in joined
            if server and process.status() != psutil.STATUS_ZOMBIE:
                found.append(line)
    return found


def descendants(processes: list[subprocess.Popen]) -> list[psutil.Process]:
    family = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            family += psutil.Process(process.pid).children(recursive=True)
    return family


def task_runs(flow_name: str) -> list[Any]:
    """The task runs of the latest run of the flow called `flow_name`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterId,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        flows = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
            sort=FlowRunSort.START_TIME_DESC,
            limit=1,
        )
        assert flows, flow_name
        return client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flows[0].id]))
        )


def on_dask(tmp_path: Path, name: str, *overrides: str) -> Any:
    return tiny_config(
        tmp_path,
        "ingest.partitions=4",
        "promotion.guard=false",
        *[f"paths.{p}={tmp_path / name / p}" for p in ("journeys", "quarantine", "scores", "reports")],
        *overrides,
    )  # fmt: skip


def test_ingest_and_scoring_on_a_dask_cluster_equal_the_thread_runner(tmp_path: Path) -> None:
    import dask.config
    from distributed import Client, get_task_stream

    from flows.pipeline import ingest_flow, pipeline_flow, score_flow
    from journeys.datasets import read_journeys
    from journeys.simulate import simulate

    simulate(tmp_path / "raw", users=300, seed=5)
    with isolated(tmp_path) as mp, dask_cluster(tmp_path / "workers") as cluster:
        # The reference: the whole pipeline on threads (ingest, train, score).
        config = tiny_config(tmp_path, "ingest.partitions=4", "promotion.guard=false")
        orchestrate(mp, task_runner="thread", max_workers=2)
        pipeline_flow(config=config)

        orchestrate(mp, task_runner="dask", dask_address=cluster.address)
        with dask.config.set(cluster.tls), Client(cluster.address) as client:
            with get_task_stream(client) as stream:
                ingest_flow(config=on_dask(tmp_path, "dask"))
                score_flow(config=on_dask(tmp_path, "dask"), attribute=False)
            workers = set(client.scheduler_info()["workers"])
            # PyTorch on each worker kept to its --nthreads (1), not every core.
            threads = client.run(lambda: __import__("torch").get_num_threads())
            partition_runs = [
                r for r in task_runs("ingest") if r.name.startswith("build-partition")
            ]
            # No process of the cluster started a Prefect server of its own (a worker
            # without the flow's API would: one each) ...
            family = descendants(cluster.processes)
            started_servers = prefect_servers(family)
            # ... and none is left when a worker (its nanny) is killed with SIGKILL.
            cluster.processes[1].kill()
            cluster.processes[1].wait()
            psutil.wait_procs(family, timeout=STOP_TIMEOUT_S / 3)
            left_servers = prefect_servers(family)

    assert not started_servers and not left_servers, (started_servers, left_servers)
    # The 4 partitions and the score chunk(s) ran on the cluster's workers ...
    assert len(stream.data) >= 4 + 1, stream.data
    assert {task["worker"] for task in stream.data} == workers  # both took a share
    assert set(threads.values()) == {1}, threads
    # ... and the flow's Prefect API recorded them (not a server of the workers' own).
    assert [r.state_name for r in partition_runs] == ["Completed"] * 4, partition_runs
    journeys = read_journeys(tmp_path / "journeys").sort("journey_id")
    assert journeys.height > 0
    assert journeys.equals(read_journeys(tmp_path / "dask" / "journeys").sort("journey_id"))

    def scores(folder: Path) -> pl.DataFrame:
        frame = pl.read_parquet(folder / "*.parquet").drop("scored_at")  # the run's moment
        return frame.sort("journey_id")

    assert scores(tmp_path / "scores").equals(scores(tmp_path / "dask" / "scores"))


@contextlib.contextmanager
def prefect_server_with_auth(folder: Path) -> Iterator[str]:
    """A real Prefect server (SQLite in `folder`) that answers only with `AUTH_SECRET`."""
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(folder), "PREFECT_SERVER_API_AUTH_STRING": AUTH_SECRET}
    env.pop("PREFECT_API_URL", None)
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
         "--port", str(port), "--no-ui"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not api_answers(url):  # asking for credentials counts
            assert server.poll() is None and time.monotonic() < deadline, "no server"
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=STOP_TIMEOUT_S)


def test_workers_use_their_own_secrets_and_none_is_shipped(tmp_path: Path) -> None:
    import dask.config
    import distributed.client
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_URL,
        PREFECT_CLIENT_CUSTOM_HEADERS,
        temporary_settings,
    )

    from flows.pipeline import ingest_flow
    from journeys.datasets import read_journeys
    from journeys.simulate import simulate

    simulate(tmp_path / "raw", users=200, seed=6)
    sent: list[bytes] = []  # every byte of every graph the flow sends to the cluster
    serialize = distributed.client.serialize

    def recording(*args: Any, **kwargs: Any) -> Any:
        header, frames = serialize(*args, **kwargs)
        sent.extend([repr(header).encode(), *(bytes(frame) for frame in frames)])
        return header, frames

    with (
        prefect_server_with_auth(tmp_path / "prefect") as api_url,
        isolated(tmp_path) as mp,
        # The workers' own API and secret, in their environment (the recipe).
        dask_cluster(
            tmp_path / "workers",
            {"PREFECT_API_URL": api_url, "PREFECT_API_AUTH_STRING": AUTH_SECRET},
        ) as cluster,
        dask.config.set(cluster.tls),
        temporary_settings(
            {
                PREFECT_API_URL: api_url,
                PREFECT_API_AUTH_STRING: AUTH_SECRET,
                PREFECT_CLIENT_CUSTOM_HEADERS: {"X-Journeys-Token": HEADER_SECRET},
            }
        ),
    ):
        mp.setattr(distributed.client, "serialize", recording)
        orchestrate(mp, task_runner="dask", dask_address=cluster.address)
        tracking = f"postgresql://journeys:{TRACKING_SECRET}@127.0.0.1:9/never-used"
        ingest_flow(config=on_dask(tmp_path, "dask", f"mlflow.tracking_uri={tracking}"))
        partition_runs = [r for r in task_runs("ingest") if r.name.startswith("build-partition")]

    assert read_journeys(tmp_path / "dask" / "journeys").height > 0
    # The server took the workers' task runs: they authenticated with their own secret.
    assert [r.state_name for r in partition_runs] == ["Completed"] * 4, partition_runs
    everything = b"".join(sent)
    assert str(tmp_path / "dask").encode() in everything  # the recording sees the tasks
    assert AUTH_SECRET.encode() not in everything
    assert TRACKING_SECRET.encode() not in everything
    assert HEADER_SECRET.encode() not in everything


def test_what_counts_as_a_secret_in_prefects_settings() -> None:
    """A settings section holding one is left to the workers' own environment."""
    from prefect.settings.models.api import APISettings
    from prefect.settings.models.client import ClientSettings

    from flows.cluster import holds_secret

    assert holds_secret(APISettings(url="http://u:pw@prefect.internal:4200/api"))
    assert holds_secret(APISettings(auth_string="admin:pw"))
    assert not holds_secret(APISettings(url="http://prefect.internal:4200/api"))
    assert holds_secret(ClientSettings(custom_headers={"Authorization": "Bearer x"}))
    assert not holds_secret(ClientSettings())


def test_a_worker_that_cannot_see_a_folder_or_reach_the_api_is_named(tmp_path: Path) -> None:
    """What every worker is asked before work is shipped (`flows.cluster.check_workers`):
    one line naming the worker and the fix. (On one machine every worker sees the same
    disk, so a missing folder stands in for another machine's.)"""
    import dask.config
    from distributed import Client

    from flows.cluster import check_workers
    from journeys.errors import ConfigError

    with (
        dask_cluster(tmp_path / "workers") as cluster,
        dask.config.set(cluster.tls),
        Client(cluster.address) as client,
    ):
        with pytest.raises(ConfigError) as unseen:
            check_workers(client, "http://127.0.0.1:9/api", [tmp_path / "not-mounted"])
        closed = f"http://user:{AUTH_SECRET}@127.0.0.1:{free_port()}/api"
        with pytest.raises(ConfigError) as unreachable:
            check_workers(client, closed, [tmp_path])
        # An API with credentials: the workers' own settings must name it.
        with prefect_server_with_auth(tmp_path / "prefect") as api_url:
            check_workers(client, api_url, [tmp_path])
            with pytest.raises(ConfigError) as elsewhere:
                check_workers(client, api_url, [tmp_path], api_from_worker_env=True)

    assert str(tmp_path / "not-mounted") in str(unseen.value)
    assert "Dask worker tls://127.0.0.1:" in str(unseen.value)
    assert "mount the paths.* folders on every worker" in str(unseen.value)
    assert "cannot reach the flow's Prefect API" in str(unreachable.value)
    assert "PREFECT_API_URL" in str(unreachable.value)
    assert AUTH_SECRET not in str(unreachable.value)
    assert "reports to a temporary Prefect server of its own" in str(elsewhere.value)
    assert f"set PREFECT_API_URL={api_url}" in str(elsewhere.value)


def test_a_local_dask_cluster_listens_on_loopback_only() -> None:
    """`task_runner=dask` with no address starts a local cluster: its scheduler, dashboard
    and workers listen on 127.0.0.1 alone. Its worker shares its threads among chunks."""
    from flows.cluster import worker_share
    from flows.settings import Orchestration, make_task_runner

    with make_task_runner(Orchestration(task_runner="dask", max_workers=1)) as runner:
        client = runner.client
        workers = [psutil.Process(p) for p in client.run(os.getpid).values()]
        ours = [psutil.Process(), *psutil.Process().children(recursive=True)]  # nannies too
        listening = {
            (process.pid, conn.laddr.ip)
            for process in ours
            for conn in process.net_connections("inet")
            if conn.status == psutil.CONN_LISTEN
        }
        assert "127.0.0.1" in client.dashboard_link
        # PyTorch threads per score chunk: the worker's --nthreads, shared by the chunks
        # it may run at once (each thread sizes its own pool: never more in all).
        (nthreads,) = client.nthreads().values()
        shares = {n: client.submit(worker_share, n, pure=False).result() for n in (1, 2, 64)}

    assert workers and any(pid == os.getpid() for pid, _ in listening), listening
    assert {ip for _, ip in listening} == {"127.0.0.1"}, listening
    assert shares[1] == nthreads and shares[64] == 1, shares
    assert all(share * min(nthreads, n) <= nthreads for n, share in shares.items()), shares
    assert worker_share(4) is None  # not on a worker: as it is

"""Shared servers as teams deploy them: PostgreSQL behind MLflow and Prefect (issue 24).

A throwaway PostgreSQL cluster on 127.0.0.1 (password authentication, scram-sha-256)
holds three databases: `mlflow` behind a real `mlflow server`, `prefect` behind a real
`prefect server start`, and `direct`, which `journeys` uses as its tracking store with
the password inside the URI. The tests then look through each server's API for what
the product claims to have done, and through every byte a run left for the password.

The servers read the password from `PGPASSWORD`, never from a URI, so whatever leaks is
the product's. Skipped only where no PostgreSQL server is installed (`make test-tools`
installs one; `.ci/run` does it first).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from conftest import free_port

from tests.test_reliability import ENV, TINY, cli, path_args, sets

pytestmark = pytest.mark.slow

SECRET = "pg-S3cr3t-7f1c"
USER = "journeys"
DATABASES = ("mlflow", "prefect", "direct")
START_TIMEOUT_S = 120
FLOWS = {"pipeline", "ingest", "train", "score", "attribution"}


# ----------------------------------------------------------------------------- servers


def _binary(name: str) -> str | None:
    """A PostgreSQL server program: on PATH, else Debian's versioned folder."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    return shutil.which(name) or (found[0] if found else None)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


@dataclass
class Postgres:
    port: int
    root: Path
    env: dict[str, str]  # PGPASSWORD set: what clients and servers connect with

    def uri(self, database: str, driver: str = "postgresql", password: bool = False) -> str:
        auth = f"{USER}:{SECRET}" if password else USER
        return f"{driver}://{auth}@127.0.0.1:{self.port}/{database}"

    def dump(self, database: str) -> str:
        command = [_binary("pg_dump") or "pg_dump", "-h", "127.0.0.1", "-p", str(self.port)]
        done = subprocess.run(
            [*command, "-U", USER, database], env=self.env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        return done.stdout


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    """A PostgreSQL cluster of our own (initdb + pg_ctl), removed afterwards."""
    initdb, pg_ctl = _binary("initdb"), _binary("pg_ctl")
    if not (initdb and pg_ctl and _binary("createdb")):
        pytest.skip("no PostgreSQL server installed (initdb): `make test-tools` installs it")
    # PostgreSQL refuses to run as root: run it as the `postgres` user the package creates.
    as_user: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="journeys-postgres-"))
    secret_file = root / "password"
    secret_file.write_text(SECRET)
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and no `postgres` user to run PostgreSQL as")
        for path in (root, secret_file):
            os.chown(path, owner.pw_uid, owner.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = root / "data", free_port()
    try:
        subprocess.run(
            [*as_user, initdb, "-D", str(data), "-U", USER, "--auth=scram-sha-256",
             f"--pwfile={secret_file}", "-E", "UTF8", "--no-sync"],
            check=True, capture_output=True,
        )  # fmt: skip
        secret_file.unlink()
        options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run(
            [*as_user, pg_ctl, "-D", str(data), "-l", str(root / "server.log"), "-w",
             "-o", options, "start"],
            check=True, capture_output=True,
        )  # fmt: skip
        env = {**ENV, "PGPASSWORD": SECRET}
        for database in DATABASES:
            subprocess.run(
                [_binary("createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", USER, database],
                check=True, env=env, capture_output=True,
            )  # fmt: skip
        yield Postgres(port, root, env)
    finally:
        subprocess.run(
            [*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True
        )
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def _server(command: list[str], env: dict[str, str], health: str, log: Path) -> Iterator[None]:
    """A server in its own process group, up when `health` answers; killed afterwards."""
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _answers(health):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(log.read_text()[-2000:])
            time.sleep(0.5)
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 9)
        process.wait()


@dataclass
class Servers:
    postgres: Postgres
    mlflow: str  # http://127.0.0.1:<port>
    prefect_api: str  # http://127.0.0.1:<port>/api
    folder: Path  # the servers' own files: artifacts, Prefect home, logs


@pytest.fixture(scope="module")
def servers(postgres: Postgres, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """`mlflow server` and `prefect server start`, both on the PostgreSQL cluster."""
    folder = tmp_path_factory.mktemp("servers")
    mlflow_port, prefect_port = free_port(), free_port()
    mlflow = f"http://127.0.0.1:{mlflow_port}"
    prefect_api = f"http://127.0.0.1:{prefect_port}/api"
    bin_dir = Path(sys.executable).parent
    mlflow_command = [
        str(bin_dir / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(mlflow_port),
        "--backend-store-uri", postgres.uri("mlflow"),
        "--artifacts-destination", str(folder / "artifacts"),
    ]  # fmt: skip
    prefect_env = {
        **postgres.env,
        "PREFECT_HOME": str(folder / "prefect-server-home"),
        "PREFECT_SERVER_DATABASE_CONNECTION_URL": postgres.uri("prefect", "postgresql+asyncpg"),
    }
    prefect_command = [
        str(bin_dir / "prefect"), "server", "start", "--host", "127.0.0.1",
        "--port", str(prefect_port),
    ]  # fmt: skip
    with (
        _server(mlflow_command, postgres.env, f"{mlflow}/health", folder / "mlflow.log"),
        _server(prefect_command, prefect_env, f"{prefect_api}/health", folder / "prefect.log"),
    ):
        yield Servers(postgres, mlflow, prefect_api, folder)


# ----------------------------------------------------------------------------- helpers


def _api(url: str, body: dict[str, Any] | None = None) -> Any:
    """GET (or POST `body` as JSON) and decode the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run(cli(*args), env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _files_holding(folder: Path, secret: bytes) -> list[str]:
    return [
        str(path)
        for path in folder.rglob("*")
        if path.is_file() and not path.is_symlink() and secret in path.read_bytes()
    ]


# ----------------------------------------------------------------------------- tests


def test_pipeline_on_postgres_and_a_prefect_server_leaves_no_password(
    servers: Servers, tmp_path: Path
) -> None:
    """`journeys pipeline` with the password in its config file's tracking URI (a
    PostgreSQL store) and in `PREFECT_API_URL`: flow runs and artifacts are in the Prefect
    server, runs and the champion in PostgreSQL, and the password is in none of the files,
    databases, logs, flow parameters, artifacts or cached results the run left behind."""
    postgres = servers.postgres
    # The user's own configuration file, outside everything the run writes to.
    user_files = tmp_path / "user"
    user_files.mkdir()
    config_file = user_files / "shared.yaml"
    config_file.write_text(f"mlflow:\n  tracking_uri: {postgres.uri('direct', password=True)}\n")
    project = tmp_path / "project"
    project.mkdir()
    api_with_password = servers.prefect_api.replace("http://", f"http://{USER}:{SECRET}@")
    env = {
        **ENV,
        "PREFECT_HOME": str(project / "prefect-home"),
        "PREFECT_API_URL": api_with_password,
    }
    args = ["pipeline", "--config", str(config_file), *path_args(project, project / "raw")]
    args += sets(*TINY, "simulate.users=300", "ingest.partitions=2")
    done = _run(args, env, project)

    # The Prefect server has every flow run, completed, and the artifacts.
    flows = {f["id"]: f["name"] for f in _api(f"{servers.prefect_api}/flows/filter", {})}
    runs = _api(f"{servers.prefect_api}/flow_runs/filter", {})
    assert {flows[run["flow_id"]] for run in runs} >= FLOWS
    assert all(run["state_type"] == "COMPLETED" for run in runs)
    pipeline_run = next(run for run in runs if flows[run["flow_id"]] == "pipeline")
    redacted = postgres.uri("direct").replace(f"{USER}@", f"{USER}:***@")
    assert pipeline_run["parameters"]["config"]["mlflow"]["tracking_uri"] == redacted
    artifacts = {a["key"] for a in _api(f"{servers.prefect_api}/artifacts/filter", {})}
    assert {"journeys-pipeline", "journeys-train", "journeys-score"} <= artifacts

    # MLflow's runs and registry are in PostgreSQL.
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=postgres.uri("direct", password=True))
    champion = client.get_model_version_by_alias("journey-conversion", "champion")
    experiment = client.get_experiment_by_name("journeys")
    found = client.search_runs([experiment.experiment_id])
    families = {r.data.tags.get("model_family") for r in found}
    assert {"transformer", "baseline_prior"} <= families
    run = client.get_run(champion.run_id)
    assert run.data.params["mlflow.tracking_uri"] == redacted  # the store used, redacted

    # The summary names the servers used, not the local defaults.
    assert servers.prefect_api.removesuffix("/api").replace("http://", "") in done.stdout
    assert f"127.0.0.1:{postgres.port}/direct" in done.stdout

    # Not one byte anywhere holds the password.
    secret = SECRET.encode()
    assert SECRET not in done.stdout + done.stderr
    assert _files_holding(project, secret) == []  # outputs, checkpoints, PREFECT_HOME, mlruns
    assert _files_holding(servers.folder, secret) == []  # server homes, artifacts, logs
    for database in ("direct", "prefect"):
        dump = postgres.dump(database)
        assert "journeys" in dump and SECRET not in dump, database
    assert config_file.read_text().count(SECRET) == 1  # the test did put it somewhere


def test_train_and_score_through_an_mlflow_server_on_postgres(
    servers: Servers, tmp_path: Path
) -> None:
    """`journeys train` and `journeys score` against `mlflow server` (PostgreSQL behind it,
    artifacts proxied by the server): runs, the champion and the artifacts are found
    through the server's REST API, and scoring loads the champion through the server."""
    env = {**ENV, "MLFLOW_TRACKING_URI": servers.mlflow}
    paths = path_args(tmp_path, tmp_path / "raw")
    _run(["simulate", "--out", str(tmp_path / "raw"), "--users", "300"], env, tmp_path)
    _run(["ingest", *paths], env, tmp_path)
    _run(["train", *paths, *sets(*TINY)], env, tmp_path)
    _run(["score", *paths], env, tmp_path)

    api = f"{servers.mlflow}/api/2.0/mlflow"
    name = "journey-conversion"
    champion = _api(f"{api}/registered-models/alias?name={name}&alias=champion")["model_version"]
    experiment = _api(f"{api}/experiments/get-by-name?experiment_name=journeys")["experiment"]
    runs = _api(f"{api}/runs/search", {"experiment_ids": [experiment["experiment_id"]]})["runs"]
    tags = [{t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs]
    assert {"transformer", "baseline_prior"} <= {t.get("model_family") for t in tags}
    assert any(t.get("journeys.stage") == "score" for t in tags)
    listed = _api(f"{api}/artifacts/list?run_id={champion['run_id']}")
    assert listed.get("files")  # uploaded through the server ...
    assert not (tmp_path / "mlruns").exists()  # ... not written beside the client
    assert any((servers.folder / "artifacts").rglob("weights.safetensors"))

    scores = pl.read_parquet(tmp_path / "scores" / "*.parquet")
    journeys = pl.read_parquet(tmp_path / "journeys" / "*.parquet")
    assert scores.height == journeys.height
    from journeys.datasets import read_metadata

    assert str(read_metadata(tmp_path / "scores")["model_version"]) == champion["version"]

"""Prefect orchestration: the pipeline end to end, content caching, retries, schedules,
partitioned ingest, multi-process training and a real MLflow tracking server.

One session-scoped `prefect_test_harness()` serves every test; PREFECT_HOME points to a
temporary folder before Prefect is imported, so nothing touches ~/.prefect.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_PREFECT_HOME = tempfile.mkdtemp(prefix="journeys-prefect-home-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"

import polars as pl  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402
from conftest import free_port  # noqa: E402

from journeys.config import Config, load_config  # noqa: E402
from journeys.errors import InputError, JourneysError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=1",
    "model.dropout=0.0",
    "train.batch_size=64",
    "train.warmup_steps=4",
    "train.lr=0.005",
    "train.accelerator=cpu",
    "train.max_epochs=1",
    "train.baselines=[logreg,prior]",
    # A few hundred simulated users: too few to judge a model on (the guard has its own
    # tests); these test the plumbing, which needs a champion.
    "promotion.guard=false",
    "simulate.users=300",
    "simulate.conversion_rate=0.2",
    "ingest.partitions=3",
]


@pytest.fixture(scope="session")
def prefect_api() -> Iterator[None]:
    """One temporary Prefect API (SQLite) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
    shutil.rmtree(_PREFECT_HOME, ignore_errors=True)


pytestmark = pytest.mark.usefixtures("prefect_api")


def tiny_config(folder: Path, *extra: str, tracking_uri: str | None = None) -> Config:
    """Every path under `folder`, a tiny model, one epoch, two baselines."""
    uri = tracking_uri or f"sqlite:///{folder / 'mlflow.db'}"
    return load_config(
        None,
        [
            f"paths.raw={folder / 'raw'}",
            f"paths.journeys={folder / 'journeys'}",
            f"paths.quarantine={folder / 'quarantine'}",
            f"paths.scores={folder / 'scores'}",
            f"paths.reports={folder / 'reports'}",
            f"paths.checkpoints={folder / 'checkpoints'}",
            f"mlflow.tracking_uri={uri}",
            *TINY,
            *extra,
        ],
    )


@contextlib.contextmanager
def isolated(folder: Path) -> Iterator[pytest.MonkeyPatch]:
    """cwd in `folder` and no MLFLOW_TRACKING_URI from outside (the config decides)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        yield mp


def counting(mp: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Replace `module.name` by a wrapper that counts its calls."""
    calls: list[int] = []
    original = getattr(module, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    mp.setattr(module, name, wrapper)
    return calls


def latest_task_state(prefix: str) -> str:
    """State name of the most recent task run whose name starts with `prefix`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_=prefix)),
            sort=TaskRunSort.EXPECTED_START_TIME_DESC,
            limit=20,
        )
    return next(r.state_name for r in runs if r.name.startswith(prefix))


# ----------------------------------------------------------------------------- pipeline


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The pipeline three times on a tiny simulated log: fresh, unchanged, scores deleted."""
    from flows.pipeline import pipeline_command, pipeline_flow
    from journeys import ingest as ingest_lib
    from journeys import train as train_lib

    tmp = tmp_path_factory.mktemp("pipeline")
    config = tiny_config(tmp)
    with isolated(tmp) as mp:
        first = pipeline_flow(config=config)
        stage_calls = counting(mp, ingest_lib, "stage")
        train_calls = counting(mp, train_lib, "train_command")
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            second = pipeline_command(config)
        counts = {"stage_calls": len(stage_calls), "train_calls": len(train_calls)}
        ingest_state = latest_task_state("ingest-")
        shutil.rmtree(tmp / "scores")
        third = pipeline_flow(config=config)
    return {
        "tmp": tmp,
        "config": config,
        "first": first,
        "second": second,
        "third": third,
        "printed": printed.getvalue(),
        "ingest_state": ingest_state,
        **counts,
    }


@pytest.mark.slow
def test_pipeline_produces_journeys_runs_champion_scores_and_report(pipeline_runs) -> None:
    from mlflow import MlflowClient

    from journeys.datasets import read_journeys

    tmp, first = pipeline_runs["tmp"], pipeline_runs["first"]
    assert first["simulated"]["users"] == 300
    assert (tmp / "raw" / "events.csv").exists()

    journeys = read_journeys(tmp / "journeys")
    assert journeys.height == first["ingest"]["journeys"] > 0
    assert (tmp / "journeys" / "ingest_report.json").exists()

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("journeys")
    runs = client.search_runs([experiment.experiment_id])
    families = {run.data.tags.get("model_family") for run in runs}
    assert {"transformer", "baseline_logreg", "baseline_prior"} <= families
    champion = client.get_model_version_by_alias("journey-conversion", "champion")
    assert int(champion.version) == first["train"]["champion_version"]
    assert set(first["train"]["baselines"]) == {"logreg", "prior"}
    assert "test_roc_auc" in first["train"]["metrics"]

    scores = pl.read_parquet(tmp / "scores" / "*.parquet")
    assert scores.height == journeys.height == first["score"]["rows"]
    assert set(scores["journey_id"]) == set(journeys["journey_id"])
    assert (tmp / "reports" / "summary.json").exists()
    assert first["attribution"]["files"]


@pytest.mark.slow
def test_a_log_where_gradient_boosting_wins_ends_with_it_as_champion_and_scores(
    tmp_path: Path,
) -> None:
    """The guard on, a transformer that learns nothing (its learning rate is all but 0)
    and `hgb_aggregates` that does: the pipeline serves the booster, never stopping for
    want of a champion, and the scores carry its probability and the transformer's
    attention."""
    from mlflow import MlflowClient

    from flows.pipeline import pipeline_flow
    from journeys.tracking import MODEL_KIND_TAG

    config = tiny_config(
        tmp_path,
        "promotion.guard=true",
        "simulate.users=2500",
        "train.lr=1e-9",
        "train.stack=false",
        "train.baselines=[hgb_aggregates,prior]",
    )
    with isolated(tmp_path):
        summary = pipeline_flow(config=config)
    train = summary["train"]
    assert train["model_kind"] == "baseline_hgb_aggregates"
    assert train["promoted"] and train["champion_check"] == "first_champion"
    assert "baseline_hgb_aggregates serves" in train["champion_reason"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    champion = client.get_model_version_by_alias("journey-conversion", "champion")
    assert champion.tags[MODEL_KIND_TAG] == "baseline_hgb_aggregates"
    scores = pl.read_parquet(tmp_path / "scores" / "*.parquet")
    assert scores.height == summary["ingest"]["journeys"] == summary["score"]["rows"]
    sums = scores.select(pl.col("attention").list.sum()).to_series()
    assert ((sums - 1).abs() < 1e-4).all()
    assert scores["conversion_probability"].n_unique() > 10  # the booster's, not a constant


def test_pipeline_writes_markdown_artifacts(pipeline_runs) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="journeys-"))
        )
    keys = {a.key for a in artifacts}
    assert {"journeys-pipeline", "journeys-ingest", "journeys-train", "journeys-score"} <= keys
    # Every candidate's row, the one the registry serves marked (the guard is off here).
    # (Other tests' pipelines write theirs to the same session API.)
    pipelines = [a.data for a in artifacts if a.key == "journeys-pipeline"]
    assert any("| transformer (served) |" in d and "| baseline_logreg |" in d for d in pipelines)


def test_unchanged_input_is_a_cache_hit(pipeline_runs) -> None:
    second = pipeline_runs["second"]
    assert pipeline_runs["ingest_state"] == "Cached"
    assert pipeline_runs["stage_calls"] == 0  # the ingest code did not run again
    assert pipeline_runs["train_calls"] == 0
    assert second["simulated"] is None
    for stage in ("ingest", "train", "score", "attribution"):
        assert second[stage]["cached"], stage
    assert second["train"]["run_id"] == pipeline_runs["first"]["train"]["run_id"]


def test_pipeline_command_prints_a_summary(pipeline_runs) -> None:
    printed = pipeline_runs["printed"]
    for needle in ("journeys pipeline: done", "baseline_logreg", "champion:", "journeys ui"):
        assert needle in printed
    from prefect.settings import get_current_settings

    # The Prefect server the run used (here the test harness's), not a default address.
    api = str(get_current_settings().api.url)
    assert f"Prefect: {api.removesuffix('/api')}" in printed
    assert str(pipeline_runs["tmp"] / "scores") in printed


def test_missing_outputs_are_recomputed(pipeline_runs) -> None:
    third = pipeline_runs["third"]
    assert third["ingest"]["cached"] and third["train"]["cached"]
    assert not third["score"]["cached"]  # its output folder was deleted
    assert third["score"]["rows"] == pipeline_runs["first"]["score"]["rows"]
    assert (pipeline_runs["tmp"] / "scores").is_dir()


# ----------------------------------------------------------------------------- retries


def orchestrate(mp: pytest.MonkeyPatch, **settings: Any) -> None:
    """Orchestration settings for a test, with no delay between retries.

    (Like `--set orchestration.retry_delay_s=0`, without rebuilding the config.)
    """
    import flows.pipeline
    from flows.settings import Orchestration

    mp.setattr(
        flows.pipeline, "orchestration", lambda config: Orchestration(retry_delay_s=0, **settings)
    )


def test_a_task_failing_once_is_retried_and_the_flow_succeeds(tmp_path: Path) -> None:
    from flows.pipeline import ingest_flow
    from journeys import sessionise
    from journeys.simulate import simulate

    simulate(tmp_path / "raw", users=60, seed=3)
    config = tiny_config(tmp_path)
    calls: list[int] = []
    original = sessionise.build_partition

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("transient: disk hiccup")
        return original(*args, **kwargs)

    with isolated(tmp_path) as mp:
        orchestrate(mp)
        mp.setattr(sessionise, "build_partition", flaky)
        report = ingest_flow(config=config)
    assert report["journeys"] > 0
    assert len(calls) == config.ingest.partitions + 1  # one partition ran twice


def test_ingest_retries_each_pass_once_over(tmp_path: Path) -> None:
    """A failed stage pass retries the ingest task; a partition that failed after its own
    retries does not (the attempts would multiply)."""
    from flows.pipeline import ingest_flow
    from journeys import ingest as ingest_lib
    from journeys import sessionise
    from journeys.simulate import simulate

    simulate(tmp_path / "raw", users=40, seed=6)
    config = tiny_config(tmp_path, "ingest.partitions=1")
    stage_calls: list[int] = []
    build_calls: list[int] = []
    stage = ingest_lib.stage

    def flaky_stage(*args: Any, **kwargs: Any) -> Any:
        stage_calls.append(1)
        if len(stage_calls) == 1:
            raise OSError("transient: network share away")
        return stage(*args, **kwargs)

    def broken_build(*args: Any, **kwargs: Any) -> Any:
        build_calls.append(1)
        raise OSError("disk full")

    with isolated(tmp_path) as mp:
        orchestrate(mp, retries=1)
        mp.setattr(ingest_lib, "stage", flaky_stage)
        assert ingest_flow(config=config)["journeys"] > 0
        assert len(stage_calls) == 2

        orchestrate(mp, retries=1, cache=False)
        mp.setattr(ingest_lib, "stage", stage)
        stage_calls = counting(mp, ingest_lib, "stage")
        mp.setattr(sessionise, "build_partition", broken_build)
        with pytest.raises(OSError, match="disk full"):
            ingest_flow(config=config, full=True)  # nothing new: only a full one builds
    assert len(build_calls) == 2  # its own try and retry
    assert len(stage_calls) == 1  # and no retry of the whole


def test_bad_input_is_not_retried(tmp_path: Path) -> None:
    from flows.pipeline import ingest_flow
    from journeys import sessionise
    from journeys.simulate import simulate

    simulate(tmp_path / "raw", users=30, seed=4)
    config = tiny_config(tmp_path, "ingest.partitions=1")
    calls: list[int] = []

    def bad(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        raise InputError("journeys lack column 'channel'")

    with isolated(tmp_path) as mp:
        orchestrate(mp)
        mp.setattr(sessionise, "build_partition", bad)
        with pytest.raises(InputError, match="lack column"):
            ingest_flow(config=config)
    assert len(calls) == 1


def test_cli_pipeline_bad_input_exits_2_with_one_line(tmp_path: Path, capsys) -> None:
    from journeys.cli import main

    with isolated(tmp_path):
        code = main(["pipeline", "--set", f"paths.raw={tmp_path}/nothing-*.csv"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("journeys pipeline: error: ")


# ----------------------------------------------------------------------------- scale-out


@pytest.mark.slow
def test_partitioned_ingest_gives_the_same_journeys(tmp_path: Path) -> None:
    from flows.pipeline import ingest_flow
    from journeys.datasets import read_journeys
    from journeys.simulate import simulate

    simulate(tmp_path / "raw", users=200, seed=5, dirty_rate=0.05, shuffle=True)
    results = {}
    with isolated(tmp_path) as mp:
        for partitions in (1, 7):
            out = tmp_path / f"p{partitions}"
            config = tiny_config(
                tmp_path,
                f"ingest.partitions={partitions}",
                f"paths.journeys={out / 'journeys'}",
                f"paths.quarantine={out / 'quarantine'}",
            )
            if partitions > 1:
                orchestrate(mp, task_runner="process", max_workers=2)  # real processes
            report = ingest_flow(config=config)
            assert report["partitions"] == partitions
            results[partitions] = (read_journeys(out / "journeys").sort("journey_id"), report)
    (one, one_report), (many, many_report) = results[1], results[7]
    assert one.height > 0
    assert one.equals(many)
    ignore = {"partitions", "cached"}
    assert {k: v for k, v in one_report.items() if k not in ignore} == {
        k: v for k, v in many_report.items() if k not in ignore
    }


@pytest.mark.slow
def test_scoring_mapped_as_tasks_on_threads_or_processes_matches_scoring_in_order(
    tmp_path: Path,
) -> None:
    """The score flow's map (`chunks_as_tasks`): one Prefect task per chunk, on the
    thread and the process runner, writes the same files byte for byte, and what scoring
    in order writes up to float rounding (one PyTorch thread per worker against two)."""
    from prefect import flow
    from test_score import (
        assert_same_scores,
        covered_parts,
        journeys_folder,
        save_tiny_model,
        split_into_parts,
    )

    from flows.pipeline import chunks_as_tasks
    from flows.settings import Orchestration
    from journeys.datasets import count_rows, parquet_parts
    from journeys.score import score_dataset
    from journeys.trained_model import load_model
    from journeys.vocab import Vocabularies

    one = journeys_folder(tmp_path / "one", n=120)
    journeys = split_into_parts(one, tmp_path / "journeys", 4)
    loaded = load_model(str(save_tiny_model(tmp_path / "model", Vocabularies.load(journeys))))
    settings = dict(chunk_journeys=20, progress=False, metadata={"scored_at": "2026-03-01"})

    @flow
    def score_on(runner: str) -> int:
        settings_ = Orchestration(task_runner=runner, max_workers=2, retry_delay_s=0)
        out = tmp_path / runner
        return score_dataset(
            loaded, journeys, out, map_chunks=chunks_as_tasks(settings_), **settings
        ).rows

    with isolated(tmp_path):
        assert score_dataset(loaded, journeys, tmp_path / "in-order", **settings).rows == 120
        assert score_on("thread") == score_on("process") == 120
    files = sorted(p.name for p in (tmp_path / "in-order").iterdir())
    # A file per part (piece) each chunk holds: together they hold every part once.
    assert covered_parts(tmp_path / "in-order") == {
        p.name: count_rows([p]) for p in parquet_parts(journeys)
    }
    for runner in ("thread", "process"):
        assert sorted(p.name for p in (tmp_path / runner).iterdir()) == files
    for file in files:
        threads = pl.read_parquet(tmp_path / "thread" / file)
        assert threads.equals(pl.read_parquet(tmp_path / "process" / file)), file
        assert_same_scores(threads, pl.read_parquet(tmp_path / "in-order" / file))


@pytest.mark.parametrize(("user_value", "expected"), [(None, 120), ("7", 7)])
def test_first_temporary_server_start_gets_time_to_migrate(user_value, expected) -> None:
    """The first start on a fresh machine migrates a new database: Prefect's 20 s default
    timed out under `make run` on 2 cores. A value the user set is kept."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
    }
    if user_value is not None:
        env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = user_value
    probe = (
        "import flows; from prefect.settings import get_current_settings; "
        "print(get_current_settings().server.ephemeral.startup_timeout_seconds)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.strip()) == expected


def test_task_runner_is_configuration() -> None:
    from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

    from flows.settings import Orchestration, make_task_runner, orchestration

    assert orchestration(load_config(None, [])) == Orchestration()  # defaults without a section
    assert isinstance(make_task_runner(Orchestration()), ThreadPoolTaskRunner)
    assert isinstance(make_task_runner(Orchestration(task_runner="process")), ProcessPoolTaskRunner)
    try:
        import prefect_dask  # noqa: F401
    except ImportError:
        with pytest.raises(JourneysError, match=r"pip install 'journeys\[dask\]'"):
            make_task_runner(Orchestration(task_runner="dask"))
    else:
        runner = make_task_runner(Orchestration(task_runner="dask", dask_address="tcp://x:8786"))
        assert type(runner).__name__ == "DaskTaskRunner"


@pytest.mark.slow
def test_multi_process_training_runs_in_its_own_process(tmp_path: Path) -> None:
    """DDP (2 CPU processes, gloo) through `journeys train` in a subprocess of the flow."""
    from conftest import make_journeys_dataset

    from flows.pipeline import needs_own_process, train_flow
    from journeys import processes

    assert not needs_own_process(load_config(None, ["train.devices=1"]))
    assert needs_own_process(load_config(None, ["train.devices=2"]))
    assert needs_own_process(load_config(None, ["train.strategy=ddp"]))
    assert not needs_own_process(load_config(None, ["train.devices=auto", "train.accelerator=cpu"]))

    make_journeys_dataset(tmp_path / "journeys", n=300, seed=2)
    config = tiny_config(tmp_path, "train.devices=2", "train.strategy=ddp")
    with isolated(tmp_path) as mp:
        commands: list[list[str]] = []
        popen = subprocess.Popen

        def spy(command: list[str], *args: Any, **kwargs: Any) -> subprocess.Popen:
            commands.append(command)
            return popen(command, *args, **kwargs)

        mp.setattr(processes.subprocess, "Popen", spy)
        summary = train_flow(config=config)
    assert commands and commands[0][1:4] == ["-m", "journeys.cli", "train"]
    assert summary["model_version"] == summary["champion_version"] == 1
    assert set(summary["baselines"]) == {"logreg", "prior"}
    assert 0 <= summary["metrics"]["test_roc_auc"] <= 1


def test_each_stage_hashes_every_library_module_it_runs() -> None:
    """Read from the imports (lazy ones too) and from modules loaded by file name."""
    from flows.pipeline import STAGE_ENTRY, stage_inputs

    config = load_config(None, [])
    code = {stage: set(stage_inputs(stage, config)[1]) for stage in STAGE_ENTRY}
    runs = {
        "ingest": "ingest events datasets vocab storage",
        "train": "train lightning_parts datasets inference plots model encoding baselines "
        "trained_model metrics tracking pyfunc_model",
        "score": "score datasets inference trained_model encoding model metrics",
        "attribution": "attribution datasets inference plots trained_model encoding model",
    }
    for stage, modules in runs.items():
        assert {f"journeys.{name}" for name in modules.split()} <= code[stage], stage
    assert not any(
        name.startswith(("journeys.cli", "journeys.simulate")) for name in code["ingest"]
    )
    # What importing the entry module loads is a part (lazy imports come on top).
    probe = "import sys, journeys.score; print(*[m for m in sys.modules if m[:9] == 'journeys.'])"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert set(done.stdout.split()) <= code["score"]


def test_stage_lock_keeps_a_second_writer_out(tmp_path: Path) -> None:
    from journeys.pipeline_lock import hold_lock

    lock = tmp_path / ".journeys.lock"
    waited: list[str] = []
    with (
        hold_lock(lock, "journeys ingest"),
        pytest.raises(JourneysError, match="still locked by journeys ingest"),
        hold_lock(lock, "journeys score", timeout=0.3, on_wait=waited.append),
    ):
        pass
    assert waited and "journeys ingest" in waited[0]
    with hold_lock(lock, "journeys score", timeout=0.3):  # released: free again
        pass


# ----------------------------------------------------------------------------- schedules


def test_deployments_carry_the_configured_schedules() -> None:
    from prefect.client.orchestration import get_client

    from flows.deployments import build_deployments

    config = load_config(
        None,
        [
            "schedule.timezone=Europe/Berlin",
            "schedule.ingest_cron=15 1 * * *",
            "schedule.score_cron=45 1 * * *",
            "schedule.train_cron=0 4 * * 0",
        ],
    )
    deployments = {d.flow_name: d for d in build_deployments(config)}
    expected = {"ingest": "15 1 * * *", "score": "45 1 * * *", "train": "0 4 * * 0"}
    for flow_name, cron in expected.items():
        (schedule,) = deployments[flow_name].schedules
        assert (schedule.schedule.cron, schedule.schedule.timezone) == (cron, "Europe/Berlin")
        assert (
            deployments[flow_name].parameters["config"]["schedule"]["timezone"] == "Europe/Berlin"
        )
    assert not deployments["pipeline"].schedules

    deployment_id = deployments["train"].apply()  # registered with the API as served
    with get_client(sync_client=True) as client:
        stored = client.read_deployment(deployment_id)
    (schedule,) = stored.schedules
    assert schedule.schedule.cron == "0 4 * * 0"
    assert schedule.schedule.timezone == "Europe/Berlin"


def test_prefect_yaml_matches_the_default_schedules() -> None:
    from prefect.flows import load_flow_from_entrypoint

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    schedule = load_config(ROOT / "conf" / "default.yaml", []).schedule
    crons = {
        "ingest": schedule.ingest_cron,
        "score": schedule.score_cron,
        "train": schedule.train_cron,
    }
    seen = set()
    for deployment in spec["deployments"]:
        flow = load_flow_from_entrypoint(deployment["entrypoint"])
        seen.add(flow.name)
        assert deployment["work_pool"]["name"] == "journeys"
        assert deployment["parameters"]["config_file"] == "conf/default.yaml"
        if flow.name in crons:
            (entry,) = deployment["schedules"]
            assert (entry["cron"], entry["timezone"]) == (crons[flow.name], schedule.timezone)
    assert seen == {"ingest", "score", "train", "pipeline"}


# ----------------------------------------------------------------------------- MLflow server


@contextlib.contextmanager
def mlflow_server(folder: Path) -> Iterator[str]:
    """A real `mlflow server` on 127.0.0.1 (SQLite backend, proxied artifacts in `folder`)."""
    port = free_port()
    command = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{folder / 'server.db'}",
        "--artifacts-destination", str(folder / "artifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    log = open(folder / "server.log", "wb")  # noqa: SIM115 (closed below)
    # Own process group: `mlflow server` runs its web server as a child process.
    process = subprocess.Popen(
        command, cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((folder / "server.log").read_text()[-2000:]) from None
                time.sleep(0.5)
        yield url
    finally:
        # A graceful stop waits ~10 s for idle keep-alive connections: not worth it here.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        log.close()


@pytest.mark.slow
def test_pipeline_against_a_real_mlflow_server(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from flows.pipeline import pipeline_flow

    with mlflow_server(tmp_path) as url, isolated(tmp_path):
        config = tiny_config(tmp_path / "project", tracking_uri=url)
        summary = pipeline_flow(config=config)
        client = MlflowClient(tracking_uri=url)  # over HTTP
        experiment = client.get_experiment_by_name("journeys")
        runs = client.search_runs([experiment.experiment_id])
        champion = client.get_model_version_by_alias("journey-conversion", "champion")
        artifacts = {a.path for a in client.list_artifacts(summary["train"]["run_id"])}
    assert summary["train"]["tracking_uri"] == url
    assert {r.data.tags.get("model_family") for r in runs} >= {"transformer", "baseline_logreg"}
    assert int(champion.version) == summary["train"]["champion_version"]
    assert artifacts  # uploaded through the server
    assert summary["score"]["rows"] == summary["ingest"]["journeys"]


def test_a_flows_paths_are_made_absolute_on_its_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative paths (the defaults, `data/...`) would resolve against a Dask worker's own
    folder there and read nothing: the flow resolves them here, before any task ships."""
    from flows.settings import resolve_config
    from journeys.config import load_config

    monkeypatch.chdir(tmp_path)
    resolved = resolve_config(load_config(None, ["paths.raw=logs/*.csv"]))
    assert resolved.paths.raw == str(tmp_path / "logs" / "*.csv")
    assert resolved.paths.journeys == str(tmp_path / "data" / "journeys")
    assert all(Path(value).is_absolute() for _, value in resolved.paths)
    again = resolve_config(config_file=None, overrides=["paths.scores=/srv/scores"])
    assert again.paths.scores == "/srv/scores" and Path(again.paths.reports).is_absolute()


def test_lightning_lines_reach_the_console_once_and_without_the_tip() -> None:
    """Under Prefect, Lightning's records go through Prefect's handler (console and run
    logs) alone, not a second time through the handler Lightning adds; its advertising
    tip goes nowhere."""
    import logging

    import journeys.lightning_parts  # noqa: F401  (the tip's filter)
    from flows.pipeline import lightning_logs_once

    records: list[logging.LogRecord] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    root, capture = logging.getLogger(), Capture()
    root.addHandler(capture)
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    try:
        with lightning_logs_once():
            own = logging.getLogger("lightning").handlers
            assert not [h for h in own if type(h) is logging.StreamHandler]
            rank_zero.info("GPU available: False, used: False")
            rank_zero.info("\N{ELECTRIC LIGHT BULB} Tip: For seamless cloud logging, try litlogger")
    finally:
        root.removeHandler(capture)
    assert [r.getMessage() for r in records] == ["GPU available: False, used: False"]
    # Outside the pipeline, Lightning keeps its own handler.
    assert [h for h in logging.getLogger("lightning").handlers if type(h) is logging.StreamHandler]

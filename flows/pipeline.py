"""Prefect flows over the `journeys` library: ingest, train, score, attribution, pipeline.

Thin by design: every step calls one library function. What Prefect adds:

- retries (never for bad input or configuration: `JourneysError`) and timeouts;
- caching on INPUT CONTENT: each stage's key hashes its input files, the config sections
  it reads and the library code it runs; an unchanged stage is a `Cached` task run, not a
  recomputation, as long as the outputs of that run are still on disk (see `caching`);
- scale-out: ingest maps `build_partition` over the user-hash partitions on the configured
  task runner (threads, processes or a Dask cluster); multi-process (DDP) training runs as
  its own `journeys train` process, never inside the flow process;
- run logs, and a Markdown artifact per flow run summarising what it produced;
- a lock per data folder, so overlapping scheduled runs never write the same outputs.

Flows take either a resolved `config` (the CLI and `journeys serve` pass one) or a
`config_file` plus `overrides` (for deployments from `prefect.yaml`).
"""

from __future__ import annotations

from flows import _env  # noqa: F401  # isort: skip  (environment defaults before Prefect)

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_markdown_artifact
from prefect.states import State

from flows import summary as text
from flows.caching import (
    code_digest,
    config_digest,
    digest_files,
    files_under,
    outputs_match,
    stage_key,
    task_key,
    write_marker,
)
from flows.settings import (
    Orchestration,
    make_task_runner,
    orchestration,
    resolve_config,
)
from journeys import ingest as ingest_lib
from journeys.config import Config
from journeys.datasets import PART_FILE
from journeys.errors import InputError, JourneysError
from journeys.pipeline_lock import HELD_ENV, lock_path, pipeline_lock
from journeys.storage import scratch_dir

INGEST_CODE = ("journeys.ingest", "journeys.events", "journeys.vocab", "journeys.storage")
TRAIN_CODE = (
    "journeys.train", "journeys.model", "journeys.data", "journeys.baselines",
    "journeys.packaging", "journeys.metrics", "journeys.tracking", "journeys.pyfunc_model",
)  # fmt: skip
SCORE_CODE = ("journeys.score", "journeys.packaging", "journeys.data", "journeys.model")
ATTRIBUTION_CODE = ("journeys.attribution",)
INGEST_CONFIG = ("paths.raw", "paths.journeys", "paths.quarantine", "data", "journey", "split",
                 "ingest", "vocab")  # fmt: skip
TRAIN_CONFIG = ("paths.journeys", "paths.checkpoints", "data", "journey", "split", "vocab",
                "model", "train", "mlflow")  # fmt: skip
SCORE_CONFIG = ("paths.journeys", "paths.scores", "data", "journey", "score")
# Attribution settings may live in any section: hash all but those that cannot matter.
NOT_ATTRIBUTION = ("simulate", "schedule", "orchestration", "model", "train", "ingest")
CREDIT_ROWS = 30  # touchpoints shown in the attribution artifact
TRAIN_RECORD = ".flow-cache-train.json"  # in paths.checkpoints: cache key -> MLflow run
MULTI_PROCESS = ("ddp", "fsdp", "deepspeed")  # Lightning strategies that launch processes
TQDM_UPDATE = re.compile(r"\d+/\d+ \[.*(it/s|s/it)")


# ----------------------------------------------------------------------------- helpers


def stage_inputs(stage: str, config: Config) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(config entries, library modules) a stage's result depends on."""
    if stage == "attribution":
        sections = tuple(name for name in type(config).model_fields if name not in NOT_ATTRIBUTION)
        return (*sections, "paths.reports", "paths.scores"), ATTRIBUTION_CODE
    return {
        "ingest": (INGEST_CONFIG, INGEST_CODE),
        "train": (TRAIN_CONFIG, TRAIN_CODE),
        "score": (SCORE_CONFIG, SCORE_CODE),
    }[stage]


def _retry_unless_bad_input(_task: Any, _task_run: Any, state: State) -> bool:
    """Retry transient failures; bad input or configuration fails the same way again."""
    return not isinstance(state.result(raise_on_failure=False), JourneysError)


def _configured(task_: Any, settings: Orchestration, **options: Any) -> Any:
    """The task with the configured retries and timeout."""
    defaults = {
        "retries": settings.retries,
        "retry_delay_seconds": settings.retry_delay_s,
        "timeout_seconds": settings.task_timeout_s,
        "retry_condition_fn": _retry_unless_bad_input,
    }
    return task_.with_options(**{**defaults, **options})


def _call_cached(
    task_: Any, settings: Orchestration, fresh: bool, retries: int | None = None, **kwargs: Any
) -> tuple[Any, bool]:
    """Run a content-cached task; a hit only when caching is on and outputs are intact."""
    options: dict[str, Any] = {"refresh_cache": not (settings.cache and fresh)}
    if retries is not None:
        options["retries"] = retries
    state = _configured(task_, settings, **options)(**kwargs, return_state=True)
    return state.result(), state.name == "Cached"


@contextlib.contextmanager
def _stage_lock(config: Config, stage: str) -> Iterator[None]:
    settings = orchestration(config)
    logger = get_run_logger()
    with pipeline_lock(
        lock_path(config), f"journeys {stage}", settings.lock_timeout_s, on_wait=logger.info
    ):
        yield


# ----------------------------------------------------------------------------- simulate


def raw_is_empty(raw: str) -> bool:
    """True when `paths.raw` is a folder (or a folder-like path) with no event files yet."""
    from journeys.events import resolve_sources

    path = Path(raw)
    if any(ch in raw for ch in "*?[") or (not path.exists() and path.suffix):
        return False  # a glob or a file name: nothing to simulate into
    try:
        resolve_sources(raw)
    except InputError:
        return not path.is_file()
    return False


@task(name="simulate", retry_condition_fn=_retry_unless_bad_input)
def simulate_task(config: Config) -> dict[str, Any] | None:
    """Write a synthetic event log into `paths.raw` when it holds none (demo and first run)."""
    from journeys.simulate import simulate

    if not raw_is_empty(config.paths.raw):
        return None
    settings = config.simulate.model_dump()
    result = simulate(Path(config.paths.raw), **settings)
    get_run_logger().info(
        "%s held no event log: simulated %s users (%s events) into it",
        config.paths.raw,
        f"{result.n_users:,}",
        f"{result.n_events:,}",
    )
    return {"out": config.paths.raw, "users": result.n_users, "events": result.n_events}


# ----------------------------------------------------------------------------- ingest


@task(name="stage")
def stage_task(config: Config, folder: Path) -> ingest_lib.Staged:
    """Pass 1: every raw row once, into user-hash partitions or quarantine."""
    staged = ingest_lib.stage(config, folder)
    get_run_logger().info(
        "staged %s rows from %d file(s) into %d partition(s)",
        f"{staged.rows_read:,}",
        len(staged.sources),
        len(staged.partitions),
    )
    return staged


@task(name="build-partition", task_run_name="build-partition-{index}")
def build_partition_task(
    partition: Path | None, config: Config, out: Path, index: int
) -> ingest_lib.PartitionResult:
    """Pass 2 for one partition: de-duplicate, sort, sessionise, label."""
    return ingest_lib.build_partition(partition, config, out)


@task(name="finish")
def finish_task(
    config: Config, staged: ingest_lib.Staged, parts: list[ingest_lib.PartitionResult]
) -> dict[str, Any]:
    """Pass 3: censoring, split, vocabularies; outputs swapped in atomically."""
    result = ingest_lib.finish(
        config, staged, parts, Path(config.paths.journeys), Path(config.paths.quarantine)
    )
    return result.report


@task(name="fingerprint", task_run_name="fingerprint-{stage}")
def fingerprint_task(
    stage: str, config: Config, files: list[Path], extra: list[str] | None = None
) -> str:
    """The content cache key of a stage: input bytes + config sections + library code."""
    sections, code = stage_inputs(stage, config)
    started = time.perf_counter()
    key = stage_key(
        stage,
        digest_files(files),
        config_digest(config, sections),
        code_digest(*code),
        *(extra or []),
    )
    get_run_logger().info(
        "%s inputs: %d file(s) hashed in %.1f s -> %s",
        stage,
        len(files),
        time.perf_counter() - started,
        key,
    )
    return key


@task(name="ingest", cache_key_fn=task_key, persist_result=True, result_serializer="json")
def ingest_task(config: Config, key: str) -> dict[str, Any]:
    """The three ingest passes, pass 2 mapped over partitions on the configured runner."""
    settings = orchestration(config)
    journeys, quarantine = Path(config.paths.journeys), Path(config.paths.quarantine)
    with scratch_dir(journeys.parent, "ingest") as scratch:
        staged = _configured(stage_task, settings)(config, scratch / "staged")
        partitions = staged.partitions or [None]
        built = scratch / "built"
        built.mkdir()
        outs = [built / PART_FILE.format(i) for i in range(len(partitions))]
        with make_task_runner(settings) as runner:
            # No per-partition timeout: a worker thread cannot be interrupted; the
            # ingest task's own timeout bounds the whole stage.
            futures = runner.map(
                _configured(build_partition_task, settings, timeout_seconds=None),
                {
                    "partition": partitions,
                    "config": unmapped(config),
                    "out": outs,
                    "index": list(range(len(partitions))),
                },
            )
            parts = [future.result() for future in futures]
        report = _configured(finish_task, settings)(config, staged, parts)
    write_marker(journeys, key)
    write_marker(quarantine, key)
    return report


@flow(name="ingest")
def ingest_flow(
    config: Config | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Raw event logs -> journeys, quarantine and the ingest report (cached on content)."""
    from journeys.events import resolve_sources

    config = resolve_config(config, config_file, overrides)
    settings = orchestration(config)
    with _stage_lock(config, "ingest"):
        key = fingerprint_task("ingest", config, resolve_sources(config.paths.raw))
        fresh = outputs_match(key, config.paths.journeys, config.paths.quarantine)
        # Its passes retry on their own: retrying the whole would multiply the attempts.
        report, cached = _call_cached(
            ingest_task, settings, fresh, retries=0, config=config, key=key
        )
    create_markdown_artifact(
        text.ingest_markdown(report, config.paths.journeys, config.paths.quarantine),
        key="journeys-ingest",
        description="Ingest report",
    )
    return {**report, "cached": cached}


# ----------------------------------------------------------------------------- train


def needs_own_process(config: Config) -> bool:
    """True for multi-process training (DDP/FSDP/DeepSpeed, several devices or nodes)."""
    train = config.train
    strategy = train.strategy.lower()
    if any(name in strategy for name in MULTI_PROCESS) or train.num_nodes > 1:
        return True
    devices = str(train.devices).strip().lower()
    if devices in ("auto", "-1"):
        if train.accelerator == "cpu":
            return False
        import torch

        return torch.cuda.device_count() > 1
    if devices.lstrip("-").isdigit():
        return int(devices) > 1
    return len([d for d in devices.strip("[]").split(",") if d.strip()]) > 1


def _resumable(config: Config) -> bool:
    """An interrupted training left checkpoints `journeys train --resume` can continue."""
    from journeys.train import STATE_FILE

    try:
        state = json.loads((Path(config.paths.checkpoints) / STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return state.get("status") == "training"


def train_in_subprocess(config: Config, resume: bool, timeout: float) -> str:
    """`python -m journeys.cli train` in its own process (own session); returns its run id.

    The resolved config goes to the child as a YAML file; its output goes to the run log.
    """
    import yaml

    from journeys.train import STATE_FILE

    logger = get_run_logger()
    root = Path(config.paths.checkpoints)
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", dir=root, delete=False) as handle:
        yaml.safe_dump(config.model_dump(mode="json"), handle, sort_keys=False)
    command = [sys.executable, "-m", "journeys.cli", "train", "--config", handle.name]
    if resume:
        command.append("--resume")
    logger.info("training in its own process: %s", " ".join(command))
    # The flow holds the data folder's lock for this stage; the child must not wait for it.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", HELD_ENV: str(lock_path(config))}
    last = ""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        assert process.stdout is not None
        for line in process.stdout:
            line = line.rstrip()
            if line and (not TQDM_UPDATE.search(line) or "100%" in line):
                logger.info(line)
                last = line
            if time.monotonic() > deadline:
                raise TimeoutError(f"training took longer than {timeout:.0f} s")
        code = process.wait()
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        Path(handle.name).unlink(missing_ok=True)
    if code == 2:
        raise JourneysError(last.split("error: ", 1)[-1] or "journeys train: bad input")
    if code != 0:
        raise RuntimeError(f"journeys train exited with code {code}: {last}")
    return json.loads((root / STATE_FILE).read_text())["run_id"]


def train_summary(config: Config, run_id: str) -> dict[str, Any]:
    """The transformer run, its baselines and the champion, read back from MLflow."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from journeys import tracking

    uri = tracking.tracking_uri(config)
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    name = config.mlflow.registered_model
    version = run.data.tags.get(tracking.REGISTERED_VERSION_TAG, "").rpartition("/")[2] or None
    try:
        champion = int(client.get_model_version_by_alias(name, tracking.CHAMPION_ALIAS).version)
    except MlflowException:
        champion = None
    baselines = client.search_runs(
        [run.info.experiment_id],
        filter_string=f"tags.{tracking.COMPARISON_GROUP_TAG} = '{run_id}'",
    )
    return {
        "run_id": run_id,
        "experiment_id": run.info.experiment_id,
        "tracking_uri": uri,
        "registered_model": name,
        "model_version": int(version) if version else None,
        "champion_version": champion,
        "promoted": run.data.tags.get(tracking.CHAMPION_DECISION_TAG) == "promoted",
        "metrics": dict(run.data.metrics),
        "baselines": {
            r.data.tags[tracking.MODEL_FAMILY_TAG].removeprefix("baseline_"): {
                "run_id": r.info.run_id,
                "metrics": dict(r.data.metrics),
            }
            for r in baselines
            if r.data.tags.get(tracking.MODEL_FAMILY_TAG, "").startswith("baseline_")
        },
    }


def _train_record(config: Config) -> Path:
    return Path(config.paths.checkpoints) / TRAIN_RECORD


def train_outputs_exist(config: Config, key: str) -> bool:
    """The MLflow run a cached training produced is still there (and its model version)."""
    from mlflow import MlflowClient

    from journeys import tracking

    try:
        record = json.loads(_train_record(config).read_text())[key]
        client = MlflowClient(tracking_uri=tracking.tracking_uri(config))
        if client.get_run(record["run_id"]).info.lifecycle_stage != "active":
            return False
        if record.get("model_version"):
            client.get_model_version(config.mlflow.registered_model, str(record["model_version"]))
        return True
    except Exception:  # no record, no run, no store: train again
        return False


def _remember_training(config: Config, key: str, summary: dict[str, Any]) -> None:
    from journeys.storage import write_json

    path = _train_record(config)
    try:
        records = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        records = {}
    records[key] = {"run_id": summary["run_id"], "model_version": summary["model_version"]}
    write_json(records, path)


@task(name="train", cache_key_fn=task_key, persist_result=True, result_serializer="json")
def train_task(config: Config, key: str) -> dict[str, Any]:
    """Transformer + baselines, logged and registered (champion/challenger) in MLflow.

    A retry continues an interrupted training from its last checkpoint (`--resume`).
    """
    from prefect.runtime import task_run

    resume = task_run.run_count > 1 and _resumable(config)
    if needs_own_process(config):
        timeout = orchestration(config).task_timeout_s
        run_id = train_in_subprocess(config, resume, timeout)
    else:
        from journeys.train import train_command

        result = train_command(config, resume=resume)
        assert result is not None  # rank 0 in a single process
        run_id = result.run_id
    summary = train_summary(config, run_id)
    _remember_training(config, key, summary)
    return summary


@flow(name="train")
def train_flow(
    config: Config | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Train, compare with the baselines, register; cached on the journeys' content."""
    from journeys import tracking

    config = resolve_config(config, config_file, overrides)
    settings = orchestration(config)
    with _stage_lock(config, "train"):
        uri = tracking.tracking_uri(config)
        key = fingerprint_task("train", config, files_under(config.paths.journeys), [uri])
        fresh = train_outputs_exist(config, key)
        summary, cached = _call_cached(train_task, settings, fresh, config=config, key=key)
        if cached:  # the champion may have moved since that training
            summary = train_summary(config, summary["run_id"])
    create_markdown_artifact(
        text.train_markdown(summary), key="journeys-train", description="Training run"
    )
    return {**summary, "cached": cached}


# ----------------------------------------------------------------------------- score


def champion_uri(config: Config) -> tuple[str, str]:
    """The champion as a pinned `models:/<name>/<version>` URI (and its run id)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from journeys import tracking

    name = config.mlflow.registered_model
    uri = tracking.tracking_uri(config)
    if not tracking.tracking_ready(uri):  # never create an empty store just to find no model
        raise InputError(f"no MLflow store at {uri}: train first")
    client = MlflowClient(tracking_uri=uri)
    try:
        version = client.get_model_version_by_alias(name, tracking.CHAMPION_ALIAS)
    except MlflowException:
        raise InputError(f"no champion version of model {name!r}: train first") from None
    return f"models:/{name}/{version.version}", version.run_id or ""


@task(name="score", cache_key_fn=task_key, persist_result=True, result_serializer="json")
def score_task(config: Config, key: str, model_uri: str) -> dict[str, Any]:
    """Batch-score every journey (censored ones too) with the pinned champion version."""
    from journeys.score import score_command

    result = score_command(config, model_uri=model_uri)
    write_marker(config.paths.scores, key)
    return {
        "rows": result.rows,
        "out": str(result.out),
        "model_uri": result.model_uri,
        "model_version": result.model_version,
        "run_id": result.run_id,
        "seconds": result.seconds,
    }


@flow(name="score")
def score_flow(
    config: Config | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
    attribute: bool = True,
) -> dict[str, Any]:
    """Score the journeys with the champion (then the attribution report, by default)."""
    config = resolve_config(config, config_file, overrides)
    settings = orchestration(config)
    with _stage_lock(config, "score"):
        model_uri, run_id = champion_uri(config)
        files = files_under(config.paths.journeys)
        key = fingerprint_task("score", config, files, [model_uri, run_id])
        fresh = outputs_match(key, config.paths.scores)
        scored, cached = _call_cached(
            score_task, settings, fresh, config=config, key=key, model_uri=model_uri
        )
    create_markdown_artifact(
        text.score_markdown(scored), key="journeys-score", description="Scoring run"
    )
    if attribute:
        attribution_flow(config=config)
    return {**scored, "cached": cached}


# ----------------------------------------------------------------------------- attribution


@task(name="attribution", cache_key_fn=task_key, persist_result=True, result_serializer="json")
def attribution_task(config: Config, key: str) -> dict[str, Any]:
    """The attribution report from the scores."""
    from journeys.attribution import attribute_command

    report = attribute_command(config)
    out = Path(config.paths.reports)
    write_marker(out, key)
    return {
        "out": str(out),
        "files": [str(p.relative_to(out)) for p in files_under(out)],
        "credit": report.credit.head(CREDIT_ROWS).to_dicts(),
    }


@flow(name="attribution")
def attribution_flow(
    config: Config | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Scores -> the attribution report in `paths.reports` (cached on the scores' content)."""
    config = resolve_config(config, config_file, overrides)
    settings = orchestration(config)
    with _stage_lock(config, "attribution"):
        key = fingerprint_task("attribution", config, files_under(config.paths.scores))
        fresh = outputs_match(key, config.paths.reports)
        report, cached = _call_cached(attribution_task, settings, fresh, config=config, key=key)
    create_markdown_artifact(
        text.attribution_markdown(report),
        key="journeys-attribution",
        description="Attribution report",
    )
    return {**report, "cached": cached}


# ----------------------------------------------------------------------------- pipeline


@flow(name="pipeline")
def pipeline_flow(
    config: Config | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """End to end: (simulate if `paths.raw` is empty,) ingest, train, score, attribution."""
    config = resolve_config(config, config_file, overrides)
    started = time.perf_counter()
    with _stage_lock(config, "simulate"):
        simulated = simulate_task(config)
    summary = {
        "simulated": simulated,
        "ingest": ingest_flow(config=config),
        "train": train_flow(config=config),
        "score": score_flow(config=config, attribute=False),
        "attribution": attribution_flow(config=config),
        "paths": config.paths.model_dump(),
    }
    summary["seconds"] = time.perf_counter() - started
    create_markdown_artifact(
        text.pipeline_markdown(summary), key="journeys-pipeline", description="Pipeline run"
    )
    return summary


@contextlib.contextmanager
def one_line_user_errors() -> Iterator[None]:
    """On the console, bad input or configuration logs one line, not a traceback.

    Only the console handler changes: the run logs in Prefect keep the full traceback.
    """
    from prefect.logging.handlers import PrefectConsoleHandler

    def quiet(format_: Any) -> Any:
        def format_record(record: logging.LogRecord) -> str:
            if not (record.exc_info and isinstance(record.exc_info[1], JourneysError)):
                return format_(record)
            saved = record.exc_info, record.exc_text
            record.exc_info, record.exc_text = None, None
            try:
                return format_(record)
            finally:
                record.exc_info, record.exc_text = saved

        return format_record

    handlers = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    for handler in handlers:
        handler.format = quiet(handler.format)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for handler in handlers:
            del handler.format  # back to the class's method


def pipeline_command(config: Config) -> dict[str, Any]:
    """`journeys pipeline`: run the pipeline flow, then print a short summary."""
    with one_line_user_errors():
        summary = pipeline_flow(config=config)
    print(text.console_summary(summary))
    return summary

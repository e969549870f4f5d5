"""Prefect flows over the `journeys` library: ingest, train, score, attribution, pipeline.

Thin by design: every step calls one library function. What Prefect adds:

- retries (never for bad input or configuration: `JourneysError`) and timeouts;
- caching on INPUT CONTENT: each stage's key hashes its input files, the config sections
  it reads and the library code it runs; an unchanged stage is a `Cached` task run, not a
  recomputation, as long as the outputs of that run are still on disk (see `caching`);
- scale-out: ingest maps `build_partition` over the user-hash partitions on the configured
  task runner (threads, processes or a Dask cluster); multi-process (DDP) training runs as
  its own `journeys train` process (supervised: it never outlives the flow's process);
- run logs, and a Markdown artifact per flow run summarising what it produced;
- a lock per data folder, so overlapping scheduled runs never write the same outputs.

Flows take either a resolved `config` (the CLI and `journeys serve` pass one) or a
`config_file` plus `overrides` (for deployments from `prefect.yaml`).
"""

from __future__ import annotations

from flows import _env  # noqa: F401  # isort: skip  (environment defaults before Prefect)

import contextlib
import dataclasses
import logging
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task, unmapped
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.states import State

from flows import cluster
from flows import summary as text
from flows.caching import (
    code_digest,
    config_digest,
    digest_files,
    files_under,
    library_code,
    listing_digest,
    outputs_match,
    remember_training,
    stage_key,
    task_key,
    train_outputs_exist,
    write_marker,
)
from flows.settings import (
    Orchestration,
    make_task_runner,
    orchestration,
    resolve_config,
)
from journeys import ingest as ingest_lib
from journeys import sessionise, tracking
from journeys.config import Config, redact_uri
from journeys.errors import InputError, JourneysError
from journeys.pipeline_lock import HELD_ENV, lock_path, stage_lock
from journeys.processes import run_supervised
from journeys.score import ChunkScored, MapChunks, ScoreChunk, shared_cores

# The library module each stage calls; the code hashed into its cache key is every module
# that one runs (`library_code`: imports read from the source, so never out of date).
STAGE_ENTRY = {
    "ingest": "journeys.ingest",
    "train": "journeys.train",  # + journeys.tracking for its summary (train imports it)
    "score": "journeys.score",
    "attribution": "journeys.attribution",
}
INGEST_CONFIG = ("paths.raw", "paths.journeys", "paths.quarantine", "data", "journey", "split",
                 "ingest", "vocab")  # fmt: skip
TRAIN_CONFIG = ("paths.journeys", "paths.checkpoints", "data", "journey", "split", "vocab",
                "model", "train", "mlflow")  # fmt: skip
SCORE_CONFIG = ("paths.journeys", "paths.scores", "data", "journey", "score")
# Attribution settings may live in any section: hash all but those that cannot matter.
NOT_ATTRIBUTION = ("simulate", "schedule", "orchestration", "model", "train", "ingest")
CREDIT_ROWS = 30  # touchpoints shown in the attribution artifact
MULTI_PROCESS = ("ddp", "fsdp", "deepspeed")  # Lightning strategies that launch processes
TQDM_UPDATE = re.compile(r"\d+/\d+ \[.*(it/s|s/it)")
PARTITION_RETRIED = "(a partition task: failed after its own retries)"  # exception note


# ----------------------------------------------------------------------------- helpers


def stage_inputs(stage: str, config: Config) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(config entries, library modules) a stage's result depends on."""
    code = library_code(STAGE_ENTRY[stage])
    if stage == "attribution":
        sections = tuple(name for name in type(config).model_fields if name not in NOT_ATTRIBUTION)
        return (*sections, "paths.reports", "paths.scores"), code
    config_entries = {"ingest": INGEST_CONFIG, "train": TRAIN_CONFIG, "score": SCORE_CONFIG}
    return config_entries[stage], code


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


@dataclass(frozen=True)
class StageInputs:
    """What a cached stage's key hashes besides config and code, looked up under its lock."""

    files: list[Path]  # hashed by their bytes
    listed: list[Path] = field(default_factory=list)  # by name, size and time only
    extra: list[str] = field(default_factory=list)  # more key parts: a store, a model version
    arguments: dict[str, Any] = field(default_factory=dict)  # more task arguments


def cached_stage(
    stage: str,
    config: Config,
    task_: Any,
    inputs: Callable[[], StageInputs],
    fresh: Callable[[str], bool],
    markdown: Callable[[dict[str, Any]], str],
    description: str,
    task_options: dict[str, Any] | None = None,
    on_cached: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One stage flow: under the data folder's lock, fingerprint the inputs and run the task
    (a cache hit when `fresh(key)`: its outputs are intact); then its Markdown artifact.

    Returns the task's result and `cached`; `on_cached` refreshes a cached result;
    `task_options` override the configured retries and timeout.
    """
    settings = orchestration(config)
    with stage_lock(config, stage, on_wait=get_run_logger().info):
        found = inputs()
        key = fingerprint_task(stage, config, found.files, found.listed, found.extra)
        # A cache hit only when caching is on and the outputs are intact.
        options = {"refresh_cache": not (settings.cache and fresh(key)), **(task_options or {})}
        run = _configured(task_, settings, **options)
        state = run(config=config, key=key, **found.arguments, return_state=True)
        result, cached = state.result(), state.name == "Cached"
        if cached and on_cached is not None:
            result = on_cached(result)
    create_markdown_artifact(markdown(result), key=f"journeys-{stage}", description=description)
    return {**result, "cached": cached}


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


@task(name="build-partition", task_run_name="build-partition-{index}")
def build_partition_task(
    build: sessionise.PartitionBuilder, partition: int, index: int
) -> sessionise.PartitionResult:
    """Pass 2 of ingest for one partition: de-duplicate, sort, sessionise, label."""
    return build(partition)


def map_as_tasks(
    task_: Any,
    settings: Orchestration,
    work: tuple[str, Any],
    items: tuple[str, list],
    needed: Sequence[Path] = (),
) -> list[Any]:
    """One task per item on the configured task runner, results in the items' order:
    `task_(<work name>=work, <items name>=item, index=i)`. No per-item timeout: a worker
    thread cannot be interrupted; the calling stage's own timeout bounds the whole. On a
    Dask cluster every worker must see the `needed` paths (`flows.cluster.shipping_to`)."""
    task_ = _configured(task_, settings, timeout_seconds=None)
    (work_name, work_value), (items_name, values) = work, items
    with make_task_runner(settings) as runner:
        shipping = (
            cluster.shipping_to(runner.client, needed)
            if settings.task_runner == "dask"
            else contextlib.nullcontext()
        )
        with shipping:
            futures = runner.map(
                task_,
                {
                    work_name: unmapped(work_value),
                    items_name: values,
                    "index": list(range(len(values))),
                },
            )
        try:
            return [future.result() for future in futures]
        except Exception as err:
            if not isinstance(err, JourneysError):  # never retried: nothing to note
                err.add_note(PARTITION_RETRIED)
            raise


def partitions_as_tasks(settings: Orchestration) -> sessionise.MapPartitions:
    """`run_ingest`'s pass 2 as one task per partition on the configured task runner."""

    def map_partitions(
        build: sessionise.PartitionBuilder, partitions: list[int]
    ) -> list[sessionise.PartitionResult]:
        get_run_logger().info("building %d partition(s)", len(partitions))
        needed = build.paths() if isinstance(build, sessionise.BuildPartition) else []
        return map_as_tasks(
            build_partition_task, settings, ("build", build), ("partition", partitions), needed
        )

    return map_partitions


def _retry_ingest(task_: Any, task_run: Any, state: State) -> bool:
    """The ingest task retries what its stage or finish pass met, never its own timeout
    or a partition's error (partitions retry on their own): retrying the whole would
    multiply the attempts."""
    error = state.result(raise_on_failure=False)
    timed_out = type(error).__name__ == "TaskRunTimeoutError"
    if timed_out or PARTITION_RETRIED in getattr(error, "__notes__", ()):
        return False
    return _retry_unless_bad_input(task_, task_run, state)


@task(name="fingerprint", task_run_name="fingerprint-{stage}")
def fingerprint_task(
    stage: str,
    config: Config,
    files: list[Path],
    listed: list[Path] | None = None,
    extra: list[str] | None = None,
) -> str:
    """The cache key of a stage: inputs + config sections + library code."""
    sections, code = stage_inputs(stage, config)
    started = time.perf_counter()
    key = stage_key(
        stage,
        digest_files(files),
        listing_digest(listed or []),
        config_digest(config, sections),
        code_digest(*code),
        *(extra or []),
    )
    get_run_logger().info(
        "%s inputs: %d file(s) hashed, %d listed in %.1f s -> %s",
        stage,
        len(files),
        len(listed or []),
        time.perf_counter() - started,
        key,
    )
    return key


@task(name="ingest", cache_key_fn=task_key, persist_result=True, result_serializer="json")
def ingest_task(config: Config, key: str, full: bool = False) -> dict[str, Any]:
    """The three ingest passes, pass 2 mapped over partitions on the configured runner:
    only the raw files not ingested yet, unless `full`."""
    result = ingest_lib.run_ingest(
        config, map_partitions=partitions_as_tasks(orchestration(config)), full=full
    )
    get_run_logger().info(
        "ingested %s rows from %d file(s) in %d partition(s)",
        f"{result.report.rows_read:,}",
        len(result.report.sources),
        result.report.partitions,
    )
    write_marker(config.paths.journeys, key)
    write_marker(config.paths.quarantine, key)
    return result.report.to_json()


@flow(name="ingest")
def ingest_flow(
    config: Config | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
    full: bool = False,
) -> dict[str, Any]:
    """Raw event logs -> journeys, quarantine and the ingest report: the files not ingested
    yet (`full`: all of them). Cached on the raw files' listing (names, sizes, times), so
    the key never reads a raw file; a new file changes it, and ingest reads that file."""
    from journeys.events import resolve_sources

    config = resolve_config(config, config_file, overrides)
    paths = config.paths

    def inputs() -> StageInputs:
        sources = resolve_sources(paths.raw)
        return StageInputs([], sources, ["full"] if full else [], {"full": full})

    return cached_stage(
        "ingest",
        config,
        ingest_task,
        inputs=inputs,
        fresh=lambda key: outputs_match(key, paths.journeys, paths.quarantine),
        markdown=lambda report: text.ingest_markdown(report, paths.journeys, paths.quarantine),
        description="Ingest report",
        task_options={"retry_condition_fn": _retry_ingest},
    )


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
    """An interrupted training left checkpoints `journeys train --resume` can continue
    (never a search, `train.search`: it starts afresh)."""
    from journeys.train import read_state

    if config.train.search.trials:
        return False
    try:
        return read_state(Path(config.paths.checkpoints)).get("status") == "training"
    except JourneysError:  # no state, or an unreadable one
        return False


def train_in_subprocess(config: Config, resume: bool, timeout: float) -> str:
    """`python -m journeys.cli train` in its own process group, supervised (stopped with
    this process, or on the timeout); returns its run id.

    The resolved config goes to the child as a YAML file; its output goes to the run log.
    """
    import yaml

    from journeys.train import read_state

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
    # The YAML above is redacted: the child reaches the store through its environment.
    env = {
        **os.environ,
        **tracking.tracking_environment(config),
        "PYTHONUNBUFFERED": "1",
        HELD_ENV: str(lock_path(config)),
    }
    last = ""

    def log_line(line: str) -> None:
        nonlocal last
        line = line.rstrip()
        if line and (not TQDM_UPDATE.search(line) or "100%" in line):
            logger.info(line)
            last = redact_uri(line)  # it may end up in the failed state's message

    try:
        code = run_supervised(command, env, timeout, log_line)
    finally:
        Path(handle.name).unlink(missing_ok=True)
    if code == 2:
        raise JourneysError(last.split("error: ", 1)[-1] or "journeys train: bad input")
    if code != 0:
        raise RuntimeError(f"journeys train exited with code {code}: {last}")
    return read_state(root)["run_id"]


def train_summary(config: Config, run_id: str) -> dict[str, Any]:
    """The transformer run, its baselines and the champion, read back from MLflow."""
    uri = tracking.tracking_uri(config)
    return tracking.training_summary(uri, run_id, config.mlflow.registered_model)


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
    remember_training(config, key, summary)
    return summary


@flow(name="train")
def train_flow(
    config: Config | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Train, compare with the baselines, register; cached on the journeys' content."""
    config = resolve_config(config, config_file, overrides)
    uri = tracking.tracking_uri(config)
    return cached_stage(
        "train",
        config,
        train_task,
        inputs=lambda: StageInputs([], files_under(config.paths.journeys), [redact_uri(uri)]),
        fresh=lambda key: train_outputs_exist(config, key),
        markdown=text.train_markdown,
        description="Training run",
        # the champion may have moved since that training
        on_cached=lambda summary: train_summary(config, summary["run_id"]),
    )


# ----------------------------------------------------------------------------- score


# Never cached: the model is not worth hashing, and the output goes to this run's staging.
@task(name="score-chunk", task_run_name="score-chunk-{index}", cache_policy=NO_CACHE)
def score_chunk_task(score: ScoreChunk, chunk: tuple[int, int], index: int) -> ChunkScored:
    """One chunk of the journeys, scored into the scores' staging folder; on a Dask worker
    with PyTorch on the worker's share of the cores (not every core of its machine)."""
    if score.torch_threads is None and (threads := cluster.worker_share(len(score.held))):
        score = dataclasses.replace(score, torch_threads=threads)
    return score(index, chunk)


def chunks_as_tasks(settings: Orchestration) -> MapChunks:
    """Scoring as one task per chunk on the configured task runner; on threads and
    processes each worker gets its share of this machine's cores for PyTorch."""

    def map_chunks(score: ScoreChunk, chunks: list[tuple[int, int]]) -> list[ChunkScored]:
        get_run_logger().info("scoring %d chunk(s)", len(chunks))
        workers = min(settings.max_workers or len(chunks), len(chunks)) or None
        if settings.task_runner == "dask":  # a Dask worker's share is its --nthreads
            workers = None
        needed = score.paths()
        with shared_cores(score, workers) as shared:
            return map_as_tasks(
                score_chunk_task, settings, ("score", shared), ("chunk", chunks), needed
            )

    return map_chunks


@task(name="score", cache_key_fn=task_key, persist_result=True, result_serializer="json")
def score_task(config: Config, key: str, model_uri: str) -> dict[str, Any]:
    """Batch-score every journey (censored ones too) with the pinned champion version,
    each chunk a task of its own."""
    from journeys.score import score_command

    result = score_command(
        config, model_uri=model_uri, map_chunks=chunks_as_tasks(orchestration(config))
    )
    write_marker(config.paths.scores, key)
    return {
        "rows": result.rows,
        "out": str(result.out),
        "model_uri": result.model_uri,
        "model_version": result.model_version,
        "run_id": result.run_id,
        "seconds": result.seconds,
        "as_of": result.as_of.isoformat() if result.as_of else None,
        "open": result.open,
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

    def inputs() -> StageInputs:  # the champion now, pinned to its version
        uri = tracking.tracking_uri(config)
        model_uri, run_id = tracking.champion_uri(uri, config.mlflow.registered_model)
        files = files_under(config.paths.journeys)
        return StageInputs([], files, [model_uri, run_id], {"model_uri": model_uri})

    scored = cached_stage(
        "score",
        config,
        score_task,
        inputs=inputs,
        fresh=lambda key: outputs_match(key, config.paths.scores),
        markdown=text.score_markdown,
        description="Scoring run",
    )
    if attribute:
        attribution_flow(config=config)
    return scored


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
    return cached_stage(
        "attribution",
        config,
        attribution_task,
        inputs=lambda: StageInputs([], files_under(config.paths.scores)),
        fresh=lambda key: outputs_match(key, config.paths.reports),
        markdown=text.attribution_markdown,
        description="Attribution report",
    )


# ----------------------------------------------------------------------------- monitor


@flow(name="monitor")
def monitor_flow(
    config: Config | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """Tonight's drift, scores and arrived labels against the model's reference (never
    cached: each night adds its row to the history). Alerts tag this flow run
    `monitor-alert` and are one line each in the summary."""
    from journeys.monitor import MONITOR_DIR, PAGE_FILE, alert_lines, run_monitor

    config = resolve_config(config, config_file, overrides)
    with stage_lock(config, "monitor", on_wait=get_run_logger().info):
        result = run_monitor(config)
    lines = alert_lines(result)
    for line in lines:
        get_run_logger().warning(line)
    if lines:
        mark_flow_run("monitor-alert")
    page = Path(config.paths.reports) / MONITOR_DIR / result.night / PAGE_FILE
    return {"night": result.night, "alerts": lines, "checks": len(result.checks), "page": str(page)}


def mark_flow_run(tag: str) -> None:
    """Add `tag` to the flow run in progress (the Prefect UI filters runs by tag)."""
    from prefect.client.orchestration import get_client
    from prefect.context import get_run_context

    run = get_run_context().flow_run  # type: ignore[union-attr]
    if run is None:
        return
    with get_client(sync_client=True) as client:
        client.update_flow_run(run.id, tags=sorted({*run.tags, tag}))


# ----------------------------------------------------------------------------- pipeline


def servers_used(config: Config) -> dict[str, str | None]:
    """The MLflow store and Prefect API this run used (passwords redacted); None: a
    temporary Prefect server, gone with the run (its runs stay in Prefect's home database,
    which `prefect server start` shows)."""
    from prefect.settings import get_current_settings

    from flows.prefect_server import started_here

    api = get_current_settings().api.url
    temporary = api is None or started_here(str(api))
    return {
        "mlflow": redact_uri(tracking.tracking_uri(config)),
        "prefect": None if temporary else redact_uri(str(api)),
    }


@flow(name="pipeline")
def pipeline_flow(
    config: Config | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
) -> dict[str, Any]:
    """End to end: (simulate if `paths.raw` is empty,) ingest, train, score, attribution,
    monitor."""
    config = resolve_config(config, config_file, overrides)
    started = time.perf_counter()
    with stage_lock(config, "simulate", on_wait=get_run_logger().info):
        simulated = simulate_task(config)
    summary = {
        "simulated": simulated,
        "ingest": ingest_flow(config=config),
        "train": train_flow(config=config),
        "score": score_flow(config=config, attribute=False),
        "attribution": attribution_flow(config=config),
        "monitor": monitor_flow(config=config),
        "paths": config.paths.model_dump(),
        "servers": servers_used(config),
    }
    summary["seconds"] = time.perf_counter() - started
    create_markdown_artifact(
        text.pipeline_markdown(summary), key="journeys-pipeline", description="Pipeline run"
    )
    return summary


class RedactPasswords(logging.Filter):
    """Run logs go to the Prefect database: a password inside a URI in a message or a
    traceback (a failing connection string, say) is redacted before any handler sees it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = redact_uri(record.getMessage()), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_uri(record.exc_text)
        return True


for _run_logger in ("prefect.flow_runs", "prefect.task_runs"):  # what get_run_logger uses
    logging.getLogger(_run_logger).addFilter(RedactPasswords())


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


@contextlib.contextmanager
def lightning_logs_once() -> Iterator[None]:
    """Lightning's records reach the console once, through Prefect's handler (which also
    sends them to the run's logs), not a second time through the handler Lightning adds
    to its own `lightning` logger when it is first imported (now, so it can be taken off;
    scoring and training import it anyway)."""
    import lightning  # noqa: F401  (adds the handler)

    logger = logging.getLogger("lightning")
    own = [h for h in logger.handlers if type(h) is logging.StreamHandler]
    for handler in own:
        logger.removeHandler(handler)
    try:
        yield
    finally:
        for handler in own:
            logger.addHandler(handler)


def pipeline_command(config: Config) -> dict[str, Any]:
    """`journeys pipeline`: run the pipeline flow, then print a short summary. With no
    Prefect API configured, the run reports to a server that dies with this process."""
    from flows.prefect_server import run_server

    with run_server(), one_line_user_errors(), lightning_logs_once():
        summary = pipeline_flow(config=config)
    print(text.console_summary(summary))
    return summary

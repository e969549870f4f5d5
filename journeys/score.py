"""Batch scoring: journeys (or a raw event log) -> Parquet scores with per-event attention.

`journeys score` (`score_command`) loads a logged model (`journeys.packaging.load_model`:
JSON + safetensors, never pickle) and writes one row per input journey, censored ones
included, with the columns of CONTRACT §5:

    journey_id, user_id, n_events, conversion_probability (float64, temperature-calibrated),
    event_type, event_time, attention (list[float32], one per event, >= 0, sums to 1),
    <one list column per model feature>, model_uri, model_version, scored_at
    (+ label, censored, split, n_events_total when the input has them;
     + prefix_probability, the probability after each event, when the model is causal)

Input is either a journeys dataset (a folder with `part-*.parquet` and `vocab.json`, as
`journeys ingest` writes it) or a raw event log (file, folder or glob). A raw log is
ingested into a temporary folder with the *model's* preprocessing settings and scored with
the *model's* vocabularies: nothing is refitted, and an event type the model never saw maps
to the unknown token. A model keeps only its last `max_len` events, so the list columns of
a longer journey are cut to the events the model read and attention stays aligned with them.

Memory stays bounded however large the input: the part files are read in chunks of
`score.chunk_journeys` journeys, one at a time; each chunk is scored in forward
passes of `score.batch_size` (grouped by length, so little compute goes to padding),
written as its own part file into a staging folder, and freed before the next one. The
staging folder is swapped in atomically when all are done: readers never see half.

After scoring, the attribution report (`journeys.attribution`) is built from the scores
into `paths.reports`. When the configured MLflow store exists (a server, or a SQLite file
that is already there) the scoring run is logged to it, params `model_uri`, `rows`, ...,
with the report as artifacts; scoring never creates a store.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import polars as pl

from journeys.errors import InputError
from journeys.storage import atomic_dir, scratch_dir

if TYPE_CHECKING:
    import torch

    from journeys.config import Config
    from journeys.data import EncodedJourneys
    from journeys.packaging import LoadedModel

AttentionMode = Literal["pooled", "rollout"]

PART_FILE = "part-{:05d}.parquet"
# Scoring facts (model, run, input) ride in each part file's Parquet key-value metadata:
# the scores folder stays Parquet-only, so `pl.scan_parquet(folder)` keeps working.
METADATA_KEY = "journeys.scoring"
CHAMPION_ALIAS = "champion"  # journeys.tracking.CHAMPION_ALIAS (not imported: it is light)
READ_BUFFER_BYTES = 1 << 20  # Parquet pages are streamed through a buffer of this size
JOURNEYS_MARKER = "vocab.json"  # with part-*.parquet, marks a journeys dataset folder
UTC_US = pl.Datetime("us", "UTC")

REQUIRED_COLUMNS = ("journey_id", "user_id", "event_type", "event_time")
# Columns copied through when the input has them (and their output types).
OPTIONAL_COLUMNS: dict[str, pl.DataType] = {
    "label": pl.Int8(),
    "censored": pl.Boolean(),
    "split": pl.String(),
    "n_events_total": pl.Int32(),
}


# ----------------------------------------------------------------------------- schema


def scores_schema(
    features: list[str], optional: list[str] | tuple[str, ...] = (), causal: bool = False
) -> pl.Schema:
    """The output schema: contract columns, model features, present optional columns."""
    columns: dict[str, pl.DataType] = {
        "journey_id": pl.String(),
        "user_id": pl.String(),
        "n_events": pl.Int32(),
        "conversion_probability": pl.Float64(),
    }
    if causal:
        columns["prefix_probability"] = pl.List(pl.Float64())
    columns |= {
        "event_type": pl.List(pl.String()),
        "event_time": pl.List(UTC_US),
        "attention": pl.List(pl.Float32()),
    }
    columns |= {name: pl.List(pl.String()) for name in features}
    columns |= {name: dtype for name, dtype in OPTIONAL_COLUMNS.items() if name in optional}
    columns |= {"model_uri": pl.String(), "model_version": pl.String(), "scored_at": UTC_US}
    return pl.Schema(columns)


# ----------------------------------------------------------------------------- model side


def default_model_uri(config: Config) -> str:
    return f"models:/{config.mlflow.registered_model}@{CHAMPION_ALIAS}"


def pick_device() -> torch.device:
    """The GPU when there is one; on CPU, use every core this process may run on."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores))
    return torch.device("cpu")


def sigmoid(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Numerically stable logistic in float64 (tanh form: no overflow for large |x|)."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    return 0.5 * (1.0 + np.tanh(0.5 * x))


@dataclass(frozen=True)
class ChunkOutputs:
    """Model outputs for a chunk, in the chunk's journey order; per-event arrays are flat
    (journey i's events at `offsets[i]:offsets[i + 1]`)."""

    logits: np.ndarray  # [n] float32
    offsets: np.ndarray  # [n + 1] int64
    attention: np.ndarray | None  # [events] float32
    prefix_logits: np.ndarray | None  # [events] float32 (causal models)


def forward_encoded(
    model: Any,
    encoded: EncodedJourneys,
    batch_size: int,
    attention: AttentionMode | None,
    device: torch.device | None = None,
) -> ChunkOutputs:
    """Run the model over `encoded` in length-grouped batches; outputs back in input order."""
    import torch

    from journeys.data import make_dataloader

    device = device or next(model.parameters()).device
    causal = bool(model.config.causal)
    offsets = encoded.offsets
    logits = np.zeros(len(encoded), dtype=np.float32)
    weights = np.zeros(encoded.n_events, dtype=np.float32) if attention else None
    prefix = np.zeros(encoded.n_events, dtype=np.float32) if causal else None
    model.eval()
    with torch.inference_mode():
        # Grouped by length: batches of similar journeys waste little compute on padding;
        # `batch.index` puts every row back where it came from.
        loader = make_dataloader(encoded, batch_size, shuffle=False, group_by_length=True)
        for batch in loader:
            out = model(
                batch.tokens.to(device),
                batch.features.to(device),
                batch.time_buckets.to(device),
                batch.mask.to(device),
                attention=attention,
            )
            index = batch.index
            logits[index.numpy()] = out.logits.float().cpu().numpy()
            if weights is None and prefix is None:
                continue
            mask = batch.mask
            # Flat position of every real event of the batch, row-major like mask selection.
            positions = (offsets[index][:, None] + torch.arange(mask.size(1)))[mask].numpy()
            if weights is not None:
                weights[positions] = out.attention.float().cpu()[mask].numpy()
            if prefix is not None:
                prefix[positions] = out.prefix_logits.float().cpu()[mask].numpy()
    return ChunkOutputs(logits, offsets.numpy(), weights, prefix)


def _list_series(name: str, offsets: np.ndarray, values: np.ndarray) -> pl.Series:
    """Flat values + offsets -> a List series without a Python loop (via Arrow)."""
    import pyarrow as pa

    array = pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(values))
    return pl.Series(name, array)


def score_frame(
    loaded: LoadedModel,
    frame: pl.DataFrame,
    *,
    attention: AttentionMode | None = "pooled",
    batch_size: int = 1024,
    device: torch.device | None = None,
) -> pl.DataFrame:
    """Score an in-memory journeys frame (ingest schema): the per-journey output columns.

    Returns journey_id, user_id, n_events, conversion_probability (+ prefix_probability),
    the list columns cut to the events the model read, attention (unless `attention` is
    None) and the optional columns present in `frame`. No run-level columns.
    """
    from journeys.data import encode_journeys

    model = loaded.model
    max_len = int(model.config.max_len)
    n_time_buckets = int(loaded.preprocessing.get("n_time_buckets", model.config.n_time_buckets))
    features = loaded.vocabs.features
    encoded = encode_journeys(frame, loaded.vocabs, n_time_buckets, max_len)
    outputs = forward_encoded(model, encoded, batch_size, attention, device)

    temperature = float(loaded.temperature)
    columns: list[pl.Series | pl.Expr] = [
        pl.col("journey_id").cast(pl.String),
        pl.col("user_id").cast(pl.String),
        pl.col("event_type").list.tail(max_len).list.len().cast(pl.Int32).alias("n_events"),
        pl.Series("conversion_probability", sigmoid(outputs.logits, temperature)),
    ]
    if outputs.prefix_logits is not None:
        probabilities = sigmoid(outputs.prefix_logits, temperature)
        columns.append(_list_series("prefix_probability", outputs.offsets, probabilities))
    columns += [pl.col(c).list.tail(max_len) for c in ("event_type", "event_time", *features)]
    if outputs.attention is not None:
        columns.append(_list_series("attention", outputs.offsets, outputs.attention))
    columns += [
        pl.col(name).cast(dtype) for name, dtype in OPTIONAL_COLUMNS.items() if name in frame
    ]
    return frame.select(columns)


# ----------------------------------------------------------------------------- input side


def is_journeys_dataset(path: str | Path) -> bool:
    """A folder of `part-*.parquet` with `vocab.json` beside them (as ingest writes it), or
    whose parts hold `event_type` as a list (journeys, not raw events), is a journeys
    dataset; anything else is read as a raw event log."""
    path = Path(path)
    parts = _parquet_parts(path) if path.is_dir() else []
    if not parts:
        return False
    if (path / JOURNEYS_MARKER).exists():
        return True
    try:
        return isinstance(pl.read_parquet_schema(parts[0]).get("event_type"), pl.List)
    except (pl.exceptions.PolarsError, OSError):
        return False  # unreadable: let the raw-log reader name the problem


def scoring_config(config: Config, preprocessing: dict[str, Any]) -> Config:
    """`config` with the model's preprocessing settings, for ingesting a raw log to score.

    The model decides what a journey is (features, event map, conversion and drop events,
    max_gap, max_events, time zone, epoch unit). Column names describe the file being read,
    so the current configuration's `data.columns` override the model's per logical name.
    """
    from journeys.config import Config

    tree = config.model_dump()
    data, journey = tree["data"], tree["journey"]
    for key in ("features", "event_map", "conversion_events", "drop_events", "timezone"):
        if key in preprocessing:
            data[key] = preprocessing[key]
    if "timestamp_unit" in preprocessing:
        data["timestamp_unit"] = preprocessing["timestamp_unit"]
    data["columns"] = {**preprocessing.get("columns", {}), **config.data.columns}
    for key in ("max_gap", "max_events", "after_conversion"):
        if key in preprocessing:
            journey[key] = preprocessing[key]
    return Config.model_validate(tree)


def _parquet_parts(folder: Path) -> list[Path]:
    return sorted(folder.glob("part-*.parquet"))


def _input_schema(parts: list[Path]) -> pl.Schema:
    try:
        return pl.read_parquet_schema(parts[0])
    except (pl.exceptions.PolarsError, OSError) as err:
        raise InputError(f"cannot read {parts[0]}: {_first_line(err)}") from None


def check_columns(schema: pl.Schema, features: list[str], where: str | Path) -> list[str]:
    """Raise InputError unless the journeys have what the model needs; return the columns
    to read (required, features, optional ones present)."""
    needed = [*REQUIRED_COLUMNS, *features]
    missing = [name for name in needed if name not in schema]
    if missing:
        raise InputError(
            f"journeys at {where} lack column(s) {missing} that the model needs "
            f"(model features: {features}); re-ingest with the model's data.features"
        )
    return [*needed, *[name for name in OPTIONAL_COLUMNS if name in schema]]


def iter_chunks(
    parts: list[Path], columns: list[str], chunk_journeys: int
) -> Iterator[pl.DataFrame]:
    """Journeys in chunks of `chunk_journeys` rows (the last one smaller), in input order.

    Pull-based on purpose: the next rows are read only when the previous chunk has been
    scored. (Polars' `collect_batches` / `sink_batches` read ahead of a slow consumer and
    buffered the whole input in a test.) pyarrow streams each file page by page
    (`buffer_size`, no pre-buffering), so even a huge row group is never decoded at once.
    Small part files are pooled into full chunks, so length-grouped batching finds
    journeys of similar length to batch together.
    """
    pending: list[pl.DataFrame] = []
    held = 0
    for frame in _record_batches(parts, columns, chunk_journeys):
        pending.append(frame)
        held += frame.height
        while held >= chunk_journeys:
            pooled = pl.concat(pending, how="vertical_relaxed", rechunk=False)
            yield pooled.slice(0, chunk_journeys)
            rest = pooled.slice(chunk_journeys)
            pending, held = ([rest] if rest.height else []), rest.height
    if held:
        yield pl.concat(pending, how="vertical_relaxed", rechunk=False)


def _record_batches(parts: list[Path], columns: list[str], size: int) -> Iterator[pl.DataFrame]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in parts:
        try:
            reader = pq.ParquetFile(path, buffer_size=READ_BUFFER_BYTES, pre_buffer=False)
            for batch in reader.iter_batches(batch_size=size, columns=columns):
                yield pl.from_arrow(batch)  # type: ignore[misc]
        except (pa.ArrowException, OSError) as err:
            raise InputError(f"cannot read {path}: {_first_line(err)}") from None


def release_freed_memory() -> None:
    """Hand memory freed by the last chunk back to the OS (glibc only; a no-op elsewhere).

    torch's CPU tensors come from glibc malloc, which keeps freed arenas mapped, and
    pyarrow's pool keeps its pages; without this, the peak creeps up chunk after chunk
    instead of staying flat.
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
    if "pyarrow" in sys.modules:  # pyarrow's own pool (mimalloc/jemalloc) keeps pages too
        sys.modules["pyarrow"].default_memory_pool().release_unused()


@functools.cache
def _libc() -> Any:
    import ctypes

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # e.g. musl
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def _count_rows(parts: list[Path]) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    total = 0
    for path in parts:
        try:
            total += pq.ParquetFile(path).metadata.num_rows
        except (pa.ArrowException, OSError) as err:
            raise InputError(f"cannot read {path}: {_first_line(err)}") from None
    return total


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ----------------------------------------------------------------------------- scoring


@dataclass
class ScoreResult:
    """What one scoring run produced."""

    out: Path
    rows: int
    parts: int
    model_uri: str
    model_version: str | None
    attention: str
    seconds: float
    input: str
    ingest_report: dict[str, Any] | None = None
    run_id: str | None = None
    reports: Path | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def journeys_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else float("nan")


def score_dataset(
    loaded: LoadedModel,
    journeys_folder: str | Path,
    out: str | Path,
    *,
    batch_size: int = 1024,
    chunk_journeys: int = 50_000,
    attention: AttentionMode | None = "pooled",
    metadata: dict[str, Any] | None = None,
    progress: bool = True,
) -> int:
    """Score every journey of a journeys folder into Parquet parts under `out` (atomic).

    Returns the number of rows written. `attention=None` skips the attention export (for
    benchmarks; the product always exports it). An empty input gives one empty part file
    with the full schema.
    """
    folder = Path(journeys_folder)
    parts = _parquet_parts(folder)
    if not parts:
        raise InputError(f"no journeys (part-*.parquet) in {folder}")
    features = loaded.vocabs.features
    columns = check_columns(_input_schema(parts), features, folder)
    optional = [name for name in OPTIONAL_COLUMNS if name in columns]
    schema = scores_schema(features, optional, causal=bool(loaded.model.config.causal))
    if attention is None:
        schema = pl.Schema({k: v for k, v in schema.items() if k != "attention"})
    metadata = dict(metadata or {})
    scored_at = datetime.fromisoformat(metadata.get("scored_at") or _now()).astimezone(UTC)
    constants = [
        pl.lit(loaded.model_uri, pl.String).alias("model_uri"),
        pl.lit(loaded.model_version, pl.String).alias("model_version"),
        pl.lit(scored_at, UTC_US).alias("scored_at"),
    ]
    parquet_metadata = {METADATA_KEY: json.dumps(metadata, default=str)}

    device = pick_device()
    loaded.model.to(device)
    total = _count_rows(parts)
    written = 0
    with atomic_dir(out) as staging, _progress(total, progress) as advance:
        index = -1
        for index, chunk in enumerate(iter_chunks(parts, columns, chunk_journeys)):
            scored = score_frame(
                loaded, chunk, attention=attention, batch_size=batch_size, device=device
            ).with_columns(constants)
            scored = scored.select(pl.col(name).cast(dtype) for name, dtype in schema.items())
            scored.write_parquet(staging / PART_FILE.format(index), metadata=parquet_metadata)
            written += scored.height
            advance(scored.height)
            del scored, chunk
            release_freed_memory()
        if index < 0:  # no rows at all: still a readable file with every column
            pl.DataFrame(schema=schema).write_parquet(
                staging / PART_FILE.format(0), metadata=parquet_metadata
            )
    return written


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[int], None]]:
    """A rich progress bar on stderr, advanced by journeys scored (or a no-op)."""
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(TextColumn("scoring"), *columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("scoring", total=total)
        yield lambda n: bar.advance(task, n)


def _now() -> str:
    return datetime.now(UTC).replace(microsecond=0).isoformat()


def score_input(
    loaded: LoadedModel,
    config: Config,
    input_path: str | Path,
    out: str | Path,
    *,
    attention: AttentionMode | None = None,
    metadata: dict[str, Any] | None = None,
    progress: bool = True,
) -> tuple[int, dict[str, Any] | None]:
    """Score a journeys folder, or ingest a raw log with the model's settings and score it.

    `attention` None means `score.attention` from the configuration. Returns (rows
    written, the ingest report when the input was a raw log).
    """
    from journeys.ingest import run_ingest

    source = Path(input_path)
    settings = dict(
        batch_size=config.score.batch_size,
        chunk_journeys=config.score.chunk_journeys,
        attention=attention or config.score.attention,
        metadata=metadata,
        progress=progress,
    )
    if is_journeys_dataset(source):
        return score_dataset(loaded, source, out, **settings), None
    if not any(ch in str(input_path) for ch in "*?[") and not source.exists():
        raise InputError(f"input not found: {input_path}")
    out = Path(out)
    ingest_config = scoring_config(config, loaded.preprocessing)
    with scratch_dir(out.parent, "score-ingest") as scratch:
        result = run_ingest(
            ingest_config,
            raw=str(input_path),
            journeys_folder=scratch / "journeys",
            quarantine_folder=scratch / "quarantine",
        )
        rows = score_dataset(loaded, result.journeys_folder, out, **settings)
        return rows, result.report


def score_command(
    config: Config,
    model_uri: str | None = None,
    input_path: str | Path | None = None,
    out: str | Path | None = None,
    *,
    attribute: bool = True,
) -> ScoreResult:
    """`journeys score`: load the model, score, write the attribution report, log to MLflow.

    Defaults: model `models:/<mlflow.registered_model>@champion`, input `paths.journeys`,
    output `paths.scores`. A missing model or alias, an unreadable input or columns that
    do not match the configuration raise `InputError` (the CLI prints one line, exit 2).
    """
    from journeys.packaging import load_model
    from journeys.tracking import tracking_uri

    # MLflow's per-file download bars would drown the one progress bar that matters.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = model_uri or default_model_uri(config)
    store = tracking_uri(config)
    if uri.startswith(("models:/", "runs:/")) and not tracking_ready(store):
        raise InputError(f"model {uri} not found: no MLflow store at {store} (train first)")
    loaded = load_model(uri, tracking_uri=store)
    source = str(input_path or config.paths.journeys)
    out = Path(out or config.paths.scores)
    attention = config.score.attention

    run = ScoringRun.start(config, store) if tracking_ready(store) else None
    metadata = {
        "model_uri": loaded.model_uri,
        "model_version": loaded.model_version,
        "attention": attention,
        "input": source,
        "scored_at": _now(),
        "run_id": run.run_id if run else None,
    }
    # journeys.data imports Lightning (~4 s): import it before the clock starts so the
    # reported journeys/s measures scoring, not start-up.
    import journeys.data  # noqa: F401

    started = time.perf_counter()
    try:
        rows, report = score_input(
            loaded, config, source, out, attention=attention, metadata=metadata
        )
    except BaseException:
        if run:
            run.finish("FAILED")
        raise
    result = ScoreResult(
        out=out,
        rows=rows,
        parts=len(_parquet_parts(out)),
        model_uri=loaded.model_uri,
        model_version=loaded.model_version,
        attention=attention,
        seconds=time.perf_counter() - started,
        input=source,
        ingest_report=report,
        run_id=run.run_id if run else None,
        metadata=metadata,
    )
    _print_summary(result)
    status = "FAILED"
    try:
        if attribute and rows:
            from journeys.attribution import attribute as build_report

            result.reports = Path(config.paths.reports)
            build_report(out, result.reports, loaded=loaded)
            print(f"attribution report -> {result.reports}")
        status = "FINISHED"
    finally:
        if run:
            run.log(result)
            run.finish(status)
    return result


def _print_summary(result: ScoreResult) -> None:
    version = f" v{result.model_version}" if result.model_version else ""
    if result.rows == 0:
        print(
            f"no journeys to score in {result.input}: wrote an empty scores file with the "
            f"full schema to {result.out}"
        )
        return
    print(
        f"scored {result.rows:,} journeys with {result.model_uri}{version} in "
        f"{result.seconds:.1f} s ({result.journeys_per_second:,.0f}/s, attention "
        f"{result.attention}) -> {result.out}"
    )
    if result.ingest_report:
        report = result.ingest_report
        print(
            f"  ingested {report['rows_read']:,} raw rows with the model's settings: "
            f"{report['quarantined_total']:,} quarantined, "
            f"{report['duplicates_dropped']:,} duplicates, "
            f"{report['dropped_by_config']:,} dropped by config"
        )


# ----------------------------------------------------------------------------- MLflow


def tracking_ready(uri: str) -> bool:
    """True when the tracking store exists already: scoring logs there but never creates
    one (a `sqlite:///mlflow.db` file appearing after `journeys score` would surprise)."""
    if uri.startswith("sqlite:///"):
        path = uri.removeprefix("sqlite:///")
        return path not in ("", ":memory:") and Path(path).exists()
    if uri.startswith("file:"):
        return Path(uri.removeprefix("file://").removeprefix("file:")).exists()
    if "://" not in uri:  # a plain folder store
        return Path(uri).exists()
    return True  # a server or a database: it exists by definition


@dataclass
class ScoringRun:
    """The MLflow run of one scoring job (optional: scoring works without a store)."""

    client: Any
    run_id: str

    @classmethod
    def start(cls, config: Config, uri: str) -> ScoringRun | None:
        try:
            from mlflow import MlflowClient

            from journeys.tracking import get_experiment_id

            client = MlflowClient(tracking_uri=uri)
            experiment = get_experiment_id(uri, config.mlflow.experiment)
            run = client.create_run(experiment, run_name="score", tags={"journeys.stage": "score"})
            return cls(client, run.info.run_id)
        except Exception as err:  # tracking is optional; scoring must not fail on it
            _warn(f"not logging the scoring run to MLflow ({uri}): {_first_line(err)}")
            return None

    def log(self, result: ScoreResult) -> None:
        from mlflow.entities import Metric, Param

        try:
            now = int(time.time() * 1000)
            params = {
                "model_uri": result.model_uri,
                "model_version": result.model_version or "",
                "input": result.input,
                "rows": result.rows,
                "attention": result.attention,
                "out": str(result.out),
            }
            metrics = {
                "rows": result.rows,
                "seconds": result.seconds,
                "journeys_per_second": result.journeys_per_second,
            }
            self.client.log_batch(
                self.run_id,
                params=[Param(k, str(v)) for k, v in params.items()],
                metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()],
            )
            if result.ingest_report:
                self.client.log_dict(self.run_id, result.ingest_report, "ingest_report.json")
            if result.reports and result.reports.exists():
                self.client.log_artifacts(self.run_id, str(result.reports), "attribution")
        except Exception as err:
            _warn(f"logging the scoring run to MLflow failed: {_first_line(err)}")

    def finish(self, status: str) -> None:
        try:
            self.client.set_terminated(self.run_id, status)
        except Exception as err:
            _warn(f"could not close MLflow run {self.run_id}: {_first_line(err)}")


def read_metadata(scores: str | Path) -> dict[str, Any]:
    """The scoring facts stored in the first part file's Parquet metadata ({} if none)."""
    parts = _parquet_parts(Path(scores)) if Path(scores).is_dir() else [Path(scores)]
    if not parts:
        return {}
    try:
        raw = pl.read_parquet_metadata(parts[0]).get(METADATA_KEY)
        return json.loads(raw) if raw else {}
    except (pl.exceptions.PolarsError, OSError, json.JSONDecodeError):
        return {}


def _warn(message: str) -> None:
    print(f"journeys score: warning: {message}", file=sys.stderr)

"""Batch scoring: journeys (or a raw event log) -> Parquet scores with per-event attention.

`journeys score` (`score_command`) loads a logged model (`journeys.trained_model.load_model`:
JSON + safetensors, never pickle) and writes one row per input journey, censored ones
included, with the columns of the scores contract (`journeys.datasets.scores_schema`):

    journey_id, user_id, n_events, conversion_probability (float64, temperature-calibrated),
    events_probability (before an open journey's quiet-time adjustment), event_type,
    event_time, attention (list[float32], one per event, >= 0, sums to 1),
    <one list column per model feature>, open, quiet_seconds, as_of, model_uri,
    model_version, scored_at
    (+ label, censored, split, n_events_total when the input has them;
     + prefix_probability, the probability after each event, when the model is causal)

Journeys are scored as they stood at a moment, `as_of` (`journeys score --as-of`; default
the end of the data): later events are ignored, journeys that had not started are not
scored, and a journey not converted by then whose last event is within `journey.max_gap`
is `open`. An open journey's probability is that it converts from here on, given how
long it has been quiet (`journeys.in_flight`); a finished one's is the model's score.

Input is either a journeys dataset (a folder with `part-*.parquet` and `vocab.json`, as
`journeys ingest` writes it) or a raw event log (file, folder or glob). A raw log is
ingested into a temporary folder with the *model's* journey rules and scored with
the *model's* vocabularies: nothing is refitted, and an event type the model never saw maps
to the unknown token. A model keeps only its last `max_len` events, so the list columns of
a longer journey are cut to the events the model read and attention stays aligned with them.

Scoring scales out like ingest: the input's journeys, its part files read back to back, are
cut into equal chunks of at most `score.chunk_journeys`, and each chunk is scored on its own
(`ScoreChunk`) and written as one file per input part it holds (`segment_file`); the chunks
are mapped over workers: `journeys score` runs `orchestration.max_workers` local threads or
processes (`chunks_in_pool`), the score flow one Prefect task per chunk on the configured
task runner (thread, process, Dask). Chunks depend on the data alone, so the output is the
same file for file whichever runs them. (Chunks, not ingest's partitions: small partitions
would make small chunks, and a length-sorted chunk of 8k journeys pads its batches so much
more than one of 50k that scoring took 1.5x as long.)

Memory stays bounded however large the input: a worker holds one chunk at a time, scores
it in forward passes of `score.batch_size` (grouped by length, so little compute goes to
padding), writes it into a staging folder and frees it (peak: about one chunk per
worker). The staging folder is swapped in atomically when all are done: readers never see
half.

When the configured MLflow store exists (a server, or a SQLite file that is already there)
the scoring run is logged to it (params `model_uri`, `rows`, ...); scoring never creates a
store. The attribution report is a separate stage (`journeys.attribution`) that the command
line and the flows run after scoring; it reads the scores and logs into the same run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from journeys.config import redact_uri
from journeys.datasets import (
    CHUNK_KEY,
    EVENTS_PROBABILITY,
    OPTIONAL_COLUMNS,
    PART_FILE,
    REPORT_FILE,
    UTC_US,
    IngestReport,
    check_not_stale,
    chunk_facts,
    count_rows,
    input_schema,
    is_journeys_dataset,
    parquet_parts,
    read_rows,
    require_input,
    scores_metadata,
    scores_schema,
    scoring_columns,
)
from journeys.errors import ConfigError, InputError, first_line
from journeys.in_flight import cut_at, in_flight_probability, mark_open
from journeys.storage import atomic_dir, file_key, link_or_copy, scratch_dir
from journeys.tracking import (
    CHAMPION_ALIAS,
    STAGE_TAG,
    champion_version,
    mlflow_run,
    no_champion,
    tracking_ready,
)

if TYPE_CHECKING:
    import torch

    from journeys.config import Config
    from journeys.model import AttentionMode
    from journeys.tracking import TrackedRun
    from journeys.trained_model import TrainedModel


# ----------------------------------------------------------------------------- model side


def default_model_uri(config: Config) -> str:
    return f"models:/{config.mlflow.registered_model}@{CHAMPION_ALIAS}"


def score_frame(
    trained: TrainedModel,
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
    from journeys.inference import list_series, run_model
    from journeys.metrics import sigmoid

    max_len = trained.max_len
    features = trained.encoder.event_columns
    outputs = run_model(trained.model, trained.encode(frame), batch_size, attention, device)

    temperature = float(trained.temperature)
    probability = trained.probabilities(outputs.logits, frame)
    columns: list[pl.Series | pl.Expr] = [
        pl.col("journey_id").cast(pl.String),
        pl.col("user_id").cast(pl.String),
        pl.col("event_type").list.tail(max_len).list.len().cast(pl.Int32).alias("n_events"),
        pl.Series("conversion_probability", probability),
    ]
    if outputs.prefix_logits is not None:
        probabilities = sigmoid(outputs.prefix_logits, temperature)
        columns.append(list_series("prefix_probability", outputs.offsets, probabilities))
    columns += [pl.col(c).list.tail(max_len) for c in ("event_type", "event_time", *features)]
    if outputs.attention is not None:
        columns.append(list_series("attention", outputs.offsets, outputs.attention))
    columns += [
        pl.col(name).cast(dtype) for name, dtype in OPTIONAL_COLUMNS.items() if name in frame
    ]
    return frame.select(columns)


# ----------------------------------------------------------------------------- input side


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


# ----------------------------------------------------------------------------- scoring


@dataclass(frozen=True)
class Scored:
    """What `score_dataset` wrote: its rows, out of the input's journeys (the others had
    not started by `as_of`), how many of them are open, and the moment they stand at;
    how many rows an earlier run's scores gave unchanged, or why none."""

    rows: int
    journeys: int
    open: int
    as_of: datetime
    kept: int = 0
    why_not_kept: str | None = None


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
    ingest_report: IngestReport | None = None
    run_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    as_of: datetime | None = None  # the moment the journeys were scored as of
    open: int = 0  # journeys still open then
    not_started: int = 0  # input journeys that had no event by `as_of`: not scored
    kept: int = 0  # journeys whose earlier model output stands (their events did not change)
    why_not_kept: str | None = None
    trained: TrainedModel | None = field(default=None, repr=False)  # the model that scored

    @property
    def journeys_per_second(self) -> float:
        """Of the journeys scored now (not those whose earlier scores were kept)."""
        return (self.rows - self.kept) / self.seconds if self.seconds > 0 else float("nan")


@dataclass(frozen=True)
class ChunkScored:
    """What `ScoreChunk` did with one chunk: journeys read, rows written (the others had
    not started by `as_of`), and how many of those are open."""

    journeys: int
    rows: int
    open: int
    kept: int = 0  # rows whose earlier scores stand (`reused_rows`)


@dataclass(frozen=True, kw_only=True)
class ScoreChunk:
    """Scores one chunk of the input, `(first row, rows)` of its part files read back to
    back, into `staging`, a file per input part it holds (`segment_file`): the unit
    `score_dataset` maps over the workers. A plain picklable object, like ingest's
    `BuildPartition`, so a task runner can ship it to worker threads, processes or a Dask
    cluster (whose workers must see `paths()`: the input, `staging` and the earlier scores
    files it may keep rows of). `torch_threads`, when set, is the worker's PyTorch thread
    count."""

    trained: TrainedModel
    parts: list[Path]
    staging: Path
    columns: list[str]
    schema: pl.Schema
    as_of: datetime
    scored_at: datetime
    parquet_metadata: dict[str, str]
    attention: AttentionMode | None = "pooled"
    batch_size: int = 1024
    torch_threads: int | None = None
    held: tuple[list, ...] = ()  # each chunk's `segments`: what of which parts it holds
    reuse: tuple[Path, ...] = ()  # earlier files whose rows may stand (`ScoreState.others`)

    def paths(self) -> list[Path]:
        """The folders and files a worker reads and writes (it must see them here)."""
        parents = sorted({part.parent for part in self.parts})
        return [self.staging, *parents, *self.reuse]

    def __call__(self, index: int, chunk: tuple[int, int]) -> ChunkScored:
        from journeys.inference import pick_device

        # Never every core first: a thread worker would run its neighbour on them too.
        trained, device = self.trained, pick_device(self.torch_threads)
        trained.model.to(device)
        read = read_rows(self.parts, self.columns, *chunk)
        # Each input part's rows go to a file of their own: a later run keeps a part's
        # scores as long as that part is unchanged, whatever it was scored beside.
        held = self.held[index]
        read = read.with_columns(
            pl.Series(SEGMENT, np.repeat(np.arange(len(held)), [s[2] for s in held]), pl.Int32)
        )
        frame = mark_open(
            cut_at(read, self.as_of, trained.encoder.event_columns), self.as_of, trained.max_gap
        ).with_row_index(ROW)
        kept, frame = reused_rows(
            frame,
            self.reuse,
            self.schema,
            trained.encoder.event_columns,
            self.as_of,
            self.scored_at,
        )
        scored = score_frame(
            trained, frame, attention=self.attention, batch_size=self.batch_size, device=device
        ).with_columns(
            *frame.select("open", "quiet_seconds", SEGMENT, ROW),
            pl.col("conversion_probability").alias(EVENTS_PROBABILITY),
        )
        scored = scored.with_columns(
            pl.lit(self.as_of, UTC_US).alias("as_of"),
            pl.lit(trained.model_uri, pl.String).alias("model_uri"),
            pl.lit(trained.model_version, pl.String).alias("model_version"),
            pl.lit(self.scored_at, UTC_US).alias("scored_at"),
        ).select(*(pl.col(name).cast(dtype) for name, dtype in self.schema.items()), SEGMENT, ROW)
        scored = pl.concat([scored, kept]).sort(ROW)  # the input's order
        if trained.quiet_survival is not None:  # how long each open journey has been quiet now
            scored = in_flight_probability(scored, trained.quiet_survival)
        segment = scored.get_column(SEGMENT)
        scored = scored.drop(SEGMENT, ROW)
        done = ChunkScored(
            read.height, scored.height, int(scored.get_column("open").sum()), kept.height
        )
        last = pl.col("end_time") if "end_time" in read.columns else pl.col("event_time").list.max()
        latest = read.group_by(SEGMENT).agg(last.max()).rows_by_key(SEGMENT, unique=True)
        for i, piece in enumerate(held):
            rows = scored.filter(segment == i)
            facts = {
                "segments": [piece], "rows": rows.height,
                "open": int(rows.get_column("open").sum()),
                "latest": str(latest.get(i, (None,))[0] or self.as_of), "as_of": str(self.as_of),
                "model_uri": trained.model_uri, "model_version": trained.model_version,
                "attention": self.attention,
            }  # fmt: skip
            rows.write_parquet(
                self.staging / segment_file(piece, facts),
                metadata={**self.parquet_metadata, CHUNK_KEY: json.dumps(facts)},
            )
        del scored, frame, read
        release_freed_memory()
        return done


# Runs `ScoreChunk` over the chunks (score(index, chunk)), results in their order:
# in this process by default; `chunks_in_pool` for the CLI; the score flow maps them as
# Prefect tasks on the configured task runner.
MapChunks = Callable[[ScoreChunk, list[tuple[int, int]]], list[ChunkScored]]


def score_dataset(
    trained: TrainedModel,
    journeys_folder: str | Path,
    out: str | Path,
    *,
    batch_size: int = 1024,
    chunk_journeys: int = 50_000,
    attention: AttentionMode | None = "pooled",
    metadata: dict[str, Any] | None = None,
    progress: bool = True,
    as_of: datetime | None = None,
    map_chunks: MapChunks | None = None,
    keep_earlier: bool = True,
) -> Scored:
    """Score every journey of a journeys folder, as it stood at `as_of` (default: the end
    of the data), into Parquet parts under `out` (atomic). With `keep_earlier`, the files
    of an earlier scoring in `out` that still hold the right scores stay (`score_state`)
    and only the rest of the input is scored.

    The input is cut into chunks of `chunk_journeys`, each scored on its own
    (`ScoreChunk`); `map_chunks` spreads them over workers (default: one after the other,
    here, with a progress bar). The output is the same whichever map runs them.
    Rows are the input's journeys less those that had not started by `as_of`.
    `attention=None` skips the attention export (for benchmarks; the product always
    exports it). An empty input gives one empty part file with the full schema.
    """
    folder = Path(journeys_folder)
    parts = parquet_parts(folder)
    if not parts:
        raise InputError(f"no journeys (part-*.parquet) in {folder.absolute()}")
    features = trained.encoder.vocabs.features
    schema_in = input_schema(parts)
    columns = scoring_columns(schema_in, trained.encoder.event_columns, folder)
    optional = [name for name in OPTIONAL_COLUMNS if name in columns]
    if "end_time" in schema_in:  # when a conversion happened: was it by `as_of`?
        columns.append("end_time")
    as_of = as_of or data_end(folder, parts)
    schema = scores_schema(
        features, optional, bool(trained.model.config.causal), trained.encoder.numeric_features
    )
    if attention is None:
        schema = pl.Schema({k: v for k, v in schema.items() if k != "attention"})
    metadata = dict(metadata or {})
    scored_at = datetime.fromisoformat(metadata.get("scored_at") or _now()).astimezone(UTC)

    keys = [file_key(part) for part in parts]
    rows_of = dict(zip(keys, (count_rows([part]) for part in parts), strict=True))
    facts = {
        "model_uri": trained.model_uri,
        "model_version": trained.model_version,
        "attention": attention,
    }  # fmt: skip
    earlier = (
        score_state(Path(out), rows_of, facts, as_of, schema)
        if keep_earlier
        else ScoreState(why_not="asked to score everything")
    )
    todo = [(part, key) for part, key in zip(parts, keys, strict=True) if key not in earlier.parts]
    todo_rows = [rows_of[key] for _, key in todo]
    total = sum(todo_rows)
    chunks = chunk_bounds(total, chunk_journeys)
    held = tuple(segments(chunk, [key for _, key in todo], todo_rows) for chunk in chunks)
    with atomic_dir(out) as staging:
        for path in earlier.files:
            link_or_copy(path, staging / path.name)
        score = ScoreChunk(
            trained=trained,
            parts=[part for part, _ in todo],
            staging=staging,
            columns=columns,
            schema=schema,
            as_of=as_of,
            scored_at=scored_at,
            parquet_metadata=scores_metadata(metadata),
            attention=attention,
            batch_size=batch_size,
            held=held,
            reuse=tuple(earlier.others) if todo else (),
        )
        if map_chunks is None:
            with _progress(total, progress) as advance:
                results = []
                for index, chunk in enumerate(chunks):
                    results.append(score(index, chunk))
                    advance(results[-1].journeys)
        else:
            results = map_chunks(score, chunks)
        if not chunks and not earlier.files:
            # no rows at all: still a readable file with every column
            pl.DataFrame(schema=schema).write_parquet(
                staging / PART_FILE.format(0), metadata=score.parquet_metadata
            )
    return Scored(
        sum(r.rows for r in results) + earlier.rows,
        sum(r.journeys for r in results) + earlier.rows,
        sum(r.open for r in results),
        as_of,
        earlier.rows + sum(r.kept for r in results),
        earlier.why_not,
    )


SEGMENT = "_segment"  # a working column: which input part (piece) a row came from
ROW = "_row"  # ... and its place in the chunk

# ----------------------------------------------------------------------------- what changed
# A nightly run re-scores only what changed. Each scores file records which rows of which
# input part files it holds (a part is named by its name, size and modification time:
# ingest never rewrites a part in place), and the moment it was scored as of. A file is
# kept when its parts are unchanged, the model and the output columns are the same, none
# of its journeys was open, every event was in by its as_of and the new as_of is later:
# then a finished journey's score is what scoring afresh gives (only `as_of`,
# `quiet_seconds` and `scored_at` still tell when it was scored).


@dataclass(frozen=True)
class ScoreState:
    """What an earlier scoring left that this one keeps: its files still right, and why
    none when none is (scoring's counterpart of `journeys.ingest_state.IngestState`)."""

    files: list[Path] = field(default_factory=list)
    parts: frozenset[str] = frozenset()  # input parts they cover whole
    rows: int = 0  # journeys they hold
    why_not: str | None = None
    # Files of the same model and as_of no later, not kept whole: their finished
    # journeys' rows may still stand (`reused_rows` reads them).
    others: list[Path] = field(default_factory=list)


def score_state(
    out: Path, part_rows: dict[str, int], facts: dict[str, Any], as_of: datetime,
    schema: pl.Schema,
) -> ScoreState:  # fmt: skip
    """The files of an earlier scoring of `out` that still hold the right scores."""
    if not out.is_dir():
        return ScoreState(why_not="no earlier scores")
    candidates, usable, models, other_columns = {}, [], set(), False
    for path in parquet_parts(out):
        chunk = chunk_facts(path)
        if chunk is None:  # not a scores file of ours: scored afresh, and replaced
            continue
        model = (chunk["model_uri"], chunk["model_version"])
        models.add(model)
        same = all(chunk[name] == value for name, value in facts.items())
        earlier_as_of = datetime.fromisoformat(chunk["as_of"])
        columns_same = pl.read_parquet_schema(path) == schema
        other_columns |= same and not columns_same
        if not (same and as_of >= earlier_as_of and columns_same):
            continue
        usable.append(path)
        if chunk["open"] == 0 and datetime.fromisoformat(chunk["latest"]) <= earlier_as_of:
            candidates[path] = chunk
    # Keep a file only if every part it draws on is unchanged and covered whole by the
    # files kept; dropping one can uncover a part of another, so repeat until stable.
    while True:
        covered: dict[str, int] = {}
        for chunk in candidates.values():
            for key, _, rows in chunk["segments"]:
                covered[key] = covered.get(key, 0) + rows
        whole = {key for key, rows in covered.items() if part_rows.get(key) == rows}
        dropped = [
            p for p, c in candidates.items() if any(s[0] not in whole for s in c["segments"])
        ]
        if not dropped:
            break
        for path in dropped:
            del candidates[path]
    why = None
    if not candidates:
        now = f"{facts['model_uri']} v{facts['model_version']}"
        if models and (facts["model_uri"], facts["model_version"]) not in models:
            why = f"the model changed (now {now}): every journey re-scored"
        elif other_columns:
            why = (
                "the scores' columns changed (another version of journeys): every journey re-scored"
            )
        else:
            why = "nothing finished to keep"
    rows = sum(c["rows"] for c in candidates.values())
    others = [path for path in usable if path not in candidates]
    return ScoreState(sorted(candidates), frozenset(whole), rows, why, others)


def reused_rows(
    frame: pl.DataFrame,
    reuse: tuple[Path, ...],
    schema: pl.Schema,
    event_columns: list[str],
    as_of: datetime,
    scored_at: datetime,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(earlier rows kept, the journeys still to score) of a chunk: an earlier row stands
    for a journey whose events (as the model reads them) and length are the same. What
    the model made of its events stands, with the columns copied from the input now
    (split, label, ...) and whether it is open now; its `conversion_probability` is its
    `events_probability` until `in_flight_probability` adjusts an open one for its quiet
    time. A row open now or then is worked out as of now (`as_of`, `quiet_seconds`,
    `scored_at`); one finished then and now keeps those, which say when it was scored."""
    empty = pl.DataFrame(schema={**schema, SEGMENT: pl.Int32, ROW: pl.UInt32})
    if not reuse or frame.height == 0:
        return empty, frame
    lists = [c for c in ("event_type", "event_time", *event_columns) if c in schema]
    checked = [*lists, *(["n_events_total"] if "n_events_total" in schema else [])]
    earlier = (
        pl.scan_parquet(list(reuse))
        .filter(pl.col("journey_id").is_in(frame.get_column("journey_id").implode()))
        .collect()
    )
    if earlier.height == 0:
        return empty, frame
    now = frame.select("journey_id", *checked)
    same = now.join(earlier.select("journey_id", *checked), on="journey_id", suffix="_then")
    unchanged = pl.all_horizontal(
        pl.col(c).eq_missing(pl.col(f"{c}_then")) for c in checked
    )  # fmt: skip
    ids = same.filter(unchanged).get_column("journey_id")
    if ids.len() == 0:
        return empty, frame
    copied = [name for name in OPTIONAL_COLUMNS if name in schema and name in frame.columns]
    fresh = frame.filter(pl.col("journey_id").is_in(ids.implode()))
    now = fresh.select("journey_id", *copied, "open", "quiet_seconds", SEGMENT, ROW)
    as_of_now = pl.col("open") | pl.col("open_then")
    kept = (
        earlier.filter(pl.col("journey_id").is_in(ids.implode()))
        .drop(copied)
        .join(now, on="journey_id", suffix="_now")
        .rename({"open": "open_then", "open_now": "open"})
        .with_columns(
            conversion_probability=pl.col(EVENTS_PROBABILITY),
            quiet_seconds=pl.when(as_of_now).then("quiet_seconds_now").otherwise("quiet_seconds"),
            as_of=pl.when(as_of_now).then(pl.lit(as_of, UTC_US)).otherwise("as_of"),
            scored_at=pl.when(as_of_now).then(pl.lit(scored_at, UTC_US)).otherwise("scored_at"),
        )
        .select(*(pl.col(name).cast(dtype) for name, dtype in schema.items()), SEGMENT, ROW)
    )
    return kept, frame.filter(~pl.col("journey_id").is_in(ids.implode()))


def segments(chunk: tuple[int, int], keys: list[str], part_rows: list[int]) -> list[list]:
    """The `[part, first row in it, rows]` a chunk of the parts read back to back holds."""
    start, stop, seen, held = chunk[0], chunk[0] + chunk[1], 0, []
    for key, rows in zip(keys, part_rows, strict=True):
        low, high = max(start, seen), min(stop, seen + rows)
        if low < high:
            held.append([key, low - seen, high - low])
        seen += rows
    return held


def segment_file(piece: list, facts: dict[str, Any]) -> str:
    """A scores file's name from the rows it holds and how they were scored: the same work
    gives the same name, and a new file never takes the name of one kept."""
    text = json.dumps([piece, facts["model_uri"], facts["model_version"], facts["as_of"]])
    return f"part-{hashlib.blake2b(text.encode(), digest_size=8).hexdigest()}.parquet"


def chunk_bounds(total: int, most: int) -> list[tuple[int, int]]:
    """`(first row, rows)` of `total` rows cut into the fewest chunks of at most `most`
    rows, all the same size within one row: no small last chunk leaves a worker idle
    while another still scores a full one."""
    n = -(-total // most)
    edges = [total * i // n for i in range(n + 1)] if n else []
    return [(first, end - first) for first, end in itertools.pairwise(edges)]


def chunks_in_pool(task_runner: str, workers: int | None) -> MapChunks | None:
    """The CLI's map for `orchestration.task_runner` and `max_workers` (None: one per CPU
    core): a local pool of threads (`thread`) or processes (`process`), each worker with
    its share of the cores for PyTorch. None with one worker: scored in order, here.

    A Dask cluster is the score flow's (`journeys pipeline`, the deployments): asked for
    here, it is refused rather than replaced by local processes without a word."""
    if task_runner == "dask":
        raise ConfigError(
            "journeys score runs on this machine's threads or processes; a Dask cluster "
            "(orchestration.task_runner=dask) scores through the Prefect flows (journeys "
            "pipeline, journeys serve): add --set orchestration.task_runner=process here"
        )
    workers = workers or os.cpu_count() or 1
    if workers <= 1:
        return None

    def map_chunks(score: ScoreChunk, chunks: list[tuple[int, int]]) -> list[ChunkScored]:
        import multiprocessing
        from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor

        if len(chunks) <= 1:  # nothing to spread: no pool to start
            return [score(index, chunk) for index, chunk in enumerate(chunks)]
        n = min(workers, len(chunks))
        pool: Executor
        if task_runner == "thread":
            pool = ThreadPoolExecutor(n)
        else:  # spawned: a forked PyTorch may deadlock
            pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"))
        with shared_cores(score, n) as shared, pool:
            return list(pool.map(shared, range(len(chunks)), chunks))

    return map_chunks


@contextlib.contextmanager
def shared_cores(score: ScoreChunk, workers: int | None) -> Iterator[ScoreChunk]:
    """`score` for one of `workers` workers on this machine, each with its share of the
    cores for PyTorch (None: as it is; a Dask task takes its worker's). PyTorch's thread count
    is restored afterwards: thread workers set it for the whole process."""
    import torch

    threads = torch.get_num_threads()
    try:
        if workers is None:
            yield score
        else:
            share = max(1, (os.cpu_count() or 1) // max(1, workers))
            yield dataclasses.replace(score, torch_threads=share)
    finally:
        torch.set_num_threads(threads)


def data_end(folder: Path, parts: list[Path]) -> datetime:
    """The end of a journeys dataset's data: until when its ingest saw conversions
    (`data.observed_until`, else the last event), else its last journey's end."""
    report = IngestReport.read(folder)
    moment = report.outcomes_until if report is not None else None
    if moment is not None:
        return moment.astimezone(UTC)
    frame = pl.scan_parquet(parts)
    end = (
        pl.col("end_time")
        if "end_time" in frame.collect_schema()
        else pl.col("event_time").list.last()
    )
    last = frame.select(end.max()).collect().item()
    return last if last is not None else datetime.now(UTC)


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
    trained: TrainedModel,
    config: Config,
    input_path: str | Path,
    out: str | Path,
    *,
    attention: AttentionMode | None = None,
    metadata: dict[str, Any] | None = None,
    progress: bool = True,
    as_of: datetime | None = None,
    map_chunks: MapChunks | None = None,
) -> tuple[Scored, IngestReport | None]:
    """Score a journeys folder, or ingest a raw log with the model's settings and score it,
    as the journeys stood at `as_of` (default: the end of the data).

    `attention` None means `score.attention` from the configuration. Returns (what was
    scored, the ingest report when the input was a raw log). A raw log's quarantined rows
    go to `<out>-quarantine/` (`quarantine_beside`).
    """
    from journeys.ingest import run_ingest

    source = Path(input_path)
    settings = dict(
        batch_size=config.score.batch_size,
        chunk_journeys=config.score.chunk_journeys,
        attention=attention or config.score.attention,
        metadata=metadata,
        progress=progress,
        as_of=as_of,
        map_chunks=map_chunks,
    )
    if is_journeys_dataset(source):
        return score_dataset(trained, source, out, **settings), None
    require_input(input_path, "input", "pass a journeys folder or a raw event log")
    out = Path(out)
    ingest_config = trained.rules.ingest_config(config)
    with scratch_dir(out.parent, "score-ingest") as scratch:
        # The rows the log's ingest rejects are kept beside the scores, not lost.
        result = run_ingest(
            ingest_config,
            raw=str(input_path),
            journeys_folder=scratch / "journeys",
            quarantine_folder=quarantine_beside(out),
        )
        scored = score_dataset(trained, result.journeys_folder, out, **settings)
        return scored, result.report


def quarantine_beside(out: Path) -> Path:
    """Where scoring a raw log keeps the rows its ingest quarantined: `<out>-quarantine`."""
    return out.with_name(f"{out.name}-quarantine")


def parse_as_of(text: str | datetime | None, timezone: str) -> datetime | None:
    """`--as-of`: ISO 8601 (read in `timezone` without an offset), `now`, or None (the end
    of the data); anything else is an InputError naming the forms."""
    from journeys.events import as_utc

    if text is None or isinstance(text, datetime):
        return as_utc(text, timezone)
    if text.strip().lower() == "now":
        return datetime.now(UTC)
    try:
        return as_utc(datetime.fromisoformat(text.strip()), timezone)
    except ValueError:
        raise InputError(
            f"--as-of {text!r} is not a time: use ISO 8601 (2026-03-01T00:00:00Z, an offset, "
            f"or none for data.timezone) or now"
        ) from None


def score_command(
    config: Config,
    model_uri: str | None = None,
    input_path: str | Path | None = None,
    out: str | Path | None = None,
    as_of: str | datetime | None = None,
    map_chunks: MapChunks | None = None,
) -> ScoreResult:
    """`journeys score`: load the model, score, log the scoring run to MLflow.

    Defaults: model `models:/<mlflow.registered_model>@champion`, input `paths.journeys`,
    output `paths.scores`, `as_of` the end of the data, the input's part files spread over
    `orchestration.max_workers` local threads or processes (`chunks_in_pool`). A missing model or alias, an
    unreadable input, a bad `as_of` or columns that do not match the configuration raise
    `InputError` (the CLI prints one line, exit 2).
    """
    from journeys.tracking import tracking_uri
    from journeys.trained_model import load_model

    # MLflow's per-file download bars would drown the one progress bar that matters.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = model_uri or default_model_uri(config)
    store = tracking_uri(config)
    if uri.startswith(("models:/", "runs:/")) and not tracking_ready(store):
        raise InputError(
            f"model {uri} not found: no MLflow store at {redact_uri(store)} (train first)"
        )
    moment = parse_as_of(as_of, config.data.timezone)
    source = str(input_path or config.paths.journeys)
    if Path(source).is_dir():
        check_not_stale(source)  # before the model loads: a stopped ingest fails fast
    try:
        trained = load_model(uri, tracking_uri=store)
    except InputError:
        name = config.mlflow.registered_model
        if model_uri is None and champion_version(store, name) is None:
            raise no_champion(store, name) from None  # the guard's decision and its fix
        raise
    out = Path(out or config.paths.scores)
    attention = config.score.attention

    with mlflow_run(
        store, config.mlflow.experiment, name="score", tags={STAGE_TAG: "score"}, optional=True
    ) as run:
        metadata = {
            "model_uri": trained.model_uri,
            "model_version": trained.model_version,
            "attention": attention,
            "input": source,
            "scored_at": _now(),
            "run_id": run.run_id if run else None,
        }
        # journeys.encoding imports torch's data utilities (~1 s): import it before the
        # clock starts so the reported journeys/s measures scoring, not start-up.
        import journeys.encoding  # noqa: F401

        started = time.perf_counter()
        settings = config.orchestration
        scored, report = score_input(
            trained, config, source, out, attention=attention, metadata=metadata, as_of=moment,
            map_chunks=map_chunks or chunks_in_pool(settings.task_runner, settings.max_workers),
        )  # fmt: skip
        result = ScoreResult(
            out=out,
            rows=scored.rows,
            parts=len(parquet_parts(out)),
            model_uri=trained.model_uri,
            model_version=trained.model_version,
            attention=attention,
            seconds=time.perf_counter() - started,
            input=source,
            ingest_report=report,
            run_id=run.run_id if run else None,
            metadata=metadata,
            as_of=scored.as_of,
            open=scored.open,
            not_started=scored.journeys - scored.rows,
            kept=scored.kept,
            why_not_kept=scored.why_not_kept,
            trained=trained,
        )
        _print_summary(result)
        if result.open and trained.quiet_survival is None:
            _warn(
                f"{uri} was trained before open journeys could be scored: they are marked "
                "open but keep the model's score, not the chance that they convert from here "
                "on; retrain to score them"
            )
        if run:
            log_scoring(run, result)
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
    if result.kept:
        print(
            f"  {result.kept:,} journeys kept what the model made of them (their events did "
            f"not change; open ones adjusted for their quiet time); "
            f"{result.rows - result.kept:,} scored now"
        )
    elif result.why_not_kept and "re-scored" in result.why_not_kept:
        print(f"  {result.why_not_kept}")
    if result.as_of is not None:
        print(
            f"  as of {result.as_of:%Y-%m-%d %H:%M} UTC: {result.open:,} journeys open (scored "
            f"as the chance they convert from here on), {result.rows - result.open:,} finished"
            + (
                f"; {result.not_started:,} had not started and are not scored"
                if result.not_started
                else ""
            )
        )
    if result.ingest_report:
        report = result.ingest_report
        print(
            f"  ingested {report.rows_read:,} raw rows with the model's settings: "
            f"{report.quarantined_total:,} quarantined (in {quarantine_beside(result.out)}), "
            f"{report.duplicates_dropped:,} duplicates, "
            f"{report.dropped_by_config:,} dropped by config"
        )


# ----------------------------------------------------------------------------- MLflow


def log_scoring(run: TrackedRun, result: ScoreResult) -> None:
    """What the scoring run logs: where the scores came from and went, and how many. A
    store that fails here only warns: the scores are written."""
    try:
        run.log_params(
            {
                "model_uri": result.model_uri,
                "model_version": result.model_version or "",
                "input": result.input,
                "rows": result.rows,
                "attention": result.attention,
                "out": str(result.out),
                "as_of": result.as_of.isoformat() if result.as_of else "",
            }
        )
        run.log_metrics(
            {
                "rows": result.rows,
                "seconds": result.seconds,
                "journeys_per_second": result.journeys_per_second,
                "open_journeys": result.open,
                "journeys_not_started": result.not_started,
                "journeys_kept": result.kept,
            }
        )
        if result.ingest_report:
            run.log_dict(result.ingest_report.to_json(), REPORT_FILE)
    except Exception as err:
        _warn(f"logging the scoring run to MLflow failed: {first_line(err)}")


def _warn(message: str) -> None:
    print(f"journeys score: warning: {message}", file=sys.stderr)

"""The product's on-disk datasets: journeys (what ingest writes) and scores (what scoring
writes). One home for their file names, splits, schemas, scoring metadata and checks.

Both are folders of Parquet part files (`part-00000.parquet`, ...), so `pl.scan_parquet`
reads either whole. A journeys folder also holds `vocab.json` and `ingest_report.json`.
Scoring facts (model, run, input) ride in each scores part file's Parquet key-value
metadata, so the scores folder stays Parquet-only.

Light on purpose (Polars and pyarrow only): the command line, the flows and the checks
that run before training use it without importing torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from journeys.errors import InputError, first_line
from journeys.vocab import VOCAB_FILE, Vocabularies

if TYPE_CHECKING:
    from journeys.config import Config

PART_FILE = "part-{:05d}.parquet"
# Ingest's parts: finished journeys by their end day (written once, rewritten only when a
# split cut moves across that day), and the journeys still open (rewritten every run).
FINISHED_PART = "part-{day}-{run:05d}-{index:03d}.parquet"
OPEN_PART = "part-open-{run:05d}.parquet"
OPEN_PART_PREFIX = "part-open-"
SPLITS = ("train", "val", "test")
# A feature value that was not recorded, in every table and report: never merged with a
# real value.
MISSING_VALUE = "(none)"
NO_SPLIT = "none"  # censored (and near-end converted) journeys: scored, never trained on
UTC_US = pl.Datetime("us", "UTC")
REPORT_FILE = "ingest_report.json"
MONITOR_DIR = "monitor"  # under paths.reports: one folder a night, and the history
# Folders other stages keep inside `paths.reports`: the attribution report's swap carries
# them over, and its cache key leaves them out.
KEPT_BESIDE = (MONITOR_DIR,)
# Beside the journeys while the last ingest meant to refresh them has stopped: scoring them
# then would quietly score yesterday's journeys (`check_not_stale`).
FAILED_INGEST_FILE = "ingest_failed.json"
METADATA_KEY = "journeys.scoring"  # the scores' Parquet key-value metadata
CHUNK_KEY = "journeys.chunk"  # ... and per file: its input rows, open journeys, as_of
# Fewer conversions than this in val or test: the metrics are printed with a warning (their
# intervals are wide: at 30 positives a ROC AUC of 0.8 is known to about +-0.08).
MIN_EVALUATION_CONVERSIONS = 30
READ_BUFFER_BYTES = 1 << 20  # Parquet pages are streamed through a buffer of this size
READ_BATCH_ROWS = 8_192  # rows pyarrow decodes at a time when reading a chunk

# What training needs of a journeys dataset (features come from the configuration).
TRAINING_COLUMNS = ("journey_id", "label", "censored", "split", "event_type", "event_time")
# What scoring needs of its input journeys.
SCORING_COLUMNS = ("journey_id", "user_id", "event_type", "event_time")
# Columns scoring copies through when the input has them (and their output types).
OPTIONAL_COLUMNS: dict[str, pl.DataType] = {
    "label": pl.Int8(),
    "censored": pl.Boolean(),
    "split": pl.String(),
    "n_events_total": pl.Int32(),
}


def require_input(path: str | Path, what: str, hint: str) -> None:
    """Raise `InputError` naming the absolute path tried unless `path` exists (or is a
    glob). Commands call it before they take a lock or create any folder."""
    text = str(path)
    if not any(ch in text for ch in "*?[") and not Path(text).exists():
        raise InputError(f"{what} not found at {Path(text).absolute()}: {hint}")


def record_failed_ingest(folder: str | Path, error: BaseException) -> None:
    """Say beside the journeys (when there are any) that the ingest stopped, and why."""
    from journeys.config import redact_uri
    from journeys.storage import write_json

    folder = Path(folder)
    if folder.is_dir():
        stopped = {"at": datetime.now().astimezone().isoformat(timespec="seconds")}
        write_json(stopped | {"error": redact_uri(first_line(error))}, folder / FAILED_INGEST_FILE)


def clear_failed_ingest(folder: str | Path) -> None:
    (Path(folder) / FAILED_INGEST_FILE).unlink(missing_ok=True)


def check_not_stale(folder: str | Path) -> None:
    """Raise `InputError` when the last ingest into `folder` stopped: its journeys are
    those of the ingest before, and scores made from them would look current."""
    path = Path(folder) / FAILED_INGEST_FILE
    if not path.is_file():
        return
    stopped = json.loads(path.read_text())
    raise InputError(
        f"the last `journeys ingest` into {folder} stopped at {stopped['at']} "
        f"({stopped['error']}): these journeys are from the ingest before it; fix that and "
        "run `journeys ingest` again"
    )


def parquet_parts(folder: str | Path) -> list[Path]:
    return sorted(Path(folder).glob("part-*.parquet"))


# ----------------------------------------------------------------------------- journeys


def scan_journeys(path: str | Path) -> pl.LazyFrame:
    """Lazy scan of a journeys dataset: every `*.parquet` in the folder, or one file."""
    path = Path(path)
    if not path.exists():
        raise InputError(f"journeys not found at {path.absolute()}: run `journeys ingest` first")
    parts = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not parts:
        raise InputError(f"no journeys (*.parquet) in {path}: run `journeys ingest` first")
    return pl.scan_parquet(parts)


def read_journeys(folder: str | Path) -> pl.DataFrame:
    """The journeys dataset (all part files) as one frame."""
    return scan_journeys(folder).collect()


def labelled(journeys: pl.LazyFrame, splits: tuple[str, ...] = SPLITS) -> pl.LazyFrame:
    """The journeys of `splits` whose label is known (censored ones never are)."""
    return journeys.filter(~pl.col("censored") & pl.col("split").is_in(splits))


def is_journeys_dataset(path: str | Path) -> bool:
    """A folder of `part-*.parquet` with `vocab.json` beside them (as ingest writes it), or
    whose parts hold `event_type` as a list (journeys, not raw events), is a journeys
    dataset; anything else is read as a raw event log."""
    path = Path(path)
    parts = parquet_parts(path) if path.is_dir() else []
    if not parts:
        return False
    if (path / VOCAB_FILE).exists():
        return True
    try:
        return isinstance(pl.read_parquet_schema(parts[0]).get("event_type"), pl.List)
    except (pl.exceptions.PolarsError, OSError):
        return False  # unreadable: let the raw-log reader name the problem


def _iso(value: Any) -> str:
    return value.isoformat() if isinstance(value, datetime) else str(value)


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """What one ingest run did (the report's `ingest`): its mode, the files and rows it
    read (their accounting holds on its own) and the journeys it added, extended (more
    events) and closed."""

    mode: str  # full | incremental
    why: str
    run: int
    new_files: list[str] = field(default_factory=list)
    rows_read: int = 0
    rows_valid: int = 0
    quarantined_total: int = 0
    late: int = 0
    duplicates_dropped: int = 0
    dropped_by_config: int = 0
    journeys_added: int = 0
    journeys_extended: int = 0
    journeys_closed: int = 0
    journeys_open: int = 0


@dataclass(frozen=True, kw_only=True)
class IngestReport:
    """`ingest_report.json`, beside the journeys: what every ingest run so far read, kept,
    quarantined and built (`journeys.ingest_report.make_report` sums it from the manifest),
    what the last run did (`ingest`) and what looks wrong (`warnings`, each with its fix).

    Every stage reads it through `IngestReport.read`; the file holds `to_json()`. Always
    `rows_read == rows_valid + quarantined_total + duplicates_dropped + dropped_by_config`.
    """

    rows_read: int
    rows_valid: int
    quarantined: dict[str, int]  # reason -> rows
    quarantined_total: int
    duplicates_dropped: int
    dropped_by_config: int  # drop_events, exclude_users and after a conversion
    dropped_after_conversion: int = 0
    journeys: int
    journeys_converted: int
    journeys_censored: int
    journeys_by_split: dict[str, int]  # train, val, test and none
    # converted, but as recent as the censored ones: split none (ingest.unsplit_expr)
    journeys_converted_near_end: int = 0
    conversions_without_journey: int = 0
    repeat_conversions: int = 0  # conversions straight after a conversion of the same visit
    events_in_journeys: int = 0
    events_kept: int = 0  # within journey.max_events
    users: int = 0
    data_start: datetime | None = None  # the first valid event
    data_end: datetime | None = None  # the last valid event
    # Until when conversions were recorded: `data.observed_until`, else the last event.
    # Censoring counts from it, and so does an open journey's quiet time at scoring.
    observed_until: datetime | None = None
    partitions: int = 0
    # feature -> split -> share of the split's kept events holding a value
    feature_presence: dict[str, dict[str, float | None]] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    by_source: dict[str, dict[str, Any]] = field(default_factory=dict)
    max_gap: str | None = None  # journey.max_gap, as configured
    split_fractions: list[float] | None = None  # what the split was made with
    ingest: RunSummary | None = None  # what the last run did
    short_export: str | None = None  # most journeys unsplit: the fix train refuses with
    warnings: list[str] = field(default_factory=list)

    @property
    def outcomes_until(self) -> datetime | None:
        """Until when conversions were recorded (`observed_until`, else the last event)."""
        return self.observed_until or self.data_end

    def to_json(self) -> dict[str, Any]:
        return json.loads(json.dumps(asdict(self), default=_iso))

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> IngestReport:
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}  # an older report's extras
        for name in ("data_start", "data_end", "observed_until"):
            if values.get(name):
                values[name] = datetime.fromisoformat(str(values[name]))
        if isinstance(values.get("ingest"), dict):
            values["ingest"] = RunSummary(**values["ingest"])
        return cls(**values)

    @classmethod
    def read(cls, folder: str | Path) -> IngestReport | None:
        """The report beside the journeys in `folder`, or None when there is none."""
        path = Path(folder) / REPORT_FILE
        if not path.exists():
            return None
        return cls.from_json(json.loads(path.read_text()))


def training_journeys(folder: str | Path, window: timedelta | None = None) -> pl.LazyFrame:
    """The labelled journeys training reads; with `window` (`train.window`), those that
    ended within it of the data's end, so a weekly retrain over nightly ingests reads a
    bounded slice. The split stays the ingest's: the cuts are not moved into the window.

    In journey-id order, not the part files': a nightly ingest lays the same journeys out
    in other files than a full rebuild, and training must see them in the same order to
    give the same model and metrics with the same seed."""
    journeys = labelled(scan_journeys(folder)).sort("journey_id")
    if window is None:
        return journeys
    report = IngestReport.read(folder)
    if report is None or report.data_end is None:
        raise InputError(f"train.window needs the ingest report beside the journeys at {folder}")
    return journeys.filter(pl.col("end_time") >= report.data_end - window)


def split_sizes(folder: str | Path, window: timedelta | None = None) -> dict[str, dict[str, int]]:
    """{split: {"n": journeys, "positives": conversions}} over the labelled journeys (within
    `window` of the data's end, when given)."""
    counts = (
        training_journeys(folder, window)
        .group_by("split")
        .agg(n=pl.len(), positives=pl.col("label").cast(pl.Int64).sum())
        .collect()
    )
    sizes = {
        row["split"]: {"n": row["n"], "positives": row["positives"]}
        for row in counts.iter_rows(named=True)
    }
    return {split: sizes.get(split, {"n": 0, "positives": 0}) for split in SPLITS}


def small_evaluation_warning(split: str, size: dict[str, int]) -> str | None:
    """The warning for an evaluation split with too few conversions to mean much, or None."""
    if size["positives"] >= MIN_EVALUATION_CONVERSIONS:
        return None
    return (
        f"warning: the {split} split holds {size['positives']} conversions (of {size['n']:,} "
        f"journeys), fewer than {MIN_EVALUATION_CONVERSIONS}: its metrics mean little (see "
        "their intervals); more data or a larger split.fractions share"
    )


def check_trainable(
    folder: str | Path,
    features: list[str],
    fractions: tuple[float, ...] | None = None,
    window: timedelta | None = None,
) -> dict[str, dict[str, int]]:
    """Raise `InputError` unless the journeys dataset can be trained and evaluated on;
    return split sizes. Train, val and test each need both classes (a one-class val split
    would fit the temperature and pick the checkpoint on nothing; a one-class test split
    has no AUC to register the model by); few conversions are `evaluation_warnings`.

    Cheap (schema and one aggregation), so it runs before any data is put on tensors.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(
            f"journeys dataset not found at {folder.absolute()}: run `journeys ingest` first"
        )
    schema = scan_journeys(folder).collect_schema()
    vocabs = Vocabularies.load(folder)
    missing = [c for c in (*TRAINING_COLUMNS, *features) if c not in schema]
    if missing:
        raise InputError(f"journeys at {folder} lack column(s) {missing}: re-run `journeys ingest`")
    if vocabs.features != list(features):
        raise InputError(
            f"vocabularies at {folder} are for features {vocabs.features}, "
            f"but data.features is {list(features)}: re-run `journeys ingest`"
        )
    check_split_setting(folder, fractions)
    sizes = split_sizes(folder, window)
    unsplit = unsplit_problem(folder)
    if window is not None:
        unsplit = unsplit or f"a longer train.window (now {window}), or none"
    for split in SPLITS:
        if sizes[split]["n"] == 0:
            raise InputError(
                f"the {split} split of {folder} is empty: "
                + (unsplit or "more data or other split.fractions")
            )
    shares = "/".join(f"{f:g}" for f in fractions) if fractions else None
    for split in SPLITS:
        size = sizes[split]
        if size["positives"] in (0, size["n"]):
            fix = unsplit or (
                f"change split.fractions (now {shares}) or add data"
                if split != "train" and shares
                else "add data (or check data.conversion_events)"
            )
            raise InputError(
                f"the {split} split of {folder} has one class only ({size['positives']} "
                f"conversions of {size['n']:,} journeys): {fix}"
            )
    return sizes


def check_split_setting(folder: Path, fractions: tuple[float, ...] | None) -> None:
    """`InputError` when `split.fractions` differs from the shares the journeys were split
    with: the split is made at ingest, so a training-time setting would not act (and would
    be logged as if it had)."""
    report = IngestReport.read(folder) if fractions is not None else None
    split = report.split_fractions if report is not None else None
    if (
        fractions is None
        or split is None
        or all(abs(a - b) < 1e-9 for a, b in zip(split, fractions, strict=True))
    ):
        return
    shares = "/".join(f"{f:g}" for f in fractions)
    made = "/".join(f"{f:g}" for f in split)
    raise InputError(
        f"split.fractions is {shares} but the journeys at {folder} were split {made} at "
        f"ingest, and training does not re-split: run `journeys ingest --full --set "
        f"split.fractions=[{', '.join(f'{f:g}' for f in fractions)}]` first, or leave it out"
    )


def dataset_features(config: Config) -> Config:
    """`config` with the features its journeys were ingested with, when it does not set
    `data.features` (the defaults: ingest kept those the log has). Unchanged otherwise, or
    when there are no journeys yet."""
    from journeys.config import with_features

    folder = Path(config.paths.journeys)
    if config.data.features_given or not (folder / VOCAB_FILE).exists():
        return config
    return with_features(config, Vocabularies.load(folder).features)


def unsplit_problem(folder: str | Path) -> str | None:
    """The ingest's short-export warning (most journeys unsplit: `journey.max_gap` long
    against the data's span) when it gave one: the real fix for an empty or one-class
    split. None otherwise, or for journeys ingested before the warning existed."""
    report = IngestReport.read(folder)
    return report.short_export if report is not None else None


def evaluation_warnings(sizes: dict[str, dict[str, int]]) -> list[str]:
    """A warning for each of val and test with too few conversions to mean much."""
    warnings = (small_evaluation_warning(split, sizes[split]) for split in ("val", "test"))
    return [warning for warning in warnings if warning]


# ----------------------------------------------------------------------------- scores

EVENTS_PROBABILITY = "events_probability"


def scores_schema(
    features: list[str],
    optional: list[str] | tuple[str, ...] = (),
    causal: bool = False,
    numeric: list[str] | tuple[str, ...] = (),
) -> pl.Schema:
    """The scores' schema: contract columns, model features (and numeric features, the
    values the model read), present optional columns."""
    columns: dict[str, pl.DataType] = {
        "journey_id": pl.String(),
        "user_id": pl.String(),
        "n_events": pl.Int32(),
        "conversion_probability": pl.Float64(),
        # The model's probability from the events alone: an open journey's
        # conversion_probability is it adjusted for the time quiet since (`in_flight`).
        EVENTS_PROBABILITY: pl.Float64(),
    }
    if causal:
        columns["prefix_probability"] = pl.List(pl.Float64())
    columns |= {
        "event_type": pl.List(pl.String()),
        "event_time": pl.List(UTC_US),
        "attention": pl.List(pl.Float32()),
    }
    columns |= {name: pl.List(pl.String()) for name in features}
    columns |= {name: pl.List(pl.Float64()) for name in numeric}
    columns |= {name: dtype for name, dtype in OPTIONAL_COLUMNS.items() if name in optional}
    columns |= {"open": pl.Boolean(), "quiet_seconds": pl.Float64(), "as_of": UTC_US}
    columns |= {"model_uri": pl.String(), "model_version": pl.String(), "scored_at": UTC_US}
    return pl.Schema(columns)


def chunk_facts(part: Path) -> dict[str, Any] | None:
    """What a scores file holds (`CHUNK_KEY`: its input rows, open journeys, latest event,
    as_of), or None for a file written before scoring recorded it (or not ours)."""
    try:
        return json.loads(pl.read_parquet_metadata(part).get(CHUNK_KEY) or "null")
    except (pl.exceptions.PolarsError, OSError, ValueError):
        return None


def scores_as_of(path: str | Path) -> datetime | None:
    """The latest moment the scores in a folder were made as of (None: they do not say)."""
    if not Path(path).is_dir():
        return None
    moments = [f["as_of"] for p in parquet_parts(path) if (f := chunk_facts(p)) is not None]
    return datetime.fromisoformat(max(moments)) if moments else None


def scores_window_start(path: str | Path, window: timedelta | None) -> datetime | None:
    """Where a report over the last `window` of scores starts: `window` before the latest
    as_of the scores were made at (None: no window, or scores that do not say)."""
    as_of = scores_as_of(path) if window is not None else None
    return as_of - window if as_of is not None and window is not None else None


def scores_parts(path: Path, since: datetime | None = None) -> list[Path]:
    """The scores files under `path` (a folder of part files or one file) that hold a
    journey ending at or after `since` (their recorded latest event tells; at least one
    file, so an empty window still has the scores' schema)."""
    if path.is_dir():
        parts = sorted(path.glob("*.parquet"))
    elif path.exists():
        parts = [path]
    else:
        raise InputError(f"scores not found at {path.absolute()}: run `journeys score` first")
    if not parts:
        raise InputError(f"no scores (*.parquet) in {path}: run `journeys score` first")
    if since is None:
        return parts
    facts = {part: chunk_facts(part) for part in parts}
    recent = [
        p for p, f in facts.items() if f is None or datetime.fromisoformat(f["latest"]) >= since
    ]
    return recent or parts[:1]


def scan_scores(path: str | Path, since: datetime | None = None) -> pl.LazyFrame:
    """Scores written by `journeys score` (a folder of part files or one Parquet file);
    with `since`, only journeys whose last event is at or after it, and files whose
    recorded latest event is earlier are not opened at all (a report's cost then stays
    flat as the history grows)."""
    path = Path(path)
    parts = scores_parts(path, since)
    try:
        scores = pl.scan_parquet(parts)
        schema = scores.collect_schema()
    except (pl.exceptions.PolarsError, OSError) as err:
        raise InputError(f"cannot read scores at {path}: {first_line(err)}") from None
    missing = [c for c in ("journey_id", "event_type", "attention") if c not in schema]
    if missing:
        raise InputError(f"scores at {path} lack column(s) {missing}")
    if since is not None:
        scores = scores.filter(pl.col("event_time").list.last() >= since)
    return scores


def scores_metadata(metadata: dict[str, Any]) -> dict[str, str]:
    """The Parquet key-value metadata that carries the scoring facts."""
    return {METADATA_KEY: json.dumps(metadata, default=str)}


def read_metadata(scores: str | Path) -> dict[str, Any]:
    """The scoring facts stored in the first part file's Parquet metadata ({} if none)."""
    parts = parquet_parts(scores) if Path(scores).is_dir() else [Path(scores)]
    if not parts:
        return {}
    try:
        raw = pl.read_parquet_metadata(parts[0]).get(METADATA_KEY)
        return json.loads(raw) if raw else {}
    except (pl.exceptions.PolarsError, OSError, json.JSONDecodeError):
        return {}


# ----------------------------------------------------------------------------- reading parts


def input_schema(parts: list[Path]) -> pl.Schema:
    try:
        return pl.read_parquet_schema(parts[0])
    except (pl.exceptions.PolarsError, OSError) as err:
        raise InputError(f"cannot read {parts[0]}: {first_line(err)}") from None


def scoring_columns(schema: pl.Schema, features: list[str], where: str | Path) -> list[str]:
    """Raise InputError unless the journeys have what the model needs; return the columns
    to read (required, features, optional ones present)."""
    needed = [*SCORING_COLUMNS, *features]
    missing = [name for name in needed if name not in schema]
    if missing:
        raise InputError(
            f"journeys at {where} lack column(s) {missing} that the model needs "
            f"(model features: {features}); re-ingest with the model's data.features"
        )
    return [*needed, *[name for name in OPTIONAL_COLUMNS if name in schema]]


def count_rows(parts: list[Path]) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    total = 0
    for path in parts:
        try:
            total += pq.ParquetFile(path).metadata.num_rows
        except (pa.ArrowException, OSError) as err:
            raise InputError(f"cannot read {path}: {first_line(err)}") from None
    return total


def read_rows(parts: list[Path], columns: list[str], start: int, count: int) -> pl.DataFrame:
    """Rows `start` to `start + count` of the part files read back to back: one chunk of
    scoring. Only the row groups that hold them are read, and pyarrow streams those page by
    page (`buffer_size`, no pre-buffering), so even a huge row group is never decoded at
    once; rows before `start` in the first one are decoded and dropped batch by batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    stop = start + count
    seen = 0  # rows of the parts before the row group being looked at
    frames: list[pl.DataFrame] = []
    for path in parts:
        if seen >= stop:
            break
        try:
            reader = pq.ParquetFile(path, buffer_size=READ_BUFFER_BYTES, pre_buffer=False)
            groups, position = [], None  # the row groups to read; the first one's first row
            for group in range(reader.metadata.num_row_groups):
                rows = reader.metadata.row_group(group).num_rows
                if seen + rows > start and seen < stop:
                    position = seen if position is None else position
                    groups.append(group)
                seen += rows
            if position is None:
                continue
            # Small batches: the rows before `start` are decoded one batch at a time.
            size = min(count, READ_BATCH_ROWS)
            batches = reader.iter_batches(batch_size=size, row_groups=groups, columns=columns)
            for batch in batches:
                first, last = max(start - position, 0), min(stop - position, batch.num_rows)
                if last > first:
                    frames.append(pl.from_arrow(batch.slice(first, last - first)))  # type: ignore[arg-type]
                position += batch.num_rows
                if position >= stop:
                    break
        except (pa.ArrowException, OSError) as err:
            raise InputError(f"cannot read {path}: {first_line(err)}") from None
    return pl.concat(frames, how="vertical_relaxed", rechunk=False)

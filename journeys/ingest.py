"""Validated events -> labelled journeys, a temporal split and train-only vocabularies.

Stage two of the pipeline (`journeys ingest`). A user's time-ordered events split into
journeys after a gap longer than `journey.max_gap` or after a conversion event. The
conversion event labels its journey and is cut from the sequence, so the model never sees
the outcome it predicts.

The work runs in three passes so memory stays bounded by one partition, not the input:
1. `stage`: stream every row once, writing quarantined rows aside and valid rows into
   partitions by user hash (all of a user's events land in one partition);
2. `build_partition`: per partition, de-duplicate, sort, sessionise and label
   (independent, so partitions can run in parallel, e.g. as Prefect tasks);
3. `finish`: censoring and the time split need global facts (the data's end, the end-time
   cut points), vocabularies count the train split; then every output is swapped in
   atomically: readers see the previous complete output or the new one.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import polars as pl

from journeys.config import FLAG_TS, FROM_FLAG, SEQUENCE_COLUMN, Config, Data, with_features
from journeys.datasets import NO_SPLIT, PART_FILE, REPORT_FILE, SPLITS, UTC_US, read_journeys
from journeys.errors import InputError, first_line
from journeys.events import (
    REASON,
    REASONS,
    ROW,
    ROW_HASH,
    SOURCE,
    TS,
    as_utc,
    clean_events,
    format_that_reads,
    read_columns,
    scan_events,
    user_bucket,
)
from journeys.storage import atomic_dir, scratch_dir, write_json
from journeys.vocab import Vocabularies, Vocabulary

QUARANTINE_FILE = "quarantine.parquet"
UNSPLIT = "_unsplit"  # a working column: the journey takes no split (see unsplit_expr)
QUARANTINE_BUCKET = -1
BUCKET = "_bucket"
ROW_ORDER = "_order"
TOP_EVENT_TYPES = 5  # listed when no conversion event is found


def journey_id_expr(user: str = "user_id", start: str = "start_time") -> pl.Expr:
    """Deterministic id: the user and the first event's UTC instant in microseconds."""
    return pl.format("{}-{}", pl.col(user), pl.col(start).dt.epoch("us"))


def sort_events(events: pl.DataFrame, data: Data) -> pl.DataFrame:
    """Order by user and time; events that share a timestamp by `data.columns.sequence`
    when the log has one, then as the log holds them (file name, then row in the file),
    never by their content: a log's own order is the best record of what came first. A
    conversion from a flag column comes right after its touch."""
    order = [SEQUENCE_COLUMN] if data.sequence else []
    flag = [FROM_FLAG] if data.conversion_flag is not None else []
    return events.sort(["user_id", TS, *order, SOURCE, ROW, *flag], nulls_last=True)


@dataclass(frozen=True)
class Sessionised:
    journeys: pl.DataFrame
    orphan_conversions: int  # conversions with no event before them in their journey
    dropped_after_conversion: int  # with journey.after_conversion = drop


def build_journeys(events: pl.DataFrame, config: Config) -> Sessionised:
    """Sessionise sorted events into labelled journeys (censoring and split come later)."""
    features = config.data.event_columns
    max_gap = config.journey.max_gap_delta
    max_events = config.journey.max_events

    # Events are sorted by user then time, so plain shifts compare each event with the
    # previous one of the same user.
    new_user = (pl.col("user_id") != pl.col("user_id").shift(1)).fill_null(True)
    long_gap = (pl.col(TS).diff() > max_gap).fill_null(True)
    tagged = events.with_columns(
        _conversion=pl.col("event_type").is_in(config.data.conversions),
        _visit=(new_user | long_gap).cum_sum(),
    )
    dropped_after = 0
    if config.journey.after_conversion == "drop":
        # Drop what follows a conversion until the next long gap (e.g. a loan's back-office
        # steps after approval): such events belong to the converted journey's aftermath.
        seen = pl.col("_conversion").cast(pl.Int32).cum_sum().over("_visit", order_by=ROW_ORDER)
        after = (seen - pl.col("_conversion").cast(pl.Int32)) > 0
        flagged = tagged.with_row_index(ROW_ORDER).with_columns(_after=after)
        # Rows of the log only: a conversion made from a flag column is not one.
        input_rows = ~pl.col(FROM_FLAG) if FROM_FLAG in events.columns else pl.lit(True)
        dropped_after = flagged.filter(pl.col("_after") & input_rows).height
        tagged = flagged.filter(~pl.col("_after")).drop(ROW_ORDER, "_after")
    tagged = tagged.with_columns(
        _journey=(
            (pl.col("_visit") != pl.col("_visit").shift(1)).fill_null(True)
            | pl.col("_conversion").shift(1).fill_null(False)
        ).cum_sum()
    )

    in_sequence = ~pl.col("_conversion")
    sequence_columns = ["event_type", *features]
    grouped = tagged.group_by("_journey", maintain_order=True).agg(
        pl.col("user_id").first(),
        pl.col(TS).filter(in_sequence).first().alias("start_time"),
        pl.col(TS).last().alias("end_time"),
        in_sequence.sum().cast(pl.Int32).alias("n_events_total"),
        pl.col("_conversion").last().cast(pl.Int8).alias("label"),
        *[pl.col(name).filter(in_sequence).tail(max_events) for name in sequence_columns],
        pl.col(TS).filter(in_sequence).tail(max_events).alias("event_time"),
    )
    empty = grouped.filter(pl.col("n_events_total") == 0)
    journeys = grouped.filter(pl.col("n_events_total") > 0).drop("_journey")
    journeys = journeys.with_columns(
        journey_id_expr().alias("journey_id"),
        pl.col("event_type").list.len().cast(pl.Int32).alias("n_events"),
    )
    columns = [
        "journey_id", "user_id", "start_time", "end_time", "n_events", "n_events_total",
        "label", "event_type", "event_time", *features,
    ]  # fmt: skip
    # Already ordered by user, then start: the groups keep the sorted events' order.
    return Sessionised(journeys.select(columns), empty.height, dropped_after)


@dataclass(frozen=True)
class Staged:
    """Pass 1's output: partition folders of valid rows, quarantined rows, counts."""

    folder: Path
    partitions: list[Path]
    quarantine: list[Path]
    rows_read: int
    sources: list[str]
    quarantined: dict[str, int] = field(default_factory=dict)  # reason -> rows
    # source file -> {"rows": read, "quarantined": of them}
    by_source: dict[str, dict[str, int]] = field(default_factory=dict)
    features: list[str] = field(default_factory=list)  # data.features the log has
    features_left_out: list[str] = field(default_factory=list)  # default ones it lacks


# The passes' own files, read back once or twice and deleted: written for speed (lz4), not
# size. The journeys themselves: zstd at its fastest level, twice as fast to write as
# Polars' default level (3) for files 7% larger (10M events: 0.25 s against 0.51 s a part).
SCRATCH_COMPRESSION = "lz4"
OUTPUT_COMPRESSION, OUTPUT_COMPRESSION_LEVEL = "zstd", 1


def stage(config: Config, folder: Path, raw: str | Path | None = None) -> Staged:
    """Pass 1: read every row once (streaming) into user-hash partitions or quarantine."""
    scanned = scan_events(raw or config.paths.raw, config.data)
    rows, sources = scanned.rows, scanned.sources
    n = config.ingest.partitions
    key = pl.when(pl.col(REASON).is_null()).then(user_bucket(n)).otherwise(QUARANTINE_BUCKET)
    try:
        rows.with_columns(key.alias(BUCKET)).sink_parquet(
            pl.PartitionBy(folder, key=BUCKET, include_key=False),
            mkdir=True,
            compression=SCRATCH_COMPRESSION,
        )
    except (pl.exceptions.PolarsError, OSError) as err:
        raise InputError(f"cannot read {raw or config.paths.raw}: {first_line(err)}") from None
    buckets = {int(p.name.split("=", 1)[1]): p for p in folder.glob(f"{BUCKET}=*")}
    quarantine_dir = buckets.pop(QUARANTINE_BUCKET, None)
    quarantine = sorted(quarantine_dir.glob("*.parquet")) if quarantine_dir else []
    partitions = [buckets[k] for k in sorted(buckets)]
    files = [f for p in partitions for f in p.glob("*.parquet")] + quarantine
    rows_read = pl.scan_parquet(files).select(pl.len()).collect().item() if files else 0
    quarantined = dict.fromkeys(REASONS, 0)
    by_source = {source: {"rows": 0, "quarantined": 0} for source in sources}
    if files:
        per_source = (
            pl.scan_parquet(files)
            .group_by(SOURCE)
            .agg(rows=pl.len(), quarantined=pl.col(REASON).is_not_null().sum())
            .collect()
        )
        for row in per_source.iter_rows(named=True):
            by_source[row[SOURCE]] = {"rows": row["rows"], "quarantined": row["quarantined"]}
    if quarantine:
        counts = pl.scan_parquet(quarantine).group_by(REASON).len().collect()
        quarantined |= dict(counts.iter_rows())  # type: ignore[arg-type]
    left_out = [name for name in config.data.features if name not in scanned.features]
    return Staged(
        folder, partitions, quarantine, rows_read, sources, quarantined, by_source,
        scanned.features, left_out,
    )  # fmt: skip


@dataclass(frozen=True)
class PartitionResult:
    """Pass 2's output for one partition: journeys (no censoring/split yet) and counts."""

    path: Path
    rows_valid: int
    duplicates_dropped: int
    dropped_by_config: int
    dropped_after_conversion: int
    conversions_without_journey: int
    users: int
    data_start: datetime | None
    data_end: datetime | None
    conversions: int = 0  # conversion events among the valid rows
    event_map_matched: frozenset[str] = frozenset()  # data.event_map keys found in the rows
    conversions_by_source: dict[str, int] = field(default_factory=dict)
    top_user: tuple[str, int] | None = None  # the user with the most events, and how many
    events: int = 0  # events kept (after de-duplication and drops)


def build_partition(partition: Path | None, config: Config, out: Path) -> PartitionResult:
    """Pass 2: one partition's valid rows -> journeys written to `out` (None: no rows)."""
    if partition is None:
        rows = pl.DataFrame(schema=staged_schema(config))
    else:
        rows = pl.read_parquet(sorted(partition.glob("*.parquet")))
    clean = clean_events(rows.drop(REASON), config.data)
    conversions = config.data.conversions
    built = build_journeys(sort_events(clean.events, config.data), config)
    built.journeys.write_parquet(out, compression=SCRATCH_COMPRESSION)
    converting = clean.events.filter(pl.col("event_type").is_in(conversions))
    by_source = converting.group_by(SOURCE).len()
    # The log's own rows (not the conversions a flag column adds) for the skew warning.
    logged = clean.events
    if FROM_FLAG in logged.columns:
        logged = logged.filter(~pl.col(FROM_FLAG))
    per_user = logged.group_by("user_id").len().sort(["len", "user_id"], descending=[True, False])
    return PartitionResult(
        path=out,
        rows_valid=clean.rows_valid,
        duplicates_dropped=clean.duplicates_dropped,
        dropped_by_config=clean.dropped_by_config + built.dropped_after_conversion,
        dropped_after_conversion=built.dropped_after_conversion,
        conversions_without_journey=built.orphan_conversions,
        users=clean.events.get_column("user_id").n_unique(),
        data_start=clean.events.get_column(TS).min(),
        data_end=clean.data_end,
        conversions=converting.height,
        event_map_matched=clean.event_map_matched,
        conversions_by_source=dict(by_source.iter_rows()),  # type: ignore[arg-type]
        top_user=per_user.row(0) if per_user.height else None,  # type: ignore[arg-type]
        events=logged.height,
    )


def staged_schema(config: Config) -> dict[str, pl.DataType]:
    text = list(read_columns(config.data))  # numbers too: cast when cleaned
    flag_time = config.data.conversion_flag is not None and config.data.conversion_flag.time
    return {
        **dict.fromkeys(text, pl.String()),
        TS: UTC_US,
        SOURCE: pl.String(),
        ROW: pl.Int64(),
        **({ROW_HASH: pl.UInt32()} if config.data.dedupe == "all_columns" else {}),
        **({FLAG_TS: UTC_US} if flag_time else {}),
        REASON: pl.String(),
    }


def near_end_expr(data_end: datetime | None, max_gap: timedelta) -> pl.Expr:
    """The journey's last event (before any conversion) is within `max_gap` of the data's end."""
    if data_end is None:
        return pl.lit(False)
    return pl.lit(data_end) - pl.col("event_time").list.last() <= max_gap


def censored_expr(data_end: datetime | None, max_gap: timedelta) -> pl.Expr:
    """Unconverted and last seen within `max_gap` of the data's end: the label is not known."""
    return (pl.col("label") == 0) & near_end_expr(data_end, max_gap)


def unsplit_expr(
    data_end: datetime | None, max_gap: timedelta, exclude_recent_conversions: bool
) -> pl.Expr:
    """Journeys that take no split: the censored ones and, by default, their converted peers.

    Censoring keeps a late journey only if it converted, so keeping those converted
    journeys would raise the conversion rate of the latest split (test: 6.9% against a true
    4.0% on the simulator) and bias its calibration. Leaving out every journey whose last
    event is near the end, whatever its label, selects on the events only, never the label.
    """
    if exclude_recent_conversions:
        return near_end_expr(data_end, max_gap)
    return censored_expr(data_end, max_gap)


def split_expr(ends: pl.Series, fractions: tuple[float, float, float]) -> pl.Expr:
    """Split by journey end time: the earliest ends train, the latest test; `_unsplit` -> none.

    `ends` are the end times of the journeys that take a split. Cuts are placed at end-time
    values, so journeys ending at the same instant share a split and every train journey
    ends strictly before every val journey (and val before test).
    """
    ends = ends.sort()
    n = ends.len()
    if n == 0:
        return pl.lit(NO_SPLIT)
    val_cut = ends[min(int(n * fractions[0]), n - 1)]
    test_cut = ends[min(int(n * (fractions[0] + fractions[1])), n - 1)]
    if fractions[2] == 0:
        test_cut = None
    if fractions[1] == 0:
        val_cut = test_cut
    before_val = pl.lit(True) if val_cut is None else pl.col("end_time") < val_cut
    before_test = pl.lit(True) if test_cut is None else pl.col("end_time") < test_cut
    return (
        pl.when(pl.col(UNSPLIT))
        .then(pl.lit(NO_SPLIT))
        .when(before_val)
        .then(pl.lit("train"))
        .when(before_test)
        .then(pl.lit("val"))
        .otherwise(pl.lit("test"))
    )


def count_tokens(journeys: pl.LazyFrame, columns: list[str]) -> dict[str, pl.DataFrame]:
    """Token counts per sequence column (`token`, `count`)."""
    return {
        name: journeys.select(pl.col(name).explode().alias("token"))
        .group_by("token")
        .len(name="count")
        .collect(engine="streaming")
        for name in columns
    }


def build_vocabularies(journeys: pl.LazyFrame, config: Config) -> Vocabularies:
    """Token vocabularies from the train split's sequences only (nothing from val/test)."""
    train = journeys.filter(pl.col("split") == "train")
    counts = count_tokens(train, ["event_type", *config.data.features])
    by_column = {
        name: Vocabulary.from_counts(table, config.vocab.min_count)
        for name, table in counts.items()
    }
    return Vocabularies(by_column=by_column, min_count=config.vocab.min_count)


@dataclass(frozen=True)
class IngestResult:
    report: dict[str, Any]
    journeys_folder: Path
    quarantine_folder: Path
    vocabularies: Vocabularies = field(repr=False)

    @property
    def journeys(self) -> pl.DataFrame:
        return read_journeys(self.journeys_folder)

    @property
    def quarantine(self) -> pl.DataFrame:
        return pl.read_parquet(self.quarantine_folder / QUARANTINE_FILE)


def finish(
    config: Config,
    staged: Staged,
    parts: list[PartitionResult],
    journeys_folder: Path,
    quarantine_folder: Path,
) -> IngestResult:
    """Pass 3: censoring, split and vocabularies from global facts; write everything.

    Censoring counts from `data.observed_until` (the moment up to which conversions were
    recorded), by default the last event.
    """
    data_end = max((p.data_end for p in parts if p.data_end), default=None)
    observed_until = observation_end(config, data_end)
    max_gap = config.journey.max_gap_delta
    flags = [
        censored_expr(observed_until, max_gap).alias("censored"),
        unsplit_expr(observed_until, max_gap, config.split.exclude_recent_conversions).alias(
            UNSPLIT
        ),
    ]
    staged_journeys = pl.scan_parquet([p.path for p in parts]).with_columns(flags)
    require_conversions(config, parts, staged_journeys)
    warn_unmatched_event_map(config, parts)
    ends = staged_journeys.filter(~pl.col(UNSPLIT)).select("end_time").collect().to_series()
    split = split_expr(ends, config.split.fractions)
    labelled = staged_journeys.with_columns(split.alias("split"))
    vocabularies = build_vocabularies(labelled, config)
    summary = (
        labelled.group_by("split")
        .agg(
            pl.len().alias("journeys"),
            pl.col("label").sum().alias("converted"),
            pl.col("censored").sum().alias("censored"),
            (pl.col(UNSPLIT) & (pl.col("label") == 1)).sum().alias("converted_near_end"),
            pl.col("n_events_total").sum().alias("events"),
            pl.col("n_events").sum().alias("kept"),
        )
        .collect()
    )
    report = make_report(staged, parts, summary, data_end, observed_until)
    report["max_gap"] = config.journey.max_gap
    unsplit = report["journeys_by_split"][NO_SPLIT]
    short = report["journeys"] and unsplit / report["journeys"] > config.ingest.warn_unsplit_share
    # A short export, apart: `train` refuses an empty split with it (datasets.check_trainable).
    report["short_export"] = unsplit_warning(report) if short else None
    left_out = staged.features_left_out
    report["warnings"] = [
        *([report["short_export"]] if short else []),
        *report_warnings(config, report, parts),
        *(
            [f"the default features {left_out} are not in the log: ingested without them "
             "(data.features names the ones to use)"]
            if left_out else []
        ),
    ]  # fmt: skip

    columns = [*parts_columns(config)]
    write_quarantine(config, staged, quarantine_folder)
    with atomic_dir(journeys_folder) as folder:
        # One query for every part: Polars runs the sinks side by side (10M events: 3.1 s
        # against 4.5 s one after the other).
        sinks = [
            pl.scan_parquet(part.path)
            .with_columns(flags)
            .with_columns(split.alias("split"))
            .select(columns)
            .sink_parquet(
                folder / PART_FILE.format(index),
                compression=OUTPUT_COMPRESSION,
                compression_level=OUTPUT_COMPRESSION_LEVEL,
                lazy=True,
            )
            for index, part in enumerate(parts)
        ]
        pl.collect_all(sinks, engine="streaming")
        vocabularies.save(folder)
        write_json(report, folder / REPORT_FILE)
    return IngestResult(report, journeys_folder, quarantine_folder, vocabularies)


def write_quarantine(config: Config, staged: Staged, quarantine_folder: Path) -> None:
    """The quarantined rows with their original values, source, row number and reason."""
    with atomic_dir(quarantine_folder) as folder:
        schema = staged_schema(config)
        quarantine = (
            pl.scan_parquet(staged.quarantine) if staged.quarantine else pl.LazyFrame(schema=schema)
        )
        kept = [name for name in schema if name not in (TS, ROW_HASH, FLAG_TS)]
        quarantine.select(*kept).sink_parquet(folder / QUARANTINE_FILE)


# ----------------------------------------------------------------------------- guards
# Results a user could mistake for real ones are refused with one line naming the fix.

TIMESTAMP_FIX = (
    "check data.timestamp_unit (now {unit}; auto infers s/ms/us/ns), data.timezone and "
    "data.columns.timestamp"
)
FIXES = {
    "missing_user_id": "check data.columns.user_id (and data.header, data.separator)",
    "missing_event_type": "check data.columns.event_type (and data.header, data.separator)",
    "bad_timestamp": TIMESTAMP_FIX,
    "implausible_timestamp": TIMESTAMP_FIX + " (or data.plausible_from)",
    "out_of_range": "check data.valid_from and data.valid_until",
    "bad_numeric": "check data.numeric_features and data.columns (an empty value is missing)",
}


def check_quarantine(config: Config, staged: Staged, quarantine_folder: Path) -> None:
    """Stop (InputError) when more than `ingest.max_quarantined_share` of the rows read
    were quarantined: the configuration, not the data, is almost surely wrong. The
    quarantine is written first so the user can look; the journeys stay as they were."""
    total = sum(staged.quarantined.values())
    if total == 0 or total / staged.rows_read <= config.ingest.max_quarantined_share:
        return
    share = total / staged.rows_read
    write_quarantine(config, staged, quarantine_folder)
    reason = max(staged.quarantined, key=staged.quarantined.__getitem__)
    parsed = (
        pl.scan_parquet(staged.quarantine)
        .filter(pl.col(REASON) == reason)
        .select(low=pl.col(TS).min(), high=pl.col(TS).max())
    )
    low, high = parsed.collect().row(0)
    seen = f" (timestamps parsed to {low:%Y-%m-%d} .. {high:%Y-%m-%d})" if low else ""
    fix = FIXES.get(reason, "check data.columns").format(unit=config.data.timestamp_unit)
    if reason == "bad_timestamp":
        fix = timestamp_fix(config, staged) or fix
    raise InputError(
        f"{total:,} of {staged.rows_read:,} rows ({share:.0%}) were quarantined, most as "
        f"{reason}{seen}: {fix}; the quarantine is in {quarantine_folder}, the journeys "
        f"are unchanged (ingest.max_quarantined_share {config.ingest.max_quarantined_share})"
    )


def timestamp_fix(config: Config, staged: Staged) -> str | None:
    """For timestamps that did not parse: a sample value and the setting that reads it."""
    sample = (
        pl.scan_parquet(staged.quarantine)
        .filter((pl.col(REASON) == "bad_timestamp") & pl.col("timestamp").is_not_null())
        .select(pl.col("timestamp").str.strip_chars())
        .head(1)
        .collect()
    )
    if sample.height == 0:
        return None
    value = sample.item()
    if pl.Series([value]).cast(pl.Float64, strict=False).null_count() == 0:
        setting = "data.timestamp_unit: auto (epoch numbers: s, ms, us or ns)"
    elif layout := format_that_reads(value):
        setting = f"data.timestamp_format: '{layout}'"
    else:
        setting = "data.timestamp_format (strftime, e.g. '%d/%m/%Y %H:%M') or data.timestamp_unit"
    now = (
        f" (now {config.data.timestamp_format!r})"
        if config.data.timestamp_format
        else f" (now timestamp_unit {config.data.timestamp_unit})"
        if config.data.timestamp_unit
        else " (ISO 8601 is read by default)"
    )
    return f"a value such as {value!r} reads with {setting}{now}; check data.columns.timestamp too"


def warn_unmatched_event_map(config: Config, parts: list[PartitionResult]) -> None:
    """A `data.event_map` key that matches no event type is probably misspelt: warn."""
    seen = frozenset().union(*(p.event_map_matched for p in parts))
    unmatched = sorted(set(config.data.event_map) - seen)
    if unmatched:
        print(
            f"journeys ingest: warning: data.event_map keys {unmatched} match no event type",
            file=sys.stderr,
        )


def require_conversions(
    config: Config, parts: list[PartitionResult], journeys: pl.LazyFrame
) -> None:
    """Stop (InputError) when no row is a conversion: every label would be 0, and only
    training, much later, would complain (`ingest.require_conversions: false` to score)."""
    if not config.ingest.require_conversions or any(p.conversions for p in parts):
        return
    if not any(p.rows_valid for p in parts):
        return
    top = (
        journeys.select(pl.col("event_type").explode())
        .group_by("event_type")
        .len()
        .sort(["len", "event_type"], descending=[True, False])
        .head(TOP_EVENT_TYPES)
        .collect()
    )
    listed = ", ".join(f"{name} ({count:,})" for name, count in top.iter_rows())
    raise InputError(
        f"no row matches data.conversion_events {list(config.data.conversion_events)}; the "
        f"most frequent event types (after data.event_map) are: {listed}"
    )


def observation_end(config: Config, data_end: datetime | None) -> datetime | None:
    """Where censoring counts from: `data.observed_until`, else the last event."""
    observed = as_utc(config.data.observed_until, config.data.timezone)
    if observed is None:
        return data_end
    if data_end is not None and observed < data_end:
        raise InputError(
            f"data.observed_until ({observed:%Y-%m-%d %H:%M}) is before the last event "
            f"({data_end:%Y-%m-%d %H:%M}): conversions cannot be recorded for less time than "
            "the log covers; set it at or after the last event, or leave it null"
        )
    return observed


def parts_columns(config: Config) -> list[str]:
    return [
        "journey_id", "user_id", "start_time", "end_time", "n_events", "n_events_total",
        "label", "censored", "split", "event_type", "event_time", *config.data.event_columns,
    ]  # fmt: skip


def make_report(
    staged: Staged,
    parts: list[PartitionResult],
    summary: pl.DataFrame,
    data_end: datetime | None,
    observed_until: datetime | None,
) -> dict[str, Any]:
    """The ingest report; checks the row-accounting invariant before anything is written."""
    quarantined = staged.quarantined
    totals = {name: sum(getattr(p, name) for p in parts) for name in (
        "rows_valid", "duplicates_dropped", "dropped_by_config", "dropped_after_conversion",
        "conversions_without_journey", "users",
    )}  # fmt: skip
    by_split = dict.fromkeys([*SPLITS, NO_SPLIT], 0)
    for row in summary.iter_rows(named=True):
        by_split[row["split"]] = row["journeys"]
    rows_valid = totals["rows_valid"] - totals["duplicates_dropped"] - totals["dropped_by_config"]
    report = {
        "rows_read": staged.rows_read,
        "rows_valid": rows_valid,
        "quarantined": quarantined,
        "quarantined_total": sum(quarantined.values()),
        "duplicates_dropped": totals["duplicates_dropped"],
        "dropped_by_config": totals["dropped_by_config"],
        "dropped_after_conversion": totals["dropped_after_conversion"],
        "journeys": int(summary.get_column("journeys").sum()),
        "journeys_converted": int(summary.get_column("converted").sum()),
        "journeys_censored": int(summary.get_column("censored").sum()),
        "journeys_by_split": by_split,
        # converted, but as recent as the censored ones: split none (split_expr's docstring)
        "journeys_converted_near_end": int(summary.get_column("converted_near_end").sum()),
        "conversions_without_journey": totals["conversions_without_journey"],
        "events_in_journeys": int(summary.get_column("events").sum()),
        "events_kept": int(summary.get_column("kept").sum()),
        "users": totals["users"],
        "data_start": min((p.data_start for p in parts if p.data_start), default=None),
        "data_end": data_end,
        "observed_until": observed_until,  # conversions seen until: where censoring counts from
        "partitions": len(parts),
        "sources": staged.sources,
        "by_source": {
            source: counts
            | {"conversions": sum(p.conversions_by_source.get(source, 0) for p in parts)}
            for source, counts in staged.by_source.items()
        },
    }
    accounted = (
        report["rows_valid"]
        + report["quarantined_total"]
        + report["duplicates_dropped"]
        + report["dropped_by_config"]
    )
    if report["rows_read"] != accounted:
        raise AssertionError(f"row accounting broken: {report}")  # a bug, never bad input
    return json.loads(json.dumps(report, default=str))


def report_warnings(
    config: Config, report: dict[str, Any], parts: list[PartitionResult]
) -> list[str]:
    """What looks wrong in a log though no row is, each with its figures and its fix (the
    short export apart: `unsplit_warning`)."""
    settings, warnings = config.ingest, []
    conversions = sum(p.conversions for p in parts)
    orphans = report["conversions_without_journey"]
    if conversions and orphans / conversions > settings.warn_orphan_conversion_share:
        warnings.append(
            f"{orphans:,} of {conversions:,} conversions ({orphans / conversions:.0%}) label "
            "no journey (no event of the user before them in their journey): check that "
            "the touches and the conversions share data.columns.user_id, or shorten "
            "journey.max_gap if they come long after the touches"
        )
    events = sum(p.events for p in parts)
    tops = [p.top_user for p in parts if p.top_user]
    if events and tops and report["users"] >= MIN_USERS_FOR_SKEW:
        user, count = max(tops, key=lambda top: top[1])
        if count / events > settings.warn_top_user_share:
            warnings.append(
                f"user id {user!r} holds {count:,} of {events:,} events ({count / events:.0%}): "
                "a placeholder for unknown users? list it in data.exclude_users (its rows are "
                "then dropped and counted)"
            )
    warnings += source_quarantine_warnings(
        report["by_source"], settings.warn_source_quarantine_factor
    )
    return warnings


# With fewer users than this, one user holding many events is no sign of a placeholder.
MIN_USERS_FOR_SKEW = 20
# A file's quarantine rate below this never warns, however far above the others it is.
MIN_WARNED_QUARANTINE_RATE = 0.05


def source_quarantine_warnings(by_source: dict[str, dict[str, int]], factor: float) -> list[str]:
    """A warning per source file whose quarantine rate is `factor` times the others'."""
    warnings = []
    for source, counts in by_source.items():
        rows, quarantined = counts["rows"], counts["quarantined"]
        other_rows = sum(c["rows"] for s, c in by_source.items() if s != source)
        if not rows or not other_rows:
            continue
        rate = quarantined / rows
        others = sum(c["quarantined"] for s, c in by_source.items() if s != source) / other_rows
        if rate >= MIN_WARNED_QUARANTINE_RATE and rate > factor * others:
            warnings.append(
                f"{source}: {quarantined:,} of {rows:,} rows ({rate:.0%}) quarantined, against "
                f"{others:.1%} in the other files: a changed header or format? see the "
                "quarantine's reasons for that file (data.columns takes a list of names)"
            )
    return warnings


def unsplit_warning(report: dict[str, Any]) -> str:
    """Most journeys end too near the data's end to be labelled: the log is short against
    `journey.max_gap`. The same line `train` refuses with."""
    journeys, unsplit = report["journeys"], report["journeys_by_split"][NO_SPLIT]
    span = "?"
    if report.get("data_start") and report.get("data_end"):
        start = datetime.fromisoformat(str(report["data_start"]))
        end = datetime.fromisoformat(str(report["data_end"]))
        span = f"{(end - start).total_seconds() / 86400:.1f} days"
    return (
        f"{unsplit:,} of {journeys:,} journeys ({unsplit / journeys:.0%}) take no split: they "
        f"end within journey.max_gap ({report.get('max_gap', '?')}) of the data's end, and the "
        f"log spans {span}; lower journey.max_gap (a session log: 30m to 1d), or set "
        "data.observed_until if the outcomes are known to a later moment"
    )


PartitionBuilder = Callable[[Path | None], PartitionResult]
# Runs the builder over the partitions, results in the partitions' order.
MapPartitions = Callable[[PartitionBuilder, list[Path | None]], list[PartitionResult]]


@dataclass(frozen=True)
class BuildPartition:
    """Pass 2 for one partition, its output named by the partition's position.

    A plain picklable object, so a task runner can ship it to worker processes.
    """

    config: Config
    outputs: dict[Path | None, Path]

    def __call__(self, partition: Path | None) -> PartitionResult:
        return build_partition(partition, self.config, self.outputs[partition])


def map_in_order(build: PartitionBuilder, partitions: list[Path | None]) -> list[PartitionResult]:
    """The default `map_partitions`: one partition after the other, in this process."""
    return [build(partition) for partition in partitions]


def run_ingest(
    config: Config,
    raw: str | Path | None = None,
    journeys_folder: str | Path | None = None,
    quarantine_folder: str | Path | None = None,
    map_partitions: MapPartitions | None = None,
) -> IngestResult:
    """`journeys ingest` as a function: all three passes, outputs written atomically.

    `map_partitions(build, partitions)` runs pass 2 (default `map_in_order`); the flow
    maps `build` over the partitions as tasks on its task runner. The result does not
    depend on how, as long as the results come back in the partitions' order.
    """
    journeys_folder = Path(journeys_folder or config.paths.journeys)
    quarantine_folder = Path(quarantine_folder or config.paths.quarantine)
    with scratch_dir(journeys_folder.parent, "ingest") as scratch:
        staged = stage(config, scratch / "staged", raw)
        if staged.features != config.data.features:  # default features the log lacks
            config = with_features(config, staged.features)
        check_quarantine(config, staged, quarantine_folder)
        built = scratch / "built"
        built.mkdir()
        partitions: list[Path | None] = list(staged.partitions) or [None]
        outputs = {p: built / PART_FILE.format(i) for i, p in enumerate(partitions)}
        parts = (map_partitions or map_in_order)(BuildPartition(config, outputs), partitions)
        if len(parts) != len(partitions):
            raise AssertionError(f"{len(parts)} results for {len(partitions)} partitions")
        return finish(config, staged, parts, journeys_folder, quarantine_folder)


def ingest(config: Config) -> dict[str, Any]:
    """`journeys ingest`: returns the report (also written beside the journeys)."""
    return run_ingest(config).report


def print_report(report: dict[str, Any]) -> None:
    """The ingest report as a readable table."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="ingest report", show_header=False)
    table.add_column("what")
    table.add_column("count", justify="right")
    for key in ("rows_read", "rows_valid", "quarantined_total"):
        table.add_row(key, f"{report[key]:,}")
    for reason, count in report["quarantined"].items():
        table.add_row(f"  {reason}", f"{count:,}")
    for key in ("duplicates_dropped", "dropped_by_config", "users", "journeys"):
        table.add_row(key, f"{report[key]:,}")
    for key in ("journeys_converted", "journeys_censored", "conversions_without_journey"):
        table.add_row(f"  {key.removeprefix('journeys_')}", f"{report[key]:,}")
    for split, count in report["journeys_by_split"].items():
        table.add_row(f"  split {split}", f"{count:,}")
    table.add_row("data range", f"{report['data_start']} .. {report['data_end']}")
    Console().print(table)
    for warning in report.get("warnings", []):
        print(f"journeys ingest: warning: {warning}", file=sys.stderr)

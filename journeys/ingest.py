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

Nightly runs are incremental (docs/nightly.md): with an earlier ingest of the same
configuration in the folder (`journeys.manifest`), pass 1 reads only the raw files not
seen yet, pass 2 rebuilds each partition's open visits (their rows kept in `_state/`) with
the new rows, and pass 3 writes the journeys that closed into files by end day, leaving
the finished ones as they are. A full build is the same passes from an empty state.
The guards and warnings are in `journeys.ingest_checks`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import polars as pl

from journeys.config import (
    FLAG_TS,
    FROM_FLAG,
    SEQUENCE_COLUMN,
    Config,
    Data,
    with_features,
    without_secrets,
)
from journeys.datasets import (
    FINISHED_PART,
    NO_SPLIT,
    OPEN_PART,
    OPEN_PART_PREFIX,
    REPORT_FILE,
    SPLITS,
    UTC_US,
    clear_failed_ingest,
    read_journeys,
    record_failed_ingest,
)
from journeys.errors import InputError, first_line
from journeys.events import (
    REASON,
    REASONS,
    ROW,
    ROW_HASH,
    SOURCE,
    TS,
    CleanEvents,
    as_utc,
    clean_events,
    read_columns,
    resolve_sources,
    scan_events,
    user_bucket,
)
from journeys.ingest_checks import (
    add_warnings,
    quarantine_problem,
    require_conversions,
    warn_unmatched_event_map,
)
from journeys.manifest import (
    STATE_DIR,
    Manifest,
    config_key,
    file_key,
    fingerprints_meanwhile,
    load_manifest,
    new_sources,
)
from journeys.storage import (
    atomic_dir,
    atomic_path,
    link_or_copy,
    restore_interrupted_swap,
    scratch_dir,
    write_json,
)
from journeys.vocab import Vocabularies, Vocabulary

QUARANTINE_FILE = "quarantine.parquet"  # the full build's; a nightly run adds its own:
NIGHTLY_QUARANTINE_FILE = "quarantine-{:05d}.parquet"
UNSPLIT = "_unsplit"  # a working column: the journey takes no split (see unsplit_expr)
QUARANTINE_BUCKET = -1
BUCKET = "_bucket"
ROW_ORDER = "_order"


def journey_id_expr(user: str = "user_id", start: str = "start_time") -> pl.Expr:
    """Deterministic id: the user and the first event's UTC instant in microseconds, and
    where one user has several journeys starting at that instant (a log stamped to the
    second or the hour, a conversion straight after a conversion), the later ones' place
    among them: `u1-1772442000000000`, then `u1-1772442000000000-1`.

    Journeys must be ordered by user, then start, then event order, as `build_journeys`
    makes them (all journeys starting at one instant lie in one visit, which every build
    reads whole): the place is counted along neighbours, which costs a shift where a
    window over (user, start) cost 20 times as much.
    """
    same = (pl.col(user) == pl.col(user).shift(1)) & (pl.col(start) == pl.col(start).shift(1))
    row = pl.int_range(pl.len())
    place = row - pl.when(~same.fill_null(False)).then(row).forward_fill()
    base = pl.format("{}-{}", pl.col(user), pl.col(start).dt.epoch("us"))
    return pl.concat_str(
        [base, pl.when(place > 0).then(pl.format("-{}", place))], ignore_nulls=True
    )


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
    journeys: pl.DataFrame  # with VISIT_END: when the journey's visit ended
    open_from: pl.DataFrame  # user_id, OPEN_FROM: where each user's open visits start
    orphans_settled: int  # conversions with no event before them, in closed visits
    orphans_open: int  # ... in open visits (counted again by the next run)
    repeats_settled: int  # conversions straight after a conversion, in closed visits
    repeats_open: int
    dropped_after_settled: int  # with journey.after_conversion = drop, in closed visits
    dropped_after_open: int


VISIT_END = "_visit_end"
OPEN_FROM = "_open_from"


def build_journeys(
    events: pl.DataFrame, config: Config, horizon: datetime | None = None
) -> Sessionised:
    """Sessionise sorted events into labelled journeys (censoring and split come later).

    A visit is a user's run of events with no gap longer than `journey.max_gap`; journeys
    never cross one. A visit whose last event is at or after `horizon` is open: an event
    still to come can change it (`closing_horizon`), so its events are kept for the next
    nightly run and the counts made from it are provisional.
    """
    features = config.data.event_columns
    max_gap = config.journey.max_gap_delta
    max_events = config.journey.max_events

    # Events are sorted by user then time, so plain shifts compare each event with the
    # previous one of the same user.
    new_user = (pl.col("user_id") != pl.col("user_id").shift(1)).fill_null(True)
    long_gap = (pl.col(TS).diff() > max_gap).fill_null(True)
    conversion = pl.col("event_type").is_in(config.data.conversions)
    tagged = events.with_columns(
        _conversion=conversion,
        _end=pl.col("event_type").is_in(config.data.end_events),
        _visit=(new_user | long_gap).cum_sum(),
    ).with_columns(
        pl.col(TS).max().over("_visit").alias(VISIT_END),
        # A conversion straight after another of the same visit: a repeat purchase, a
        # second clickout (`journey.repeat_conversions` says what it is).
        _repeat=conversion
        & conversion.shift(1).fill_null(False)
        & (pl.col("_visit") == pl.col("_visit").shift(1)),
    )
    if config.journey.repeat_conversions == "new_journey":  # the next journey's first touch
        tagged = tagged.with_columns(_conversion=pl.col("_conversion") & ~pl.col("_repeat"))
    in_open_visit = pl.col(VISIT_END) >= horizon if horizon is not None else pl.lit(False)
    open_from = (
        tagged.filter(in_open_visit).group_by("user_id").agg(pl.col(TS).min().alias(OPEN_FROM))
    )
    dropped_after = dropped_after_open = 0
    if config.journey.after_conversion == "drop":
        # Drop what follows a conversion until the next long gap (e.g. a loan's back-office
        # steps after approval): such events belong to the converted journey's aftermath.
        outcome = (pl.col("_conversion") | pl.col("_end")).cast(pl.Int32)
        seen = outcome.cum_sum().over("_visit", order_by=ROW_ORDER)
        after = (seen - outcome) > 0
        flagged = tagged.with_row_index(ROW_ORDER).with_columns(_after=after)
        # Rows of the log only: a conversion made from a flag column is not one.
        input_rows = ~pl.col(FROM_FLAG) if FROM_FLAG in events.columns else pl.lit(True)
        dropped = flagged.filter(pl.col("_after") & input_rows)
        dropped_after, dropped_after_open = dropped.height, dropped.filter(in_open_visit).height
        tagged = flagged.filter(~pl.col("_after")).drop(ROW_ORDER, "_after")
    tagged = tagged.with_columns(
        _journey=(
            (pl.col("_visit") != pl.col("_visit").shift(1)).fill_null(True)
            | (pl.col("_conversion") | pl.col("_end")).shift(1).fill_null(False)
        ).cum_sum()
    )

    repeats = tagged.filter(pl.col("_repeat"))
    repeats_open = repeats.filter(in_open_visit).height
    in_sequence = ~(pl.col("_conversion") | pl.col("_end"))
    sequence_columns = ["event_type", *features]
    grouped = tagged.group_by("_journey", maintain_order=True).agg(
        pl.col("user_id").first(),
        pl.col(TS).filter(in_sequence).first().alias("start_time"),
        pl.col(TS).last().alias("end_time"),
        in_sequence.sum().cast(pl.Int32).alias("n_events_total"),
        pl.col("_conversion").last().cast(pl.Int8).alias("label"),
        *[pl.col(name).filter(in_sequence).tail(max_events) for name in sequence_columns],
        pl.col(TS).filter(in_sequence).tail(max_events).alias("event_time"),
        pl.col(VISIT_END).first(),
    )
    # A conversion with no event before it labels no journey (an end event alone ends none).
    empty = grouped.filter((pl.col("n_events_total") == 0) & (pl.col("label") == 1))
    journeys = grouped.filter(pl.col("n_events_total") > 0).drop("_journey")
    journeys = journeys.with_columns(
        journey_id_expr().alias("journey_id"),
        pl.col("event_type").list.len().cast(pl.Int32).alias("n_events"),
    )
    columns = [
        "journey_id", "user_id", "start_time", "end_time", "n_events", "n_events_total",
        "label", "event_type", "event_time", *features, VISIT_END,
    ]  # fmt: skip
    orphans_open = empty.filter(in_open_visit).height
    # Already ordered by user, then start: the groups keep the sorted events' order.
    return Sessionised(
        journeys.select(columns), open_from,
        empty.height - orphans_open, orphans_open,
        repeats.height - repeats_open, repeats_open,
        dropped_after - dropped_after_open, dropped_after_open,
    )  # fmt: skip


def closing_horizon(data_end: datetime | None, config: Config) -> datetime | None:
    """Visits whose last event is before this are closed for good: the next run takes no
    event older than `data_end - ingest.late_allowed`, and one after that is more than
    `journey.max_gap` from such a visit, so it starts a visit of its own."""
    if data_end is None:
        return None
    return data_end - config.ingest.late_allowed_delta - config.journey.max_gap_delta


@dataclass(frozen=True)
class Staged:
    """Pass 1's output: partition folders of valid rows, quarantined rows, counts."""

    folder: Path
    partitions: dict[int, Path]  # user bucket -> its folder of valid rows
    quarantine: list[Path]
    rows_read: int
    sources: list[str]
    quarantined: dict[str, int] = field(default_factory=dict)  # reason -> rows
    # source file -> {"rows": read, "quarantined": of them}
    # file -> rows, quarantined and the quarantined rows by reason
    by_source: dict[str, dict[str, Any]] = field(default_factory=dict)
    features: list[str] = field(default_factory=list)  # data.features the log has
    features_left_out: list[str] = field(default_factory=list)  # default ones it lacks
    data_end: datetime | None = None  # the latest valid row's time


# The passes' own files, read back once or twice and deleted: written for speed (lz4), not
# size. The journeys themselves: zstd at its fastest level, twice as fast to write as
# Polars' default level (3) for files 7% larger (10M events: 0.25 s against 0.51 s a part).
SCRATCH_COMPRESSION = "lz4"
OUTPUT_COMPRESSION, OUTPUT_COMPRESSION_LEVEL = "zstd", 1


def stage(
    config: Config,
    folder: Path,
    sources: list[Path],
    late_before: datetime | None = None,
    held_before: Collection[str] = (),
) -> Staged:
    """Pass 1: read every row of `sources` once (streaming) into user-hash partitions or
    quarantine; a valid row older than `late_before` is quarantined as `late`; a feature
    of `held_before` (an earlier ingest's) that the new files lack is null in them."""
    scanned = scan_events(sources, config.data, held_before)
    rows = scanned.rows
    if late_before is not None:
        late = pl.col(REASON).is_null() & (pl.col(TS) < late_before)
        rows = rows.with_columns(
            pl.when(late).then(pl.lit("late")).otherwise(pl.col(REASON)).alias(REASON)
        )
    n = config.ingest.partitions
    key = pl.when(pl.col(REASON).is_null()).then(user_bucket(n)).otherwise(QUARANTINE_BUCKET)
    try:
        rows.with_columns(key.alias(BUCKET)).sink_parquet(
            pl.PartitionBy(folder, key=BUCKET, include_key=False),
            mkdir=True,
            compression=SCRATCH_COMPRESSION,
        )
    except (pl.exceptions.PolarsError, OSError) as err:
        raise InputError(f"cannot read {sources[0].parent}: {first_line(err)}") from None
    buckets = {int(p.name.split("=", 1)[1]): p for p in folder.glob(f"{BUCKET}=*")}
    quarantine_dir = buckets.pop(QUARANTINE_BUCKET, None)
    quarantine = sorted(quarantine_dir.glob("*.parquet")) if quarantine_dir else []
    valid = [f for p in buckets.values() for f in p.glob("*.parquet")]
    files = valid + quarantine
    # Every count from one pass over the staged rows: by source and reason (null: valid).
    counted = (
        pl.scan_parquet(files)
        .group_by(SOURCE, REASON)
        .agg(n=pl.len().cast(pl.Int64), end=pl.col(TS).max())
        if files
        else pl.LazyFrame(schema={SOURCE: pl.String, REASON: pl.String, "n": pl.Int64})
    ).collect()
    rows_read = int(counted.get_column("n").sum())
    valid_rows = counted.filter(pl.col(REASON).is_null())
    data_end = valid_rows.get_column("end").max() if valid_rows.height else None
    quarantined = dict.fromkeys(REASONS, 0)
    bad = counted.filter(pl.col(REASON).is_not_null())
    quarantined |= dict(bad.group_by(REASON).agg(pl.col("n").sum()).iter_rows())  # type: ignore[arg-type]
    by_source: dict[str, dict[str, Any]] = {
        str(source): {"rows": 0, "quarantined": 0, "reasons": {}} for source in sources
    }
    per_source = counted.group_by(SOURCE).agg(
        rows=pl.col("n").sum(), quarantined=pl.col("n").filter(pl.col(REASON).is_not_null()).sum()
    )
    for row in per_source.iter_rows(named=True):
        by_source[row[SOURCE]] |= {"rows": row["rows"], "quarantined": row["quarantined"]}
    for source, reason, n, _ in bad.sort(SOURCE, REASON).iter_rows():
        by_source[source]["reasons"][reason] = n
    left_out = [name for name in config.data.features if name not in scanned.features]
    return Staged(
        folder, dict(sorted(buckets.items())), quarantine, rows_read, scanned.sources,
        quarantined, by_source, scanned.features, left_out, data_end,
    )  # fmt: skip


@dataclass(frozen=True)
class Counts:
    """Row counters that add up across partitions and runs (`ingest_report.json`)."""

    rows_valid: int = 0  # valid rows, before de-duplication and drops
    duplicates_dropped: int = 0
    dropped_by_config: int = 0  # drop_events, exclude_users and after a conversion
    dropped_after_conversion: int = 0
    conversions_without_journey: int = 0
    repeat_conversions: int = 0  # conversions straight after a conversion of the same visit
    conversions_by_source: dict[str, int] = field(default_factory=dict)

    def __add__(self, other: Counts) -> Counts:
        return self._combine(other, 1)

    def __sub__(self, other: Counts) -> Counts:
        return self._combine(other, -1)

    def _combine(self, other: Counts, sign: int) -> Counts:
        sources = {**self.conversions_by_source}
        for source, count in other.conversions_by_source.items():
            sources[source] = sources.get(source, 0) + sign * count
        numbers = {
            name: getattr(self, name) + sign * getattr(other, name)
            for name in self.__dataclass_fields__
            if name != "conversions_by_source"
        }
        kept = {k: v for k, v in sorted(sources.items()) if v}  # sorted: the manifest's bytes
        return Counts(**numbers, conversions_by_source=kept)

    @property
    def conversions(self) -> int:
        return sum(self.conversions_by_source.values())


@dataclass(frozen=True)
class PartitionResult:
    """Pass 2's output for one partition: its journeys, split into finished ones (their
    visit closed) and open ones, the rows it keeps for the next run, and counts."""

    finished: Path
    open: Path
    open_rows: Path  # valid rows of open visits, for the next nightly run
    users_file: Path  # every user seen in this partition, in any run
    settled: Counts  # of rows in closed visits: final
    provisional: Counts  # of rows in open visits: counted again next run
    users: int
    data_start: datetime | None
    event_map_matched: frozenset[str] = frozenset()  # data.event_map keys found in the rows
    top_user: tuple[str, int] | None = None  # the user with the most events, and how many
    events: int = 0  # events kept (after de-duplication and drops)


def conversions_by_source(events: pl.DataFrame, data: Data) -> dict[str, int]:
    converting = events.filter(pl.col("event_type").is_in(data.conversions))
    return dict(converting.group_by(SOURCE).len().sort(SOURCE).iter_rows())  # type: ignore[arg-type]


def cleaned_counts(rows: pl.DataFrame, data: Data) -> tuple[CleanEvents, Counts]:
    clean = clean_events(rows.drop(REASON, strict=False), data)
    counts = Counts(
        rows_valid=clean.rows_valid,
        duplicates_dropped=clean.duplicates_dropped,
        dropped_by_config=clean.dropped_by_config,
        conversions_by_source=conversions_by_source(clean.events, data),
    )
    return clean, counts


def read_or_empty(paths: list[Path], schema: dict[str, pl.DataType]) -> pl.DataFrame:
    frames = [pl.read_parquet(p) if p.suffix == ".parquet" else pl.read_ipc(p) for p in paths]
    frames = [frame.select(pl.col(k).cast(v) for k, v in schema.items()) for frame in frames]
    return pl.concat(frames, how="vertical") if frames else pl.DataFrame(schema=schema)


def build_partition(
    rows: pl.DataFrame,
    users_seen: pl.DataFrame,
    config: Config,
    horizon: datetime | None,
    out: dict[str, Path],
) -> PartitionResult:
    """Pass 2: one partition's rows (those kept open by the last run, then the new ones)
    -> journeys, finished and open, written to `out`."""
    data = config.data
    clean, cleaned = cleaned_counts(rows, data)
    built = build_journeys(sort_events(clean.events, data), config, horizon)
    total = cleaned + Counts(
        dropped_by_config=built.dropped_after_settled + built.dropped_after_open,
        dropped_after_conversion=built.dropped_after_settled + built.dropped_after_open,
        conversions_without_journey=built.orphans_settled + built.orphans_open,
        repeat_conversions=built.repeats_settled + built.repeats_open,
    )
    # A row stays for the next run from its user's first open visit on (a twin of it can
    # only come within that bound); the others are settled, and so are their counts.
    # (The mask from the two columns it needs: joining every column would copy them all.)
    keep_from = pl.min_horizontal(pl.col(OPEN_FROM), pl.lit(horizon, UTC_US))
    stays = (
        rows.select(pl.col("user_id").str.strip_chars(), TS)
        .join(built.open_from, on="user_id", how="left", maintain_order="left")
        .select((pl.col(TS) >= keep_from).fill_null(False))
        .to_series()
        if horizon is not None
        else pl.repeat(False, rows.height, eager=True)
    )
    open_rows = rows.filter(stays).drop(REASON, strict=False)
    # Clean counts are additive (a row and its copies fall on the same side): count the
    # smaller side again and take the other as the rest (a full build settles most rows,
    # a nightly run keeps most open).
    if open_rows.height <= rows.height - open_rows.height:
        _, provisional = cleaned_counts(open_rows, data)
        settled = cleaned - provisional
    else:
        _, settled = cleaned_counts(rows.filter(~stays), data)
    after_conversion = Counts(
        dropped_by_config=built.dropped_after_settled,
        dropped_after_conversion=built.dropped_after_settled,
        conversions_without_journey=built.orphans_settled,
        repeat_conversions=built.repeats_settled,
    )
    settled = settled + after_conversion
    open_rows.write_ipc(out["open_rows"], compression="lz4")
    closed = pl.col(VISIT_END) < horizon if horizon is not None else pl.lit(True)
    journeys = built.journeys
    journeys.filter(closed).drop(VISIT_END).write_parquet(
        out["finished"], compression=SCRATCH_COMPRESSION
    )
    journeys.filter(~closed).drop(VISIT_END).write_parquet(
        out["open"], compression=SCRATCH_COMPRESSION
    )
    seen = clean.events.select(pl.col("user_id").unique())
    users = pl.concat([users_seen, seen.join(users_seen, on="user_id", how="anti").sort("user_id")])
    users.write_ipc(out["users"], compression="lz4")
    # The log's own rows (not the conversions a flag column adds) for the skew warning.
    logged = clean.events
    if FROM_FLAG in logged.columns:
        logged = logged.filter(~pl.col(FROM_FLAG))
    per_user = logged.group_by("user_id").len().sort(["len", "user_id"], descending=[True, False])
    return PartitionResult(
        finished=out["finished"],
        open=out["open"],
        open_rows=out["open_rows"],
        users_file=out["users"],
        settled=settled,
        provisional=total - settled,
        users=users.height,
        data_start=clean.events.get_column(TS).min(),
        event_map_matched=clean.event_map_matched,
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


Cuts = tuple[datetime | None, datetime | None]  # where val starts, where test starts


def split_cuts(ends: pl.Series, fractions: tuple[float, float, float]) -> Cuts:
    """The end times at which val and test start, from the end times of the journeys that
    take a split: the earliest ends train, the latest test. None: no such split."""
    ends = ends.sort()
    n = ends.len()
    if n == 0:
        return None, None
    val_cut = ends[min(int(n * fractions[0]), n - 1)]
    test_cut = ends[min(int(n * (fractions[0] + fractions[1])), n - 1)]
    if fractions[2] == 0:
        test_cut = None
    if fractions[1] == 0:
        val_cut = test_cut
    return val_cut, test_cut


def split_by_cuts(cuts: Cuts) -> pl.Expr:
    """Split by journey end time; `_unsplit` -> none. Cuts are end-time values, so journeys
    ending at the same instant share a split and every train journey ends strictly before
    every val journey (and val before test)."""
    val_cut, test_cut = cuts
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


def moved_ranges(old: Cuts, new: Cuts) -> list[tuple[datetime | None, datetime | None]]:
    """End-time ranges [low, high) whose journeys change split when the cuts move from
    `old` to `new` (None: beyond every end)."""
    ranges = []
    for before, after in zip(old, new, strict=True):
        if before == after:
            continue
        if before is None or after is None:
            ranges.append((before if after is None else after, None))
        else:
            ranges.append((min(before, after), max(before, after)))
    return ranges


def count_tokens(journeys: pl.LazyFrame, columns: list[str]) -> pl.DataFrame:
    """Token counts per sequence column: `column`, `token`, `count`."""
    counted = [
        journeys.select(pl.col(name).explode().alias("token"))
        .group_by("token")
        .len(name="count")
        .with_columns(pl.lit(name).alias("column"))
        .select("column", "token", pl.col("count").cast(pl.Int64))
        for name in columns
    ]
    return pl.concat(pl.collect_all(counted, engine="streaming"), how="vertical")


def build_vocabularies(journeys: pl.LazyFrame, config: Config) -> Vocabularies:
    """Token vocabularies from the train split's sequences only (nothing from val/test)."""
    train = journeys.filter(pl.col("split") == "train")
    return vocabularies_from(count_tokens(train, ["event_type", *config.data.features]), config)


def vocabularies_from(counts: pl.DataFrame, config: Config) -> Vocabularies:
    """Token vocabularies from the train split's token counts (nothing from val/test)."""
    by_column = {
        name: Vocabulary.from_counts(
            counts.filter(pl.col("column") == name).select("token", "count"),
            config.vocab.min_count,
        )
        for name in ["event_type", *config.data.features]
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
        return read_quarantine(self.quarantine_folder)


def read_quarantine(folder: Path) -> pl.DataFrame:
    """Every quarantined row: the full build's file and one per nightly run since."""
    return pl.read_parquet(sorted(folder.glob("quarantine*.parquet")))


@dataclass(frozen=True)
class Previous:
    """The ingest a nightly run builds on: its folder and manifest."""

    folder: Path
    manifest: Manifest

    @property
    def data_end(self) -> datetime | None:
        end = self.manifest.data_end
        return datetime.fromisoformat(end) if end else None

    @property
    def cuts(self) -> Cuts:
        val, test = (datetime.fromisoformat(c) if c else None for c in self.manifest.cuts)
        return val, test

    def finished_parts(self) -> dict[str, dict[str, Any]]:
        return {n: s for n, s in self.manifest.parts.items() if s["kind"] == "finished"}

    def open_part(self) -> Path | None:
        names = [n for n, s in self.manifest.parts.items() if s["kind"] == "open"]
        return self.folder / names[0] if names else None

    def state(self, name: str) -> Path | None:
        path = self.folder / STATE_DIR / name
        return path if path.exists() else None


OPEN_ROWS_FILE = "open-rows-{:05d}.arrow"  # in STATE_DIR: one per user bucket
USERS_FILE = "users-{:05d}.arrow"
TRAIN_TOKENS_FILE = "train-tokens.arrow"
DAY = "_day"
PRESENT = "_present:"  # the part summaries' working column names


def part_summaries(files: list[Path], features: list[str]) -> dict[str, dict[str, Any]]:
    """Per part file: journeys, labels, split counts, end-time range and, per split, the
    events kept and those holding each feature (one query)."""
    if not files:
        return {}

    def in_split(value: pl.Expr, split: str) -> pl.Expr:
        return value.filter(pl.col("split") == split).sum()

    present = {
        f"{PRESENT}{name}:{split}": in_split(
            pl.col(name).list.eval(pl.element().is_not_null()).list.sum().cast(pl.Int64), split
        )
        for name in features
        for split in SPLITS
    }
    kept = {
        f"{PRESENT}:{split}": in_split(pl.col("n_events").cast(pl.Int64), split) for split in SPLITS
    }
    frame = (
        pl.scan_parquet(files, include_file_paths="_file")
        .group_by("_file")
        .agg(
            **present,
            **kept,
            journeys=pl.len(),
            converted=pl.col("label").cast(pl.Int64).sum(),
            censored=pl.col("censored").sum(),
            converted_near_end=((pl.col("split") == NO_SPLIT) & (pl.col("label") == 1)).sum(),
            events=pl.col("n_events_total").cast(pl.Int64).sum(),
            kept=pl.col("n_events").cast(pl.Int64).sum(),
            min_end=pl.col("end_time").min(),
            max_end=pl.col("end_time").max(),
            **{split: (pl.col("split") == split).sum() for split in (*SPLITS, NO_SPLIT)},
        )
        .collect()
    )
    summaries = {}
    for row in frame.sort("_file").iter_rows(named=True):
        name = Path(row.pop("_file")).name
        row["by_split"] = {split: row.pop(split) for split in (*SPLITS, NO_SPLIT)}
        row["kept_by_split"] = {split: row.pop(f"{PRESENT}:{split}") for split in SPLITS}
        row["present_by_split"] = {
            name: {split: row.pop(f"{PRESENT}{name}:{split}") for split in SPLITS}
            for name in features
        }
        row["min_end"], row["max_end"] = str(row["min_end"]), str(row["max_end"])
        row["kind"] = "open" if name.startswith(OPEN_PART_PREFIX) else "finished"
        row["day"] = name.split("-")[1]  # the end day of a finished part's journeys
        summaries[name] = row
    return summaries


def finish(
    config: Config,
    staged: Staged,
    parts: list[PartitionResult],
    journeys_folder: Path,
    quarantine_folder: Path,
    previous: Previous | None,
    mode: dict[str, Any],
) -> IngestResult:
    """Pass 3: censoring, split and vocabularies from global facts; write everything.

    Censoring counts from `data.observed_until` (the moment up to which conversions were
    recorded), by default the last event. Only open journeys can be censored (a finished
    one ended long before the data's end), so finished ones are written once, into files
    by their end day, and rewritten only when a split cut moves across that day.
    """
    run = previous.manifest.run + 1 if previous else 0
    data_end = max_or_none(previous.data_end if previous else None, staged.data_end)
    observed_until = observation_end(config, data_end)
    max_gap = config.journey.max_gap_delta
    open_flags = [
        censored_expr(observed_until, max_gap).alias("censored"),
        unsplit_expr(observed_until, max_gap, config.split.exclude_recent_conversions).alias(
            UNSPLIT
        ),
    ]
    finished_flags = [pl.lit(False).alias("censored"), pl.lit(False).alias(UNSPLIT)]
    new_finished = pl.scan_parquet([p.finished for p in parts]).with_columns(finished_flags)
    opened = pl.scan_parquet([p.open for p in parts]).with_columns(open_flags)
    settled = Counts(**previous.manifest.settled) if previous else Counts()
    settled = sum((p.settled for p in parts), settled)
    provisional = sum((p.provisional for p in parts), Counts())
    total = settled + provisional
    require_conversions(
        config, total.conversions, total.rows_valid, pl.concat([new_finished, opened])
    )
    matched = frozenset(previous.manifest.event_map_matched if previous else ()).union(
        *(p.event_map_matched for p in parts)
    )
    warn_unmatched_event_map(config, matched)

    old_finished = previous.finished_parts() if previous else {}
    old_files = [previous.folder / name for name in old_finished] if previous else []
    # The only history a nightly run reads: the finished journeys' end times (8 bytes a
    # journey), where the split's cuts fall.
    ends = pl.concat(
        [
            *([pl.scan_parquet(old_files).select("end_time")] if old_files else []),
            new_finished.select("end_time"),
            opened.filter(~pl.col(UNSPLIT)).select("end_time"),
        ]
    )
    cuts = split_cuts(ends.collect().to_series(), config.split.fractions)
    # Finished files whose journeys change split as the cuts move are rewritten, with every
    # other file of their day: each day stays one file once a cut has passed it.
    moved = moved_ranges(previous.cuts, cuts) if previous else []
    days = {s["day"] for s in old_finished.values() if overlaps(s, moved)}
    rewritten = [name for name, s in old_finished.items() if s["day"] in days]
    kept = [name for name in old_finished if name not in rewritten]
    columns = parts_columns(config)
    split = split_by_cuts(cuts)
    to_write = pl.concat(
        [
            new_finished,
            *(
                [
                    pl.scan_parquet([previous.folder / n for n in rewritten])
                    .with_columns(finished_flags)
                    .drop("split")
                ]
                if previous and rewritten
                else []
            ),
        ],
        how="diagonal_relaxed",
    ).with_columns(split.alias("split"), pl.col("end_time").dt.strftime("%Y%m%d").alias(DAY))

    with atomic_dir(journeys_folder) as folder:
        for name in kept:
            link_or_copy(previous.folder / name, folder / name)  # type: ignore[union-attr]
        written = write_by_day(to_write.select(*columns, DAY), folder, run)
        open_path = folder / OPEN_PART.format(run=run)
        opened.with_columns(split.alias("split")).select(columns).sink_parquet(
            open_path, compression=OUTPUT_COMPRESSION, compression_level=OUTPUT_COMPRESSION_LEVEL
        )
        summaries = {name: old_finished[name] for name in kept}
        summaries |= part_summaries([*written, open_path], config.data.features)
        summaries.setdefault(open_path.name, empty_summary(config.data.features))
        summaries = dict(sorted(summaries.items()))
        # The train split's token counts, kept up to date: less what the replaced files
        # held, plus what the new ones hold (a cut move changes only the rewritten days).
        token_columns = ["event_type", *config.data.features]
        removed = [previous.folder / n for n in rewritten] if previous else []
        old_open = previous.open_part() if previous else None
        if old_open is not None:
            removed.append(old_open)
        tokens = train_tokens([*written, open_path], token_columns)
        old_tokens = previous.state(TRAIN_TOKENS_FILE) if previous else None
        if old_tokens is not None:
            tokens = pl.concat(
                [
                    pl.read_ipc(old_tokens),
                    train_tokens(removed, token_columns).with_columns(-pl.col("count")),
                    tokens,
                ]
            )
        tokens = (
            tokens.group_by("column", "token").agg(pl.col("count").sum())
            .filter(pl.col("count") > 0).sort("column", "token")
        )  # fmt: skip
        vocabularies = vocabularies_from(tokens, config)
        state = folder / STATE_DIR
        state.mkdir()
        tokens.write_ipc(state / TRAIN_TOKENS_FILE)
        for index, part in enumerate(parts):
            os.replace(part.open_rows, state / OPEN_ROWS_FILE.format(index))
            os.replace(part.users_file, state / USERS_FILE.format(index))

        previous_start = previous.manifest.data_start if previous else None
        previous_start = datetime.fromisoformat(previous_start) if previous_start else None
        manifest = Manifest(
            config_key=mode["config_key"],
            run=run,
            data_start=iso(min_or_none(previous_start, *(p.data_start for p in parts))),
            data_end=iso(data_end),
            features=list(config.data.features),
            cuts=[iso(cut) for cut in cuts],
            files={**(previous.manifest.files if previous else {}), **mode["files"]},
            parts=summaries,
            settled=asdict(settled),
            provisional=asdict(provisional),
            quarantined=add_counts(
                previous.manifest.quarantined if previous else {}, staged.quarantined
            ),
            event_map_matched=sorted(matched),
        )
        report = make_report(manifest, total, parts, observed_until)
        report["max_gap"] = config.journey.max_gap
        report["split_fractions"] = list(config.split.fractions)  # train checks it acted
        report["ingest"] = run_summary(
            mode, staged, total - (previous_total(previous)), previous, opened, new_finished
        )
        add_warnings(
            config, report, staged.features_left_out, staged.quarantined.get("late", 0),
            [p.top_user for p in parts if p.top_user], sum(p.events for p in parts),
        )  # fmt: skip
        write_quarantine(config, staged, quarantine_folder, run)
        vocabularies.save(folder)
        write_json(report, folder / REPORT_FILE)
        manifest.save(folder)
    return IngestResult(report, journeys_folder, quarantine_folder, vocabularies)


def max_or_none(*moments: datetime | None) -> datetime | None:
    return max((m for m in moments if m is not None), default=None)


def min_or_none(*moments: datetime | None) -> datetime | None:
    return min((m for m in moments if m is not None), default=None)


def iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def add_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {key: a.get(key, 0) + b.get(key, 0) for key in sorted({**a, **b})}


def overlaps(
    summary: dict[str, Any], ranges: list[tuple[datetime | None, datetime | None]]
) -> bool:
    """Does a part's end-time range meet any of `ranges` ([low, high), None: unbounded)?"""
    low_end = datetime.fromisoformat(summary["min_end"])
    high_end = datetime.fromisoformat(summary["max_end"])
    return any(
        (low is None or high_end >= low) and (high is None or low_end < high)
        for low, high in ranges
    )


def empty_summary(features: list[str]) -> dict[str, Any]:
    return {
        "journeys": 0, "converted": 0, "censored": 0, "converted_near_end": 0, "events": 0,
        "kept": 0, "min_end": None, "max_end": None, "kind": "open",
        "by_split": dict.fromkeys((*SPLITS, NO_SPLIT), 0),
        "kept_by_split": dict.fromkeys(SPLITS, 0),
        "present_by_split": {name: dict.fromkeys(SPLITS, 0) for name in features},
    }  # fmt: skip


def write_by_day(journeys: pl.LazyFrame, folder: Path, run: int) -> list[Path]:
    """Finished journeys into `part-<end day>-<run>-<n>.parquet` files (one streaming pass)."""
    scratch = folder / f".{DAY}.tmp"
    journeys.sink_parquet(
        pl.PartitionBy(scratch, key=DAY, include_key=False),
        mkdir=True,
        compression=OUTPUT_COMPRESSION,
        compression_level=OUTPUT_COMPRESSION_LEVEL,
    )
    written = []
    for day_folder in sorted(scratch.glob(f"{DAY}=*")):
        day = day_folder.name.split("=", 1)[1]
        for index, file in enumerate(sorted(day_folder.glob("*.parquet"))):
            target = folder / FINISHED_PART.format(day=day, run=run, index=index)
            os.replace(file, target)
            written.append(target)
    shutil.rmtree(scratch, ignore_errors=True)
    return written


def train_tokens(files: list[Path], columns: list[str]) -> pl.DataFrame:
    """Token counts of the train split of `files` (`column`, `token`, `count`)."""
    if not files:
        return pl.DataFrame(schema={"column": pl.String, "token": pl.String, "count": pl.Int64})
    train = pl.scan_parquet(files).filter(pl.col("split") == "train")
    return count_tokens(train, columns)


def previous_total(previous: Previous | None) -> Counts:
    if previous is None:
        return Counts()
    return Counts(**previous.manifest.settled) + Counts(**previous.manifest.provisional)


def run_summary(
    mode: dict[str, Any],
    staged: Staged,
    counts: Counts,
    previous: Previous | None,
    opened: pl.LazyFrame,
    new_finished: pl.LazyFrame,
) -> dict[str, Any]:
    """What this run did: its mode, the files and rows it read (their accounting holds on
    its own), and the journeys it added, extended (more events) and closed."""
    now = pl.concat(
        [new_finished.select("journey_id", "n_events_total"),
         opened.select("journey_id", "n_events_total")]
    ).collect()  # fmt: skip
    old_open = previous.open_part() if previous else None
    before = (
        pl.read_parquet(old_open, columns=["journey_id", "n_events_total"])
        if old_open is not None
        else pl.DataFrame(schema={"journey_id": pl.String, "n_events_total": pl.Int32})
    )
    matched = now.join(before, on="journey_id", how="inner", suffix="_before")
    closed = new_finished.select("journey_id").collect().join(before, on="journey_id")
    quarantined = sum(staged.quarantined.values())
    rows_valid = counts.rows_valid - counts.duplicates_dropped - counts.dropped_by_config
    summary = {
        "mode": mode["mode"],
        "why": mode["why"],
        "run": mode["run"],
        "new_files": [str(source) for source in staged.sources],
        "rows_read": staged.rows_read,
        "rows_valid": rows_valid,
        "quarantined_total": quarantined,
        "late": staged.quarantined.get("late", 0),
        "duplicates_dropped": counts.duplicates_dropped,
        "dropped_by_config": counts.dropped_by_config,
        "journeys_added": now.height - matched.height,
        "journeys_extended": matched.filter(
            pl.col("n_events_total") != pl.col("n_events_total_before")
        ).height,
        "journeys_closed": closed.height,
        "journeys_open": opened.select(pl.len()).collect().item(),
    }
    accounted = rows_valid + quarantined + counts.duplicates_dropped + counts.dropped_by_config
    if staged.rows_read != accounted:
        raise AssertionError(f"row accounting broken for this run: {summary}")  # a bug
    return summary


def write_quarantine(config: Config, staged: Staged, quarantine_folder: Path, run: int) -> None:
    """The quarantined rows with their original values, source, row number and reason: the
    full build's replace the folder, a nightly run's are added beside them (its own file,
    named by the run, so a run killed and run again writes it once)."""
    schema = staged_schema(config)
    quarantine = (
        pl.scan_parquet(staged.quarantine) if staged.quarantine else pl.LazyFrame(schema=schema)
    )
    kept = quarantine.select(name for name in schema if name not in (TS, ROW_HASH, FLAG_TS))
    if run == 0:
        with atomic_dir(quarantine_folder) as folder:
            kept.sink_parquet(folder / QUARANTINE_FILE)
    elif staged.quarantine:
        with atomic_path(quarantine_folder / NIGHTLY_QUARANTINE_FILE.format(run)) as tmp:
            kept.sink_parquet(tmp)


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


def feature_presence(summaries: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per feature and split: the share of the split's kept events that hold a value
    (None for a split without events). Summaries of an older ingest, without the counts,
    leave it out."""
    if not summaries or any("present_by_split" not in part for part in summaries):
        return {}
    kept = {split: sum(part["kept_by_split"][split] for part in summaries) for split in SPLITS}
    names = summaries[0]["present_by_split"]
    return {
        name: {
            split: (
                sum(part["present_by_split"][name][split] for part in summaries) / kept[split]
                if kept[split]
                else None
            )
            for split in SPLITS
        }
        for name in names
    }


def make_report(
    manifest: Manifest,
    total: Counts,
    parts: list[PartitionResult],
    observed_until: datetime | None,
) -> dict[str, Any]:
    """The ingest report over every run so far (sums of the manifest's part summaries and
    counters); checks the row-accounting invariant before anything is written."""
    summaries = list(manifest.parts.values())
    by_split = {s: sum(p["by_split"][s] for p in summaries) for s in (*SPLITS, NO_SPLIT)}
    quarantined = {reason: manifest.quarantined.get(reason, 0) for reason in REASONS}
    conversions: dict[str, int] = {}  # rows name their file as it was given: key it
    for source, count in total.conversions_by_source.items():
        conversions[file_key(source)] = conversions.get(file_key(source), 0) + count
    report = {
        "rows_read": sum(f["rows"] for f in manifest.files.values()),
        "rows_valid": total.rows_valid - total.duplicates_dropped - total.dropped_by_config,
        "quarantined": quarantined,
        "quarantined_total": sum(quarantined.values()),
        "duplicates_dropped": total.duplicates_dropped,
        "dropped_by_config": total.dropped_by_config,
        "dropped_after_conversion": total.dropped_after_conversion,
        "journeys": sum(p["journeys"] for p in summaries),
        "journeys_converted": sum(p["converted"] for p in summaries),
        "journeys_censored": sum(p["censored"] for p in summaries),
        "journeys_by_split": by_split,
        # converted, but as recent as the censored ones: split none (unsplit_expr's docstring)
        "journeys_converted_near_end": sum(p["converted_near_end"] for p in summaries),
        "conversions_without_journey": total.conversions_without_journey,
        "repeat_conversions": total.repeat_conversions,
        "events_in_journeys": sum(p["events"] for p in summaries),
        "events_kept": sum(p["kept"] for p in summaries),
        "users": sum(p.users for p in parts),
        "data_start": manifest.data_start,
        "data_end": manifest.data_end,
        "observed_until": observed_until,  # conversions seen until: where censoring counts from
        "partitions": len(parts),
        "feature_presence": feature_presence(summaries),
        "sources": list(manifest.files),
        "by_source": {
            source: {
                "rows": facts["rows"],
                "quarantined": facts["quarantined"],
                "quarantined_by_reason": facts.get("reasons", {}),
                "conversions": conversions.get(source, 0),
            }
            for source, facts in manifest.files.items()
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


PartitionBuilder = Callable[[int], PartitionResult]
# Runs the builder over the user buckets, results in the buckets' order.
MapPartitions = Callable[[PartitionBuilder, list[int]], list[PartitionResult]]


@dataclass(frozen=True, kw_only=True)
class BuildPartition:
    """Pass 2 for one user bucket: the rows the last run kept open and the new ones.

    A plain picklable object, so a task runner can ship it to worker processes; its
    configuration holds no password (`without_secrets`): the partitions never connect.
    """

    config: Config
    staged: dict[int, Path]  # bucket -> its new rows
    state: Path | None  # the previous ingest's state folder (open rows, users seen)
    scratch: Path
    horizon: datetime | None

    def paths(self) -> list[Path]:
        """The folders a worker reads and writes (it must see them at these paths)."""
        return [self.scratch, *self.staged.values(), *([self.state] if self.state else [])]

    def __call__(self, bucket: int) -> PartitionResult:
        schema = {k: v for k, v in staged_schema(self.config).items() if k != REASON}
        kept = []
        users_seen = pl.DataFrame(schema={"user_id": pl.String})
        if self.state is not None:
            kept = [p for p in [self.state / OPEN_ROWS_FILE.format(bucket)] if p.exists()]
            users = self.state / USERS_FILE.format(bucket)
            if users.exists():
                users_seen = pl.read_ipc(users)
        new = sorted(self.staged[bucket].glob("*.parquet")) if bucket in self.staged else []
        rows = read_or_empty([*kept, *new], schema)
        out = {
            name: self.scratch / f"{name}-{bucket:05d}.{suffix}"
            for name, suffix in (
                ("finished", "parquet"), ("open", "parquet"), ("open_rows", "arrow"),
                ("users", "arrow"),
            )
        }  # fmt: skip
        return build_partition(rows, users_seen, self.config, self.horizon, out)


def map_in_order(build: PartitionBuilder, partitions: list[int]) -> list[PartitionResult]:
    """The default `map_partitions`: one partition after the other, in this process."""
    return [build(partition) for partition in partitions]


def previous_ingest(config: Config, folder: Path, full: bool) -> tuple[Previous | None, str]:
    """The earlier ingest a nightly run builds on, or None and why the run is a full one."""
    restore_interrupted_swap(folder)
    manifest = load_manifest(folder)
    if full:
        return None, "--full"
    if manifest is None:
        return None, "no earlier ingest in this folder"
    if manifest.config_key != config_key(config):
        return None, "the configuration changed since the last ingest"
    return Previous(folder, manifest), "new files since the last ingest"


def run_ingest(
    config: Config,
    raw: str | Path | None = None,
    journeys_folder: str | Path | None = None,
    quarantine_folder: str | Path | None = None,
    map_partitions: MapPartitions | None = None,
    full: bool = False,
) -> IngestResult:
    """`journeys ingest` as a function: all three passes, outputs written atomically.

    Incremental when the journeys folder holds an earlier ingest with the same
    configuration (its manifest): only raw files not read before are read, the journeys
    their events can touch are rebuilt, finished ones stay as they are; the result equals
    a full rebuild on the same files. `full` rebuilds from nothing.

    `map_partitions(build, buckets)` runs pass 2 (default `map_in_order`); the flow maps
    `build` over the buckets as tasks on its task runner. The result does not depend on
    how, as long as the results come back in the buckets' order.
    """
    journeys_folder = Path(journeys_folder or config.paths.journeys)
    quarantine_folder = Path(quarantine_folder or config.paths.quarantine)
    try:
        result = _run_ingest(config, raw, journeys_folder, quarantine_folder, map_partitions, full)
    except Exception as err:  # the journeys stay as they were: say so beside them
        record_failed_ingest(journeys_folder, err)
        raise
    clear_failed_ingest(journeys_folder)
    return result


def _run_ingest(
    config: Config,
    raw: str | Path | None,
    journeys_folder: Path,
    quarantine_folder: Path,
    map_partitions: MapPartitions | None,
    full: bool,
) -> IngestResult:
    key = config_key(config)
    previous, why = previous_ingest(config, journeys_folder, full)
    sources = resolve_sources(raw or config.paths.raw)
    if previous is not None:
        config = with_features(config, previous.manifest.features)
        sources = new_sources(previous.manifest, sources)
        if not sources:
            return up_to_date(previous, quarantine_folder)
    late_before = None
    if previous is not None and previous.data_end is not None:
        late_before = previous.data_end - config.ingest.late_allowed_delta
    with (
        scratch_dir(journeys_folder.parent, "ingest") as scratch,
        fingerprints_meanwhile([Path(source) for source in sources]) as fingerprints,
    ):
        # Per-event columns earlier files held: absent from the new files, they are null.
        held = config.data.event_columns if previous is not None else []
        staged = stage(config, scratch / "staged", sources, late_before, held)
        if staged.features != config.data.features:  # default features the log lacks
            if previous is not None:
                raise InputError(
                    f"the new files lack the features {staged.features_left_out} that the "
                    "journeys were built with: set data.features, or run `journeys ingest "
                    "--full`"
                )
            config = with_features(config, staged.features)
        problem = quarantine_problem(
            config, staged.rows_read, staged.quarantined, staged.quarantine
        )
        if problem is not None:  # written first, so the user can look
            run = previous.manifest.run + 1 if previous else 0
            write_quarantine(config, staged, quarantine_folder, run)
            raise InputError(problem)
        built = scratch / "built"
        built.mkdir()
        data_end = max_or_none(previous.data_end if previous else None, staged.data_end)
        build = BuildPartition(
            config=without_secrets(config),
            staged=staged.partitions,
            state=previous.folder / STATE_DIR if previous else None,
            scratch=built,
            horizon=closing_horizon(data_end, config),
        )
        buckets = list(range(config.ingest.partitions))
        parts = (map_partitions or map_in_order)(build, buckets)
        if len(parts) != len(buckets):
            raise AssertionError(f"{len(parts)} results for {len(buckets)} partitions")
        hashed = fingerprints()
        files = {
            file_key(source): hashed[source]
            | {k: staged.by_source[source][k] for k in ("rows", "quarantined", "reasons")}
            for source in staged.sources
        }
        mode = {
            "mode": "incremental" if previous else "full",
            "why": why,
            "run": previous.manifest.run + 1 if previous else 0,
            "config_key": key,
            "files": files,
        }
        return finish(config, staged, parts, journeys_folder, quarantine_folder, previous, mode)


def up_to_date(previous: Previous, quarantine_folder: Path) -> IngestResult:
    """No new raw file: the journeys stand as they are (nothing is read or written)."""
    report = json.loads((previous.folder / REPORT_FILE).read_text())
    report["ingest"] = {
        "mode": "incremental", "why": "no new raw file: nothing to do",
        "run": previous.manifest.run, "new_files": [], "rows_read": 0,
    }  # fmt: skip
    vocabularies = Vocabularies.load(previous.folder)
    return IngestResult(report, previous.folder, quarantine_folder, vocabularies)


def ingest(config: Config, full: bool = False) -> dict[str, Any]:
    """`journeys ingest`: returns the report (also written beside the journeys)."""
    return run_ingest(config, full=full).report


def run_line(run: dict[str, Any] | None) -> str:
    """What this run did, in one line (the table above is over every run)."""
    if not run or not run.get("new_files"):
        return "journeys ingest: up to date: no new raw file, nothing read or written"
    return (
        f"journeys ingest: {run['mode']} ({run['why']}): {len(run['new_files'])} new file(s), "
        f"{run['rows_read']:,} rows ({run['quarantined_total']:,} quarantined, {run['late']:,} "
        f"of them late); journeys added {run['journeys_added']:,}, extended "
        f"{run['journeys_extended']:,}, closed {run['journeys_closed']:,}; "
        f"{run['journeys_open']:,} open"
    )


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
    for key in (
        "journeys_converted", "journeys_censored", "conversions_without_journey",
        "repeat_conversions",
    ):  # fmt: skip
        table.add_row(f"  {key.removeprefix('journeys_')}", f"{report[key]:,}")
    for split, count in report["journeys_by_split"].items():
        table.add_row(f"  split {split}", f"{count:,}")
    table.add_row("data range", f"{report['data_start']} .. {report['data_end']}")
    Console().print(table)
    print(run_line(report.get("ingest")))
    for warning in report.get("warnings", []):
        print(f"journeys ingest: warning: {warning}", file=sys.stderr)

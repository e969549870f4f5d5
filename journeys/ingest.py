"""Validated events -> labelled journeys, a temporal split and train-only vocabularies.

Stage two of the pipeline (`journeys ingest`), in three passes so memory stays bounded by
one partition, not the input:
1. `journeys.staging.stage`: stream every row once, writing quarantined rows aside and
   valid rows into partitions by user hash (all of a user's events land in one);
2. `journeys.sessionise.BuildPartition`: per partition, de-duplicate, sort, sessionise and
   label (independent, so partitions can run in parallel, e.g. as Prefect tasks);
3. `finish` (here): censoring and the time split need global facts (the data's end, the
   end-time cut points), vocabularies count the train split; then every output is swapped
   in atomically: readers see the previous complete output or the new one.

Every run builds on what the last one left (`journeys.ingest_state.IngestState`, docs/
nightly.md): pass 1 reads only the raw files not seen yet, pass 2 rebuilds each
partition's open visits (their rows kept in `_state/`) with the new rows, and pass 3
writes the journeys that closed into files by end day, leaving the finished ones as they
are. A full build is the same passes from `IngestState.empty()`. The guards and warnings
are in `journeys.ingest_checks`, the report in `journeys.ingest_report`.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import polars as pl

from journeys.config import Config, with_features, without_secrets
from journeys.datasets import (
    FINISHED_PART,
    NO_SPLIT,
    OPEN_PART,
    REPORT_FILE,
    IngestReport,
    RunSummary,
    clear_failed_ingest,
    read_journeys,
    record_failed_ingest,
)
from journeys.errors import InputError
from journeys.events import as_utc, resolve_sources
from journeys.ingest_checks import (
    add_warnings,
    quarantine_problem,
    require_conversions,
    warn_unmatched_event_map,
)
from journeys.ingest_report import make_report, run_summary
from journeys.ingest_state import (
    Cuts,
    IngestState,
    ThisRun,
    empty_summary,
    file_key,
    fingerprints_meanwhile,
    max_or_none,
    min_or_none,
    overlaps,
    part_summaries,
    write_state,
)
from journeys.sessionise import (
    BuildPartition,
    Counts,
    MapPartitions,
    PartitionResult,
    closing_horizon,
    map_in_order,
)
from journeys.staging import (
    OUTPUT_COMPRESSION,
    OUTPUT_COMPRESSION_LEVEL,
    Staged,
    read_quarantine,
    stage,
    write_quarantine,
)
from journeys.storage import atomic_dir, link_or_copy, scratch_dir, write_json
from journeys.vocab import Vocabularies

UNSPLIT = "_unsplit"  # a working column: the journey takes no split (see unsplit_expr)
DAY = "_day"


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


@dataclass(frozen=True)
class IngestResult:
    report: IngestReport
    journeys_folder: Path
    quarantine_folder: Path
    vocabularies: Vocabularies = field(repr=False)

    @property
    def journeys(self) -> pl.DataFrame:
        return read_journeys(self.journeys_folder)

    @property
    def quarantine(self) -> pl.DataFrame:
        return read_quarantine(self.quarantine_folder)


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


def finish(
    config: Config,
    staged: Staged,
    parts: list[PartitionResult],
    journeys_folder: Path,
    quarantine_folder: Path,
    this_run: ThisRun,
) -> IngestResult:
    """Pass 3: censoring, split and vocabularies from global facts; write everything.

    Censoring counts from `data.observed_until` (the moment up to which conversions were
    recorded), by default the last event. Only open journeys can be censored (a finished
    one ended long before the data's end), so finished ones are written once, into files
    by their end day, and rewritten only when a split cut moves across that day.
    """
    state, run = this_run.state, this_run.number
    data_end = max_or_none(state.data_end, staged.data_end)
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
    settled = sum((p.settled for p in parts), state.settled)
    provisional = sum((p.provisional for p in parts), Counts())
    total = settled + provisional
    require_conversions(
        config, total.conversions, total.rows_valid, pl.concat([new_finished, opened])
    )
    matched = frozenset(state.manifest.event_map_matched).union(
        *(p.event_map_matched for p in parts)
    )
    warn_unmatched_event_map(config, matched)

    old_finished = state.finished_parts()
    old_files = state.paths(list(old_finished))
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
    moved = moved_ranges(state.cuts, cuts)
    days = {s["day"] for s in old_finished.values() if overlaps(s, moved)}
    rewritten = [name for name, s in old_finished.items() if s["day"] in days]
    kept = [name for name in old_finished if name not in rewritten]
    columns = parts_columns(config)
    split = split_by_cuts(cuts)
    again = state.paths(rewritten)
    to_write = pl.concat(
        [
            new_finished,
            *([pl.scan_parquet(again).with_columns(finished_flags).drop("split")] if again else []),
        ],
        how="diagonal_relaxed",
    ).with_columns(split.alias("split"), pl.col("end_time").dt.strftime("%Y%m%d").alias(DAY))

    with atomic_dir(journeys_folder) as folder:
        for path in state.paths(kept):
            link_or_copy(path, folder / path.name)
        written = write_by_day(to_write.select(*columns, DAY), folder, run)
        open_path = folder / OPEN_PART.format(run=run)
        opened.with_columns(split.alias("split")).select(columns).sink_parquet(
            open_path, compression=OUTPUT_COMPRESSION, compression_level=OUTPUT_COMPRESSION_LEVEL
        )
        summaries = {name: old_finished[name] for name in kept}
        summaries |= part_summaries([*written, open_path], config.data.features)
        summaries.setdefault(open_path.name, empty_summary(config.data.features))
        old_open = state.open_part()
        token_columns = ["event_type", *config.data.features]
        tokens = state.train_tokens(
            [*again, *([old_open] if old_open else [])], [*written, open_path], token_columns
        )
        vocabularies = Vocabularies.from_counts(tokens, token_columns, config.vocab.min_count)
        write_state(folder, tokens, parts)
        manifest = this_run.manifest(
            data_start=min_or_none(state.data_start, *(p.data_start for p in parts)),
            data_end=data_end,
            features=list(config.data.features),
            cuts=cuts,
            parts=dict(sorted(summaries.items())),
            settled=settled,
            provisional=provisional,
            quarantined=staged.quarantined,
            event_map_matched=matched,
        )
        report = make_report(
            manifest, total, parts, observed_until,
            max_gap=config.journey.max_gap,
            split_fractions=list(config.split.fractions),  # train checks it acted
            this_run=run_summary(this_run, staged, total - state.total, opened, new_finished),
        )  # fmt: skip
        report = add_warnings(
            config, report, staged.features_left_out, staged.quarantined.get("late", 0),
            [p.top_user for p in parts if p.top_user], sum(p.events for p in parts),
        )  # fmt: skip
        write_quarantine(config, staged, quarantine_folder, run)
        vocabularies.save(folder)
        write_json(report.to_json(), folder / REPORT_FILE)
        manifest.save(folder)
    return IngestResult(report, journeys_folder, quarantine_folder, vocabularies)


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
    state = IngestState.of(config, journeys_folder, full)
    sources = resolve_sources(raw or config.paths.raw)
    if not state.is_empty:  # the journeys' features stay; only new files are read
        config = with_features(config, state.manifest.features)
        sources = state.new_sources(sources)
        if not sources:
            return up_to_date(state, quarantine_folder)
    late_before = state.data_end - config.ingest.late_allowed_delta if state.data_end else None
    with (
        scratch_dir(journeys_folder.parent, "ingest") as scratch,
        fingerprints_meanwhile([Path(source) for source in sources]) as fingerprints,
    ):
        # Per-event columns earlier files held: absent from the new files, they are null.
        held = [] if state.is_empty else config.data.event_columns
        staged = stage(config, scratch / "staged", sources, late_before, held)
        if staged.features != config.data.features:  # default features the log lacks
            if not state.is_empty:
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
            write_quarantine(config, staged, quarantine_folder, state.run)
            raise InputError(problem)
        built = scratch / "built"
        built.mkdir()
        build = BuildPartition(
            config=without_secrets(config),
            staged=staged.partitions,
            state=state.state_folder,
            scratch=built,
            horizon=closing_horizon(max_or_none(state.data_end, staged.data_end), config),
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
        this_run = ThisRun(state, files)
        return finish(config, staged, parts, journeys_folder, quarantine_folder, this_run)


def up_to_date(state: IngestState, quarantine_folder: Path) -> IngestResult:
    """No new raw file: the journeys stand as they are (nothing is read or written)."""
    folder = state.folder
    report = IngestReport.read(folder) if folder is not None else None
    if folder is None or report is None:  # a manifest without its report: not ours
        raise InputError(f"no ingest report beside the journeys at {folder}: run `--full`")
    run = RunSummary(
        mode="incremental", why="no new raw file: nothing to do", run=state.manifest.run
    )
    report = replace(report, ingest=run)
    return IngestResult(report, folder, quarantine_folder, Vocabularies.load(folder))


def ingest(config: Config, full: bool = False) -> dict[str, Any]:
    """`journeys ingest`: returns the report as the file beside the journeys holds it (and
    as the flows return it)."""
    return run_ingest(config, full=full).report.to_json()

"""Pass 1 of ingest: every raw row read once, into user partitions or quarantine.

`stage` streams the sources (`journeys.events.scan_events` validates each row) and sinks
valid rows into one folder per user hash bucket (all of a user's events land in one
partition, so pass 2 can build partitions independently) and quarantined rows into a
bucket of their own, then counts rows by source and reason in one query over what it
wrote. `write_quarantine` keeps the quarantined rows with their original values.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import polars as pl

from journeys.config import FLAG_TS, Config
from journeys.datasets import UTC_US
from journeys.errors import InputError, first_line
from journeys.events import (
    REASON,
    REASONS,
    ROW,
    ROW_HASH,
    SOURCE,
    TS,
    read_columns,
    scan_events,
    user_bucket,
)
from journeys.storage import atomic_dir, atomic_path

QUARANTINE_FILE = "quarantine.parquet"  # the full build's; a nightly run adds its own:
NIGHTLY_QUARANTINE_FILE = "quarantine-{:05d}.parquet"
QUARANTINE_BUCKET = -1
BUCKET = "_bucket"

# The passes' own files, read back once or twice and deleted: written for speed (lz4), not
# size. The journeys themselves: zstd at its fastest level, twice as fast to write as
# Polars' default level (3) for files 7% larger (10M events: 0.25 s against 0.51 s a part).
SCRATCH_COMPRESSION = "lz4"
OUTPUT_COMPRESSION, OUTPUT_COMPRESSION_LEVEL = "zstd", 1


@dataclass(frozen=True)
class Staged:
    """Pass 1's output: partition folders of valid rows, quarantined rows, counts."""

    folder: Path
    partitions: dict[int, Path]  # user bucket -> its folder of valid rows
    quarantine: list[Path]
    rows_read: int
    sources: list[str]
    quarantined: dict[str, int] = field(default_factory=dict)  # reason -> rows
    # file -> rows, quarantined and the quarantined rows by reason
    by_source: dict[str, dict[str, Any]] = field(default_factory=dict)
    features: list[str] = field(default_factory=list)  # data.features the log has
    features_left_out: list[str] = field(default_factory=list)  # default ones it lacks
    data_end: datetime | None = None  # the latest valid row's time


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


def read_quarantine(folder: Path) -> pl.DataFrame:
    """Every quarantined row: the full build's file and one per nightly run since."""
    return pl.read_parquet(sorted(folder.glob("quarantine*.parquet")))

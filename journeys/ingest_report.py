"""The ingest report (`ingest_report.json`, beside the journeys): what every run so far
read, kept, quarantined and built, with what this run did under `ingest`.

`make_report` sums the manifest's part summaries and counters (it reads no journey) and
checks the row accounting before anything is written, into the typed report
(`journeys.datasets.IngestReport`, which every other stage reads); `print_report` is the
command's table.
"""

from __future__ import annotations

import sys
from datetime import datetime
from typing import Any

import polars as pl

from journeys.datasets import NO_SPLIT, SPLITS, IngestReport, RunSummary
from journeys.events import REASONS
from journeys.ingest_state import Manifest, ThisRun, file_key, from_iso, iso
from journeys.sessionise import Counts, PartitionResult
from journeys.staging import Staged


def run_summary(
    this_run: ThisRun,
    staged: Staged,
    counts: Counts,
    opened: pl.LazyFrame,
    new_finished: pl.LazyFrame,
) -> RunSummary:
    """What this run did: its mode, the files and rows it read (their accounting holds on
    its own), and the journeys it added, extended (more events) and closed."""
    now = pl.concat(
        [new_finished.select("journey_id", "n_events_total"),
         opened.select("journey_id", "n_events_total")]
    ).collect()  # fmt: skip
    old_open = this_run.state.open_part()
    before = (
        pl.read_parquet(old_open, columns=["journey_id", "n_events_total"])
        if old_open is not None
        else pl.DataFrame(schema={"journey_id": pl.String, "n_events_total": pl.Int32})
    )
    matched = now.join(before, on="journey_id", how="inner", suffix="_before")
    closed = new_finished.select("journey_id").collect().join(before, on="journey_id")
    quarantined = sum(staged.quarantined.values())
    rows_valid = counts.rows_valid - counts.duplicates_dropped - counts.dropped_by_config
    summary = RunSummary(
        mode=this_run.mode,
        why=this_run.state.why,
        run=this_run.number,
        new_files=[str(source) for source in staged.sources],
        rows_read=staged.rows_read,
        rows_valid=rows_valid,
        quarantined_total=quarantined,
        late=staged.quarantined.get("late", 0),
        duplicates_dropped=counts.duplicates_dropped,
        dropped_by_config=counts.dropped_by_config,
        journeys_added=now.height - matched.height,
        journeys_extended=matched.filter(
            pl.col("n_events_total") != pl.col("n_events_total_before")
        ).height,
        journeys_closed=closed.height,
        journeys_open=opened.select(pl.len()).collect().item(),
    )
    accounted = rows_valid + quarantined + counts.duplicates_dropped + counts.dropped_by_config
    if staged.rows_read != accounted:
        raise AssertionError(f"row accounting broken for this run: {summary}")  # a bug
    return summary


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
    *,
    max_gap: str,
    split_fractions: list[float],
    this_run: RunSummary,
) -> IngestReport:
    """The ingest report over every run so far (sums of the manifest's part summaries and
    counters); checks the row-accounting invariant before anything is written."""
    summaries = list(manifest.parts.values())
    by_split = {s: sum(p["by_split"][s] for p in summaries) for s in (*SPLITS, NO_SPLIT)}
    quarantined = {reason: manifest.quarantined.get(reason, 0) for reason in REASONS}
    conversions: dict[str, int] = {}  # rows name their file as it was given: key it
    for source, count in total.conversions_by_source.items():
        conversions[file_key(source)] = conversions.get(file_key(source), 0) + count
    report = IngestReport(
        rows_read=sum(f["rows"] for f in manifest.files.values()),
        rows_valid=total.rows_valid - total.duplicates_dropped - total.dropped_by_config,
        quarantined=quarantined,
        quarantined_total=sum(quarantined.values()),
        duplicates_dropped=total.duplicates_dropped,
        dropped_by_config=total.dropped_by_config,
        dropped_after_conversion=total.dropped_after_conversion,
        journeys=sum(p["journeys"] for p in summaries),
        journeys_converted=sum(p["converted"] for p in summaries),
        journeys_censored=sum(p["censored"] for p in summaries),
        journeys_by_split=by_split,
        journeys_converted_near_end=sum(p["converted_near_end"] for p in summaries),
        conversions_without_journey=total.conversions_without_journey,
        repeat_conversions=total.repeat_conversions,
        events_in_journeys=sum(p["events"] for p in summaries),
        events_kept=sum(p["kept"] for p in summaries),
        users=sum(p.users for p in parts),
        data_start=from_iso(manifest.data_start),
        data_end=from_iso(manifest.data_end),
        observed_until=observed_until,
        partitions=len(parts),
        feature_presence=feature_presence(summaries),
        sources=list(manifest.files),
        by_source={
            source: {
                "rows": facts["rows"],
                "quarantined": facts["quarantined"],
                "quarantined_by_reason": facts.get("reasons", {}),
                "conversions": conversions.get(source, 0),
            }
            for source, facts in manifest.files.items()
        },
        max_gap=max_gap,
        split_fractions=split_fractions,
        ingest=this_run,
    )
    accounted = (
        report.rows_valid
        + report.quarantined_total
        + report.duplicates_dropped
        + report.dropped_by_config
    )
    if report.rows_read != accounted:
        raise AssertionError(f"row accounting broken: {report}")  # a bug, never bad input
    return report


def run_line(run: RunSummary | None) -> str:
    """What this run did, in one line (the table above is over every run)."""
    if run is None or not run.new_files:
        return "journeys ingest: up to date: no new raw file, nothing read or written"
    return (
        f"journeys ingest: {run.mode} ({run.why}): {len(run.new_files)} new file(s), "
        f"{run.rows_read:,} rows ({run.quarantined_total:,} quarantined, {run.late:,} "
        f"of them late); journeys added {run.journeys_added:,}, extended "
        f"{run.journeys_extended:,}, closed {run.journeys_closed:,}; "
        f"{run.journeys_open:,} open"
    )


def print_report(report: IngestReport) -> None:
    """The ingest report as a readable table."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="ingest report", show_header=False)
    table.add_column("what")
    table.add_column("count", justify="right")
    for key in ("rows_read", "rows_valid", "quarantined_total"):
        table.add_row(key, f"{getattr(report, key):,}")
    for reason, count in report.quarantined.items():
        table.add_row(f"  {reason}", f"{count:,}")
    for key in ("duplicates_dropped", "dropped_by_config", "users", "journeys"):
        table.add_row(key, f"{getattr(report, key):,}")
    for key in (
        "journeys_converted", "journeys_censored", "conversions_without_journey",
        "repeat_conversions",
    ):  # fmt: skip
        table.add_row(f"  {key.removeprefix('journeys_')}", f"{getattr(report, key):,}")
    for split, count in report.journeys_by_split.items():
        table.add_row(f"  split {split}", f"{count:,}")
    table.add_row("data range", f"{iso(report.data_start)} .. {iso(report.data_end)}")
    Console().print(table)
    print(run_line(report.ingest))
    for warning in report.warnings:
        print(f"journeys ingest: warning: {warning}", file=sys.stderr)

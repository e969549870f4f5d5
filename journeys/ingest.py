"""Validated events -> labelled journeys, a temporal split and train-only vocabularies.

Stage two of the pipeline (`journeys ingest`). A user's time-ordered events split into
journeys after a gap longer than `journey.max_gap` or after a conversion event. The
conversion event labels its journey and is cut from the sequence, so the model never sees
the outcome it predicts. Outputs (journeys, vocabularies, report; quarantine) are swapped
in atomically: readers see the previous complete output or the new one.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import polars as pl

from journeys.config import Config
from journeys.events import ROW, SOURCE, TS, Events, read_events
from journeys.storage import atomic_dir, write_json
from journeys.vocab import Vocabularies, Vocabulary

JOURNEYS_FILE = "journeys.parquet"
REPORT_FILE = "ingest_report.json"
QUARANTINE_FILE = "quarantine.parquet"
SPLITS = ("train", "val", "test")
NO_SPLIT = "none"  # censored journeys: scored, never trained or evaluated on
ROW_ORDER = "_order"


def journey_id_expr(user: str = "user_id", start: str = "start_time") -> pl.Expr:
    """Deterministic id: the user and the first event's UTC instant in microseconds."""
    return pl.format("{}-{}", pl.col(user), pl.col(start).dt.epoch("us"))


def sort_events(events: pl.DataFrame, features: list[str]) -> pl.DataFrame:
    """Order by (user, time), ties by content then source position.

    Breaking timestamp ties by content first makes the result independent of the
    arrival order of files and rows; rows identical in content are interchangeable.
    """
    return events.sort(["user_id", TS, "event_type", *features, SOURCE, ROW], nulls_last=True)


@dataclass(frozen=True)
class Sessionised:
    journeys: pl.DataFrame
    orphan_conversions: int  # conversions with no event before them in their journey
    dropped_after_conversion: int  # with journey.after_conversion = drop


def build_journeys(events: pl.DataFrame, config: Config, data_end: datetime | None) -> Sessionised:
    """Sessionise sorted events into labelled journeys (see the module docstring)."""
    features = config.data.features
    max_gap = config.journey.max_gap_delta
    max_events = config.journey.max_events

    # Events are sorted by user then time, so plain shifts compare each event with the
    # previous one of the same user.
    new_user = (pl.col("user_id") != pl.col("user_id").shift(1)).fill_null(True)
    long_gap = (pl.col(TS).diff() > max_gap).fill_null(True)
    tagged = events.with_columns(
        _conversion=pl.col("event_type").is_in(config.data.conversion_events),
        _visit=(new_user | long_gap).cum_sum(),
    )
    dropped_after = 0
    if config.journey.after_conversion == "drop":
        # Drop what follows a conversion until the next long gap (e.g. a loan's back-office
        # steps after approval): such events belong to the converted journey's aftermath.
        seen = pl.col("_conversion").cast(pl.Int32).cum_sum().over("_visit", order_by=ROW_ORDER)
        after = (seen - pl.col("_conversion").cast(pl.Int32)) > 0
        kept = tagged.with_row_index(ROW_ORDER).filter(~after).drop(ROW_ORDER)
        dropped_after = tagged.height - kept.height
        tagged = kept
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

    censored = pl.lit(False)
    if data_end is not None:
        censored = (pl.col("label") == 0) & (pl.lit(data_end) - pl.col("end_time") <= max_gap)
    journeys = journeys.with_columns(
        journey_id_expr().alias("journey_id"),
        pl.col("event_type").list.len().cast(pl.Int32).alias("n_events"),
        censored.alias("censored"),
    )
    columns = [
        "journey_id", "user_id", "start_time", "end_time", "n_events", "n_events_total",
        "label", "censored", "event_type", "event_time", *features,
    ]  # fmt: skip
    return Sessionised(
        journeys.select(columns).sort(["user_id", "start_time"]), empty.height, dropped_after
    )


def assign_split(journeys: pl.DataFrame, fractions: tuple[float, float, float]) -> pl.DataFrame:
    """Split by journey end time: the earliest ends train, the latest test; censored -> none.

    Cuts are placed at end-time values, so journeys ending at the same instant share a
    split and every train journey ends strictly before every val journey (val before test).
    """
    ends = journeys.filter(~pl.col("censored")).get_column("end_time").sort()
    n = ends.len()
    split = pl.lit(NO_SPLIT)
    if n:
        val_cut = ends[min(int(n * fractions[0]), n - 1)]
        test_cut = ends[min(int(n * (fractions[0] + fractions[1])), n - 1)]
        if fractions[2] == 0:
            test_cut = None
        if fractions[1] == 0:
            val_cut = test_cut
        split = (
            pl.when(pl.col("censored"))
            .then(pl.lit(NO_SPLIT))
            .when(pl.lit(val_cut is None) | (pl.col("end_time") < val_cut))
            .then(pl.lit("train"))
            .when(pl.lit(test_cut is None) | (pl.col("end_time") < test_cut))
            .then(pl.lit("val"))
            .otherwise(pl.lit("test"))
        )
    return journeys.with_columns(split.alias("split"))


def build_vocabularies(journeys: pl.DataFrame, config: Config) -> Vocabularies:
    """Token vocabularies from the train split's sequences only (nothing from val/test)."""
    train = journeys.filter(pl.col("split") == "train")
    by_column: dict[str, Vocabulary] = {}
    for name in ["event_type", *config.data.features]:
        counts = (
            train.select(pl.col(name).explode().alias("token")).group_by("token").len(name="count")
        )
        by_column[name] = Vocabulary.from_counts(counts, config.vocab.min_count)
    return Vocabularies(by_column=by_column, min_count=config.vocab.min_count)


@dataclass(frozen=True)
class IngestResult:
    events: Events
    journeys: pl.DataFrame
    vocabularies: Vocabularies
    report: dict[str, Any]


def make_report(events: Events, built: Sessionised, journeys: pl.DataFrame) -> dict:
    quarantined = events.quarantined
    quarantined_total = sum(quarantined.values())
    rows_valid = events.valid.height - built.dropped_after_conversion
    dropped_by_config = events.dropped_by_config + built.dropped_after_conversion
    by_split = dict.fromkeys([*SPLITS, NO_SPLIT], 0)
    for split, count in journeys.group_by("split").len().iter_rows():
        by_split[split] = count
    report = {
        "rows_read": events.rows_read,
        "rows_valid": rows_valid,
        "quarantined": quarantined,
        "quarantined_total": quarantined_total,
        "duplicates_dropped": events.duplicates_dropped,
        "dropped_by_config": dropped_by_config,
        "dropped_after_conversion": built.dropped_after_conversion,
        "journeys": journeys.height,
        "journeys_converted": int(journeys.get_column("label").sum()),
        "journeys_censored": int(journeys.get_column("censored").sum()),
        "journeys_by_split": by_split,
        "conversions_without_journey": built.orphan_conversions,
        "events_in_journeys": int(journeys.get_column("n_events_total").sum()),
        "events_kept": int(journeys.get_column("n_events").sum()),
        "users": events.valid.get_column("user_id").n_unique(),
        "data_start": events.valid.get_column(TS).min(),
        "data_end": events.data_end,
        "sources": events.sources,
    }
    accounted = rows_valid + quarantined_total + events.duplicates_dropped
    if events.rows_read != accounted + dropped_by_config:
        raise AssertionError(f"row accounting broken: {report}")  # a bug, never bad input
    return report


def run_ingest(config: Config, raw: str | Path | None = None) -> IngestResult:
    """Everything but writing: read, validate, sessionise, label, split, build vocabularies."""
    events = read_events(raw or config.paths.raw, config.data)
    ordered = sort_events(events.valid, config.data.features)
    built = build_journeys(ordered, config, events.data_end)
    journeys = assign_split(built.journeys, config.split.fractions)
    vocabularies = build_vocabularies(journeys, config)
    report = make_report(events, built, journeys)
    return IngestResult(events, journeys, vocabularies, report)


def ingest(config: Config) -> dict[str, Any]:
    """`journeys ingest`: run and write journeys, vocabularies, report and quarantine."""
    result = run_ingest(config)
    with atomic_dir(config.paths.quarantine) as folder:
        result.events.quarantine.write_parquet(folder / QUARANTINE_FILE)
    with atomic_dir(config.paths.journeys) as folder:
        result.journeys.write_parquet(folder / JOURNEYS_FILE)
        result.vocabularies.save(folder)
        write_json(result.report, folder / REPORT_FILE)
    return result.report


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

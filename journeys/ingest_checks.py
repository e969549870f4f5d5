"""What looks wrong in a log: the guards that stop an ingest with one line naming the fix,
and the warnings its report carries (each with its figures and its fix). Results a user
could mistake for real ones are refused; odd but possible ones are warned about.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from journeys.datasets import NO_SPLIT, IngestReport
from journeys.errors import InputError
from journeys.events import REASON, TS, format_that_reads

if TYPE_CHECKING:
    from journeys.config import Config, Ingest

TOP_EVENT_TYPES = 5  # listed when no conversion event is found


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
    "late": "they are older than ingest.late_allowed before the data already ingested (a file "
    "delivered again?): `journeys ingest --full` takes them in",
}


def quarantine_problem(
    config: Config, rows_read: int, quarantined: dict[str, int], files: list[Path]
) -> str | None:
    """The one-line error when more than `ingest.max_quarantined_share` of the rows read
    were quarantined (`files`: the quarantined rows): the configuration, not the data, is
    almost surely wrong. None when the share is below."""
    total = sum(quarantined.values())
    if total == 0 or total / rows_read <= config.ingest.max_quarantined_share:
        return None
    share = total / rows_read
    reason = max(quarantined, key=quarantined.__getitem__)
    parsed = (
        pl.scan_parquet(files)
        .filter(pl.col(REASON) == reason)
        .select(low=pl.col(TS).min(), high=pl.col(TS).max())
    )
    low, high = parsed.collect().row(0)
    seen = f" (timestamps parsed to {low:%Y-%m-%d} .. {high:%Y-%m-%d})" if low else ""
    fix = FIXES.get(reason, "check data.columns").format(unit=config.data.timestamp_unit)
    if reason == "bad_timestamp":
        fix = timestamp_fix(config, files) or fix
    return (
        f"{total:,} of {rows_read:,} rows ({share:.0%}) were quarantined, most as "
        f"{reason}{seen}: {fix}; the quarantine is in {config.paths.quarantine}, the journeys "
        f"are unchanged (ingest.max_quarantined_share {config.ingest.max_quarantined_share})"
    )


def timestamp_fix(config: Config, files: list[Path]) -> str | None:
    """For timestamps that did not parse: a sample value and the setting that reads it."""
    sample = (
        pl.scan_parquet(files)
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


def warn_unmatched_event_map(config: Config, seen: frozenset[str]) -> None:
    """A `data.event_map` key that matches no event type is probably misspelt: warn."""
    unmatched = sorted(set(config.data.event_map) - seen)
    if unmatched:
        print(
            f"journeys ingest: warning: data.event_map keys {unmatched} match no event type",
            file=sys.stderr,
        )


def require_conversions(
    config: Config, conversions: int, rows_valid: int, journeys: pl.LazyFrame
) -> None:
    """Stop (InputError) when no row is a conversion: every label would be 0, and only
    training, much later, would complain (`ingest.require_conversions: false` to score)."""
    if not config.ingest.require_conversions or conversions or not rows_valid:
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


def add_warnings(
    config: Config,
    report: IngestReport,
    features_left_out: list[str],
    late: int,
    top_users: list[tuple[str, int]],
    events: int,
) -> IngestReport:
    """The report with its `short_export` and `warnings` (each with its figures and its
    fix): `late` rows quarantined by this run, each partition's user with the most events
    of the `events` kept."""
    unsplit = report.journeys_by_split[NO_SPLIT]
    short = report.journeys and unsplit / report.journeys > config.ingest.warn_unsplit_share
    # A short export, apart: `train` refuses an empty split with it (datasets.check_trainable).
    short_export = unsplit_warning(report) if short else None
    left_out = features_left_out
    warnings = [
        *([short_export] if short_export else []),
        *report_warnings(config, report, top_users, events),
        *(
            [f"the default features {left_out} are not in the log: ingested without them "
             "(data.features names the ones to use)"]
            if left_out else []
        ),
        *(
            [f"{late:,} rows are older than ingest.late_allowed ({config.ingest.late_allowed}) "
             "before the data already ingested: quarantined as late; `journeys ingest --full` "
             "takes them in"]
            if late else []
        ),
    ]  # fmt: skip
    return replace(report, short_export=short_export, warnings=warnings)


def report_warnings(
    config: Config, report: IngestReport, top_users: list[tuple[str, int]], events: int
) -> list[str]:
    """What looks wrong in a log though no row is, each with its figures and its fix (the
    short export apart: `unsplit_warning`)."""
    settings, warnings = config.ingest, []
    conversions = sum(source["conversions"] for source in report.by_source.values())
    repeats = report.repeat_conversions
    if config.journey.repeat_conversions == "new_journey":
        repeats = 0  # touches of the next journey: none of them is an orphan
    orphans = report.conversions_without_journey - repeats
    share = settings.warn_orphan_conversion_share
    if conversions and repeats / conversions > share:
        warnings.append(
            f"{repeats:,} of {conversions:,} conversions ({repeats / conversions:.0%}) come "
            "straight after another conversion of the user, no touch between (repeat "
            "purchases, second clickouts): they count with the one before and label no "
            "journey; journey.repeat_conversions: new_journey makes each the first touch of "
            "the next journey"
        )
    if conversions and orphans / conversions > share:
        warnings.append(
            f"{orphans:,} of {conversions:,} conversions ({orphans / conversions:.0%}) label "
            "no journey (no event of the user before them in their journey, and not a "
            "repeat of a conversion): check that the touches and the conversions share "
            "data.columns.user_id, or shorten journey.max_gap if they come long after the "
            "touches"
        )
    if events and top_users and report.users >= MIN_USERS_FOR_SKEW:
        user, count = max(top_users, key=lambda top: top[1])
        if count / events > settings.warn_top_user_share:
            warnings.append(
                f"user id {user!r} holds {count:,} of {events:,} events ({count / events:.0%}): "
                "a placeholder for unknown users? list it in data.exclude_users (its rows are "
                "then dropped and counted)"
            )
    warnings += source_quarantine_warnings(report.by_source, settings.warn_source_quarantine_factor)
    warnings += feature_split_warnings(report.feature_presence, settings)
    return warnings


def feature_split_warnings(
    presence: dict[str, dict[str, float | None]], settings: Ingest
) -> list[str]:
    """A warning per feature that val or test holds far less often than train (a column
    that left the export, or joined it): the model learns from values its evaluation and
    the journeys it scores lack."""
    warnings = []
    for name, shares in presence.items():
        train = shares.get("train")
        if not train or train < settings.warn_feature_min_share:
            continue
        for split in ("val", "test"):
            share = shares.get(split)
            if share is not None and share < train * settings.warn_feature_split_ratio:
                warnings.append(
                    f"feature {name} is on {share:.0%} of the {split} events against {train:.0%} "
                    f"of train's: did the column leave the export? the model learns from "
                    f"values the {split} split lacks (drop it from data.features, or fill it)"
                )
    return warnings


# With fewer users than this, one user holding many events is no sign of a placeholder.
MIN_USERS_FOR_SKEW = 20
# A file's quarantine rate below this never warns, however far above the others it is.
MIN_WARNED_QUARANTINE_RATE = 0.05


def source_quarantine_warnings(by_source: dict[str, dict[str, Any]], factor: float) -> list[str]:
    """A warning per source file whose quarantine rate is `factor` times the others',
    naming its commonest reason, that reason's count and fix."""
    warnings = []
    for source, counts in by_source.items():
        rows, quarantined = counts["rows"], counts["quarantined"]
        other_rows = sum(c["rows"] for s, c in by_source.items() if s != source)
        if not rows or not other_rows:
            continue
        rate = quarantined / rows
        others = sum(c["quarantined"] for s, c in by_source.items() if s != source) / other_rows
        if rate >= MIN_WARNED_QUARANTINE_RATE and rate > factor * others:
            reasons = counts.get("quarantined_by_reason") or {}
            why = "see the quarantine's reasons for that file"
            if reasons:
                reason, count = max(reasons.items(), key=lambda item: (item[1], item[0]))
                why = f"most as {reason} ({count:,} rows): {FIXES.get(reason, why)}"
            warnings.append(
                f"{source}: {quarantined:,} of {rows:,} rows ({rate:.0%}) quarantined, against "
                f"{others:.1%} in the other files; {why}"
            )
    return warnings


def unsplit_warning(report: IngestReport) -> str:
    """Most journeys end too near the data's end to be labelled: the log is short against
    `journey.max_gap`. The same line `train` refuses with."""
    journeys, unsplit = report.journeys, report.journeys_by_split[NO_SPLIT]
    span = "?"
    if report.data_start and report.data_end:
        span = f"{(report.data_end - report.data_start).total_seconds() / 86400:.1f} days"
    return (
        f"{unsplit:,} of {journeys:,} journeys ({unsplit / journeys:.0%}) take no split: they "
        f"end within journey.max_gap ({report.max_gap or '?'}) of the data's end, and the "
        f"log spans {span}; lower journey.max_gap (a session log: 30m to 1d), or set "
        "data.observed_until if the outcomes are known to a later moment"
    )

"""Monitoring: can tonight's scores be trusted? (`journeys monitor`, docs/monitoring.md)

Each night is compared with a reference: what the champion was trained and judged on (its
val split's events, journeys and served probabilities, and the ingest's rates), saved with
the model as `reference.json`, so a monitor never re-reads the history. The night is what
the last ingest added: the events after the previous night's end, the journeys that closed
since (their lengths and probabilities are final, like the reference's), the rows its new
files brought and quarantined.

Every check gives a figure (an effect size) and, where sampling can explain it, a p-value.
An alert needs both: significance with the night's tests taken together (Benjamini and
Hochberg 1995 at `monitor.fdr`, so a threshold knows its sample size: a fixed PSI cut-off
fires on most identical samples of 100 rows and on none of 1,000) and an effect above the
check's floor (`monitor.*`), so a large night does not alert on a trivial shift.

Performance once labels arrive: every night snapshots the open journeys' probabilities
(`open.parquet`); a later night looks each cohort's journeys up. Conversions so far are
held against those the probabilities promise by now (the delay curve saved with the
reference). Once a cohort has matured (`journey.max_gap` and `ingest.late_allowed` after
its night; a journey that keeps receiving events stays open longer), its realised ROC AUC
(DeLong interval), ECE and observed against expected conversions are reported beside the
estimate made without labels (CBPE: the expected ROC AUC under calibrated probabilities),
so a reader sees how far the estimate can be trusted; the two are compared for an alert
once the cohort has settled (`monitor.settled_share` of its outcomes known).
"""

from __future__ import annotations

import base64
import io
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from journeys.datasets import (
    MONITOR_DIR,
    OPEN_PART_PREFIX,
    IngestReport,
    scan_journeys,
    scan_scores,
)
from journeys.errors import InputError
from journeys.reference import (
    QUANTILES,
    Profile,
    Reference,
    Sketch,
    event_rows,
    finite,
    profile,
)
from journeys.storage import atomic_dir, atomic_path

if TYPE_CHECKING:
    from journeys.config import Config, Monitor
    from journeys.trained_model import TrainedModel

HISTORY_FILE = "history.parquet"
REPORT_JSON = "report.json"
PAGE_FILE = "index.html"
OPEN_SNAPSHOT = "open.parquet"  # the night's open journeys and their probabilities
# A journey's id as the cohorts look its outcome up: a 64-bit hash joins a million
# snapshot rows several times faster than the strings (two of the half million journeys
# of a 90-day history share one with a chance below 1e-8).
JOURNEY_KEY = pl.col("journey_id").cast(pl.String).hash().alias("key")
SNAPSHOT_SCHEMA = pl.Schema({
    "journey_id": pl.String,
    "conversion_probability": pl.Float64,
    "as_of": pl.Datetime("us", "UTC"),
    "quiet_seconds": pl.Float64,
})  # fmt: skip
MIN_EXPECTED = 5.0  # categories expected fewer times than this are pooled for chi-square
COHORT_INTERVAL = 0.99  # the interval of a cohort's expected conversions
FIRST_NIGHT = timedelta(days=1)  # a first night, with no history, is the day before the end
PLOTTED_CATEGORIES = 12  # the commonest values of a column in its plot
MONITOR_PLOT_DPI = 90  # the page's figures, embedded in index.html
PLOT_SHARE_OF_FLOOR = 0.5  # a column's mix is plotted once it moved this share of its floor


# ----------------------------------------------------------------------------- tests


@dataclass(frozen=True)
class Check:
    """One figure of the night against its reference."""

    check: str
    column: str | None
    message: str
    figure: float
    threshold: float  # the effect floor an alert needs
    p_value: float | None = None  # None: the check is a rule, not a test
    over_floor: bool = False
    alert: bool = False


def js_distance(night: dict[str, int], reference: dict[str, int]) -> float:
    """Jensen-Shannon distance (base 2, in [0, 1]) between two category counts."""
    keys = sorted(set(night) | set(reference))
    p = np.array([night.get(k, 0) for k in keys], dtype=np.float64)
    q = np.array([reference.get(k, 0) for k in keys], dtype=np.float64)
    if p.sum() == 0 or q.sum() == 0:
        return math.nan
    p, q = p / p.sum(), q / q.sum()
    m = (p + q) / 2

    def kl(a: np.ndarray) -> float:
        mask = a > 0
        return float(np.sum(a[mask] * np.log2(a[mask] / m[mask])))

    return math.sqrt(max(0.0, (kl(p) + kl(q)) / 2))


def chi_square_p(night: dict[str, int], reference: dict[str, int]) -> float:
    """Two-sample chi-square test of one category mix against another (categories
    expected fewer than `MIN_EXPECTED` times pooled)."""
    from scipy.stats import chi2_contingency

    keys = sorted(set(night) | set(reference))
    table = np.array([[night.get(k, 0) for k in keys], [reference.get(k, 0) for k in keys]])
    table = table[:, table.sum(axis=0) > 0].astype(np.float64)
    if table.shape[1] < 2 or (table.sum(axis=1) == 0).any():
        return 1.0
    expected = np.outer(table.sum(axis=1), table.sum(axis=0)) / table.sum()
    rare = expected.min(axis=0) < MIN_EXPECTED
    if rare.any() and (~rare).any():
        table = np.column_stack([table[:, ~rare], table[:, rare].sum(axis=1)])
    if table.shape[1] < 2:
        return 1.0
    return float(chi2_contingency(table, correction=False)[1])


def sketch_shift(night: Sketch, reference: Sketch) -> tuple[float, float]:
    """(Wasserstein distance over the reference's spread, K-S p-value), from the sketches'
    interior quantiles: the minimum and maximum of a heavy-tailed sample move from night
    to night with nothing changed, and would dominate both figures."""
    from scipy.stats import kstwobign

    if night.n == 0 or reference.n == 0:
        return math.nan, 1.0
    a, b = np.array(night.quantiles)[1:-1], np.array(reference.quantiles)[1:-1]
    levels = QUANTILES[1:-1]
    wasserstein = float(np.mean(np.abs(a - b)))
    spread = reference.std if reference.std > 0 else max(abs(reference.mean), 1.0)
    grid = np.union1d(a, b)
    night_cdf, reference_cdf = cdf_points(a, levels), cdf_points(b, levels)
    d = float(np.max(np.abs(np.interp(grid, *night_cdf) - np.interp(grid, *reference_cdf))))
    if len(night_cdf[0]) < len(a) or len(reference_cdf[0]) < len(b):
        # Atoms (a whole-number column): a sketch places the CDF at each only to within one
        # level, so two sketches of one distribution differ by up to that much there.
        d = max(0.0, d - float(levels[1] - levels[0]))
    effective = night.n * reference.n / (night.n + reference.n)
    return wasserstein / spread, float(kstwobign.sf(d * math.sqrt(effective)))


def smoothed_share(count: float, total: float) -> float:
    """A share seen as `count` of `total`, with half a count added (Jeffreys' prior): a
    baseline that saw none is not certain there are none. Against exactly 0 of 100,000,
    one unknown value in a 40-event night had p = 4e-11, swaying Benjamini-Hochberg's cut
    for the night's other tests; against half a count, 2e-4, near Fisher's exact 4e-4."""
    return (count + 0.5) / (total + 1)


def cdf_points(quantiles: np.ndarray, levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A sketch's CDF as points to interpolate: each distinct quantile value with the
    highest level at it. A whole-number column's atoms repeat a value over many levels,
    and interpolating over the repeats read an arbitrary level at them."""
    values, last = np.unique(quantiles[::-1], return_index=True)
    return values, levels[::-1][last]


def proportion_p(count: int, total: int, baseline: float) -> float:
    """One-sided p-value that `count` of `total` exceeds a share of `baseline`."""
    from scipy.stats import binom

    if total == 0:
        return 1.0
    return float(binom.sf(count - 1, total, min(max(baseline, 1e-12), 1.0)))


def benjamini_hochberg(p_values: list[float], rate: float) -> list[bool]:
    """Which of the tests are discoveries at false discovery rate `rate`."""
    order = np.argsort(p_values)
    m = len(p_values)
    passed = [p <= rate * (rank + 1) / m for rank, p in enumerate(np.array(p_values)[order])]
    last = max((rank for rank, ok in enumerate(passed) if ok), default=-1)
    discovered = [False] * m
    for rank, index in enumerate(order):
        discovered[index] = rank <= last
    return discovered


@dataclass(frozen=True)
class Night:
    """What the last ingest added: events after `start`, closed journeys, its files' rows."""

    night: str  # the date of `end`
    start: datetime
    end: datetime
    profile: Profile
    rows_read: int = 0
    quarantined: dict[str, int] = field(default_factory=dict)
    conversions: int = 0
    files: list[str] = field(default_factory=list)
    open_journeys: int = 0
    open_mean_probability: float = math.nan
    open_estimated_roc_auc: float = math.nan


def checks(
    night: Night,
    reference: Reference,
    baseline: dict[str, float],
    settings: Monitor,
    cohorts: Sequence[Check] = (),
) -> list[Check]:
    """Every check of the night (the `cohorts`' among them), each marked `alert` when
    significant (Benjamini-Hochberg over the night's tests) and over its floor (rules
    alert on their floor alone)."""
    found: list[Check] = list(cohorts)
    ref = reference.profile
    for column, counts in night.profile.categories.items():
        before = ref.categories.get(column)
        if not before or not counts:
            continue
        distance = js_distance(counts, before)
        total, total_before = sum(counts.values()), sum(before.values())
        moved = max(
            set(counts) | set(before),
            key=lambda k: abs(counts.get(k, 0) / total - before.get(k, 0) / total_before),
        )
        found.append(Check(
            "category_mix", column,
            f"{column}: the share of {moved!r} is {counts.get(moved, 0) / total:.1%} tonight "
            f"against {before.get(moved, 0) / total_before:.1%} in the reference "
            f"(Jensen-Shannon distance {distance:.3f})",
            distance, settings.min_js_distance, chi_square_p(counts, before),
            distance >= settings.min_js_distance,
        ))  # fmt: skip
    for column, lacked in night.profile.unknown.items():
        events = night.profile.events
        share = lacked / events if events else 0.0
        base = ref.unknown.get(column, 0) / ref.events if ref.events else 0.0
        top = ", ".join(f"{v!r} ({n:,})" for v, n in night.profile.unknown_top.get(column, []))
        found.append(Check(
            "unknown_values", column,
            f"{column}: {share:.1%} of tonight's events hold a value the model does not know "
            f"(reference {base:.2%})" + (f": {top}" if top else ""),
            share - base, settings.min_unknown_share,
            proportion_p(lacked, events, smoothed_share(ref.unknown.get(column, 0), ref.events)),
            share - base >= settings.min_unknown_share,
        ))  # fmt: skip
    sketches = [
        ("numeric_shift", name, night.profile.numeric[name], ref.numeric.get(name))
        for name in night.profile.numeric
    ]
    sketches += [
        ("journey_length", "n_events_total", night.profile.length, ref.length),
        ("gaps", "event_time", night.profile.gap_hours, ref.gap_hours),
        ("scores", "conversion_probability", night.profile.probability, ref.probability),
    ]
    for check, column, now, before in sketches:
        if before is None or now.n == 0 or before.n == 0:
            continue
        shift, p = sketch_shift(now, before)
        floor = settings.min_score_shift if check == "scores" else settings.min_shift
        found.append(Check(
            check, column,
            f"{column}: mean {now.mean:.4g} tonight ({now.n:,}) against {before.mean:.4g} in the "
            f"reference (shift {shift:.2f} of its spread)",
            shift, floor, p, shift >= floor,
        ))  # fmt: skip
    if night.profile.probability.n and ref.probability.n and ref.probability.mean > 0:
        ratio = night.profile.probability.mean / ref.probability.mean
        sd = ref.probability.std / math.sqrt(night.profile.probability.n)
        z = (night.profile.probability.mean - ref.probability.mean) / sd if sd > 0 else 0.0
        found.append(Check(
            "mean_probability", "conversion_probability",
            f"mean predicted probability {night.profile.probability.mean:.4f} tonight against "
            f"{ref.probability.mean:.4f} in the reference ({ratio:.2f}x)",
            either_way(ratio), settings.score_ratio, _two_sided(z),
            either_way(ratio) >= settings.score_ratio,
        ))  # fmt: skip
    valid = night.rows_read - sum(night.quarantined.values())
    if reference.conversions_per_row and valid > 0:
        expected = valid * reference.conversions_per_row
        ratio = night.conversions / expected
        p = poisson_p(night.conversions, expected)
        found.append(Check(
            "conversions", None,
            f"{night.conversions:,} conversions in tonight's {valid:,} valid rows, "
            f"{expected:,.0f} expected at the reference's rate ({ratio:.2f}x)",
            either_way(ratio), settings.conversion_ratio, p,
            either_way(ratio) >= settings.conversion_ratio,
        ))  # fmt: skip
    for reason, count in night.quarantined.items():
        base = baseline.get(reason, reference.quarantined_share.get(reason, 0.0))
        share = count / night.rows_read if night.rows_read else 0.0
        found.append(Check(
            "quarantine", reason,
            f"{count:,} of tonight's {night.rows_read:,} rows ({share:.1%}) quarantined as "
            f"{reason}, against {base:.2%} on recent nights",
            share - base, settings.min_quarantine_share,
            proportion_p(count, night.rows_read, base), share - base >= settings.min_quarantine_share,
        ))  # fmt: skip
    user, events = night.profile.busiest_user
    busiest_before = max(ref.busiest_user[1], 1)
    found.append(Check(
        "flood", "user_id",
        f"user id {user!r} has {events:,} events tonight; the busiest user-day of the "
        f"reference had {busiest_before:,}",
        events / busiest_before, settings.flood_factor, None,
        events / busiest_before >= settings.flood_factor,
    ))  # fmt: skip
    tested = [i for i, c in enumerate(found) if c.p_value is not None]
    discovered = benjamini_hochberg([_p(found[i].p_value) for i in tested], settings.fdr)
    significant = {i for i, yes in zip(tested, discovered, strict=True) if yes}
    return [
        replace(c, alert=c.over_floor and (c.p_value is None or i in significant))
        for i, c in enumerate(found)
    ]


def poisson_p(seen: int, expected: float) -> float:
    """Two-sided p-value of `seen` counts where a Poisson with mean `expected` is assumed."""
    from scipy.stats import poisson

    return min(1.0, float(2 * min(poisson.cdf(seen, expected), poisson.sf(seen - 1, expected))))


def either_way(ratio: float) -> float:
    """How far a ratio is from 1, either way: 0.5x and 2x are both 2 (none at all: inf)."""
    return max(ratio, 1.0 / ratio) if ratio > 0 else math.inf


def _p(value: float | None) -> float:
    return 1.0 if value is None or math.isnan(value) else value


def _two_sided(z: float) -> float:
    return math.erfc(abs(z) / math.sqrt(2))


# ----------------------------------------------------------------------------- performance


def expected_roc_auc(probabilities: np.ndarray) -> float:
    """CBPE: the ROC AUC expected if the probabilities are calibrated (each journey a
    positive with its probability), with no label at all."""
    p = np.sort(np.asarray(probabilities, dtype=np.float64))
    if p.size < 2:
        return math.nan
    negatives_below = np.cumsum(1.0 - p) - (1.0 - p)
    pairs = p.sum() * (1.0 - p).sum() - np.sum(p * (1.0 - p))
    return float(np.sum(p * negatives_below) / pairs) if pairs > 0 else math.nan


# A cohort's figures from its journeys whose outcome is known: they stand while no new
# outcome arrives (the known journeys only grow, and a known outcome is final).
LABELLED_FIGURES = (
    "estimated_roc_auc", "roc_auc", "roc_auc_ci", "roc_auc_se", "ece", "conversions_interval",
)  # fmt: skip


def cohort_figures(
    snapshots: pl.DataFrame,
    outcomes: pl.DataFrame,
    now: datetime,
    maturity: timedelta,
    earlier: dict[str, dict[str, Any]],
    reference: Reference,
    settings: Monitor,
) -> dict[str, dict[str, Any]]:
    """Earlier nights' open journeys (`snapshots`, `cohort` their snapshot's path) against
    what they did since, by cohort (named by its night): conversions so far against those
    expected by now (each journey's probability times the share of conversions that arrive
    within its elapsed time, `DelayCurve.share`); realised figures once a cohort has matured (`maturity`
    after its night) and holds enough conversions, beside the estimate without labels.
    A cohort with no new outcome since the `earlier` report keeps its labelled figures."""
    joined = snapshots.join(outcomes, on="key", how="left")
    elapsed = (now - joined.get_column("as_of")).dt.total_seconds().to_numpy() / 3600.0
    quiet = joined.get_column("quiet_seconds").fill_null(math.nan).to_numpy() / 3600.0
    probability = joined.get_column("conversion_probability").to_numpy()
    joined = joined.with_columns(
        so_far=pl.Series(probability * reference.conversion_delay.share(quiet, elapsed))
    )
    is_known = pl.col("outcome").is_not_null()
    sums = joined.group_by("cohort").agg(
        journeys=pl.len(),
        known=is_known.sum(),  # the rest are still open (a journey has no longest span)
        converted=(pl.col("outcome") == 1).sum(),
        # what the probabilities promise by now (NaN: no delay curve), and its variance
        expected_so_far=pl.col("so_far").sum(),
        so_far_variance=(pl.col("so_far") * (1 - pl.col("so_far"))).sum(),
        expected_conversions=pl.col("conversion_probability").filter(is_known).sum(),
        first=pl.col("as_of").min(),
    )
    sums = sums.with_columns(
        matured=pl.lit(now) - pl.col("first") >= maturity,
        night=pl.col("cohort").cast(pl.String).str.split("/").list.get(-2),
    )
    # Only a cohort with new outcomes (or matured tonight) has its labelled figures worked
    # out again: the known journeys only grow, and a known outcome is final.
    key = ["known", "converted", "expected_conversions", "matured"]
    unchanged = {
        row["cohort"] for row in sums.iter_rows(named=True)
        if all(earlier.get(row["night"], {}).get(k) == row[k] for k in key)
    }  # fmt: skip
    labelled = joined.filter(is_known, ~pl.col("cohort").is_in(list(unchanged)))
    by_cohort = labelled.partition_by("cohort", as_dict=True)
    cohorts = {}
    for row in sums.iter_rows(named=True):  # one row a cohort
        name, matured = row["night"], row["matured"]
        figures: dict[str, Any] = {
            "journeys": row["journeys"],
            "known": row["known"],
            "converted": row["converted"],
            "expected_so_far": row["expected_so_far"],
            "expected_so_far_interval": _normal_interval(
                row["expected_so_far"], row["so_far_variance"]
            ),
            "expected_conversions": row["expected_conversions"],  # among the known
            "matured": matured,
        }
        if row["cohort"] in unchanged:
            figures |= {k: v for k, v in earlier[name].items() if k in LABELLED_FIGURES}
        else:
            figures |= labelled_figures(by_cohort.get((row["cohort"],)), matured, settings)
        cohorts[name] = figures
    return cohorts


def labelled_figures(known: pl.DataFrame | None, matured: bool, settings: Monitor) -> dict[str, Any]:  # fmt: skip
    """A cohort's figures from its journeys whose outcome is `known`: CBPE's estimate, and
    once matured with `min_cohort_conversions`, the realised ROC AUC (DeLong interval and
    standard error), the ECE and the interval of the conversions expected."""
    from journeys.metrics import auc_interval, expected_calibration_error, roc_auc_with_se

    if known is None or known.height == 0:
        return {"estimated_roc_auc": math.nan}
    labels = known.get_column("outcome").to_numpy().astype(np.int64)
    probs = known.get_column("conversion_probability").to_numpy()
    # CBPE on the journeys whose outcome is known: what the realised figure is beside
    figures: dict[str, Any] = {"estimated_roc_auc": expected_roc_auc(probs)}
    if matured and settings.min_cohort_conversions <= labels.sum() < labels.size:
        auc, se = roc_auc_with_se(labels, probs)
        figures |= {
            "roc_auc": auc,
            "roc_auc_ci": list(auc_interval(auc, se)),
            "roc_auc_se": se,
            "ece": expected_calibration_error(labels, probs),
            "conversions_interval": _normal_interval(
                float(probs.sum()), float(np.sum(probs * (1 - probs)))
            ),
        }
    return figures


def _normal_interval(mean: float, variance: float) -> list[float]:
    """`COHORT_INTERVAL` interval of a number of conversions with this mean and variance
    (the normal approximation of the Poisson-binomial, each journey converting with its
    probability)."""
    from statistics import NormalDist

    if not (math.isfinite(mean) and math.isfinite(variance)):
        return [math.nan, math.nan]
    z = NormalDist().inv_cdf(0.5 + COHORT_INTERVAL / 2)
    sd = math.sqrt(max(variance, 0.0))
    return [max(0.0, mean - z * sd), mean + z * sd]


def outcomes(journeys_folder: Path, keys: pl.Series, since: datetime) -> pl.DataFrame:
    """key -> outcome, for the journeys whose `JOURNEY_KEY` is among `keys`: 1 converted,
    0 closed without converting (and not censored); journeys still open or censored are
    left out (their outcome is not known)."""
    found = (
        pl.scan_parquet(sorted(journeys_folder.glob("*.parquet")), include_file_paths="_file")
        .filter(pl.col("end_time") >= since)
        .select(JOURNEY_KEY, "label", "censored", "_file")
        .filter(pl.col("key").is_in(keys.implode()))
        .collect()
    )
    open_part = pl.col("_file").str.split("/").list.last().str.starts_with(OPEN_PART_PREFIX)
    known = (pl.col("label") == 1) | (~open_part & ~pl.col("censored").fill_null(False))
    outcome = pl.col("label").cast(pl.Int8).alias("outcome")
    return found.filter(known).select("key", outcome).unique("key", keep="any")


# ----------------------------------------------------------------------------- the night


@dataclass
class MonitorReport:
    night: str
    start: datetime
    end: datetime
    model: str
    checks: list[Check]
    cohorts: dict[str, dict[str, Any]]
    night_facts: dict[str, Any]

    @property
    def alerts(self) -> list[Check]:
        return [c for c in self.checks if c.alert]

    def to_json(self) -> dict[str, Any]:
        """Valid JSON: a figure that is not a number (NaN, inf) is null."""
        return finite({
            "night": self.night,
            "start": self.start.isoformat(),
            "end": self.end.isoformat(),
            "model": self.model,
            "alerts": [asdict(c) for c in self.alerts],
            "checks": [asdict(c) for c in self.checks],
            "cohorts": self.cohorts,
            "night_facts": self.night_facts,
        })  # fmt: skip


def monitor(config: Config, trained: TrainedModel) -> MonitorReport:
    """Tonight's monitor report, written under `paths.reports/monitor/<night>/`, with the
    night's row in `history.parquet` and its open journeys' snapshot."""
    journeys_folder = Path(config.paths.journeys)
    report = ingest_report(config)
    check_scores_current(config, report)
    reference = trained.reference
    if reference is None:
        raise InputError(
            "the champion has no monitoring reference (trained before `journeys monitor` "
            "existed): retrain with `journeys train`"
        )
    settings = config.monitor
    root = Path(config.paths.reports) / MONITOR_DIR
    history = read_history(root)
    end = report.data_end
    assert end is not None  # ingest_report checked it
    # A night is a date: run again on the same date (a second ingest, a rerun), it is
    # measured again from the end of the previous date, and replaces its row.
    earlier = history.filter(pl.col("night") < end.date().isoformat())
    start = earlier.get_column("end").max() if earlier.height else end - FIRST_NIGHT
    seen = set(earlier.get_column("sources").tail(1).explode().drop_nulls()) if earlier.height else None  # fmt: skip
    night, opened = measure_night(config, trained, report, start, end, seen)
    baseline = quarantine_baseline(earlier.tail(settings.recent_nights))
    last = last_report(root, night.night)
    earlier_cohorts = last.get("cohorts", {})
    cohorts = cohort_history(root, journeys_folder, end, earlier_cohorts, reference, config)
    # A cohort is updated for the last time on the night `cohort_horizon` after its own.
    last_update = (end - settings.cohort_horizon_delta).date().isoformat()
    promise = cohort_checks(cohorts, earlier_cohorts, last.get("night"), last_update, settings)
    found = checks(night, reference, baseline, settings, promise)
    result = MonitorReport(
        night.night, start, end, model_name(trained), found, cohorts,
        {
            "files": night.files, "events": night.profile.events, "rows_read": night.rows_read,
            "quarantined": sum(night.quarantined.values()), "conversions": night.conversions,
            "closed_journeys": night.profile.length.n, "open_journeys": night.open_journeys,
            "open_mean_probability": night.open_mean_probability,
            "open_estimated_roc_auc": night.open_estimated_roc_auc,
            "reference_roc_auc": reference.roc_auc,
        },
    )  # fmt: skip
    write_night(root, result, night, opened, reference, report.sources)
    return result


def model_name(trained: TrainedModel) -> str:
    """The model as reports name it: its URI (a password in it redacted) and version."""
    from journeys.config import redact_uri

    version = f" v{trained.model_version}" if trained.model_version else ""
    return f"{redact_uri(trained.model_uri)}{version}"


def ingest_report(config: Config) -> IngestReport:
    report = IngestReport.read(config.paths.journeys)
    if report is None or report.data_end is None:
        raise InputError(
            f"no ingest report beside the journeys at {config.paths.journeys}: run "
            "`journeys ingest` first"
        )
    return report


def check_scores_current(config: Config, report: IngestReport) -> None:
    """`InputError` when the scores stand before the journeys' end: a scoring that failed
    would otherwise be monitored as tonight's."""
    from journeys.datasets import scores_as_of

    as_of, end = scores_as_of(config.paths.scores), report.outcomes_until
    if as_of is not None and end is not None and as_of < end:
        raise InputError(
            f"the scores at {config.paths.scores} stand at {as_of:%Y-%m-%d %H:%M} and the "
            f"journeys at {end:%Y-%m-%d %H:%M}: run `journeys score` first"
        )


def measure_night(
    config: Config,
    trained: TrainedModel,
    report: IngestReport,
    start: datetime,
    end: datetime,
    seen: set[str] | None,
) -> tuple[Night, pl.DataFrame]:
    """The night's events, closed journeys and the rows of the files not `seen` by an
    earlier night (None: the last ingest's), and its open journeys' probabilities
    (journey_id, conversion_probability, as_of)."""
    categorical = list(trained.encoder.features)
    numeric = list(trained.encoder.numeric_features)
    journeys = scan_journeys(config.paths.journeys).filter(pl.col("end_time") > start)
    events = event_rows(journeys, categorical, numeric, start).collect()
    # Journeys whose visit closed tonight (the closing horizon moved from start's to
    # end's): their length and probability are final, as the reference's are.
    closing = config.ingest.late_allowed_delta + config.journey.max_gap_delta
    scores = scan_scores(config.paths.scores, start - closing)
    length = "n_events_total" if "n_events_total" in scores.collect_schema() else "n_events"
    last = pl.col("event_time").list.last()
    # One pass over the scores files for both (Polars shares the scan).
    closed, opened = pl.collect_all(
        [
            scores.filter(
                ~pl.col("open"), last.is_between(start - closing, end - closing, "right")
            ).select(
                "journey_id", "conversion_probability", pl.col(length).alias("n_events_total")
            ),
            scores.filter(pl.col("open")).select(
                "journey_id", "conversion_probability", "as_of", "quiet_seconds"
            ),
        ]
    )
    probabilities = closed.get_column("conversion_probability").to_numpy()
    vocabularies = trained.encoder.vocabs
    measured = profile(events, closed, categorical, numeric, vocabularies, probabilities, False)
    measured = replace(measured, busiest_user=busiest_user(events, journeys, start))
    if seen is None:
        run = report.ingest
        new_files = sorted({str(Path(f).absolute()) for f in (run.new_files if run else [])})
    else:  # every file since the last night monitored, if nights were skipped
        new_files = sorted(set(report.sources) - seen)
    facts = [report.by_source[f] for f in new_files if f in report.by_source]
    quarantined: dict[str, int] = {}
    for entry in facts:
        for reason, n in entry.get("quarantined_by_reason", {}).items():
            quarantined[reason] = quarantined.get(reason, 0) + n
    open_probs = opened.get_column("conversion_probability").to_numpy()
    night = Night(
        night=end.date().isoformat(),
        start=start,
        end=end,
        profile=measured,
        rows_read=sum(entry["rows"] for entry in facts),
        quarantined=quarantined,
        conversions=sum(entry.get("conversions", 0) for entry in facts),
        files=new_files,
        open_journeys=opened.height,
        open_mean_probability=float(open_probs.mean()) if open_probs.size else math.nan,
        open_estimated_roc_auc=expected_roc_auc(open_probs),
    )
    return night, opened


def busiest_user(events: pl.DataFrame, journeys: pl.LazyFrame, start: datetime) -> tuple[str, int]:
    """The user with the most events after `start`: the events the journeys' lists hold,
    and those `journey.max_events` cut from journeys that began after `start` (a bot's
    50,000 events keep only their tail in the lists)."""
    cut = (
        journeys.filter(pl.col("start_time") > start)
        .group_by("user_id")
        .agg(cut=(pl.col("n_events_total") - pl.col("n_events")).sum().cast(pl.Int64))
        .collect()
    )
    listed = events.group_by("user_id").agg(listed=pl.len().cast(pl.Int64))
    per_user = (
        listed.join(cut, on="user_id", how="left")
        .select("user_id", (pl.col("listed") + pl.col("cut").fill_null(0)).alias("events"))
        .sort("events", "user_id", descending=[True, False])
    )
    if per_user.height == 0:
        return ("", 0)
    return str(per_user.item(0, "user_id")), int(per_user.item(0, "events"))


def quarantine_baseline(recent: pl.DataFrame) -> dict[str, float]:
    """Per reason, the share of rows quarantined over the recent nights (pooled)."""
    if recent.height == 0 or recent.get_column("rows_read").sum() == 0:
        return {}
    rows = recent.get_column("rows_read").sum()
    pooled = recent.select(pl.col("quarantined_by_reason").explode()).unnest(
        "quarantined_by_reason"
    )
    if pooled.height == 0:
        return {}
    sums = pooled.group_by("reason").agg(pl.col("rows").sum())
    return {reason: n / rows for reason, n in sums.iter_rows()}


def cohort_history(
    root: Path,
    journeys_folder: Path,
    now: datetime,
    earlier: dict[str, dict[str, Any]],
    reference: Reference,
    config: Config,
) -> dict[str, dict[str, Any]]:
    """Each earlier night's open journeys against their outcomes so far, looked up in one
    query. A cohort the last report (its `earlier` cohorts) found settled (`settled`), or
    older than `monitor.cohort_horizon`, keeps its figures: a night's cost stays flat, and
    a judged cohort keeps the figures it was judged on."""
    maturity = config.journey.max_gap_delta + config.ingest.late_allowed_delta
    horizon = (now - config.monitor.cohort_horizon_delta).date().isoformat()
    cohorts, pending = {}, {}
    for path in sorted(root.glob(f"*/{OPEN_SNAPSHOT}")):
        name = path.parent.name
        if name.startswith("."):  # an interrupted swap's leftover
            continue
        kept = earlier.get(name)
        if kept and (name < horizon or settled(kept, config.monitor)):
            cohorts[name] = kept
            continue
        pending[name] = path
    if not pending:
        return cohorts
    # One scan over the snapshots still updating (tonight's own, as of now, is not yet a
    # cohort). Snapshots kept before `quiet_seconds` was have it null: their journeys get no
    # delay-adjusted expectation rather than a wrong one.
    snapshots = (
        pl.scan_parquet(
            list(pending.values()),
            schema=SNAPSHOT_SCHEMA,
            missing_columns="insert",
            include_file_paths="path",
            cast_options=pl.ScanCastOptions(
                float_cast="upcast", datetime_cast="nanosecond-downcast"
            ),
        )
        .filter(pl.col("as_of") < now)
        # The path as a category: the cohorts group by it several times faster than by
        # each row's night cut out of it.
        .select(
            JOURNEY_KEY,
            pl.exclude("journey_id", "path"),
            cohort=pl.col("path").cast(pl.Categorical),
        )
        .collect()
    )
    if snapshots.height == 0:
        return cohorts
    found = outcomes(
        journeys_folder,
        snapshots.get_column("key").unique(),
        snapshots.get_column("as_of").min() - maturity,
    )
    settings = config.monitor
    cohorts |= cohort_figures(snapshots, found, now, maturity, earlier, reference, settings)
    return dict(sorted(cohorts.items()))


def settled(cohort: dict[str, Any], settings: Monitor) -> bool:
    """Whether a cohort's figures are final: judged; or matured with every outcome known,
    or with its realised figures (`min_cohort_conversions`) and `monitor.settled_share` of
    its outcomes known. The outcomes still to come are those of the few journeys that stay
    open for weeks; a cohort short of conversions waits for them until the horizon."""
    if cohort.get("judged"):
        return True
    if not cohort["matured"]:
        return False
    known, journeys = cohort["known"], cohort["journeys"]
    return known == journeys or ("roc_auc" in cohort and known >= settings.settled_share * journeys)


def cohort_checks(
    cohorts: dict[str, dict[str, Any]],
    earlier: dict[str, dict[str, Any]],
    previous_night: str | None,
    last_update: str,
    settings: Monitor,
) -> list[Check]:
    """The model's promise, checked as labels arrive: the previous night's open journeys,
    their conversions since against what their probabilities and the delay curve expect by
    now (that one cohort, so no conversion is counted twice); and each matured cohort once
    settled (`monitor.settled_share` of its outcomes known, or its `last_update` night:
    judged on fewer, the unknown would be the journeys not converted yet), its realised ROC
    AUC against the estimate it had without labels (CBPE). A judged cohort is marked so."""
    found = []
    latest = cohorts.get(previous_night) if previous_night else None
    expected = latest.get("expected_so_far") if latest else None
    if latest and expected is not None and math.isfinite(expected) and expected > 0:
        seen = latest["converted"]
        ratio = seen / expected
        p = poisson_p(seen, expected)
        found.append(Check(
            "cohort_conversions", previous_night,
            f"{seen:,} of the {latest['journeys']:,} journeys open on {previous_night} converted "
            f"since; their probabilities expect {expected:,.1f} by now ({ratio:.2f}x)",
            either_way(ratio), settings.conversion_ratio, p,
            either_way(ratio) >= settings.conversion_ratio,
        ))  # fmt: skip
    for name, cohort in cohorts.items():
        if earlier.get(name, {}).get("judged") or cohort.get("judged"):
            cohort["judged"] = True  # carried forward: judged once
            continue
        if "roc_auc" not in cohort or not (settled(cohort, settings) or name <= last_update):
            continue  # not matured with enough conversions, or not settled yet
        cohort["judged"] = True
        realised, estimate = cohort["roc_auc"], cohort["estimated_roc_auc"]
        low, high = cohort["roc_auc_ci"]
        se = cohort.get("roc_auc_se") or 0.0
        drop = estimate - realised
        p = 0.5 * math.erfc(drop / se / math.sqrt(2)) if se > 0 else 1.0
        found.append(Check(
            "cohort_roc_auc", name,
            f"the journeys open on {name}, matured with {cohort['known']:,} of "
            f"{cohort['journeys']:,} outcomes known: ROC AUC {realised:.3f} [{low:.3f}, "
            f"{high:.3f}] against {estimate:.3f} their probabilities promised",
            drop, settings.min_auc_drop, p, drop >= settings.min_auc_drop,
        ))  # fmt: skip
    return found


def last_report(root: Path, before: str) -> dict[str, Any]:
    """The report.json of the latest night before the date `before` ({} if none)."""
    nights = sorted(
        p for p in root.glob(f"*/{REPORT_JSON}") if not p.parent.name.startswith(".")
        and p.parent.name < before
    )  # fmt: skip
    return json.loads(nights[-1].read_text()) if nights else {}


# ----------------------------------------------------------------------------- output


HISTORY_SCHEMA = {
    "night": pl.String,
    "end": pl.Datetime("us", "UTC"),
    "events": pl.Int64,
    "rows_read": pl.Int64,
    "conversions": pl.Int64,
    "open_journeys": pl.Int64,
    "open_mean_probability": pl.Float64,
    "open_estimated_roc_auc": pl.Float64,
    "alerts": pl.Int64,
    "alerted": pl.List(pl.String),
    "quarantined_by_reason": pl.List(pl.Struct({"reason": pl.String, "rows": pl.Int64})),
    "figures": pl.List(pl.Struct({"check": pl.String, "column": pl.String, "figure": pl.Float64})),
    "sources": pl.List(pl.String),  # every raw file ingested by then: the next night's are new
}


def read_history(root: Path) -> pl.DataFrame:
    path = root / HISTORY_FILE
    return pl.read_parquet(path) if path.exists() else pl.DataFrame(schema=HISTORY_SCHEMA)


def write_night(
    root: Path,
    result: MonitorReport,
    night: Night,
    opened: pl.DataFrame,
    reference: Reference,
    sources: list[str],
) -> None:
    """The night's folder (report.json, index.html, open.parquet), then its history row
    (a night monitored again replaces its row)."""
    with atomic_dir(root / result.night) as folder:
        opened.write_parquet(folder / OPEN_SNAPSHOT)
        text = json.dumps(result.to_json(), indent=2, allow_nan=False)
        (folder / REPORT_JSON).write_text(text + "\n")
        (folder / PAGE_FILE).write_text(page(result, night, reference))
    row = pl.DataFrame(
        {
            "night": [result.night],
            "end": [result.end],
            "events": [night.profile.events],
            "rows_read": [night.rows_read],
            "conversions": [night.conversions],
            "open_journeys": [night.open_journeys],
            "open_mean_probability": [_nan(night.open_mean_probability)],
            "open_estimated_roc_auc": [_nan(night.open_estimated_roc_auc)],
            "alerts": [len(result.alerts)],
            "alerted": [[f"{c.check}:{c.column}" for c in result.alerts]],
            "quarantined_by_reason": [
                [{"reason": r, "rows": n} for r, n in sorted(night.quarantined.items())]
            ],
            "figures": [
                [{"check": c.check, "column": c.column, "figure": _nan(c.figure)} for c in result.checks]
            ],
            "sources": [sources],
        },
        schema=HISTORY_SCHEMA,
    )  # fmt: skip
    history = read_history(root)
    history = pl.concat([history.filter(pl.col("night") != result.night), row]).sort("end")
    with atomic_path(root / HISTORY_FILE) as tmp:
        history.write_parquet(tmp)


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


def page(result: MonitorReport, night: Night, reference: Reference) -> str:
    """A self-contained HTML page: the alerts, every check, the cohorts, and the plots
    (PNG inlined), readable offline and small whatever the night's size."""
    from html import escape

    def table(rows: list[list[Any]], head: list[str]) -> str:
        cells = "".join(f"<th>{escape(h)}</th>" for h in head)
        body = "".join(
            "<tr>" + "".join(f"<td>{escape(_cell(v))}</td>" for v in row) + "</tr>" for row in rows
        )
        return f"<table><tr>{cells}</tr>{body}</table>"

    alerts = [[c.check, c.column or "", c.message] for c in result.alerts]
    every = [
        [c.check, c.column or "", c.figure, c.threshold, c.p_value, "ALERT" if c.alert else ""]
        for c in result.checks
    ]
    cohorts = [
        [name, c["journeys"], c["known"], c["converted"], c.get("expected_so_far"),
         _interval(c.get("expected_so_far_interval")), c["expected_conversions"],
         c.get("roc_auc"), c["estimated_roc_auc"], c.get("ece"), "yes" if c["matured"] else "no"]
        for name, c in sorted(result.cohorts.items())
    ]  # fmt: skip
    images = "".join(
        f'<figure><img alt="{escape(name)}" src="data:image/png;base64,{data}"/>'
        f"<figcaption>{escape(name)}</figcaption></figure>"
        for name, data in plots(night, reference, moved_columns(result.checks)).items()
    )
    status = f"{len(result.alerts)} alert(s)" if result.alerts else "no alert"
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>journeys monitor {escape(result.night)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:3px 8px;font-size:13px}}img{{max-width:720px}}</style>
</head><body>
<h1>Night {escape(result.night)}: {escape(status)}</h1>
<p>Events after {escape(result.start.isoformat())} up to {escape(result.end.isoformat())};
model {escape(result.model)}.</p>
<h2>Alerts</h2>{table(alerts, ["check", "column", "message"]) if alerts else "<p>none</p>"}
<h2>Every check</h2>{table(every, ["check", "column", "figure", "floor", "p-value", ""])}
<h2>Cohorts: open journeys of earlier nights, as their outcomes arrive</h2>
{
        table(
            cohorts,
            [
                "night",
                "journeys",
                "known",
                "converted",
                "expected by now",
                "99% interval",
                "expected of the known",
                "ROC AUC",
                "estimated ROC AUC",
                "ECE",
                "matured",
            ],
        )
    }
<h2>Plots</h2><p>Each column whose mix moved at least half its floor, and the probabilities.</p>{
        images
    }
</body></html>
"""


def _interval(bounds: list[float | None] | None) -> str:
    """An interval as the page shows it ('' when it has no finite bounds)."""
    if not bounds or any(b is None or not math.isfinite(b) for b in bounds):
        return ""
    return f"[{bounds[0]:.1f}, {bounds[1]:.1f}]"


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return "" if not math.isfinite(value) else f"{value:.4g}"
    return "" if value is None else str(value)


def moved_columns(found: list[Check]) -> set[str]:
    """The categorical columns whose mix moved by at least `PLOT_SHARE_OF_FLOOR` of its
    floor tonight: the ones worth a plot."""
    return {
        c.column for c in found
        if c.check == "category_mix" and c.column and c.figure >= PLOT_SHARE_OF_FLOOR * c.threshold
    }  # fmt: skip


def plots(night: Night, reference: Reference, columns: set[str]) -> dict[str, str]:
    """For each categorical column among `columns`, tonight's shares against the
    reference's (its commonest values); the probability distributions of closed journeys.
    Base64 PNGs (a plot costs about 0.1 s: a quiet night draws one)."""
    from matplotlib.ticker import LogFormatter

    from journeys.plots import figure_of

    images = {}
    for column, counts in night.profile.categories.items():
        if column not in columns:
            continue
        before = reference.profile.categories.get(column, {})
        keys = sorted(set(counts) | set(before), key=lambda k: -(counts.get(k, 0) + before.get(k, 0)))[:PLOTTED_CATEGORIES]  # fmt: skip
        if not keys:
            continue
        figure = figure_of(7, 3)
        axes = figure.subplots()
        x = np.arange(len(keys))
        for offset, (label, source) in enumerate((("tonight", counts), ("reference", before))):
            total = max(sum(source.values()), 1)
            axes.bar(x + 0.4 * offset, [source.get(k, 0) / total for k in keys], 0.4, label=label)
        axes.set_xticks(x + 0.2, keys, rotation=30, ha="right", fontsize=8)
        axes.set_ylabel("share of events")
        axes.set_title(column)
        axes.legend()
        images[f"{column} mix"] = _png(figure)
    now, before = night.profile.probability, reference.profile.probability
    if now.n and before.n:
        figure = figure_of(7, 3)
        axes = figure.subplots()
        axes.plot(QUANTILES, now.quantiles, label=f"tonight's closed journeys ({now.n:,})")
        axes.plot(QUANTILES, before.quantiles, label=f"reference ({before.n:,})")
        axes.set_xlabel("quantile")
        axes.set_ylabel("conversion probability")
        axes.set_yscale("log")
        # Plain tick labels: the default's mathtext (10^-2) is laid out glyph by glyph.
        axes.yaxis.set_major_formatter(LogFormatter())
        axes.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False))  # under a decade
        axes.legend()
        images["probability quantiles"] = _png(figure)
    return images


def _png(figure: Any) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=MONITOR_PLOT_DPI, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def run_monitor(config: Config) -> MonitorReport:
    """The night's monitor against the model that wrote tonight's scores; with alerts,
    that model version is tagged `monitor_alerts` (the night and what alerted)."""
    from journeys import tracking
    from journeys.attribution import scoring_model_uri
    from journeys.datasets import read_metadata
    from journeys.trained_model import load_model

    ingest_report(config)  # fails before the model loads; `monitor` checks the rest
    uri = scoring_model_uri(read_metadata(config.paths.scores))
    if uri is None:
        raise InputError(f"the scores at {config.paths.scores} do not name their model: re-score")
    store = tracking.tracking_uri(config)
    if uri.startswith(("models:/", "runs:/")) and not tracking.tracking_ready(store):
        raise InputError(f"model {uri} not found: no MLflow store at {tracking.redact_uri(store)}")
    trained = load_model(uri, tracking_uri=store)
    result = monitor(config, trained)
    if result.alerts and trained.model_version:
        alerted = ", ".join(f"{c.check} {c.column or ''}".strip() for c in result.alerts)
        tracking.tag_model_version(
            config, trained.model_version, "monitor_alerts", f"{result.night}: {alerted}"
        )
    return result


def alert_lines(result: MonitorReport) -> list[str]:
    """One line per alert: the night, the check and its message (naming the column)."""
    return [f"ALERT {result.night} {c.check}: {c.message}" for c in result.alerts]


def monitor_command(config: Config) -> MonitorReport:
    """`journeys monitor`: the night's report, its alerts printed one a line."""
    result = run_monitor(config)
    for line in alert_lines(result):
        print(f"journeys monitor: {line}")
    page = Path(config.paths.reports) / MONITOR_DIR / result.night / PAGE_FILE
    print(
        f"journeys monitor: night {result.night}: {len(result.checks)} checks, "
        f"{len(result.alerts)} alert(s) -> {page}"
    )
    return result

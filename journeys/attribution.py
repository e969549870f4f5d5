"""Attribution report: what the model credits, side by side with the classic rules.

Which attention is exported (`score.attention`)
-----------------------------------------------
By default `pooled`: the last layer's attention of the query the classifier reads, i.e.
the last event's row (the default `model.pooling: last`, and causal models; with `cls` the
CLS token's row, with `mean` the average of all rows), averaged over heads, padding
removed, renormalised to sum to 1 over the journey's events. It is cheap, O(L) extra per
journey: the fast SDPA path still computes the outputs and only that one row of weights is
recomputed, so exporting it costs little (see benchmarks/RESULTS.md). And it is the
quantity the classifier head actually reads: the pooled vector is exactly this weighted mix
of the last layer's values.
Its limit is that it sees one layer: what earlier layers moved between positions is not
in it. `rollout` (Abnar & Zuidema 2020) multiplies the head-averaged maps of every layer
(with the residual identity mixed in), which follows information through the depth of
the network, but needs the full L x L maps of every layer (O(L^2)) and tends to spread
mass towards uniform. Neither is a causal explanation by itself: benchmarks/faithfulness.py
measures how well each one finds the simulator's truly causal events, next to integrated
gradients.

What the report holds (`attribute`, written atomically into `paths.reports`)
---------------------------------------------------------------------------
Tables (Parquet and CSV), computed with Polars explode + group_by (no per-row Python):

- `attention_by_event_type`, `attention_by_channel` (when the scores have a `channel`
  list), `attention_by_position` (position from the end, 0 = the last event before the
  outcome), per outcome (`converted`, `not_converted`, `unknown` = censored, open or
  unlabelled):
  events, attention mass, attention share, event share, lift = attention share / event
  share;
- `credit`: one converting journey = one conversion to share out among touchpoints
  (channels, or event types when there is no channel feature), by six methods: attention
  (the exported weights), first touch, last touch, linear, the Markov-chain removal effect,
  and integrated gradients on a sample; every column sums to 1;
- `markov_transitions` and `markov_removal_effects`: the first-order chain over
  touchpoints with `(start)`, `(conversion)` and `(null)` states, fitted on every journey
  with a known outcome (converting and not), and each touchpoint's removal effect
  1 - P(conversion without it) / P(conversion), normalised to shares for `credit`.
  Absorption probabilities come from solving (I - Q) x = r with numpy.

Every table adds up over journeys: each scores file's sums (`report_sums`) are kept in
`_sums/` beside the report, and the next report reads only the files that changed
(`scores_sums`), so a nightly report costs what its new scores cost.

Plots (PNG): credit share by touchpoint for each method, attention heatmaps of a few
high-scoring converting journeys, attention by position from the end.

Integrated gradients (Sundararajan et al. 2017, `journeys.inference`) run on a sample of
converting journeys; for credit, each journey's positive attributions are normalised to 1
(events that lowered the score get no credit).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from journeys.config import redact_uri
from journeys.datasets import (
    KEPT_BESIDE,
    MISSING_VALUE,
    count_rows,
    read_metadata,
    scan_scores,
    scores_parts,
    scores_window_start,
)
from journeys.errors import InputError, first_line
from journeys.plots import REPORT_PLOT_DPI, plot_credit, plot_examples, plot_position
from journeys.storage import atomic_dir, file_key, link_or_copy

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from journeys.config import Attribution as AttributionSettings
    from journeys.config import Config
    from journeys.trained_model import TrainedModel

START, CONVERSION, NULL = "(start)", "(conversion)", "(null)"
OTHER = "(other)"  # rare touchpoints lumped together for the Markov chain
CONVERTED, NOT_CONVERTED, UNKNOWN = "converted", "not_converted", "unknown"
METHODS = ("attention", "first_touch", "last_touch", "linear", "markov", "integrated_gradients")
EXAMPLE_EVENTS = 20  # last events shown per journey in the heatmap (what fits its width)


# ----------------------------------------------------------------------------- reading


def outcome_expr(schema: pl.Schema) -> pl.Expr:
    """converted / not_converted from `label`; unknown when censored, open at the scores'
    `as_of`, or unlabelled."""
    if "label" not in schema:
        return pl.lit(UNKNOWN).alias("outcome")
    censored = pl.col("censored").fill_null(False) if "censored" in schema else pl.lit(False)
    if "open" in schema:
        censored = censored | pl.col("open").fill_null(False)
    return (
        pl.when(censored | pl.col("label").is_null())
        .then(pl.lit(UNKNOWN))
        .when(pl.col("label") == 1)
        .then(pl.lit(CONVERTED))
        .otherwise(pl.lit(NOT_CONVERTED))
        .alias("outcome")
    )


def score_features(schema: pl.Schema) -> list[str]:
    """The feature columns of scores: their lists beside the events, times and weights."""
    not_features = ("event_type", "event_time", "attention", "prefix_probability")
    return [
        name
        for name, dtype in schema.items()
        if isinstance(dtype, pl.List) and name not in not_features
    ]


def report_dimensions(features: list[str], by: list[str] | None) -> list[str]:
    """What credit is broken down by: `by` (features or event_type), else event_type and
    every feature. Raise `InputError` on a dimension that is not there."""
    dimensions = list(by) if by else ["event_type", *features]
    unknown = [name for name in dimensions if name not in [*features, "event_type"]]
    if unknown:
        raise InputError(
            f"attribution.by names {unknown}, not among the features {list(features)} or event_type"
        )
    return dimensions


def _filled(column: str) -> pl.Expr:
    return pl.col(column).list.eval(pl.element().cast(pl.String).fill_null(MISSING_VALUE))


# ----------------------------------------------------------------------------- sums
# Everything the report computes over journeys is a sum (events, attention, first and
# last touches, Markov transitions, ...), so each scores file's sums are computed once and
# kept beside the report (`SUMS_DIR`); a nightly report reads only the files that changed
# since the last one and adds the sums up. Sums are kept by every list column, before
# any lumping of rare touchpoints: which ones are rare, which features are constant and
# the shares are decided after adding up, on the whole window.

SUMS_DIR = "_sums"  # in the report folder: per scores file, what the report adds up
SUMS_VERSION = 1  # raise when what a file's sums hold changes: older ones are not reused
SUM_TABLES = ("outcomes", "varies", "attention", "positions", "touchpoints", "transitions")
SUM_COLUMNS = (
    "events",
    "attention",
    "known_events",
    "first_touch",
    "last_touch",
    "linear",
    "count",
)

# SUM_TABLES' tables; kept per scores file, with `FILES`: each file's earliest journey
# end and the window cut its sums were taken at.
ReportSums = dict[str, pl.DataFrame]
FILES = "files"
EXPLAINED = "explained"  # also kept: the journeys integrated gradients explained
FILE = "file"  # in what is kept: the scores file (its `file_key`) a sum or a row is of


def report_sums(
    scores: pl.LazyFrame, by: tuple[str, ...] = (), read_once: bool = False
) -> ReportSums:
    """The additive tables of the report over `scores`, per value of the `by` columns
    (`("file",)`: per scores file). With `read_once`, the columns they need are read into
    memory first (a batch of files: `scores_sums`), else each table streams them anew.

    `outcomes`: journeys per outcome; `varies`:
    whether each list column takes more than one value within some journey; `attention`:
    events and attention mass per (column, outcome, value); `positions`: the same per
    (outcome, position from the end); `touchpoints`: per (dimension, touchpoint), events
    in journeys of known outcome and, over converting journeys, first and last touches,
    linear credit and attention mass; `transitions`: the Markov chain's transition counts
    per dimension (touchpoints not lumped).
    """
    schema = scores.collect_schema()
    columns = ["event_type", *score_features(schema)]
    keys = list(by)
    journeys = scores.select(*keys, outcome_expr(schema), "attention", *map(_filled, columns))
    if read_once:
        journeys = journeys.collect().lazy()
    known = journeys.filter(pl.col("outcome") != UNKNOWN)
    converted = journeys.filter(pl.col("outcome") == CONVERTED)

    def by_value(column: str) -> pl.LazyFrame:
        return (
            journeys.select(*keys, "outcome", pl.col(column).alias("value"), "attention")
            .explode(["value", "attention"])
            .drop_nulls("attention")
            .group_by(*keys, "outcome", "value")
            .agg(events=pl.len(), attention=pl.col("attention").cast(pl.Float64).sum())
            .select(*keys, pl.lit(column).alias("column"), pl.exclude(keys))
        )

    def by_touchpoint(dimension: str) -> pl.LazyFrame:
        on_converted = converted.select(*keys, pl.col(dimension).alias("touchpoints"), "attention")
        events = (
            known.select(*keys, touchpoint=pl.col(dimension))
            .explode("touchpoint")
            .group_by(*keys, "touchpoint")
            .agg(known_events=pl.len())
        )
        credit = events
        for part in (_firsts_and_lasts, _linear, _attention_mass):
            credit = credit.join(
                part(on_converted, keys), on=[*keys, "touchpoint"], how="full", coalesce=True
            )
        return credit.select(*keys, pl.lit(dimension).alias("dimension"), pl.exclude(keys))

    def transitions(dimension: str) -> pl.LazyFrame:
        paths = known.select(
            *keys, pl.col(dimension).alias("touchpoints"), converted=pl.col("outcome") == CONVERTED
        )
        counts = _transition_counts(paths, keys)
        return counts.select(*keys, pl.lit(dimension).alias("dimension"), pl.exclude(keys))

    length = pl.col("attention").list.len().cast(pl.Int64)
    positions = (
        journeys.select(
            *keys, "outcome", "attention", position_from_end=pl.int_ranges(length - 1, -1, -1)
        )
        .explode(["attention", "position_from_end"])
        .drop_nulls("attention")
        .group_by(*keys, "outcome", "position_from_end")
        .agg(events=pl.len(), attention=pl.col("attention").cast(pl.Float64).sum())
    )
    varies = [
        journeys.group_by(keys or pl.lit(0).alias("_all"))
        .agg(varies=(pl.col(column).list.n_unique() > 1).any().fill_null(False))
        .select(*keys, pl.lit(column).alias("column"), "varies")
        for column in columns
    ]
    # One query at a time, each streamed: together they would hold every file's exploded
    # lists at once (4x the memory on a 90-day window).
    queries = {
        "outcomes": [journeys.group_by(*keys, "outcome").agg(journeys=pl.len())],
        "varies": varies,
        "attention": [by_value(c) for c in columns],
        "positions": [positions],
        "touchpoints": [by_touchpoint(c) for c in columns],
        "transitions": [transitions(c) for c in columns],
    }
    return {
        name: pl.concat([q.collect(engine="streaming") for q in parts], how="diagonal_relaxed")
        for name, parts in queries.items()
    }


def added_up(sums: ReportSums) -> ReportSums:
    """Sums kept per file as one frame's: counts and masses summed, `varies` any."""
    total: ReportSums = {}
    for name in SUM_TABLES:
        table = sums[name].drop(FILE, strict=False)
        keys = [c for c in table.columns if c not in (*SUM_COLUMNS, "journeys", "varies")]
        values = [c for c in table.columns if c not in keys]
        total[name] = table.group_by(keys, maintain_order=True).agg(
            pl.col(c).any() if c == "varies" else pl.col(c).fill_null(0).sum() for c in values
        )
    return total


def _firsts_and_lasts(converted: pl.LazyFrame, keys: list[str]) -> pl.LazyFrame:
    touches = pl.col("touchpoints")
    first = converted.group_by(*keys, touchpoint=touches.list.first()).agg(first_touch=pl.len())
    last = converted.group_by(*keys, touchpoint=touches.list.last()).agg(last_touch=pl.len())
    return first.join(last, on=[*keys, "touchpoint"], how="full", coalesce=True)


def _linear(converted: pl.LazyFrame, keys: list[str]) -> pl.LazyFrame:
    return (
        converted.select(
            *keys,
            pl.col("touchpoints").alias("touchpoint"),
            (1.0 / pl.col("touchpoints").list.len()).alias("weight"),
        )
        .explode("touchpoint")
        .group_by(*keys, "touchpoint")
        .agg(linear=pl.col("weight").sum())
    )


def _attention_mass(converted: pl.LazyFrame, keys: list[str]) -> pl.LazyFrame:
    return (
        converted.select(*keys, pl.col("touchpoints").alias("touchpoint"), "attention")
        .explode(["touchpoint", "attention"])
        .drop_nulls("attention")
        .group_by(*keys, "touchpoint")
        .agg(attention=pl.col("attention").cast(pl.Float64).sum())
    )


def _outer(left: pl.LazyFrame, right: pl.LazyFrame) -> pl.LazyFrame:
    return left.join(right, on="touchpoint", how="full", coalesce=True)


def constant_columns(sums: ReportSums, columns: list[str]) -> list[str]:
    """Of `columns`, those with one value throughout every journey (a device per user, a
    price list aside; every one when there is no journey): credit by them would only
    restate which journeys converted, so the default breakdown skips them
    (`attribution.by` can still name them)."""
    varies = dict(sums["varies"].select("column", "varies").iter_rows())
    return [column for column in columns if not varies.get(column)]


# ----------------------------------------------------------------------------- attention


def attention_table(sums: ReportSums, column: str) -> pl.DataFrame:
    """The summed attention by one list column's values, per outcome, with shares."""
    table = sums["attention"].filter(pl.col("column") == column).drop("column")
    return _shares(table.rename({"value": column}).lazy(), [column])


def position_table(sums: ReportSums, cap: int) -> pl.DataFrame:
    """The summed attention by position from the end, `cap` and beyond pooled."""
    table = (
        sums["positions"]
        .lazy()
        .group_by("outcome", pl.col("position_from_end").clip(upper_bound=cap))
        .agg(pl.col("events", "attention").sum())
    )
    return _shares(table, ["position_from_end"])


def _shares(grouped: pl.LazyFrame, keys: list[str]) -> pl.DataFrame:
    """Add mean attention, attention and event shares within each outcome, and their
    ratio (lift)."""
    return (
        grouped.with_columns(
            mean_attention=pl.col("attention") / pl.col("events"),
            attention_share=pl.col("attention") / pl.col("attention").sum().over("outcome"),
            event_share=pl.col("events") / pl.col("events").sum().over("outcome"),
        )
        .with_columns(lift=pl.col("attention_share") / pl.col("event_share"))
        .select("outcome", *keys, "events", "attention", "mean_attention", "attention_share",
                "event_share", "lift")
        .sort(["outcome", *keys])
        .collect()
    )  # fmt: skip


# ----------------------------------------------------------------------------- rules


def credit_table(
    sums: ReportSums, dimension: str, keep: list[str] | None, markov: MarkovResult
) -> pl.DataFrame:
    """Credit shares by `dimension` from the sums: attention, first and last touch and
    linear over converting journeys, and the Markov chain's removal effects (every
    touchpoint of a journey with a known outcome has a row)."""
    converted = dict(sums["outcomes"].iter_rows()).get(CONVERTED, 0)
    methods = ("first_touch", "last_touch", "linear", "attention")
    summed = (
        sums["touchpoints"]
        .lazy()
        .filter(pl.col("dimension") == dimension, pl.col("known_events") > 0)
        .group_by(touchpoint=_lump(pl.col("touchpoint"), keep))
        .agg(pl.col(*methods).fill_null(0).sum())
        .select(
            "touchpoint",
            *(pl.col(m).cast(pl.Float64) / max(converted, 1) for m in methods),
        )
    )
    return _outer(summed, markov.removal.select("touchpoint", "markov").lazy()).collect()


# ----------------------------------------------------------------------------- Markov


@dataclass(frozen=True)
class MarkovResult:
    transitions: pl.DataFrame  # from, to, count, probability
    removal: pl.DataFrame  # touchpoint, removal_effect, markov (share), p_without
    conversion_probability: float  # P(reach (conversion) from (start))


def _transition_counts(paths: pl.LazyFrame, keys: list[str]) -> pl.LazyFrame:
    """Transition counts of the first-order chain over touchpoints, per `keys`.

    `paths` has `touchpoints` (list) and `converted` (bool): each journey is the path
    (start) -> t1 -> ... -> tn -> (conversion) or (null).
    """
    end = pl.when(pl.col("converted")).then(pl.lit(CONVERSION)).otherwise(pl.lit(NULL))
    path = pl.concat_list(pl.lit(START), pl.col("touchpoints"), end).alias("path")
    steps = pl.col("path").list.len() - 1
    return (
        paths.select(*keys, path)
        .select(
            *keys,
            pl.col("path").list.slice(0, steps).alias("from"),
            pl.col("path").list.slice(1).alias("to"),
        )
        .explode(["from", "to"])
        .group_by(*keys, "from", "to")
        .agg(count=pl.len())
    )


def markov_removal_effects(transitions: pl.DataFrame) -> MarkovResult:
    """Removal effects of a first-order absorbing chain given its transition counts.

    States: (start) and the touchpoints are transient; (conversion) and (null) absorb.
    With Q the transient-to-transient and r the transient-to-conversion probabilities,
    the conversion probabilities x from each state solve (I - Q) x = r. Removing a
    touchpoint sends every transition into it to (null): its column of Q is zeroed.
    Self-loops (repeated touchpoints) change no absorption probability, so repeated
    events need no collapsing.
    """
    states = set(transitions.get_column("from")) | set(transitions.get_column("to"))
    touchpoints = sorted(states - {START, CONVERSION, NULL})
    transient = [START, *touchpoints]
    index = {state: i for i, state in enumerate(transient)}
    n = len(transient)
    counts = np.zeros((n, n + 2))  # columns: transient..., conversion, null
    absorbing = {CONVERSION: n, NULL: n + 1}
    for source, target, count in transitions.select("from", "to", "count").iter_rows():
        counts[index[source], index.get(target, absorbing.get(target, -1))] += count
    totals = counts.sum(axis=1, keepdims=True)
    probabilities = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    q, r = probabilities[:, :n], probabilities[:, n]

    def p_conversion(q_matrix: np.ndarray) -> float:
        return float(np.linalg.solve(np.eye(n) - q_matrix, r)[index[START]])

    base = p_conversion(q) if n > 1 else 0.0
    without = []
    for touchpoint in touchpoints:
        removed = q.copy()
        removed[:, index[touchpoint]] = 0.0
        without.append(p_conversion(removed))
    p_without = np.array(without, dtype=np.float64)
    effect = 1.0 - p_without / base if base > 0 else np.zeros(len(touchpoints))
    total = effect.sum()
    share = effect / total if total > 0 else np.zeros(len(touchpoints))

    source_totals = transitions.group_by("from").agg(total=pl.col("count").sum())
    table = (
        transitions.join(source_totals, on="from")
        .with_columns(probability=pl.col("count") / pl.col("total"))
        .drop("total")
        .sort("from", "to")
    )
    removal = pl.DataFrame(
        {
            "touchpoint": touchpoints,
            "removal_effect": effect,
            "markov": share,
            "p_without": p_without,
        },
        schema={
            "touchpoint": pl.String,
            "removal_effect": pl.Float64,
            "markov": pl.Float64,
            "p_without": pl.Float64,
        },
    )
    return MarkovResult(table, removal, base)


def frequent_touchpoints(sums: ReportSums, dimension: str, max_states: int) -> list[str] | None:
    """The `max_states - 1` commonest touchpoints of `dimension` in journeys of known
    outcome, or None when there are no more than `max_states` (then none is lumped)."""
    frequent = (
        sums["touchpoints"]
        .filter(pl.col("dimension") == dimension, pl.col("known_events") > 0)
        .sort(["known_events", "touchpoint"], descending=[True, False])
    )
    if frequent.height <= max_states:
        return None
    return frequent.head(max_states - 1).get_column("touchpoint").to_list()


def lumped(touchpoints: pl.Expr, keep: list[str] | None) -> pl.Expr:
    """Each list's touchpoints, those not in `keep` as `(other)` (None: all kept)."""
    if keep is None:
        return touchpoints
    return touchpoints.list.eval(_lump(pl.element(), keep))


def _lump(touchpoint: pl.Expr, keep: list[str] | None) -> pl.Expr:
    """A touchpoint as itself when kept (or a state of the chain), else `(other)`."""
    if keep is None:
        return touchpoint
    kept = pl.lit(pl.Series([*keep, START, CONVERSION, NULL], dtype=pl.String)).implode()
    return pl.when(touchpoint.is_in(kept.first())).then(touchpoint).otherwise(pl.lit(OTHER))


def markov_of(sums: ReportSums, dimension: str, keep: list[str] | None) -> MarkovResult:
    """The chain over `dimension`'s touchpoints from the summed transitions, those not in
    `keep` lumped (a transition into a lumped touchpoint is one into `(other)`)."""
    transitions = (
        sums["transitions"]
        .filter(pl.col("dimension") == dimension)
        .group_by(_lump(pl.col("from"), keep), _lump(pl.col("to"), keep))
        .agg(pl.col("count").sum())
        .sort("from", "to")
    )
    return markov_removal_effects(transitions.select("from", "to", "count"))


# ----------------------------------------------------------------------------- IG


def integrated_gradients_frame(
    trained: TrainedModel, frame: pl.DataFrame, steps: int | None = None
) -> pl.Series:
    """IG per event for a journeys/scores frame: a list[float32] per journey, aligned with
    the (model-length) lists of `journeys.score.score_frame`."""
    from journeys.inference import IG_STEPS, list_series, run_integrated_gradients

    encoded = trained.encode(frame)
    values = run_integrated_gradients(trained.model, encoded, steps or IG_STEPS)
    return list_series("integrated_gradients", encoded.offsets.numpy(), values)


def positive_part(column: str) -> pl.Expr:
    """A list of signed attributions -> its positive part (events that raised the score)."""
    return pl.col(column).list.eval(pl.element().clip(lower_bound=0.0))


def normalised_positive(frame: pl.DataFrame | pl.LazyFrame, column: str, out: str = "weight"):
    """Keep rows with some positive attribution; `out` = positive part scaled to sum 1.

    Rows whose attributions are all <= 0 are dropped (they would divide by zero).
    """
    positive = frame.with_columns(positive_part(column).alias(out))
    total = pl.col(out).list.sum()
    # Polars orders NaN above every number, so `total > 0` alone would keep NaN rows.
    return positive.filter((total > 0) & total.is_finite()).with_columns(pl.col(out) / total)


def explain_sample(
    trained: TrainedModel,
    converted: pl.LazyFrame,
    sample: int,
    seed: int,
    earlier: pl.DataFrame | None = None,
    files: list[Path] | None = None,
) -> pl.DataFrame:
    """A random sample of `sample` converting journeys with their `integrated_gradients`
    lists.

    The sample is the journeys whose id hashes lowest (with `seed`): as random as any, and
    from one night to the next it changes only by the journeys that came or left, so the
    lists of `earlier` (the last report's sample) stand for every journey whose events
    and model are the same, and only the newcomers are explained now. With `files` (those
    `converted` reads), each row says which file it came from (`file`, its `file_key`),
    and a journey still in an unchanged file is the row explained then, not read again."""
    ids = converted.select("journey_id").collect()
    if ids.height > sample:
        ids = ids.bottom_k(sample, by=pl.col("journey_id").hash(seed))
    located = located_in(files, ids.get_column("journey_id")) if files else None
    unmoved = pl.DataFrame()
    if located is not None and earlier is not None and FILE in earlier.columns:
        unmoved = earlier.join(located, on=["journey_id", FILE], how="semi")
    if unmoved.height:
        ids = ids.join(unmoved.select("journey_id"), on="journey_id", how="anti")
    frame = rows_of(converted, ids.get_column("journey_id"), files, located)
    if located is not None:
        frame = frame.join(located, on="journey_id", how="left")
    if frame.height == 0 and unmoved.height == 0:
        return frame.with_columns(integrated_gradients=pl.lit(None, pl.List(pl.Float32)))
    # The same journey, events and model: every list column the model reads, as scoring's
    # `reused_rows` checks.
    lists = ["event_type", "event_time", *score_features(frame.schema)]
    same = ["journey_id", *lists, "n_events_total", "model_uri", "model_version"]
    same = [c for c in dict.fromkeys(same) if c in frame.columns]
    kept = pl.DataFrame()
    if earlier is not None and frame.height and set(same) <= set(earlier.columns):
        kept = frame.join(
            earlier.select(*same, "integrated_gradients"), on=same, how="inner", nulls_equal=True
        )
    todo = (
        frame.join(kept.select(same), on=same, how="anti", nulls_equal=True)
        if kept.height
        else frame
    )
    if todo.height:
        todo = todo.with_columns(integrated_gradients_frame(trained, todo))
    return pl.concat([unmoved, kept, todo], how="diagonal_relaxed").sort("journey_id")


def located_in(files: list[Path], ids: pl.Series) -> pl.DataFrame:
    """`journey_id` and `file` (the `file_key` of the scores file holding it) of `ids`
    among `files`: one column of each file read, so that their rows can then be read from
    those files alone (`rows_of`)."""
    keys = {str(path): file_key(path) for path in files}
    return (
        pl.scan_parquet(files, include_file_paths=FILE)
        .select("journey_id", FILE)
        .filter(pl.col("journey_id").is_in(ids.implode()))
        .collect()
        .with_columns(pl.col(FILE).replace_strict(keys))
    )


def rows_of(
    journeys: pl.LazyFrame,
    ids: pl.Series,
    files: list[Path] | None = None,
    located: pl.DataFrame | None = None,
) -> pl.DataFrame:
    """The rows of `journeys` (scores with their `outcome`) of the journeys `ids`. With
    `files` (those `journeys` reads) only the files that hold them are read (`located`
    says which, when known): a filter on the whole scan decodes every row of every file
    to keep a few."""
    if ids.len() == 0:
        return journeys.head(0).collect()
    wanted = pl.col("journey_id").is_in(ids.implode())
    if not files:
        return journeys.filter(wanted).collect()
    located = located_in(files, ids) if located is None else located.filter(wanted)
    held = set(located.get_column(FILE))
    paths = [path for path in files if file_key(path) in held]
    if not paths:
        return journeys.filter(pl.lit(False)).collect()
    scores = pl.scan_parquet(paths)
    return scores.filter(wanted).with_columns(outcome_expr(scores.collect_schema())).collect()


def ig_credit(
    explained: pl.DataFrame, dimension: str, keep: list[str] | None = None
) -> tuple[pl.DataFrame, int]:
    """Integrated-gradients credit shares by `dimension` over the explained sample (the
    touchpoints not in `keep` as `(other)`), and how many journeys had some positive
    attribution to share out."""
    weights = normalised_positive(
        explained.select(
            lumped(_filled(dimension), keep).alias("touchpoints"), "integrated_gradients"
        ),
        "integrated_gradients",
    )
    table = (
        weights.explode(["touchpoints", "weight"])
        .group_by(touchpoint=pl.col("touchpoints"))
        .agg(integrated_gradients=pl.col("weight").cast(pl.Float64).sum() / max(weights.height, 1))
        .sort("touchpoint")
    )
    return table, weights.height


# ----------------------------------------------------------------------------- report


@dataclass
class AttributionReport:
    tables: dict[str, pl.DataFrame]
    summary: dict[str, Any]
    figures: dict[str, Figure] = field(default_factory=dict, repr=False)
    # Kept for the next report (`SUMS_DIR`): each scores file's sums (`scores_sums`) and
    # the journeys integrated gradients explained; empty when not built from files.
    sums: ReportSums = field(default_factory=dict, repr=False)

    @property
    def credit(self) -> pl.DataFrame:
        return self.tables["credit"]


def build_report(
    scores: pl.LazyFrame,
    *,
    trained: TrainedModel | None = None,
    settings: AttributionSettings | None = None,
    sums: ReportSums | None = None,
    files: list[Path] | None = None,
) -> AttributionReport:
    """Every table, summary fact and figure of the report (nothing written yet).

    The tables come from `sums` (default: `report_sums(scores)`, the whole frame in
    memory); `scores` itself is read only for the examples and the journeys that
    integrated gradients explain (those `sums` holds as `EXPLAINED` are not explained
    again). With `files`, the Parquet files `scores` reads, those few journeys are read
    from the files that hold them alone. Credit, the Markov chain and their plots come once per
    dimension of `settings.by` (every feature by default); the `credit` and Markov tables
    hold all of them, told apart by their `dimension` column. A missing value is its own
    touchpoint, `(none)`.
    """
    from journeys.config import Attribution

    settings = settings or Attribution()
    schema = scores.collect_schema()
    total = added_up(sums if sums is not None else report_sums(scores))
    features = score_features(schema)
    constant = [] if settings.by else constant_columns(total, ["event_type", *features])
    dimensions = report_dimensions([f for f in features if f not in constant], settings.by)
    if not settings.by:
        dimensions = [d for d in dimensions if d not in constant] or ["event_type"]
    journeys = scores.with_columns(outcome_expr(schema))
    converted = journeys.filter(pl.col("outcome") == CONVERTED)

    tables: dict[str, pl.DataFrame] = {
        f"attention_by_{name}": attention_table(total, name)
        for name in dict.fromkeys(["event_type", *dimensions])
    }
    tables["attention_by_position"] = position_table(total, settings.position_cap)

    summary: dict[str, Any] = {}
    if constant:
        summary["constant_features_skipped"] = constant
    explained = None
    if trained is not None and settings.ig_sample > 0:
        from journeys.inference import IG_STEPS

        before = sums.get(EXPLAINED) if sums else None
        explained = explain_sample(
            trained, converted, settings.ig_sample, settings.seed, before, files
        )
        summary |= {"ig_sample": explained.height, "ig_steps": IG_STEPS}

    credits, transitions, removals, figures = [], [], [], {}
    markov_probability: dict[str, float] = {}
    for dimension in dimensions:
        # Rare touchpoints are lumped into `(other)` beyond `markov_max_states` (the chain
        # solves one system per state), for every method alike, so the columns compare.
        keep = frequent_touchpoints(total, dimension, settings.markov_max_states)
        markov = markov_of(total, dimension, keep)
        credit = credit_table(total, dimension, keep, markov)
        if explained is not None:
            ig_table, explained_journeys = ig_credit(explained, dimension, keep)
            credit = _outer(credit.lazy(), ig_table.lazy()).collect()
            summary[f"ig_explained_{dimension}"] = explained_journeys
        methods = [m for m in METHODS if m in credit.columns]
        table = (
            credit.with_columns(pl.col(m).fill_null(0.0) for m in methods)
            .select(pl.lit(dimension).alias("dimension"), "touchpoint", *methods)
            .sort("touchpoint")
        )
        credits.append(table)
        by = pl.lit(dimension).alias("dimension")
        transitions.append(markov.transitions.select(by, pl.all()))
        removals.append(markov.removal.select(by, pl.all()))
        markov_probability[dimension] = markov.conversion_probability
        figures[f"credit_by_{dimension}.png"] = plot_credit(table, dimension, methods)
    tables["credit"] = pl.concat(credits, how="diagonal")
    tables["markov_transitions"] = pl.concat(transitions)
    tables["markov_removal_effects"] = pl.concat(removals)

    counts = dict(total["outcomes"].iter_rows())
    n_known = counts.get(CONVERTED, 0) + counts.get(NOT_CONVERTED, 0)
    summary = {
        "journeys": sum(counts.values()),
        "journeys_by_outcome": {k: counts.get(k, 0) for k in (CONVERTED, NOT_CONVERTED, UNKNOWN)},
        "dimensions": dimensions,
        "credit_methods": [m for m in METHODS if m in tables["credit"].columns],
        "observed_conversion_rate": counts.get(CONVERTED, 0) / n_known if n_known else None,
        "markov_conversion_probability": markov_probability,
        **summary,
    }
    if not counts.get(CONVERTED):
        summary["note"] = "no converting journeys with a known outcome: no credit to share out"
    examples = _examples(journeys, settings.example_journeys, files)
    figures["attention_by_position.png"] = plot_position(
        tables["attention_by_position"], settings.position_cap
    )
    if examples.height:
        figures["attention_examples.png"] = plot_examples(examples, EXAMPLE_EVENTS)
    kept: ReportSums = {}
    if sums is not None:  # built from files: what the next report can reuse
        kept = {name: sums[name] for name in (FILES, *SUM_TABLES)}
        kept |= {EXPLAINED: explained} if explained is not None else {}
    return AttributionReport(tables, summary, figures, kept)


def _examples(journeys: pl.LazyFrame, n: int, files: list[Path] | None = None) -> pl.DataFrame:
    """The highest-scoring converting journeys (any journeys when none converted): picked
    on their probabilities, then read (from the files that hold them, with `files`)."""
    schema = journeys.collect_schema()
    order = "conversion_probability" if "conversion_probability" in schema else None
    shown = ["journey_id", "attention", "event_type", *([order] if order else [])]  # plot_examples
    # Scores' `n_events` is the length of their attention lists: picked without decoding them.
    events = pl.col("n_events") if "n_events" in schema else pl.col("attention").list.len()
    for subset in (journeys.filter(pl.col("outcome") == CONVERTED), journeys):
        picked = subset.filter(events > 0).select("journey_id", *([order] if order else []))
        if order:
            picked = picked.sort(order, descending=True, nulls_last=True)
        ids = picked.head(n).collect().get_column("journey_id")
        if ids.len():  # shown in the order they were picked
            rank = ids.to_frame().with_row_index("rank")
            frame = rows_of(journeys, ids, files).join(rank, on="journey_id")
            return frame.sort("rank").select(shown)
    return pl.DataFrame()


def scores_sums(
    path: Path, since: datetime | None, earlier: ReportSums, batch_journeys: int
) -> ReportSums:
    """Each scores file's sums over its journeys ending at or after `since`, a `file`
    column naming the file (`file_key`): `earlier`'s (the last report's) for a file that
    has not changed and that the window cuts at the same place (or not at all, then and
    now), computed afresh for the others, read in batches of files of about
    `batch_journeys` journeys (at least a file), each batch read once."""
    keys = {file_key(part): part for part in scores_parts(path, since)}
    reusable = set()
    if earlier:
        for key, end, cut in earlier[FILES].select(FILE, "earliest_end", "since").iter_rows():
            whole = end is None or ((cut is None or cut <= end) and (since is None or since <= end))
            if key in keys and (whole or cut == since):
                reusable.add(key)
    kept = pl.col(FILE).is_in(list(reusable))
    tables = (FILES, *SUM_TABLES)
    pieces = [{name: earlier[name].filter(kept) for name in tables}] if reusable else []
    fresh = [(str(part), key) for key, part in keys.items() if key not in reusable]
    for batch in _batches(fresh, batch_journeys):
        # Files by number while the events are exploded, by key in what is kept.
        numbers = {path: i for i, (path, _) in enumerate(batch)}
        frame = pl.scan_parquet([path for path, _ in batch], include_file_paths=FILE)
        frame = frame.with_columns(pl.col(FILE).replace_strict(numbers, return_dtype=pl.UInt32))
        ends = frame.group_by(FILE).agg(
            earliest_end=pl.col("event_time").list.last().min(),
            since=pl.lit(since, pl.Datetime("us", "UTC")),
            version=pl.lit(SUMS_VERSION),
        )
        if since is not None:
            frame = frame.filter(pl.col("event_time").list.last() >= since)
        named = pl.col(FILE).replace_strict(dict(enumerate(key for _, key in batch)))
        sums = {FILES: ends.collect(), **report_sums(frame, by=(FILE,), read_once=True)}
        pieces.append({name: table.with_columns(named) for name, table in sums.items()})
    return {name: pl.concat([p[name] for p in pieces], how="diagonal_relaxed") for name in tables}


def _batches(files: list[tuple[str, str]], most: int) -> list[list[tuple[str, str]]]:
    """`files` ((path, key), in order) in runs of about `most` journeys, a file at least."""
    batches: list[list[tuple[str, str]]] = []
    rows = 0
    for file in files:
        n = count_rows([Path(file[0])])
        if not batches or rows + n > most:
            batches.append([])
            rows = 0
        batches[-1].append(file)
        rows += n
    return batches


def read_sums(folder: Path) -> ReportSums:
    """What a written report kept for the next (`SUMS_DIR`): its per-file sums and, when
    there was one, its explained sample (`EXPLAINED`); {} when none, or damaged."""
    try:
        names = (FILES, *SUM_TABLES)
        kept = {name: pl.read_parquet(folder / SUMS_DIR / f"{name}.parquet") for name in names}
        if (folder / SUMS_DIR / f"{EXPLAINED}.parquet").exists():
            kept[EXPLAINED] = pl.read_parquet(folder / SUMS_DIR / f"{EXPLAINED}.parquet")
        versions = kept[FILES].get_column("version").unique().to_list()
    except (pl.exceptions.PolarsError, OSError):
        return {}
    return kept if versions == [SUMS_VERSION] else {}  # another layout: built afresh


# In summary.json: the scores' metadata and the settings the report was made from.
MADE_FROM = "made_from"
SUMMARY_FILE = "summary.json"


def read_report(folder: str | Path) -> AttributionReport | None:
    """A written report's tables and summary (no figures), or None when there is none."""
    folder = Path(folder)
    summary = folder / SUMMARY_FILE
    if not summary.exists():
        return None
    try:
        tables = {path.stem: pl.read_parquet(path) for path in sorted(folder.glob("*.parquet"))}
        return AttributionReport(tables, json.loads(summary.read_text()))
    except (pl.exceptions.PolarsError, OSError, json.JSONDecodeError):
        return None  # damaged or foreign: rebuilt


def write_report(report: AttributionReport, out: str | Path) -> Path:
    """Tables as Parquet + CSV, figures as PNG, `summary.json`: swapped in atomically
    (the folders other stages keep there, `KEPT_BESIDE`, carried over as hard links)."""
    out = Path(out)
    with atomic_dir(out) as staging:
        for name in KEPT_BESIDE:
            if (out / name).is_dir():
                shutil.copytree(out / name, staging / name, copy_function=link_or_copy)
        for name, table in report.tables.items():
            table.write_parquet(staging / f"{name}.parquet")
            table.write_csv(staging / f"{name}.csv")
        for name, figure in report.figures.items():
            figure.savefig(staging / name, dpi=REPORT_PLOT_DPI, bbox_inches="tight")
        if report.sums:
            (staging / SUMS_DIR).mkdir()
            for name, table in report.sums.items():
                table.write_parquet(staging / SUMS_DIR / f"{name}.parquet")
        (staging / SUMMARY_FILE).write_text(json.dumps(report.summary, indent=2, default=str))
    return out


def attribute(
    scores: str | Path | pl.LazyFrame,
    out: str | Path,
    *,
    trained: TrainedModel | None = None,
    settings: AttributionSettings | None = None,
) -> AttributionReport:
    """Build the report from scores (a folder, a file or a LazyFrame) and write it to `out`.

    With `trained` (the model that produced the scores) integrated gradients are added on
    a sample of `settings.ig_sample` converting journeys.
    """
    if isinstance(scores, pl.LazyFrame):
        report = build_report(scores, trained=trained, settings=settings)
    else:
        from journeys.config import Score

        sums = scores_sums(Path(scores), None, {}, Score().chunk_journeys)
        parts = scores_parts(Path(scores))
        report = build_report(
            scan_scores(scores), trained=trained, settings=settings, sums=sums, files=parts
        )
    write_report(report, out)
    return report


def attribute_command(
    config: Config,
    scores: str | Path | None = None,
    out: str | Path | None = None,
    trained: TrainedModel | None = None,
) -> AttributionReport:
    """`journeys attribute`: the report from existing scores into `paths.reports`.

    Integrated gradients need the model named in the scores: `trained` when the caller
    that scored holds it, else reloaded (skipped, with a warning, when it cannot be). The
    report is logged to the scoring run when the scores name one and the store exists.
    """
    from journeys.tracking import mlflow_run, redact_uri, tracking_uri

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    scores = Path(scores or config.paths.scores)
    out = Path(out or config.paths.reports)
    settings = config.attribution
    since = scores_window_start(scores, settings.window_delta)
    frame = scan_scores(scores, since)
    metadata = read_metadata(scores)
    store = tracking_uri(config)
    scores_made = metadata | (
        {"model_uri": redact_uri(metadata["model_uri"])} if "model_uri" in metadata else {}
    )
    # Which files, not only which run: a nightly scoring keeps earlier files beside new ones.
    names = sorted(p.name for p in scores.glob("*.parquet")) if scores.is_dir() else [scores.name]
    files = hashlib.blake2b("\0".join(names).encode(), digest_size=8).hexdigest()
    made_from = {
        "scores": scores_made, "files": files, "settings": settings.model_dump(mode="json")
    }  # fmt: skip
    existing = read_report(out)
    if existing is not None and metadata and existing.summary.get(MADE_FROM) == made_from:
        # `journeys score` built it a moment ago from these very scores and settings.
        print(f"attribution report in {out} is up to date with these scores: not rebuilt")
        return existing
    if not settings.ig_sample:
        trained = None
    elif trained is None or trained.model_uri != metadata.get("model_uri"):
        trained = _load_scoring_model(metadata, store)
    # Only the scores files that changed since the last report are read whole.
    earlier = read_sums(out)
    sums = scores_sums(scores, since, earlier, config.score.chunk_journeys)
    if EXPLAINED in earlier:
        sums[EXPLAINED] = earlier[EXPLAINED]
    parts = scores_parts(scores, since)  # those `frame` reads
    report = build_report(frame, trained=trained, settings=settings, sums=sums, files=parts)
    report.summary[MADE_FROM] = made_from
    if since is not None:  # attribution.window
        report.summary["journeys_since"] = since.isoformat()
    write_report(report, out)
    print_credit(report)
    if "note" in report.summary:
        print(report.summary["note"])
    print(f"attribution report -> {out}")
    run_id = metadata.get("run_id")
    if run_id:  # into the scoring run, when the store is there
        with mlflow_run(store, config.mlflow.experiment, run_id=run_id, optional=True) as run:
            try:
                for path in sorted(out.iterdir()) if run else []:
                    if path.is_file():  # the report, not the folders kept beside it
                        run.log_artifact(path, "attribution")
            except Exception as err:  # the report is written; logging is a bonus
                _warn(f"could not log the report to MLflow run {run_id}: {first_line(err)}")
    return report


_ALIAS_URI = re.compile(r"models:/(?P<name>[^/@]+)@[^/]+/?")


def scoring_model_uri(metadata: dict[str, Any]) -> str | None:
    """The URI of the exact model version that wrote scores, from their metadata (an
    alias may have moved since): None when they do not say."""
    uri = metadata.get("model_uri")
    if not uri:
        return None
    match = _ALIAS_URI.fullmatch(uri)
    if match and metadata.get("model_version"):
        uri = f"models:/{match['name']}/{metadata['model_version']}"
    return uri


def _load_scoring_model(metadata: dict[str, Any], store: str) -> TrainedModel | None:
    """The exact model version that wrote the scores (an alias may have moved since)."""
    from journeys.tracking import tracking_ready
    from journeys.trained_model import load_model

    uri = scoring_model_uri(metadata)
    if not uri:
        _warn("the scores do not name their model: integrated gradients skipped")
        return None
    if uri.startswith(("models:/", "runs:/")) and not tracking_ready(store):
        _warn(f"no MLflow store at {redact_uri(store)}: integrated gradients skipped")
        return None
    try:
        return load_model(uri, tracking_uri=store)
    except InputError as err:
        _warn(f"{err}: integrated gradients skipped")
        return None


def print_credit(report: AttributionReport) -> None:
    """One credit table per dimension: a row per touchpoint, a column per method (%)."""
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for (dimension,), credit in report.credit.group_by("dimension", maintain_order=True):
        methods = [c for c in credit.columns if c in METHODS]
        table = Table(title=f"credit by {dimension} (converting journeys)")
        table.add_column("touchpoint")
        for method in methods:
            table.add_column(method.replace("_", " "), justify="right")
        for row in credit.iter_rows(named=True):
            table.add_row(row["touchpoint"], *[f"{100 * row[m]:.1f}%" for m in methods])
        console.print(table)


def _warn(message: str) -> None:
    print(f"journeys attribute: warning: {message}", file=sys.stderr)

"""A second synthetic event log, with mechanics of its own, for choosing model defaults.

The product's simulator (`journeys/simulate.py`) is what the defaults were first tuned on;
a default chosen on it alone could owe its win to that simulator's particular rules. This
generator shares nothing with it but the output contract (`conf/default.yaml` ingests its
log unchanged), so the default suite (`benchmarks/suite.py`) can check a default on both.

How users behave (`Behaviour`):

- INTENT: each user has a latent intent (standard normal); each journey's intent is the
  user's plus fresh noise (correlation `intent_user_share`). Intent makes users come back
  more often (visits per journey: 1 + Poisson with a mean growing with intent) and browse
  deeper (browsing steps per visit: geometric, mean growing with intent), and tilts the
  browsing towards product views, carts and checkouts. Intent itself never enters the
  true model: it acts on conversion only through what it makes the user do, so the true
  probability is a function of the log alone and its ROC AUC is the Bayes-optimal AUC on
  what the log shows.
- LENGTH: journeys are a compound count (visits times geometric depth), capped at
  `length_max` (60 events: under `journey.max_events` = 64, so the ingester keeps every
  event). The simulator draws one log-normal length instead.
- VISITS open with their touch: `ad_click` when a marketing channel brought the user,
  `landing` when the user came `direct`. Browsing inside a visit is a Markov chain over
  the previous event type with its own vocabulary (`EVENT_TYPES`); `checkout_start` and
  `remove_from_cart` need an item in the cart, which persists across visits.
- GAPS are heavy-tailed: log-logistic inside a visit (seconds to `event_gap_max_s` = 20
  minutes), Pareto between visits (from 1 hour to 6 days, always under
  `journey.max_gap` = 7 days), and 7 days + 1 hour + Lomax between journeys. The
  simulator's gaps are log-normal. Any visit threshold between 20 minutes and 1 hour (the
  model's `visit_gap` default of 30 minutes, say) recovers the visits from the log.
- CHANNELS: the first visit's channel from `first_touch_mix`, later visits' from
  `return_mix`; a device per user, switched per visit now and then.

How journeys convert (`TrueModel`; logistic, intercept calibrated to `conversion_rate`):

- ENGAGEMENT (counts carry signal): per unit of log(visits in the journey).
- ORDER: a `checkout_start` after an `add_to_cart` of the same visit raises the odds; the
  journey's last `add_to_cart` not followed by a `checkout_start` in its visit (an
  abandoned cart) lowers them. Counts of carts and checkouts cannot tell these apart.
- RECENCY: exp(-hours from the last `ad_click` to the journey's last event /
  `recency_scale_h`), 0 when the journey has no ad click.
- FIRST TOUCH: one coefficient per channel of the journey's first event (vs `direct`).
- TIMING, weak on purpose: the journey's last event falls on a Saturday or Sunday (UTC).

A converting journey ends with a `purchase` on the channel and device of its last event,
one in-visit gap after it; the slot is reserved for every journey, so the timeline (and
the gap to the user's next journey) does not depend on the label.

Layout written under `out/` (the ingester skips names starting with `_`)::

    events.csv                 user_id,timestamp,event_type,channel,device (ISO 8601 UTC)
    _truth/journeys.parquet    journey_id, user_id, times, true_probability, converted,
                               n_events, n_visits, intent, and each effect (`effect_<name>`)
    _truth/events.parquet      clean events (no purchase) with journey_id, position, visit
                               and `causal`: the event raised the true log-odds
    _truth/summary.json        counts, rates, coefficients and intercept

Vectorised numpy and Polars (one loop over event positions); the same arguments give
byte-identical files; 20,000 users take about a second.

    python benchmarks/second_generator.py OUT --users 20000 --seed 0 [--evaluate]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import sys
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from journeys.simulate import (  # noqa: E402
    calibrate_intercept,
    categorical,
    user_ids,
    utc_from_ms,
)
from journeys.storage import atomic_path, write_json, write_parquet  # noqa: E402

# User ids `g000000`, ...: a prefix of its own, so they never collide with the simulator's.
USER_PREFIX = "g"

# --- vocabularies (codes are indices into these tuples) ---------------------------------------

EVENT_TYPES: tuple[str, ...] = (
    "ad_click",
    "landing",
    "search",
    "category_view",
    "product_view",
    "add_to_cart",
    "remove_from_cart",
    "wishlist",
    "checkout_start",
    "purchase",
)
(
    AD_CLICK,
    LANDING,
    SEARCH,
    CATEGORY_VIEW,
    PRODUCT_VIEW,
    ADD_TO_CART,
    REMOVE_FROM_CART,
    WISHLIST,
    CHECKOUT_START,
    PURCHASE,
) = range(len(EVENT_TYPES))
# What one browsing step inside a visit can produce (the touches only open visits).
BROWSE_EVENTS: tuple[int, ...] = (
    SEARCH,
    CATEGORY_VIEW,
    PRODUCT_VIEW,
    ADD_TO_CART,
    REMOVE_FROM_CART,
    WISHLIST,
    CHECKOUT_START,
)
CHANNELS: tuple[str, ...] = (
    "paid_search",
    "social",
    "email",
    "display",
    "referral",
    "push",
    "direct",
)
DIRECT = CHANNELS.index("direct")
DEVICES: tuple[str, ...] = ("mobile", "desktop", "tablet")

LOG_COLUMNS: tuple[str, ...] = ("user_id", "timestamp", "event_type", "channel", "device")
TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%S%.3fZ"  # the simulator's text, to the millisecond
CONVERSION_EVENT = "purchase"  # conf/default.yaml's data.conversion_events

_MS_PER_SECOND = 1_000
_MS_PER_HOUR = 3_600_000
_MS_PER_DAY = 24 * _MS_PER_HOUR
_EPOCH_WEEKDAY = 3  # 1970-01-01 was a Thursday (Monday = 0)
_SATURDAY = 5

MIN_TRUTH_MATCH = 0.9  # bayes_roc_auc: at least this share of journeys must be in the truth


@dataclass(frozen=True)
class Behaviour:
    """How generated users browse: intent, journeys, visits, depth, gaps, channels."""

    start: datetime = datetime(2026, 2, 2, tzinfo=UTC)  # a Monday
    days: int = 120
    # Journeys per user: geometric (mean 1 / journeys_p), capped; later journeys that would
    # end after the date range are dropped.
    journeys_p: float = 0.55
    max_journeys: int = 6
    # Journey intent = share * user intent + sqrt(1 - share^2) * noise (unit variance).
    intent_user_share: float = 0.7
    # Visits per journey: 1 + Poisson(visits_mean * exp(visits_intent * intent)), capped.
    visits_mean: float = 1.0
    visits_intent: float = 0.6
    max_visits: int = 12
    # Browsing steps after a visit's touch: geometric with mean depth_mean * exp(depth_intent
    # * intent).
    depth_mean: float = 2.5
    depth_intent: float = 0.35
    length_max: int = 60  # events per journey before any purchase
    # Gaps inside a visit: log-logistic (median, shape), clipped.
    event_gap_median_s: float = 40.0
    event_gap_shape: float = 1.6
    event_gap_min_s: float = 1.0
    event_gap_max_s: float = 1_200.0
    # Gaps between visits of one journey: Pareto (minimum, tail index), clipped.
    visit_gap_min_h: float = 1.0
    visit_gap_alpha: float = 0.9
    visit_gap_max_h: float = 144.0
    # Gaps between journeys of one user: minimum plus Lomax (scale, tail index), clipped.
    journey_gap_min_h: float = 7 * 24 + 1
    journey_gap_scale_d: float = 4.0
    journey_gap_alpha: float = 1.5
    journey_gap_extra_max_d: float = 90.0
    # Channel of a journey's first visit, and of later visits (CHANNELS order).
    first_touch_mix: tuple[float, ...] = (0.25, 0.22, 0.08, 0.18, 0.07, 0.05, 0.15)
    # Half the return visits are direct: the time since the last ad click then varies.
    return_mix: tuple[float, ...] = (0.12, 0.08, 0.12, 0.08, 0.05, 0.05, 0.50)
    device_mix: tuple[float, ...] = (0.60, 0.32, 0.08)
    device_switch_prob: float = 0.2
    # Next browsing event given the previous event: rows in EVENT_TYPES order up to
    # checkout_start, columns BROWSE_EVENTS. remove_from_cart and checkout_start are
    # possible only with an item in the cart (their weights are zeroed otherwise).
    transitions: tuple[tuple[float, ...], ...] = (
        (0.10, 0.25, 0.50, 0.08, 0.00, 0.02, 0.05),  # after ad_click
        (0.35, 0.30, 0.25, 0.03, 0.00, 0.02, 0.05),  # after landing
        (0.10, 0.15, 0.65, 0.04, 0.00, 0.03, 0.03),  # after search
        (0.10, 0.20, 0.60, 0.04, 0.00, 0.03, 0.03),  # after category_view
        (0.08, 0.15, 0.35, 0.22, 0.00, 0.10, 0.10),  # after product_view
        (0.08, 0.12, 0.30, 0.08, 0.10, 0.02, 0.30),  # after add_to_cart
        (0.15, 0.25, 0.40, 0.05, 0.05, 0.05, 0.05),  # after remove_from_cart
        (0.15, 0.25, 0.40, 0.10, 0.00, 0.05, 0.05),  # after wishlist
        (0.10, 0.20, 0.40, 0.10, 0.10, 0.05, 0.05),  # after checkout_start
    )
    # Intent tilts each browsing event's weight by exp(tilt * intent) (BROWSE_EVENTS order).
    intent_tilt: tuple[float, ...] = (-0.1, 0.0, 0.25, 0.5, -0.3, 0.0, 0.5)


@dataclass(frozen=True)
class TrueModel:
    """Coefficients of the true conversion log-odds; the intercept is calibrated per run."""

    engagement: float = 0.4  # per unit of log(visits)
    cart_checkout_in_visit: float = 1.3  # a checkout after a cart of the same visit
    abandoned_last_cart: float = -1.0  # the last cart without a checkout after it in its visit
    click_recency: float = 2.0  # times exp(-hours since the last ad click / recency_scale_h)
    recency_scale_h: float = 12.0
    # FIRST TOUCH per channel in CHANNELS order (relative to direct).
    first_touch: tuple[float, ...] = (0.4, -0.8, 0.9, -0.5, 1.2, 0.3, 0.0)
    weekend: float = 0.25  # the journey's last event on a Saturday or Sunday (UTC)


@dataclass
class _Generated:
    """The clean generated data as flat numpy arrays (journeys sorted by user, then time)."""

    n_users: int
    j_user: np.ndarray
    j_offset: np.ndarray
    j_length: np.ndarray
    j_visits: np.ndarray
    j_intent: np.ndarray
    j_start_ms: np.ndarray
    j_last_ms: np.ndarray
    j_purchase_ms: np.ndarray
    j_prob: np.ndarray
    j_converted: np.ndarray
    e_journey: np.ndarray
    e_position: np.ndarray
    e_visit: np.ndarray  # visit number within the journey
    e_time_ms: np.ndarray
    e_type: np.ndarray
    e_channel: np.ndarray
    e_device: np.ndarray
    e_causal: np.ndarray
    effects: dict[str, np.ndarray]
    coefficients: dict[str, float]
    intercept: float


# --- public entry points -----------------------------------------------------------------------


def generate(
    out: Path,
    users: int = 20_000,
    seed: int = 0,
    conversion_rate: float = 0.05,
    behaviour: Behaviour | None = None,
    true_model: TrueModel | None = None,
) -> Path:
    """Write `out/events.csv` and its ground truth under `out/_truth`; return `out`.

    `_truth/journeys.parquet`: journey_id, user_id, true_probability, converted, n_events
    (and times, visits, intent, effects); `_truth/events.parquet`: the clean events with
    journey_id, position and a boolean `causal` (the event raised the true log-odds).
    """
    if users < 1:
        raise ValueError("users must be at least 1")
    if not 0 < conversion_rate < 1:
        raise ValueError("conversion_rate must be in (0, 1)")
    behaviour = behaviour or Behaviour()
    true_model = true_model or TrueModel()
    _check(behaviour, true_model)
    out = Path(out)
    # Separate streams: the labels' draw never moves the events, so a changed true model
    # relabels the same log.
    log_rng, label_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    g = _generate(log_rng, label_rng, users, conversion_rate, behaviour, true_model)

    truth_dir = out / "_truth"
    write_parquet(_truth_journeys(g), truth_dir / "journeys.parquet")
    write_parquet(_truth_events(g), truth_dir / "events.parquet")
    log = _log(g)
    with atomic_path(out / "events.csv") as tmp:
        log.write_csv(tmp)
    write_json(
        {
            "generator": "benchmarks/second_generator.py",
            "users": users,
            "seed": seed,
            "journeys": len(g.j_user),
            "events": log.height,
            "purchases": int(g.j_converted.sum()),
            "conversion_rate": float(g.j_converted.mean()),
            "expected_conversion_rate": float(g.j_prob.mean()),
            "behaviour": dataclasses.asdict(behaviour),
            "true_model": {"coefficients": g.coefficients, "intercept": g.intercept},
        },
        truth_dir / "summary.json",
    )
    return out


def bayes_roc_auc(journeys: pl.DataFrame, truth_dir: Path) -> float:
    """ROC AUC of the true probability against `journeys`' labels (joined on journey_id).

    `journeys` is an ingested frame with `journey_id` and `label` (e.g. the test split of
    `journeys.datasets.labelled`). Raises ValueError when under 90% of its journeys are in
    the truth (another log, another seed, another `journey.max_gap`) or when the labels
    hold one class only.
    """
    from sklearn.metrics import roc_auc_score

    truth = pl.read_parquet(
        Path(truth_dir) / "journeys.parquet", columns=["journey_id", "true_probability"]
    )
    joined = journeys.select("journey_id", "label").join(truth, on="journey_id", how="inner")
    matched = joined.height / max(journeys.height, 1)
    if journeys.height == 0 or matched < MIN_TRUTH_MATCH:
        raise ValueError(
            f"only {joined.height:,} of {journeys.height:,} journeys ({matched:.0%}) are in the "
            f"truth at {truth_dir}: not the log it describes, or ingested with other settings "
            f"(need {MIN_TRUTH_MATCH:.0%})"
        )
    labels = joined.get_column("label").to_numpy()
    if labels.min() == labels.max():
        raise ValueError("the journeys' labels hold one class only: ROC AUC is undefined")
    return float(roc_auc_score(labels, joined.get_column("true_probability").to_numpy()))


def count_features(journeys: pl.DataFrame) -> pl.DataFrame:
    """Per journey: how many events of each type (EVENT_TYPES but purchase) and the length."""
    return journeys.select(
        *(
            pl.col("event_type").list.count_matches(name).alias(f"n_{name}")
            for name in EVENT_TYPES
            if name != CONVERSION_EVENT
        ),
        pl.col("event_type").list.len().alias("n_events"),
    )


def counts_roc_auc(train: pl.DataFrame, test: pl.DataFrame, seed: int = 0) -> float:
    """Test ROC AUC of a HistGradientBoosting on event-type counts and length (no order,
    no time, no channel): what a model that only counts reaches."""
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.metrics import roc_auc_score
    from threadpoolctl import threadpool_limits

    model = HistGradientBoostingClassifier(random_state=seed)
    # One OpenMP thread: on a small or shared machine the default thread count
    # over-subscribes it (48 s instead of 1 s for 20,000 journeys on 2 cores).
    with threadpool_limits(limits=1, user_api="openmp"):
        model.fit(count_features(train).to_numpy(), train.get_column("label").to_numpy())
        scores = model.predict_proba(count_features(test).to_numpy())[:, 1]
    return float(roc_auc_score(test.get_column("label").to_numpy(), scores))


def _check(b: Behaviour, m: TrueModel) -> None:
    """Refuse settings that would break the log's promises (journeys, visits, ingestion)."""
    if not b.length_max >= 1:
        raise ValueError("length_max must be at least 1")
    if b.event_gap_min_s * _MS_PER_SECOND < 1:
        raise ValueError("event_gap_min_s must be at least 1 ms: timestamps stay unique")
    if b.event_gap_max_s * _MS_PER_SECOND >= b.visit_gap_min_h * _MS_PER_HOUR:
        raise ValueError("gaps inside a visit must stay shorter than gaps between visits")
    if b.visit_gap_max_h >= b.journey_gap_min_h or b.journey_gap_min_h <= 7 * 24:
        raise ValueError("visits must be < 7 days apart and journeys > 7 days apart")
    if len(b.first_touch_mix) != len(CHANNELS) or len(b.return_mix) != len(CHANNELS):
        raise ValueError(f"channel mixes need {len(CHANNELS)} weights")
    if len(m.first_touch) != len(CHANNELS):
        raise ValueError(f"first_touch needs {len(CHANNELS)} coefficients")
    if np.shape(b.transitions) != (CHECKOUT_START + 1, len(BROWSE_EVENTS)):
        raise ValueError(f"transitions must be {CHECKOUT_START + 1} x {len(BROWSE_EVENTS)}")
    if len(b.intent_tilt) != len(BROWSE_EVENTS):
        raise ValueError(f"intent_tilt needs {len(BROWSE_EVENTS)} values")


# --- generation --------------------------------------------------------------------------------


def _generate(
    rng: np.random.Generator,
    label_rng: np.random.Generator,
    n_users: int,
    conversion_rate: float,
    b: Behaviour,
    m: TrueModel,
) -> _Generated:
    """Journeys, visits, events and labels as flat arrays."""
    range_ms = b.days * _MS_PER_DAY
    # Proposed journeys and their intent.
    u_intent = rng.standard_normal(n_users)
    n_proposed = np.minimum(rng.geometric(b.journeys_p, n_users), b.max_journeys)
    p_user = np.repeat(np.arange(n_users, dtype=np.int64), n_proposed)
    p_first = np.r_[True, p_user[1:] != p_user[:-1]]
    n_p = len(p_user)
    noise_share = np.sqrt(1.0 - b.intent_user_share**2)
    p_intent = b.intent_user_share * u_intent[p_user] + noise_share * rng.standard_normal(n_p)

    # Visits per journey and events per visit, both growing with intent.
    p_visits = np.minimum(
        1 + rng.poisson(b.visits_mean * np.exp(b.visits_intent * p_intent)), b.max_visits
    )
    v_journey = np.repeat(np.arange(n_p, dtype=np.int64), p_visits)
    depth = b.depth_mean * np.exp(b.depth_intent * p_intent[v_journey])
    v_length = rng.geometric(1.0 / (1.0 + depth))  # 1 touch + (geometric - 1) browsing steps
    # Cap journeys at length_max events: later visits are cut short or dropped.
    v_end = np.cumsum(v_length)
    v_first = np.r_[True, v_journey[1:] != v_journey[:-1]]
    v_pos = v_end - v_length - (v_end - v_length)[v_first][_group_index(v_first)]
    v_length = np.clip(b.length_max - v_pos, 0, v_length)
    kept_visit = v_length > 0
    v_journey, v_length = v_journey[kept_visit], v_length[kept_visit]
    p_visits = np.bincount(v_journey, minlength=n_p)
    p_length = np.bincount(v_journey, weights=v_length, minlength=n_p).astype(np.int64)
    p_offset = np.r_[0, np.cumsum(p_length)[:-1]]

    # Events: gaps, then times relative to each journey's first event.
    n_ev = int(p_length.sum())
    e_vis = np.repeat(np.arange(len(v_journey), dtype=np.int64), v_length)
    ev_journey = v_journey[e_vis]
    visit_start = np.r_[True, e_vis[1:] != e_vis[:-1]]
    gap = np.where(visit_start, _visit_gaps(rng, b, n_ev), _event_gaps(rng, b, n_ev))
    gap[p_offset] = 0
    elapsed = np.cumsum(gap)
    rel_ms = elapsed - elapsed[p_offset][ev_journey]
    # A purchase slot after the last event for every journey (labels never move the timeline).
    purchase_gap = _event_gaps(rng, b, n_p)
    duration = rel_ms[p_offset + p_length - 1] + purchase_gap

    # Timeline: the first journey starts uniformly where it fits in the range; each later one
    # > 7 days after the previous one's end, dropped when it would end after the range.
    journey_gap = b.journey_gap_min_h * _MS_PER_HOUR + np.minimum(
        b.journey_gap_scale_d * _MS_PER_DAY * rng.pareto(b.journey_gap_alpha, n_p),
        b.journey_gap_extra_max_d * _MS_PER_DAY,
    )
    first_start = rng.random(n_p) * np.maximum(range_ms - duration, 0)
    step = np.where(p_first, first_start, journey_gap).astype(np.int64) + duration
    total = np.cumsum(step)
    end = total - (total - step)[p_first][_group_index(p_first)]
    start = end - duration
    keep = p_first | (end <= range_ms)

    # Compact to the kept journeys.
    keep_ev = keep[ev_journey]
    j_user = p_user[keep]
    j_length = p_length[keep]
    j_visits = p_visits[keep]
    j_intent = p_intent[keep]
    j_offset = np.r_[0, np.cumsum(j_length)[:-1]]
    start_ms = int((b.start - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1))
    j_start_ms = start_ms + start[keep]
    j_purchase_ms = j_start_ms + duration[keep]
    n_j = len(j_user)
    e_journey = np.repeat(np.arange(n_j, dtype=np.int64), j_length)
    e_position = np.arange(len(e_journey), dtype=np.int64) - j_offset[e_journey]
    e_time_ms = j_start_ms[e_journey] + rel_ms[keep_ev]
    visit_start = visit_start[keep_ev]
    j_last_ms = e_time_ms[j_offset + j_length - 1]
    visit_id = np.cumsum(visit_start) - 1  # global visit index
    e_visit = visit_id - visit_id[j_offset][e_journey]

    # Channels and devices per visit.
    n_visits = int(visit_id[-1]) + 1
    first_visit = np.zeros(n_visits, dtype=bool)
    first_visit[visit_id[j_offset]] = True
    v_channel = np.where(
        first_visit,
        categorical(rng, b.first_touch_mix, n_visits),
        categorical(rng, b.return_mix, n_visits),
    )
    u_device = categorical(rng, b.device_mix, n_users)
    v_device = np.where(
        rng.random(n_visits) < b.device_switch_prob,
        categorical(rng, b.device_mix, n_visits),
        u_device[j_user[e_journey[visit_start]]],
    )
    e_channel = v_channel[visit_id]
    e_device = v_device[visit_id]
    e_type = _event_types(rng, b, visit_start, e_channel, j_offset, j_length, j_intent)

    effects, coefficients, causal = _true_effects(
        m, e_type, e_channel, e_journey, e_position, visit_id, e_time_ms, j_offset, j_length,
        j_visits, j_last_ms,
    )  # fmt: skip
    score = sum(coefficients[name] * value for name, value in effects.items())
    intercept = calibrate_intercept(score, conversion_rate)
    j_prob = 1.0 / (1.0 + np.exp(-(score + intercept)))
    j_converted = label_rng.random(n_j) < j_prob
    return _Generated(
        n_users=n_users,
        j_user=j_user,
        j_offset=j_offset,
        j_length=j_length,
        j_visits=j_visits,
        j_intent=j_intent,
        j_start_ms=j_start_ms,
        j_last_ms=j_last_ms,
        j_purchase_ms=j_purchase_ms,
        j_prob=j_prob,
        j_converted=j_converted,
        e_journey=e_journey,
        e_position=e_position,
        e_visit=e_visit,
        e_time_ms=e_time_ms,
        e_type=e_type,
        e_channel=e_channel,
        e_device=e_device,
        e_causal=causal,
        effects=effects,
        coefficients=coefficients,
        intercept=intercept,
    )


def _event_types(
    rng: np.random.Generator,
    b: Behaviour,
    visit_start: np.ndarray,
    e_channel: np.ndarray,
    j_offset: np.ndarray,
    j_length: np.ndarray,
    j_intent: np.ndarray,
) -> np.ndarray:
    """Each visit opens with its touch, then browsing steps from an intent-tilted Markov
    chain; the cart (items added minus removed) persists across the journey's visits."""
    e_type = np.full(len(visit_start), -1, dtype=np.int8)
    e_type[visit_start] = np.where(e_channel[visit_start] == DIRECT, LANDING, AD_CLICK)
    base = np.asarray(b.transitions, dtype=np.float64)
    browse = np.asarray(BROWSE_EVENTS, dtype=np.int8)
    needs_item = np.isin(browse, (REMOVE_FROM_CART, CHECKOUT_START))
    tilt = np.exp(j_intent[:, None] * np.asarray(b.intent_tilt)[None, :])
    items = np.zeros(len(j_length), dtype=np.int64)
    # Journeys longest first, so the journeys still going at position p are a prefix.
    by_length = np.argsort(-j_length, kind="stable")
    sorted_offset = j_offset[by_length]
    n_active = np.searchsorted(-j_length[by_length], -np.arange(int(j_length.max())), "left")
    for p in range(1, len(n_active)):
        journeys = by_length[: n_active[p]]
        idx = sorted_offset[: n_active[p]] + p
        browsing = ~visit_start[idx]
        journeys, idx = journeys[browsing], idx[browsing]
        weights = base[e_type[idx - 1]] * tilt[journeys]
        weights[:, needs_item] *= (items[journeys] > 0)[:, None]
        cumulative = np.cumsum(weights, axis=1)
        u = rng.random(len(idx)) * cumulative[:, -1]
        chosen = browse[np.minimum((u[:, None] >= cumulative).sum(axis=1), len(browse) - 1)]
        e_type[idx] = chosen
        items[journeys] += (chosen == ADD_TO_CART).astype(np.int64)
        items[journeys] -= (chosen == REMOVE_FROM_CART).astype(np.int64)
    return e_type


def _true_effects(
    m: TrueModel,
    e_type: np.ndarray,
    e_channel: np.ndarray,
    e_journey: np.ndarray,
    e_position: np.ndarray,
    visit_id: np.ndarray,
    e_time_ms: np.ndarray,
    j_offset: np.ndarray,
    j_length: np.ndarray,
    j_visits: np.ndarray,
    j_last_ms: np.ndarray,
) -> tuple[dict[str, np.ndarray], dict[str, float], np.ndarray]:
    """Per-journey features of the true model, their coefficients, and the causal flag per
    event (the event raised the true log-odds)."""
    is_cart = e_type == ADD_TO_CART
    is_checkout = e_type == CHECKOUT_START
    causal = np.zeros(len(e_type), dtype=bool)
    effects: dict[str, np.ndarray] = {}
    coefficients: dict[str, float] = {}

    def effect(name: str, coefficient: float, value: np.ndarray) -> None:
        effects[name] = value.astype(np.float64)
        coefficients[name] = float(coefficient)

    # ENGAGEMENT: the return visits (their touches raised it).
    effect("engagement", m.engagement, np.log(j_visits))
    if m.engagement > 0:
        causal |= (e_type == AD_CLICK) | (e_type == LANDING)
        causal[j_offset] = False

    # ORDER: a checkout after a cart of the same visit.
    visit_first = np.r_[True, visit_id[1:] != visit_id[:-1]]
    visit_offset = np.flatnonzero(visit_first)
    carts_before = np.cumsum(is_cart) - is_cart  # carts strictly before each event
    carts_before -= carts_before[visit_offset][visit_id]  # ... within its visit
    paired_checkout = is_checkout & (carts_before > 0)
    effect(
        "cart_checkout_in_visit",
        m.cart_checkout_in_visit,
        np.bitwise_or.reduceat(paired_checkout, j_offset),
    )
    if m.cart_checkout_in_visit > 0:
        last_paired = np.maximum.reduceat(np.where(paired_checkout, e_position, -1), visit_offset)
        causal |= paired_checkout | (is_cart & (e_position < last_paired[visit_id]))

    # ORDER: the last cart abandoned (no checkout after it in its visit).
    last_cart = np.maximum.reduceat(np.where(is_cart, e_position, -1), j_offset)
    has_cart = last_cart >= 0
    cart_visit = visit_id[j_offset + np.maximum(last_cart, 0)]
    rescued = (
        is_checkout
        & (visit_id == cart_visit[e_journey])
        & (e_position > last_cart[e_journey])
        & has_cart[e_journey]
    )
    abandoned = has_cart & ~np.bitwise_or.reduceat(rescued, j_offset)
    effect("abandoned_last_cart", m.abandoned_last_cart, abandoned)
    if m.abandoned_last_cart > 0:
        causal[(j_offset + last_cart)[abandoned]] = True

    # RECENCY: hours from the last ad click to the journey's last event.
    last_click = np.maximum.reduceat(np.where(e_type == AD_CLICK, e_position, -1), j_offset)
    has_click = last_click >= 0
    hours = (j_last_ms - e_time_ms[j_offset + np.maximum(last_click, 0)]) / _MS_PER_HOUR
    effect(
        "click_recency", m.click_recency, np.where(has_click, np.exp(-hours / m.recency_scale_h), 0)
    )
    if m.click_recency > 0:
        causal[(j_offset + last_click)[has_click]] = True

    # FIRST TOUCH: one effect per channel of the journey's first event.
    first_channel = e_channel[j_offset]
    for code, channel in enumerate(CHANNELS):
        effect(f"first_touch_{channel}", m.first_touch[code], first_channel == code)
    causal[j_offset] |= np.asarray(m.first_touch)[first_channel] > 0

    # TIMING: the last event's UTC weekday; a moment is no event's doing, so nothing causal.
    weekday = (j_last_ms // _MS_PER_DAY + _EPOCH_WEEKDAY) % 7
    effect("weekend", m.weekend, weekday >= _SATURDAY)
    return effects, coefficients, causal


# --- outputs -----------------------------------------------------------------------------------


def _log(g: _Generated) -> pl.DataFrame:
    """The raw log: events plus each converted journey's purchase, by user then time."""
    n_e = len(g.e_type)
    conv = np.flatnonzero(g.j_converted)
    # Each purchase goes right after its journey's last event.
    before = np.r_[0, np.cumsum(g.j_converted)[:-1]]
    e_row = np.arange(n_e) + before[g.e_journey]
    p_row = g.j_offset[conv] + g.j_length[conv] + before[conv]
    last = g.j_offset[conv] + g.j_length[conv] - 1

    def rows(events: np.ndarray, purchases: np.ndarray) -> np.ndarray:
        column = np.empty(n_e + len(conv), dtype=np.result_type(events, purchases))
        column[e_row] = events
        column[p_row] = purchases
        return column

    return pl.DataFrame(
        {
            "user_id": user_ids(g.n_users, USER_PREFIX).gather(
                rows(g.j_user[g.e_journey], g.j_user[conv])
            ),
            "timestamp": pl.Series(rows(g.e_time_ms, g.j_purchase_ms[conv]))
            .cast(pl.Datetime("ms", "UTC"))
            .dt.strftime(TIMESTAMP_FORMAT),
            "event_type": pl.Series(EVENT_TYPES).gather(
                rows(g.e_type, np.full(len(conv), PURCHASE, dtype=np.int8))
            ),
            "channel": pl.Series(CHANNELS).gather(rows(g.e_channel, g.e_channel[last])),
            "device": pl.Series(DEVICES).gather(rows(g.e_device, g.e_device[last])),
        }
    ).select(LOG_COLUMNS)


def _journey_ids(g: _Generated) -> pl.Series:
    """`{user_id}-{epoch microseconds of the first event}`, as the ingester builds it."""
    return pl.DataFrame(
        {"u": user_ids(g.n_users, USER_PREFIX).gather(g.j_user), "us": g.j_start_ms * 1000}
    ).select(journey_id=pl.format("{}-{}", "u", "us"))["journey_id"]


def _truth_journeys(g: _Generated) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "journey_id": _journey_ids(g),
            "user_id": user_ids(g.n_users, USER_PREFIX).gather(g.j_user),
            "start_time": utc_from_ms(g.j_start_ms),
            "end_time": utc_from_ms(np.where(g.j_converted, g.j_purchase_ms, g.j_last_ms)),
            "last_event_time": utc_from_ms(g.j_last_ms),
            "true_probability": g.j_prob,
            "converted": g.j_converted,
            "n_events": g.j_length.astype(np.int64),
            "n_visits": g.j_visits.astype(np.int64),
            "intent": g.j_intent,  # latent: acts only through the events it causes
            **{f"effect_{name}": value for name, value in g.effects.items()},
        }
    )


def _truth_events(g: _Generated) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "user_id": user_ids(g.n_users, USER_PREFIX).gather(g.j_user[g.e_journey]),
            "timestamp": utc_from_ms(g.e_time_ms),
            "event_type": pl.Series(EVENT_TYPES).gather(g.e_type),
            "channel": pl.Series(CHANNELS).gather(g.e_channel),
            "device": pl.Series(DEVICES).gather(g.e_device),
            "journey_id": _journey_ids(g).gather(g.e_journey),
            "position": g.e_position.astype(np.int32),
            "visit": g.e_visit.astype(np.int32),
            "causal": g.e_causal,
        }
    )


# --- helpers -----------------------------------------------------------------------------------


def _group_index(first: np.ndarray) -> np.ndarray:
    """For each row, the index (among group starts) of its group's first row."""
    return np.cumsum(first) - 1


def _event_gaps(rng: np.random.Generator, b: Behaviour, n: int) -> np.ndarray:
    """Log-logistic gaps inside a visit, in whole ms: median * (u / (1 - u)) ** (1 / shape)."""
    u = rng.random(n)
    draws = b.event_gap_median_s * _MS_PER_SECOND * (u / (1.0 - u)) ** (1.0 / b.event_gap_shape)
    low, high = b.event_gap_min_s * _MS_PER_SECOND, b.event_gap_max_s * _MS_PER_SECOND
    return np.clip(np.rint(draws), low, high).astype(np.int64)


def _visit_gaps(rng: np.random.Generator, b: Behaviour, n: int) -> np.ndarray:
    """Pareto gaps between visits, in whole ms (heavy tail: most short, some days)."""
    draws = b.visit_gap_min_h * _MS_PER_HOUR * (1.0 + rng.pareto(b.visit_gap_alpha, n))
    return np.minimum(np.rint(draws), b.visit_gap_max_h * _MS_PER_HOUR).astype(np.int64)


# --- command line ------------------------------------------------------------------------------


def evaluate(out: Path, config_path: Path = ROOT / "conf" / "default.yaml") -> dict[str, object]:
    """Ingest `out` with `config_path` into `out/_ingest`, and measure the room for models:
    split sizes, conversion rate, the Bayes ROC AUC on test and a counts-only HGB's."""
    from journeys.config import load_config
    from journeys.datasets import labelled, scan_journeys
    from journeys.ingest import ingest

    work = out / "_ingest"
    config = load_config(
        config_path,
        [
            f"paths.raw={out}",
            f"paths.journeys={work / 'journeys'}",
            f"paths.quarantine={work / 'quarantine'}",
        ],
    )
    with contextlib.redirect_stdout(io.StringIO()):
        report = ingest(config)
    journeys = scan_journeys(config.paths.journeys)
    train = labelled(journeys, ("train",)).collect()
    test = labelled(journeys, ("test",)).collect()
    return {
        "journeys_by_split": report["journeys_by_split"],
        "journeys": report["journeys"],
        "conversion_rate": report["journeys_converted"] / report["journeys"],
        "test_conversions": int(test.get_column("label").sum()),
        "bayes_test_roc_auc": bayes_roc_auc(test, out / "_truth"),
        "counts_hgb_test_roc_auc": counts_roc_auc(train, test),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder for events.csv and _truth/")
    parser.add_argument("--users", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--conversion-rate", type=float, default=0.05)
    parser.add_argument(
        "--evaluate",
        action="store_true",
        help="then ingest with conf/default.yaml into OUT/_ingest and print the Bayes and "
        "counts-only test ROC AUC",
    )
    args = parser.parse_args()
    out = generate(args.out, users=args.users, seed=args.seed, conversion_rate=args.conversion_rate)
    print(f"wrote {out / 'events.csv'} and {out / '_truth'}")
    if args.evaluate:
        for key, value in evaluate(out).items():
            print(f"{key}: {value}")


if __name__ == "__main__":
    main()

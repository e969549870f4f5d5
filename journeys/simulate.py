"""Synthetic AdTech event logs with known ground truth, for demos, tests and benchmarks.

Each user goes through one or more journeys: visits brought in by a marketing channel (an
ad click, an email, ... or `direct`), browsing events inside each visit, and, for converted
journeys, a final `purchase`. Whether a journey converts is drawn from a *true* probability
that depends on the ORDER, RECENCY, FIRST TOUCH, TIMING (time away, the first visit's
length, the hour of day) and PRICE of its events, so a model that only counts events cannot
reach the Bayes-optimal score: there is room for a sequence model to win. Each effect's
value per journey is written with the truth, and the events that raised the true log-odds
are marked as causal, as ground truth for attribution.

Everything is vectorised with numpy (one loop over event positions, at most
`Behaviour.length_max` short steps) and written with Polars; 10 million events take
seconds. The same arguments give byte-identical files.

Layout written under `out/` (the ingester skips names starting with `_` or `.`)::

    events.csv | events.jsonl | events.parquet       (or events-000.csv, ... with n_files > 1)
    _truth/journeys.parquet   one row per journey: true_probability, converted, and each
                              effect of the true model (`effect_<name>`, see TrueModel)
    _truth/events.parquet     clean events (no dirt, no duplicates, no purchase) + causal flag
    _truth/summary.json       counts, dirty counts, realised conversion rate, and the true
                              model's coefficients and intercept
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

import numpy as np
import polars as pl

from journeys.storage import atomic_path, write_json, write_parquet

# --- vocabularies (codes are indices into these tuples) -----------------------------------

EVENT_TYPES: tuple[str, ...] = (
    "search",
    "page_view",
    "product_view",
    "click",
    "add_to_cart",
    "checkout",
    "purchase",
)
SEARCH, PAGE_VIEW, PRODUCT_VIEW, CLICK, ADD_TO_CART, CHECKOUT, PURCHASE = range(len(EVENT_TYPES))
# What one browsing step inside a visit can produce (clicks only open visits).
BROWSE_EVENTS: tuple[int, ...] = (SEARCH, PAGE_VIEW, PRODUCT_VIEW, ADD_TO_CART, CHECKOUT)

CHANNELS: tuple[str, ...] = ("paid_search", "display", "social", "email", "affiliate", "direct")
PAID_SEARCH, DISPLAY, SOCIAL, EMAIL, AFFILIATE, DIRECT = range(len(CHANNELS))

DEVICES: tuple[str, ...] = ("mobile", "desktop", "tablet")

# Campaigns per channel, in CHANNELS order; `direct` visits have no campaign (null).
CAMPAIGNS: tuple[tuple[str, ...], ...] = (
    ("ps_brand", "ps_generic", "ps_competitor"),
    ("dsp_prospecting", "dsp_retargeting", "dsp_video"),
    ("soc_feed", "soc_stories", "soc_influencer"),
    ("em_newsletter", "em_cart_reminder", "em_promo"),
    ("aff_coupon", "aff_review", "aff_cashback"),
    (),
)

RAW_COLUMNS: tuple[str, ...] = (
    "user_id",
    "timestamp",
    "event_type",
    "channel",
    "device",
    "campaign",
    "price",
)
TIMESTAMP_FORMAT = "%Y-%m-%dT%H:%M:%S%.3fZ"
DIRTY_KINDS: tuple[str, ...] = (
    "missing_user_id",
    "missing_event_type",
    "bad_timestamp",
    "duplicates",
)

_MS_PER_MINUTE = 60_000
_MS_PER_HOUR = 3_600_000
_MS_PER_DAY = 24 * _MS_PER_HOUR


@dataclass(frozen=True)
class Behaviour:
    """How simulated users browse: journeys, lengths, visits, gaps, channels and devices."""

    # Journeys per user: 1 + Poisson(extra_journeys_mean); later journeys that would end
    # after the date range are dropped, so the realised mean is lower (about 1.5).
    extra_journeys_mean: float = 1.0
    # Events per journey before any purchase: log-normal, clipped.
    length_median: float = 9.0
    length_sigma: float = 0.8
    length_min: int = 2
    length_max: int = 150
    # Each event after the first opens a new visit with this probability.
    new_visit_prob: float = 0.2
    # Gaps between events of one visit (seconds to minutes): log-normal, clipped.
    event_gap_median_s: float = 45.0
    event_gap_sigma: float = 1.0
    event_gap_min_s: float = 1.0
    event_gap_max_s: float = 1800.0
    # Gaps between visits of one journey (hours to days), always < journey.max_gap (7d).
    visit_gap_median_h: float = 8.0
    visit_gap_sigma: float = 1.3
    visit_gap_min_h: float = 0.5
    visit_gap_max_h: float = 144.0
    # Gaps between journeys of one user, always > journey.max_gap (7d).
    journey_gap_min_h: float = 7 * 24 + 1
    journey_gap_extra_mean_d: float = 10.0
    # Channel of the first visit of a journey, and of later visits (CHANNELS order).
    first_touch_mix: tuple[float, ...] = (0.28, 0.20, 0.17, 0.10, 0.08, 0.17)
    return_mix: tuple[float, ...] = (0.20, 0.15, 0.08, 0.12, 0.05, 0.40)
    # A `direct` visit opens with a search (else a page_view); other channels with a click.
    direct_entry_search_prob: float = 0.4
    # Each user has a primary device; a visit uses another device with `device_switch_prob`.
    device_mix: tuple[float, ...] = (0.55, 0.35, 0.10)
    device_switch_prob: float = 0.15
    # Prices: each user has a usual price level (log-normal over users); each priced event
    # (a product seen, carted or checked out) costs that level times log-normal noise, in
    # cents. Other events have no price (an empty field: a missing value).
    priced_events: tuple[int, ...] = (PRODUCT_VIEW, ADD_TO_CART, CHECKOUT)
    price_usual_median: float = 40.0
    price_usual_sigma: float = 0.8
    price_sigma: float = 0.4
    # Next browsing event given the previous event: rows in EVENT_TYPES order up to checkout
    # (search, page_view, product_view, click, add_to_cart, checkout), columns BROWSE_EVENTS.
    transitions: tuple[tuple[float, ...], ...] = (
        (0.15, 0.25, 0.52, 0.07, 0.01),  # after search
        (0.15, 0.33, 0.45, 0.06, 0.01),  # after page_view
        (0.10, 0.25, 0.35, 0.24, 0.06),  # after product_view
        (0.10, 0.42, 0.40, 0.08, 0.00),  # after click
        (0.05, 0.25, 0.42, 0.10, 0.18),  # after add_to_cart
        (0.05, 0.45, 0.40, 0.10, 0.00),  # after checkout
    )


@dataclass(frozen=True)
class TrueModel:
    """Coefficients of the true conversion log-odds; the intercept is calibrated per run.

    Features are chosen so that counting events is not enough: what matters is where the
    events are (after the last ad click, among the last few events), which channel came
    first, and how long the user was away before the final visit.
    """

    # ORDER: an add_to_cart after the journey's last ad click (a click that "worked").
    cart_after_last_click: float = 1.0
    # RECENCY: add_to_cart / checkout, or product_view, among the last `recent_window` events.
    recent_window: int = 3
    recent_cart: float = 1.6
    recent_product_view: float = 0.5
    # FIRST TOUCH, per channel in CHANNELS order (relative to `direct`).
    first_touch: tuple[float, ...] = (0.2, -0.4, -0.5, 1.0, 0.8, 0.0)
    # INTERACTION: a paid_search click followed within `search_cart_window` events by a cart.
    search_cart_window: int = 3
    search_to_cart: float = 0.9
    # TIMING: per unit of log1p(hours away before the final visit / 12); negative = decay.
    final_visit_gap: float = -1.2
    # TIMING: a long first visit, per unit of log1p(its minutes / first_visit_scale_min).
    long_first_visit: float = 0.6
    first_visit_scale_min: float = 5.0
    # TIME OF DAY: times cos(2 pi (hour - peak) / 24) of the last event's UTC hour: the
    # evening converts best, the small hours worst.
    hour_of_day: float = 0.5
    hour_peak: float = 20.0
    # PRICE: per unit of log(price of the last priced event) minus the mean log price of the
    # journey's priced events: dearer than the user's usual converts less (0 when the
    # journey has fewer than two prices).
    price_premium: float = -1.2
    # COUNTS contribute a little: per unit of log1p(number of product_views).
    product_view_count: float = 0.15


@dataclass(frozen=True)
class SimulationResult:
    """What `simulate` wrote and how much dirt it injected."""

    events_path: Path  # the raw log file written (the first one when n_files > 1)
    truth_dir: Path  # out/_truth
    n_events: int  # rows written to the log (dirty rows and duplicates included)
    n_users: int
    n_journeys: int
    dirty: dict[str, int] = field(default_factory=dict)  # kind -> rows injected
    events_paths: tuple[Path, ...] = ()  # every log file written, in order


@dataclass
class _Clean:
    """The clean simulation before dirt: journeys, their events, purchases."""

    # per user
    n_users: int
    user_ids: pl.Series
    # per journey (sorted by user, then time)
    j_user: np.ndarray
    j_offset: np.ndarray  # index of the journey's first event in the event arrays
    j_length: np.ndarray  # events before the purchase
    j_start_ms: np.ndarray
    j_last_ms: np.ndarray  # last event before the purchase
    j_purchase_ms: np.ndarray  # when a purchase would happen (used only if converted)
    j_prob: np.ndarray
    j_converted: np.ndarray
    # per event (journey by journey, position by position; purchases not included)
    e_journey: np.ndarray
    e_position: np.ndarray
    e_time_ms: np.ndarray
    e_type: np.ndarray
    e_channel: np.ndarray
    e_device: np.ndarray
    e_campaign: np.ndarray  # index into the flat campaign list, -1 for none
    e_price: np.ndarray  # NaN for events without a price
    e_causal: np.ndarray
    # the true model: name -> per-journey value, name -> coefficient, and the intercept
    effects: dict[str, np.ndarray]
    coefficients: dict[str, float]
    intercept: float


# --- public entry point ----------------------------------------------------------------------


def simulate(
    out: Path,
    *,
    users: int = 20_000,
    seed: int = 0,
    start: datetime = datetime(2026, 1, 1),
    days: int = 90,
    conversion_rate: float = 0.04,
    dirty_rate: float = 0.0,
    shuffle: bool = False,
    format: Literal["csv", "jsonl", "parquet"] = "csv",
    n_files: int = 1,
    behaviour: Behaviour | None = None,
    true_model: TrueModel | None = None,
) -> SimulationResult:
    """Write a synthetic raw event log under folder `out` and its ground truth under `_truth`.

    `dirty_rate` is the fraction of written rows that are dirty, split evenly between rows
    missing user_id, rows missing event_type, rows with an unparseable timestamp and exact
    duplicates of clean rows. Dirt is added on top of the clean log, so the clean rows and
    the truth do not depend on it. `start` is read as UTC when it has no time zone.
    """
    if users < 1:
        raise ValueError("users must be at least 1")
    if days < 1:
        raise ValueError("days must be at least 1")
    if not 0 < conversion_rate < 1:
        raise ValueError("conversion_rate must be in (0, 1)")
    if not 0 <= dirty_rate < 0.5:
        raise ValueError("dirty_rate must be in [0, 0.5)")
    if format not in ("csv", "jsonl", "parquet"):
        raise ValueError(f"unknown format {format!r}")
    if n_files < 1:
        raise ValueError("n_files must be at least 1")
    behaviour = behaviour or Behaviour()
    true_model = true_model or TrueModel()
    _check_behaviour(behaviour)
    out = Path(out)

    # Independent streams, so that dirt and shuffling never change the clean events, and
    # prices (drawn last) leave the events' timeline and types as they were without them.
    clean_rng, dirt_rng, shuffle_rng, price_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4)
    )
    start_ms = _epoch_ms(start)
    clean = _simulate_clean(
        (clean_rng, price_rng),
        users,
        start_ms,
        days * _MS_PER_DAY,
        conversion_rate,
        behaviour,
        true_model,
    )
    log = _clean_log(clean)
    log, dirty = _add_dirt(log, dirt_rng, dirty_rate)
    if shuffle:
        log = log[shuffle_rng.permutation(log.height)]

    truth_dir = out / "_truth"
    journeys = _truth_journeys(clean)
    write_parquet(journeys, truth_dir / "journeys.parquet")
    write_parquet(_truth_events(clean), truth_dir / "events.parquet")
    paths = _write_log(log, out, format, n_files)

    result = SimulationResult(
        events_path=paths[0],
        truth_dir=truth_dir,
        n_events=log.height,
        n_users=clean.n_users,
        n_journeys=len(clean.j_user),
        dirty=dirty,
        events_paths=tuple(paths),
    )
    summary = {
        **{k: v for k, v in dataclasses.asdict(result).items() if k != "events_paths"},
        "events_paths": [str(p) for p in paths],
        "n_clean_events": int(log.height - sum(dirty.values())),
        "n_purchases": int(clean.j_converted.sum()),
        "conversion_rate": float(clean.j_converted.mean()),
        "expected_conversion_rate": float(clean.j_prob.mean()),
        "seed": seed,
        "start": datetime.fromtimestamp(start_ms / 1000, UTC).isoformat(),
        "days": days,
        "format": format,
        "shuffle": shuffle,
        "true_model": {"coefficients": clean.coefficients, "intercept": clean.intercept},
    }
    write_json(summary, truth_dir / "summary.json")
    return result


def _check_behaviour(b: Behaviour) -> None:
    """Refuse settings that would break the promises the tests and the ingester rely on."""
    if not 1 <= b.length_min <= b.length_max:
        raise ValueError("need 1 <= length_min <= length_max")
    if b.event_gap_min_s < 0.001:
        # whole-millisecond gaps of at least 1 ms keep timestamps unique per user
        raise ValueError("event_gap_min_s must be at least 0.001 (1 ms)")
    if b.visit_gap_max_h >= b.journey_gap_min_h:
        raise ValueError("visit gaps must stay shorter than gaps between journeys")
    if len(b.first_touch_mix) != len(CHANNELS) or len(b.return_mix) != len(CHANNELS):
        raise ValueError(f"channel mixes need {len(CHANNELS)} weights")
    if np.shape(b.transitions) != (CHECKOUT + 1, len(BROWSE_EVENTS)):
        raise ValueError("transitions must be a 6 x 5 table (see Behaviour)")
    if not set(b.priced_events) <= set(BROWSE_EVENTS):
        raise ValueError("priced_events must be browsing events (see BROWSE_EVENTS)")


# --- clean simulation ------------------------------------------------------------------------


def _simulate_clean(
    rngs: tuple[np.random.Generator, np.random.Generator],
    n_users: int,
    start_ms: int,
    range_ms: int,
    conversion_rate: float,
    b: Behaviour,
    m: TrueModel,
) -> _Clean:
    """Journeys, their events and labels, all as flat numpy arrays."""
    rng, price_rng = rngs
    # Proposed journeys per user; timing decides later which of them fit in the range.
    n_proposed = 1 + rng.poisson(b.extra_journeys_mean, n_users)
    p_user = np.repeat(np.arange(n_users, dtype=np.int64), n_proposed)
    p_first = np.r_[True, p_user[1:] != p_user[:-1]]
    n_p = len(p_user)

    length = np.clip(
        np.rint(b.length_median * np.exp(b.length_sigma * rng.standard_normal(n_p))),
        b.length_min,
        b.length_max,
    ).astype(np.int64)
    offset = np.r_[0, np.cumsum(length)[:-1]]
    n_ev = int(length.sum())
    ev_journey = np.repeat(np.arange(n_p, dtype=np.int64), length)
    position = np.arange(n_ev, dtype=np.int64) - offset[ev_journey]

    # Visits: position 0 always opens one; later positions open one at random.
    visit_start = rng.random(n_ev) < b.new_visit_prob
    visit_start[offset] = True
    gap = np.where(visit_start, _visit_gaps(rng, b, n_ev), _event_gaps(rng, b, n_ev))
    gap[offset] = 0
    elapsed = np.cumsum(gap)
    rel_ms = elapsed - elapsed[offset][ev_journey]  # time since the journey's first event
    # A purchase slot after the last event is reserved for every journey, so that the
    # timeline (and the > 7 day gap to the next journey) does not depend on the label.
    purchase_gap = _event_gaps(rng, b, n_p)
    duration = rel_ms[offset + length - 1] + purchase_gap

    # Timeline: the first journey starts uniformly in the range (moved earlier so that it
    # ends inside the range when it can); each later one starts > 7 days after the previous
    # one's end, and is dropped when it would end after the range.
    journey_gap = (
        b.journey_gap_min_h * _MS_PER_HOUR
        + rng.exponential(b.journey_gap_extra_mean_d * _MS_PER_DAY, n_p)
    ).astype(np.int64)
    first_start = (rng.random(n_p) * np.maximum(range_ms - duration, 0)).astype(np.int64)
    step = np.where(p_first, first_start, journey_gap) + duration
    total = np.cumsum(step)
    user_base = (total - step)[p_first][p_user]  # sum of steps before the user's first journey
    end = total - user_base  # relative to the range start
    start = end - duration
    keep = p_first | (end <= range_ms)

    # Compact to the kept journeys and their events.
    keep_ev = keep[ev_journey]
    j_user = p_user[keep]
    j_length = length[keep]
    j_offset = np.r_[0, np.cumsum(j_length)[:-1]]
    j_start_ms = start_ms + start[keep]
    j_purchase_ms = j_start_ms + duration[keep]
    n_j = len(j_user)
    e_journey = np.repeat(np.arange(n_j, dtype=np.int64), j_length)
    e_position = position[keep_ev]
    e_time_ms = j_start_ms[e_journey] + rel_ms[keep_ev]
    visit_start = visit_start[keep_ev]
    j_last_ms = e_time_ms[j_offset + j_length - 1]

    # Channels and devices per visit, spread over the visit's events.
    n_e = len(e_journey)
    visit_id = np.cumsum(visit_start) - 1
    n_visits = int(visit_id[-1]) + 1
    first_visit = np.zeros(n_visits, dtype=bool)
    first_visit[visit_id[j_offset]] = True
    v_channel = np.where(
        first_visit,
        categorical(rng, b.first_touch_mix, n_visits),
        categorical(rng, b.return_mix, n_visits),
    )
    u_device = categorical(rng, b.device_mix, n_users)
    v_user = j_user[e_journey[visit_start]]
    v_device = np.where(
        rng.random(n_visits) < b.device_switch_prob,
        categorical(rng, b.device_mix, n_visits),
        u_device[v_user],
    )
    campaign_base = np.cumsum([0, *(len(c) for c in CAMPAIGNS)])[:-1]
    n_campaigns = np.array([len(c) for c in CAMPAIGNS])
    v_campaign = np.where(
        n_campaigns[v_channel] > 0,
        campaign_base[v_channel]
        + (rng.random(n_visits) * np.maximum(n_campaigns[v_channel], 1)).astype(np.int64),
        -1,
    )
    e_channel = v_channel[visit_id]
    e_device = v_device[visit_id]
    e_campaign = v_campaign[visit_id]

    e_type = _event_types(rng, b, visit_start, e_channel, j_offset, j_length, n_e)

    e_price = _prices(price_rng, b, n_users, j_user[e_journey], e_type)

    # True log-odds from sequence features, then a calibrated intercept and the labels.
    effects, coefficients, causal = _true_effects(
        m,
        e_type,
        e_channel,
        e_price,
        e_journey,
        e_position,
        e_time_ms,
        visit_start,
        j_offset,
        j_length,
    )
    score = sum(coefficients[name] * value for name, value in effects.items())
    intercept = calibrate_intercept(score, conversion_rate)
    j_prob = 1.0 / (1.0 + np.exp(-(score + intercept)))
    j_converted = rng.random(n_j) < j_prob

    return _Clean(
        n_users=n_users,
        user_ids=user_ids(n_users),
        j_user=j_user,
        j_offset=j_offset,
        j_length=j_length,
        j_start_ms=j_start_ms,
        j_last_ms=j_last_ms,
        j_purchase_ms=j_purchase_ms,
        j_prob=j_prob,
        j_converted=j_converted,
        e_journey=e_journey,
        e_position=e_position,
        e_time_ms=e_time_ms,
        e_type=e_type,
        e_channel=e_channel,
        e_device=e_device,
        e_campaign=e_campaign,
        e_price=e_price,
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
    n_e: int,
) -> np.ndarray:
    """Event types: a visit opens with its touch, then a Markov chain of browsing steps."""
    e_type = np.full(n_e, -1, dtype=np.int8)
    direct_entry = np.where(rng.random(n_e) < b.direct_entry_search_prob, SEARCH, PAGE_VIEW).astype(
        np.int8
    )
    e_type[visit_start] = np.where(e_channel == DIRECT, direct_entry, CLICK)[visit_start]

    cumulative = np.cumsum(np.asarray(b.transitions, dtype=np.float64), axis=1)
    cumulative /= cumulative[:, -1:]  # rows need not sum exactly to one
    browse = np.asarray(BROWSE_EVENTS, dtype=np.int8)
    # Journeys longest first, so the journeys still going at position p are a prefix.
    by_length = np.argsort(-j_length, kind="stable")
    sorted_len = j_length[by_length]
    sorted_offset = j_offset[by_length]
    n_active = np.searchsorted(-sorted_len, -np.arange(int(sorted_len[0])), side="left")
    for p in range(1, len(n_active)):
        idx = sorted_offset[: n_active[p]] + p
        idx = idx[~visit_start[idx]]
        prev = e_type[idx - 1]
        u = rng.random(len(idx))[:, None]
        choice = (u > cumulative[prev, :-1]).sum(axis=1)
        e_type[idx] = browse[choice]
    return e_type


def _prices(
    rng: np.random.Generator,
    b: Behaviour,
    n_users: int,
    e_user: np.ndarray,
    e_type: np.ndarray,
) -> np.ndarray:
    """Each priced event's price in cents (the user's usual level times noise); NaN if none."""
    usual = b.price_usual_median * np.exp(b.price_usual_sigma * rng.standard_normal(n_users))
    noise = np.exp(b.price_sigma * rng.standard_normal(len(e_type)))
    price = np.maximum(np.round(usual[e_user] * noise, 2), 0.01)
    return np.where(np.isin(e_type, b.priced_events), price, np.nan)


def _true_effects(
    m: TrueModel,
    e_type: np.ndarray,
    e_channel: np.ndarray,
    e_price: np.ndarray,
    e_journey: np.ndarray,
    e_position: np.ndarray,
    e_time_ms: np.ndarray,
    visit_start: np.ndarray,
    j_offset: np.ndarray,
    j_length: np.ndarray,
) -> tuple[dict[str, np.ndarray], dict[str, float], np.ndarray]:
    """The true model's features per journey, their coefficients, and the causal flag per
    event. The true log-odds (without intercept) is the sum of coefficient times feature."""
    is_click = e_type == CLICK
    is_cart = e_type == ADD_TO_CART
    is_cart_or_checkout = is_cart | (e_type == CHECKOUT)
    is_product_view = e_type == PRODUCT_VIEW
    causal = np.zeros(len(e_type), dtype=bool)
    effects: dict[str, np.ndarray] = {}
    coefficients: dict[str, float] = {}

    def effect(name: str, coefficient: float, value: np.ndarray) -> None:
        effects[name] = value.astype(np.float64)
        coefficients[name] = float(coefficient)

    # ORDER: carts after the last ad click.
    last_click = np.maximum.reduceat(np.where(is_click, e_position, -1), j_offset)
    cart_after = is_cart & (last_click[e_journey] >= 0) & (e_position > last_click[e_journey])
    has_cart_after = np.bitwise_or.reduceat(cart_after, j_offset)
    effect("cart_after_last_click", m.cart_after_last_click, has_cart_after)
    if m.cart_after_last_click > 0:
        causal |= cart_after
        causal |= is_click & has_cart_after[e_journey] & (e_position == last_click[e_journey])

    # RECENCY: what happened among the last few events.
    recent = e_position >= (j_length[e_journey] - m.recent_window)
    recent_cart = recent & is_cart_or_checkout
    recent_view = recent & is_product_view
    effect("recent_cart", m.recent_cart, np.bitwise_or.reduceat(recent_cart, j_offset))
    effect(
        "recent_product_view", m.recent_product_view, np.bitwise_or.reduceat(recent_view, j_offset)
    )
    if m.recent_cart > 0:
        causal |= recent_cart
    if m.recent_product_view > 0:
        causal |= recent_view

    # FIRST TOUCH: the channel of the journey's first visit, one effect per channel.
    first_channel = e_channel[j_offset]
    for code, channel in enumerate(CHANNELS):
        effect(f"first_touch_{channel}", m.first_touch[code], first_channel == code)
    first_raises = np.zeros(len(e_type), dtype=bool)
    first_raises[j_offset] = np.asarray(m.first_touch)[first_channel] > 0
    causal |= first_raises

    # INTERACTION: a paid_search click followed within a few events by an add_to_cart.
    search_click = is_click & (e_channel == PAID_SEARCH)
    pair_cart = np.zeros(len(e_type), dtype=bool)
    pair_click = np.zeros(len(e_type), dtype=bool)
    for k in range(1, m.search_cart_window + 1):
        # event i is a cart and event i-k (same journey) a paid_search click
        hit = is_cart[k:] & search_click[:-k] & (e_position[k:] >= k)
        pair_cart[k:] |= hit
        pair_click[:-k] |= hit
    effect("search_to_cart", m.search_to_cart, np.bitwise_or.reduceat(pair_cart, j_offset))
    if m.search_to_cart > 0:
        causal |= pair_cart | pair_click

    # TIMING: hours away before the final visit (0 for single-visit journeys).
    last_visit = np.maximum.reduceat(np.where(visit_start, e_position, 0), j_offset)
    at = j_offset + last_visit
    away_h = np.where(last_visit > 0, (e_time_ms[at] - e_time_ms[at - 1]) / _MS_PER_HOUR, 0.0)
    effect("final_visit_gap", m.final_visit_gap, np.log1p(away_h / 12.0))

    # TIMING: how long the first visit lasted (its first to its last event). A duration is
    # no one event's doing, so no event is marked causal for it; nor for the hour below.
    second_visit = np.minimum.reduceat(
        np.where(visit_start & (e_position > 0), e_position, j_length[e_journey]), j_offset
    )
    first_visit_ms = e_time_ms[j_offset + second_visit - 1] - e_time_ms[j_offset]
    effect(
        "long_first_visit",
        m.long_first_visit,
        np.log1p(first_visit_ms / _MS_PER_MINUTE / m.first_visit_scale_min),
    )

    # TIME OF DAY of the journey's last event (UTC, fractional hours).
    last_ms = e_time_ms[j_offset + j_length - 1]
    hour = (last_ms % _MS_PER_DAY) / _MS_PER_HOUR
    effect("hour_of_day", m.hour_of_day, np.cos(2 * np.pi * (hour - m.hour_peak) / 24))

    # PRICE: the last priced event against the journey's own prices (the user's usual).
    priced = ~np.isnan(e_price)
    log_price = np.where(priced, np.log(np.where(priced, e_price, 1.0)), 0.0)
    n_priced = np.add.reduceat(priced.astype(np.int64), j_offset)
    mean_log_price = np.add.reduceat(log_price, j_offset) / np.maximum(n_priced, 1)
    last_priced = np.maximum.reduceat(np.where(priced, e_position, -1), j_offset)
    last_log_price = log_price[j_offset + np.maximum(last_priced, 0)]
    premium = np.where(n_priced >= 2, last_log_price - mean_log_price, 0.0)
    effect("price_premium", m.price_premium, premium)
    # The last priced event raised the log-odds when its term is positive.
    price_raises = np.zeros(len(e_type), dtype=bool)
    raised = (m.price_premium * premium > 0) & (n_priced >= 2)
    price_raises[(j_offset + last_priced)[raised]] = True
    causal |= price_raises

    # COUNTS, a little.
    n_views = np.add.reduceat(is_product_view.astype(np.int64), j_offset)
    effect("product_view_count", m.product_view_count, np.log1p(n_views))
    return effects, coefficients, causal


def calibrate_intercept(score: np.ndarray, rate: float) -> float:
    """The intercept b with mean(sigmoid(score + b)) == rate (bisection; the mean is monotone)."""
    lo, hi = -40.0, 40.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if np.mean(1.0 / (1.0 + np.exp(-(score + mid)))) < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# --- raw log and dirt ------------------------------------------------------------------------


def _clean_log(c: _Clean) -> pl.DataFrame:
    """The clean raw log (events plus purchases), sorted by user then time."""
    n_e = len(c.e_type)
    conv = np.flatnonzero(c.j_converted)
    # Each purchase goes right after its journey's last event: shift every event by the
    # number of purchases of earlier journeys.
    before = np.r_[0, np.cumsum(c.j_converted)[:-1]]
    e_row = np.arange(n_e) + before[c.e_journey]
    p_row = c.j_offset[conv] + c.j_length[conv] + before[conv]
    n_rows = n_e + len(conv)

    def scatter(events: np.ndarray, purchases: np.ndarray) -> np.ndarray:
        column = np.empty(n_rows, dtype=np.result_type(events, purchases))
        column[e_row] = events
        column[p_row] = purchases
        return column

    last = c.j_offset[conv] + c.j_length[conv] - 1
    user = scatter(c.j_user[c.e_journey], c.j_user[conv])
    time_ms = scatter(c.e_time_ms, c.j_purchase_ms[conv])
    etype = scatter(c.e_type, np.full(len(conv), PURCHASE, dtype=np.int8))
    channel = scatter(c.e_channel, c.e_channel[last])
    device = scatter(c.e_device, c.e_device[last])
    campaign = scatter(c.e_campaign, c.e_campaign[last])
    price = scatter(c.e_price, np.full(len(conv), np.nan))  # a purchase carries no price

    campaigns = pl.Series([name for names in CAMPAIGNS for name in names] + [None])
    campaign = np.where(campaign < 0, len(campaigns) - 1, campaign)
    return pl.DataFrame(
        {
            "user_id": c.user_ids.gather(user),
            "timestamp": pl.Series(time_ms)
            .cast(pl.Datetime("ms", "UTC"))
            .dt.strftime(TIMESTAMP_FORMAT),
            "event_type": pl.Series(EVENT_TYPES).gather(etype),
            "channel": pl.Series(CHANNELS).gather(channel),
            "device": pl.Series(DEVICES).gather(device),
            "campaign": campaigns.gather(campaign),
            "price": pl.Series(price).fill_nan(None),
        }
    )


def _add_dirt(
    log: pl.DataFrame, rng: np.random.Generator, dirty_rate: float
) -> tuple[pl.DataFrame, dict[str, int]]:
    """Insert dirty rows right after the clean rows they were copied from.

    Each dirty row is a copy of a distinct clean row with one field blanked or corrupted,
    or left intact (a duplicate). Dirty rows that happen to equal another dirty row are
    dropped, so every row of the result is unique except the intended duplicates.
    """
    counts = dict.fromkeys(DIRTY_KINDS, 0)
    n_clean = log.height
    n_dirty = round(dirty_rate * n_clean / (1 - dirty_rate))
    if n_dirty == 0:
        return log, counts
    source = np.sort(rng.choice(n_clean, n_dirty, replace=False))
    kind = rng.permutation(np.arange(n_dirty) % len(DIRTY_KINDS))
    pattern = rng.integers(0, 3, n_dirty)

    ts = pl.col("timestamp")
    bad_ts = (
        pl.when(pl.col("_pattern") == 0)
        .then(ts.str.slice(0, 5) + "13" + ts.str.slice(7))  # month 13
        .when(pl.col("_pattern") == 1)
        .then(ts.str.slice(0, 11) + "99" + ts.str.slice(13))  # hour 99
        .otherwise(pl.lit("not-a-time"))
    )
    dirty = (
        log[source]
        .with_columns(_kind=pl.Series(kind), _pattern=pl.Series(pattern), _source=pl.Series(source))
        .with_columns(
            user_id=pl.when(pl.col("_kind") == 0).then(None).otherwise(pl.col("user_id")),
            event_type=pl.when(pl.col("_kind") == 1).then(None).otherwise(pl.col("event_type")),
            timestamp=pl.when(pl.col("_kind") == 2).then(bad_ts).otherwise(ts),
        )
        .filter(pl.struct(*RAW_COLUMNS).is_first_distinct())
    )
    kinds = dirty["_kind"].to_numpy()
    for i, name in enumerate(DIRTY_KINDS):
        counts[name] = int((kinds == i).sum())

    # Row positions: every clean row moves down by the dirty rows inserted before it.
    kept_source = dirty["_source"].to_numpy()
    inserted = np.zeros(n_clean, dtype=np.int64)
    inserted[kept_source] = 1
    clean_pos = np.arange(n_clean) + np.cumsum(inserted) - inserted
    order = np.empty(n_clean + len(kept_source), dtype=np.int64)
    order[clean_pos] = np.arange(n_clean)
    order[clean_pos[kept_source] + 1] = n_clean + np.arange(len(kept_source))
    combined = pl.concat([log, dirty.select(RAW_COLUMNS)])
    return combined[order], counts


def _write_log(log: pl.DataFrame, out: Path, format: str, n_files: int) -> list[Path]:
    """Write the log as one file or `n_files` contiguous parts, each atomically."""
    suffix = {"csv": "csv", "jsonl": "jsonl", "parquet": "parquet"}[format]
    if n_files == 1:
        targets = [out / f"events.{suffix}"]
    else:
        targets = [out / f"events-{i:03d}.{suffix}" for i in range(n_files)]
    bounds = np.linspace(0, log.height, len(targets) + 1).astype(np.int64)
    for target, lo, hi in zip(targets, bounds[:-1], bounds[1:], strict=True):
        part = log.slice(int(lo), int(hi - lo))
        with atomic_path(target) as tmp:
            if format == "csv":
                part.write_csv(tmp)
            elif format == "jsonl":
                part.write_ndjson(tmp)
            else:
                part.write_parquet(tmp)
    return targets


# --- ground truth ----------------------------------------------------------------------------


def _journey_ids(c: _Clean) -> pl.Series:
    """`{user_id}-{epoch microseconds of the first event}`, exactly as the ingester builds it."""
    return pl.DataFrame(
        {
            "u": c.user_ids.gather(c.j_user),
            "us": c.j_start_ms * 1000,
        }
    ).select(journey_id=pl.format("{}-{}", "u", "us"))["journey_id"]


def _truth_journeys(c: _Clean) -> pl.DataFrame:
    end_ms = np.where(c.j_converted, c.j_purchase_ms, c.j_last_ms)
    return pl.DataFrame(
        {
            "journey_id": _journey_ids(c),
            "user_id": c.user_ids.gather(c.j_user),
            "start_time": utc_from_ms(c.j_start_ms),
            "end_time": utc_from_ms(end_ms),
            "last_event_time": utc_from_ms(c.j_last_ms),
            "true_probability": c.j_prob.astype(np.float64),
            "converted": c.j_converted,
            "n_events": c.j_length.astype(np.int64),
            **{f"effect_{name}": value for name, value in c.effects.items()},
        }
    )


def _truth_events(c: _Clean) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "user_id": c.user_ids.gather(c.j_user[c.e_journey]),
            "timestamp": utc_from_ms(c.e_time_ms),
            "event_type": pl.Series(EVENT_TYPES).gather(c.e_type),
            "channel": pl.Series(CHANNELS).gather(c.e_channel),
            "journey_id": _journey_ids(c).gather(c.e_journey),
            "position": c.e_position.astype(np.int32),
            "price": pl.Series(c.e_price).fill_nan(None),
            "causal": c.e_causal,
        }
    )


# --- helpers ---------------------------------------------------------------------------------


def _epoch_ms(moment: datetime) -> int:
    """Milliseconds since the epoch; a naive datetime is read as UTC."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return (moment - datetime(1970, 1, 1, tzinfo=UTC)) // timedelta(milliseconds=1)


def utc_from_ms(ms: np.ndarray) -> pl.Series:
    """Epoch milliseconds -> UTC datetimes (microsecond precision, as the ingester's)."""
    return pl.Series(ms * 1000).cast(pl.Datetime("us", "UTC"))


def user_ids(n_users: int, prefix: str = "u") -> pl.Series:
    """`u000000`, ...: zero-padded, so ids sort as numbers do."""
    width = max(6, len(str(n_users - 1)))
    digits = pl.Series("user_id", np.arange(n_users)).cast(pl.String).str.zfill(width)
    return pl.select(pl.lit(prefix) + digits).to_series().alias("user_id")


def _event_gaps(rng: np.random.Generator, b: Behaviour, n: int) -> np.ndarray:
    """Gaps between events of one visit, in ms (seconds to minutes)."""
    return _lognormal_ms(
        rng,
        n,
        b.event_gap_median_s * 1000,
        b.event_gap_sigma,
        b.event_gap_min_s * 1000,
        b.event_gap_max_s * 1000,
    )


def _visit_gaps(rng: np.random.Generator, b: Behaviour, n: int) -> np.ndarray:
    """Gaps between visits of one journey, in ms (hours to days)."""
    return _lognormal_ms(
        rng,
        n,
        b.visit_gap_median_h * _MS_PER_HOUR,
        b.visit_gap_sigma,
        b.visit_gap_min_h * _MS_PER_HOUR,
        b.visit_gap_max_h * _MS_PER_HOUR,
    )


def _lognormal_ms(
    rng: np.random.Generator, n: int, median: float, sigma: float, low: float, high: float
) -> np.ndarray:
    """`n` log-normal durations in whole milliseconds, clipped to [low, high]."""
    draws = median * np.exp(sigma * rng.standard_normal(n))
    return np.clip(np.rint(draws), low, high).astype(np.int64)


def categorical(rng: np.random.Generator, probs: tuple[float, ...], n: int) -> np.ndarray:
    """`n` draws of indices with probabilities `probs` (normalised)."""
    cumulative = np.cumsum(probs) / np.sum(probs)
    return np.minimum(np.searchsorted(cumulative, rng.random(n), side="right"), len(probs) - 1)

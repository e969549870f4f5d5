"""Open journeys: which journeys are still open at a moment, and how likely each one is to
convert from there on.

A journey is *open* at `as_of` when it has not converted by then and its last event is
within `journey.max_gap` of it: the user may still come back and convert. The others are
*finished*: converted, or quiet for longer than `max_gap` (a later event would start a new
journey). At the end of the data the open journeys are the censored ones.

The model scores a journey from its events. An open journey has also been quiet for a
while, and that matters: in finished journeys a conversion follows its last touch within
minutes to hours, so a journey quiet for six days has all but ended, while one active a
minute ago may well go on. Bayes' rule with the time `t` the journey has been quiet:

    P(converts | events, quiet for t) = q S1(t) / (q S1(t) + (1 - q) S0(t))

where q is the model's probability for the events and S1(t) (S0(t)) is the share of
event prefixes of converting (non-converting) journeys after which nothing happened for
`t`: no next event and, for converting journeys, no conversion. After a non-converting
journey's last event nothing ever happens, so S0 levels off at the share of last events
while S1 falls to 0. `QuietSurvival.fit` learns both curves from the train split's
finished journeys when the model is trained; they are stored with the model and applied
unchanged when scoring.

Why this and not a delay model inside the network (Chapelle 2014's delayed feedback, or
an elapsed-time input trained on prefixes cut at sampled moments): it needs no change to
the model or its training, works for either `train.objective`, and its assumption is
plain to state: given the outcome, how long a journey stays quiet does not depend on its
events. For `train.objective: every_prefix`, q is what the model was trained to give (the
journey's eventual outcome after these events); for `journey`, q answers "had the journey
ended here", and the replay benchmark (`benchmarks/in_flight.py`) measures both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

import numpy as np
import polars as pl

from journeys.metrics import logit, sigmoid

# Quiet times at which the curves are stored: log-spaced from one second to max_gap.
GRID_POINTS = 96
GRID_START_S = 1.0
SEEN = "__journeys_seen"  # a working column: not a name a user's feature could have
# The replay that recalibrates the in-flight probability (`QuietSurvival.recalibrated`):
# open journeys at this many moments of the val window, and no recalibration with fewer
# conversions after them than this (three numbers fitted on a handful would be noise).
REPLAY_MOMENTS = 8
MIN_REPLAY_CONVERSIONS = 30
PROBABILITY_FLOOR = 1e-9  # keeps the log-odds of a probability of exactly 0 or 1 finite


@dataclass(frozen=True)
class QuietSurvival:
    """Share of event prefixes followed by `seconds[i]` of quiet, by the journey's outcome."""

    seconds: tuple[float, ...]
    converted: tuple[float, ...]
    not_converted: tuple[float, ...]
    # (a, b, c): the probability's log-odds become a + b * log-odds + c * log(1 + quiet
    # hours), fitted on open journeys replayed in the val window (`recalibrated`); None:
    # Bayes' rule as it is.
    recalibration: tuple[float, float, float] | None = None

    @classmethod
    def fit(cls, journeys: pl.DataFrame, max_gap: timedelta) -> QuietSurvival | None:
        """From finished journeys (`label`, `end_time`, `event_time`): after each event, the
        wait for the next one, or for a converting journey's last event the wait for the
        conversion; a non-converting journey's last event waits forever. None when either
        outcome has no journey (nothing to learn from)."""
        next_time = pl.concat_list(
            pl.col("event_time").list.slice(1),
            pl.when(pl.col("label") == 1).then(pl.col("end_time")),
        )
        waits = (
            journeys.select(pl.col("label"), pl.col("event_time"), next_time.alias("next"))
            .explode("event_time", "next")
            .select(
                "label",
                wait=(pl.col("next") - pl.col("event_time")).dt.total_seconds(fractional=True),
            )
        )
        grid = np.r_[0.0, np.geomspace(GRID_START_S, max_gap.total_seconds(), GRID_POINTS - 1)]
        curves = []
        for label in (1, 0):
            wait = waits.filter(pl.col("label") == label).get_column("wait")
            if wait.len() == 0:
                return None
            finite = np.sort(wait.drop_nulls().to_numpy())
            # Share still quiet after t: waits longer than t, and the endless ones, plus one
            # wait as long as the longest seen and then some (Laplace's rule of succession,
            # with a 1/t tail past the longest wait): a converting journey's curve goes on
            # falling past what training saw, but never to 0, so a long-quiet open
            # journey keeps its model's ranking.
            longer = wait.len() - np.searchsorted(finite, grid, side="right")
            longest = finite[-1] if finite.size else 0.0
            beyond = np.minimum(1.0, longest / np.maximum(grid, 1e-9)) if longest else 1.0
            quiet = (longer + beyond) / (wait.len() + 1)
            curves.append(tuple(float(s) for s in quiet))
        return cls(tuple(float(t) for t in grid), curves[0], curves[1])

    def to_dict(self) -> dict[str, Any]:
        return {
            "seconds": list(self.seconds),
            "converted": list(self.converted),
            "not_converted": list(self.not_converted),
            "recalibration": list(self.recalibration) if self.recalibration else None,
        }

    @classmethod
    def from_dict(cls, stored: dict[str, Any] | None) -> QuietSurvival | None:
        if not stored:
            return None
        recalibration = stored.get("recalibration")  # absent from models saved before it
        return cls(
            tuple(stored["seconds"]),
            tuple(stored["converted"]),
            tuple(stored["not_converted"]),
            tuple(recalibration) if recalibration else None,
        )

    def probability(self, q: np.ndarray, quiet_seconds: np.ndarray) -> np.ndarray:
        """P(converts) of journeys with model probability `q`, quiet for `quiet_seconds`."""
        quiet = np.clip(np.asarray(quiet_seconds, dtype=np.float64), 0.0, None)
        p = self._bayes(np.asarray(q, dtype=np.float64), quiet)
        if self.recalibration is None:
            return p
        a, b, c = self.recalibration
        return sigmoid(a + b * logit(p, PROBABILITY_FLOOR) + c * np.log1p(quiet / 3600.0))

    def _bayes(self, q: np.ndarray, quiet: np.ndarray) -> np.ndarray:
        # Interpolated on log(1 + t): the grid is log-spaced.
        x = np.log1p(np.asarray(self.seconds))
        at = np.log1p(quiet)
        s1 = q * np.interp(at, x, self.converted)
        s0 = (1.0 - q) * np.interp(at, x, self.not_converted)
        total = s1 + s0
        return np.divide(s1, total, out=np.zeros_like(total), where=total > 0)

    def recalibrated(
        self, q: np.ndarray, quiet_seconds: np.ndarray, converted: np.ndarray
    ) -> QuietSurvival:
        """These curves with a recalibration fitted on open journeys whose outcome is known:
        their model probability `q`, quiet time and whether they `converted` after.

        Why: Bayes' rule above assumes that how long a journey stays quiet, given its
        outcome, does not depend on its events. It does (a checkout is followed by a
        purchase within minutes, a first page view by days of quiet), and the pooled curves
        under-state long quiet spells: replayed on the simulator, the journeys quiet for two
        days or more converted 1.2-2x as often as predicted. A logistic regression on
        the rule's log-odds and the log of the quiet hours corrects the level and the slope
        in quiet time. Unchanged (no recalibration) with fewer than
        `MIN_REPLAY_CONVERSIONS` conversions, or when the fit would turn the ranking round
        (b <= 0).
        """
        from sklearn.linear_model import LogisticRegression

        converted = np.asarray(converted).astype(int)
        if converted.sum() < MIN_REPLAY_CONVERSIONS or converted.sum() == converted.size:
            return replace(self, recalibration=None)
        quiet = np.clip(np.asarray(quiet_seconds, dtype=np.float64), 0.0, None)
        bayes = self._bayes(np.asarray(q, dtype=np.float64), quiet)
        inputs = np.c_[logit(bayes, PROBABILITY_FLOOR), np.log1p(quiet / 3600.0)]
        fitted = LogisticRegression(C=1e4, max_iter=1000).fit(inputs, converted)
        b, c = (float(v) for v in fitted.coef_[0])
        if b <= 0:
            return replace(self, recalibration=None)
        return replace(self, recalibration=(float(fitted.intercept_[0]), b, c))


def replay_open_journeys(
    journeys: pl.DataFrame, moments: list[datetime], event_lists: list[str], max_gap: timedelta
) -> pl.DataFrame:
    """The journeys open at each of `moments`, as they stood then (`cut_at`, `mark_open`),
    with `converted_after`: whether each went on to convert. `journeys` must hold every
    journey that could be open then with its outcome known (finished, labelled)."""
    frames = []
    for moment in moments:  # a handful of moments; each is one vectorised cut
        started = journeys.filter(pl.col("start_time") <= moment)
        cut = mark_open(cut_at(started, moment, event_lists), moment, max_gap)
        frames.append(cut.filter("open").with_columns(converted_after=pl.col("label") == 1))
    return pl.concat(frames, how="vertical_relaxed") if frames else journeys.clear()


def recalibrate_in_flight(
    survival: QuietSurvival,
    journeys: pl.DataFrame,
    predict: Callable[[pl.DataFrame], np.ndarray],
    event_lists: list[str],
    max_gap: timedelta,
) -> QuietSurvival:
    """`survival` recalibrated on a replay of the val window: open journeys at
    `REPLAY_MOMENTS` moments from the val split's first end to `max_gap` before its last
    (so that what they did next is in train or val, never test), scored by `predict` (the
    served model's probabilities for a journeys frame).

    `journeys`: the labelled journeys with their `split`."""
    known = journeys.filter(pl.col("split").is_in(["train", "val"]))
    ends = known.filter(pl.col("split") == "val").get_column("end_time")
    if ends.len() == 0:
        return survival
    first, last = ends.min(), ends.max() - max_gap
    if last <= first:  # a val window shorter than max_gap: nothing it can tell
        return survival
    step = (last - first) / max(1, REPLAY_MOMENTS - 1)
    moments = [first + i * step for i in range(REPLAY_MOMENTS)]
    # Only journeys that can be open at one of the moments: begun by the last, and with an
    # event within max_gap of the first.
    could_be_open = (pl.col("start_time") <= last) & (pl.col("end_time") >= first - max_gap)
    replayed = replay_open_journeys(known.filter(could_be_open), moments, event_lists, max_gap)
    if replayed.height == 0:
        return survival
    return survival.recalibrated(
        predict(replayed),
        replayed.get_column("quiet_seconds").to_numpy(),
        replayed.get_column("converted_after").to_numpy(),
    )


def cut_at(frame: pl.DataFrame, as_of: datetime, event_lists: list[str]) -> pl.DataFrame:
    """The journeys as they stood at `as_of`: later events dropped from every per-event
    list (and from `n_events` / `n_events_total`), journeys with no event by then dropped.
    Event times are sorted, as ingest writes them. A journey longer than
    `journey.max_events` keeps only its latest events, so one whose kept events all come
    after `as_of` is dropped too."""
    times = pl.col("event_time")
    if frame.select(((times.list.last() <= as_of) & (times.list.len() > 0)).all()).item():
        return frame  # every event by then (the default: the data's end): nothing to cut
    seen = times.list.eval(pl.element() <= as_of).list.sum()
    later = pl.col("event_time").list.len() - pl.col(SEEN)
    updates = [
        pl.col(name).list.head(pl.col(SEEN)) for name in ("event_type", "event_time", *event_lists)
    ]
    for count in ("n_events", "n_events_total"):
        if count in frame.columns:
            updates.append((pl.col(count) - later).cast(frame.schema[count]))
    return (
        frame.with_columns(**{SEEN: seen}).filter(pl.col(SEEN) > 0).with_columns(updates).drop(SEEN)
    )


def mark_open(frame: pl.DataFrame, as_of: datetime, max_gap: timedelta) -> pl.DataFrame:
    """Add `open` (not converted by `as_of`, last event within `max_gap` of it) and
    `quiet_seconds` (from the last event to `as_of`). A conversion counts when `label` is 1
    and, where the frame has `end_time` (the conversion's time), it happened by `as_of`."""
    quiet = as_of - pl.col("event_time").list.last()
    converted = pl.lit(False)
    if "label" in frame.columns:
        converted = pl.col("label") == 1
        if "end_time" in frame.columns:
            converted = converted & (pl.col("end_time") <= as_of)
    return frame.with_columns(
        (~converted & (quiet <= max_gap)).alias("open"),
        quiet.dt.total_seconds(fractional=True).alias("quiet_seconds"),
    )


def in_flight_probability(scored: pl.DataFrame, survival: QuietSurvival) -> pl.DataFrame:
    """Open journeys' `conversion_probability` becomes the chance they convert from here
    on, given how long they have been quiet; finished ones keep theirs."""
    if scored.height == 0:
        return scored
    q = scored.get_column("conversion_probability").to_numpy()
    from_here = survival.probability(q, scored.get_column("quiet_seconds").to_numpy())
    return scored.with_columns(
        conversion_probability=pl.when("open")
        .then(pl.Series(from_here))
        .otherwise(pl.col("conversion_probability"))
    )

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

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import numpy as np
import polars as pl

# Quiet times at which the curves are stored: log-spaced from one second to max_gap.
GRID_POINTS = 96
GRID_START_S = 1.0
SEEN = "__journeys_seen"  # a working column: not a name a user's feature could have


@dataclass(frozen=True)
class QuietSurvival:
    """Share of event prefixes followed by `seconds[i]` of quiet, by the journey's outcome."""

    seconds: tuple[float, ...]
    converted: tuple[float, ...]
    not_converted: tuple[float, ...]

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
        }

    @classmethod
    def from_dict(cls, stored: dict[str, Any] | None) -> QuietSurvival | None:
        if not stored:
            return None
        return cls(
            tuple(stored["seconds"]), tuple(stored["converted"]), tuple(stored["not_converted"])
        )

    def probability(self, q: np.ndarray, quiet_seconds: np.ndarray) -> np.ndarray:
        """P(converts) of journeys with model probability `q`, quiet for `quiet_seconds`."""
        # Interpolated on log(1 + t): the grid is log-spaced.
        x = np.log1p(np.asarray(self.seconds))
        at = np.log1p(np.clip(np.asarray(quiet_seconds, dtype=np.float64), 0.0, None))
        s1 = q * np.interp(at, x, self.converted)
        s0 = (1.0 - q) * np.interp(at, x, self.not_converted)
        total = s1 + s0
        return np.divide(s1, total, out=np.zeros_like(total), where=total > 0)


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

"""The transformer stacked with gradient boosting on journey aggregates: the `stack` candidate.

On logs where counts, gaps and durations carry the signal, `hgb_aggregates` (the strong
baseline) ranks journeys as well as the transformer or better; on logs where order and
timing do, the transformer wins. The stack takes both: the mean of the two models'
calibrated log-odds (the transformer's logit over its temperature, the booster's logit),
then a Platt scaling fitted on val so the blend's probabilities are calibrated again.

Why equal weights and not a blend fitted on val: a fitted blend's weights are noisy on the
small val splits real logs have, and judged honestly (cross-fitted) such a blend fell below
both its parts where it was best on test. The mean has no weight to choose, so its val
ranking is an honest figure as it is (given the transformer's cross-fitted logits), and
Platt scaling changes calibration, never the ranking.

The transformer's attention is still what scoring exports: the stack changes the
probability, not the explanation. The booster is the fitted `hgb_aggregates` baseline of
the same run; `journeys.trained_model` saves the stack as the weights below plus that
baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from journeys.metrics import logit

if TYPE_CHECKING:
    import polars as pl

    from journeys.baselines import HgbAggregates

TRANSFORMER_SHARE = 0.5  # the transformer's share of the blended log-odds


@dataclass
class Stack:
    """`weights[0] * transformer logit + weights[1] * booster logit + intercept` (the
    transformer's raw logit: its temperature is folded into the weight)."""

    baseline: HgbAggregates
    weights: tuple[float, float]
    intercept: float

    def booster_logits(self, frame: pl.DataFrame) -> np.ndarray:
        """The boosting model's logits for a journeys frame (ingest schema)."""
        return logit(self.baseline.predict_proba(frame))

    def combine(self, transformer_logits: np.ndarray, frame: pl.DataFrame) -> np.ndarray:
        """The stacked logits of `frame`'s journeys, given the transformer's (uncalibrated)."""
        return self.blend(transformer_logits, self.booster_logits(frame))

    def blend(self, transformer_logits: np.ndarray, booster_logits: np.ndarray) -> np.ndarray:
        """The stacked logits from both models' (the transformer's uncalibrated)."""
        transformer = self.weights[0] * np.asarray(transformer_logits)
        return transformer + self.weights[1] * np.asarray(booster_logits) + self.intercept

    def blend_state(self) -> dict[str, Any]:
        return {"weights": list(self.weights), "intercept": self.intercept}


def blended(transformer_calibrated: np.ndarray, booster: np.ndarray) -> np.ndarray:
    """The equal-weight blend of two models' calibrated log-odds."""
    share = TRANSFORMER_SHARE
    return share * np.asarray(transformer_calibrated) + (1 - share) * np.asarray(booster)


def platt(scores: np.ndarray, labels: np.ndarray) -> tuple[float, float]:
    """Slope and intercept of a logistic regression of `labels` on `scores` (one input).

    A calibration keeps the order: a slope that comes out negative (the blend ranks val
    backwards) is no calibration of it, so the blend gets none (slope 0, the base rate).
    """
    from sklearn.linear_model import LogisticRegression

    labels = np.asarray(labels)
    if np.unique(labels).size < 2:
        return 1.0, 0.0
    model = LogisticRegression(C=1e6).fit(np.asarray(scores)[:, None], labels)
    slope, intercept = float(model.coef_[0][0]), float(model.intercept_[0])
    if slope > 0:
        return slope, intercept
    rate = float(labels.mean())
    return 0.0, float(np.log(rate / (1 - rate)))


def fit_stack(
    baseline: HgbAggregates,
    labels: np.ndarray,
    transformer_val: np.ndarray,
    booster_val: np.ndarray,
    temperature: float,
) -> Stack:
    """The stack of `baseline` (fitted on train) and the transformer, from both models'
    logits on the val journeys (`transformer_val` uncalibrated, `booster_val` the
    baseline's) and their `labels`."""
    mixed = blended(np.asarray(transformer_val) / temperature, booster_val)
    slope, intercept = platt(mixed, np.asarray(labels).astype(np.int64))
    share = TRANSFORMER_SHARE
    return Stack(baseline, (slope * share / temperature, slope * (1 - share)), intercept)

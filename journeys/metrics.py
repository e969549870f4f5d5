"""Evaluation: the test metrics every model logs, their intervals and temperature scaling.

All functions take plain NumPy arrays (labels in {0, 1}, probabilities or logits), so the
transformer and the baselines are scored by exactly the same code.
"""

from __future__ import annotations

import math

import numpy as np

# Equal-width probability bins for the expected calibration error and the reliability plot.
ECE_BINS = 15
# Probabilities are clipped this far from 0 and 1 so log loss stays finite.
PROB_EPS = 1e-7
# Temperature is searched in log space and clamped: a val split with (almost) no signal
# would otherwise push it to 0 or infinity.
TEMPERATURE_RANGE = (0.05, 20.0)

METRIC_NAMES = ("roc_auc", "pr_auc", "log_loss", "brier", "ece")


def sigmoid(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """Numerically stable logistic in float64 (tanh form: no overflow for large |x|)."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def expected_calibration_error(
    labels: np.ndarray, probs: np.ndarray, n_bins: int = ECE_BINS
) -> float:
    """Sum over equal-width bins of (bin share) * |observed rate - mean predicted probability|."""
    labels = np.asarray(labels, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    if probs.size == 0:
        return math.nan
    bins = np.clip((probs * n_bins).astype(np.int64), 0, n_bins - 1)
    # sum_b (n_b / N) * |observed_b / n_b - predicted_b / n_b| == sum_b |observed_b - predicted_b| / N
    observed = np.bincount(bins, weights=labels, minlength=n_bins)
    predicted = np.bincount(bins, weights=probs, minlength=n_bins)
    return float(np.abs(observed - predicted).sum() / probs.size)


def binary_metrics(
    labels: np.ndarray, probs: np.ndarray, prefix: str = "test_"
) -> dict[str, float]:
    """ROC AUC, PR AUC (average precision), log loss, Brier score and ECE.

    Ranking metrics are NaN when the labels hold a single class (they are undefined then).
    """
    from sklearn.metrics import average_precision_score, brier_score_loss, log_loss, roc_auc_score

    labels = np.asarray(labels, dtype=np.int64)
    probs = np.clip(np.asarray(probs, dtype=np.float64), PROB_EPS, 1 - PROB_EPS)
    two_classes = np.unique(labels).size == 2
    out = {
        "roc_auc": float(roc_auc_score(labels, probs)) if two_classes else math.nan,
        "pr_auc": float(average_precision_score(labels, probs)) if two_classes else math.nan,
        "log_loss": float(log_loss(labels, probs, labels=[0, 1])),
        "brier": float(brier_score_loss(labels, probs, pos_label=1)),
        "ece": expected_calibration_error(labels, probs),
    }
    return {f"{prefix}{name}": value for name, value in out.items()}


def fit_temperature(logits: np.ndarray, labels: np.ndarray, max_iter: int = 100) -> float:
    """One scalar T minimising the log loss of sigmoid(logits / T) (fitted on val, by LBFGS)."""
    import torch

    labels_np = np.asarray(labels)
    if labels_np.size == 0 or np.unique(labels_np).size < 2:
        return 1.0  # nothing to calibrate against
    x = torch.as_tensor(np.asarray(logits), dtype=torch.float64)
    y = torch.as_tensor(labels_np, dtype=torch.float64)
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)  # T = exp(log_t) > 0
    optimizer = torch.optim.LBFGS([log_t], lr=0.5, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x / log_t.exp(), y)
        loss.backward()
        return loss

    optimizer.step(closure)
    temperature = float(log_t.detach().exp())
    if not math.isfinite(temperature):
        return 1.0
    return float(np.clip(temperature, *TEMPERATURE_RANGE))

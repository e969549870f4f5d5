"""Evaluation: the test metrics every model logs, temperature scaling and the plots.

All functions take plain NumPy arrays (labels in {0, 1}, probabilities or logits), so the
transformer and the baselines are scored by exactly the same code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

# Equal-width probability bins for the expected calibration error and the reliability plot.
ECE_BINS = 15
# Probabilities are clipped this far from 0 and 1 so log loss stays finite.
PROB_EPS = 1e-7
# Temperature is searched in log space and clamped: a val split with (almost) no signal
# would otherwise push it to 0 or infinity.
TEMPERATURE_RANGE = (0.05, 20.0)

METRIC_NAMES = ("roc_auc", "pr_auc", "log_loss", "brier", "ece")


def sigmoid(logits: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(logits, dtype=np.float64)))


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


# ----------------------------------------------------------------------------- plots


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4.5), dpi=110)
    return plt, fig, ax


def _save(plt, fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_roc(labels: np.ndarray, curves: Mapping[str, np.ndarray], path: Path) -> Path:
    """ROC curve of each named probability vector."""
    from sklearn.metrics import roc_auc_score, roc_curve

    plt, fig, ax = _figure()
    for name, probs in curves.items():
        if np.unique(labels).size == 2:
            fpr, tpr, _ = roc_curve(labels, probs)
            ax.plot(fpr, tpr, label=f"{name} (AUC {roc_auc_score(labels, probs):.3f})")
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC (test)")
    ax.legend(loc="lower right", fontsize=8)
    return _save(plt, fig, path)


def plot_pr(labels: np.ndarray, curves: Mapping[str, np.ndarray], path: Path) -> Path:
    """Precision-recall curve of each named probability vector, with the base rate."""
    from sklearn.metrics import average_precision_score, precision_recall_curve

    plt, fig, ax = _figure()
    for name, probs in curves.items():
        if np.unique(labels).size == 2:
            precision, recall, _ = precision_recall_curve(labels, probs)
            ap = average_precision_score(labels, probs)
            ax.plot(recall, precision, label=f"{name} (AP {ap:.3f})")
    base_rate = float(np.mean(labels)) if len(labels) else 0.0
    ax.axhline(
        base_rate, color="grey", linestyle=":", linewidth=1, label=f"base rate {base_rate:.3f}"
    )
    ax.set(xlabel="recall", ylabel="precision", title="Precision-recall (test)", ylim=(0, 1.02))
    ax.legend(loc="upper right", fontsize=8)
    return _save(plt, fig, path)


def plot_calibration(
    labels: np.ndarray, curves: Mapping[str, np.ndarray], path: Path, n_bins: int = ECE_BINS
) -> Path:
    """Reliability diagram: observed conversion rate against mean predicted probability."""
    plt, fig, ax = _figure()
    labels = np.asarray(labels, dtype=np.float64)
    for name, probs in curves.items():
        probs = np.asarray(probs, dtype=np.float64)
        bins = np.clip((probs * n_bins).astype(np.int64), 0, n_bins - 1)
        count = np.bincount(bins, minlength=n_bins)
        used = count > 0
        predicted = np.bincount(bins, weights=probs, minlength=n_bins)[used] / count[used]
        observed = np.bincount(bins, weights=labels, minlength=n_bins)[used] / count[used]
        ece = expected_calibration_error(labels, probs, n_bins)
        ax.plot(predicted, observed, marker="o", markersize=3, label=f"{name} (ECE {ece:.3f})")
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
    ax.set(
        xlabel="mean predicted probability",
        ylabel="observed conversion rate",
        title=f"Calibration (test, {n_bins} bins)",
        xlim=(0, 1),
        ylim=(0, 1),
    )
    ax.legend(loc="upper left", fontsize=8)
    return _save(plt, fig, path)


def plot_attention_by_event_type(table: Mapping[str, tuple[float, int]], path: Path) -> Path:
    """Bars of mean attention per event type (relative to uniform; 1 = an average event).

    `table` maps event type -> (mean relative attention, number of occurrences).
    """
    plt, fig, ax = _figure()
    items = sorted(table.items(), key=lambda item: item[1][0])
    names = [name for name, _ in items]
    values = [value for _, (value, _) in items]
    ax.barh(names, values, color="tab:blue")
    ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
    for i, (_, (value, count)) in enumerate(items):
        ax.text(value, i, f" n={count:,}", va="center", fontsize=7)
    ax.set(
        xlabel="mean pooled attention x journey length (1 = uniform)",
        title="Attention by event type (test)",
    )
    fig.set_size_inches(6, max(3.0, 0.3 * len(names) + 1.5))
    return _save(plt, fig, path)

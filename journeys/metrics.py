"""Evaluation: the test metrics every model logs, their intervals and temperature scaling.

All functions take plain NumPy arrays (labels in {0, 1}, probabilities or logits), so the
transformer and the baselines are scored by exactly the same code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

# Equal-width probability bins for the expected calibration error and the reliability plot.
ECE_BINS = 15
# Probabilities are clipped this far from 0 and 1 so log loss stays finite.
PROB_EPS = 1e-7
# Temperature is searched in log space and clamped: a val split with (almost) no signal
# would otherwise push it to 0 or infinity.
TEMPERATURE_RANGE = (0.05, 20.0)

METRIC_NAMES = ("roc_auc", "pr_auc", "log_loss", "brier", "ece")
# Ranking metrics get a 95% interval: `<name>_ci_low`, `<name>_ci_high`.
INTERVAL_METRICS = ("roc_auc", "pr_auc")
CONFIDENCE = 0.95
# Paired bootstrap of a PR AUC difference: resamples, drawn this many at a time (memory).
PAIRED_RESAMPLES = 200
PAIRED_CHUNK = 25
LOGIT_FLOOR = 1e-6  # probabilities are clipped this far from 0 and 1 before taking logits


def logit(probability: np.ndarray, floor: float = LOGIT_FLOOR) -> np.ndarray:
    """Log-odds in float64, of probabilities clipped `floor` away from 0 and 1."""
    p = np.clip(np.asarray(probability, dtype=np.float64), floor, 1 - floor)
    return np.log(p) - np.log1p(-p)


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
    labels: np.ndarray, probs: np.ndarray, prefix: str = "test_", intervals: bool = True
) -> dict[str, float]:
    """ROC AUC, PR AUC (average precision), log loss, Brier score and ECE, and (unless
    `intervals` is False) 95% intervals of the two AUCs.

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
    if intervals:
        bounds = {
            "roc_auc": roc_auc_interval(labels, probs) if two_classes else (math.nan, math.nan),
            "pr_auc": average_precision_interval(out["pr_auc"], int(labels.sum())),
        }
        for name, (low, high) in bounds.items():
            out[f"{name}_ci_low"], out[f"{name}_ci_high"] = low, high
    return {f"{prefix}{name}": value for name, value in out.items()}


def format_metric(scores: Mapping[str, float], name: str) -> str:
    """`0.8504 [0.8421, 0.8587]` for a test metric with a 95% interval, else `0.0123`."""
    value = scores.get(f"test_{name}")
    if value is None:
        return "n/a"
    low, high = scores.get(f"test_{name}_ci_low"), scores.get(f"test_{name}_ci_high")
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return f"{value:.4f}"
    return f"{value:.4f} [{low:.4f}, {high:.4f}]"


def _placements(
    labels: np.ndarray, scores: np.ndarray, in_order: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """DeLong's placement values: per positive the share of negatives scored below it,
    per negative the share of positives scored above it (ties count half). The AUC is the
    mean of the first; their variances give the AUC's (Sun and Xu 2014, O(n log n)): each
    class sorted, each score placed among the other class by binary search. Without
    `in_order` the negatives' values come in score order (enough for a variance, and
    several times faster to place: sorted keys search in cache)."""
    positives, negatives = scores[labels], scores[~labels]
    m, n = positives.size, negatives.size
    by_negatives, by_positives = np.sort(negatives), np.sort(positives)
    below = np.searchsorted(by_negatives, positives, "left")
    tied = np.searchsorted(by_negatives, positives, "right") - below
    v10 = (below + 0.5 * tied) / n
    placed = negatives if in_order else by_negatives
    at_or_below = np.searchsorted(by_positives, placed, "right")
    tied = at_or_below - np.searchsorted(by_positives, placed, "left")
    v01 = (m - at_or_below + 0.5 * tied) / m
    return v10, v01


def _z(confidence: float, sides: int = 2) -> float:
    """The standard normal quantile of a `confidence` interval (two-sided) or bound (one)."""
    from statistics import NormalDist

    return NormalDist().inv_cdf(1 - (1 - confidence) / sides)


def roc_auc_interval(
    labels: np.ndarray, scores: np.ndarray, confidence: float = CONFIDENCE
) -> tuple[float, float]:
    """`confidence` (95%) interval of ROC AUC by DeLong et al. (1988), in the fast form of
    Sun and Xu (2014): the AUC's variance from each positive's and each negative's
    placement values, O(n log n) and no resampling. Clipped to [0, 1]."""
    return auc_interval(*roc_auc_with_se(labels, scores), confidence)


def auc_interval(auc: float, se: float, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The normal `confidence` interval of an AUC from its standard error, clipped to [0, 1]
    (NaN for both when either is NaN: a class was missing)."""
    if not (math.isfinite(auc) and math.isfinite(se)):
        return math.nan, math.nan
    half = _z(confidence) * se
    return max(0.0, auc - half), min(1.0, auc + half)


def roc_auc_with_se(labels: np.ndarray, scores: np.ndarray) -> tuple[float, float]:
    """ROC AUC and its standard error by DeLong (the variance `roc_auc_interval` uses);
    NaN for both when a class is missing."""
    labels = np.asarray(labels).astype(bool)
    scores = np.asarray(scores, dtype=np.float64)
    m, n = int(labels.sum()), int((~labels).sum())
    if m == 0 or n == 0 or not np.isfinite(scores).all():  # a NaN score ranks nowhere
        return math.nan, math.nan
    v10, v01 = _placements(labels, scores, in_order=False)
    variance = (v10.var(ddof=1) if m > 1 else 0.0) / m + (v01.var(ddof=1) if n > 1 else 0.0) / n
    return float(v10.mean()), math.sqrt(max(variance, 0.0))


def paired_roc_auc_difference(
    labels: np.ndarray, first: np.ndarray, second: np.ndarray, confidence: float = CONFIDENCE
) -> tuple[float, float]:
    """ROC AUC of `first` minus that of `second` on the same examples, and the one-sided
    `confidence` upper bound of that difference (DeLong's paired test: the two AUCs'
    placement values are correlated through the shared examples). An upper bound below 0
    says `second` is ahead beyond doubt."""
    labels = np.asarray(labels).astype(bool)
    first, second = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    m, n = int(labels.sum()), int((~labels).sum())
    if m < 2 or n < 2 or not (np.isfinite(first).all() and np.isfinite(second).all()):
        return math.nan, math.nan
    a10, a01 = _placements(labels, first)
    b10, b01 = _placements(labels, second)
    difference = float(a10.mean() - b10.mean())
    variance = (a10 - b10).var(ddof=1) / m + (a01 - b01).var(ddof=1) / n
    return difference, difference + _z(confidence, sides=1) * math.sqrt(max(variance, 0.0))


def paired_average_precision_difference(
    labels: np.ndarray,
    first: np.ndarray,
    second: np.ndarray,
    confidence: float = CONFIDENCE,
    resamples: int = PAIRED_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """Average precision of `first` minus that of `second` on the same examples, and the
    one-sided `confidence` upper bound of that difference, from a paired bootstrap (every
    resample draws the same examples for both: Poisson weights, vectorised). An upper bound
    below 0 says `second` is ahead beyond doubt."""
    labels = np.asarray(labels).astype(np.float64)
    if labels.sum() < 2 or labels.sum() > labels.size - 2:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    differences = []
    for start in range(0, resamples, PAIRED_CHUNK):
        weights = rng.poisson(1.0, size=(min(PAIRED_CHUNK, resamples - start), labels.size))
        differences.append(
            _weighted_average_precision(labels, first, weights)
            - _weighted_average_precision(labels, second, weights)
        )
    ones = np.ones((1, labels.size))
    difference = float(
        _weighted_average_precision(labels, first, ones)[0]
        - _weighted_average_precision(labels, second, ones)[0]
    )
    spread = np.concatenate(differences)
    spread = spread[np.isfinite(spread)]
    if spread.size < 2:
        return difference, math.nan
    return difference, difference + _z(confidence, sides=1) * float(spread.std(ddof=1))


def _weighted_average_precision(
    labels: np.ndarray, scores: np.ndarray, weights: np.ndarray
) -> np.ndarray:
    """Average precision (scikit-learn's step-wise definition, ties as one threshold) of
    `scores` under each row of example `weights` [resamples, n]."""
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    ranked = np.asarray(scores, dtype=np.float64)[order]
    # The last position of each run of tied scores: thresholds fall between runs.
    ends = np.flatnonzero(np.r_[ranked[1:] != ranked[:-1], True])
    w = weights[:, order].astype(np.float64)
    hits = np.cumsum(w * labels[order], axis=1)[:, ends]
    seen = np.cumsum(w, axis=1)[:, ends]
    gained = np.diff(hits, axis=1, prepend=0.0)
    # A resample that drew none of the top examples has seen nothing at the first cut:
    # precision there is 0 (it gains nothing), not 0 / 0.
    precision = np.divide(hits, seen, out=np.zeros_like(hits), where=seen > 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (gained * precision).sum(axis=1) / hits[:, -1]


def paired_log_loss_difference(
    labels: np.ndarray, first: np.ndarray, second: np.ndarray, confidence: float = CONFIDENCE
) -> tuple[float, float]:
    """Log loss of `first` minus that of `second` on the same examples, and the one-sided
    `confidence` upper bound of that difference (the mean of per-example differences and
    its standard error). An upper bound below 0 says `first` is better beyond doubt."""
    labels = np.asarray(labels).astype(np.float64)
    if labels.size < 2:
        return math.nan, math.nan

    def losses(probs: np.ndarray) -> np.ndarray:
        p = np.clip(np.asarray(probs, dtype=np.float64), PROB_EPS, 1 - PROB_EPS)
        return -(labels * np.log(p) + (1 - labels) * np.log1p(-p))

    differences = losses(first) - losses(second)
    mean = float(differences.mean())
    error = float(differences.std(ddof=1)) / math.sqrt(differences.size)
    return mean, mean + _z(confidence, sides=1) * error


def average_precision_interval(ap: float, n_positives: int) -> tuple[float, float]:
    """95% logit interval of average precision (Boyd, Eng and Page 2013): symmetric in
    logit(AP) with standard error 1 / sqrt(n_pos AP (1 - AP)). It stays inside (0, 1) and
    covers well from a few dozen positives on; with fewer it is wide, as it should be."""
    if not math.isfinite(ap) or n_positives == 0:
        return math.nan, math.nan
    # A perfect (or null) ranking of a few positives is no certainty: the interval is that
    # of an AP half a positive from the edge, stretched to reach the estimate itself.
    edge = 0.5 / n_positives
    shrunk = min(max(ap, edge), 1 - edge)
    centre = math.log(shrunk / (1 - shrunk))
    half = _z(CONFIDENCE) / math.sqrt(n_positives * shrunk * (1 - shrunk))
    low, high = 1 / (1 + math.exp(-(centre - half))), 1 / (1 + math.exp(-(centre + half)))
    return min(low, ap), max(high, ap)


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


def auc_by_prefix_length(
    prefix_len: np.ndarray, labels: np.ndarray, scores: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per prefix length k (the events seen): k, how many prefixes have it, and their ROC
    AUC (NaN where they hold one class only). A journey of n events gives prefixes 1..n,
    each scored after its k-th event and labelled with the journey's outcome."""
    from sklearn.metrics import roc_auc_score

    prefix_len, labels, scores = (np.asarray(a) for a in (prefix_len, labels, scores))
    lengths, counts = np.unique(prefix_len, return_counts=True)
    aucs = np.full(len(lengths), np.nan)
    for i, length in enumerate(lengths):
        at = prefix_len == length
        y = labels[at]
        if 0 < y.sum() < len(y):
            aucs[i] = roc_auc_score(y, scores[at])
    return lengths, counts, aucs


def weighted_prefix_auc(counts: np.ndarray, aucs: np.ndarray) -> float:
    """The AUCs by prefix length averaged with their prefix counts as weights, over the
    lengths that have one (Teinemaa et al. 2019's headline number); NaN if none has."""
    scored = ~np.isnan(aucs)
    if not scored.any():
        return float("nan")
    return float(np.average(aucs[scored], weights=np.asarray(counts, dtype=np.float64)[scored]))

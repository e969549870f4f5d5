"""The PNGs of training runs and reports: the evaluation plots logged with each training
run (ROC, precision-recall, calibration, attention by event type) and the attribution
report's (credit by method, attention by position, attention heatmaps of example
journeys). The monitor's page draws its own figures (`journeys.monitor`).

Figures are built without pyplot: no global state and no GUI backend, so plotting is safe
in threads, flows and on servers without a display.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from journeys.metrics import ECE_BINS, expected_calibration_error

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

METRIC_PLOT_DPI = 110  # the evaluation plots logged with each training run
REPORT_PLOT_DPI = 120  # the attribution report's figures


def figure_of(width: float, height: float) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


# ----------------------------------------------------------------------------- evaluation


def _axes() -> tuple[Figure, Axes]:
    figure = figure_of(5.0, 4.5)
    return figure, figure.subplots()


def save(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=METRIC_PLOT_DPI)
    return path


def plot_roc(labels: np.ndarray, curves: Mapping[str, np.ndarray], path: Path) -> Path:
    """ROC curve of each named probability vector."""
    from sklearn.metrics import roc_auc_score, roc_curve

    fig, ax = _axes()
    for name, probs in curves.items():
        if np.unique(labels).size == 2:
            fpr, tpr, _ = roc_curve(labels, probs)
            ax.plot(fpr, tpr, label=f"{name} (AUC {roc_auc_score(labels, probs):.3f})")
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1)
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC (test)")
    ax.legend(loc="lower right", fontsize=8)
    return save(fig, path)


def plot_pr(labels: np.ndarray, curves: Mapping[str, np.ndarray], path: Path) -> Path:
    """Precision-recall curve of each named probability vector, with the base rate."""
    from sklearn.metrics import average_precision_score, precision_recall_curve

    fig, ax = _axes()
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
    return save(fig, path)


def plot_calibration(
    labels: np.ndarray, curves: Mapping[str, np.ndarray], path: Path, n_bins: int = ECE_BINS
) -> Path:
    """Reliability diagram: observed conversion rate against mean predicted probability."""
    fig, ax = _axes()
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
    return save(fig, path)


def plot_attention_by_event_type(table: Mapping[str, tuple[float, int]], path: Path) -> Path:
    """Bars of mean attention per event type (relative to uniform; 1 = an average event).

    `table` maps event type -> (mean relative attention, number of occurrences).
    """
    fig, ax = _axes()
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
    return save(fig, path)


# ----------------------------------------------------------------------------- attribution


def plot_credit(credit: pl.DataFrame, dimension: str, methods: list[str]) -> Figure:
    """Grouped bars: each method's credit share per touchpoint."""
    labels = credit.get_column("touchpoint").to_list()
    figure = figure_of(max(6.0, 0.9 * len(labels) * max(1, len(methods)) / 3), 4.0)
    ax = figure.subplots()
    width = 0.8 / max(1, len(methods))
    x = np.arange(len(labels))
    for i, method in enumerate(methods):
        ax.bar(x + i * width, credit.get_column(method).to_numpy(), width, label=method)
    ax.set_xticks(x + 0.4 - width / 2, labels, rotation=30, ha="right")
    ax.set_ylabel("share of conversions")
    ax.set_title(f"Credit by {dimension}, per method")
    if labels:
        ax.legend(fontsize="small")
    return figure


def plot_position(by_position: pl.DataFrame, cap: int) -> Figure:
    """Mean attention per event by position from the end, per outcome."""
    figure = figure_of(6.0, 3.5)
    ax = figure.subplots()
    for (outcome,), part in by_position.group_by("outcome", maintain_order=True):
        part = part.sort("position_from_end")
        ax.plot(part["position_from_end"], part["mean_attention"], marker="o", label=outcome)
    ax.set_xlabel(f"position from the end (0 = last event, {cap} = that far or more)")
    ax.set_ylabel("mean attention per event")
    if by_position.height:
        ax.legend(fontsize="small")
    return figure


def plot_examples(examples: pl.DataFrame, max_events: int) -> Figure:
    """Heatmap of attention over the last events of a few journeys, cells labelled by type."""
    rows = examples.select(
        "journey_id",
        pl.col("attention").list.tail(max_events),
        pl.col("event_type").list.tail(max_events),
        *(["conversion_probability"] if "conversion_probability" in examples.columns else []),
    ).to_dicts()
    width = max(len(r["attention"]) for r in rows)
    grid = np.full((len(rows), width), np.nan)
    for i, row in enumerate(rows):
        grid[i, : len(row["attention"])] = row["attention"]
    figure = figure_of(max(6.0, 0.6 * width), 0.6 * len(rows) + 1.5)
    ax = figure.subplots()
    image = ax.imshow(grid, aspect="auto", cmap="viridis")
    for i, row in enumerate(rows):
        for j, event in enumerate(row["event_type"]):
            ax.text(j, i, str(event)[:6], ha="center", va="center", fontsize=6, color="white")
    labels = [
        f"{r['journey_id'][:18]}  p={r.get('conversion_probability', float('nan')):.2f}"
        for r in rows
    ]
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.set_xlabel(f"event (last {max_events} at most)")
    ax.set_title("Attention over events of high-scoring journeys")
    figure.colorbar(image, ax=ax, label="attention")
    return figure

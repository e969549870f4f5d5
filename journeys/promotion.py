"""Which model becomes the champion: chosen on the validation split, and guarded.

A training run's transformer is a candidate for the registry's `champion` alias. It is
promoted only when every check below holds, in this order; the first that fails decides,
and the summary, the run and the model version say which and what to do about it:

1. `too_few_conversions`: the val split holds at least `promotion.min_val_conversions`
   conversions (with fewer, a ROC AUC's 95% interval spans 0.2 or more: nothing can be
   chosen on it);
2. `not_above_chance`: the lower end of the candidate's val ROC AUC interval (DeLong) is
   above 0.5: a run that did not learn is no candidate;
3. `below_baseline`: no baseline of the same run is ahead of it on the same val journeys
   by a paired DeLong test (one-sided, at `promotion.confidence`): the registry never
   serves a transformer that a simple model beats;
4. `not_better_than_champion`: its val ROC AUC beats the current champion's on the same
   val journeys (a tie keeps the champion).

The test split never takes part: its metrics are reported, so they still measure
something. (MLflow's model validation refuses a candidate below a baseline's thresholds;
AutoGluon and its kind pick models on validation data. This is both, with the paired test
that small validation splits need.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from journeys.config import Promotion
from journeys.metrics import paired_roc_auc_difference, roc_auc_interval

CHANCE = 0.5


@dataclass(frozen=True)
class Decision:
    """Whether the candidate becomes the champion, which check decided, why, the fix, and
    every model's val ROC AUC that took part (`transformer`, `baseline_<name>`, `champion`)."""

    promote: bool
    check: str  # promoted | first_champion | too_few_conversions | not_above_chance | ...
    reason: str
    fix: str = ""
    val_roc_auc: dict[str, float] = field(default_factory=dict)

    @property
    def summary(self) -> str:
        """The one line a person reads: the reason, and the fix when there is one."""
        return f"{self.reason}; {self.fix}" if self.fix else self.reason

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide(
    labels: np.ndarray,
    candidate: np.ndarray,
    baselines: dict[str, np.ndarray],
    champion: np.ndarray | float | None,
    settings: Promotion,
) -> Decision:
    """The promotion decision on the val split: `labels` and each model's val scores
    (`candidate`, every `baselines[name]`, and `champion`, the current champion's scores
    on the same journeys, its logged val ROC AUC when it could not score them, or None
    when there is no champion yet). See the module docstring for the checks."""
    labels = np.asarray(labels).astype(bool)
    conversions, n = int(labels.sum()), labels.size
    if not settings.guard:
        return _against_champion(labels, candidate, champion, {}, " (promotion.guard off)")
    if conversions < settings.min_val_conversions or conversions == n:
        return Decision(
            False,
            "too_few_conversions",
            f"the val split holds {conversions} conversions of {n} journeys, fewer than "
            f"promotion.min_val_conversions ({settings.min_val_conversions}): no model can "
            "be chosen on it, the champion stays",
            "give val more journeys (a longer log, or a larger val share in split.fractions)",
        )
    aucs = {"transformer": _auc(labels, candidate)}
    aucs |= {f"baseline_{name}": _auc(labels, scores) for name, scores in baselines.items()}
    if champion is not None:
        aucs["champion"] = float(champion) if np.ndim(champion) == 0 else _auc(labels, champion)
    auc = aucs["transformer"]
    low, high = roc_auc_interval(labels, candidate, settings.confidence)
    if not low > CHANCE:
        return Decision(
            False,
            "not_above_chance",
            f"val ROC AUC {auc:.4f} [{low:.4f}, {high:.4f}] is not above chance: the "
            "transformer did not learn, the champion stays",
            "check the labels and the split (the ingest report), or train longer (train.min_steps)",
            aucs,
        )
    ahead = []
    for name, scores in baselines.items():
        difference, upper = paired_roc_auc_difference(
            labels, candidate, scores, settings.confidence
        )
        if upper < 0:  # the baseline is ahead beyond doubt
            ahead.append((difference, name))
    if ahead:
        _, name = min(ahead)
        return Decision(
            False,
            "below_baseline",
            f"baseline_{name} (val ROC AUC {aucs[f'baseline_{name}']:.4f}) is ahead of the "
            f"transformer ({auc:.4f}) by a paired test on the same val journeys: the champion "
            "stays",
            f"use baseline_{name} for this log, or give the transformer what it uses "
            "(docs/model.md)",
            aucs,
        )
    return _against_champion(labels, candidate, champion, aucs)


def _against_champion(
    labels: np.ndarray,
    candidate: np.ndarray,
    champion: np.ndarray | float | None,
    aucs: dict[str, float],
    note: str = "",
) -> Decision:
    """The last check: ahead of the champion on the same val journeys (or its logged AUC)."""
    aucs = {"transformer": _auc(labels, candidate), **aucs}
    if champion is not None and "champion" not in aucs:
        aucs["champion"] = float(champion) if np.ndim(champion) == 0 else _auc(labels, champion)
    auc = aucs["transformer"]
    if champion is None:
        return Decision(
            True, "first_champion", f"first champion (val ROC AUC {auc:.4f}){note}", "", aucs
        )
    best = aucs["champion"]
    where = "logged" if np.ndim(champion) == 0 else "on the same val journeys"
    if not (math.isfinite(best) and auc <= best):
        reason = f"val ROC AUC {auc:.4f} > champion's {best:.4f} ({where}){note}"
        return Decision(True, "promoted", reason, "", aucs)
    return Decision(
        False,
        "not_better_than_champion",
        f"val ROC AUC {auc:.4f} <= champion's {best:.4f} ({where}): the champion stays{note}",
        "",
        aucs,
    )


def _auc(labels: np.ndarray, scores: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    if labels.all() or not labels.any():
        return math.nan  # one class: no ranking to measure
    return float(roc_auc_score(labels, scores))

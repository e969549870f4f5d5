"""Which model becomes the champion: chosen among the run's candidates on val, and guarded.

Every training run has several candidates, all saved and served the same way
(`journeys.trained_model.TrainedModel.kind`): the `transformer`, the `stack` (the
transformer blended with `hgb_aggregates`) and each baseline's model (`baseline_<name>`).
The one registered is decided on the val split alone, by these checks in order; the
summary, the run and the model version say which decided, why, and what to do:

1. `too_few_conversions`: val holds at least `promotion.min_val_conversions` conversions
   (with fewer, a ROC AUC's 95% interval spans 0.2 or more: nothing can be chosen on it);
2. `not_above_chance`: a candidate whose val ROC AUC interval (DeLong) does not clear 0.5
   learned nothing: it is out, and when no candidate is left, nothing is served;
3. the best val ROC AUC wins, but a tie goes to the transformer, then the stack: within
   `promotion.tie_margin` of the best they are preferred (their attention explains the
   journeys; scores carry it whatever gives the probability); and unless a rival is
   clearly ahead of them (a paired DeLong test at `promotion.confidence`), not merely
   ahead on this val split, the stack (the transformer and the strong booster), then
   `hgb_aggregates` go first: among close rivals the one first on val is often last on
   test;
4. `promotion.metrics` beside ROC AUC: a candidate clearly worse than a rival on PR AUC or
   log loss (beyond doubt by a paired one-sided test at `promotion.confidence`, and by
   more than `promotion.metric_tolerance` of the rival's figure) is passed over for the
   next, unless that rival is itself clearly behind on ROC AUC;
5. `not_better_than_champion`: the chosen candidate's val ROC AUC beats the current
   champion's on the same val journeys (a tie keeps the champion).

What is judged is never what chose: every val figure here is honest. The baselines are
fitted on train alone. The transformer's checkpoint is the epoch with the best val ROC AUC,
so the figure judged is cross-fitted (`cross_fitted_transformer`): each half of val is
scored by the epoch the other half picked, and an epoch-0 fluke on one half does not
survive the other. Calibration fitted on val (the transformer's temperature, the stack's Platt
scaling) are chosen and fitted on one half for the other the same way (`cross_fit`). The
chosen candidate then meets the champion with that honest figure too: what it serves,
its checkpoint chosen on all of val, would meet the champion's out-of-sample scores with
an in-sample one, and a run would win on the luck of its choice. (The version's logged
`val_roc_auc`, which a champion that cannot score the journeys is met with, is the same
honest figure.)

The test split never takes part: its metrics are reported, so they still measure
something. (MLflow's model validation refuses a candidate below a baseline's thresholds;
AutoGluon and its kind pick among models on validation data. This is both, with the
paired tests small validation splits need.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from journeys.config import Promotion
from journeys.metrics import (
    paired_average_precision_difference,
    paired_log_loss_difference,
    paired_roc_auc_difference,
    roc_auc_interval,
)

CHANCE = 0.5
# The kinds of candidate: what a registered model serves (`TrainedModel.kind`), and the
# `model_family` of the MLflow run that fitted it (a stack has none of its own).
TRANSFORMER, STACK = "transformer", "stack"
BASELINE_PREFIX = "baseline_"  # a baseline's kind is `baseline_<name>` (`baseline_kind`)


def baseline_kind(name: str) -> str:
    """The kind of candidate (and run family) of baseline `name`."""
    return BASELINE_PREFIX + name


PREFERRED = (TRANSFORMER, STACK)  # who takes a tie, in this order
# Who goes first, in this order, when not clearly behind the best (a paired test).
WITHIN_NOISE = (STACK, baseline_kind("hgb_aggregates"))
VAL_FOLDS = 2  # halves of val: one chooses (an epoch, a calibration), the other judges
# What each metric is called in messages, and whether higher is better.
METRIC_LABELS = {"roc_auc": "ROC AUC", "pr_auc": "PR AUC", "log_loss": "log loss"}


@dataclass(frozen=True)
class Decision:
    """Which candidate is registered (`kind`), whether it becomes the champion, which check
    decided, why, the fix, and every candidate's honest val metrics (`val_metrics[kind]`,
    and the current champion's ROC AUC as `val_metrics["champion"]`)."""

    promote: bool
    check: str  # promoted | first_champion | too_few_conversions | not_above_chance | ...
    reason: str
    fix: str = ""
    kind: str = TRANSFORMER
    val_metrics: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def summary(self) -> str:
        """The one line a person reads: the reason, and the fix when there is one."""
        return f"{self.reason}; {self.fix}" if self.fix else self.reason

    @property
    def val_roc_auc(self) -> dict[str, float]:
        return {kind: m["roc_auc"] for kind, m in self.val_metrics.items() if "roc_auc" in m}

    @property
    def guard_passed(self) -> bool:
        """Whether a candidate passed the guard (it may still not beat the champion)."""
        return self.check in ("promoted", "first_champion", "not_better_than_champion")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def decide(
    labels: np.ndarray,
    candidates: dict[str, np.ndarray],
    champion: np.ndarray | float | None,
    settings: Promotion,
    served: dict[str, np.ndarray] | None = None,
) -> Decision:
    """The decision on the val split: `labels`, each candidate's honest val probabilities
    (`candidates[kind]`, the transformer first), and `champion`: the current champion's
    scores on the same journeys, its logged val ROC AUC when it could not score them, or
    None when there is none yet. The chosen candidate meets the champion with its honest
    figure too. `served[kind]` (what each serves on val, fitted on all of it) is what the
    transformer meets the champion with when `promotion.guard` is off, for plumbing and
    demos (default: its honest figures). See the module docstring for the checks."""
    served = served or {}
    labels = np.asarray(labels).astype(bool)
    conversions, n = int(labels.sum()), labels.size
    if not settings.guard:  # plumbing and demos: the transformer, against the champion only
        metrics = {kind: _metrics(labels, scores) for kind, scores in candidates.items()}
        why = f"{TRANSFORMER} serves (promotion.guard off)"
        scores = served.get(TRANSFORMER, candidates[TRANSFORMER])
        return _against_champion(labels, TRANSFORMER, scores, champion, metrics, why)
    if min(conversions, n - conversions) < settings.min_val_conversions:
        # Either outcome that rare: an AUC's interval would be no interval (one journey
        # without a conversion makes DeLong's variance 0).
        fewer = "conversions" if conversions <= n - conversions else "journeys without one"
        return Decision(
            False,
            "too_few_conversions",
            f"the val split holds {conversions} conversions of {n} journeys, fewer "
            f"{fewer} than promotion.min_val_conversions ({settings.min_val_conversions}): "
            f"no model can be chosen on it, {_champion_stays(champion)}",
            "give val more journeys (a longer log, then `journeys ingest` with a larger val "
            "share in split.fractions)",
        )
    metrics = {kind: _metrics(labels, scores) for kind, scores in candidates.items()}
    low = {
        kind: roc_auc_interval(labels, s, settings.confidence)[0] for kind, s in candidates.items()
    }
    passing = [kind for kind in candidates if low[kind] > CHANCE]
    if not passing:
        best = max(candidates, key=lambda kind: _finite(metrics[kind]["roc_auc"]))
        return Decision(
            False,
            "not_above_chance",
            f"no candidate's val ROC AUC is above chance (the best, {best}: "
            f"{metrics[best]['roc_auc']:.4f}, interval from {low[best]:.4f}): nothing "
            f"learned to rank these journeys, {_champion_stays(champion)}",
            "check the labels and the split (the ingest report: a conversion event that "
            "does not mean conversion, a split whose val differs from train)",
            TRANSFORMER,  # what is registered (never aliased): the run's own model
            metrics,
        )
    order = ranking(passing, metrics, settings.tie_margin)
    if order[0] != TRANSFORMER:
        # Within the noise of the best on val, the stack (the transformer and the strong
        # booster), then the strong booster alone, go first: a rival first by a hair on val
        # is often last on test (the winner's curse of choosing among close candidates).
        lead = candidates[order[0]]
        close = [
            kind
            for kind in WITHIN_NOISE
            if kind in order
            and not _clearly_better(labels, lead, candidates[kind], "roc_auc", settings.confidence)
        ]
        order = [*close, *(kind for kind in order if kind not in close)]
    chosen, passed_over = _on_every_metric(labels, order, candidates, metrics, settings)
    return _against_champion(
        labels,
        chosen,
        candidates[chosen],
        champion,
        metrics,
        _why(chosen, order, metrics, passed_over),
    )


def ranking(kinds: list[str], metrics: dict[str, dict[str, float]], tie_margin: float) -> list[str]:
    """`kinds` best first by val ROC AUC, a tie going to the preferred: each place goes to
    the transformer if it is within `tie_margin` of the best left, else the stack if it
    is, else the best."""

    def auc(kind: str) -> float:
        return _finite(metrics[kind]["roc_auc"])

    left, order = list(kinds), []
    while left:
        best = max(auc(kind) for kind in left)
        tied = [kind for kind in left if best - auc(kind) <= tie_margin]
        preferred = [kind for kind in PREFERRED if kind in tied]
        chosen = preferred[0] if preferred else max(tied, key=auc)
        order.append(chosen)
        left.remove(chosen)
    return order


def _on_every_metric(
    labels: np.ndarray,
    order: list[str],
    candidates: dict[str, np.ndarray],
    metrics: dict[str, dict[str, float]],
    settings: Promotion,
) -> tuple[str, list[str]]:
    """The first candidate of `order` that no rival beats clearly on another metric of
    `promotion.metrics` (a rival that is itself clearly behind on ROC AUC does not count);
    the first of `order` when every one is beaten. Also: why each one before it was passed
    over."""
    others = [m for m in settings.metrics if m != "roc_auc"]
    passed_over = []
    for kind in order:
        beaten = None
        for rival in order:
            if rival == kind or _clearly_better(
                labels, candidates[kind], candidates[rival], "roc_auc", settings.confidence
            ):
                continue
            beaten = next(
                (
                    m
                    for m in others
                    if _clearly_better(
                        labels,
                        candidates[rival],
                        candidates[kind],
                        m,
                        settings.confidence,
                        settings.metric_tolerance * metrics[rival][m],
                    )
                ),
                None,
            )
            if beaten:
                passed_over.append(
                    f"{kind} passed over: {rival} is clearly better on val {METRIC_LABELS[beaten]}"
                )
                break
        if beaten is None:
            return kind, passed_over
    return order[0], [*passed_over, "every candidate is beaten on one metric: ROC AUC decides"]


def _clearly_better(
    labels: np.ndarray,
    first: np.ndarray,
    second: np.ndarray,
    metric: str,
    confidence: float,
    margin: float = 0.0,
) -> bool:
    """Whether `first` is ahead of `second` on `metric` beyond doubt (one-sided, paired)
    and by more than `margin`."""
    if metric == "roc_auc":
        difference, upper = paired_roc_auc_difference(labels, second, first, confidence)
    elif metric == "pr_auc":
        difference, upper = paired_average_precision_difference(labels, second, first, confidence)
    else:  # log loss: lower is better
        difference, upper = paired_log_loss_difference(labels, first, second, confidence)
    return bool(upper < 0 and -difference > margin)


def _why(
    chosen: str, order: list[str], metrics: dict[str, dict[str, float]], passed_over: list[str]
) -> str:
    auc = metrics[chosen]["roc_auc"]
    best = max(order, key=lambda kind: _finite(metrics[kind]["roc_auc"]))
    text = f"{chosen} serves (val ROC AUC {auc:.4f}"
    if best != chosen:
        text += f"; {best} {metrics[best]['roc_auc']:.4f}"
    if chosen != TRANSFORMER and TRANSFORMER in metrics:
        text += f"; transformer {metrics[TRANSFORMER]['roc_auc']:.4f}"
    text += ")"
    return "; ".join([text, *passed_over])


def _against_champion(
    labels: np.ndarray,
    kind: str,
    scores: np.ndarray,
    champion: np.ndarray | float | None,
    metrics: dict[str, dict[str, float]],
    why: str,
) -> Decision:
    """The last check: `scores` (what `kind` serves on val) ahead of the champion's on the
    same val journeys (or its logged AUC)."""
    auc = _auc(labels, np.asarray(scores))
    if champion is None:
        return Decision(True, "first_champion", f"first champion: {why.strip()}", "", kind, metrics)
    best = float(champion) if np.ndim(champion) == 0 else _auc(labels, np.asarray(champion))
    metrics = {**metrics, "champion": {"roc_auc": best}}
    where = "logged" if np.ndim(champion) == 0 else "on the same val journeys"
    if not (math.isfinite(best) and auc <= best):
        reason = f"{why.strip()}: val ROC AUC {auc:.4f} > champion's {best:.4f} ({where})"
        return Decision(True, "promoted", reason, "", kind, metrics)
    return Decision(
        False,
        "not_better_than_champion",
        f"{why.strip()}: val ROC AUC {auc:.4f} <= champion's {best:.4f} ({where}): the "
        "champion stays",
        "",
        kind,
        metrics,
    )


def _champion_stays(champion: np.ndarray | float | None) -> str:
    return "no champion is served" if champion is None else "the champion stays"


def _metrics(labels: np.ndarray, probabilities: np.ndarray) -> dict[str, float]:
    """ROC AUC and PR AUC of the scores as they are, log loss of them as probabilities."""
    from sklearn.metrics import average_precision_score

    from journeys.metrics import PROB_EPS

    p = np.clip(np.asarray(probabilities, dtype=np.float64), PROB_EPS, 1 - PROB_EPS)
    two_classes = bool(labels.any() and not labels.all())
    return {
        "roc_auc": _auc(labels, probabilities),
        "pr_auc": float(average_precision_score(labels, probabilities))
        if two_classes
        else math.nan,
        "log_loss": float(-np.mean(labels * np.log(p) + (~labels) * np.log1p(-p))),
    }


def _auc(labels: np.ndarray, scores: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    if labels.all() or not labels.any():
        return math.nan  # one class: no ranking to measure
    return float(roc_auc_score(labels, scores))


def _finite(value: float) -> float:
    return value if math.isfinite(value) else -math.inf


# ----------------------------------------------------------------------------- honest val


def val_folds(labels: np.ndarray, seed: int) -> np.ndarray:
    """A fold (0 .. VAL_FOLDS - 1) for every val journey, each class dealt out evenly."""
    labels = np.asarray(labels).astype(bool)
    folds = np.empty(labels.size, dtype=np.int64)
    rng = np.random.default_rng(seed)
    for value in (False, True):
        rows = np.flatnonzero(labels == value)
        folds[rng.permutation(rows)] = np.arange(rows.size) % VAL_FOLDS
    return folds


def best_epoch(history: np.ndarray, labels: np.ndarray, rows: np.ndarray) -> int:
    """The epoch of `history` ([epochs, journeys] val logits) with the best ROC AUC on
    `rows` (a mask of val journeys)."""
    labels = np.asarray(labels).astype(bool)
    aucs = [_auc(labels[rows], epoch[rows]) for epoch in np.atleast_2d(history)]
    return int(np.argmax([_finite(a) for a in aucs]))


FoldModel = Callable[[np.ndarray, np.ndarray], np.ndarray]


def cross_fit(labels: np.ndarray, folds: np.ndarray, fit_predict: FoldModel) -> np.ndarray:
    """Each val journey's figure from what was chosen and fitted on the *other* folds:
    `fit_predict(fit_rows, held_rows)` chooses (an epoch) and fits (a temperature, a
    blend's calibration) on `fit_rows` alone and returns its values for `held_rows`."""
    out = np.empty(np.asarray(labels).size)
    for fold in range(VAL_FOLDS):
        held = folds == fold
        out[held] = fit_predict(~held, held)
    return out


def cross_fitted_transformer(
    history: np.ndarray, labels: np.ndarray, folds: np.ndarray
) -> np.ndarray:
    """Each val journey's probability from the epoch the *other* folds chose and the
    temperature they fitted (`calibrated_choice`): `history` is [epochs, journeys], every
    validated epoch's val logits."""
    from journeys.metrics import sigmoid

    history = np.atleast_2d(np.asarray(history, dtype=np.float64))
    return cross_fit(
        labels, folds, lambda fit, held: sigmoid(calibrated_choice(history, labels, fit)[held])
    )


def calibrated_choice(history: np.ndarray, labels: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The val logits `rows` choose and calibrate: the epoch of `history` with the best ROC
    AUC on them, divided by the temperature fitted on them (what the transformer's and the
    stack's cross-fitted figures start from)."""
    from journeys.metrics import fit_temperature

    epoch = history[best_epoch(history, labels, rows)]
    return epoch / fit_temperature(epoch[rows], labels[rows])

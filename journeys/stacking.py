"""The transformer stacked with gradient boosting on journey aggregates (`train.stack`).

On logs where counts, gaps and durations carry the signal, `hgb_aggregates` (the strong
baseline) ranks journeys as well as the transformer or better; on logs where order and
timing do, the transformer wins. A stacked model takes both: the same boosting model,
fitted on the train journeys, and a logistic regression on the two models' logits,
fitted on the val journeys (three numbers, so val is enough; what promotion compares is
cross-fitted on val, never the val fit itself). The transformer's attention is still
what scoring exports: the stack changes the probability, not the explanation.

Saved beside the transformer's files: `stack.json` (the blend and the aggregates' fitted
vocabulary) and `booster.skops` (the boosting model, read back with skops, which loads
only the types named in `BOOSTER_TYPES`, never arbitrary pickles).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

from journeys.baselines import JourneyAggregates, fit_aggregates_booster

if TYPE_CHECKING:
    from sklearn.ensemble import HistGradientBoostingClassifier

STACK_FILE = "stack.json"
BOOSTER_FILE = "booster.skops"
STACK_FILES = (STACK_FILE, BOOSTER_FILE)
# The only types `booster.skops` may hold besides skops' defaults (a fitted
# HistGradientBoostingClassifier); a file with others is refused.
BOOSTER_TYPES = (
    "functools.partial",
    "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor",
    "sklearn.utils.validation.check_array",
)
CROSS_FIT_FOLDS = 5  # folds of val for the stack's honest val predictions
_CLIP = 1e-6  # probabilities are clipped this far from 0 and 1 before taking logits


def logit(probability: np.ndarray) -> np.ndarray:
    p = np.clip(np.asarray(probability, dtype=np.float64), _CLIP, 1 - _CLIP)
    return np.log(p / (1 - p))


@dataclass
class Stack:
    """Gradient boosting on journey aggregates plus the blend of its logit with the
    transformer's: `weights[0] * transformer + weights[1] * booster + intercept`."""

    aggregates: JourneyAggregates
    booster: HistGradientBoostingClassifier
    weights: tuple[float, float]
    intercept: float

    def booster_logits(self, frame: pl.DataFrame) -> np.ndarray:
        """The boosting model's logits for a journeys frame (ingest schema; a served frame
        without `n_events_total` counts the events it lists)."""
        if "n_events_total" not in frame.columns:
            frame = frame.with_columns(n_events_total=pl.col("event_type").list.len())
        return logit(self.booster.predict_proba(self.aggregates.transform(frame))[:, 1])

    def combine(self, transformer_logits: np.ndarray, frame: pl.DataFrame) -> np.ndarray:
        """The stacked logits of `frame`'s journeys, given the transformer's (uncalibrated)."""
        booster = self.booster_logits(frame)
        return blend(self.weights, self.intercept, np.asarray(transformer_logits), booster)

    # ------------------------------------------------------------------------- files

    def save(self, folder: Path) -> list[Path]:
        from skops.io import dump

        settings = {
            "weights": list(self.weights),
            "intercept": self.intercept,
            "aggregates": self.aggregates.to_dict(),
        }
        (folder / STACK_FILE).write_text(json.dumps(settings, indent=2) + "\n")
        dump(self.booster, folder / BOOSTER_FILE)
        return [folder / name for name in STACK_FILES]

    @classmethod
    def load(cls, folder: Path) -> Stack | None:
        """The stack saved in `folder`, or None when the model has none."""
        from skops.io import load

        if not (folder / STACK_FILE).exists():
            return None
        settings: dict[str, Any] = json.loads((folder / STACK_FILE).read_text())
        booster = load(folder / BOOSTER_FILE, trusted=list(BOOSTER_TYPES))
        weights = tuple(float(w) for w in settings["weights"])
        return cls(
            JourneyAggregates.from_dict(settings["aggregates"]),
            booster,
            (weights[0], weights[1]),
            float(settings["intercept"]),
        )


def blend(
    weights: tuple[float, float], intercept: float, transformer: np.ndarray, booster: np.ndarray
) -> np.ndarray:
    return weights[0] * transformer + weights[1] * booster + intercept


@dataclass(frozen=True)
class FittedStack:
    stack: Stack
    val_logits: np.ndarray  # cross-fitted on val: what promotion compares
    test_logits: np.ndarray


def fit_stack(
    train: pl.DataFrame,
    val: pl.DataFrame,
    test: pl.DataFrame,
    transformer_val: np.ndarray,
    transformer_test: np.ndarray,
    aggregates: JourneyAggregates,
    seed: int,
) -> FittedStack:
    """Fit the boosting model on `train` and the blend on `val` (the transformer's
    uncalibrated logits on val and test, in the frames' order)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold

    aggregates, booster = fit_aggregates_booster(train, aggregates, seed)
    stack = Stack(aggregates, booster, (1.0, 0.0), 0.0)
    val_inputs = np.column_stack([transformer_val, stack.booster_logits(val)])
    labels = val.get_column("label").cast(pl.Int64).to_numpy()
    blend_model = LogisticRegression().fit(val_inputs, labels)
    stack.weights = (float(blend_model.coef_[0][0]), float(blend_model.coef_[0][1]))
    stack.intercept = float(blend_model.intercept_[0])
    # Each val journey scored by a blend fitted without it: an honest val AUC for promotion.
    cross_fitted = np.empty(len(labels))
    folds = min(CROSS_FIT_FOLDS, int(labels.sum()), int(len(labels) - labels.sum()))
    if folds >= 2:
        splitter = StratifiedKFold(folds, shuffle=True, random_state=seed)
        for fit_rows, held_out in splitter.split(val_inputs, labels):
            fold = LogisticRegression().fit(val_inputs[fit_rows], labels[fit_rows])
            cross_fitted[held_out] = fold.decision_function(val_inputs[held_out])
    else:  # too few of a class to hold any out: the val fit itself (promotion says too few)
        cross_fitted = blend_model.decision_function(val_inputs)
    return FittedStack(stack, cross_fitted, stack.combine(transformer_test, test))

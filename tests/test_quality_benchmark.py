"""The quality benchmark's label-noise-free yardstick (`benchmarks/quality.py`)."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from benchmarks.quality import expected_roc_auc


@pytest.mark.slow
def test_expected_roc_auc_is_the_mean_auc_over_label_draws() -> None:
    rng = np.random.default_rng(0)
    true_probability = rng.beta(0.5, 5.0, size=400)
    scores = np.log(true_probability) + rng.normal(0, 1.0, size=400)  # an imperfect model
    draws = [roc_auc_score(rng.random(400) < true_probability, scores) for _ in range(2_000)]
    # The Monte-Carlo mean is good to ~0.001 (sd of one draw ~0.045 / sqrt(2000)).
    assert abs(expected_roc_auc(scores, true_probability) - np.mean(draws)) < 0.003
    # The oracle ranks by the true probability: no model's expectation is higher.
    oracle = expected_roc_auc(true_probability, true_probability)
    assert oracle > expected_roc_auc(scores, true_probability) + 0.02
    assert abs(expected_roc_auc(np.zeros(400), true_probability) - 0.5) < 1e-12

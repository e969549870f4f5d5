"""The speed benchmarks still run on the default configuration (their smoke modes).

They build the default model from `conf/default.yaml` and feed it journeys of their own;
when the defaults gained inputs (the time encodings) they broke without a test noticing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_script(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_DISABLE_TELEMETRY": "true"}
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_train_speed_smoke_run_compares_with_torch_encoder() -> None:
    out = run_script("benchmarks/train_speed.py", "--quick", "--runs", "2")
    assert "journeys/s, this model / torch.nn.TransformerEncoder:" in out


@pytest.mark.slow
def test_gpu_benchmark_smoke_run_on_cpu() -> None:
    out = run_script("benchmarks/gpu.py", "--quick")
    assert "tiny: bf16 / fp32 throughput" in out
    assert "`journeys score` end to end, batch 8192, 4 thread worker(s):" in out
    assert "rows and columns identical" in out


@pytest.mark.slow
def test_default_suite_runs_a_candidate_beside_the_defaults_on_a_committed_sample() -> None:
    out = run_script(
        "benchmarks/suite.py", "--logs", "ga4_sample", "--variants", "defaults", "wide",
        "--no-record",
    )  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith("| ga4_sample |")]
    assert [row.split(" | ")[1] for row in rows] == ["defaults", "wide"]
    # The deletion test ran on each: top and random logit drops.
    assert all(re.search(r"\| -?\d+\.\d+ / -?\d+\.\d+ \(", row) for row in rows)
    assert re.search(r"^\| wide \| ga4_sample \| no \|", out, re.MULTILINE)  # paired, not voted


def test_every_suite_variant_is_a_valid_configuration_of_every_log() -> None:
    """What running each variant on a log would check first, without the trainings (a
    search variant alone trains eight models): its settings read on the log's own."""
    from benchmarks.public_logs import PUBLIC_LOGS
    from benchmarks.suite import LOGS, VARIANTS
    from journeys.config import load_config

    configs = {(log.config, log.overrides) for log in LOGS}
    configs |= {(log.config, ()) for log in PUBLIC_LOGS}
    assert len(configs) >= 5  # the default, BPIC 2012, the samples' and the public logs'
    for config, log_overrides in sorted(configs):
        for overrides in VARIANTS.values():
            load_config(ROOT / config, [*log_overrides, *overrides])


def test_the_suite_pairs_each_seed_with_the_defaults_of_that_seed() -> None:
    """Two seeds where the candidate's probabilities equal the defaults' of the same seed:
    every per-seed change is 0, whatever the seeds differ by; paired with the other seed's
    defaults they would not be."""
    import numpy as np
    import polars as pl

    from benchmarks.suite import against_defaults

    rng = np.random.default_rng(0)
    labels = np.array([0, 1] * 100)
    deletion = pl.DataFrame({"journey_id": ["a", "b"], "top": [0.3, 0.1], "random": [0.1, 0.0]})
    by_seed = {seed: rng.random(labels.size) for seed in (0, 1)}

    def row(variant: str, seed: int) -> dict:
        return {"log": "taobao", "variant": variant, "seed": seed, "conversions": 100,
                "test_labels": labels, "served_p": by_seed[seed],
                "deletion_by_journey": deletion}  # fmt: skip

    changes = against_defaults([row(v, s) for v in ("defaults", "floor600") for s in (0, 1)])
    assert [(c["seed"], c["auc"][0]) for c in changes] == [(0, 0.0), (1, 0.0)]
    assert all(c["tells"] and c["attention"][0] == 0.0 for c in changes)


def test_the_suite_decides_on_the_mean_over_seeds() -> None:
    """Three seeds of one candidate on one log: the change is their mean, and its interval
    adds their spread (Student's t, 2 degrees of freedom) to their mean squared half-width;
    another log's single run keeps its change as it was."""
    import math

    from scipy.stats import t as student_t

    from benchmarks.suite import over_seeds

    def change(log: str, seed: int | None, auc: tuple[float, float, float]) -> dict:
        return {"log": log, "variant": "floor600", "seed": seed, "tells": True,
                "auc": auc, "attention": (0.0, -0.1, 0.1)}  # fmt: skip

    three = [
        change("taobao", 0, (0.03, 0.02, 0.04)),
        change("taobao", 1, (0.00, -0.02, 0.02)),
        change("taobao", 2, (-0.03, -0.06, 0.00)),
    ]
    alone = change("bpic2012", None, (0.01, 0.0, 0.02))
    combined, kept = over_seeds([*three, alone])
    assert kept == alone | {"seeds": 1}
    assert combined["seeds"] == 3 and combined["seed"] is None
    mean, low, high = combined["auc"]
    assert mean == pytest.approx(0.0)
    mean_square_half = (0.01**2 + 0.02**2 + 0.03**2) / 3
    variance_of_mean = 0.03**2 * 2 / 2 / 3  # values 0.03, 0, -0.03: sample variance 9e-4
    quantile = student_t.ppf(0.975, 2)
    assert high - mean == pytest.approx(
        math.sqrt(mean_square_half + quantile**2 * variance_of_mean)
    )
    assert mean - low == pytest.approx(high - mean)
    assert combined["attention"] == pytest.approx((0.0, -0.1, 0.1))

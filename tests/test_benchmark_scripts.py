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
def test_default_suite_runs_each_variant_on_a_committed_sample() -> None:
    out = run_script("benchmarks/suite.py", "--logs", "ga4_sample", "--no-record")
    rows = [line for line in out.splitlines() if line.startswith("| ga4_sample |")]
    from benchmarks.suite import VARIANTS

    assert [row.split(" | ")[1] for row in rows] == list(VARIANTS)
    # The deletion test ran on each: top and random logit drops.
    assert all(re.search(r"\| -?\d+\.\d+ / -?\d+\.\d+ \(", row) for row in rows)


def test_the_suite_decides_on_the_mean_over_seeds() -> None:
    """Two seeds of one candidate on one log: the change is their mean, and its interval
    adds their spread to their own width; a run without seeds keeps its change as it was."""
    import math

    from benchmarks.suite import over_seeds

    def change(seed: int | None, auc: tuple[float, float, float]) -> dict:
        return {"log": "taobao", "variant": "floor600", "seed": seed, "tells": True,
                "auc": auc, "attention": (0.0, -0.1, 0.1)}  # fmt: skip

    (alone,) = over_seeds([change(None, (0.01, 0.0, 0.02))])
    assert alone["auc"] == pytest.approx((0.01, 0.0, 0.02))
    (both,) = over_seeds([change(0, (0.01, 0.0, 0.02)), change(1, (-0.01, -0.02, 0.0))])
    mean, low, high = both["auc"]
    assert mean == pytest.approx(0.0)
    # each seed's half-width 0.01; the two values' variance of the mean 1e-4
    assert high - mean == pytest.approx(math.sqrt(0.01**2 + 1.96**2 * 1e-4))
    assert mean - low == pytest.approx(high - mean)
    assert both["attention"] == pytest.approx((0.0, -0.1, 0.1))

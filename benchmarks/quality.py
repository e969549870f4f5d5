"""How good is the transformer? Test metrics against the baselines and the true model.

On a simulated log (`journeys.simulate`, whose ground truth gives every journey its true
conversion probability), the product runs as a user would: `ingest`, then `train` (the
transformer and every baseline, tracked in a private MLflow store) once per seed. The
"oracle" row scores the same test journeys with the simulator's true probabilities: the
best any model can do on this data. The "logreg on the true features" row is a logistic
regression on exactly the features the simulator's true model uses, fitted on the train
split: the best a model can do with this much data if it knew what to look for. Printed:
mean +- std over seeds of every test metric, then the same ROC AUCs in expectation over the
labels (`expected_roc_auc`): the realised test AUC carries the noise of one draw of ~900
positives (about +-0.003 on a gap to the oracle), which the expectation does not.

Usage::

    .venv/bin/python benchmarks/quality.py                     # 400k users (674k journeys), seeds 0 1 2
    .venv/bin/python benchmarks/quality.py --users 100000      # the size used until 2026-12-02
    .venv/bin/python benchmarks/quality.py --quick             # 3k users, one seed, 10 epochs
    .venv/bin/python benchmarks/quality.py --config conf/gpu.yaml --set train.devices=1

Everything is written under `data/bench/quality/` (log, journeys, checkpoints, mlflow.db);
`--workdir DIR` puts all but the simulated log (cached per size and seed) in DIR instead, so
that two runs can share the machine.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BENCH = ROOT / "data" / "bench" / "quality"
# At 100k users the gap to the oracle is mostly a lack of converted journeys (it shrinks
# with data: RESULTS.md); 400k users is a small AdTech log and trains in minutes.
LARGE_USERS = 400_000
METRICS = ("roc_auc", "pr_auc", "log_loss", "brier", "ece")


def simulated_log(users: int, sim_seed: int) -> Path:
    """The simulated log of `users` users, made once per size and seed (a cache that
    `benchmarks/suite.py` shares)."""
    from journeys.simulate import simulate

    raw = BENCH / f"events-{users}-{sim_seed}"
    if not (raw / "_truth" / "summary.json").exists():  # written last: a whole log
        simulate(raw, users=users, seed=sim_seed)
    return raw


def prepare(users: int, sim_seed: int, config_path: str, overrides: list[str], work: Path):
    """Simulate (cached per size and seed) and ingest into `work`; return the config and
    truth folder."""
    from journeys.config import load_config
    from journeys.ingest import run_ingest

    raw = simulated_log(users, sim_seed)
    uri = f"sqlite:///{work / 'mlflow.db'}"
    config = load_config(
        config_path,
        [
            f"paths.raw={raw}",
            f"paths.journeys={work / 'journeys'}",
            f"paths.quarantine={work / 'quarantine'}",
            f"paths.checkpoints={work / 'checkpoints'}",
            f"mlflow.tracking_uri={uri}",
            "mlflow.experiment=journeys-quality",
            "mlflow.registered_model=journey-conversion-quality",
            # The simulator's price drives conversion (TrueModel.price_premium): read it.
            "data.numeric_features=[price]",
            *overrides,
        ],
    )
    run_ingest(config)
    return config, raw / "_truth"


@dataclass
class TestTruth:
    """The uncensored test journeys with the simulator's truth, loaded once per benchmark."""

    journeys: Any  # pl.DataFrame in the ingest schema, plus `true_probability`
    design: np.ndarray  # [n, k] the true model's features (`true_effects`)
    names: list[str]

    @classmethod
    def load(cls, config, truth: Path) -> TestTruth:
        import polars as pl

        from journeys.datasets import scan_journeys

        test = (
            scan_journeys(config.paths.journeys)
            .filter((pl.col("split") == "test") & ~pl.col("censored"))
            .collect()
            .join(
                pl.read_parquet(truth / "journeys.parquet").select(
                    "journey_id", "true_probability"
                ),
                on="journey_id",
                how="inner",
                maintain_order="left",
            )
        )
        design, names = true_effects(truth, test.get_column("journey_id"))
        return cls(test, design, names)

    @property
    def labels(self) -> np.ndarray:
        return self.journeys.get_column("label").to_numpy()

    @property
    def true_probability(self) -> np.ndarray:
        return self.journeys.get_column("true_probability").to_numpy()


def oracle_metrics(test: TestTruth) -> dict[str, float]:
    """The simulator's true probabilities on the test split: the ceiling for every model."""
    from journeys.metrics import binary_metrics

    return binary_metrics(test.labels, test.true_probability)


def true_effects(truth: Path, journey_ids) -> tuple[np.ndarray, list[str]]:
    """The simulator's true-model features (`TrueModel`) of the given journeys, as the
    simulator wrote them with its truth: design matrix [n, k] (with a constant) and the
    feature names. The first touch is relative to `direct`, as the constant stands for it."""
    import polars as pl

    effects = pl.read_parquet(truth / "journeys.parquet").select(
        "journey_id", pl.selectors.starts_with("effect_") - pl.selectors.ends_with("_direct")
    )
    features = pl.DataFrame({"journey_id": journey_ids}).join(
        effects, on="journey_id", how="left", maintain_order="left"
    )
    names = [c.removeprefix("effect_") for c in features.columns[1:]]
    design = features.drop("journey_id").cast(pl.Float64).to_numpy()
    return np.column_stack([design, np.ones(len(journey_ids))]), [*names, "intercept"]


def expected_roc_auc(scores: np.ndarray, true_probability: np.ndarray) -> float:
    """ROC AUC in expectation over the labels the simulator could have drawn.

    Each journey counts as a positive with weight p and as a negative with weight 1 - p (p
    its true probability): the chance that a converting journey outscores a non-converting
    one, for these journeys, without the noise of the one draw of labels the test set has.
    """
    from sklearn.metrics import roc_auc_score

    p = np.asarray(true_probability, dtype=np.float64)
    labels = np.r_[np.ones(len(p)), np.zeros(len(p))]
    return float(roc_auc_score(labels, np.r_[scores, scores], sample_weight=np.r_[p, 1 - p]))


def true_feature_ceiling(config, truth: Path, test: TestTruth) -> np.ndarray:
    """Test probabilities of a logistic regression on the simulator's true features,
    fitted on the train split.

    What a model that knew exactly which features matter would reach with this much
    data: the gap between it and the oracle is the data's share of the transformer's gap.
    """
    import polars as pl
    from sklearn.linear_model import LogisticRegression

    from journeys.datasets import scan_journeys

    train = (
        scan_journeys(config.paths.journeys)
        .filter((pl.col("split") == "train") & ~pl.col("censored"))
        .select("journey_id", "label")
        .collect()
    )
    design, _ = true_effects(truth, train.get_column("journey_id"))
    # Nearly unpenalised (C large): 11 coefficients from 100k+ journeys need no shrinkage.
    # The design's last column is the constant; LogisticRegression fits its own intercept.
    fit = LogisticRegression(C=1e4, max_iter=5_000)
    fit.fit(design[:, :-1], train.get_column("label").to_numpy())
    return fit.predict_proba(test.design[:, :-1])[:, 1]


def model_logits(config, run_id: str, test: TestTruth) -> np.ndarray:
    """The logged model's logits on the test journeys, loaded as `journeys score` loads it."""
    import mlflow

    from journeys.tracking import tracking_uri
    from journeys.trained_model import load_model

    mlflow.set_tracking_uri(tracking_uri(config))
    return load_model(f"runs:/{run_id}/model").predict_logits(test.journeys)


def run_seconds(config, run_id: str) -> float:
    """Wall time of one MLflow run: for the transformer, fit, evaluation and model logging
    (the baselines that `journeys train` runs afterwards are runs of their own)."""
    from mlflow import MlflowClient

    from journeys.tracking import tracking_uri

    info = MlflowClient(tracking_uri=tracking_uri(config)).get_run(run_id).info
    return (info.end_time - info.start_time) / 1000


def effect_recovery(test: TestTruth, model_logit: np.ndarray) -> list[tuple[str, float, float]]:
    """Least-squares fit of the true logit and of the model's logit on the true features.

    A coefficient of the model's fit near the truth's means the model learned that
    effect; one near 0 means it missed it. Returns (feature, truth, model) rows.
    """
    probability = test.true_probability
    fits = [
        np.linalg.lstsq(test.design, target, rcond=None)[0]
        for target in (np.log(probability / (1 - probability)), model_logit)
    ]
    return [(n, float(t), float(m)) for n, t, m in zip(test.names, *fits, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "conf" / "default.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--users", type=int, default=LARGE_USERS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sim-seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=BENCH, help="journeys, runs, results")
    parser.add_argument("--quick", action="store_true", help="3k users, one seed, 10 epochs")
    parser.add_argument(
        "--effects",
        action="store_true",
        help="also fit each seed's test logits on the true model's features (effect recovery)",
    )
    args = parser.parse_args()
    if args.quick:
        args.users, args.seeds = 3_000, args.seeds[:1]
        # ~16 steps an epoch at 3k users: a short warm-up, or training never leaves it.
        args.overrides = ["train.max_epochs=10", "train.warmup_steps=30", *args.overrides]

    from journeys.metrics import binary_metrics
    from journeys.promotion import baseline_kind
    from journeys.train import train_command

    config, truth = prepare(args.users, args.sim_seed, args.config, args.overrides, args.workdir)
    rows: dict[str, list[dict[str, float]]] = {"oracle (true probability)": []}
    test = TestTruth.load(config, truth)
    oracle = oracle_metrics(test)
    ceiling_probability = true_feature_ceiling(config, truth, test)
    ceiling = binary_metrics(test.labels, ceiling_probability)
    expected = {
        "oracle (true probability)": [
            expected_roc_auc(test.true_probability, test.true_probability)
        ],
        "logreg on the true features": [
            expected_roc_auc(ceiling_probability, test.true_probability)
        ],
        "transformer": [],
    }
    timing: dict[str, list[float]] = {}
    effects: list[dict[str, list[float]]] = []  # per seed: feature -> [truth, transformer]
    for seed in args.seeds:
        seeded = config.model_copy(update={"train": config.train.model_copy(update={"seed": seed})})
        start = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # one table at the end, not per seed
            result = train_command(seeded)
        command_s = time.perf_counter() - start
        transformer_s = run_seconds(config, result.run_id)
        print(
            f"seed {seed}: `journeys train` took {command_s:.0f} s, of which the transformer "
            f"run (fit, evaluation, model logging) {transformer_s:.0f} s (run {result.run_id})"
        )
        timing.setdefault("train_command_s", []).append(command_s)
        timing.setdefault("transformer_run_s", []).append(transformer_s)
        rows["oracle (true probability)"].append(oracle)
        rows.setdefault("logreg on the true features", []).append(ceiling)
        rows.setdefault("transformer", []).append(result.metrics)
        calibrated = {f"test_{m}": result.metrics[f"test_{m}_calibrated"] for m in METRICS}
        rows.setdefault("transformer (calibrated)", []).append(calibrated)
        for name, baseline in result.baselines.items():
            rows.setdefault(baseline_kind(name), []).append(baseline.metrics)
        logits = model_logits(config, result.run_id, test)
        expected["transformer"].append(expected_roc_auc(logits, test.true_probability))
        gap = expected["oracle (true probability)"][0] - expected["transformer"][-1]
        print(
            f"seed {seed}: expected test ROC AUC {expected['transformer'][-1]:.4f}, gap {gap:.4f}"
        )
        if args.effects:
            recovered = effect_recovery(test, logits)
            print(f"seed {seed}: effect recovery (coefficient on the true features, test set)")
            for name, true, learned in recovered:
                share = f"{learned / true:6.0%}" if abs(true) > 1e-9 else ""
                print(f"  {name:<26} truth {true:+6.2f}  transformer {learned:+6.2f}  {share}")
            effects.append({name: [true, learned] for name, true, learned in recovered})

    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Test metrics, {args.users:,} users, seeds {args.seeds} (mean +- std)")
    table.add_column("model")
    for name in METRICS:
        table.add_column(name, justify="right")
    summary = {}
    for model, runs in rows.items():
        values = {m: np.array([r[f"test_{m}"] for r in runs]) for m in METRICS}
        summary[model] = {m: [float(v.mean()), float(v.std())] for m, v in values.items()}
        table.add_row(model, *(f"{v.mean():.4f} +- {v.std():.4f}" for v in values.values()))
    Console(width=140).print(table)
    ceiling_auc = expected["oracle (true probability)"][0]
    table = Table(title="Test ROC AUC in expectation over the labels (mean +- std)")
    for name in ("model", "expected roc_auc", "gap to the oracle"):
        table.add_column(name, justify="left" if name == "model" else "right")
    for model, values in expected.items():
        auc = np.array(values)
        table.add_row(
            model, f"{auc.mean():.4f} +- {auc.std():.4f}", f"{ceiling_auc - auc.mean():.4f}"
        )
        summary[model]["expected_roc_auc"] = [float(auc.mean()), float(auc.std())]
        summary[model]["expected_roc_auc_by_seed"] = [float(a) for a in auc]
    Console(width=140).print(table)
    summary["seconds"] = timing
    if effects:
        summary["effects"] = effects
    (args.workdir / "results.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

"""How well are open journeys scored? A replay: the log cut at a moment, held against what
the users did after it.

1. Simulate the default log (`journeys.simulate`: 20,000 users over 90 days).
2. Cut it at `--cut-day` (day 75 of 90): the rows with a timestamp up to the cut are what
   was known then. Ingest them, and train on them the way a user would (`journeys train`,
   no baselines), once per objective: the default configuration (`train.objective:
   journey`) and a causal model trained at every prefix (`every_prefix`).
3. Score the journeys as of the cut (`journeys score --as-of`), and keep the open ones:
   not converted by the cut, last event within `journey.max_gap` of it.
4. Hold each open journey's score against the full log: did the user convert in this
   journey after the cut (the simulator's truth)?

Printed per objective: ROC AUC, PR AUC, ECE and the mean score against the realised rate,
for the product's in-flight probability (`journeys.in_flight`: the model's score and how
long the journey has been quiet) and for the model's score alone (what scoring gave open
journeys before: "had it ended now, would it have converted?"). A reliability plot and
every figure go to an MLflow run of their own (experiment `journeys-in-flight`).

Not measured: the simulator's own probability for an open journey. Its truth is the
probability of the whole journey, drawn at once; the chance of converting given a prefix
would need continuations sampled from the simulator, which draws journeys whole.

Usage::

    .venv/bin/python benchmarks/in_flight.py             # the default simulator size
    .venv/bin/python benchmarks/in_flight.py --quick     # 3k users, 3 epochs: a smoke run
    .venv/bin/python benchmarks/in_flight.py --record    # also rewrite its RESULTS.md section
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
BENCH = ROOT / "data" / "bench" / "in_flight"
OBJECTIVES = {
    "journey (default)": [],
    "every_prefix": ["model.causal=true", "train.objective=every_prefix"],
}
ECE_TARGET = 0.02
# Quiet-time buckets (seconds since the open journey's last event) for observed against
# expected conversions: calibration relative to the base rate, which an ECE of a rare
# outcome hides (0.0006 looked fine where 83% of open journeys scored exactly 0).
QUIET_BUCKETS = (("under 1h", 0, 3600), ("1h-1d", 3600, 86400), ("over 1d", 86400, np.inf))
Z_99 = 2.576  # the interval of observed conversions a bucket is held to


def by_quiet_time(
    outcome: np.ndarray, probability: np.ndarray, quiet_seconds: np.ndarray
) -> list[dict[str, float | str]]:
    """Per quiet-time bucket: open journeys, conversions observed and expected (the sum of
    the probabilities) with the 99% interval of observed around expected (a sum of
    independent Bernoulli draws), and the smallest probability given."""
    rows = []
    for name, low, high in QUIET_BUCKETS:
        inside = (quiet_seconds >= low) & (quiet_seconds < high)
        p = probability[inside]
        expected = float(p.sum())
        half = Z_99 * float(np.sqrt((p * (1 - p)).sum()))
        rows.append(
            {
                "bucket": name,
                "journeys": float(inside.sum()),
                "observed": float(outcome[inside].sum()),
                "expected": expected,
                "low": expected - half,
                "high": expected + half,
                "smallest": float(p.min()) if p.size else float("nan"),
            }
        )
    return rows


def cut_log(full: Path, cut: datetime, out: Path) -> int:
    """Write the rows of the simulated CSV with a timestamp up to `cut`; return their count."""
    import polars as pl

    from journeys.simulate import TIMESTAMP_FORMAT

    out.mkdir(parents=True, exist_ok=True)
    known = pl.read_csv(full / "events.csv", infer_schema=False).filter(
        pl.col("timestamp").str.strptime(pl.Datetime("ms", "UTC"), TIMESTAMP_FORMAT) <= cut
    )
    known.write_csv(out / "events.csv")
    return known.height


def replay(
    args: argparse.Namespace,
) -> tuple[dict[str, dict[str, float]], dict[str, list[dict[str, float | str]]]]:
    """Simulate, cut, ingest, train and score per objective; metrics of the open journeys."""
    import polars as pl

    from journeys.config import load_config
    from journeys.ingest import run_ingest
    from journeys.metrics import binary_metrics
    from journeys.score import score_command
    from journeys.simulate import simulate
    from journeys.train import train_command
    from journeys.trained_model import load_model

    work = args.workdir
    start = datetime(2026, 1, 1, tzinfo=UTC)
    cut = start + timedelta(days=args.cut_day)
    full = work / "full"
    simulate(full, users=args.users, seed=args.seed, start=start, days=args.days)
    known_rows = cut_log(full, cut, work / "known")
    truth = pl.read_parquet(full / "_truth" / "journeys.parquet").select(
        "journey_id", "converted", "end_time"
    )
    uri = f"sqlite:///{work / 'mlflow.db'}"
    base = [
        f"paths.raw={work / 'known'}",
        f"paths.journeys={work / 'journeys'}",
        f"paths.quarantine={work / 'quarantine'}",
        f"mlflow.tracking_uri={uri}",
        "mlflow.experiment=journeys-in-flight",
        "mlflow.registered_model=journey-conversion-in-flight",
        "train.baselines=[]",
        *args.overrides,
    ]
    run_ingest(load_config(None, base))
    print(f"cut at {cut:%Y-%m-%d %H:%M} UTC: {known_rows:,} rows known then")

    results: dict[str, dict[str, float]] = {}
    curves: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    buckets: dict[str, list[dict[str, float | str]]] = {}
    for name, settings in OBJECTIVES.items():
        slug = name.split()[0]
        config = load_config(None, [*base, *settings, f"paths.checkpoints={work / slug}"])
        with contextlib.redirect_stdout(io.StringIO()):
            trained = train_command(config)
            out = work / f"scores-{slug}"
            score_command(
                config,
                model_uri=trained.model_uri,
                input_path=work / "journeys",
                out=out,
                as_of=cut,
            )
        scores = (
            pl.read_parquet(out / "*.parquet")
            .filter("open")
            .join(truth, on="journey_id", how="left")
        )
        if scores["converted"].null_count():
            raise RuntimeError("an open journey is not in the simulator's truth")
        # Every open journey was unconverted at the cut: a conversion in the truth came after.
        outcome = scores["converted"].cast(pl.Int8).to_numpy()
        in_flight = scores["conversion_probability"].to_numpy()
        buckets[name] = by_quiet_time(outcome, in_flight, scores["quiet_seconds"].to_numpy())
        loaded = load_model(trained.model_uri, tracking_uri=uri)
        open_journeys = (
            pl.read_parquet(work / "journeys" / "*.parquet")
            .join(scores.select("journey_id").with_row_index("order"), on="journey_id")
            .sort("order")
        )
        ended_now = loaded.predict_proba(open_journeys)
        for kind, probability in (("in-flight", in_flight), ("score alone", ended_now)):
            metrics = binary_metrics(outcome, probability, prefix="", intervals=True)
            metrics |= {
                "mean_probability": float(probability.mean()),
                "conversion_rate": float(outcome.mean()),
                "open_journeys": float(len(outcome)),
                "conversions": float(outcome.sum()),
                "test_roc_auc": trained.metrics["test_roc_auc"],
            }
            results[f"{name}, {kind}"] = metrics
            curves[f"{slug}, {kind}"] = (outcome, probability)
    log_run(results, curves, uri, args, cut)
    return results, buckets


def bucket_table(buckets: dict[str, list[dict[str, float | str]]]) -> str:
    header = (
        "| objective | quiet for | open journeys | observed | expected [99%] | smallest "
        "probability |\n|---|---|---|---|---|---|"
    )
    rows = [
        f"| {name} | {b['bucket']} | {b['journeys']:,.0f} | {b['observed']:.0f} "
        f"| {b['expected']:.1f} [{b['low']:.1f}, {b['high']:.1f}] | {b['smallest']:.2e} |"
        for name, rows_ in buckets.items()
        for b in rows_
    ]
    return "\n".join([header, *rows])


def log_run(results, curves, uri: str, args: argparse.Namespace, cut: datetime) -> None:
    """The replay as an MLflow run of its own: settings, every figure, a reliability plot.
    (A client, not the fluent API: nothing global is left set for whoever runs next.)"""
    import tempfile

    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    from journeys.plots import plot_calibration
    from journeys.tracking import get_experiment_id

    client = MlflowClient(tracking_uri=uri)
    run = client.create_run(
        get_experiment_id(uri, "journeys-in-flight"),
        run_name="replay",
        tags={"benchmark": "in_flight"},
    )
    params = {"users": args.users, "seed": args.seed, "cut": cut.isoformat(), "days": args.days}
    now = int(datetime.now(UTC).timestamp() * 1000)
    metrics = []
    for name, values in results.items():
        key = name.replace(" (default)", "").replace(", ", ".").replace(" ", "_")
        metrics += [Metric(f"{key}.{m}", v, now, 0) for m, v in values.items() if np.isfinite(v)]
    client.log_batch(
        run.info.run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in params.items()]
    )
    with tempfile.TemporaryDirectory() as tmp:
        outcome = next(iter(curves.values()))[0]
        path = plot_calibration(
            outcome, {k: p for k, (_, p) in curves.items()}, Path(tmp) / "reliability.png"
        )
        client.log_artifact(run.info.run_id, str(path))
    client.set_terminated(run.info.run_id)


def table(results: dict[str, dict[str, float]]) -> str:
    header = (
        "| objective, probability | ROC AUC [95% CI] | PR AUC | ECE | mean score | "
        "realised rate |\n|---|---|---|---|---|---|"
    )
    rows = [
        f"| {name} | {m['roc_auc']:.3f} [{m['roc_auc_ci_low']:.3f}, {m['roc_auc_ci_high']:.3f}] "
        f"| {m['pr_auc']:.3f} | {m['ece']:.4f} | {m['mean_probability']:.4f} | "
        f"{m['conversion_rate']:.4f} |"
        for name, m in results.items()
    ]
    return "\n".join([header, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=20_000)
    parser.add_argument("--days", type=int, default=90)
    parser.add_argument("--cut-day", type=float, default=75.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=BENCH)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--quick", action="store_true", help="3k users, 3 epochs: a smoke run")
    parser.add_argument("--record", action="store_true", help="rewrite the RESULTS.md section")
    args = parser.parse_args()
    if args.quick:
        args.users = 3_000
        args.overrides = [
            "train.max_epochs=3", "train.min_steps=0", "train.warmup_steps=10",
            "model.d_model=16", "model.n_heads=2", "model.n_layers=1", *args.overrides,
        ]  # fmt: skip

    import shutil

    shutil.rmtree(args.workdir, ignore_errors=True)
    results, buckets = replay(args)
    text = table(results) + "\n\nObserved against expected conversions by quiet time:\n\n"
    text += bucket_table(buckets)
    first = next(iter(results.values()))
    summary = (
        f"{int(first['open_journeys']):,} journeys open at the cut, "
        f"{int(first['conversions']):,} of them converted afterwards."
    )
    print(summary)
    print(text)
    prefix = results["every_prefix, in-flight"]
    default = results["journey (default), in-flight"]
    print(
        f"every_prefix in-flight: ECE {prefix['ece']:.4f} (target <= {ECE_TARGET}), ROC AUC "
        f"{prefix['roc_auc'] - default['roc_auc']:+.4f} against the default objective's"
    )
    if first["conversions"] < 100:
        print(
            f"only {int(first['conversions'])} conversions among the open journeys: the AUCs "
            "are noisy (see the intervals)"
        )
    if args.record:
        from benchmarks.recording import machine, record_section

        record_section(
            f"## In-flight replay ({datetime.now(UTC):%Y-%m-%d}, {machine()})\n\n"
            f"`.venv/bin/python benchmarks/in_flight.py {' '.join(sys.argv[1:])}` ({args.users:,} users, "
            f"cut at day {args.cut_day:g} of {args.days}). {summary}\n\n{text}\n"
        )


if __name__ == "__main__":
    main()

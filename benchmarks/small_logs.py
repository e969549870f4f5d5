"""Small logs: does the transformer learn from a few hundred conversions, and how many
optimiser steps does it make?

For each size and simulation seed this simulates a log (`journeys simulate`), ingests it
with the defaults, trains each variant (`--set` overrides on the defaults) and scores the
test split in expectation over the labels (the simulator knows each journey's true
probability: `benchmarks/quality.expected_roc_auc`), which a test split of a dozen
conversions could not measure by its one draw of labels. Printed per size and variant,
averaged over seeds: the transformer's expected test ROC AUC, the best baseline's, the gap
between them, and the optimiser steps the transformer made.

    python benchmarks/small_logs.py --users 1500 --seeds 0 1 2 3 4
    python benchmarks/small_logs.py --users 180 1500 --variant floor600 train.step_floor=600
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.quality import expected_roc_auc  # noqa: E402
from benchmarks.recording import machine, record_section  # noqa: E402

WORK = ROOT / "data" / "bench" / "small_logs"


def run(users: int, seed: int, variants: dict[str, list[str]]) -> list[dict]:
    """Simulate, ingest and train each variant; one row per variant."""
    import polars as pl

    from journeys.config import load_config
    from journeys.errors import JourneysError, first_line
    from journeys.ingest import run_ingest
    from journeys.simulate import simulate
    from journeys.train import train_command

    work = WORK / f"{users}-{seed}"
    shutil.rmtree(work, ignore_errors=True)
    raw = work / "raw"
    simulate(raw, users=users, seed=seed)
    truth = pl.read_parquet(raw / "_truth" / "journeys.parquet").select(
        "journey_id", "true_probability"
    )
    rows = []
    for variant, overrides in variants.items():
        config = load_config(
            None,
            [
                f"paths.raw={raw}",
                f"paths.journeys={work / 'journeys'}",
                f"paths.quarantine={work / 'quarantine'}",
                f"paths.checkpoints={work / variant / 'checkpoints'}",
                f"mlflow.tracking_uri=sqlite:///{work / variant / 'mlflow.db'}",
                *overrides,
            ],
        )
        started = time.perf_counter()
        row = {"users": users, "seed": seed, "variant": variant}
        try:
            with (
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                run_ingest(config)
                result = train_command(config)
        except JourneysError as err:
            rows.append(row | {"outcome": first_line(err)})
            continue
        test = result.test_predictions.join(
            truth, on="journey_id", how="left", maintain_order="left"
        )
        p = test.get_column("true_probability").to_numpy()
        baselines = {
            name: expected_roc_auc(run.test_scores, p) for name, run in result.baselines.items()
        }
        best = max(baselines, key=lambda name: baselines[name])
        rows.append(
            row
            | {
                "transformer": expected_roc_auc(test.get_column("probability").to_numpy(), p),
                "oracle": expected_roc_auc(p, p),
                "best_baseline": best,
                "best_baseline_auc": baselines[best],
                "steps": result.metrics["optimizer_steps"],
                "seconds": time.perf_counter() - started,
            }
        )
    return rows


def markdown(rows: list[dict], command: str, seconds: float) -> str:
    from datetime import date

    import polars as pl

    done = pl.DataFrame([r for r in rows if "outcome" not in r])
    summary = (
        done.group_by("users", "variant", maintain_order=True)
        .agg(
            seeds=pl.len(),
            transformer=pl.col("transformer").mean(),
            best_baseline=pl.col("best_baseline_auc").mean(),
            gap=(pl.col("best_baseline_auc") - pl.col("transformer")).mean(),
            gap_sd=(pl.col("best_baseline_auc") - pl.col("transformer")).std(),
            oracle=pl.col("oracle").mean(),
            steps=pl.col("steps").mean(),
            which=pl.col("best_baseline").mode().first(),
        )
        .sort("users", maintain_order=True)
    )
    lines = [
        f"## Small logs ({date.today().isoformat()})",
        "",
        f"`{command}` ({seconds / 60:.0f} min). {machine()}.",
        "",
        "The simulator at a few sizes, each over several seeds; test ROC AUC in expectation "
        "over the labels (the true probabilities weigh each journey as a positive and a "
        "negative). Gap: the best baseline's less the transformer's (mean and spread over "
        "seeds).",
        "",
        "| users | variant | seeds | transformer | best baseline (commonest) | gap (sd) | oracle | optimiser steps |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in summary.iter_rows(named=True):
        lines.append(
            f"| {r['users']:,} | {r['variant']} | {r['seeds']} | {r['transformer']:.4f} "
            f"| {r['best_baseline']:.4f} ({r['which']}) | {r['gap']:+.4f} ({r['gap_sd']:.4f}) "
            f"| {r['oracle']:.4f} | {r['steps']:.0f} |"
        )
    failed = [r for r in rows if "outcome" in r]
    lines += [
        f"- {r['users']} users, seed {r['seed']}, {r['variant']}: {r['outcome']}" for r in failed
    ]
    return "\n".join([*lines, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, nargs="+", default=[1500])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument(
        "--variant", nargs="+", action="append", metavar=("NAME", "KEY=VALUE"),
        help="a variant: its name, then --set overrides (repeatable); default: the defaults",
    )  # fmt: skip
    parser.add_argument("--no-record", action="store_true", help="print, do not touch RESULTS")
    args = parser.parse_args()
    variants = {v[0]: v[1:] for v in args.variant} if args.variant else {"defaults": []}
    started = time.perf_counter()
    rows = []
    for users in args.users:
        for seed in args.seeds:
            rows += run(users, seed, variants)
            print(rows[-len(variants) :], flush=True)
    command = "python benchmarks/small_logs.py " + " ".join(sys.argv[1:])
    text = markdown(rows, command.strip(), time.perf_counter() - started)
    print(text)
    if not args.no_record:
        record_section(text)


if __name__ == "__main__":
    main()

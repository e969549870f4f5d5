"""Does the exported attention point at the events that truly caused conversions?

Measured against the simulator's ground truth (`_truth/events.parquet` flags every event
that raised its journey's true log-odds as `causal`), for three per-event attributions:
pooled attention (the product's default export), attention rollout, and integrated
gradients (zero/padding baseline, `journeys.attribution.integrated_gradients`).

1. Attention lift on causal events: over journeys with both causal and non-causal events,
   (mean attribution mass on causal events) / (mean share of causal events). 1 = no better
   than spreading weight uniformly; the aim is > 2. Also: how often the top-weighted event
   is causal, next to the causal share (what a random pick would give).
2. Deletion test: on converting journeys with more than k events, delete the k events a
   method ranks highest (the events are removed from the sequence and the journey is
   re-encoded and re-scored) versus k random events; compare the mean drop in predicted
   conversion probability. The aim: top-k drop >= 2x random drop.

The model is trained with the product (`journeys ingest` + `journeys train`, in child
processes, on a simulated log) unless `--model URI` names one (with `--tracking-uri`
when it lives in MLflow). Evaluation runs on a *fresh* simulation (another seed), scored
through the product's raw-log path (ingested with the model's own preprocessing), so no
evaluated journey was seen in training.

Usage::

    .venv/bin/python benchmarks/faithfulness.py                   # train, then evaluate
    .venv/bin/python benchmarks/faithfulness.py --model models:/journey-conversion@champion \\
        --tracking-uri sqlite:///data/bench/faithfulness/mlflow.db
    .venv/bin/python benchmarks/faithfulness.py --quick           # small smoke run

Results are printed and appended to benchmarks/RESULTS.md (`--no-record` to skip).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.recording import machine, record_section  # noqa: E402

WORK = ROOT / "data" / "bench" / "faithfulness"
METHODS = ("pooled", "rollout", "integrated_gradients")
TRAIN_USERS = 40_000
EVAL_USERS = 10_000
TRAIN_SEED = 0
EVAL_SEED_OFFSET = 1_000  # the evaluation log uses seed + this: unseen journeys
KS = (1, 3)
SAMPLE = 2_000  # journeys evaluated (IG costs IG_STEPS forward+backward passes each)
RANDOM_REPEATS = 5  # random deletions averaged per journey
LIFT_TARGET, DELETION_TARGET = 2.0, 2.0
ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}


def journeys_cli(*args: str) -> None:
    """Run a `journeys` command in a child process (the product, as a user runs it)."""
    command = [sys.executable, "-m", "journeys.cli", *args]
    print("$", " ".join(command[2:]), flush=True)
    env = {**os.environ, **ENV}
    subprocess.run(command, check=True, cwd=ROOT, env=env)


def train_model(
    work: Path, users: int, seed: int, epochs: int, overrides: list[str]
) -> tuple[str, str]:
    """Simulate, ingest and train with the product; returns (model URI, tracking URI).

    A previous run's store and checkpoints are removed first: otherwise training would
    resume from the old checkpoint, and the champion alias (moved only on improvement)
    could still name the old model.
    """
    for stale in ("mlflow.db", "checkpoints", "train_journeys", "train_quarantine"):
        path = work / stale
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    tracking = f"sqlite:///{work / 'mlflow.db'}"
    settings = [
        f"paths.raw={work / 'train_raw'}",
        f"paths.journeys={work / 'train_journeys'}",
        f"paths.quarantine={work / 'train_quarantine'}",
        f"paths.checkpoints={work / 'checkpoints'}",
        f"mlflow.tracking_uri={tracking}",
        f"train.max_epochs={epochs}",
        "train.baselines=[]",
        *overrides,
    ]
    sets = [arg for s in settings for arg in ("--set", s)]
    journeys_cli(
        "simulate", "--out", str(work / "train_raw"), "--users", str(users), "--seed", str(seed)
    )
    journeys_cli("ingest", *sets)
    journeys_cli("train", *sets)
    return "models:/journey-conversion@champion", tracking


# --- per-event attributions -----------------------------------------------------------------


def attributions(loaded, frame: pl.DataFrame, batch_size: int = 512) -> pl.DataFrame:
    """Per-event weights of every method (lists aligned with the scored event lists)."""
    from journeys.attribution import integrated_gradients_frame
    from journeys.score import score_frame

    out = frame.select("journey_id")
    for mode in ("pooled", "rollout"):
        scored = score_frame(loaded, frame, attention=mode, batch_size=batch_size)
        out = out.with_columns(scored["attention"].alias(mode))
    started = time.perf_counter()
    ig = integrated_gradients_frame(loaded, frame)
    print(
        f"  integrated gradients on {frame.height:,} journeys: {time.perf_counter() - started:.1f} s"
    )
    return out.with_columns(ig.alias("integrated_gradients"))


def causal_flags(truth_events: Path, scores: pl.DataFrame) -> pl.DataFrame:
    """journey_id -> list of causal flags for the scored (last n) events of the journey."""
    truth = (
        pl.scan_parquet(truth_events)
        .join(scores.lazy().select("journey_id"), on="journey_id", how="semi")
        .sort("journey_id", "position")
        .group_by("journey_id", maintain_order=True)
        .agg(pl.col("causal"), pl.col("event_type").alias("truth_event_type"))
        .collect()
    )
    n = pl.col("event_type").list.len()
    return (
        scores.select("journey_id", "event_type")
        .join(truth, on="journey_id")
        .with_columns(pl.col("causal", "truth_event_type").list.tail(n))
        # Guard: the truth's events must be the scored events, in the same order.
        .filter(pl.col("truth_event_type") == pl.col("event_type"))
        .select("journey_id", "causal")
    )


def lift_table(weights: pl.DataFrame, causal: pl.DataFrame) -> pl.DataFrame:
    """Per method: causal lift (ratio of means) and top-1 hit rate vs the causal share."""
    from journeys.attribution import normalised_positive

    frame = weights.join(causal, on="journey_id")
    n = pl.col("causal").list.len()
    n_causal = pl.col("causal").list.sum()
    frame = frame.filter((n_causal > 0) & (n_causal < n)).with_columns(share=n_causal / n)
    rows = []
    for method in METHODS:
        if method == "integrated_gradients":  # signed: credit is its positive part
            part = normalised_positive(frame, method, "w")
        else:
            part = frame.with_columns(pl.col(method).alias("w"))
        exploded = part.select(
            "journey_id", "share", "w", "causal", idx=pl.int_ranges(pl.col("w").list.len())
        ).explode(["w", "causal", "idx"])
        per_journey = exploded.group_by("journey_id").agg(
            mass=(pl.col("w") * pl.col("causal").cast(pl.Float64)).sum(),
            share=pl.col("share").first(),
            # Top-weighted event (ties: the later event) is causal?
            top_causal=pl.col("causal").sort_by(["w", "idx"], descending=[True, True]).first(),
            # The first event carries the first-touch channel, but so does the rest of the
            # first visit: deleting it alone barely moves the prediction (deletion test).
            top_first=pl.col("idx").sort_by(["w", "idx"], descending=[True, True]).first() == 0,
        )
        stats = per_journey.select(
            journeys=pl.len(),
            causal_mass=pl.col("mass").mean(),
            causal_share=pl.col("share").mean(),
            top1_causal=pl.col("top_causal").cast(pl.Float64).mean(),
            top1_first=pl.col("top_first").cast(pl.Float64).mean(),
        ).row(0, named=True)
        rows.append(
            {
                "method": method,
                **stats,
                "lift": stats["causal_mass"] / stats["causal_share"],
            }
        )
    return pl.DataFrame(rows)


# --- deletion test --------------------------------------------------------------------------


LIST_COLUMNS_EXTRA = ("event_time",)


def delete_events(frame: pl.DataFrame, drop: pl.DataFrame, lists: list[str]) -> pl.DataFrame:
    """Remove the (journey_id, idx) events in `drop` from every list column of `frame`."""
    exploded = frame.select(
        "journey_id", *lists, idx=pl.int_ranges(pl.col("event_type").list.len())
    ).explode([*lists, "idx"])
    kept = exploded.join(drop, on=["journey_id", "idx"], how="anti").sort("journey_id", "idx")
    return kept.group_by("journey_id", maintain_order=True).agg(*lists)


def top_k(weights: pl.DataFrame, method: str, k: int) -> pl.DataFrame:
    """(journey_id, idx) of the k highest-weighted events per journey (ties: later first)."""
    return (
        weights.select("journey_id", w=pl.col(method), idx=pl.int_ranges(pl.col(method).list.len()))
        .explode(["w", "idx"])
        .sort(["journey_id", "w", "idx"], descending=[False, True, True])
        .group_by("journey_id", maintain_order=True)
        .head(k)
        .select("journey_id", "idx")
    )


def random_k(frame: pl.DataFrame, k: int, seed: int) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    lengths = frame["event_type"].list.len().to_numpy()
    weights = pl.Series(
        [rng.random(n) for n in lengths], dtype=pl.List(pl.Float64)
    )  # a short loop over a few thousand journeys, in the benchmark only
    return top_k(frame.select("journey_id").with_columns(r=weights), "r", k)


def deletion_table(
    loaded,
    frame: pl.DataFrame,
    weights: pl.DataFrame,
    ks: tuple[int, ...],
    methods: tuple[str, ...] = METHODS,
    on: str = "probability",
) -> pl.DataFrame:
    """Mean drop in the served probability (or, `on="logit"`, in the transformer's own
    logit) after deleting the top-k events vs k random events."""
    from journeys.score import score_frame

    lists = ["event_type", "event_time", *loaded.encoder.event_columns]

    def probability(journeys: pl.DataFrame) -> pl.DataFrame:
        rebuilt = journeys.join(frame.select("journey_id", "user_id"), on="journey_id")
        if on == "logit":
            logits = loaded.predict_logits(rebuilt, batch_size=512)
            return pl.DataFrame({"journey_id": rebuilt["journey_id"], "p": logits})
        scored = score_frame(loaded, rebuilt, attention=None, batch_size=512)
        return scored.select("journey_id", p="conversion_probability")

    base = probability(frame.select("journey_id", *lists)).rename({"p": "p0"})
    rows = []
    for k in ks:
        eligible = frame.filter(pl.col("event_type").list.len() > k)
        ids = eligible.select("journey_id")
        drops: dict[str, float] = {}
        for method in methods:
            chosen = top_k(weights.join(ids, on="journey_id"), method, k)
            after = probability(delete_events(eligible, chosen, lists))
            drops[method] = _mean_drop(base, after)
        random_drops = [
            _mean_drop(
                base, probability(delete_events(eligible, random_k(eligible, k, seed), lists))
            )
            for seed in range(RANDOM_REPEATS)
        ]
        random_drop = float(np.mean(random_drops))
        for method in methods:
            rows.append(
                {
                    "k": k,
                    "method": method,
                    "journeys": eligible.height,
                    "top_k_drop": drops[method],
                    "random_drop": random_drop,
                    "ratio": drops[method] / random_drop if random_drop else float("nan"),
                }
            )
    return pl.DataFrame(rows)


def _mean_drop(base: pl.DataFrame, after: pl.DataFrame) -> float:
    joined = base.join(after, on="journey_id")
    return float((joined["p0"] - joined["p"]).mean())


# --- driver -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    lift: pl.DataFrame
    deletion: pl.DataFrame
    details: dict


def evaluate(model_uri: str, tracking: str | None, work: Path, args: argparse.Namespace) -> Outcome:
    from journeys.config import load_config
    from journeys.score import score_input
    from journeys.simulate import simulate
    from journeys.trained_model import load_model

    loaded = load_model(model_uri, tracking_uri=tracking)
    eval_seed = args.seed + EVAL_SEED_OFFSET
    raw = work / f"eval_raw_{eval_seed}_{args.eval_users}"
    if not (raw / "_truth" / "events.parquet").exists():
        simulate(raw, users=args.eval_users, seed=eval_seed)
    config = load_config(None, [f"paths.scores={work / 'eval_scores'}"])
    started = time.perf_counter()
    scored, _ = score_input(
        loaded, config, raw, work / "eval_scores", attention="pooled", progress=False
    )
    print(
        f"scored {scored.rows:,} fresh journeys through the raw-log path in {time.perf_counter() - started:.1f} s"
    )

    scores = pl.read_parquet(work / "eval_scores" / "*.parquet")
    known = scores.filter(~pl.col("censored"))
    sample = known.sample(min(args.sample, known.height), seed=args.seed)
    converted = known.filter(pl.col("label") == 1)
    converted = converted.sample(min(args.sample, converted.height), seed=args.seed)
    frame = pl.concat([sample, converted]).unique("journey_id", keep="first", maintain_order=True)

    weights = attributions(loaded, frame)
    causal = causal_flags(raw / "_truth" / "events.parquet", frame)
    lift = pl.concat(
        [
            lift_table(
                weights.join(subset.select("journey_id"), on="journey_id"), causal
            ).with_columns(journeys_subset=pl.lit(name))
            for name, subset in (("uncensored", sample), ("converting", converted))
        ]
    )
    conv_frame = frame.join(converted.select("journey_id"), on="journey_id")
    deletion = deletion_table(loaded, conv_frame, weights, tuple(args.k))
    details = {
        "model": f"{loaded.model_uri} (version {loaded.model_version})",
        "model_config": {
            k: getattr(loaded.config, k)
            for k in ("d_model", "n_heads", "n_layers", "pooling", "causal")
        },
        "eval_journeys": scored.rows,
        "lift_sample": sample.height,
        "evaluated": frame.height,
        "matched_truth": causal.height,
        "converted_sample": converted.height,
    }
    return Outcome(lift, deletion, details)


def markdown(outcome: Outcome, command: str, seconds: float) -> str:
    lift = outcome.lift
    deletion = outcome.deletion
    lines = [
        "",
        f"## Attribution faithfulness ({datetime.now(UTC):%Y-%m-%d})",
        "",
        f"- Command: `{command}`",
        f"- Machine: {machine()}",
        f"- Model: {outcome.details['model']}, {outcome.details['model_config']}",
        f"- Evaluation: a fresh simulation ({outcome.details['eval_journeys']:,} journeys, unseen in "
        f"training), scored through `journeys score`'s raw-log path; a random sample of "
        f"{outcome.details['lift_sample']:,} uncensored journeys and {outcome.details['converted_sample']:,} "
        f"converting ones ({outcome.details['matched_truth']:,} of {outcome.details['evaluated']:,} "
        f"matched event by event to the truth); {seconds:.0f} s in all.",
        "",
        "Lift on causal events (target > 2): attribution mass on truly causal events / their share of events.",
        "",
        "Journeys with both causal and non-causal events; top-1: the highest-ranked event is causal "
        "(a random pick: the causal share).",
        "",
        "| journeys | method | n | causal mass | causal share | lift | top-1 event causal | top-1 is the first event |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in lift.iter_rows(named=True):
        lines.append(
            f"| {r['journeys_subset']} | {r['method']} | {r['journeys']:,} | {r['causal_mass']:.3f} | {r['causal_share']:.3f} | "
            f"**{r['lift']:.2f}** | {r['top1_causal']:.3f} | {r['top1_first']:.3f} |"
        )
    lines += [
        "",
        f"Deletion test (target: top-k drop >= 2x random drop): mean drop in predicted conversion "
        f"probability after removing the k highest-ranked events vs k random ones ({RANDOM_REPEATS} draws).",
        "",
        "| k | method | journeys | top-k drop | random drop | ratio |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for r in deletion.iter_rows(named=True):
        lines.append(
            f"| {r['k']} | {r['method']} | {r['journeys']:,} | {r['top_k_drop']:.4f} | "
            f"{r['random_drop']:.4f} | **{r['ratio']:.2f}** |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model URI; default: train one with the product")
    parser.add_argument("--tracking-uri", default=None, help="MLflow store of --model")
    parser.add_argument("--users", type=int, default=TRAIN_USERS, help="training users")
    parser.add_argument("--eval-users", type=int, default=EVAL_USERS)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=TRAIN_SEED)
    parser.add_argument("--sample", type=int, default=SAMPLE)
    parser.add_argument("--k", type=int, nargs="+", default=list(KS))
    parser.add_argument("--work", type=Path, default=WORK)
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], help="config override"
    )
    parser.add_argument(
        "--no-record", action="store_true", help="do not record the run in RESULTS.md"
    )
    args = parser.parse_args()
    if args.quick:
        args.users, args.eval_users, args.epochs, args.sample = 4_000, 2_000, 2, 300
    os.environ.update(ENV)
    args.work.mkdir(parents=True, exist_ok=True)

    started = time.perf_counter()
    model_uri, tracking = args.model, args.tracking_uri
    if model_uri is None:
        model_uri, tracking = train_model(
            args.work, args.users, args.seed, args.epochs, args.overrides
        )
    outcome = evaluate(model_uri, tracking, args.work, args)
    seconds = time.perf_counter() - started
    command = "python benchmarks/faithfulness.py " + " ".join(sys.argv[1:])
    text = markdown(outcome, command.strip(), seconds)
    print(text)
    if not args.no_record:
        record_section(text)


if __name__ == "__main__":
    main()

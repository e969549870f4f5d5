"""The suite a default is chosen on: every log here, the defaults before and after a change.

A default changes only when it is no worse on any log of the suite, for AUC and for
attribution alike. For each log (the simulator, the second generator with mechanics of
its own, the simulator at 400k users, BPIC 2012 when `../shared` has it, the committed
samples, and the public real logs of `benchmarks/public_logs.py` that were brought in; a
missing one is skipped and said) this ingests once with the log's configuration and
trains with each variant, then prints one table: split sizes, test ROC AUC with its
interval, the ROC AUC of a generator's true probability on the same test labels, the best
val ROC AUC, `hgb_aggregates` on the same test split, the champion decision, and the
attention deletion test (mean drop in the transformer's logit when each test journey
loses its most-attended event, against a random one: above 1 means attention finds what
matters).

    python benchmarks/suite.py                      # the defaults against each candidate
                                                    # (the 400k-user log: ~4 min a variant)
    python benchmarks/suite.py --logs bpic2012_sample ga4_sample
    python benchmarks/suite.py --logs taobao --variants defaults piecewise --seeds 0 1 2 3 4

With `--seeds`, every variant trains once per `train.seed` (the split stays the log's), each
seed's run is compared with the defaults' run of the same seed, and the verdict is on the
mean over seeds: on a log of a few thousand journeys the seed alone moves the transformer's
test ROC AUC by 0.01 or more (Taobao: 0.611-0.638 over five seeds), as much as most
candidates do.

Variants are `--set` overrides on top of the log's configuration (`VARIANTS`): the
defaults, and each candidate default.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.recording import machine, record_section  # noqa: E402
from benchmarks.second_generator import bayes_roc_auc, generate  # noqa: E402

WORK = ROOT / "data" / "bench" / "suite"
SIMULATED_USERS = 20_000  # the demo's log: `make run`
DELETION_SAMPLE = 1_000  # test journeys in the deletion test
# A log can tell two defaults apart with this many test conversions or more; the others
# are reported, never voted (docs/model.md, "How a default is chosen").
CAN_TELL = 100
# The defaults, and each candidate default as an override on top of them.
VARIANTS = {
    "defaults": [],
    "stack_off": ["train.stack=false"],  # the default before 2026-12-06
    "periodic": ["model.continuous_encoding=periodic"],
    "floor600": ["train.step_floor=600"],
    "periodic+floor600": ["model.continuous_encoding=periodic", "train.step_floor=600"],
    "wide": ["model.wide=true"],  # journey aggregates beside the sequence (Wide & Deep)
    # each continuous input's train-quantile bins beside the projection (PLE)
    "piecewise": ["model.continuous_encoding=piecewise"],
    "steps3000": ["train.min_steps=3000"],  # the default before 2026-12-07
    "so_far": ["model.journey_so_far=true"],  # journey-so-far counts and gaps on each event
    "so_far+piecewise": ["model.journey_so_far=true", "model.continuous_encoding=piecewise"],
    "search8": ["train.search.trials=8"],  # a search on val over the default space
    "search8_optim": [  # ... over the optimiser's settings alone, the architecture kept
        "train.search.trials=8",
        "train.search.space={train.lr: {low: 0.0005, high: 0.01, log: true}, "
        "train.weight_decay: {low: 0.01, high: 0.3, log: true}, model.dropout: {low: 0, high: 0.2}}",
    ],
}


def simulated(out: Path) -> Path:
    from journeys.simulate import simulate

    simulate(out, users=SIMULATED_USERS, seed=0)
    return out


def second_generator(out: Path) -> Path:
    return generate(out, users=SIMULATED_USERS, seed=0)


def simulated_large(_out: Path) -> Path:
    """The log of `benchmarks/quality.py` (its gap to Bayes), from that benchmark's cache."""
    from benchmarks.quality import LARGE_USERS, simulated_log

    return simulated_log(LARGE_USERS, 0)


@dataclass(frozen=True)
class Log:
    name: str
    config: str
    raw: Path | None  # None: made by `make` (into the work folder, or a cache of its own)
    note: str
    make: Callable[[Path], Path] | None = None  # writes raw events and their `_truth/`
    overrides: tuple[str, ...] = ()  # settings of the log on top of its configuration


LOGS = (
    Log("simulator", "conf/default.yaml", None, f"{SIMULATED_USERS:,} users, seed 0", simulated),
    Log("second_generator", "conf/default.yaml", None,
        f"other mechanics, {SIMULATED_USERS:,} users, seed 0", second_generator),
    # A large log, where negative sampling binds: the quality benchmark's, price read.
    Log("simulator_large", "conf/default.yaml", None,
        "400,000 users, seed 0, price as a number (benchmarks/quality.py's log)",
        simulated_large, ("data.numeric_features=[price]",)),
    Log("bpic2012", "conf/bpic2012.yaml", ROOT.parent / "shared/data/bpic2012/events.csv.gz",
        "the full log (../shared, optional)"),
    Log("bpic2012_sample", "conf/bpic2012.yaml", ROOT / "data/samples/bpic2012/events.csv.gz",
        "6% committed sample"),
    Log("ga4_sample", "conf/ga4.yaml", ROOT / "data/samples/ga4/events.jsonl", "committed sample"),
    Log("segment_sample", "conf/segment.yaml", ROOT / "data/samples/segment/events.jsonl",
        "committed sample"),
)  # fmt: skip


def public_logs() -> tuple[list[Log], list[str]]:
    """The public real logs of `benchmarks/public_logs.py` brought in, and the missing."""
    from benchmarks.public_logs import PUBLIC_LOGS

    found, missing = [], []
    for log in PUBLIC_LOGS:
        if log.raw_path().is_file():
            found.append(Log(log.name, log.config, log.raw_path(), log.note))
        else:
            missing.append(f"{log.name}: {log.raw} is not there (`{log.bring_in}`)")
    return found, missing


def run_log(log: Log, variants: dict[str, list[str]], seeds: list[int] | None = None) -> list[dict]:
    """Ingest `log` once, then train, evaluate and test attention with each variant (with
    `seeds`: once per `train.seed` each)."""
    from journeys.config import load_config
    from journeys.datasets import labelled, scan_journeys
    from journeys.errors import JourneysError, first_line
    from journeys.ingest import ingest
    from journeys.promotion import baseline_kind
    from journeys.tracking import tracking_uri, training_summary
    from journeys.train import train_command
    from journeys.trained_model import load_model

    work = WORK / log.name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    raw = log.raw
    if raw is None:
        assert log.make is not None, "a log without a raw path is made"
        raw = log.make(work / "raw")
    paths = [
        f"paths.raw={raw}",
        f"paths.journeys={work / 'journeys'}",
        f"paths.quarantine={work / 'quarantine'}",
        *log.overrides,
    ]
    rows = []
    with contextlib.redirect_stdout(io.StringIO()):
        ingest(load_config(ROOT / log.config, paths))
    runs = [(variant, overrides, seed) for variant, overrides in variants.items()
            for seed in (seeds or [None])]  # fmt: skip
    for variant, overrides, seed in runs:
        folder = work / (variant if seed is None else f"{variant}-seed{seed}")
        settings = [
            *paths,
            f"paths.checkpoints={folder / 'checkpoints'}",
            f"mlflow.tracking_uri=sqlite:///{folder / 'mlflow.db'}",
            *overrides,
            *([] if seed is None else [f"train.seed={seed}"]),
        ]
        config = load_config(ROOT / log.config, settings)
        row = {"log": log.name, "variant": variant, "seed": seed}
        started = time.perf_counter()
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                result = train_command(config)
        except JourneysError as err:
            rows.append(row | {"outcome": f"not trainable: {first_line(err)}"})
            continue
        metrics = result.metrics
        test = labelled(scan_journeys(config.paths.journeys), ("test",)).collect()
        truth = Path(raw) / "_truth"
        run_models = {"transformer": metrics["test_roc_auc"]}
        if "stacked_test_roc_auc" in metrics:
            run_models["stack"] = metrics["stacked_test_roc_auc"]
        run_models |= {
            baseline_kind(name): baseline.metrics["test_roc_auc"]
            for name, baseline in result.baselines.items()
        }
        best = max(run_models, key=lambda kind: run_models[kind])
        row |= {
            "bayes": bayes_roc_auc(test, truth) if truth.exists() else float("nan"),
            "seconds": time.perf_counter() - started,
            "n": f"{metrics['n_train']:.0f}/{metrics['n_val']:.0f}/{metrics['n_test']:.0f}",
            "conversions": int(test.get_column("label").sum()),
            "transformer": metrics["test_roc_auc"],
            "ci": (metrics["test_roc_auc_ci_low"], metrics["test_roc_auc_ci_high"]),
            "served_kind": result.model_kind,
            "served": metrics["served_test_roc_auc"],
            "best_kind": best,
            "best": run_models[best],
            "hgb_aggregates": run_models.get("baseline_hgb_aggregates", float("nan")),
            "champion": training_summary(
                tracking_uri(config), result.run_id, config.mlflow.registered_model
            )["champion_check"],
        }
        trained = load_model(result.model_uri, tracking_uri(config))
        ordered = test.sort("journey_id")
        by_journey = attention_deletion(trained, ordered)
        row |= {
            "test_labels": ordered.get_column("label").to_numpy(),
            "served_p": trained.predict_proba(ordered),
            "deletion_by_journey": by_journey,
            "deletion": (float(by_journey["top"].mean()), float(by_journey["random"].mean())),
        }
        rows.append(row)
    return rows


def attention_deletion(trained, test: pl.DataFrame) -> pl.DataFrame:
    """Per test journey (a sample of those with 2+ events): the drop in the transformer's
    logit when it loses its most-attended event (`top`) and, averaged over
    `RANDOM_REPEATS` draws, a random one (`random`). The attention is the transformer's,
    judged against its own logit, whatever candidate the registered model serves."""
    from benchmarks.faithfulness import RANDOM_REPEATS, delete_events, random_k, top_k
    from journeys.score import score_frame

    frame = test.filter(pl.col("event_type").list.len() > 1)
    if frame.height > DELETION_SAMPLE:
        frame = frame.sample(DELETION_SAMPLE, seed=0)
    if frame.height == 0:
        return pl.DataFrame(
            schema={"journey_id": pl.String, "top": pl.Float64, "random": pl.Float64}
        )
    scored = score_frame(trained, frame, attention="pooled")
    # score_frame cut the lists to the events the model read: delete among those.
    lists = ["event_type", "event_time", *trained.encoder.event_columns]
    cut = frame.select("journey_id", "user_id").with_columns(scored.select(lists).get_columns())

    def drops(deleted: pl.DataFrame) -> np.ndarray:
        after = deleted.join(cut.select("journey_id", "user_id"), on="journey_id")
        order = cut.select("journey_id").join(after, on="journey_id", maintain_order="left")
        return base - trained.predict_logits(order)

    base = trained.predict_logits(cut)
    weights = scored.select("journey_id", pooled="attention")
    top = drops(delete_events(cut, top_k(weights, "pooled", 1), lists))
    random = np.mean(
        [
            drops(delete_events(cut, random_k(cut, 1, seed), lists))
            for seed in range(RANDOM_REPEATS)
        ],
        axis=0,
    )
    return pl.DataFrame({"journey_id": cut["journey_id"], "top": top, "random": random})


def deletion_ratio(top: float, random: float) -> str:
    """Top-attended over random drop; where a random deletion raises the logit on average
    (a negative drop) while the top one lowers it, the ratio is unbounded: said so."""
    if math.isnan(top) or math.isnan(random):
        return ""
    if top <= 0:
        return "none: the top event raises it"
    if random <= 0:
        return "inf (random raises it)"
    return f"{top / random:.2f}x"


def against_defaults(rows: list[dict]) -> list[dict]:
    """Each variant's change from the defaults on the same log, with 95% paired intervals:
    the served test ROC AUC (DeLong, on the same test journeys) and attention's deletion
    effect (the per-journey top drop less the random drop, on the same journeys)."""
    from journeys.metrics import paired_roc_auc_difference

    out = []
    defaults = {
        (row["log"], row.get("seed")): row
        for row in rows
        if row["variant"] == "defaults" and "served_p" in row
    }
    for row in rows:
        base = defaults.get((row["log"], row.get("seed")))
        if row["variant"] == "defaults" or base is None or "served_p" not in row:
            continue
        labels = row["test_labels"]
        difference, upper = paired_roc_auc_difference(
            labels, row["served_p"], base["served_p"], 0.975
        )
        low = difference - (upper - difference)  # two-sided 95%: one-sided 97.5% each way
        effect = row["deletion_by_journey"].join(base["deletion_by_journey"], on="journey_id")
        change = (
            (effect["top"] - effect["random"]) - (effect["top_right"] - effect["random_right"])
        ).to_numpy()
        half = 1.96 * change.std(ddof=1) / math.sqrt(change.size) if change.size > 1 else math.nan
        out.append(
            {
                "log": row["log"],
                "variant": row["variant"],
                "seed": row.get("seed"),
                "tells": row["conversions"] >= CAN_TELL,
                "auc": (difference, low, upper),
                "attention": (
                    float(change.mean()),
                    float(change.mean() - half),
                    float(change.mean() + half),
                ),
            }
        )
    return out


def over_seeds(changes: list[dict]) -> list[dict]:
    """Each (log, variant)'s changes averaged over its seeds, with `seeds` their number (a
    seed whose run or whose defaults' run failed is not among them). The interval's
    half-width is sqrt(mean per-seed half-width^2 + t^2 x the variance of the mean over
    seeds), t Student's 97.5% quantile with one fewer degrees of freedom than seeds. Every
    seed is judged on the same test journeys, so their test noise is taken as fully shared
    (not averaged away): an upper bound on that part. A single seed's change is kept."""
    from scipy.stats import t as student_t

    groups: dict[tuple[str, str], list[dict]] = {}
    for change in changes:
        groups.setdefault((change["log"], change["variant"]), []).append(change)

    def combined(triples: list[tuple[float, float, float]]) -> tuple[float, float, float]:
        values = np.array([value for value, _, _ in triples])
        half_widths = np.array([(high - low) / 2 for _, low, high in triples])
        variance_of_mean = values.var(ddof=1) / values.size
        quantile = float(student_t.ppf(0.975, values.size - 1))
        half = math.sqrt(float(np.mean(half_widths**2)) + quantile**2 * variance_of_mean)
        mean = float(values.mean())
        return mean, mean - half, mean + half

    out = []
    for group in groups.values():
        first = group[0] | {"seeds": len(group)}
        if len(group) > 1:
            first |= {
                "seed": None,
                "auc": combined([c["auc"] for c in group]),
                "attention": combined([c["attention"] for c in group]),
            }
        out.append(first)
    return out


def markdown(rows: list[dict], command: str, skipped: list[str], seconds: float) -> str:
    from datetime import date

    lines = [
        f"## Default suite ({date.today().isoformat()})",
        "",
        f"`{command}` ({seconds / 60:.0f} min). {machine()}.",
        "",
        "Each log ingested once with its own configuration, trained with the defaults and "
        "with each candidate default (every candidate of the run: the transformer, the "
        f"stack, the baselines). Logs with {CAN_TELL} test conversions or more can tell "
        "(marked yes); the others are reported, not voted. Served: the candidate the "
        "registry chose on val and its test ROC AUC; best: the run's best model on test. "
        "True p on test: the ROC AUC of a generator's true probability on the same test "
        "labels. Deletion: mean drop in the transformer's logit when a test journey loses its "
        "most-attended event, and when it loses a random one.",
        "",
        "| log | variant | train/val/test (conversions) | can tell | transformer [95%] "
        "| served | best of the run | hgb_aggregates | true p | deletion: top / random logit "
        "drop (ratio) | decision | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if "outcome" in row:
            lines.append(f"| {row['log']} | {variant_label(row)} | {row['outcome']} ||||||||||")
            continue
        low, high = row["ci"]
        bayes = "" if math.isnan(row["bayes"]) else f"{row['bayes']:.4f}"
        tells = "yes" if row["conversions"] >= CAN_TELL else "no"
        lines.append(
            f"| {row['log']} | {variant_label(row)} | {row['n']} ({row['conversions']}) | {tells} "
            f"| {row['transformer']:.4f} [{low:.3f}, {high:.3f}] "
            f"| {row['served_kind']} {row['served']:.4f} | {row['best_kind']} {row['best']:.4f} "
            f"| {row['hgb_aggregates']:.4f} | {bayes} | {row['deletion'][0]:.3f} / "
            f"{row['deletion'][1]:.3f} ({deletion_ratio(*row['deletion'])}) "
            f"| {row['champion']} | {row['seconds']:.0f} |"
        )
    lines += ["", *changes_markdown(over_seeds(against_defaults(rows)))]
    lines += ["", *(f"- Not in this run: {line}." for line in skipped), ""]
    return "\n".join(lines)


def variant_label(row: dict) -> str:
    """The variant, and its seed when the run has `--seeds`."""
    return row["variant"] if row.get("seed") is None else f"{row['variant']} (seed {row['seed']})"


def changes_markdown(changes: list[dict]) -> list[str]:
    """The rule a default changes by: each variant against the defaults, per log, and the
    verdict over the logs that can tell."""
    if not changes:
        return []

    def cell(low_high: tuple[float, float, float]) -> str:
        value, low, high = low_high
        return f"{value:+.4f} [{low:+.4f}, {high:+.4f}]"

    lines = [
        "Each variant against the defaults, on the same test journeys (variant less "
        "defaults, 95% paired intervals): the served test ROC AUC, and attention's deletion "
        "effect (per journey, the top event's logit drop less a random event's). With "
        "`--seeds`: the mean over the seeds each pair trained with, and their number.",
        "",
        "| variant | log | can tell | served ROC AUC | attention deletion effect |",
        "|---|---|---|---|---|",
    ]
    for change in changes:
        tells = "yes" if change["tells"] else "no"
        seeds = f" ({change['seeds']} seeds)" if change["seeds"] > 1 else ""
        lines.append(
            f"| {change['variant']}{seeds} | {change['log']} | {tells} | {cell(change['auc'])} "
            f"| {cell(change['attention'])} |"
        )
    lines += ["", "| variant | mean served ROC AUC change (logs that can tell) | worse beyond "
              "the interval (AUC / attention) | better on average, no worse anywhere |",
              "|---|---|---|---|"]  # fmt: skip
    for variant in dict.fromkeys(change["variant"] for change in changes):
        telling = [c for c in changes if c["variant"] == variant and c["tells"]]
        if not telling:
            continue
        mean = float(np.mean([c["auc"][0] for c in telling]))
        worse_auc = [c["log"] for c in telling if c["auc"][2] < 0]
        worse_attention = [c["log"] for c in telling if c["attention"][2] < 0]
        verdict = "yes" if mean > 0 and not worse_auc and not worse_attention else "no"
        lines.append(
            f"| {variant} | {mean:+.4f} | {', '.join(worse_auc) or 'none'} / "
            f"{', '.join(worse_attention) or 'none'} | {verdict} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logs", nargs="*", help="names of logs to run (default: all here)")
    parser.add_argument(
        "--variants", nargs="*", choices=list(VARIANTS), help="variants to run (default: all)"
    )
    parser.add_argument(
        "--seeds", nargs="+", type=int, help="train each variant once per train.seed, "
        "compare seed by seed and decide on the mean (default: the configuration's seed)"
    )  # fmt: skip
    parser.add_argument("--no-record", action="store_true", help="print, do not touch RESULTS")
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # each variant has its own store
    started = time.perf_counter()
    public, skipped = public_logs()
    rows = []
    for log in (*LOGS, *public):
        if args.logs is not None and log.name not in args.logs:
            continue
        if log.raw is not None and not log.raw.exists():
            skipped.append(f"{log.name}: {log.raw} is not there")
            continue
        print(f"{log.name} ({log.note})", flush=True)
        chosen = {name: VARIANTS[name] for name in args.variants or VARIANTS}
        rows += run_log(log, chosen, sorted(set(args.seeds)) if args.seeds else None)
        print(f"  {rows[-1]}", flush=True)
    command = "python benchmarks/suite.py " + " ".join(sys.argv[1:])
    text = markdown(rows, command.strip(), skipped, time.perf_counter() - started)
    print(text)
    if not args.no_record:
        record_section(text)


if __name__ == "__main__":
    main()

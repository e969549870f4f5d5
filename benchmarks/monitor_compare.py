"""`journeys monitor` against Evidently's data drift preset and NannyML's CBPE, on the planted
faults of `tests/test_monitor.py`.

Stage 1 (this project's environment): the test's nights, rebuilt the same way. The
simulator (`USERS`, 16,000, over `DAYS`, 66, seed 3) is cut into day files; days 1-30 are
ingested, trained on (the test's tiny model) and scored; then each of days 31-65 lands, with a fault
planted on its night (33 an event renamed, 35 email's share tripled, 37 a 50,000-event bot,
38 and 39 the purchase event gone), and runs `journeys ingest`, `journeys score` and
`journeys monitor` through `journeys.cli.main`. Exported as Parquet:

- the reference window: the val split's events as `journeys.reference.build_reference`
  sees them (`event_rows` of the val journeys: event type, the model's features, the gap
  in log10(1 + hours)), and the val journeys' served probabilities and labels;
- each night: the events after the previous night's end (what the monitor measures), the
  rows of the day file as it landed (with every column of the export), and the night's
  open journeys with their probabilities and the outcomes known after the last night.

Stage 2 (a separate environment with Evidently and NannyML, `--cmp-python`, run by this
script as `--stage compare`): per night, Evidently's `DataDriftPreset` against the
reference (on the same events, and on the raw rows against the training days' rows of the
val window), and NannyML's CBPE fitted on the val journeys (daily chunks; as it comes, and
without its calibration) estimating each night's open journeys' ROC AUC, beside the
monitor's own CBPE figure and the ROC AUC realised on the outcomes known after the last
night; every tool timed per night. Then two markdown tables (what alerted each night; the
CBPE figures) and a verdict: fault nights caught, false alarms on the quiet nights.

`journeys monitor`'s seconds are the whole command's, in process: loading the champion
from the registry, reading the journeys and scores, the cohorts, the report's HTML page
with its plots. Evidently's are `Dataset.from_pandas` of the night and the report's run
(the reference's preparation once, apart); NannyML's are `estimate` on the night.

Usage::

    .venv/bin/python benchmarks/monitor_compare.py                # both stages
    .venv/bin/python benchmarks/monitor_compare.py --compare-only # stage 2 on stage 1's files
    .venv/bin/python benchmarks/monitor_compare.py --record       # also rewrite its RESULTS.md section

The comparison environment (kept out of the project's)::

    python3.11 -m venv data/bench/monitor_compare_env
    data/bench/monitor_compare_env/bin/pip install evidently nannyml "pandas<3" pyarrow

Data and folders live under data/bench/monitor_compare/ (git-ignored).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd
    import polars as pl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORK = ROOT / "data" / "bench" / "monitor_compare"
# The comparison's own environment, git-ignored beside the benchmark's data (not inside it:
# a full run starts the data afresh).
CMP_PYTHON = ROOT / "data" / "bench" / "monitor_compare_env" / "bin" / "python"
# 30 days to train on, then 35 nights, 30 of them quiet; about 5,000 events a night.
USERS, SEED, TRAIN_DAYS, DAYS = 16_000, 3, 30, 66
# Night (day number) -> the fault planted in that day's file and the check that must name
# it (tests/test_monitor.py reads them from here).
FAULTS = {
    33: ("renamed", "unknown_values", "event_type"),
    35: ("channel_tripled", "category_mix", "channel"),
    37: ("flood", "flood", "user_id"),
    38: ("no_conversions", "conversions", None),
    39: ("no_conversions", "conversions", None),
}
QUIET = tuple(n for n in range(TRAIN_DAYS + 1, DAYS) if n not in FAULTS)
# Cohorts pooled for a steadier realised ROC AUC: every outcome known before the purchase
# event left (a journey open on night 35 closes by day 37).
POOLED = (31, 32, 33, 34, 35)
RAW_NUMERIC = ("price",)  # numbers of the raw export (strings in the CSV)
ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "NML_DISABLE_USAGE_LOGGING": "1",  # NannyML's usage logging
}


def make_cmp(python: Path) -> str:
    """The commands that make the comparison environment whose interpreter is `python`."""
    venv = python.parent.parent
    return (
        f'python3.11 -m venv {venv} && {venv}/bin/pip install evidently nannyml "pandas<3" pyarrow'
    )


# ----------------------------------------------------------------------------- stage 1


def plant(day: pl.DataFrame, fault: str) -> pl.DataFrame:
    """`day`'s rows with `fault` planted (tests/test_monitor.py plants them with this too)."""
    import numpy as np
    import polars as pl

    if fault == "renamed":  # a tracking change: add_to_cart becomes addToCart
        return day.with_columns(pl.col("event_type").replace("add_to_cart", "addToCart"))
    if fault == "channel_tripled":  # a campaign: email's share tripled
        rng = np.random.default_rng(0)
        moved = pl.Series(rng.random(day.height) < 0.3)
        return day.with_columns(
            pl.when(moved).then(pl.lit("email")).otherwise(pl.col("channel")).alias("channel")
        )
    if fault == "flood":  # a bot under one user id, an event every 1.7 seconds
        first = day.get_column("timestamp").str.to_datetime(time_zone="UTC").min()
        moments = pl.datetime_range(
            first, first + timedelta(seconds=1.7 * 49_999), timedelta(milliseconds=1700),
            eager=True,
        )  # fmt: skip
        bot = pl.DataFrame({"user_id": ["bot-0"] * moments.len()}).with_columns(
            timestamp=moments.dt.strftime("%Y-%m-%dT%H:%M:%S%.3fZ"),
            event_type=pl.lit("page_view"),
            channel=pl.lit("direct"),
            device=pl.lit("desktop"),
            campaign=pl.lit(None, pl.String),
            price=pl.lit(None, pl.String),
        )
        return pl.concat([day, bot.select(day.columns)], how="vertical_relaxed")
    if fault == "no_conversions":  # the purchase event left the export
        return day.filter(pl.col("event_type") != "purchase")
    raise ValueError(fault)


def simulated_days(folder: Path) -> pl.DataFrame:
    """The nights' log (`USERS` over `DAYS`, `SEED`), simulated into `folder`, its rows as
    text with `_day`, the day number from 1."""
    import polars as pl

    from journeys.simulate import simulate

    simulate(folder, users=USERS, days=DAYS, seed=SEED)
    rows = pl.read_csv(next(folder.glob("*.csv")), infer_schema=False)
    day = pl.col("timestamp").str.to_datetime(time_zone="UTC").dt.date()
    return rows.with_columns((day - day.min()).dt.total_days().alias("_day") + 1)


def settings(folder: Path) -> list[str]:
    """The nights' configuration (tests/test_monitor.py runs with it too): every path under
    `folder`, the tiny model; a few hundred open journeys a night convert rarely, hence a
    realised figure from 2 conversions."""
    return [
        f"paths.raw={folder / 'raw'}", f"paths.journeys={folder / 'journeys'}",
        f"paths.quarantine={folder / 'quarantine'}", f"paths.scores={folder / 'scores'}",
        f"paths.reports={folder / 'reports'}", f"paths.checkpoints={folder / 'checkpoints'}",
        f"mlflow.tracking_uri=sqlite:///{folder / 'mlflow.db'}",
        "model.d_model=16", "model.n_heads=2", "model.n_layers=1", "train.max_epochs=1",
        "train.baselines=[logreg,prior]", "promotion.guard=false", "journey.max_gap=1d",
        "ingest.late_allowed=1d", "attribution.ig_sample=0", "train.accelerator=cpu",
        "monitor.min_cohort_conversions=2",
    ]  # fmt: skip


@contextlib.contextmanager
def isolated(folder: Path, log: Path) -> Iterator[None]:
    """cwd in `folder`, no MLFLOW_TRACKING_URI from outside, the commands' output to `log`."""
    cwd, uri, argv = Path.cwd(), os.environ.pop("MLFLOW_TRACKING_URI", None), sys.argv
    os.chdir(folder)
    sys.argv = ["journeys"]
    try:
        with log.open("a") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            yield
    finally:
        os.chdir(cwd)
        sys.argv = argv
        if uri is not None:
            os.environ["MLFLOW_TRACKING_URI"] = uri


def command(
    name: str, args: list[str], log: Path, allowed: tuple[int, ...] = (0,)
) -> tuple[int, float]:
    """Run `journeys <name>` in this process; its exit code and seconds."""
    from journeys.cli import main

    started = time.perf_counter()
    code = main([name, *(a for pair in args for a in ("--set", pair))])
    seconds = time.perf_counter() - started
    if code not in allowed:
        raise RuntimeError(f"journeys {name} exited {code}: see {log}")
    return code, seconds


def event_columns(events: pl.DataFrame, categorical: list[str], numeric: list[str]) -> pl.DataFrame:
    """The per-event columns the comparison reads: categories as strings, numbers as floats."""
    import polars as pl

    return events.select(
        *(pl.col(c).cast(pl.String) for c in ["event_type", *categorical]),
        *(pl.col(c).cast(pl.Float64) for c in [*numeric, "gap_hours"]),
    )


def raw_columns(rows: pl.DataFrame) -> pl.DataFrame:
    """A day file's rows as the comparison reads them (the export's columns, numbers as floats)."""
    import polars as pl

    return rows.drop("user_id", "timestamp").with_columns(
        pl.col(c).cast(pl.Float64, strict=False) for c in RAW_NUMERIC if c in rows.columns
    )


def export_reference(
    config: Any, trained: Any, log_rows: pl.DataFrame, out: Path
) -> dict[str, Any]:
    """The val split's events (as the reference profiles them), its journeys' served
    probabilities and labels, and the raw rows of the val window."""
    import polars as pl

    from journeys.datasets import labelled, scan_journeys, scan_scores
    from journeys.reference import event_rows

    categorical = list(trained.encoder.features)
    numeric = list(trained.encoder.numeric_features)
    val = labelled(scan_journeys(config.paths.journeys)).filter(pl.col("split") == "val")
    events = event_rows(val, categorical, numeric, None).collect()
    event_columns(events, categorical, numeric).write_parquet(out / "reference-events.parquet")
    scores = (
        scan_scores(config.paths.scores)
        .select("journey_id", "conversion_probability")
        .join(val.select("journey_id", "label", "end_time"), on="journey_id")
        .collect()
    )
    scores.write_parquet(out / "reference-scores.parquet")
    first, last = events.get_column("event_time").min(), events.get_column("event_time").max()
    moment = pl.col("timestamp").str.to_datetime(time_zone="UTC")
    raw = log_rows.filter(moment.is_between(first, last), pl.col("_day") <= TRAIN_DAYS).drop("_day")
    raw_columns(raw).write_parquet(out / "reference-raw.parquet")
    profile = trained.reference.profile
    return {
        "events": events.height,
        "reference_json_events": profile.events,
        "journeys": scores.height,
        "reference_json_journeys": profile.probability.n,
        "mean_probability": float(scores.get_column("conversion_probability").mean()),
        "reference_json_mean_probability": profile.probability.mean,
        "conversions": int(scores.get_column("label").sum()),
        "raw_rows": raw.height,
        "window": [first.isoformat(), last.isoformat()],
        "categorical": categorical,
        "numeric": numeric,
        "val_roc_auc": trained.reference.roc_auc,
    }


def cohort_facts(cohort: pl.DataFrame) -> dict[str, Any]:
    """Of a cohort of open journeys (`conversion_probability`, `outcome`: null while
    unknown): the known and converted, the CBPE estimate on the known, and their realised
    ROC AUC with its DeLong 95% interval (None without both outcomes)."""
    import polars as pl

    from journeys.metrics import roc_auc_interval
    from journeys.monitor import expected_roc_auc

    labelled = cohort.filter(pl.col("outcome").is_not_null())
    labels = labelled.get_column("outcome").cast(pl.Int64).to_numpy()
    probs = labelled.get_column("conversion_probability").to_numpy()
    both = labelled.get_column("outcome").n_unique() == 2
    realised = None
    if both:
        from sklearn.metrics import roc_auc_score

        realised = float(roc_auc_score(labels, probs))
    return {
        "known": labelled.height,
        "converted": int(labels.sum()),
        "estimated_roc_auc_known": expected_roc_auc(probs),
        "realised_roc_auc": realised,
        "realised_ci": list(roc_auc_interval(labels, probs)) if both else None,
    }


def build_nights(work: Path) -> dict[str, Any]:
    """Stage 1: the test's nights, run and exported; what the monitor said each night."""
    import polars as pl

    from journeys.config import load_config
    from journeys.datasets import scan_journeys
    from journeys.monitor import (
        JOURNEY_KEY,
        MONITOR_DIR,
        OPEN_SNAPSHOT,
        REPORT_JSON,
        expected_roc_auc,
        outcomes,
    )
    from journeys.reference import event_rows
    from journeys.score import default_model_uri
    from journeys.trained_model import load_model

    folder, out, log = work / "run", work / "export", work / "stage1.log"
    for path in (folder, out):
        path.mkdir(parents=True)
    os.environ.update(ENV)
    started = time.perf_counter()
    rows = simulated_days(folder / "log")
    raw = folder / "raw"
    raw.mkdir()
    args = settings(folder)
    config = load_config(None, args)

    def land(number: int) -> pl.DataFrame:
        landed = rows.filter(pl.col("_day") == number).drop("_day")
        if number in FAULTS:
            landed = plant(landed, FAULTS[number][0])
        landed.write_csv(raw / f"day-{number:03d}.csv")
        return landed

    nights: dict[str, dict[str, Any]] = {}
    console = sys.stdout  # the commands' own output goes to the log
    with isolated(folder, log):
        for number in range(1, TRAIN_DAYS + 1):
            land(number)
        command("ingest", args, log)
        command("train", args, log)
        command("score", args, log)
        trained = load_model(default_model_uri(config), tracking_uri=config.mlflow.tracking_uri)
        reference = export_reference(config, trained, rows, out)
        categorical, numeric = reference["categorical"], reference["numeric"]
        trained_at = time.perf_counter() - started
        for number in range(TRAIN_DAYS + 1, DAYS):
            landed = land(number)
            command("ingest", args, log)
            command("score", args, log)
            code, seconds = command("monitor", args, log, allowed=(0, 3))
            done = sorted((folder / "reports" / MONITOR_DIR).glob("*/" + REPORT_JSON))
            night_folder = done[-1].parent
            report = json.loads((night_folder / REPORT_JSON).read_text())
            since = datetime.fromisoformat(report["start"])
            journeys = scan_journeys(config.paths.journeys).filter(pl.col("end_time") > since)
            events = event_rows(journeys, categorical, numeric, since).collect()
            event_columns(events, categorical, numeric).write_parquet(
                out / f"night-{number}-events.parquet"
            )
            raw_columns(landed).write_parquet(out / f"night-{number}-raw.parquet")
            facts = report["night_facts"]
            nights[str(number)] = {
                "night": report["night"],
                "code": code,
                "monitor_seconds": seconds,
                "alerts": [[a["check"], a["column"]] for a in report["alerts"]],
                "events": events.height,
                "rows_landed": landed.height,
                "rows_read": facts["rows_read"],
                "open_journeys": facts["open_journeys"],
                "estimated_roc_auc": facts["open_estimated_roc_auc"],
                "snapshot": str(night_folder / OPEN_SNAPSHOT),
                "end": report["end"],
            }
            print(
                f"night {number} ({report['night']}): exit {code}, {len(report['alerts'])} alerts, "
                f"{events.height:,} events, monitor {seconds:.2f} s",
                file=console,
                flush=True,
            )
    # Outcomes as known after the last night (`journeys.monitor.outcomes`: converted, or
    # closed without converting and not censored; still open or censored: unknown).
    cohorts = []
    for number, night in nights.items():
        snapshot = pl.read_parquet(night["snapshot"])
        since = datetime.fromisoformat(night["end"]) - timedelta(days=30)
        snapshot = snapshot.select("journey_id", "conversion_probability", JOURNEY_KEY)
        known = outcomes(Path(config.paths.journeys), snapshot.get_column("key"), since)
        joined = snapshot.join(known, on="key", how="left").drop("key")
        joined.write_parquet(out / f"night-{number}-open.parquet")
        night |= cohort_facts(joined)
        if int(number) in POOLED:
            cohorts.append(joined)
    summary = {
        "reference": reference,
        "nights": nights,
        "pooled": cohort_facts(pl.concat(cohorts))
        | {
            "open_journeys": sum(nights[str(n)]["open_journeys"] for n in POOLED),
            "estimated_roc_auc": expected_roc_auc(
                pl.concat(cohorts).get_column("conversion_probability").to_numpy()
            ),
        },
        "seconds_to_champion": trained_at,
        "seconds": time.perf_counter() - started,
        "users": USERS,
    }
    (work / "nights.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return summary


# ----------------------------------------------------------------------------- stage 2


def evidently_night(
    reference: Any, current: pd.DataFrame, definition: Any
) -> tuple[dict[str, Any], float]:
    """Evidently's data drift preset (with its tests) on one night; its verdict and seconds."""
    from evidently import Dataset, Report
    from evidently.presets import DataDriftPreset

    started = time.perf_counter()
    dataset = Dataset.from_pandas(current, data_definition=definition)
    snapshot = Report([DataDriftPreset()], include_tests=True).run(
        current_data=dataset, reference_data=reference
    )
    result = snapshot.dict()
    seconds = time.perf_counter() - started
    scores, share, drift_share = {}, None, 0.5
    for metric in result["metrics"]:
        config = metric["config"]
        if "column" in config:
            scores[config["column"]] = [config["method"], config["threshold"], metric["value"]]
        else:  # DriftedColumnsCount
            share = metric["value"]["share"]
            drift_share = config["drift_share"]
    drifted = sorted(
        test["metric_config"]["params"]["column"]
        for test in result["tests"]
        if test["status"] == "FAIL" and "column" in test["metric_config"]["params"]
    )
    return {
        "dataset_drift": share is not None and share >= drift_share,
        "drifted_share": share,
        "drifted": drifted,
        "scores": scores,
        "rows": len(current),
    }, seconds


def evidently_runs(export: Path, nights: list[str], kind: str, reference: Path) -> dict[str, Any]:
    """Evidently per night on the `kind` files against `reference`."""
    import pandas as pd
    from evidently import DataDefinition, Dataset

    frame = pd.read_parquet(reference)
    numeric = [c for c in frame.columns if pd.api.types.is_float_dtype(frame[c])]
    definition = DataDefinition(
        numerical_columns=numeric,
        categorical_columns=[c for c in frame.columns if c not in numeric],
    )
    started = time.perf_counter()
    prepared = Dataset.from_pandas(frame, data_definition=definition)
    runs: dict[str, Any] = {
        "reference_rows": len(frame),
        "reference_seconds": time.perf_counter() - started,
        "columns": list(frame.columns),
        "nights": {},
    }
    for night in nights:
        current = pd.read_parquet(export / f"night-{night}-{kind}.parquet")
        verdict, seconds = evidently_night(prepared, current, definition)
        runs["nights"][night] = {**verdict, "seconds": seconds}
    return runs


def nannyml_runs(export: Path, nights: dict[str, Any]) -> dict[str, Any]:
    """NannyML's CBPE fitted on the val journeys (a chunk a day), as it comes (isotonic
    calibration when it judges the reference needs it) and with no calibration; then each
    night's open journeys (all, and those whose outcome is known) and the pooled cohorts:
    estimated ROC AUC, its alert (outside the reference chunks' range), seconds."""
    import warnings

    import nannyml as nml
    import pandas as pd
    from nannyml.calibration import NoopCalibrator

    reference = pd.read_parquet(export / "reference-scores.parquet")
    reference = pd.DataFrame({
        "p": reference["conversion_probability"].astype(float),
        "y": reference["label"].astype(int),
        "t": pd.to_datetime(reference["end_time"], utc=True).dt.tz_localize(None),
    })  # fmt: skip
    frames = {n: pd.read_parquet(export / f"night-{n}-open.parquet") for n in nights}
    pooled = pd.concat([frames[str(n)] for n in POOLED])
    moments = {
        n: pd.Timestamp(facts["end"]).tz_convert("UTC").tz_localize(None)
        for n, facts in nights.items()
    }
    cohorts = {**{n: (f, moments[n]) for n, f in frames.items()}, "pooled": (pooled, moments[str(POOLED[-1])])}  # fmt: skip
    variants: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for variant, calibrator in (("default", None), ("no_calibration", NoopCalibrator())):
            estimator = nml.CBPE(
                y_pred_proba="p", y_true="y", problem_type="classification_binary",
                metrics=["roc_auc"], timestamp_column_name="t", chunk_period="D",
                calibrator=calibrator,
            )  # fmt: skip
            started = time.perf_counter()
            estimator.fit(reference)
            fit_seconds = time.perf_counter() - started
            fitted = estimator.estimate(reference).to_df()
            chunks = fitted[fitted[("chunk", "period")] == "reference"]
            results = {
                name: {
                    "all": cbpe_estimate(estimator, frame, moment),
                    "known": cbpe_estimate(estimator, frame[frame["outcome"].notna()], moment),
                }
                for name, (frame, moment) in cohorts.items()
            }
            calibrated_to_zero = None
            if estimator.needs_calibration:  # what the calibrator makes of the open journeys
                calibrated = estimator.calibrator.calibrate(pooled["conversion_probability"])
                calibrated_to_zero = float((calibrated == 0).mean())
            variants[variant] = {
                "needs_calibration": bool(estimator.needs_calibration),
                "pooled_calibrated_to_zero": calibrated_to_zero,
                "fit_seconds": fit_seconds,
                "reference_chunks": len(chunks),
                "reference_chunk_roc_auc": [float(v) for v in chunks[("roc_auc", "value")]],
                "nights": results,
            }
    return {
        "version": nml.__version__,
        **variants,
        "warnings": sorted({str(w.message).splitlines()[0][:160] for w in caught}),
    }


def cbpe_estimate(
    estimator: Any, cohort: pd.DataFrame, moment: pd.Timestamp
) -> dict[str, Any] | None:
    """A fitted CBPE's estimate on one cohort as one chunk (None under two journeys)."""
    import pandas as pd

    if len(cohort) < 2:
        return None
    current = pd.DataFrame({"p": cohort["conversion_probability"].astype(float), "t": moment})
    started = time.perf_counter()
    estimated = estimator.estimate(current).to_df()
    seconds = time.perf_counter() - started
    analysis = estimated[estimated[("chunk", "period")] == "analysis"].iloc[-1]
    return {
        "roc_auc": float(analysis[("roc_auc", "value")]),
        "alert": bool(analysis[("roc_auc", "alert")]),
        "thresholds": [
            float(analysis[("roc_auc", "lower_threshold")]),
            float(analysis[("roc_auc", "upper_threshold")]),
        ],
        "seconds": seconds,
    }


def compare(work: Path) -> None:
    """Stage 2, in the comparison environment: Evidently and NannyML on stage 1's files."""
    import evidently
    import pandas as pd

    export = work / "export"
    stage1 = json.loads((work / "nights.json").read_text())
    nights = sorted(stage1["nights"], key=int)
    result: dict[str, Any] = {
        "python": sys.version.split()[0],
        "evidently": evidently.__version__,
        "pandas": pd.__version__,
        "evidently_events": evidently_runs(
            export, nights, "events", export / "reference-events.parquet"
        ),
        "evidently_raw": evidently_runs(export, nights, "raw", export / "reference-raw.parquet"),
    }
    try:
        result["nannyml"] = nannyml_runs(export, stage1["nights"])
    except ImportError as error:  # not installed next to Evidently: say why
        result["nannyml"] = {"error": f"{type(error).__name__}: {error}"}
    (work / "compare.json").write_text(json.dumps(result, indent=1, default=str) + "\n")


# ----------------------------------------------------------------------------- report


def describe(number: int) -> str:
    return FAULTS[number][0].replace("_", " ") if number in FAULTS else "none"


def named(alerts: list[list[str | None]]) -> str:
    return ", ".join(f"{c}({col})" if col else c for c, col in alerts) or "-"


def tables(stage1: dict[str, Any], result: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """The per-night table, the CBPE table and what each tool caught."""
    events, raw = result["evidently_events"]["nights"], result["evidently_raw"]["nights"]
    head = (
        "| night | planted fault | events / rows landed | journeys monitor alerts | journeys s "
        "| Evidently dataset drift (share drifted) | Evidently drifted columns | Evidently s "
        "| Evidently on raw rows: drift, columns | raw s |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = []
    caught: dict[str, dict[str, list[int]]] = {
        tool: {"faults": [], "quiet": []}
        for tool in ("journeys", "Evidently (a drifted column)", "Evidently (dataset drift)",
                     "Evidently raw (a drifted column)", "Evidently raw (dataset drift)")
    }  # fmt: skip
    for key, night in sorted(stage1["nights"].items(), key=lambda kv: int(kv[0])):
        number = int(key)
        e, r = events[key], raw[key]
        fired = {
            "journeys": bool(night["alerts"]),
            "Evidently (a drifted column)": bool(e["drifted"]),
            "Evidently (dataset drift)": e["dataset_drift"],
            "Evidently raw (a drifted column)": bool(r["drifted"]),
            "Evidently raw (dataset drift)": r["dataset_drift"],
        }
        for tool, flag in fired.items():
            if flag and (number in FAULTS or number in QUIET):
                caught[tool]["faults" if number in FAULTS else "quiet"].append(number)
        rows.append(
            f"| {number} ({night['night']}) | {describe(number)} "
            f"| {night['events']:,} / {night['rows_landed']:,} | {named(night['alerts'])} "
            f"| {night['monitor_seconds']:.2f} | {'yes' if e['dataset_drift'] else 'no'} "
            f"({e['drifted_share']:.2f}) | {', '.join(e['drifted']) or '-'} | {e['seconds']:.2f} "
            f"| {'yes' if r['dataset_drift'] else 'no'}, {', '.join(r['drifted']) or '-'} "
            f"| {r['seconds']:.2f} |"
        )
    cbpe_head = (
        "| night | open journeys | known outcomes (converted) | realised ROC AUC [95%] (known) "
        "| journeys CBPE: all open / known | NannyML CBPE: all open / known | NannyML alert "
        "| NannyML s | NannyML CBPE without calibration: all open / known "
        "|\n|---|---|---|---|---|---|---|---|---|"
    )
    nanny = result["nannyml"].get("default", {}).get("nights", {})
    plain = result["nannyml"].get("no_calibration", {}).get("nights", {})
    cohorts = [(key, key, night) for key, night in stage1["nights"].items()]
    cohorts.append((f"{POOLED[0]}-{POOLED[-1]} pooled", "pooled", stage1["pooled"]))
    cbpe = [
        f"| {label} | {night['open_journeys']:,} | {night['known']:,} ({night['converted']}) "
        f"| {_fmt(night['realised_roc_auc'])} {_interval(night['realised_ci'])} "
        f"| {_fmt(night['estimated_roc_auc'])} / {_fmt(night['estimated_roc_auc_known'])} "
        f"| {_nanny(nanny.get(key))} | {_nanny(plain.get(key), estimates_only=True)} |"
        for label, key, night in cohorts
    ]
    return "\n".join([head, *rows]), "\n".join([cbpe_head, *cbpe]), caught


def _nanny(cohort: dict[str, Any] | None, estimates_only: bool = False) -> str:
    """NannyML's cells of a cohort: estimates (all / known), alerts, seconds (all)."""
    if cohort is None:
        return "not run" if estimates_only else "not run | - | -"
    both = [cohort["all"], cohort["known"]]
    estimates = " / ".join(_fmt(c["roc_auc"] if c else None) for c in both)
    if estimates_only:
        return estimates
    return (
        estimates
        + " | "
        + " / ".join("-" if c is None else "yes" if c["alert"] else "no" for c in both)
        + f" | {cohort['all']['seconds']:.3f}"
    )


def _interval(bounds: list[float] | None) -> str:
    return "" if not bounds else f"[{bounds[0]:.3f}, {bounds[1]:.3f}]"


def _fmt(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.3f}"


def report(stage1: dict[str, Any], result: dict[str, Any], seconds: float) -> str:
    """The markdown the script prints (and records)."""
    night_table, cbpe_table, caught = tables(stage1, result)
    nights = stage1["nights"].values()
    mean = {
        "journeys monitor": sum(n["monitor_seconds"] for n in nights) / len(nights),
        "Evidently": _mean(result["evidently_events"]),
        "Evidently on raw rows": _mean(result["evidently_raw"]),
    }
    verdict = "; ".join(
        f"{tool}: {len(c['faults'])}/{len(FAULTS)} fault nights caught "
        f"({', '.join(map(str, c['faults'])) or 'none'}), false alarms on "
        f"{len(c['quiet'])}/{len(QUIET)} quiet nights ({', '.join(map(str, c['quiet'])) or 'none'})"
        for tool, c in caught.items()
    )
    ref = stage1["reference"]
    nanny = result["nannyml"]
    nanny_line = f"NannyML not run: {nanny.get('error')}"
    if "version" in nanny:
        fitted = nanny["default"]
        zero = fitted["pooled_calibrated_to_zero"]
        nanny_line = (
            f"NannyML {nanny['version']}: CBPE fitted on the {ref['journeys']:,} val journeys "
            f"({ref['conversions']} conversions, realised ROC AUC {_fmt(ref['val_roc_auc'])}) "
            f"in {fitted['reference_chunks']} daily chunks ({fitted['fit_seconds']:.2f} s; "
            f"its estimate on them {min(fitted['reference_chunk_roc_auc']):.3f}-"
            f"{max(fitted['reference_chunk_roc_auc']):.3f}); it judged the val probabilities "
            f"{'miscalibrated and fitted its isotonic calibrator' if fitted['needs_calibration'] else 'calibrated'}"
            + (
                f", which maps {zero:.0%} of the pooled open journeys' probabilities to 0"
                if zero is not None
                else ""
            )
        )
    return (
        f"Evidently {result['evidently']} and NannyML "
        f"{nanny.get('version', 'not installed')} (Python {result['python']}, pandas "
        f"{result['pandas']}); reference: the val split's {ref['events']:,} events "
        f"(reference.json: {ref['reference_json_events']:,}), {ref['raw_rows']:,} raw rows of "
        f"the val window for the raw comparison. Columns: event_type, "
        f"{', '.join(ref['categorical'] + ref['numeric'])}, gap_hours (the journeys hold "
        f"only the model's features); raw: {', '.join(result['evidently_raw']['columns'])}. "
        f"Mean seconds a night: "
        + ", ".join(f"{k} {v:.2f}" for k, v in mean.items())
        + f". Wall time {seconds / 60:.1f} min (stage 1 {stage1['seconds'] / 60:.1f} min).\n\n"
        f"{night_table}\n\n**Verdict**: {verdict}.\n\n{nanny_line}. Each night's open journeys "
        f"against the outcomes known after night {DAYS - 1} (a realised figure on a handful of "
        f"conversions has no useful interval):\n\n{cbpe_table}\n"
    )


def _mean(runs: dict[str, Any]) -> float:
    values = [n["seconds"] for n in runs["nights"].values()]
    return sum(values) / len(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cmp-python", type=Path, default=CMP_PYTHON)
    parser.add_argument("--workdir", type=Path, default=WORK)
    parser.add_argument("--stage", choices=["all", "compare"], default="all")
    parser.add_argument("--compare-only", action="store_true", help="reuse stage 1's files")
    parser.add_argument("--record", action="store_true", help="rewrite the RESULTS.md section")
    args = parser.parse_args()
    if args.stage == "compare":  # in the comparison environment
        compare(args.workdir)
        return
    if not args.cmp_python.exists():
        print(
            f"monitor_compare: error: no comparison interpreter at {args.cmp_python}: make it "
            f"with `{make_cmp(args.cmp_python)}`",
            file=sys.stderr,
        )
        sys.exit(2)
    import shutil

    started = time.perf_counter()
    if args.compare_only:
        stage1 = json.loads((args.workdir / "nights.json").read_text())
    else:
        shutil.rmtree(args.workdir, ignore_errors=True)
        stage1 = build_nights(args.workdir)
    subprocess.run(
        [str(args.cmp_python), str(Path(__file__).resolve()), "--stage", "compare",
         "--workdir", str(args.workdir)],
        check=True, env={**os.environ, **ENV, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    result = json.loads((args.workdir / "compare.json").read_text())
    text = report(stage1, result, time.perf_counter() - started)
    print(text)
    if args.record:
        from benchmarks.recording import machine, record_section

        record_section(
            f"## Monitor against Evidently and NannyML ({datetime.now(UTC):%Y-%m-%d}, "
            f"{machine()})\n\n`.venv/bin/python benchmarks/monitor_compare.py --record` "
            f"(tests/test_monitor.py's nights: {USERS:,} simulated users, trained on "
            f"{TRAIN_DAYS} days, then {DAYS - 1 - TRAIN_DAYS} nights). {text}"
        )


if __name__ == "__main__":
    main()

"""BPIC 2012 outcome prediction, prefix by prefix, against a published table.

Reproduces the protocol of Teinemaa, Dumas, La Rosa and Maggi, "Outcome-Oriented
Predictive Process Monitoring: Review and Benchmark" (ACM TKDD 2019) on the BPI Challenge
2012 log (B.F. van Dongen, 4TU.ResearchData, DOI 10.4121/uuid:3926db30-f712-4394-aebc-75976070e91f,
CC BY 4.0) with the product's own pipeline:

- labels: each case's LAST O_* event (by time) gives three binary tasks, accepted
  (O_ACCEPTED), declined (O_DECLINED) and cancelled (O_CANCELLED); a case whose last O_*
  event is another one, or that has no O_* event, is left out (4,685 of 13,087 cases stay);
- split: temporal by case start, the first 80% of cases train (the latest 20% of those
  validate, for early stopping), and train events at or after the first test case's start
  are removed (the reference's `split_data_strict`);
- sequences: the product's ingest (`run_ingest`) on a config derived from
  `conf/bpic2012.yaml` by overrides only: one case is one journey, `data.drop_events` per
  setting (below); the first 40 events of each case are kept. The log it ingests is the raw
  log plus two derived categorical columns (`prepare_log`): the requested amount's band
  (for a comparison: the model reads the amount itself, `data.numeric_features`) and the
  time since the case's first event;
- the transformer: the product's causal `JourneyTransformer`, trained by the product's
  `JourneyModule` and Trainer (`journeys.lightning_parts`) with configuration only
  (`MODEL_OVERRIDES`): `train.objective=every_prefix` puts the loss at every prefix position
  (the causal head gives a logit after each event, so one pass trains on all prefixes
  1..40), `train.prefix_weight=prefix` weighs every prefix alike (the reference trains on
  all prefixes, one row each), `train.monitor=val_prefix_roc_auc` checkpoints and stops
  early on the val cases' prefixes; then (like the baseline) it is retrained from scratch
  on train + val for the early-stopped number of epochs (`--no-refit` skips this); each
  test case is scored in ONE pass of the product's `run_model` and the logit after event k
  is the prediction for the prefix of length k. Three seeds, probabilities averaged;
- the baseline: scikit-learn's HistGradientBoostingClassifier on the reference's
  aggregation encoding (counts of activity-lifecycle and resource in the prefix; mean, max,
  min, sum and std of the event's hour, weekday, month, minutes since midnight, since the
  previous event and since the case start, and the event number; the requested amount),
  fitted on every prefix 1..40 of the train cases, its number of rounds chosen on val, then
  refitted on train + val;
- the metric: ROC AUC per prefix length k = 1..40 (over the test cases with at least k
  events) and their average weighted by the number of test cases of each length; lengths
  whose test prefixes hold one class only have no AUC and are left out of the average.

Two settings:

- `reference`: every event stays in the sequence, as in the reference, where a long enough
  prefix contains the outcome event itself (O_ACCEPTED, O_DECLINED, ...). This is the
  setting COMPARABLE to the published figures.
- `leak_free`: `conf/bpic2012.yaml` as shipped: the outcome events and what only follows an
  outcome are dropped by configuration (`data.drop_events`; A_APPROVED is the conversion and
  `journey.after_conversion: drop` cuts what follows it). No prefix holds an outcome event;
  work items that close at the outcome (a call-back item completed when the offer is
  cancelled, say) stay, as they are not outcome events.

Usage::

    .venv/bin/python benchmarks/bpic2012.py                  # both settings, all three tasks
    .venv/bin/python benchmarks/bpic2012.py --quick          # smoke run: tiny model, 2 epochs
    .venv/bin/python benchmarks/bpic2012.py --tasks declined --settings leak_free --epochs 10

Prints one table and ends with one JSON line of the transformer AUCs. Work files (the
derived log, journeys, `results.json` with AUCs per prefix length) go under
`data/bench/bpic2012/`. Every model runs on one thread (`limited_threads`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import polars as pl

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from journeys import metrics as M  # noqa: E402  (after the checkout is importable)

if TYPE_CHECKING:
    from journeys.config import Config
    from journeys.encoding import EncodedJourneys, JourneyEncoder
    from journeys.model import JourneyTransformer
    from journeys.vocab import Vocabularies

DEFAULT_RAW = ROOT.parent / "shared" / "data" / "bpic2012" / "events.csv.gz"
SAMPLE_RAW = ROOT / "data" / "samples" / "bpic2012" / "events.csv.gz"
BASE_CONFIG = ROOT / "conf" / "bpic2012.yaml"
WORKDIR = ROOT / "data" / "bench" / "bpic2012"

# Task -> the last O_* event that makes a case positive.
TASKS: dict[str, str] = {
    "accepted": "O_ACCEPTED",
    "declined": "O_DECLINED",
    "cancelled": "O_CANCELLED",
}
# Teinemaa et al. (2019), XGBoost with aggregation encoding, single bucket (about).
PUBLISHED: dict[str, float] = {"accepted": 0.67, "declined": 0.55, "cancelled": 0.69}
SETTINGS = ("reference", "leak_free")
SETTING_TITLES = {
    "reference": "reference (all events; comparable to the published figures)",
    "leak_free": "leak-free (outcome events dropped by configuration)",
}
OFFER_PREFIX = "O_"
MAX_PREFIX = 40
TRAIN_FRACTION = 0.8
VAL_FRACTION = 0.2  # of the train cases, the latest by start: early stopping only
# The case's requested amount (raw column, one value per case repeated on every event).
AMOUNT = "amount_req"
# The transformer reads the amount as a number (`data.numeric_features` in
# conf/bpic2012.yaml). Before numeric features it read the amount's half-octave band, a
# derived column still added to the ingested log (`amount_band_expr`), so that
# `--set data.numeric_features=[]` compares the two (the band: 0.003-0.014 lower AUC).
AMOUNT_BAND = "amount_band"
# Likewise the time since the case's first event (`elapsed_band_expr`): the product embeds
# the gap to the previous event only, and a sum of gaps is hard to read off attention.
ELAPSED_BAND = "elapsed_band"
ROW_NUMBER = "_row_number"
# Per-event categorical columns ingest carries into the journeys (`data.features`) ...
INGEST_FEATURES = ["lifecycle", "resource", AMOUNT_BAND, ELAPSED_BAND]
# ... and those the transformer embeds (its vocabularies). `resource` (the employee) only
# feeds the boosting baseline, as in the reference: with it the transformer's val AUC was
# lower on the tasks tried (staff changes over time).
FEATURES = ["lifecycle", AMOUNT_BAND, ELAPSED_BAND]
DERIVED_LOG = "events_with_bands.parquet"
NEVER = "__no_conversion__"  # an event type that does not occur: no journey is cut

# Model and training settings (product config keys) for the full run and for --quick.
MODEL_OVERRIDES = [
    "model.causal=true",
    # The loss at every prefix (the causal head gives a logit after each event), one row
    # per prefix as the reference trains; the checkpoint and early stopping on the val
    # cases' prefix AUC (the journey's own AUC sees the outcome event in `reference`).
    "train.objective=every_prefix",
    "train.prefix_weight=prefix",
    "train.monitor=val_prefix_roc_auc",
    "train.ema_decay=null",  # as measured: the raw weights of the best epoch
    "train.positive_share=null",  # every train case, every epoch
    # The visit-gap embedding (a 30-minute session rule, made for web journeys) did not
    # help here: cancelled 0.6908 with it, 0.6929 without (reference setting, 3 seeds).
    "model.visit_gap=null",
    # Time encodings (on by default since the simulator gained time-of-day effects) gave
    # cancelled 0.6935 against 0.7074 without (reference setting, 3 seeds): off, as measured.
    "model.time_encodings=false",
    "model.d_model=64",
    "model.n_heads=4",
    "model.n_layers=2",
    "model.dropout=0.2",
    "model.attention_dropout=0.2",  # as measured, when one key covered both
    "train.batch_size=64",
    "train.lr=0.003",
    "train.warmup_steps=100",
    "train.schedule=cosine",
    "train.weight_decay=0.01",
    "train.patience=4",
    "train.max_epochs=30",
    "train.accelerator=cpu",
]
QUICK_OVERRIDES = ["model.d_model=32", "model.n_layers=1", "train.max_epochs=2"]
SEEDS = 3  # transformers per task, probabilities averaged (one with --quick)

# The reference sets factor levels seen fewer than 10 times to "other".
MIN_LEVEL_COUNT = 10
OTHER = "other"
MISSING = "missing"
HGB_MAX_ITER = 150  # rounds tried on val (the best was at most 60 in every run)
HGB_QUICK_MAX_ITER = 20
HGB_LEARNING_RATE = 0.05


# ----------------------------------------------------------------------------- labels


def amount_band_expr(amount: pl.Expr) -> pl.Expr:
    """Requested amount (text) -> the lower edge of its half-octave band, as text.

    Band k holds amounts in [2^(k/2), 2^((k+1)/2)): 5000 and 5001 -> "4096", 8000 ->
    "5793"; zero, negative or missing amounts -> "0".
    """
    value = amount.cast(pl.Float64, strict=False)
    band = (value.log(2) * 2).floor()
    edge = (pl.lit(2.0).pow(band / 2)).round(0).cast(pl.Int64).cast(pl.String)
    return pl.when(value > 0).then(edge).otherwise(pl.lit("0"))


def elapsed_band_expr(elapsed: pl.Expr) -> pl.Expr:
    """Time since the case's first event -> its half-octave band in hours, as text.

    Band k holds 2^(k/2) - 1 <= hours < 2^((k+1)/2) - 1: 0 -> "0", 1 h -> "2", 3 h -> "4",
    30 days -> "18". Known when the event happens, so it leaks nothing.
    """
    hours = elapsed.dt.total_seconds(fractional=True).clip(lower_bound=0) / 3600
    return ((hours + 1).log(2) * 2).floor().cast(pl.Int64).cast(pl.String)


@dataclass(frozen=True)
class PreparedLog:
    path: Path  # the raw rows plus the derived columns, as Parquet, for ingest
    events: pl.DataFrame  # `read_log` of the raw file (for the labels)
    amounts: pl.DataFrame  # `case_id`, `amount_req` (float): the boosting's static feature


def prepare_log(raw: str | Path, folder: Path, config: Config) -> PreparedLog:
    """The raw log plus two derived categorical columns, as Parquet for the product to ingest.

    `amount_band` (the requested amount's band, which the model reads only when the amount
    is not a numeric feature) and `elapsed_band` (time since the case's first event). Every raw
    row and column is kept, as text, so ingest parses exactly what it parses from the CSV;
    timestamps for `elapsed_band` are parsed by the product too (`read_log`).
    """
    if not Path(raw).is_file():
        raise ValueError(f"{raw}: the benchmark reads one log file")
    events = read_log(raw, config)
    starts = events.group_by("case_id").agg(pl.col("ts").min().alias("start"))
    elapsed = events.join(starts, on="case_id").select(
        pl.col("row").alias(ROW_NUMBER),
        elapsed_band_expr(pl.col("ts") - pl.col("start")).alias(ELAPSED_BAND),
    )
    frame = pl.read_csv(raw, infer_schema=False).with_row_index(ROW_NUMBER, offset=1)
    frame = (
        frame.join(elapsed, on=ROW_NUMBER, how="left")
        .sort(ROW_NUMBER)
        .with_columns(amount_band_expr(pl.col(AMOUNT)).alias(AMOUNT_BAND))
        .drop(ROW_NUMBER)
    )
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / DERIVED_LOG
    frame.write_parquet(path)
    amounts = frame.group_by("case_id").agg(
        pl.col(AMOUNT).cast(pl.Float64, strict=False).drop_nulls().first().fill_null(0.0)
    )
    return PreparedLog(path, events, amounts)


def read_log(raw: str | Path, config: Config) -> pl.DataFrame:
    """Valid rows of the raw log as the product reads them: `case_id`, `activity`, `ts`, `row`.

    Parsing goes through the product's `scan_events`, so timestamps are exactly those of
    ingest (UTC). `row` is the position in the source, used to break timestamp ties.
    """
    from journeys.events import REASON, ROW, TS, scan_events

    # Only the required columns: the derived feature columns are not in the raw file.
    rows = scan_events(raw, config.data.model_copy(update={"features": []})).rows
    return (
        rows.filter(pl.col(REASON).is_null())
        .select(
            pl.col("user_id").alias("case_id"),
            pl.col("event_type").alias("activity"),
            pl.col(TS).alias("ts"),
            pl.col(ROW).alias("row"),
        )
        .collect()
    )


def case_outcomes(events: pl.DataFrame) -> pl.DataFrame:
    """One row per labelled case: `case_id`, `start_time`, `outcome` (a key of `TASKS`).

    `events` has `case_id`, `activity`, `ts` and `row`. The outcome is the case's last O_*
    event by (time, row); cases whose last O_* event is not one of the three task events,
    or that have no O_* event, are left out, as in the reference. `start_time` is the case's
    first event of any type. Sorted by (start_time, case_id).
    """
    outcome_of = {event: task for task, event in TASKS.items()}
    last_offer = (
        events.filter(pl.col("activity").str.starts_with(OFFER_PREFIX))
        .sort(["case_id", "ts", "row"])
        .group_by("case_id", maintain_order=True)
        .agg(pl.col("activity").last().alias("last_offer"))
    )
    starts = events.group_by("case_id").agg(pl.col("ts").min().alias("start_time"))
    return (
        last_offer.filter(pl.col("last_offer").is_in(list(outcome_of)))
        .join(starts, on="case_id", how="inner")
        .select(
            "case_id",
            "start_time",
            pl.col("last_offer")
            .replace_strict(outcome_of, return_dtype=pl.String)
            .alias("outcome"),
        )
        .sort(["start_time", "case_id"])
    )


# ----------------------------------------------------------------------------- split


@dataclass(frozen=True)
class CaseSplit:
    """Roles by case start: `cases` has `case_id`, `start_time`, `outcome`, `role`."""

    cases: pl.DataFrame
    cutoff: datetime  # the first test case's start: train events at or after it are removed


def temporal_split(
    cases: pl.DataFrame,
    train_fraction: float = TRAIN_FRACTION,
    val_fraction: float = VAL_FRACTION,
) -> CaseSplit:
    """The reference's strict temporal split, plus the latest train cases as validation.

    Cases sorted by (start_time, case_id): the first `int(train_fraction * n)` train, the rest
    test. Of the train cases, the latest `round(val_fraction * n_train)` become `val` (still
    train data for the protocol: their events are cut at the same cutoff).
    """
    ordered = cases.sort(["start_time", "case_id"])
    n = ordered.height
    n_train = int(train_fraction * n)
    if not 0 < n_train < n:
        raise ValueError(f"{n} labelled cases cannot be split {train_fraction:.0%} / rest")
    n_val = round(val_fraction * n_train)
    index = pl.int_range(pl.len())
    role = (
        pl.when(index >= n_train)
        .then(pl.lit("test"))
        .when(index >= n_train - n_val)
        .then(pl.lit("val"))
        .otherwise(pl.lit("train"))
    )
    with_roles = ordered.with_columns(role.alias("role"))
    cutoff = with_roles.filter(pl.col("role") == "test").get_column("start_time").min()
    return CaseSplit(with_roles, cutoff)


# ----------------------------------------------------------------------------- sequences


def setting_overrides(setting: str) -> list[str]:
    """`--set`-style overrides of `conf/bpic2012.yaml` for a setting (configuration only)."""
    common = [
        # The log spans 5.5 months: a gap larger than that keeps every case one journey.
        "journey.max_gap=365d",
        # Keep every event at ingest (the longest case has 175); prefixes take the first 40.
        "journey.max_events=4096",
        f"data.features=[{','.join(INGEST_FEATURES)}]",
    ]
    if setting == "leak_free":
        return common  # the shipped drop and end events, A_APPROVED conversion, cut at decisions
    if setting == "reference":
        # Nothing dropped and nothing cut: every event of the case is in its sequence.
        # Labels come from the offer events here, not from ingest: no conversion is expected.
        return [
            *common,
            f"data.conversion_events=[{NEVER}]",
            "data.drop_events=[]",
            "data.end_events=[]",
            "ingest.require_conversions=false",
        ]
    raise ValueError(f"unknown setting {setting!r}; choose from {SETTINGS}")


def make_config(
    setting: str, raw: str | Path, workdir: Path, extra: list[str] | None = None
) -> Config:
    """The product config for a setting: `conf/bpic2012.yaml` plus overrides."""
    from journeys.config import load_config

    folder = workdir / setting
    return load_config(
        BASE_CONFIG,
        [
            f"paths.raw={raw}",
            f"paths.journeys={folder / 'journeys'}",
            f"paths.quarantine={folder / 'quarantine'}",
            f"paths.checkpoints={folder / 'checkpoints'}",
            *setting_overrides(setting),
            *MODEL_OVERRIDES,
            *(extra or []),
        ],
    )


def ingest_cases(config: Config) -> pl.DataFrame:
    """The product's ingest; returns one journey per case (checked) in the ingest schema."""
    from journeys.datasets import read_journeys
    from journeys.ingest import run_ingest

    result = run_ingest(config)
    journeys = read_journeys(result.journeys_folder)
    if journeys.get_column("user_id").n_unique() != journeys.height:
        raise AssertionError("a case was split into several journeys: raise journey.max_gap")
    if (journeys.get_column("n_events") != journeys.get_column("n_events_total")).any():
        raise AssertionError("ingest truncated a case: raise journey.max_events")
    return journeys


def sequence_columns(config: Config) -> list[str]:
    return ["event_type", "event_time", *config.data.event_columns]


def transformer_features(config: Config) -> list[str]:
    """`FEATURES`, less the amount's band when the amount is a number
    (`--set data.numeric_features=[amount_req]`)."""
    as_number = AMOUNT in config.data.numeric_features
    return [f for f in FEATURES if not (as_number and f == AMOUNT_BAND)]


def prefix_cases(
    journeys: pl.DataFrame, split: CaseSplit, columns: list[str], max_prefix: int = MAX_PREFIX
) -> pl.DataFrame:
    """Labelled cases with their role and their first `max_prefix` events (`n_events`).

    Train and val cases lose their events at or after `split.cutoff` (events are in time
    order, so the kept ones are a prefix). Cases left with no event are dropped. Ordered by
    (role, start_time, case_id).
    """
    frame = journeys.select(pl.col("user_id").alias("case_id"), *columns).join(
        split.cases, on="case_id", how="inner"
    )
    before_cutoff = pl.col("event_time").list.eval((pl.element() < split.cutoff).sum()).list.first()
    keep = (
        pl.when(pl.col("role") == "test")
        .then(pl.col("event_time").list.len())
        .otherwise(before_cutoff)
    )
    keep = pl.min_horizontal(keep.cast(pl.Int64), pl.lit(max_prefix, dtype=pl.Int64))
    frame = frame.with_columns(keep.alias("n_events"))
    frame = frame.with_columns(pl.col(c).list.head(pl.col("n_events")) for c in columns)
    return frame.filter(pl.col("n_events") > 0).sort(["role", "start_time", "case_id"])


def task_labels(frame: pl.DataFrame, task: str) -> np.ndarray:
    """1 where the case's outcome is `task`, else 0 (float32, the frame's order)."""
    return (frame.get_column("outcome") == task).cast(pl.Float32).to_numpy()


# ----------------------------------------------------------------------------- prefixes


def generate_prefixes(
    lengths: np.ndarray | list[int], max_prefix: int = MAX_PREFIX
) -> pl.DataFrame:
    """Every prefix of every case: `case_row` (position in `lengths`) and `prefix_len`.

    A case of n events gives prefixes 1..min(n, max_prefix): the reference's
    `generate_prefix_data`, where a case contributes a prefix of length k when it has at
    least k events.
    """
    counts = np.minimum(np.asarray(lengths, dtype=np.int64), max_prefix).clip(min=0)
    case_row = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    prefix_len = np.arange(int(counts.sum()), dtype=np.int64) - starts + 1
    return pl.DataFrame({"case_row": case_row, "prefix_len": prefix_len})


# ----------------------------------------------------------------------------- metric


def auc_by_prefix_length(
    prefix_len: np.ndarray, labels: np.ndarray, scores: np.ndarray
) -> pl.DataFrame:
    """`prefix_len`, `n` (test prefixes of that length) and `auc` (null with one class
    only): `journeys.metrics.auc_by_prefix_length` as a table."""
    lengths, counts, aucs = M.auc_by_prefix_length(prefix_len, labels, scores)
    return pl.DataFrame(
        {"prefix_len": lengths, "n": counts, "auc": aucs},
        schema={"prefix_len": pl.Int64, "n": pl.Int64, "auc": pl.Float64},
    ).with_columns(pl.col("auc").fill_nan(None))


def weighted_auc(table: pl.DataFrame) -> float:
    """Sum over lengths of n_k * AUC_k / sum of n_k, over lengths that have an AUC."""
    return M.weighted_prefix_auc(
        table.get_column("n").to_numpy(), table.get_column("auc").fill_null(np.nan).to_numpy()
    )


def prefix_auc(prefix_len: np.ndarray, labels: np.ndarray, scores: np.ndarray) -> float:
    """The reference's headline number: AUC per prefix length, weighted by its count."""
    return weighted_auc(auc_by_prefix_length(prefix_len, labels, scores))


# ----------------------------------------------------------------------------- transformer


def build_vocabularies(
    train: pl.DataFrame, config: Config, features: list[str] | None = None
) -> Vocabularies:
    """Vocabularies of `event_type` and `features` (default: all of `data.features`) from
    the train cases' kept events only, with the product's builder and `vocab.min_count`."""
    from journeys.vocab import build_vocabularies as product_builder

    columns = ["event_type", *(config.data.features if features is None else features)]
    train_split = train.lazy().with_columns(pl.lit("train").alias("split"))
    return product_builder(train_split, columns, config.vocab.min_count)


@dataclass
class TrainedModel:
    model: JourneyTransformer
    best_epoch: int | None
    best_val_auc: float | None
    epochs_run: int
    seconds: float
    seed: int = 0


def fit_encoder(
    train: pl.DataFrame, vocabs: Vocabularies, config: Config, numeric: bool = True
) -> JourneyEncoder:
    """The product's `JourneyEncoder` of the cases (their first `MAX_PREFIX` events),
    fitted on the train cases: the vocabularies' features and, with `numeric`,
    `data.numeric_features` scaled by the train cases' events."""
    from journeys.encoding import JourneyEncoder
    from journeys.inputs import CategoricalInput, NumericInput

    numbers = config.data.numeric_features if numeric else []
    columns = [
        *(CategoricalInput(name) for name in vocabs.features),
        *(NumericInput(name) for name in numbers),
    ]
    return JourneyEncoder.fit(
        train,
        vocabs,
        config.model,
        max_len=MAX_PREFIX,
        timezone=config.data.timezone,
        columns=columns,
    )


def train_transformer(
    config: Config,
    encoder: JourneyEncoder,
    train: EncodedJourneys,
    val: EncodedJourneys | None,
) -> TrainedModel:
    """Fit the product's `JourneyModule` with the product's Trainer (`build_trainer`),
    sized by `encoder` (what encoded `train` and `val`).

    Everything that makes it prefix-by-prefix is configuration (`MODEL_OVERRIDES`): the
    loss at every prefix, each prefix weighted alike, and the checkpoint and early stopping
    on the val prefixes' AUC. Without `val` (or with an empty one) it trains for
    `train.max_epochs` and keeps the last weights.
    """
    import tempfile

    import lightning as L
    import torch

    from journeys.encoding import make_dataloader, model_config_from
    from journeys.lightning_parts import JourneyModule, build_trainer

    started = time.perf_counter()
    L.seed_everything(config.train.seed, workers=True, verbose=False)
    model_config = model_config_from(config.model, encoder)
    lengths = train.lengths.float()
    # The head starts at the loss-minimising constant: the positive rate over what the loss
    # averages (prefixes, with prefix_weight: prefix).
    if config.train.prefix_weight == "prefix":
        base_rate = float((train.labels * lengths).sum() / lengths.sum())
    else:
        base_rate = float(train.labels.mean())
    module = JourneyModule(model_config, config.train, base_rate)
    has_val = val is not None and len(val) > 0
    train_loader = make_dataloader(
        train, config.train.batch_size, shuffle=True, seed=config.train.seed
    )
    val_loader = make_dataloader(val, 512, shuffle=False) if has_val else None
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=r".*smaller than the logging interval.*")
        warnings.filterwarnings("ignore", message=r".*could not find the monitored key.*")
        trainer, checkpoint = build_trainer(config, False, Path(folder), progress=False)
        trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=val_loader)
        best_epoch = best_score = None
        if has_val and checkpoint.best_model_path:
            saved = torch.load(checkpoint.best_model_path, weights_only=True)
            module.load_state_dict(saved["state_dict"])
            best_epoch = int(saved["epoch"]) + 1
            best_score = float(checkpoint.best_model_score)
    return TrainedModel(
        model=module.model.eval(),
        best_epoch=best_epoch,
        best_val_auc=best_score,
        epochs_run=trainer.current_epoch,
        seconds=time.perf_counter() - started,
    )


def encode_cases(
    frame: pl.DataFrame, encoder: JourneyEncoder, labels: np.ndarray | None = None
) -> EncodedJourneys:
    """The product's encoding of a cases frame (`fit_encoder`: first `MAX_PREFIX` events),
    labelled."""
    import torch

    encoded = encoder.encode(frame.select("event_type", "event_time", *encoder.event_columns))
    if labels is not None:
        encoded = replace(encoded, labels=torch.tensor(labels, dtype=torch.float32))
    return encoded


def score_prefixes(
    model: JourneyTransformer, encoded: EncodedJourneys, batch_size: int = 512
) -> pl.DataFrame:
    """One pass per case: `case_row`, `prefix_len`, `probability` for every prefix.

    The product's inference path (`run_model`): the causal model's logit after event k only
    sees events 1..k, so it is the prediction for the prefix of length k (checked against
    scoring that prefix alone in the tests).
    """
    from journeys.inference import run_model
    from journeys.metrics import sigmoid

    outputs = run_model(model, encoded, batch_size)
    if outputs.prefix_logits is None:
        raise ValueError("scoring every prefix needs a causal model (model.causal=true)")
    # run_model's per-event arrays are flat, journey by journey: generate_prefixes' order.
    lengths = np.diff(outputs.offsets)
    rows = generate_prefixes(lengths, max_prefix=int(lengths.max(initial=0)))
    return rows.with_columns(pl.Series("probability", sigmoid(outputs.prefix_logits)))


@dataclass
class Ensemble:
    members: list[TrainedModel]
    member_probabilities: list[np.ndarray]  # per member, one per test prefix
    probabilities: np.ndarray  # their mean


def train_ensemble(
    config: Config,
    encoder: JourneyEncoder,
    encoded: dict[str, EncodedJourneys],
    seeds: int,
    test_rows: pl.DataFrame,
    refit: bool = True,
) -> Ensemble:
    """`seeds` transformers (seeds train.seed, +1, ...), each scoring every test prefix.

    With `refit`, each seed's early-stopped epoch count is kept and a fresh model is trained
    for that many epochs on train + val (`encoded["train_val"]`), as the boosting baseline
    is refitted: the val cases are the latest before the test period, the most like it.
    Probabilities come back in `test_rows` order (`case_row`, `prefix_len`); a test prefix
    without a probability is an error.
    """
    members, probabilities = [], []
    for offset in range(seeds):
        member_config = config.model_copy(deep=True)
        member_config.train.seed = config.train.seed + offset
        trained = train_transformer(member_config, encoder, encoded["train"], encoded["val"])
        if refit and trained.best_epoch:
            refit_config = member_config.model_copy(deep=True)
            refit_config.train.max_epochs = trained.best_epoch
            refitted = train_transformer(refit_config, encoder, encoded["train_val"], val=None)
            trained = replace(
                trained, model=refitted.model, seconds=trained.seconds + refitted.seconds
            )
        trained.seed = member_config.train.seed
        scored = score_prefixes(trained.model, encoded["test"])
        aligned = test_rows.join(scored, on=["case_row", "prefix_len"], how="left")
        aligned = aligned.sort(["case_row", "prefix_len"])
        if aligned.get_column("probability").null_count() or aligned.height != test_rows.height:
            raise AssertionError("a test prefix has no transformer probability")
        members.append(trained)
        probabilities.append(aligned.get_column("probability").to_numpy())
    return Ensemble(members, probabilities, np.mean(probabilities, axis=0))


# ----------------------------------------------------------------------------- baseline


NUMERIC = (
    "hour",
    "weekday",
    "month",
    "timesincemidnight",
    "timesincelastevent",
    "timesincecasestart",
    "event_nr",
)
AGGREGATES = ("mean", "max", "min", "sum", "std")


@dataclass
class AggregationEncoder:
    """The reference's aggregation encoding of every prefix of every case.

    Counts of each activity-lifecycle pair and each resource (levels seen fewer than
    `MIN_LEVEL_COUNT` times in train become "other"; missing resources are carried forward
    within the case, as the reference does), aggregates of the numeric event attributes in
    `NUMERIC`, and the case's requested amount. One row per prefix, in `generate_prefixes`
    order (case by case, shortest prefix first).
    """

    timezone: str
    levels: dict[str, list[str]] = field(default_factory=dict)

    def _events(self, frame: pl.DataFrame) -> pl.DataFrame:
        local = pl.col("event_time").dt.convert_time_zone(self.timezone)
        minutes_since = (pl.col("event_time") - pl.col("event_time").first().over("case_row")).dt
        amount = pl.col(AMOUNT)
        if isinstance(frame.schema[AMOUNT], pl.List):  # also a numeric feature: per event
            amount = amount.list.drop_nulls().list.first()  # a case attribute: one value
        events = (
            frame.select(
                pl.int_range(pl.len(), dtype=pl.Int64).alias("case_row"),
                "event_type",
                "lifecycle",
                "resource",
                "event_time",
                amount.alias(AMOUNT),
            )
            .explode(["event_type", "lifecycle", "resource", "event_time"])
            .filter(pl.col("event_type").is_not_null())
        )
        return events.with_columns(
            (pl.col("event_type") + "-" + pl.col("lifecycle").fill_null(MISSING)).alias("activity"),
            pl.col("resource").forward_fill().over("case_row").fill_null(MISSING),
            pl.col(AMOUNT).cast(pl.Float64, strict=False).fill_null(0.0),
            local.dt.hour().cast(pl.Float64).alias("hour"),
            local.dt.weekday().cast(pl.Float64).alias("weekday"),
            local.dt.month().cast(pl.Float64).alias("month"),
            (local.dt.hour() * 60 + local.dt.minute()).cast(pl.Float64).alias("timesincemidnight"),
            (pl.col("event_time").diff().over("case_row").dt.total_seconds(fractional=True) / 60)
            .fill_null(0.0)
            .alias("timesincelastevent"),
            (minutes_since.total_seconds(fractional=True) / 60).alias("timesincecasestart"),
            pl.int_range(1, pl.len() + 1).over("case_row").cast(pl.Float64).alias("event_nr"),
        )

    def fit(self, frame: pl.DataFrame) -> AggregationEncoder:
        events = self._events(frame)
        for column in ("activity", "resource"):
            counts = events.group_by(column).len().filter(pl.col("len") >= MIN_LEVEL_COUNT)
            self.levels[column] = sorted(counts.get_column(column).to_list())
        return self

    @property
    def feature_names(self) -> list[str]:
        names = [f"{c}={v}" for c in ("activity", "resource") for v in [*self.levels[c], OTHER]]
        names += [f"{n}_{a}" for n in NUMERIC for a in AGGREGATES]
        return [*names, AMOUNT]

    def transform(self, frame: pl.DataFrame) -> np.ndarray:
        """[number of prefixes, features] float32, rows in `generate_prefixes` order."""
        events = self._events(frame)
        case_row = events.get_column("case_row").to_numpy()
        n = len(case_row)
        starts = np.flatnonzero(np.r_[True, case_row[1:] != case_row[:-1]]) if n else np.zeros(0)
        first_of_row = np.repeat(starts, np.diff(np.r_[starts, n]).astype(np.int64))
        blocks = []
        for column in ("activity", "resource"):
            levels = self.levels[column]
            index = {v: i for i, v in enumerate(levels)}
            ids = (
                events.get_column(column)
                .replace_strict(index, default=len(levels), return_dtype=pl.Int64)
                .to_numpy()
            )
            onehot = np.zeros((n, len(levels) + 1), dtype=np.float32)
            onehot[np.arange(n), ids] = 1.0
            blocks.append(_cumsum_within(onehot, first_of_row))
        count = events.get_column("event_nr").to_numpy()[:, None]
        for name in NUMERIC:
            x = events.get_column(name).to_numpy().astype(np.float64)[:, None]
            total = _cumsum_within(x, first_of_row)
            squares = _cumsum_within(x * x, first_of_row)
            mean = total / count
            var = np.where(count > 1, (squares - total * mean) / np.maximum(count - 1, 1), 0.0)
            cummax = events.select(pl.col(name).cum_max().over("case_row")).to_numpy()
            cummin = events.select(pl.col(name).cum_min().over("case_row")).to_numpy()
            blocks.append(
                np.hstack([mean, cummax, cummin, total, np.sqrt(np.maximum(var, 0.0))]).astype(
                    np.float32
                )
            )
        blocks.append(events.get_column(AMOUNT).to_numpy().astype(np.float32)[:, None])
        return np.hstack(blocks)


def _cumsum_within(values: np.ndarray, first_of_row: np.ndarray) -> np.ndarray:
    """Cumulative sums along rows, restarting at each case (`first_of_row`: its first row)."""
    if not len(values):
        return values
    total = np.cumsum(values, axis=0, dtype=np.float64)
    before = np.vstack([np.zeros((1, values.shape[1])), total])[first_of_row]
    return (total - before).astype(values.dtype)


def _prefix_rows(frame: pl.DataFrame) -> pl.DataFrame:
    return generate_prefixes(frame.get_column("n_events").to_numpy())


@dataclass
class BoostingResult:
    probabilities: np.ndarray  # one per test prefix, in generate_prefixes order
    n_iter: int
    val_auc: float | None
    seconds: float


def fit_boosting(
    train: pl.DataFrame,
    val: pl.DataFrame,
    test: pl.DataFrame,
    y_train: np.ndarray,
    y_val: np.ndarray,
    timezone: str,
    max_iter: int,
    seed: int = 0,
    encoded: tuple[AggregationEncoder, np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> BoostingResult:
    """HistGradientBoosting on the aggregation encoding of every prefix.

    The number of boosting rounds is chosen on the val cases' prefixes (protocol AUC), then
    the model is refitted on train + val (every train case, as the reference trains).
    """
    from sklearn.ensemble import HistGradientBoostingClassifier

    started = time.perf_counter()
    _, x_train, x_val, x_test = encoded or encode_aggregates(train, val, test, timezone)
    rows_train, rows_val = _prefix_rows(train), _prefix_rows(val)
    per_prefix_train = y_train[rows_train.get_column("case_row").to_numpy()]
    per_prefix_val = y_val[rows_val.get_column("case_row").to_numpy()]

    def model(n_iter: int) -> HistGradientBoostingClassifier:
        return HistGradientBoostingClassifier(
            max_iter=n_iter,
            learning_rate=HGB_LEARNING_RATE,
            early_stopping=False,
            random_state=seed,
        )

    best_iter, best_auc = max_iter, None
    if len(per_prefix_val) and 0 < per_prefix_val.sum() < len(per_prefix_val):
        tuned = model(max_iter).fit(x_train, per_prefix_train)
        val_lengths = rows_val.get_column("prefix_len").to_numpy()
        step = max(1, max_iter // 15)
        for i, probs in enumerate(tuned.staged_predict_proba(x_val), start=1):
            if i % step and i != max_iter:
                continue
            auc = prefix_auc(val_lengths, per_prefix_val, probs[:, 1])
            if best_auc is None or auc > best_auc:
                best_iter, best_auc = i, auc
    final = model(best_iter).fit(
        np.vstack([x_train, x_val]), np.concatenate([per_prefix_train, per_prefix_val])
    )
    return BoostingResult(
        final.predict_proba(x_test)[:, 1], best_iter, best_auc, time.perf_counter() - started
    )


def encode_aggregates(
    train: pl.DataFrame, val: pl.DataFrame, test: pl.DataFrame, timezone: str
) -> tuple[AggregationEncoder, np.ndarray, np.ndarray, np.ndarray]:
    """Fit the encoder on train + val, encode all three (shared by the three tasks)."""
    encoder = AggregationEncoder(timezone).fit(pl.concat([train, val]))
    return encoder, encoder.transform(train), encoder.transform(val), encoder.transform(test)


# ----------------------------------------------------------------------------- run


@dataclass
class TaskResult:
    task: str
    transformer_auc: float
    boosting_auc: float
    published: float
    transformer_by_length: pl.DataFrame
    boosting_by_length: pl.DataFrame
    predictions: pl.DataFrame  # case_id, prefix_len, label, transformer, boosting
    details: dict[str, Any]


@dataclass
class SettingResult:
    setting: str
    cases: dict[str, int]
    tasks: dict[str, TaskResult]
    seconds: float


def run_setting(
    setting: str,
    raw: str | Path,
    tasks: list[str],
    workdir: Path = WORKDIR,
    extra_overrides: list[str] | None = None,
    hgb_max_iter: int = HGB_MAX_ITER,
    seeds: int = SEEDS,
    log: Any = print,
    threads: int | None = 1,
    refit: bool = True,
) -> SettingResult:
    """Ingest, label, split, then per task train and score both models on every prefix.

    The transformer is `seeds` models (seeds `train.seed`, `train.seed + 1`, ...) whose
    probabilities are averaged; each is also reported alone. With `refit` each is retrained
    on train + val for its early-stopped number of epochs (see `train_ensemble`).
    """
    with limited_threads(threads):
        return _run_setting(
            setting, raw, tasks, workdir, extra_overrides, hgb_max_iter, seeds, log, refit
        )


def _run_setting(
    setting: str,
    raw: str | Path,
    tasks: list[str],
    workdir: Path,
    extra_overrides: list[str] | None,
    hgb_max_iter: int,
    seeds: int,
    log: Any,
    refit: bool,
) -> SettingResult:
    started = time.perf_counter()
    config = make_config(setting, raw, workdir, extra_overrides)
    prepared = prepare_log(raw, workdir / setting, config)
    config = make_config(setting, prepared.path, workdir, extra_overrides)
    outcomes = case_outcomes(prepared.events)
    split = temporal_split(outcomes.join(prepared.amounts, on="case_id", how="left"))
    journeys = ingest_cases(config)
    cases = prefix_cases(journeys, split, sequence_columns(config))
    parts = {role: cases.filter(pl.col("role") == role) for role in ("train", "val", "test")}
    counts = {role: part.height for role, part in parts.items()}
    counts["test_prefixes"] = int(parts["test"].get_column("n_events").sum())
    counts["train_prefixes"] = int(parts["train"].get_column("n_events").sum())
    log(
        f"[{setting}] {split.cases.height:,} labelled cases -> train {counts['train']:,}, "
        f"val {counts['val']:,}, test {counts['test']:,} ({counts['test_prefixes']:,} test "
        f"prefixes); train events cut at {split.cutoff:%Y-%m-%d %H:%M} UTC"
    )
    vocabs = build_vocabularies(parts["train"], config, transformer_features(config))
    encoder = fit_encoder(parts["train"], vocabs, config)
    aggregates = encode_aggregates(
        parts["train"], parts["val"], parts["test"], config.data.timezone
    )
    test_rows = _prefix_rows(parts["test"])
    results: dict[str, TaskResult] = {}
    for task in tasks:
        y = {role: task_labels(part, task) for role, part in parts.items()}
        encoded = {role: encode_cases(part, encoder, y[role]) for role, part in parts.items()}
        if refit:
            encoded["train_val"] = encode_cases(
                pl.concat([parts["train"], parts["val"]]),
                encoder,
                np.concatenate([y["train"], y["val"]]),
            )
        ensemble = train_ensemble(config, encoder, encoded, seeds, test_rows, refit)
        boosting = fit_boosting(
            parts["train"],
            parts["val"],
            parts["test"],
            y["train"],
            y["val"],
            config.data.timezone,
            hgb_max_iter,
            seed=config.train.seed,
            encoded=aggregates,
        )
        predictions = test_rows.with_columns(
            pl.Series("transformer", ensemble.probabilities),
            pl.Series("boosting", boosting.probabilities),
        )
        case_row = predictions.get_column("case_row").to_numpy()
        labels = y["test"][case_row]
        lengths = predictions.get_column("prefix_len").to_numpy()
        by_length = {
            model: auc_by_prefix_length(lengths, labels, predictions.get_column(model).to_numpy())
            for model in ("transformer", "boosting")
        }
        result = TaskResult(
            task=task,
            transformer_auc=weighted_auc(by_length["transformer"]),
            boosting_auc=weighted_auc(by_length["boosting"]),
            published=PUBLISHED[task],
            transformer_by_length=by_length["transformer"],
            boosting_by_length=by_length["boosting"],
            predictions=predictions.with_columns(
                pl.Series("label", labels),
                parts["test"].get_column("case_id").gather(case_row).alias("case_id"),
            ),
            details={
                "positive_rate_test": float(y["test"].mean()),
                "transformer_seeds": [m.seed for m in ensemble.members],
                "transformer_refit_on_train_val": refit,
                "transformer_auc_per_seed": [
                    prefix_auc(lengths, labels, p) for p in ensemble.member_probabilities
                ],
                "transformer_best_epoch": [m.best_epoch for m in ensemble.members],
                "transformer_epochs_run": [m.epochs_run for m in ensemble.members],
                "transformer_val_auc": [m.best_val_auc for m in ensemble.members],
                "transformer_seconds": round(sum(m.seconds for m in ensemble.members), 1),
                "transformer_parameters": ensemble.members[0].model.num_parameters(),
                "boosting_iterations": boosting.n_iter,
                "boosting_val_auc": boosting.val_auc,
                "boosting_seconds": round(boosting.seconds, 1),
            },
        )
        results[task] = result
        singles = ", ".join(f"{a:.4f}" for a in result.details["transformer_auc_per_seed"])
        log(
            f"[{setting}] {task}: transformer {result.transformer_auc:.4f} ({seeds} seeds: "
            f"{singles}; {result.details['transformer_seconds']:.0f} s), boosting "
            f"{result.boosting_auc:.4f} ({boosting.n_iter} rounds, {boosting.seconds:.0f} s), "
            f"published {result.published:.2f}"
        )
    return SettingResult(setting, counts, results, time.perf_counter() - started)


@contextlib.contextmanager
def limited_threads(threads: int | None) -> Iterator[None]:
    """Cap torch's and OpenMP's (scikit-learn's) threads, restoring them afterwards.

    On a shared machine whose cores are busy, OpenMP workers spin-waiting for each other
    made both the transformer (109 s vs 9 s for 3 epochs) and the boosting (35 s vs 5 s for
    50 rounds) an order of magnitude slower than one thread.
    """
    if threads is None:
        yield
        return
    import torch
    from threadpoolctl import threadpool_limits

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with threadpool_limits(threads):
            yield
    finally:
        torch.set_num_threads(before)


def _fmt(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.4f}"


def print_table(results: list[SettingResult]) -> None:
    """Task x setting: transformer, boosting baseline, published XGBoost, and the margins."""
    header = (
        f"{'setting':<10} {'task':<10} {'transformer':>11} {'boosting':>9} {'published':>9} "
        f"{'vs published':>12} {'vs boosting':>11}"
    )
    print()
    print("BPIC 2012, AUC per prefix length 1..40 averaged by test cases per length")
    print(header)
    print("-" * len(header))
    for setting in results:
        for task in setting.tasks.values():
            print(
                f"{setting.setting:<10} {task.task:<10} {task.transformer_auc:>11.4f} "
                f"{task.boosting_auc:>9.4f} {task.published:>9.2f} "
                f"{task.transformer_auc - task.published:>+12.4f} "
                f"{task.transformer_auc - task.boosting_auc:>+11.4f}"
            )
    print()
    for setting in results:
        print(f"{setting.setting}: {SETTING_TITLES[setting.setting]}")
    print("published: Teinemaa et al. (2019), XGBoost, aggregation encoding, same protocol")


def summary_json(results: list[SettingResult]) -> dict[str, Any]:
    """The closing JSON line: the transformer's AUCs, the comparable setting first."""
    out: dict[str, Any] = {"benchmark": "bpic2012_prefix_auc"}
    by_name = {r.setting: r for r in results}
    if "reference" in by_name:
        out["comparable_setting"] = "reference"
        out["transformer_auc"] = {
            t: round(r.transformer_auc, 4) for t, r in by_name["reference"].tasks.items()
        }
    if "leak_free" in by_name:
        out["leak_free_transformer_auc"] = {
            t: round(r.transformer_auc, 4) for t, r in by_name["leak_free"].tasks.items()
        }
    out["published_xgboost"] = PUBLISHED
    return out


def save_results(results: list[SettingResult], path: Path, run_info: dict[str, Any]) -> None:
    """Everything behind the table (per-length AUCs included) as one JSON file."""
    payload = {
        **run_info,
        "settings": {
            r.setting: {
                "cases": r.cases,
                "seconds": round(r.seconds, 1),
                "tasks": {
                    t.task: {
                        "transformer_auc": t.transformer_auc,
                        "boosting_auc": t.boosting_auc,
                        "published": t.published,
                        **t.details,
                        "transformer_by_length": t.transformer_by_length.to_dicts(),
                        "boosting_by_length": t.boosting_by_length.to_dicts(),
                    }
                    for t in r.tasks.values()
                },
            }
            for r in results
        },
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))


def _csv(value: str, allowed: tuple[str, ...] | list[str], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in allowed]
    if unknown or not items:
        raise argparse.ArgumentTypeError(f"{what}: choose from {', '.join(allowed)}")
    return items


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--raw", default=str(DEFAULT_RAW), help="the BPIC 2012 event log")
    parser.add_argument(
        "--tasks", default=",".join(TASKS), type=lambda v: _csv(v, list(TASKS), "--tasks")
    )
    parser.add_argument(
        "--settings", default=",".join(SETTINGS), type=lambda v: _csv(v, SETTINGS, "--settings")
    )
    parser.add_argument("--epochs", type=int, default=None, help="max epochs (default 30)")
    parser.add_argument("--seed", type=int, default=0, help="first transformer seed")
    parser.add_argument(
        "--seeds", type=int, default=None, help=f"transformers per task (default {SEEDS})"
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2 epochs")
    parser.add_argument(
        "--no-refit",
        dest="refit",
        action="store_false",
        help="score the early-stopped transformers (trained on train only) as they are",
    )
    parser.add_argument("--workdir", default=str(WORKDIR))
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override"
    )
    args = parser.parse_args(argv)

    overrides = [f"train.seed={args.seed}"]
    if args.quick:
        overrides += QUICK_OVERRIDES
    if args.epochs is not None:
        overrides.append(f"train.max_epochs={args.epochs}")
    overrides += args.set
    workdir = Path(args.workdir)
    hgb_iter = HGB_QUICK_MAX_ITER if args.quick else HGB_MAX_ITER
    seeds = args.seeds or (1 if args.quick else SEEDS)

    import torch

    started = time.perf_counter()
    results = []
    for setting in args.settings:
        results.append(
            run_setting(
                setting,
                args.raw,
                args.tasks,
                workdir,
                overrides,
                hgb_max_iter=hgb_iter,
                seeds=seeds,
                refit=args.refit,
            )
        )
    seconds = time.perf_counter() - started
    run_info = {
        "command": "python benchmarks/bpic2012.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} at the end; Python {platform.python_version()}, "
        f"torch {torch.__version__}; 1 thread per model (see limited_threads)",
        "overrides": overrides,
        "seconds": round(seconds, 1),
    }
    save_results(results, workdir / "results.json", run_info)
    print_table(results)
    print(f"total {seconds:.0f} s; details in {workdir / 'results.json'}")
    print(json.dumps(summary_json(results)))


if __name__ == "__main__":
    main()

"""`journeys train`: the training recipe, in the order it runs.

`train_command` is the whole recipe; the sections below it follow its steps:

1. **set up**: the journeys are trainable and the tracking store answers; one MLflow run
   (rank 0 only, also under DDP; reopened on `--resume`) gets the resolved config as
   params and the ingest report;
2. **fit**: Lightning fits `JourneyModule` (`journeys.lightning_parts`: BCE on logits; each
   epoch every converted journey and a fresh sample of the others; warm-up then decay per
   step; an exponential moving average of the weights, which is what is validated and
   checkpointed), keeping the best `val_roc_auc` and the last epoch under
   `paths.checkpoints/<run_id>/`, stopping early on no improvement;
3. **evaluate**: rank 0 reloads the best checkpoint, scores val and test with the one
   inference path, fits a temperature on val, and computes test metrics and plots;
4. **baselines**: those in `train.baselines` are fitted on train, scored on the same val
   and test journeys and logged as their own runs;
5. **choose, log and register**: `journeys.promotion` decides on the val journeys alone
   whether the transformer becomes the champion (above chance, not behind a baseline by
   a paired test, ahead of the champion); the metrics, plots, the decision and the
   `TrainedModel` (`journeys.trained_model`) go to the run, and the model is registered,
   the `champion` alias moving as decided;
6. **compare**: one table of every model on the test split, reported, never chosen on.

`--resume` continues the last interrupted training from its `last.ckpt`, in the same
MLflow run: `paths.checkpoints/latest.json` records the run id beside the checkpoints.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import numpy as np
import polars as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from journeys import metrics as M
from journeys import plots, tracking
from journeys.config import redact_uri
from journeys.datasets import (
    SPLITS,
    check_trainable,
    dataset_features,
    evaluation_warnings,
    small_evaluation_warning,
    training_journeys,
)
from journeys.encoding import EncodedJourneys, fraction_of_negatives, model_config_from
from journeys.errors import JourneysError, first_line
from journeys.in_flight import QuietSurvival
from journeys.inference import attention_by_token, run_model
from journeys.lightning_parts import (
    LAST_CHECKPOINT,
    JourneyDataModule,
    JourneyModule,
    StepSchedule,
    build_trainer,
    global_rank,
    min_epoch_journeys,
    step_schedule,
)
from journeys.promotion import Decision, decide
from journeys.trained_model import JourneyRules, TrainedModel, load_model, log_model
from journeys.vocab import Vocabularies

if TYPE_CHECKING:
    from journeys.config import Config, Train
    from journeys.stacking import FittedStack
    from journeys.tracking import Registration, TrackedRun

MODEL_FAMILY = "transformer"
STATE_FILE = "latest.json"  # in paths.checkpoints: which run/checkpoints --resume continues
PROMOTION_FILE = "promotion.json"  # the champion decision, logged to the run
COMPARED_METRICS = ("roc_auc", "pr_auc", "log_loss", "brier", "ece")
# A causal model logs its AUC after each of the first this many events (BPIC's 1..20 and
# more: most journeys are shorter); the weighted average covers every length.
PREFIX_LENGTHS_LOGGED = 30


@dataclass
class TrainResult:
    """What `journeys train` produced (for the Prefect flow and the tests)."""

    run_id: str
    experiment_id: str
    metrics: dict[str, float]
    model_uri: str
    model_version: int | None
    champion_version: int | None
    promoted: bool
    checkpoint: str
    baselines: dict[str, BaselineRun] = field(default_factory=dict)
    # journey_id, label, probability (uncalibrated) on the test split, from the in-memory
    # model
    test_predictions: pl.DataFrame | None = None


def train_command(
    config: Config, resume: bool = False, sizes: dict[str, dict[str, int]] | None = None
) -> TrainResult | None:
    """`journeys train`: see the module docstring. Returns None on ranks other than 0.

    `sizes` are `check_trainable`'s split sizes when the caller checked already.
    """
    config = dataset_features(config)
    if sizes is None:
        sizes = check_trainable(
            config.paths.journeys, config.data.features, config.split.fractions,
            config.train.window_delta,
        )  # fmt: skip
    for warning in evaluation_warnings(sizes):
        print(warning, file=sys.stderr)
    # Per-file progress bars for a handful of small artifacts are noise in the log.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    root = Path(config.paths.checkpoints)
    if global_rank() != 0:  # other DDP ranks fit, and nothing else
        checkpoint_dir = Path(read_state(root)["checkpoint_dir"]) if resume else None
        with tracking.use_tracking_uri(tracking.tracking_uri(config)):
            fit(config, sizes, None, checkpoint_dir, resume)
        return None

    # 1. set up
    uri = tracking.tracking_uri(config)
    tracking.check_tracking_uri(uri)
    resumed = resumable_run(config, uri) if resume else None
    with tracking.mlflow_run(
        uri,
        config.mlflow.experiment,
        run_id=resumed,
        name=MODEL_FAMILY,
        tags={tracking.MODEL_FAMILY_TAG: MODEL_FAMILY},
    ) as run:
        checkpoint_dir = set_up(run, config, resumed is not None)
        # 2. fit
        try:
            # Lightning's MLflow logger pins the process-wide URI: for the fit only.
            with tracking.use_tracking_uri(uri):
                fitted = fit(config, sizes, run.run_id, checkpoint_dir, resume)
        except BaseException:
            print(f"training stopped; continue with `journeys train --resume` (run {run.run_id})")
            raise
        best = load_best(fitted, checkpoint_dir)
        # The labelled journeys, read once for what follows (the baselines, the choice).
        journeys = training_journeys(config.paths.journeys, config.train.window_delta).collect()
        # 3. evaluate
        print(f"evaluating {best} on val and test, logging the model")
        with tempfile.TemporaryDirectory(prefix="journeys-eval-") as tmp:
            evaluation = evaluate(fitted, Path(tmp))
            trained = TrainedModel(
                model=fitted.module.model,
                encoder=fitted.datamodule.encoder,
                rules=JourneyRules.from_config(config),
                temperature=evaluation.temperature,
                quiet_survival=quiet_survival(journeys, config.journey.max_gap_delta),
            )
            metrics = {**evaluation.metrics, **run_facts(fitted, sizes)}
            # 4. baselines, fitted on train, scored on the same val and test journeys; and
            # the stack of the transformer with one of them, when asked for
            baselines = run_baselines_beside(run, config, journeys)
            candidate = predictions(fitted.datamodule.splits["val"], evaluation.val_logits)
            if config.train.stack and not config.model.causal:
                stacked = stack_beside(config, journeys, fitted, evaluation)
                trained.stack = stacked.stack
                metrics |= stacked_metrics(stacked, fitted)
                candidate = candidate.with_columns(probability=M.sigmoid(stacked.val_logits))
            # 5. choose on val (never on test), log and register
            val = journeys.filter(pl.col("split") == "val")
            decision = choose(config, uri, val, candidate, baselines)
            registration, model_uri = log_and_register(
                run, config, trained, evaluation, metrics, best, decision
            )
        write_state(root, {**read_state(root), "status": "done"})
        print(
            f"transformer run {run.run_id}: model version {registration.version}; "
            f"{decision.summary}"
        )
        # 6. every model side by side on test: reported, never chosen on
        scores = evaluation.metrics
        rows = [(MODEL_FAMILY, scores), (f"{MODEL_FAMILY} (calibrated)", _calibrated(scores))]
        if trained.stack is not None:
            stacked = {
                f"test_{key.removeprefix('stacked_test_')}": value
                for key, value in metrics.items()
                if key.startswith("stacked_test_")
            }
            rows.append(("stacked (served)", stacked))
        rows += [(f"baseline_{name}", result.metrics) for name, result in baselines.items()]
        print_comparison(rows, sizes["test"])
        flag_baselines_ahead(run, scores, baselines)

    test = fitted.datamodule.splits["test"]
    return TrainResult(
        run_id=run.run_id,
        experiment_id=run.experiment_id,
        metrics=metrics,
        model_uri=model_uri,
        model_version=registration.version,
        champion_version=registration.champion_version,
        promoted=registration.promoted,
        checkpoint=best,
        baselines=baselines,
        test_predictions=predictions(test, evaluation.test_logits),
    )


def predictions(split: EncodedJourneys, logits: np.ndarray) -> pl.DataFrame:
    """journey_id, label and uncalibrated probability of a split's journeys."""
    return pl.DataFrame(
        {
            "journey_id": split.journey_ids,
            "label": split.labels.numpy().astype(np.int8),
            "probability": M.sigmoid(logits),
        }
    )


# ----------------------------------------------------------------------------- 1. set up


def resumable_run(config: Config, uri: str) -> str:
    """The id of the interrupted run `--resume` continues; `JourneysError` when there is
    none (no state, a finished run, a run not in this store)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    state = read_state(Path(config.paths.checkpoints))
    if state.get("status") == "done":
        raise JourneysError(
            f"nothing to resume: run {state['run_id']} finished (start with `journeys train`)"
        )
    try:
        MlflowClient(tracking_uri=uri).get_run(state["run_id"])
    except MlflowException:
        raise JourneysError(
            f"cannot resume: run {state['run_id']} is not in {redact_uri(uri)}"
        ) from None
    print(f"resuming MLflow run {state['run_id']} from {state['checkpoint_dir']}")
    return str(state["run_id"])


def set_up(run: TrackedRun, config: Config, resumed: bool) -> Path:
    """Log the config (and, for a new run, the ingest report) and record the run beside its
    checkpoints for `--resume`; return the checkpoint folder."""
    root = Path(config.paths.checkpoints)
    tracking.log_config(run, config)
    if resumed:
        return Path(read_state(root)["checkpoint_dir"])
    checkpoint_dir = root / run.run_id
    write_state(
        root,
        {
            "run_id": run.run_id,
            "experiment_id": run.experiment_id,
            "checkpoint_dir": str(checkpoint_dir),
            "tracking_uri": redact_uri(run.uri),  # a record for people: never a password on disk
            "status": "training",
        },
    )
    tracking.log_ingest_report(run, config.paths.journeys)
    return checkpoint_dir


def read_state(root: Path) -> dict[str, Any]:
    """The last training's state in `paths.checkpoints`: run id, checkpoints, status."""
    path = root / STATE_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise JourneysError(f"nothing to resume: no {path} (start with `journeys train`)") from None
    except json.JSONDecodeError as err:
        raise JourneysError(f"cannot resume: {path} is unreadable ({err})") from None


def write_state(root: Path, state: dict[str, Any]) -> None:
    from journeys.storage import write_json

    write_json(state, root / STATE_FILE)


# ----------------------------------------------------------------------------- 2. fit


@dataclass
class Fitted:
    """A finished fit: the trained module, its data (with the encoder fitted on train) and
    the checkpoint callback that knows the best epoch."""

    module: JourneyModule
    datamodule: JourneyDataModule
    checkpoint: ModelCheckpoint


def fit(
    config: Config,
    sizes: dict[str, dict[str, int]],
    run_id: str | None,
    checkpoint_dir: Path | None,
    resume: bool,
) -> Fitted:
    """Build the Lightning pieces and fit (on every rank); epoch metrics go to `run_id`."""
    from lightning.pytorch.loggers import MLFlowLogger

    L.seed_everything(config.train.seed, workers=True, verbose=False)
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and later
    vocabs = Vocabularies.load(config.paths.journeys)
    # Rank 0 alone logs, so other ranks get no logger at all: building one opens the
    # store, and two ranks creating a new SQLite store's tables at once collide (torchrun).
    logger: MLFlowLogger | bool = False
    if global_rank() == 0:
        logger = MLFlowLogger(
            experiment_name=config.mlflow.experiment,
            tracking_uri=tracking.tracking_uri(config),
            run_id=run_id,
            log_model=False,
        )
    settings = config.train
    trainer, checkpoint = build_trainer(config, logger, checkpoint_dir)
    positives, n_train = sizes["train"]["positives"], sizes["train"]["n"]
    fraction = fraction_of_negatives(
        positives,
        n_train - positives,
        settings.positive_share,
        min_epoch_journeys(settings, trainer.world_size),
    )
    if fraction < 1:
        # Other negatives every epoch: the Trainer rebuilds the train loader each time.
        trainer.reload_dataloaders_every_n_epochs = 1
    # Small logs: smaller batches, then more epochs, so the run still makes its steps.
    schedule = step_schedule(
        settings, positives + fraction * (n_train - positives), trainer.world_size
    )
    trainer.fit_loop.max_epochs = schedule.epochs
    trainer.check_val_every_n_epoch = schedule.val_every_epochs
    if global_rank() == 0:
        describe_schedule(settings, schedule)
    datamodule = JourneyDataModule.from_config(
        config, vocabs, fraction, batch_size=schedule.batch_size
    )
    model_config = model_config_from(
        config.model,
        vocabs,
        max_len=config.journey.max_events,
        n_numeric=len(config.data.numeric_features),
    )
    module = JourneyModule(model_config, settings, positives / n_train, fraction)
    last = checkpoint_dir / LAST_CHECKPOINT if (resume and checkpoint_dir) else None
    if resume and not (last and last.exists()):
        print("no checkpoint saved yet: training from the start, in the same run")
        last = None
    with warnings.catch_warnings():
        if resume:  # the run's own checkpoints are expected there
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* not empty")
        trainer.fit(module, datamodule=datamodule, ckpt_path=last)
    return Fitted(module, datamodule, checkpoint)


def load_best(fitted: Fitted, checkpoint_dir: Path) -> str:
    """Load the best checkpoint's weights into the module (the last one when no epoch was
    validated); return its path."""
    best = fitted.checkpoint.best_model_path or str(checkpoint_dir / LAST_CHECKPOINT)
    # weights_only: a checkpoint is data, never code (torch's safe unpickler).
    state = torch.load(best, map_location=fitted.module.device, weights_only=True)
    fitted.module.load_state_dict(state["state_dict"])
    fitted.datamodule.setup("test")
    return best


def describe_schedule(settings: Train, schedule: StepSchedule) -> None:
    """Say when the data changed the schedule, and warn when the warm-up outlasts the run
    (the learning rate would never reach `train.lr`)."""
    if (schedule.batch_size, schedule.epochs) != (settings.batch_size, settings.max_epochs):
        print(
            f"small log: {schedule.steps_per_epoch} steps an epoch at batch size "
            f"{schedule.batch_size} (train.batch_size {settings.batch_size}), up to "
            f"{schedule.epochs} epochs (train.max_epochs {settings.max_epochs}) validated every "
            f"{schedule.val_every_epochs}, so that the run makes train.step_floor "
            f"({settings.step_floor}) optimiser steps"
        )
    if settings.warmup_steps > schedule.steps:
        print(
            f"warning: train.warmup_steps ({settings.warmup_steps}) is longer than the whole "
            f"run ({schedule.steps} optimiser steps): the learning rate never reaches "
            "train.lr; lower train.warmup_steps or train more",
            file=sys.stderr,
        )


# ----------------------------------------------------------------------------- 3. evaluate


@dataclass
class Evaluation:
    """Test metrics (raw and temperature-calibrated), plot files, temperature, test logits."""

    metrics: dict[str, float]
    plots: dict[str, Path]
    temperature: float
    test_logits: np.ndarray
    val_logits: np.ndarray  # in the order of the data module's val split


def evaluate(fitted: Fitted, workdir: Path) -> Evaluation:
    """Score val and test with the one inference path; fit the temperature on val."""
    model, datamodule = fitted.module.model, fitted.datamodule
    batch_size = datamodule.eval_batch_size
    val, test = datamodule.splits["val"], datamodule.splits["test"]
    val_outputs = run_model(model, val, batch_size)
    val_logits = val_outputs.logits
    # One pass over test gives the logits and the pooled attention by event type.
    test_outputs = run_model(model, test, batch_size, attention="pooled")
    test_logits = test_outputs.logits
    assert test_outputs.attention is not None
    attention = attention_by_token(
        test, test_outputs.attention, datamodule.vocabs.event_type.tokens
    )
    val_labels, test_labels = val.labels.numpy(), test.labels.numpy()

    temperature = M.fit_temperature(val_logits, val_labels)
    probs = M.sigmoid(test_logits)
    calibrated = M.sigmoid(test_logits, temperature)
    scores = M.binary_metrics(test_labels, probs)
    # Calibration keeps the ranking, so the AUCs' intervals are those of the raw scores.
    calibrated_metrics = M.binary_metrics(test_labels, calibrated, intervals=False)
    scores |= {f"{k}_calibrated": v for k, v in calibrated_metrics.items()}
    scores["temperature"] = temperature
    if test_outputs.prefix_logits is not None:  # causal: a probability after every event
        scores |= prefix_metrics("val_", val_labels, val_outputs.offsets, val_outputs.prefix_logits)
        scores |= prefix_metrics(
            "test_", test_labels, test_outputs.offsets, test_outputs.prefix_logits
        )

    (workdir / "attention_by_event_type.json").write_text(json.dumps(attention, indent=2))
    curves = {MODEL_FAMILY: probs}
    files = {
        "roc": plots.plot_roc(test_labels, curves, workdir / "roc.png"),
        "pr": plots.plot_pr(test_labels, curves, workdir / "pr.png"),
        "calibration": plots.plot_calibration(
            test_labels,
            {**curves, f"{MODEL_FAMILY} (T={temperature:.2f})": calibrated},
            workdir / "calibration.png",
        ),
        "attention_by_event_type": plots.plot_attention_by_event_type(
            attention, workdir / "attention_by_event_type.png"
        ),
        "attention_table": workdir / "attention_by_event_type.json",
    }
    return Evaluation(scores, files, temperature, test_logits, val_logits)


def prefix_metrics(
    split: str, labels: np.ndarray, offsets: np.ndarray, prefix_logits: np.ndarray
) -> dict[str, float]:
    """A causal model's ROC AUC after every event, each prefix labelled with its journey's
    outcome: by prefix length (`<split>prefix_roc_auc_len<k>`, lengths up to
    `PREFIX_LENGTHS_LOGGED`) and their average weighted by how many prefixes have each
    length (`<split>prefix_roc_auc_weighted`, as the BPIC 2012 protocol reports it)."""
    lengths = np.diff(offsets)
    prefix_len = np.arange(len(prefix_logits)) - np.repeat(offsets[:-1], lengths) + 1
    by_length, counts, aucs = M.auc_by_prefix_length(
        prefix_len, np.repeat(labels, lengths), prefix_logits
    )
    out = {f"{split}prefix_roc_auc_weighted": M.weighted_prefix_auc(counts, aucs)}
    for length, auc in zip(by_length, aucs, strict=True):
        if length <= PREFIX_LENGTHS_LOGGED and not np.isnan(auc):
            out[f"{split}prefix_roc_auc_len{length}"] = float(auc)
    return out


def quiet_survival(journeys: pl.DataFrame, max_gap: timedelta) -> QuietSurvival | None:
    """How long the train split's journeys stay quiet, by outcome: stored with the model
    to score open journeys (`journeys.in_flight`)."""
    return QuietSurvival.fit(journeys.filter(pl.col("split") == "train"), max_gap)


def run_facts(fitted: Fitted, sizes: dict[str, dict[str, int]]) -> dict[str, float]:
    """What the run logs beside the test metrics: split sizes, parameters, the share of
    negatives drawn per epoch and the best validation AUC."""
    facts = {f"n_{split}": float(sizes[split]["n"]) for split in SPLITS}
    facts["n_parameters"] = float(fitted.module.model.num_parameters())
    facts["negative_fraction"] = fitted.module.negative_fraction
    if fitted.checkpoint.best_model_score is not None:
        facts["best_val_roc_auc"] = float(fitted.checkpoint.best_model_score)
    return facts


# ----------------------------------------------------------------------------- 4. baselines


@dataclass
class BaselineRun:
    run_id: str | None
    metrics: dict[str, float]
    val_scores: pl.DataFrame  # journey_id, probability: what promotion compares


def run_baselines_beside(
    run: TrackedRun, config: Config, frame: pl.DataFrame
) -> dict[str, BaselineRun]:
    """The configured baselines, fitted on the train journeys of `frame` (labelled, every
    split) and logged in the same experiment, tagged with the transformer run's id (their
    comparison group)."""
    from journeys.baselines import run_baselines

    results = []
    group = {tracking.COMPARISON_GROUP_TAG: run.run_id}
    val = frame.filter(pl.col("split") == "val")
    if config.train.baselines:
        with tempfile.TemporaryDirectory(prefix="journeys-baselines-") as tmp:
            results = run_baselines(
                list(config.train.baselines),
                frame.filter(pl.col("split") == "train"),
                val,
                frame.filter(pl.col("split") == "test"),
                config,
                Path(tmp),
                tags=group,
            )
    run.set_tags(group)
    ids = val.get_column("journey_id")
    return {
        r.name: BaselineRun(
            r.run_id, r.metrics, pl.DataFrame({"journey_id": ids, "probability": r.val_probs})
        )
        for r in results
    }


# ----------------------------------------------------------------------------- 5. choose, register


def stack_beside(
    config: Config, journeys: pl.DataFrame, fitted: Fitted, evaluation: Evaluation
) -> FittedStack:
    """`train.stack`: gradient boosting on aggregates fitted on train, blended with the
    transformer on val (`journeys.stacking`)."""
    from journeys.baselines import JourneyAggregates
    from journeys.stacking import fit_stack

    def in_order(split: str) -> pl.DataFrame:  # the data module's order, as the logits
        ids = pl.DataFrame({"journey_id": fitted.datamodule.splits[split].journey_ids})
        return ids.join(journeys, on="journey_id", how="left", maintain_order="left")

    print("stack: gradient boosting on journey aggregates, blended with the transformer on val")
    aggregates = JourneyAggregates(
        config.data.features,
        config.data.timezone,
        config.model.visit_gap_s,
        config.data.numeric_features,
    )
    return fit_stack(
        journeys.filter(pl.col("split") == "train"),
        in_order("val"),
        in_order("test"),
        evaluation.val_logits,
        evaluation.test_logits,
        aggregates,
        config.train.seed,
    )


def stacked_metrics(stacked: FittedStack, fitted: Fitted) -> dict[str, float]:
    """The stack's test metrics (`stacked_test_*`) and its cross-fitted val ROC AUC."""
    val, test = fitted.datamodule.splits["val"], fitted.datamodule.splits["test"]
    scores = M.binary_metrics(
        test.labels.numpy(), M.sigmoid(stacked.test_logits), prefix="stacked_test_"
    )
    val_scores = M.binary_metrics(
        val.labels.numpy(), M.sigmoid(stacked.val_logits), prefix="stacked_val_", intervals=False
    )
    return scores | {"stacked_val_roc_auc": val_scores["stacked_val_roc_auc"]}


def choose(
    config: Config,
    uri: str,
    val: pl.DataFrame,
    candidate: pl.DataFrame,
    baselines: dict[str, BaselineRun],
) -> Decision:
    """Whether this run's model (`candidate`: journey_id and its val probability: the
    transformer's, or the stack's cross-fitted) becomes the champion, decided on the `val`
    journeys alone (`journeys.promotion`): against chance, the baselines and the champion."""
    ids = val.select("journey_id")

    def on_val(scores: pl.DataFrame) -> np.ndarray:
        return ids.join(scores, on="journey_id", how="left").get_column("probability").to_numpy()

    return decide(
        val.get_column("label").to_numpy(),
        on_val(candidate),
        {name: on_val(baseline.val_scores) for name, baseline in baselines.items()},
        champion_val_scores(config, uri, val),
        config.promotion,
    )


def champion_val_scores(config: Config, uri: str, val: pl.DataFrame) -> np.ndarray | float | None:
    """The current champion's scores on this run's val journeys (None: no champion yet),
    or its logged val ROC AUC when it cannot score them (a model of other features)."""
    name = config.mlflow.registered_model
    version = tracking.champion_version(uri, name)
    if version is None:
        return None
    try:
        return load_model(f"models:/{name}/{version.version}", tracking_uri=uri).predict_proba(val)
    except Exception as err:
        logged = tracking.logged_val_roc_auc(uri, version)
        print(
            f"warning: champion v{version.version} cannot score these val journeys "
            f"({first_line(err)}): compared by its logged val ROC AUC ({logged:.4f})",
            file=sys.stderr,
        )
        return logged


def log_and_register(
    run: TrackedRun,
    config: Config,
    trained: TrainedModel,
    evaluation: Evaluation,
    metrics: dict[str, float],
    best: str,
    decision: Decision,
) -> tuple[Registration, str]:
    """Log metrics, plots, the decision and the model to the run, and register the model
    (the `champion` alias moves as `decision` says); return the registration and the
    logged model's URI."""
    run.log_metrics({**metrics, **{f"val_roc_auc_{k}": v for k, v in decision.val_roc_auc.items()}})
    for path in evaluation.plots.values():
        run.log_artifact(path, "plots")
    run.log_dict(decision.to_dict(), PROMOTION_FILE)
    run.set_tags({tracking.BEST_CHECKPOINT_TAG: best})
    with run.active():
        info = log_model(trained)
    registration = tracking.register_model(
        run, info.model_uri, config.mlflow.registered_model, decision
    )
    return registration, info.model_uri


# ----------------------------------------------------------------------------- 6. compare


def flag_baselines_ahead(
    run: TrackedRun, scores: dict[str, float], baselines: dict[str, BaselineRun]
) -> list[str]:
    """Say so, on the console and as a run tag, when a baseline beats the transformer
    beyond the transformer's 95% interval."""
    from journeys.baselines import ahead_of_transformer

    ahead = ahead_of_transformer(scores, {name: b.metrics for name, b in baselines.items()})
    run.set_tags({tracking.BASELINES_AHEAD_TAG: ",".join(ahead) or "none"})
    for name in ahead:
        print(
            f"warning: baseline_{name} (test ROC AUC "
            f"{baselines[name].metrics['test_roc_auc']:.4f}) beats the transformer beyond its "
            f"95% interval ({M.format_metric(scores, 'roc_auc')}): prefer it, or give "
            "the transformer what it uses (docs/model.md)"
        )
    return ahead


def _calibrated(scores: dict[str, float]) -> dict[str, float]:
    """The calibrated row of the comparison: the raw ranking metrics and their intervals
    (a temperature keeps the order; clipped probabilities would only add ties), the
    calibrated log loss, Brier score and ECE."""
    calibrated = {f"test_{m}": scores[f"test_{m}_calibrated"] for m in COMPARED_METRICS}
    ranking = [f"test_{m}{end}" for m in M.INTERVAL_METRICS for end in ("", "_ci_low", "_ci_high")]
    return calibrated | {name: scores[name] for name in ranking}


def print_comparison(rows: list[tuple[str, dict[str, float]]], sizes: dict[str, int]) -> None:
    """One table of every model's test metrics (higher AUCs, lower losses are better), with
    95% intervals of the AUCs, and a word when the test split is too small to tell."""
    from rich.console import Console
    from rich.table import Table

    title = f"Test metrics (same test split: {sizes['n']:,} journeys, {sizes['positives']:,} conversions; 95% intervals)"
    table = Table(title=title)
    table.add_column("model")
    for name in COMPARED_METRICS:
        table.add_column(name, justify="right")
    for model, scores in rows:
        table.add_row(model, *(M.format_metric(scores, m) for m in COMPARED_METRICS))
    Console(width=max(120, int(os.environ.get("COLUMNS", "120")))).print(table)
    if warning := small_evaluation_warning("test", sizes):
        print(warning)

"""Train the conversion transformer with Lightning, evaluate it, log everything to MLflow.

`journeys train` (`train_command`) does, in order:

1. fail fast: the journeys dataset is there and trainable, the tracking store answers;
2. one MLflow run (created by global rank 0 only, also under DDP) gets the resolved
   config as params and the ingest report;
3. Lightning fits `JourneyModule` (BCE on logits; each epoch every converted journey and
   a fresh sample of the others, `train.positive_share`; AdamW/Adam, warm-up then
   inverse-sqrt or cosine decay per step, gradient clipping), keeping an exponential
   moving average (EMA) of the weights, which is what is validated and checkpointed (the
   best `val_roc_auc` and the last epoch, under `paths.checkpoints/<run_id>/`), stopping
   early on no improvement;
4. rank 0 reloads the best checkpoint, scores val and test, fits a temperature on val,
   logs test metrics (raw and calibrated), plots and the model (safetensors + JSON), and
   registers it: alias `champion` moves only when `test_roc_auc` beats the champion's;
5. the baselines in `train.baselines` are fitted and logged as their own runs, and one
   table compares every model on the test split.

The Lightning pieces (data module, module, schedule, weight average, Trainer) are in
`journeys.lightning_parts`; the one inference path in `journeys.inference`.

`--resume` continues the last interrupted training from its `last.ckpt`, in the same
MLflow run: `paths.checkpoints/latest.json` records the run id beside the checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import numpy as np
import polars as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from journeys import metrics as M
from journeys import packaging, plots, tracking
from journeys.config import redact_uri
from journeys.datasets import (
    SPLITS,
    check_trainable,
    evaluation_warnings,
    labelled,
    scan_journeys,
    small_evaluation_warning,
)
from journeys.encoding import fraction_of_negatives, model_config_from
from journeys.errors import JourneysError, first_line, run_status
from journeys.in_flight import QuietSurvival
from journeys.inference import attention_by_token, run_model
from journeys.lightning_parts import (
    LAST_CHECKPOINT,
    JourneyDataModule,
    JourneyModule,
    build_trainer,
    global_rank,
    min_epoch_journeys,
)
from journeys.vocab import Vocabularies

if TYPE_CHECKING:
    from journeys.config import Config, Train

MODEL_FAMILY = "transformer"
STATE_FILE = "latest.json"  # in paths.checkpoints: which run/checkpoints --resume continues
COMPARED_METRICS = ("roc_auc", "pr_auc", "log_loss", "brier", "ece")
# A causal model logs its AUC after each of the first this many events (BPIC's 1..20 and
# more: most journeys are shorter); the weighted average covers every length.
PREFIX_LENGTHS_LOGGED = 30


# ----------------------------------------------------------------------------- resume state


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


# ----------------------------------------------------------------------------- result


@dataclass
class BaselineRun:
    run_id: str | None
    metrics: dict[str, float]


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
    # journey_id, label, probability (uncalibrated) on the test split, from the in-memory model
    test_predictions: pl.DataFrame | None = None


@dataclass
class FittedRun:
    """A finished fit on rank 0: what evaluation, logging and registration start from."""

    config: Config
    uri: str
    run_id: str
    experiment_id: str
    checkpoint_dir: Path
    module: JourneyModule
    checkpoint: ModelCheckpoint
    datamodule: JourneyDataModule
    vocabs: Vocabularies
    sizes: dict[str, dict[str, int]]


# ----------------------------------------------------------------------------- evaluation


@dataclass
class Evaluation:
    """Test metrics (raw and temperature-calibrated), plot files, temperature, test logits."""

    metrics: dict[str, float]
    plots: dict[str, Path]
    temperature: float
    test_logits: np.ndarray


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


def evaluate(
    module: JourneyModule, datamodule: JourneyDataModule, vocabs: Vocabularies, workdir: Path
) -> Evaluation:
    """Score val and test with the one inference path; fit the temperature on val."""
    model = module.model
    batch_size = datamodule.eval_batch_size
    val, test = datamodule.splits["val"], datamodule.splits["test"]
    val_outputs = run_model(model, val, batch_size)
    val_logits = val_outputs.logits
    # One pass over test gives the logits and the pooled attention by event type.
    test_outputs = run_model(model, test, batch_size, attention="pooled")
    test_logits = test_outputs.logits
    assert test_outputs.attention is not None
    attention = attention_by_token(test, test_outputs.attention, vocabs.event_type.tokens)
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
    return Evaluation(scores, files, temperature, test_logits)


# ----------------------------------------------------------------------------- command


def planned_steps(settings: Train, epoch_journeys: float, world_size: int) -> int:
    """Optimiser steps of a run that goes all `max_epochs` (early stopping may end sooner)."""
    per_epoch = math.ceil(epoch_journeys / (settings.batch_size * world_size))
    return per_epoch * settings.max_epochs


def warn_short_run(settings: Train, epoch_journeys: float, world_size: int) -> None:
    """A run whose warm-up outlasts it never trains at `train.lr`: say so before it starts."""
    steps = planned_steps(settings, epoch_journeys, world_size)
    if settings.warmup_steps > steps:
        print(
            f"warning: train.warmup_steps ({settings.warmup_steps}) is longer than the whole "
            f"run ({steps} optimiser steps): the learning rate never reaches train.lr; lower "
            "train.warmup_steps or train more",
            file=sys.stderr,
        )


def _start_run(config: Config, uri: str, resume: bool) -> tuple[str, str, Path]:
    """Rank 0: create (or reopen, on resume) the one MLflow run; return ids and checkpoint dir."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    root = Path(config.paths.checkpoints)
    experiment_id = tracking.get_experiment_id(uri, config.mlflow.experiment)
    client = MlflowClient(tracking_uri=uri)
    if resume:
        state = read_state(root)
        if state.get("status") == "done":
            raise JourneysError(
                f"nothing to resume: run {state['run_id']} finished (start with `journeys train`)"
            )
        try:
            run = client.get_run(state["run_id"])
        except MlflowException:
            raise JourneysError(
                f"cannot resume: run {state['run_id']} is not in {redact_uri(uri)}"
            ) from None
        run_id, experiment_id = run.info.run_id, run.info.experiment_id
        print(f"resuming MLflow run {run_id} from {state['checkpoint_dir']}")
        tracking.log_config(client, run_id, config)
        return run_id, experiment_id, Path(state["checkpoint_dir"])
    run = client.create_run(
        experiment_id, run_name=MODEL_FAMILY, tags={tracking.MODEL_FAMILY_TAG: MODEL_FAMILY}
    )
    run_id = run.info.run_id
    checkpoint_dir = root / run_id
    write_state(
        root,
        {
            "run_id": run_id,
            "experiment_id": experiment_id,
            "checkpoint_dir": str(checkpoint_dir),
            "tracking_uri": redact_uri(uri),  # a record for people: never a password on disk
            "status": "training",
        },
    )
    tracking.log_config(client, run_id, config)
    tracking.log_ingest_report(client, run_id, config.paths.journeys)
    return run_id, experiment_id, checkpoint_dir


def train_command(
    config: Config, resume: bool = False, sizes: dict[str, dict[str, int]] | None = None
) -> TrainResult | None:
    """`journeys train`: see the module docstring. Returns None on ranks other than 0.

    `sizes` are `check_trainable`'s split sizes when the caller checked already.
    """
    if sizes is None:
        sizes = check_trainable(config.paths.journeys, config.data.features, config.split.fractions)
    for warning in evaluation_warnings(sizes):
        print(warning, file=sys.stderr)
    # Per-file progress bars for a handful of small artifacts are noise in the log.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = tracking.tracking_uri(config)
    # MLflow's fluent API (log_model, register_model) and Lightning's logger use the
    # process-wide URI: set it for this training only.
    with tracking.use_tracking_uri(uri):
        return _train(config, resume, uri, sizes)


def _fit(
    config: Config,
    resume: bool,
    uri: str,
    sizes: dict[str, dict[str, int]],
    run_id: str | None,
    checkpoint_dir: Path | None,
) -> tuple[L.Trainer, ModelCheckpoint, JourneyModule, JourneyDataModule, Vocabularies]:
    """Build the Lightning pieces and fit (on every rank)."""
    from lightning.pytorch.loggers import MLFlowLogger

    rank = global_rank()
    L.seed_everything(config.train.seed, workers=True, verbose=False)
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high")  # TF32 matmuls on Ampere and later
    vocabs = Vocabularies.load(config.paths.journeys)
    # Off rank 0 the logger never creates a run: its experiment is rank-zero only.
    logger = MLFlowLogger(
        experiment_name=config.mlflow.experiment, tracking_uri=uri, run_id=run_id, log_model=False
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
    if rank == 0:
        epoch_journeys = positives + fraction * (n_train - positives)
        warn_short_run(settings, epoch_journeys, trainer.world_size)
    datamodule = JourneyDataModule.from_config(config, vocabs, fraction)
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
    return trainer, checkpoint, module, datamodule, vocabs


def _train(
    config: Config, resume: bool, uri: str, sizes: dict[str, dict[str, int]]
) -> TrainResult | None:

    rank = global_rank()
    run_id = experiment_id = None
    checkpoint_dir: Path | None = None
    if rank == 0:
        tracking.check_tracking_uri(uri)
        run_id, experiment_id, checkpoint_dir = _start_run(config, uri, resume)
    elif resume:
        checkpoint_dir = Path(read_state(Path(config.paths.checkpoints))["checkpoint_dir"])

    try:
        trainer, checkpoint, module, datamodule, vocabs = _fit(
            config, resume, uri, sizes, run_id, checkpoint_dir
        )
    except BaseException as err:
        if rank == 0:
            print(f"training stopped; continue with `journeys train --resume` (run {run_id})")
            _end_run(uri, run_id, run_status(err))
        raise
    if trainer.global_rank != 0:
        return None
    assert run_id is not None and experiment_id is not None and checkpoint_dir is not None
    return _finish(
        FittedRun(
            config,
            uri,
            run_id,
            experiment_id,
            checkpoint_dir,
            module,
            checkpoint,
            datamodule,
            vocabs,
            sizes,
        )
    )


def _finish(run: FittedRun) -> TrainResult:
    """Rank 0 after fit: evaluate the best checkpoint, log, register, run baselines, compare."""
    best = run.checkpoint.best_model_path or str(run.checkpoint_dir / LAST_CHECKPOINT)
    print(f"evaluating {best} on val and test, logging the model")
    try:
        # weights_only: a checkpoint is data, never code (torch's safe unpickler).
        state = torch.load(best, map_location=run.module.device, weights_only=True)
        run.module.load_state_dict(state["state_dict"])
        run.datamodule.setup("test")
    except BaseException as err:  # the fit's logger closed the run FINISHED already
        _end_run(run.uri, run.run_id, run_status(err))
        raise
    evaluation, metrics, registration, model_uri = _log_and_register(run, best)
    root = Path(run.config.paths.checkpoints)
    write_state(root, {**read_state(root), "status": "done"})
    print(
        f"transformer run {run.run_id}: model version {registration.version}; {registration.reason}"
    )
    baselines = _run_baselines(run)
    scores = evaluation.metrics
    rows = [(MODEL_FAMILY, scores), (f"{MODEL_FAMILY} (calibrated)", _calibrated(scores))]
    rows += [(f"baseline_{name}", result.metrics) for name, result in baselines.items()]
    print_comparison(rows, run.sizes["test"])
    flag_baselines_ahead(run, scores, baselines)
    test = run.datamodule.splits["test"]
    predictions = pl.DataFrame(
        {
            "journey_id": test.journey_ids,
            "label": test.labels.numpy().astype(np.int8),
            "probability": M.sigmoid(evaluation.test_logits),
        }
    )
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
        test_predictions=predictions,
    )


def quiet_survival(config: Config) -> QuietSurvival | None:
    """How long the train split's journeys stay quiet, by outcome: stored with the model
    to score open journeys (`journeys.in_flight`)."""
    train = (
        labelled(scan_journeys(config.paths.journeys), ("train",))
        .select("label", "end_time", "event_time")
        .collect()
    )
    return QuietSurvival.fit(train, config.journey.max_gap_delta)


def _log_and_register(
    run: FittedRun, best: str
) -> tuple[Evaluation, dict[str, float], tracking.Registration, str]:
    """Evaluate, log metrics, plots and the model to the run, and register the model."""
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=run.uri)
    module, sizes = run.module, run.sizes
    with (
        tempfile.TemporaryDirectory(prefix="journeys-eval-") as tmp,
        mlflow.start_run(run_id=run.run_id),
    ):
        try:
            evaluation = evaluate(module, run.datamodule, run.vocabs, Path(tmp))
            best_score = run.checkpoint.best_model_score
            extra = {f"n_{split}": float(sizes[split]["n"]) for split in SPLITS}
            extra["n_parameters"] = float(module.model.num_parameters())
            extra["negative_fraction"] = module.negative_fraction
            if best_score is not None:
                extra["best_val_roc_auc"] = float(best_score)
            metrics = {**evaluation.metrics, **extra}
            tracking.log_metrics(client, run.run_id, metrics)
            for path in evaluation.plots.values():
                client.log_artifact(run.run_id, str(path), "plots")
            client.set_tag(run.run_id, tracking.BEST_CHECKPOINT_TAG, best)
            inputs = run.datamodule.continuous
            preprocessing = packaging.preprocessing_settings(
                run.config, inputs.numeric, quiet_survival(run.config), inputs.bucket_edges
            )
            module.model.cpu()  # weights are saved from CPU tensors
            info = packaging.log_model(
                module.model, run.vocabs, preprocessing, evaluation.temperature
            )
            registration = tracking.register_model(
                client,
                info.model_uri,
                run.config.mlflow.registered_model,
                run.run_id,
                evaluation.metrics["test_roc_auc"],
            )
        except BaseException as err:
            mlflow.end_run(run_status(err))
            raise
    return evaluation, metrics, registration, info.model_uri


def _end_run(uri: str, run_id: str | None, status: str) -> None:
    """Close the run as `status` (Lightning's logger marks any interrupted fit FAILED)."""
    if run_id is None:
        return
    from mlflow import MlflowClient

    try:
        MlflowClient(tracking_uri=uri).set_terminated(run_id, status)
    except Exception as err:  # the run's state is a courtesy; the error that stopped us wins
        print(f"could not mark MLflow run {run_id} {status}: {first_line(err)}", file=sys.stderr)


def _run_baselines(run: FittedRun) -> dict[str, BaselineRun]:
    """The configured baselines, fitted on train and logged in the same experiment."""
    from mlflow import MlflowClient

    from journeys.baselines import run_baselines

    config = run.config
    results = []
    if config.train.baselines:
        frame = labelled(scan_journeys(config.paths.journeys), ("train", "test")).collect()
        with tempfile.TemporaryDirectory(prefix="journeys-baselines-") as tmp:
            results = run_baselines(
                list(config.train.baselines),
                frame.filter(pl.col("split") == "train"),
                frame.filter(pl.col("split") == "test"),
                config,
                run.experiment_id,
                Path(tmp),
                tags={tracking.COMPARISON_GROUP_TAG: run.run_id},
            )
    client = MlflowClient(tracking_uri=run.uri)
    client.set_tag(run.run_id, tracking.COMPARISON_GROUP_TAG, run.run_id)
    return {r.name: BaselineRun(r.run_id, r.metrics) for r in results}


def flag_baselines_ahead(
    run: FittedRun, scores: dict[str, float], baselines: dict[str, BaselineRun]
) -> list[str]:
    """Say so, on the console and as a run tag, when a baseline beats the transformer
    beyond the transformer's 95% interval."""
    from mlflow import MlflowClient

    from journeys.baselines import ahead_of_transformer

    ahead = ahead_of_transformer(scores, {name: b.metrics for name, b in baselines.items()})
    MlflowClient(tracking_uri=run.uri).set_tag(
        run.run_id, tracking.BASELINES_AHEAD_TAG, ",".join(ahead) or "none"
    )
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

"""`journeys train`: the training recipe, in the order it runs.

`train_command` is the whole recipe; the sections below it follow its steps, each given
the part of the configuration it reads (a section, or a value; the few that take the whole
`Config` say why):

1. **set up**: the journeys are trainable and the tracking store answers; one MLflow run
   (rank 0 only, also under DDP; reopened on `--resume`) gets the resolved config as
   params and the ingest report;
2. **fit**: Lightning fits `JourneyModule` (`journeys.lightning_parts`: BCE on logits; each
   epoch every converted journey and a fresh sample of the others; warm-up then decay per
   step; an exponential moving average of the weights, which is what is validated and
   checkpointed), keeping the best `val_roc_auc` and the last epoch under
   `paths.checkpoints/<run_id>/`, stopping early on no improvement;
   with `train.search`, one fit per trial of a short search (`journeys.search`), each an
   MLflow run nested under the training run, and the best trial on val kept;
3. **evaluate**: rank 0 reloads the best checkpoint, scores val and test with the one
   inference path, fits a temperature on val, and computes test metrics and plots;
4. **the other candidates**: the baselines in `train.baselines` are fitted on train,
   scored on the same val and test journeys and logged as their own runs; the stack
   (`train.stack`) blends the transformer with `hgb_aggregates`' model; each candidate
   gets honest val probabilities (the transformer's checkpoint and the calibrations
   cross-fitted on val);
5. **choose, log and register**: `journeys.promotion` picks on the val journeys alone
   which candidate is registered (above chance, the best on val with ties to the
   transformer, not clearly worse on PR AUC or log loss) and whether it becomes the
   champion (ahead of the champion); the metrics, plots, the decision and the
   `TrainedModel` (`journeys.trained_model`: the transformer, serving the chosen
   candidate's probability) go to the run, and the model is registered with its
   `model_kind`, the `champion` alias moving as decided;
6. **compare**: one table of every candidate on the test split, reported, never chosen on.

`--resume` continues the last interrupted training from its `last.ckpt`, in the same
MLflow run: `paths.checkpoints/latest.json` records the run id beside the checkpoints.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import numpy as np
import polars as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from journeys import metrics as M
from journeys import plots, tracking
from journeys.baselines import BaselineSettings
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
from journeys.errors import ConfigError, Interrupted, JourneysError, first_line
from journeys.in_flight import QuietSurvival, recalibrate_in_flight
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
from journeys.model import PiecewiseLinearInputs
from journeys.promotion import STACK, TRANSFORMER, Decision, baseline_kind, decide
from journeys.trained_model import JourneyRules, TrainedModel, load_model, log_model
from journeys.vocab import Vocabularies

if TYPE_CHECKING:
    from collections.abc import Iterator
    from contextlib import AbstractContextManager

    from journeys.baselines import Baseline, BaselineResult
    from journeys.config import Config, Model, Promotion, Train
    from journeys.reference import Reference
    from journeys.stacking import Stack
    from journeys.tracking import Registration, TrackedRun

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
    registration: Registration
    checkpoint: str
    baselines: dict[str, BaselineResult] = field(default_factory=dict)
    model_kind: str = TRANSFORMER  # the candidate the registered version serves
    # journey_id, label, probability (uncalibrated) on the test split, from the in-memory
    # transformer
    test_predictions: pl.DataFrame | None = None

    @property
    def model_version(self) -> int:
        """The registered version of this run's model."""
        return self.registration.version

    @property
    def champion_version(self) -> int | None:
        """The champion's version after this run (None: no champion yet)."""
        return self.registration.champion_version

    @property
    def promoted(self) -> bool:
        """Whether this run's model became the champion."""
        return self.registration.promoted


def train_command(
    config: Config, resume: bool = False, sizes: dict[str, dict[str, int]] | None = None
) -> TrainResult | None:
    """`journeys train`: see the module docstring. Returns None on ranks other than 0.

    `sizes` are `check_trainable`'s split sizes when the caller checked already.
    """
    config, sizes = trainable(config, sizes)
    root, model_name = Path(config.paths.checkpoints), config.mlflow.registered_model
    if global_rank() != 0:  # other DDP ranks fit, and nothing else
        return fit_on_other_rank(config, sizes, root, resume)
    # 1. set up
    uri = tracking.tracking_uri(config)
    tracking.check_tracking_uri(uri)
    if resume and config.train.search.trials:
        raise ConfigError(
            "train.search cannot resume (a search starts afresh): run `journeys train` again"
        )
    resumed = resumable_run(root, uri) if resume else None
    with transformer_run(uri, config.mlflow.experiment, resumed) as run:
        checkpoint_dir = set_up(run, config, resumed is not None)
        # 2. fit (with `train.search`: the best of its trials, with its configuration)
        if config.train.search.trials:
            config, fitted, best = fit_searched(config, sizes, run, checkpoint_dir)
        else:
            fitted, best = fit_best(config, sizes, run.run_id, checkpoint_dir, resume, uri)
        journeys = training_journeys(config.paths.journeys, config.train.window_delta).collect()
        print(f"evaluating {best} on val and test, logging the model")
        with tempfile.TemporaryDirectory(prefix="journeys-eval-") as tmp:  # plots, until logged
            # 3. evaluate; 4. the other candidates, on the same journeys
            evaluation = evaluate(fitted, Path(tmp))
            splits = in_data_module_order(journeys, fitted)
            baselines = run_baselines_beside(run, config, splits)
            booster = BaselineSettings.from_config(config)  # the stack's, if no hgb baseline
            candidates = candidates_beside(
                config.train, config.model, booster, splits, fitted, evaluation, baselines
            )
            # 5. choose among them on val (never on test), log and register
            decision = choose(config.promotion, model_name, uri, candidates, splits["val"])
            rules = JourneyRules.from_config(config)  # what a journey is, kept with the model
            trained = served_model(
                fitted, evaluation, rules, candidates, decision, journeys, splits["val"],
                config.paths.journeys,
            )  # fmt: skip
            metrics = run_metrics(fitted, sizes, evaluation, candidates, decision)
            registration, model_uri = log_and_register(
                run, model_name, trained, evaluation, metrics, best, decision
            )
        mark_done(root, run.run_id, registration, decision)
        # 6. every model side by side on test: reported, never chosen on
        print_comparison(candidates.comparison(decision.kind), sizes["test"])
        flag_baselines_ahead(run, evaluation.metrics, baselines)
    test = predictions(fitted.datamodule.splits["test"], evaluation.test_logits)
    return TrainResult(
        run_id=run.run_id, experiment_id=run.experiment_id, metrics=metrics,
        model_uri=model_uri, registration=registration, checkpoint=best,
        baselines=baselines, model_kind=decision.kind, test_predictions=test,
    )  # fmt: skip


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


def trainable(
    config: Config, sizes: dict[str, dict[str, int]] | None
) -> tuple[Config, dict[str, dict[str, int]]]:
    """`config` with the features its journeys were ingested with (`dataset_features`), and
    the journeys' split sizes, checked trainable (`check_trainable`) unless the caller gave
    them; a warning for val or test with too few conversions.

    Takes the whole `Config`: it returns it resolved, for every step after it.
    """
    config = dataset_features(config)
    if sizes is None:
        sizes = check_trainable(
            config.paths.journeys, config.data.features, config.split.fractions,
            config.train.window_delta,
        )  # fmt: skip
    for warning in evaluation_warnings(sizes):
        print(warning, file=sys.stderr)
    return config, sizes


def resumable_run(root: Path, uri: str) -> str:
    """The id of the interrupted run `--resume` continues, from the state in `root`
    (`paths.checkpoints`); `JourneysError` when there is none (no state, a finished run, a
    run not in this store)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    state = read_state(root)
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


def transformer_run(
    uri: str, experiment: str, run_id: str | None
) -> AbstractContextManager[TrackedRun | None]:
    """The transformer's MLflow run in `experiment` (`tracking.mlflow_run`): a new one, or
    `run_id` reopened (`--resume`)."""
    tags = {tracking.MODEL_FAMILY_TAG: TRANSFORMER}
    return tracking.mlflow_run(uri, experiment, run_id=run_id, name=TRANSFORMER, tags=tags)


def set_up(run: TrackedRun, config: Config, resumed: bool) -> Path:
    """Log the config (and, for a new run, the ingest report) and record the run beside its
    checkpoints for `--resume`; return the checkpoint folder.

    Takes the whole `Config`: all of it is logged as the run's params.
    """
    # Per-file progress bars for a handful of small artifacts are noise in the log.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    root = Path(config.paths.checkpoints)
    # A searched setting is logged when the search has chosen it (`fit_searched`): never
    # a value that did not act.
    tracking.log_config(run, config, skip=searched_settings(config))
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
    # A search's other trials' validated epochs (val logits, the same journeys in the same
    # order): choices the search had, judged with this fit's own (`val_choices`).
    other_trials: list[torch.Tensor] = field(default_factory=list)

    def val_choices(self) -> list[torch.Tensor]:
        """Every validated epoch's val logits that could have been kept: this fit's, and
        with `train.search` every other trial's."""
        return [*self.module.val_history, *self.other_trials]


@contextmanager
def resume_hint(run_id: str) -> Iterator[None]:
    """However the fit stops early (an error, Ctrl+C), say how to continue it."""
    try:
        yield
    except BaseException:
        print(f"training stopped; continue with `journeys train --resume` (run {run_id})")
        raise


@contextmanager
def search_hint() -> Iterator[None]:
    """However a search stops early, say that it starts again (it does not resume)."""
    try:
        yield
    except BaseException:
        print("training stopped during train.search; a search starts afresh: `journeys train`")
        raise


def fit(
    config: Config,
    sizes: dict[str, dict[str, int]],
    run_id: str | None,
    checkpoint_dir: Path | None,
    resume: bool,
) -> Fitted:
    """Build the Lightning pieces and fit (on every rank); epoch metrics go to `run_id`.

    Takes the whole `Config`: the Trainer (`build_trainer`) and the data module
    (`JourneyDataModule.from_config`) are built from it, and the model and its logger read
    `model`, `journey`, `data` and `mlflow` besides `train`.
    """
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
    # The network is sized by the encoder fitted on train: its inputs, time buckets, max_len.
    model_config = model_config_from(config.model, datamodule.fitted_encoder)
    module = JourneyModule(model_config, settings, positives / n_train, fraction)
    # Piecewise inputs' bin edges: the train split's quantiles, before the first step (every
    # rank reads the same split, so every rank fits the same edges).
    projection = module.model.continuous_projection
    if isinstance(projection, PiecewiseLinearInputs):
        continuous = datamodule.splits["train"].continuous
        assert continuous is not None, "a model with continuous inputs has them on train"
        projection.fit_edges(continuous)
    last = checkpoint_dir / LAST_CHECKPOINT if (resume and checkpoint_dir) else None
    if resume and not (last and last.exists()):
        print("no checkpoint saved yet: training from the start, in the same run")
        last = None
    with warnings.catch_warnings():
        if resume:  # the run's own checkpoints are expected there
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* not empty")
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=last)
        except SIGTERMException:  # Lightning's own stop after a batch: a SystemExit(None)
            raise Interrupted(signal.SIGTERM) from None
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


def fit_best(
    config: Config,
    sizes: dict[str, dict[str, int]],
    run_id: str,
    checkpoint_dir: Path,
    resume: bool,
    uri: str,
) -> tuple[Fitted, str]:
    """Fit on rank 0 (`fit`, which takes the whole `Config`), then load the best checkpoint;
    return the fit and that checkpoint's path. Lightning's MLflow logger pins the
    process-wide tracking URI: to `uri`, for the fit only."""
    with resume_hint(run_id), tracking.use_tracking_uri(uri):
        fitted = fit(config, sizes, run_id, checkpoint_dir, resume)
    return fitted, load_best(fitted, checkpoint_dir)


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


def searched_settings(config: Config) -> list[str]:
    """The settings `train.search` chooses (none when it is off)."""
    return list(config.train.search.space) if config.train.search.trials else []


def as_validated(config: Config, settings: dict[str, Any]) -> dict[str, Any]:
    """`settings`' keys with the values `config` holds, as `flat()` logs them: a drawn
    YAML `1e-3` is text until validated to 0.001."""
    flat = config.flat()
    return {key: flat[key] for key in settings}


@dataclass
class Trial:
    """One trial of `train.search`: its number (from 1), MLflow run, settings,
    configuration, fit, checkpoint folder and val ROC AUC (its best epoch's)."""

    number: int
    run_id: str
    settings: dict[str, Any]
    config: Config
    fitted: Fitted
    folder: Path
    score: float


def fit_searched(
    config: Config, sizes: dict[str, dict[str, int]], run: TrackedRun, checkpoint_dir: Path
) -> tuple[Config, Fitted, str]:
    """`train.search` (`journeys.search`): fit one transformer per trial, each in an MLflow
    run nested under `run`, and keep the trial with the best `train.monitor` (val ROC AUC);
    return its configuration, its fit (with every other trial's validated epochs, for an
    honest judgement) and its best checkpoint. The kept settings go to `run` as params;
    the other trials' checkpoints are deleted.

    Takes the whole `Config`: each trial is the whole configuration with its settings.
    """
    import optuna

    from journeys.search import search, shown

    kept: Trial | None = None
    others: list[torch.Tensor] = []  # every other trial's validated epochs

    def run_trial(trial_config: Config, settings: dict[str, Any], number: int) -> float:
        nonlocal kept
        # The last dropped trial's module and trainer refer to each other: free its encoded
        # journeys now, not whenever the cyclic collector runs, before this trial encodes.
        gc.collect()
        folder = checkpoint_dir / f"trial-{number}"
        tags = {tracking.PARENT_RUN_TAG: run.run_id, tracking.SEARCH_TRIAL_TAG: str(number)}
        with tracking.mlflow_run(
            run.uri, trial_config.mlflow.experiment, name=f"trial-{number}", tags=tags
        ) as trial_run:
            assert trial_run is not None  # the store answered for the parent run
            trial_run.log_params(as_validated(trial_config, settings))
            with search_hint(), tracking.use_tracking_uri(run.uri):
                fitted = fit(trial_config, sizes, trial_run.run_id, folder, resume=False)
            if fitted.checkpoint.best_model_score is None:
                raise JourneysError("train.search needs val journeys to choose on")
            trial = Trial(number, trial_run.run_id, settings, trial_config, fitted, folder,
                          float(fitted.checkpoint.best_model_score))  # fmt: skip
            trial_run.log_metrics({tracking.best_val_metric(config.train.monitor): trial.score})
        if kept and not np.array_equal(
            fitted.datamodule.splits["val"].journey_ids,
            kept.fitted.datamodule.splits["val"].journey_ids,
        ):
            raise JourneysError("train.search: trials saw val journeys in different orders")
        if kept is None or trial.score > kept.score:
            dropped, kept = kept, trial
        else:
            dropped = trial
        if dropped is not None:
            others.extend(dropped.fitted.module.val_history)
            shutil.rmtree(dropped.folder, ignore_errors=True)
        return trial.score

    study = search(config, run_trial)
    if kept is None:
        raise ConfigError(
            "train.search: no trial's drawn settings made a valid configuration; "
            "narrow train.search.space"
        )
    kept.fitted.other_trials = others
    run.log_params(as_validated(kept.config, kept.settings))
    trained = sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    run.log_metrics({"search_trials": trained, "search_best_trial": kept.number})
    # The kept model's epochs on the training run, as any training run has them.
    best = tracking.best_val_metric(config.train.monitor)
    tracking.copy_metric_histories(run, kept.run_id, skip=(best,))
    print(f"search: kept trial {kept.number} of {trained} trained ({shown(kept.settings)})")
    return kept.config, kept.fitted, load_best(kept.fitted, kept.folder)


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
    curves = {TRANSFORMER: probs}
    files = {
        "roc": plots.plot_roc(test_labels, curves, workdir / "roc.png"),
        "pr": plots.plot_pr(test_labels, curves, workdir / "pr.png"),
        "calibration": plots.plot_calibration(
            test_labels,
            {**curves, f"{TRANSFORMER} (T={temperature:.2f})": calibrated},
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


def transformer_model(
    fitted: Fitted,
    evaluation: Evaluation,
    rules: JourneyRules,
    journeys: pl.DataFrame,
    max_gap: timedelta,
) -> TrainedModel:
    """The fitted transformer as the model to log: its encoder, the journey `rules`, the
    temperature fitted on val and the train journeys' quiet times (`quiet_survival`)."""
    return TrainedModel(
        model=fitted.module.model,
        encoder=fitted.datamodule.fitted_encoder,
        rules=rules,
        temperature=evaluation.temperature,
        quiet_survival=quiet_survival(journeys, max_gap),
    )


def quiet_survival(journeys: pl.DataFrame, max_gap: timedelta) -> QuietSurvival | None:
    """How long the train split's journeys stay quiet, by outcome: stored with the model
    to score open journeys (`journeys.in_flight`)."""
    return QuietSurvival.fit(journeys.filter(pl.col("split") == "train"), max_gap)


def in_flight_recalibration(
    trained: TrainedModel, journeys: pl.DataFrame, max_gap: timedelta
) -> QuietSurvival | None:
    """The served model's quiet-time curves, recalibrated on open journeys replayed in the
    val window and scored by what it serves (`journeys.in_flight.recalibrate_in_flight`);
    `max_gap` is `journey.max_gap`."""
    survival = trained.quiet_survival
    if survival is None:
        return None
    recalibrated = recalibrate_in_flight(
        survival, journeys, trained.predict_proba, trained.encoder.event_columns, max_gap
    )
    if recalibrated.recalibration is not None:
        a, b, c = recalibrated.recalibration
        print(
            f"open journeys: in-flight probability recalibrated on a replay of the val window "
            f"(log-odds x {b:.2f}, {c:+.2f} per log quiet hour, {a:+.2f})"
        )
    return recalibrated


def fit_on_other_rank(
    config: Config, sizes: dict[str, dict[str, int]], root: Path, resume: bool
) -> None:
    """A DDP rank other than 0: it fits (resuming where rank 0 does), and nothing else."""
    checkpoint_dir = Path(read_state(root)["checkpoint_dir"]) if resume else None
    with tracking.use_tracking_uri(tracking.tracking_uri(config)):
        fit(config, sizes, None, checkpoint_dir, resume)


def served_model(
    fitted: Fitted,
    evaluation: Evaluation,
    rules: JourneyRules,
    candidates: Candidates,
    decision: Decision,
    journeys: pl.DataFrame,
    val: pl.DataFrame,
    journeys_folder: str,
) -> TrainedModel:
    """The model the run registers: the transformer (`transformer_model`) serving the chosen
    candidate's probability, its open-journey survival recalibrated, and its monitoring
    reference (`val`'s journeys and the ingest report in `journeys_folder`)."""
    max_gap = rules.max_gap_delta
    trained = transformer_model(fitted, evaluation, rules, journeys, max_gap)
    trained = candidates.serving(trained, decision.kind)
    trained.quiet_survival = in_flight_recalibration(trained, journeys, max_gap)
    served_val = candidates.served_val[decision.kind]
    auc = decision.val_roc_auc.get(decision.kind)
    trained.reference = monitoring_reference(trained, val, served_val, journeys_folder, auc)
    return trained


def monitoring_reference(
    trained: TrainedModel,
    val: pl.DataFrame,
    served: np.ndarray,
    journeys_folder: str,
    val_roc_auc: float | None,
) -> Reference:
    """What `journeys monitor` compares each night with, saved with the model: the val
    split's events and journeys, what the served model gives them, the ingest's rates."""
    from journeys.datasets import IngestReport
    from journeys.reference import build_reference

    report = IngestReport.read(journeys_folder)
    encoder = trained.encoder
    numeric = encoder.numeric_features
    return build_reference(val, served, encoder.vocabs, numeric, report, val_roc_auc)


def run_metrics(
    fitted: Fitted,
    sizes: dict[str, dict[str, int]],
    evaluation: Evaluation,
    candidates: Candidates,
    decision: Decision,
) -> dict[str, float]:
    """Every metric the run logs: the transformer's, the run's facts, the served and the
    stacked candidates' on test and each candidate's honest val ROC AUC."""
    metrics = {**evaluation.metrics, **run_facts(fitted, sizes)}
    metrics |= candidates.metrics(decision.kind)
    return metrics | {f"val_roc_auc_{k}": v for k, v in decision.val_roc_auc.items()}


def run_facts(fitted: Fitted, sizes: dict[str, dict[str, int]]) -> dict[str, float]:
    """What the run logs beside the test metrics: split sizes, parameters, the share of
    negatives drawn per epoch, the optimiser steps made and the best validation AUC."""
    facts = {f"n_{split}": float(sizes[split]["n"]) for split in SPLITS}
    facts["n_parameters"] = float(fitted.module.model.num_parameters())
    facts["negative_fraction"] = fitted.module.negative_fraction
    facts["optimizer_steps"] = float(fitted.module.trainer.global_step)
    if fitted.checkpoint.best_model_score is not None:
        monitor = fitted.module.train_settings.monitor
        facts[tracking.best_val_metric(monitor)] = float(fitted.checkpoint.best_model_score)
    return facts


# ----------------------------------------------------------------------------- 4. baselines


def in_data_module_order(journeys: pl.DataFrame, fitted: Fitted) -> dict[str, pl.DataFrame]:
    """The labelled journeys of each split, in the data module's order (that of the
    transformer's logits): every candidate is scored on the same rows in the same order."""

    def split(name: str) -> pl.DataFrame:
        ids = pl.DataFrame({"journey_id": fitted.datamodule.splits[name].journey_ids})
        return ids.join(journeys, on="journey_id", how="left", maintain_order="left")

    return {name: split(name) for name in SPLITS}


def run_baselines_beside(
    run: TrackedRun, config: Config, splits: dict[str, pl.DataFrame]
) -> dict[str, BaselineResult]:
    """The configured baselines (`train.baselines`), fitted on the train journeys and logged
    in the same experiment, tagged with the transformer run's id (their comparison group).

    Takes the whole `Config`: each baseline's run logs all of it as params
    (`journeys.baselines.run_baselines`).
    """
    from journeys.baselines import run_baselines

    results = []
    group = {tracking.COMPARISON_GROUP_TAG: run.run_id}
    if config.train.baselines:
        with tempfile.TemporaryDirectory(prefix="journeys-baselines-") as tmp:
            results = run_baselines(
                list(config.train.baselines),
                splits["train"],
                splits["val"],
                splits["test"],
                config,
                Path(tmp),
                tags=group,
            )
    run.set_tags(group)
    return {result.name: result for result in results}


# ----------------------------------------------------------------------------- 5. choose, register


@dataclass
class Candidates:
    """Every candidate of the run, by kind (the transformer first), on the same val and
    test journeys (the data module's order): honest val probabilities (`val`), what each
    serves on val, fitted on all of it (`served_val`), test probabilities, and what the
    registered model serves for each kind (`journeys.trained_model.TrainedModel`: a stack,
    a baseline, or nothing for the transformer)."""

    val_labels: np.ndarray
    val: dict[str, np.ndarray]
    served_val: dict[str, np.ndarray]
    test_labels: np.ndarray
    test: dict[str, np.ndarray]
    heads: dict[str, Stack | Baseline | None]

    @property
    def kinds(self) -> list[str]:
        return list(self.test)

    def serving(self, trained: TrainedModel, kind: str) -> TrainedModel:
        """`trained` (the transformer) serving `kind`'s probability."""
        from journeys.stacking import Stack

        head = self.heads[kind]
        trained.stack = head if isinstance(head, Stack) else None
        trained.baseline = None if head is None or isinstance(head, Stack) else head
        return trained

    def test_metrics(self, kind: str, prefix: str) -> dict[str, float]:
        return M.binary_metrics(self.test_labels, self.test[kind], prefix=prefix)

    def metrics(self, served: str) -> dict[str, float]:
        """What the run logs of the candidates: the stack's test metrics (`stacked_test_*`)
        and the served model's (`served_test_*`)."""
        out = self.test_metrics(served, "served_test_")
        if STACK in self.test:
            out |= self.test_metrics(STACK, "stacked_test_")
        return out

    def comparison(self, served: str) -> list[tuple[str, dict[str, float]]]:
        """The rows of the test comparison, the served one marked."""
        rows = []
        for kind in self.kinds:
            name = f"{kind} (served)" if kind == served else kind
            rows.append((name, self.test_metrics(kind, "test_")))
        return rows


def candidates_beside(
    settings: Train,
    model: Model,
    booster_settings: BaselineSettings,
    splits: dict[str, pl.DataFrame],
    fitted: Fitted,
    evaluation: Evaluation,
    baselines: dict[str, BaselineResult],
) -> Candidates:
    """The transformer, the stack (`train.stack`, journey-level models) and each baseline,
    with honest val probabilities (`journeys.promotion`): the transformer's epoch and
    temperature, and the stack's calibration, are chosen and fitted on one half of val for
    the other. `booster_settings` configure the stack's booster when no `hgb_aggregates`
    baseline ran; `settings.seed` draws the val halves."""
    from journeys import promotion
    from journeys.baselines import fit_baseline
    from journeys.metrics import logit
    from journeys.stacking import blended, fit_stack, platt

    val, test = splits["val"], splits["test"]
    labels = val.get_column("label").to_numpy().astype(np.int64)
    folds = promotion.val_folds(labels, settings.seed)
    history = np.stack([h.numpy() for h in fitted.val_choices()] or [evaluation.val_logits])

    val_columns = {TRANSFORMER: promotion.cross_fitted_transformer(history, labels, folds)}
    # What each candidate serves on val (fitted on all of it): the served one's monitoring
    # reference, and what the transformer meets the champion with when promotion.guard is
    # off (plumbing and demos); with the guard on, the honest columns above meet it.
    served_val = {TRANSFORMER: M.sigmoid(evaluation.val_logits, evaluation.temperature)}
    test_scores = {TRANSFORMER: M.sigmoid(evaluation.test_logits, evaluation.temperature)}
    test_labels = test.get_column("label").to_numpy().astype(np.int64)
    heads: dict[str, Stack | Baseline | None] = {TRANSFORMER: None}
    models = {name: run.model for name, run in baselines.items()}
    if settings.stack and not model.causal:
        if "hgb_aggregates" in baselines:  # its run scored val and test already
            run = baselines["hgb_aggregates"]
            booster, booster_val, booster_test = run.model, run.val_scores, run.test_scores
        else:  # the stack's booster, when the run has no such baseline
            booster = fit_baseline("hgb_aggregates", splits["train"], booster_settings)
            booster_val, booster_test = booster.predict_proba(val), booster.predict_proba(test)
        booster_val, booster_test = logit(booster_val), logit(booster_test)
        print("stack: the transformer blended with gradient boosting on journey aggregates")
        stack = fit_stack(
            booster,  # type: ignore[arg-type]
            labels,
            evaluation.val_logits,
            booster_val,
            evaluation.temperature,
        )

        def stack_fold(fit: np.ndarray, held: np.ndarray) -> np.ndarray:
            # Epoch, temperature and Platt scaling all chosen on the other half.
            calibrated = promotion.calibrated_choice(history, labels, fit)

            def mixed(rows: np.ndarray) -> np.ndarray:
                return blended(calibrated[rows], booster_val[rows])

            slope, intercept = platt(mixed(fit), labels[fit])
            return M.sigmoid(slope * mixed(held) + intercept)

        val_columns[STACK] = promotion.cross_fit(labels, folds, stack_fold)
        served_val[STACK] = M.sigmoid(stack.blend(evaluation.val_logits, booster_val))
        test_scores[STACK] = M.sigmoid(stack.blend(evaluation.test_logits, booster_test))
        heads[STACK] = stack
    for name, run in baselines.items():
        kind = baseline_kind(name)
        val_columns[kind] = served_val[kind] = run.val_scores  # fitted on train: honest
        test_scores[kind] = run.test_scores
        heads[kind] = models[name]
    return Candidates(labels, val_columns, served_val, test_labels, test_scores, heads)


def choose(
    promotion: Promotion,
    registered_model: str,
    uri: str,
    candidates: Candidates,
    val: pl.DataFrame,
) -> Decision:
    """Which candidate is registered and whether it becomes the champion of
    `registered_model`, decided on the `val` journeys alone (`journeys.promotion`): against
    chance, one another and the champion."""
    return decide(
        candidates.val_labels,
        candidates.val,
        champion_val_scores(registered_model, uri, val),
        promotion,
        served=candidates.served_val,
    )


def champion_val_scores(
    registered_model: str, uri: str, val: pl.DataFrame
) -> np.ndarray | float | None:
    """The current champion of `registered_model`: its scores on this run's val
    journeys (None: no champion yet), or its logged val ROC AUC when it cannot score them
    (a model of other features)."""
    version = tracking.champion_version(uri, registered_model)
    if version is None:
        return None
    champion_uri = f"models:/{registered_model}/{version.version}"
    try:
        return load_model(champion_uri, tracking_uri=uri).predict_proba(val)
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
    registered_model: str,
    trained: TrainedModel,
    evaluation: Evaluation,
    metrics: dict[str, float],
    best: str,
    decision: Decision,
) -> tuple[Registration, str]:
    """Log metrics, plots, the decision and the model to the run, and register the model as
    `registered_model` (the `champion` alias moves as `decision` says); return the
    registration and the logged model's URI."""
    run.log_metrics(metrics)
    for path in evaluation.plots.values():
        run.log_artifact(path, "plots")
    run.log_dict(decision.to_dict(), PROMOTION_FILE)
    run.set_tags({tracking.BEST_CHECKPOINT_TAG: best})
    with run.active():
        info = log_model(trained)
    registration = tracking.register_model(run, info.model_uri, registered_model, decision)
    return registration, info.model_uri


def mark_done(root: Path, run_id: str, registration: Registration, decision: Decision) -> None:
    """Record the training as finished in `root` (nothing left to `--resume`) and say what
    it registered."""
    write_state(root, {**read_state(root), "status": "done"})
    print(
        f"transformer run {run_id}: model version {registration.version} "
        f"({decision.kind}); {decision.summary}"
    )


# ----------------------------------------------------------------------------- 6. compare


def flag_baselines_ahead(
    run: TrackedRun, scores: dict[str, float], baselines: dict[str, BaselineResult]
) -> list[str]:
    """Say so, on the console and as a run tag, when a baseline beats the transformer alone
    beyond the transformer's 95% interval on test (what is served was chosen on val)."""
    from journeys.baselines import ahead_of_transformer

    ahead = ahead_of_transformer(scores, {name: b.metrics for name, b in baselines.items()})
    run.set_tags({tracking.BASELINES_AHEAD_TAG: ",".join(ahead) or "none"})
    for name in ahead:
        print(
            f"note: {baseline_kind(name)} (test ROC AUC "
            f"{baselines[name].metrics['test_roc_auc']:.4f}) beats the transformer alone beyond "
            f"its 95% interval ({M.format_metric(scores, 'roc_auc')}); the model served was "
            "chosen among all of them on val (above)"
        )
    return ahead


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

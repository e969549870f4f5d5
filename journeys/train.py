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

`--resume` continues the last interrupted training from its `last.ckpt`, in the same
MLflow run: `paths.checkpoints/latest.json` records the run id beside the checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import numpy as np
import polars as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint, WeightAveraging
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader
from torchmetrics.classification import BinaryAUROC

from journeys import metrics as M
from journeys import packaging, tracking
from journeys.data import (
    DEFAULT_BUCKET_BATCHES,
    SPLITS,
    EncodedJourneys,
    JourneyBatch,
    encode_journeys,
    fraction_of_negatives,
    make_dataloader,
    sample_negatives,
)
from journeys.errors import InputError, JourneysError
from journeys.ingest import scan_journeys
from journeys.model import JourneyTransformer, ModelConfig
from journeys.vocab import Vocabularies

if TYPE_CHECKING:
    from journeys.config import Config, Train

MODEL_FAMILY = "transformer"
STATE_FILE = "latest.json"  # in paths.checkpoints: which run/checkpoints --resume continues
LAST_CHECKPOINT = "last.ckpt"
ADAM_EPS = 1e-9
COSINE_FLOOR = 0.1  # cosine decays to lr / 10 (nanoGPT's min_lr), not to zero
EMA_WARMUP = 10  # the EMA's decay ramps up as (1 + n) / (EMA_WARMUP + n) over its first steps
REQUIRED_COLUMNS = ("journey_id", "label", "censored", "split", "event_type", "event_time")
COMPARED_METRICS = ("roc_auc", "pr_auc", "log_loss", "brier", "ece")


# ----------------------------------------------------------------------------- module


def ema_update(
    averaged: torch.Tensor, current: torch.Tensor, num_averaged: torch.Tensor, decay: float
) -> torch.Tensor:
    """One EMA step of a weight, for Lightning's `WeightAveraging(avg_fn=...)`.

    Why: with lr 3e-3 the raw weights jitter from step to step and val AUC with them
    (by up to 0.005 between epochs at 100k users); the average is smoother and better (quality
    benchmark, RESULTS.md). The decay ramps up from 0 (as in timm's ModelEma), so a run of
    a few hundred steps is not stuck near its initial weights.
    """
    rate = torch.clamp((1 + num_averaged) / (EMA_WARMUP + num_averaged), max=decay)
    return averaged + (current - averaged) * (1 - rate)


def lr_factor(step: int, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """LR multiplier: linear warm-up to 1, then inverse-sqrt or cosine decay."""
    warmup = max(1, warmup_steps)
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "inverse_sqrt":
        return math.sqrt(warmup / (step + 1))
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return COSINE_FLOOR + (1 - COSINE_FLOOR) * 0.5 * (1 + math.cos(math.pi * progress))


class JourneyDataModule(L.LightningDataModule):
    """Train/val/test loaders from the journeys folder's `split` column.

    Censored journeys (unknown label, split `none`) are never in train/val/test. Scoring
    does not go through here: `journeys.score` batches any frame with `make_dataloader`.
    """

    def __init__(
        self,
        journeys_dir: str | Path,
        vocabs: Vocabularies | None = None,
        *,
        n_time_buckets: int = 32,
        max_len: int | None = None,
        batch_size: int = 256,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        group_by_length: bool = True,
        bucket_batches: int = DEFAULT_BUCKET_BATCHES,
        negative_fraction: float = 1.0,
    ) -> None:
        super().__init__()
        self.journeys_dir = Path(journeys_dir)
        self._vocabs = vocabs
        self.n_time_buckets = n_time_buckets
        self.max_len = max_len
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.group_by_length = group_by_length
        self.bucket_batches = bucket_batches
        self.negative_fraction = negative_fraction
        self.splits: dict[str, EncodedJourneys] = {}

    @classmethod
    def from_config(
        cls, config: Config, vocabs: Vocabularies | None = None, negative_fraction: float = 1.0
    ) -> JourneyDataModule:
        return cls(
            config.paths.journeys,
            vocabs,
            n_time_buckets=config.model.time_buckets,
            max_len=config.journey.max_events,
            batch_size=config.train.batch_size,
            num_workers=config.train.num_workers,
            seed=config.train.seed,
            negative_fraction=negative_fraction,
        )

    @property
    def vocabs(self) -> Vocabularies:
        if self._vocabs is None:
            self._vocabs = Vocabularies.load(self.journeys_dir)
        return self._vocabs

    def encode(self, frame: pl.DataFrame) -> EncodedJourneys:
        return encode_journeys(frame, self.vocabs, self.n_time_buckets, self.max_len)

    def _columns(self) -> list[str]:
        return ["journey_id", "label", "event_type", "event_time", *self.vocabs.features]

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        frame = (
            scan_journeys(self.journeys_dir)
            .filter(~pl.col("censored") & pl.col("split").is_in(SPLITS))
            .select("split", *self._columns())
            .collect()
        )
        for split in SPLITS:
            self.splits[split] = self.encode(frame.filter(pl.col("split") == split))

    def _loader(self, split: str, shuffle: bool, subset: torch.Tensor | None = None) -> DataLoader:
        if not self.splits:
            self.setup()
        return make_dataloader(
            self.splits[split],
            self.batch_size if shuffle else self.eval_batch_size,
            shuffle=shuffle,
            group_by_length=self.group_by_length,
            seed=self.seed,
            num_workers=self.num_workers,
            bucket_batches=self.bucket_batches,
            subset=subset,
        )

    def train_dataloader(self) -> DataLoader:
        if not self.splits:
            self.setup()
        train = self.splits["train"]
        if not len(train):
            raise InputError(f"no uncensored train journeys in {self.journeys_dir}")
        if self.negative_fraction >= 1:
            return self._loader("train", shuffle=True)
        # Built anew every epoch (the Trainer reloads it), with other negatives each time.
        epoch = self.trainer.current_epoch if self.trainer is not None else 0
        subset = sample_negatives(train.labels, self.negative_fraction, self.seed, epoch)
        return self._loader("train", shuffle=True, subset=subset)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", shuffle=False)


class JourneyModule(L.LightningModule):
    """`JourneyTransformer` + loss, optimiser, schedule and the logged epoch metrics.

    `train_loss` is the optimised loss (with label smoothing and pos_weight, on the
    epoch's sample of negatives); `val_loss` is the plain log loss on every val journey, so
    runs with different loss settings stay comparable.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        train: Train,
        base_rate: float | None = None,
        negative_fraction: float = 1.0,
    ):
        super().__init__()
        self.model = JourneyTransformer(model_config)
        self.train_settings = train
        self.negative_fraction = negative_fraction
        pos_weight = torch.tensor(train.pos_weight) if train.pos_weight else None
        self.register_buffer("pos_weight", pos_weight, persistent=False)
        self.val_auroc = BinaryAUROC()  # accumulates over the epoch, syncs across ranks
        if base_rate is not None and 0 < base_rate < 1:
            # Start at the loss-minimising constant (the prior's log-odds, shifted by
            # pos_weight) rather than at p = 0.5: with a few % conversions the first
            # hundreds of steps would otherwise only learn the base rate.
            prior = math.log(base_rate / (1 - base_rate)) + math.log(train.pos_weight or 1.0)
            with torch.no_grad():
                self.model.head.bias.fill_(prior)

    def _logits(self, batch: JourneyBatch) -> torch.Tensor:
        out = self.model(batch.tokens, batch.features, batch.time_buckets, batch.mask)
        return out.logits.float()  # bf16-mixed: the loss in float32

    def training_step(self, batch: JourneyBatch, batch_idx: int) -> torch.Tensor:
        # With a share f of the negatives, the odds in a batch are 1/f times the full
        # data's: the loss sees logit + log(1/f), so the model's own logit keeps the full
        # data's scale (King & Zeng 2001's prior correction, applied while training).
        logits = self._logits(batch) - math.log(self.negative_fraction)
        smoothing = self.train_settings.label_smoothing
        targets = batch.labels * (1 - smoothing) + 0.5 * smoothing
        loss = F.binary_cross_entropy_with_logits(logits, targets, pos_weight=self.pos_weight)
        self.log(
            "train_loss",
            loss,
            on_step=False,
            on_epoch=True,
            sync_dist=True,
            batch_size=len(logits),
            prog_bar=True,
        )
        return loss

    def validation_step(self, batch: JourneyBatch, batch_idx: int) -> None:
        logits = self._logits(batch)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        self.val_auroc.update(torch.sigmoid(logits), batch.labels.long())
        self.log(
            "val_loss", loss, on_epoch=True, sync_dist=True, batch_size=len(logits), prog_bar=True
        )
        self.log("val_roc_auc", self.val_auroc, on_epoch=True, prog_bar=True)

    def configure_optimizers(self) -> dict[str, Any]:
        settings = self.train_settings
        # Decay matrices and embeddings, not biases, LayerNorm gains or the CLS vector.
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": settings.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        if settings.optimizer == "sgd":
            # torch's SGD adds weight decay to the gradient (L2), where AdamW decouples it:
            # the same train.weight_decay means far less here (1e-4 against AdamW's 0.1).
            optimizer = torch.optim.SGD(
                groups, lr=settings.lr, momentum=settings.momentum, nesterov=True
            )
        else:
            adam = torch.optim.AdamW if settings.optimizer == "adamw" else torch.optim.Adam
            optimizer = adam(groups, lr=settings.lr, betas=settings.adam_betas, eps=ADAM_EPS)
        schedule = partial(
            lr_factor,
            warmup_steps=settings.warmup_steps,
            total_steps=int(self.trainer.estimated_stepping_batches),
            schedule=settings.schedule,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


# ----------------------------------------------------------------------------- checks


def check_dataset(config: Config) -> dict[str, dict[str, int]]:
    """Raise `InputError` unless the journeys dataset can be trained on; return split sizes.

    Cheap (schema and one aggregation), so it runs before any import of data onto tensors.
    """
    folder = Path(config.paths.journeys)
    if not folder.is_dir():
        raise InputError(f"journeys dataset not found at {folder}: run `journeys ingest` first")
    scan = scan_journeys(folder)
    vocabs = Vocabularies.load(folder)
    schema = scan.collect_schema()
    missing = [c for c in (*REQUIRED_COLUMNS, *config.data.features) if c not in schema]
    if missing:
        raise InputError(f"journeys at {folder} lack column(s) {missing}: re-run `journeys ingest`")
    if vocabs.features != list(config.data.features):
        raise InputError(
            f"vocabularies at {folder} are for features {vocabs.features}, "
            f"but data.features is {list(config.data.features)}: re-run `journeys ingest`"
        )
    counts = (
        scan.filter(~pl.col("censored") & pl.col("split").is_in(SPLITS))
        .group_by("split")
        .agg(n=pl.len(), positives=pl.col("label").cast(pl.Int64).sum())
        .collect()
    )
    sizes = {
        row["split"]: {"n": row["n"], "positives": row["positives"]}
        for row in counts.iter_rows(named=True)
    }
    for split in SPLITS:
        sizes.setdefault(split, {"n": 0, "positives": 0})
        if sizes[split]["n"] == 0:
            raise InputError(
                f"the {split} split of {folder} is empty: more data or other split.fractions"
            )
    train = sizes["train"]
    if train["positives"] in (0, train["n"]):
        raise InputError(
            f"the train split of {folder} has only one class ({train['positives']} conversions)"
        )
    return sizes


def weight_averaging(settings: Train) -> list[Callback]:
    """The EMA of the weights as a callback, when `train.ema_decay` is set.

    Validation, checkpoints (so the logged model) and the end of fit use the average;
    `last.ckpt` also keeps the raw weights, so `--resume` continues both.
    """
    if settings.ema_decay is None:
        return []
    return [WeightAveraging(avg_fn=partial(ema_update, decay=settings.ema_decay))]


def global_rank() -> int:
    """This process's rank, known before the Trainer starts (env set by the launcher)."""
    return int(rank_zero_only.rank)


# ----------------------------------------------------------------------------- resume state


def _read_state(root: Path) -> dict[str, Any]:
    path = root / STATE_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise JourneysError(f"nothing to resume: no {path} (start with `journeys train`)") from None
    except json.JSONDecodeError as err:
        raise JourneysError(f"cannot resume: {path} is unreadable ({err})") from None


def _write_state(root: Path, state: dict[str, Any]) -> None:
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


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def scores_and_attention(
    model: JourneyTransformer, encoded: EncodedJourneys, vocabs: Vocabularies, batch_size: int
) -> tuple[np.ndarray, dict[str, tuple[float, int]]]:
    """Logits [n] in `encoded`'s order and, per event type, (mean pooled attention x journey
    length, occurrences), in one pass (the explicit-weights path gives the fast path's logits).

    Multiplying by the journey length makes 1 the uniform share, so long and short
    journeys weigh alike: > 1 means the model looks at that event type more than average.
    """
    device = next(model.parameters()).device
    size = len(vocabs.event_type)
    logits = np.zeros(len(encoded), dtype=np.float32)
    sums = torch.zeros(size, dtype=torch.float64)
    counts = torch.zeros(size, dtype=torch.float64)
    model.eval()
    for batch in make_dataloader(encoded, batch_size, shuffle=False):
        mask = batch.mask
        out = model(
            batch.tokens.to(device),
            batch.features.to(device),
            batch.time_buckets.to(device),
            mask.to(device),
            attention="pooled",
        )
        logits[batch.index.numpy()] = out.logits.float().cpu().numpy()
        relative = out.attention.float().cpu() * mask.sum(dim=1, keepdim=True)
        sums.index_add_(0, batch.tokens[mask], relative[mask].double())
        counts.index_add_(0, batch.tokens[mask], torch.ones(int(mask.sum()), dtype=torch.float64))
    tokens = vocabs.event_type.tokens
    table = {
        tokens[i]: (float(sums[i] / counts[i]), int(counts[i]))
        for i in range(size)
        if counts[i] > 0
    }
    return logits, table


def evaluate(
    module: JourneyModule, datamodule: JourneyDataModule, vocabs: Vocabularies, workdir: Path
) -> tuple[dict[str, float], dict[str, Path], float, np.ndarray]:
    """Test metrics (raw and temperature-calibrated), plots, temperature, test logits."""
    model = module.model.eval()
    batch_size = datamodule.eval_batch_size
    val, test = datamodule.splits["val"], datamodule.splits["test"]
    val_logits = packaging.predict_logits(model, val, batch_size)
    test_logits, attention = scores_and_attention(model, test, vocabs, batch_size)
    val_labels, test_labels = val.labels.numpy(), test.labels.numpy()

    temperature = M.fit_temperature(val_logits, val_labels)
    probs = M.sigmoid(test_logits)
    calibrated = M.sigmoid(test_logits / temperature)
    scores = M.binary_metrics(test_labels, probs)
    scores |= {f"{k}_calibrated": v for k, v in M.binary_metrics(test_labels, calibrated).items()}
    scores["temperature"] = temperature

    (workdir / "attention_by_event_type.json").write_text(json.dumps(attention, indent=2))
    curves = {MODEL_FAMILY: probs}
    plots = {
        "roc": M.plot_roc(test_labels, curves, workdir / "roc.png"),
        "pr": M.plot_pr(test_labels, curves, workdir / "pr.png"),
        "calibration": M.plot_calibration(
            test_labels,
            {**curves, f"{MODEL_FAMILY} (T={temperature:.2f})": calibrated},
            workdir / "calibration.png",
        ),
        "attention_by_event_type": M.plot_attention_by_event_type(
            attention, workdir / "attention_by_event_type.png"
        ),
        "attention_table": workdir / "attention_by_event_type.json",
    }
    return scores, plots, temperature, test_logits


# ----------------------------------------------------------------------------- command


def min_epoch_journeys(settings: Train, world_size: int) -> int:
    """Journeys an epoch needs for `train.min_steps` optimiser steps in `train.max_epochs`
    (a step takes `batch_size` journeys on each of `world_size` ranks)."""
    steps_per_epoch = math.ceil(settings.min_steps / settings.max_epochs)
    return steps_per_epoch * settings.batch_size * world_size


def build_trainer(
    config: Config, logger: Logger, checkpoint_dir: Path | None
) -> tuple[L.Trainer, ModelCheckpoint]:
    settings = config.train
    checkpoint = ModelCheckpoint(
        dirpath=checkpoint_dir,  # None off rank 0: Lightning broadcasts rank 0's
        filename="best-{epoch:02d}-{val_roc_auc:.4f}",
        monitor="val_roc_auc",
        mode="max",
        save_top_k=1,
    )
    # `--resume` needs the latest epoch, but since Lightning 2.6 `save_last` writes only when
    # a top-k checkpoint is saved, so `last.ckpt` would be the best epoch again. A second
    # checkpoint without a monitor overwrites `last.ckpt` after every validation instead.
    last = ModelCheckpoint(
        dirpath=checkpoint_dir,
        filename=LAST_CHECKPOINT.removesuffix(".ckpt"),
        save_top_k=1,
        enable_version_counter=False,
    )
    # check_finite=False: a val split with one class gives a NaN AUC, not a reason to stop.
    early_stopping = EarlyStopping(
        monitor="val_roc_auc", mode="max", patience=settings.patience, check_finite=False
    )
    callbacks: list[Callback] = [checkpoint, last, early_stopping, *weight_averaging(settings)]
    trainer = L.Trainer(
        accelerator=settings.accelerator,
        devices=settings.devices,
        num_nodes=settings.num_nodes,
        strategy=settings.strategy,
        precision=settings.precision,
        max_epochs=settings.max_epochs,
        gradient_clip_val=settings.grad_clip or None,
        logger=logger,
        callbacks=callbacks,
        default_root_dir=config.paths.checkpoints,
        log_every_n_steps=1,  # only epoch-level metrics are logged; this just silences a warning
    )
    return trainer, checkpoint


def _start_run(config: Config, uri: str, resume: bool) -> tuple[str, str, Path]:
    """Rank 0: create (or reopen, on resume) the one MLflow run; return ids and checkpoint dir."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    root = Path(config.paths.checkpoints)
    experiment_id = tracking.get_experiment_id(uri, config.mlflow.experiment)
    client = MlflowClient(tracking_uri=uri)
    if resume:
        state = _read_state(root)
        if state.get("status") == "done":
            raise JourneysError(
                f"nothing to resume: run {state['run_id']} finished (start with `journeys train`)"
            )
        try:
            run = client.get_run(state["run_id"])
        except MlflowException:
            raise JourneysError(f"cannot resume: run {state['run_id']} is not in {uri}") from None
        run_id, experiment_id = run.info.run_id, run.info.experiment_id
        print(f"resuming MLflow run {run_id} from {state['checkpoint_dir']}")
        tracking.log_config(client, run_id, config)
        return run_id, experiment_id, Path(state["checkpoint_dir"])
    run = client.create_run(
        experiment_id, run_name=MODEL_FAMILY, tags={tracking.MODEL_FAMILY_TAG: MODEL_FAMILY}
    )
    run_id = run.info.run_id
    checkpoint_dir = root / run_id
    _write_state(
        root,
        {
            "run_id": run_id,
            "experiment_id": experiment_id,
            "checkpoint_dir": str(checkpoint_dir),
            "tracking_uri": uri,
            "status": "training",
        },
    )
    tracking.log_config(client, run_id, config)
    tracking.log_ingest_report(client, run_id, config.paths.journeys)
    return run_id, experiment_id, checkpoint_dir


def train_command(config: Config, resume: bool = False) -> TrainResult | None:
    """`journeys train`: see the module docstring. Returns None on ranks other than 0."""
    sizes = check_dataset(config)
    # Per-file progress bars for a handful of small artifacts are noise in the log.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = tracking.tracking_uri(config)
    # MLflow's fluent API (log_model, register_model) and Lightning's logger use the
    # process-wide URI: set it for this training only.
    with tracking.use_tracking_uri(uri):
        return _train(config, resume, uri, sizes)


def _train(
    config: Config, resume: bool, uri: str, sizes: dict[str, dict[str, int]]
) -> TrainResult | None:
    from lightning.pytorch.loggers import MLFlowLogger

    rank = global_rank()
    run_id = experiment_id = None
    checkpoint_dir: Path | None = None
    if rank == 0:
        tracking.check_tracking_uri(uri)
        run_id, experiment_id, checkpoint_dir = _start_run(config, uri, resume)
    elif resume:
        checkpoint_dir = Path(_read_state(Path(config.paths.checkpoints))["checkpoint_dir"])

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
    datamodule = JourneyDataModule.from_config(config, vocabs, fraction)
    model_config = ModelConfig.from_config(config.model, vocabs, max_len=config.journey.max_events)
    module = JourneyModule(model_config, settings, positives / n_train, fraction)
    last = checkpoint_dir / LAST_CHECKPOINT if (resume and checkpoint_dir) else None
    if resume and not (last and last.exists()):
        print("no checkpoint saved yet: training from the start, in the same run")
        last = None
    try:
        with warnings.catch_warnings():
            if resume:  # the run's own checkpoints are expected there
                warnings.filterwarnings("ignore", message=r"Checkpoint directory .* not empty")
            trainer.fit(module, datamodule=datamodule, ckpt_path=last)
    except BaseException:
        if rank == 0:
            print(f"training stopped; continue with `journeys train --resume` (run {run_id})")
        raise
    if trainer.global_rank != 0:
        return None
    assert run_id is not None and experiment_id is not None and checkpoint_dir is not None
    return _finish(
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


def _finish(
    config: Config,
    uri: str,
    run_id: str,
    experiment_id: str,
    checkpoint_dir: Path,
    module: JourneyModule,
    checkpoint: ModelCheckpoint,
    datamodule: JourneyDataModule,
    vocabs: Vocabularies,
    sizes: dict[str, dict[str, int]],
) -> TrainResult:
    """Rank 0 after fit: evaluate the best checkpoint, log, register, run baselines, compare."""
    import mlflow
    from mlflow import MlflowClient

    from journeys.baselines import BaselineResult, run_baselines

    client = MlflowClient(tracking_uri=uri)
    best = checkpoint.best_model_path or str(checkpoint_dir / LAST_CHECKPOINT)
    print(f"evaluating {best} on val and test, logging the model")
    # weights_only: a checkpoint is data, never code (torch's safe unpickler).
    state = torch.load(best, map_location=module.device, weights_only=True)["state_dict"]
    module.load_state_dict(state)
    datamodule.setup("test")

    with (
        tempfile.TemporaryDirectory(prefix="journeys-eval-") as tmp,
        mlflow.start_run(run_id=run_id),
    ):
        try:
            scores, plots, temperature, test_logits = evaluate(
                module, datamodule, vocabs, Path(tmp)
            )
            best_score = checkpoint.best_model_score
            extra = {f"n_{split}": float(sizes[split]["n"]) for split in SPLITS}
            extra["n_parameters"] = float(module.model.num_parameters())
            extra["negative_fraction"] = module.negative_fraction
            if best_score is not None:
                extra["best_val_roc_auc"] = float(best_score)
            all_metrics = {**scores, **extra}
            tracking.log_metrics(client, run_id, all_metrics)
            for path in plots.values():
                client.log_artifact(run_id, str(path), "plots")
            client.set_tag(run_id, "best_checkpoint", best)
            preprocessing = packaging.preprocessing_settings(config)
            module.model.cpu()  # weights are saved from CPU tensors
            info = packaging.log_model(module.model, vocabs, preprocessing, temperature)
            registration = tracking.register_model(
                client,
                info.model_uri,
                config.mlflow.registered_model,
                run_id,
                scores["test_roc_auc"],
            )
        except BaseException:
            mlflow.end_run("FAILED")
            raise
    root = Path(config.paths.checkpoints)
    _write_state(root, {**_read_state(root), "status": "done"})
    print(f"transformer run {run_id}: model version {registration.version}; {registration.reason}")

    test = datamodule.splits["test"]
    predictions = pl.DataFrame(
        {
            "journey_id": test.journey_ids,
            "label": test.labels.numpy().astype(np.int8),
            "probability": M.sigmoid(test_logits),
        }
    )
    baseline_results: list[BaselineResult] = []
    if config.train.baselines:
        frame = (
            scan_journeys(config.paths.journeys)
            .filter(~pl.col("censored") & pl.col("split").is_in(["train", "test"]))
            .collect()
        )
        with tempfile.TemporaryDirectory(prefix="journeys-baselines-") as tmp:
            baseline_results = run_baselines(
                list(config.train.baselines),
                frame.filter(pl.col("split") == "train"),
                frame.filter(pl.col("split") == "test"),
                config,
                experiment_id,
                Path(tmp),
                tags={"comparison_group": run_id},
            )
    client.set_tag(run_id, "comparison_group", run_id)
    rows = [(MODEL_FAMILY, scores), (f"{MODEL_FAMILY} (calibrated)", _calibrated(scores))]
    rows += [(f"baseline_{r.name}", r.metrics) for r in baseline_results]
    print_comparison(rows)
    return TrainResult(
        run_id=run_id,
        experiment_id=experiment_id,
        metrics=all_metrics,
        model_uri=info.model_uri,
        model_version=registration.version,
        champion_version=registration.champion_version,
        promoted=registration.promoted,
        checkpoint=best,
        baselines={r.name: BaselineRun(r.run_id, r.metrics) for r in baseline_results},
        test_predictions=predictions,
    )


def _calibrated(scores: dict[str, float]) -> dict[str, float]:
    return {f"test_{m}": scores[f"test_{m}_calibrated"] for m in COMPARED_METRICS}


def print_comparison(rows: list[tuple[str, dict[str, float]]]) -> None:
    """One table of every model's test metrics (higher AUCs, lower losses are better)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Test metrics (same test split)")
    table.add_column("model")
    for name in COMPARED_METRICS:
        table.add_column(name, justify="right")
    for model, scores in rows:
        table.add_row(model, *(f"{scores[f'test_{m}']:.4f}" for m in COMPARED_METRICS))
    Console(width=max(100, int(os.environ.get("COLUMNS", "100")))).print(table)

"""The Lightning pieces of training: data, module, schedule, weight average and Trainer.

`journeys.train` runs them (the MLflow run, evaluation, registration); this module holds
what changes when the way the network learns changes:

- `JourneyDataModule`: train/val/test loaders from the journeys' `split` column, with a
  fresh sample of negatives every epoch (`train.positive_share`);
- `JourneyModule`: `JourneyTransformer` + loss (on the journey's logit, or at every prefix
  with `train.objective: every_prefix`), optimiser and per-step schedule;
- `ema_update` / `weight_averaging`: the exponential moving average of the weights;
- `build_trainer`: checkpoints on `train.monitor` (`val_roc_auc`), early stopping, devices
  and precision.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning as L
import polars as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint, WeightAveraging
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader
from torchmetrics.classification import BinaryAUROC

from journeys.config import Model
from journeys.datasets import SPLITS, dataset_features, training_journeys
from journeys.encoding import (
    DEFAULT_BUCKET_BATCHES,
    EncodedJourneys,
    JourneyBatch,
    JourneyEncoder,
    make_dataloader,
    sample_negatives,
)
from journeys.errors import STOP_SIGNALS, ConfigError, InputError, Interrupted
from journeys.inputs import EventInput, columns_of
from journeys.model import JourneyTransformer, ModelConfig
from journeys.vocab import Vocabularies

if TYPE_CHECKING:
    from journeys.config import Config, Train


class _NoTips(logging.Filter):
    """Lightning advertises a cloud logger at every fit ("💡 Tip: ..."): noise in run logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("\N{ELECTRIC LIGHT BULB} Tip")


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_NoTips())

LAST_CHECKPOINT = "last.ckpt"
ADAM_EPS = 1e-9
COSINE_FLOOR = 0.1  # cosine decays to lr / 10 (nanoGPT's min_lr), not to zero
EMA_WARMUP = 10  # the EMA's decay ramps up as (1 + n) / (EMA_WARMUP + n) over its first steps


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
    """Train/val/test loaders from the journeys folder's `split` column, encoded by a
    `JourneyEncoder` fitted on the train split at `setup` (what the trained model keeps) for
    the per-event `columns` (`journeys.inputs`; None: the vocabularies' features).

    Censored journeys (unknown label, split `none`) are never in train/val/test. Scoring
    does not go through here: `journeys.inference.run_model` batches any encoded frame.
    """

    def __init__(
        self,
        journeys_dir: str | Path,
        vocabs: Vocabularies | None = None,
        *,
        max_len: int,
        model_settings: Model | None = None,
        timezone: str = "UTC",
        columns: Sequence[EventInput] | None = None,
        batch_size: int = 256,
        eval_batch_size: int | None = None,
        num_workers: int = 0,
        seed: int = 0,
        group_by_length: bool = True,
        bucket_batches: int = DEFAULT_BUCKET_BATCHES,
        negative_fraction: float = 1.0,
        window: timedelta | None = None,
    ) -> None:
        super().__init__()
        self.journeys_dir = Path(journeys_dir)
        self.window = window  # train.window: the journeys that ended within it
        self._vocabs = vocabs
        self.max_len = max_len
        self.model_settings = model_settings or Model()
        self.timezone = timezone
        self.columns = None if columns is None else tuple(columns)
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.group_by_length = group_by_length
        self.bucket_batches = bucket_batches
        self.negative_fraction = negative_fraction
        self.encoder: JourneyEncoder | None = None  # fitted on train at setup
        self.splits: dict[str, EncodedJourneys] = {}

    @classmethod
    def from_config(
        cls,
        config: Config,
        vocabs: Vocabularies | None = None,
        negative_fraction: float = 1.0,
        batch_size: int | None = None,
    ) -> JourneyDataModule:
        """The data module of `config`, reading the per-event columns its `data` section
        declares (its features resolved as ingest kept them: `dataset_features`);
        `batch_size` overrides `train.batch_size` (the run's `step_schedule`)."""
        return cls(
            config.paths.journeys,
            vocabs,
            max_len=config.journey.max_events,
            model_settings=config.model,
            timezone=config.data.timezone,
            columns=columns_of(dataset_features(config).data),
            batch_size=batch_size or config.train.batch_size,
            eval_batch_size=config.train.batch_size,
            num_workers=config.train.num_workers,
            seed=config.train.seed,
            negative_fraction=negative_fraction,
            window=config.train.window_delta,
        )

    @property
    def vocabs(self) -> Vocabularies:
        if self._vocabs is None:
            self._vocabs = Vocabularies.load(self.journeys_dir)
        return self._vocabs

    def _columns(self) -> list[str]:
        names = self.vocabs.features if self.columns is None else [c.name for c in self.columns]
        return ["journey_id", "label", "event_type", "event_time", *names]

    @property
    def fitted_encoder(self) -> JourneyEncoder:
        """The encoder fitted on the train split (read and fitted here when not yet): what
        sizes the model (`journeys.encoding.model_config_from`) and what it keeps."""
        self.setup()
        assert self.encoder is not None
        return self.encoder

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        frame = (
            training_journeys(self.journeys_dir, self.window)
            .select("split", *self._columns())
            .collect()
        )
        # Inputs are fitted on the train split only (vocabularies, numbers' scaling), stored
        # with the model.
        self.encoder = JourneyEncoder.fit(
            frame.filter(pl.col("split") == "train"),
            self.vocabs,
            self.model_settings,
            max_len=self.max_len,
            timezone=self.timezone,
            columns=self.columns,
        )
        for split in SPLITS:
            self.splits[split] = self.encoder.encode(frame.filter(pl.col("split") == split))

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

    `train.objective: every_prefix` (causal models) puts the loss on the logit after every
    real event, each prefix labelled with its journey's outcome; `val_loss` and
    `val_roc_auc` stay on the journey's logit (what is scored), and `val_prefix_roc_auc`
    is the AUC over every val prefix.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        train: Train,
        base_rate: float | None = None,
        negative_fraction: float = 1.0,
    ):
        super().__init__()
        self.every_prefix = train.objective == "every_prefix"
        if self.every_prefix and not model_config.causal:
            raise ConfigError("train.objective: every_prefix needs model.causal: true")
        self.model = JourneyTransformer(model_config)
        self.train_settings = train
        self.negative_fraction = negative_fraction
        pos_weight = torch.tensor(train.pos_weight) if train.pos_weight else None
        self.register_buffer("pos_weight", pos_weight, persistent=False)
        self.val_auroc = BinaryAUROC()  # accumulates over the epoch, syncs across ranks
        self.val_prefix_auroc = BinaryAUROC() if self.every_prefix else None
        # Every validated epoch's val logits, in the val split's order: the best epoch is
        # the checkpoint, so promotion judges it on a half of val that did not choose it
        # (`journeys.promotion.cross_fitted_transformer`). Kept in checkpoints for --resume.
        self.val_history: list[torch.Tensor] = []
        self._val_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        if base_rate is not None and 0 < base_rate < 1:
            # Start at the loss-minimising constant (the prior's log-odds, shifted by
            # pos_weight) rather than at p = 0.5: with a few % conversions the first
            # hundreds of steps would otherwise only learn the base rate. (With
            # prefix_weight: prefix that constant is the rate over prefixes: pass that.)
            prior = math.log(base_rate / (1 - base_rate)) + math.log(train.pos_weight or 1.0)
            with torch.no_grad():
                self.model.head.bias.fill_(prior)

    def _outputs(self, batch: JourneyBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The journey logits [B] and, for causal models, the prefix logits [B, L]."""
        out = self.model(
            batch.tokens,
            batch.features,
            batch.time_buckets,
            batch.mask,
            continuous=batch.continuous,
        )
        prefix = out.prefix_logits.float() if out.prefix_logits is not None else None
        return out.logits.float(), prefix  # bf16-mixed: the loss in float32

    def _logits(self, batch: JourneyBatch) -> torch.Tensor:
        return self._outputs(batch)[0]

    def objective(self, batch: JourneyBatch) -> torch.Tensor:
        """The training loss of a batch (see `train.objective` and `train.prefix_weight`)."""
        logits, prefix_logits = self._outputs(batch)
        # With a share f of the negatives, the odds in a batch are 1/f times the full
        # data's: the loss sees logit + log(1/f), so the model's own logit keeps the full
        # data's scale (King & Zeng 2001's prior correction, applied while training). Every
        # prefix of a sampled journey is sampled with it, so the same shift holds per prefix.
        offset = -math.log(self.negative_fraction)
        smoothing = self.train_settings.label_smoothing
        targets = batch.labels * (1 - smoothing) + 0.5 * smoothing
        if not self.every_prefix:
            return F.binary_cross_entropy_with_logits(
                logits + offset, targets, pos_weight=self.pos_weight
            )
        assert prefix_logits is not None  # causal: checked in __init__
        per_prefix = F.binary_cross_entropy_with_logits(
            prefix_logits + offset,
            targets[:, None].expand_as(prefix_logits),
            pos_weight=self.pos_weight,
            reduction="none",
        )
        mask = batch.mask
        per_prefix = torch.where(mask, per_prefix, 0.0)  # padding: no loss, no NaN
        if self.train_settings.prefix_weight == "prefix":
            return per_prefix.sum() / mask.sum().clamp(min=1)
        # Default: each journey's mean over its prefixes, then the mean over journeys. Every
        # journey weighs the same, as with the journey objective: with one term per prefix
        # a 64-event journey would count 32 times a 2-event one, so heavy users would
        # dominate the fit, and the loss-minimising constant would be the conversion rate
        # over events rather than over journeys, the rate the head's prior initialisation,
        # the negative-sampling correction and calibration are on. (Sampling one prefix per
        # journey would weigh alike too, but train on one event of each journey per epoch.)
        per_journey = per_prefix.sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_journey.mean()

    def training_step(self, batch: JourneyBatch, batch_idx: int) -> torch.Tensor:
        loss = self.objective(batch)
        self.log(
            "train_loss",
            loss,
            on_step=False,
            on_epoch=True,
            sync_dist=True,
            batch_size=len(batch.labels),
            prog_bar=True,
        )
        return loss

    def on_validation_epoch_start(self) -> None:
        self._val_parts = []

    def validation_step(self, batch: JourneyBatch, batch_idx: int) -> None:
        logits, prefix_logits = self._outputs(batch)
        self._val_parts.append((batch.index, logits.detach()))
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
        self.val_auroc.update(torch.sigmoid(logits), batch.labels.long())
        self.log(
            "val_loss", loss, on_epoch=True, sync_dist=True, batch_size=len(logits), prog_bar=True
        )
        self.log("val_roc_auc", self.val_auroc, on_epoch=True, prog_bar=True)
        if self.val_prefix_auroc is not None and prefix_logits is not None:
            mask = batch.mask
            labels = batch.labels[:, None].expand_as(mask)[mask].long()
            self.val_prefix_auroc.update(torch.sigmoid(prefix_logits[mask]), labels)
            self.log("val_prefix_roc_auc", self.val_prefix_auroc, on_epoch=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.sanity_checking or not self._val_parts:
            return
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None and datamodule.splits:
            size = len(datamodule.splits["val"])
        else:
            size = 1 + max(int(index.max()) for index, _ in self._val_parts)
        logits = torch.full((size,), math.nan, device=self.device)
        for index, values in self._val_parts:
            logits[index] = values
        if self.trainer.world_size > 1:  # each rank validated a share: NaN elsewhere
            logits = torch.nanmean(self.all_gather(logits), dim=0)
        self.val_history.append(logits.cpu())
        self._val_parts = []

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.val_history:
            checkpoint["val_history"] = torch.stack(self.val_history)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        history = checkpoint.get("val_history")
        self.val_history = list(history) if history is not None else []

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


# ----------------------------------------------------------------------------- trainer


def weight_averaging(settings: Train) -> list[Callback]:
    """The EMA of the weights as a callback, when `train.ema_decay` is set.

    Validation, checkpoints (so the logged model) and the end of fit use the average;
    `last.ckpt` also keeps the raw weights, so `--resume` continues both.
    """
    if settings.ema_decay is None:
        return []
    return [WeightAveraging(avg_fn=partial(ema_update, decay=settings.ema_decay))]


class ValidateLastEpoch(Callback):
    """With `check_val_every_n_epoch` > 1 Lightning validates only on its multiples; this
    also validates the last epoch, so the final weights can always be the checkpoint."""

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.max_epochs is not None and trainer.current_epoch == trainer.max_epochs - 1:
            trainer.check_val_every_n_epoch = 1


class StopBetweenSteps(Callback):
    """SIGTERM or Ctrl+C during a fit stops it after the batch under way, not wherever the
    signal lands: raised inside the logger's write to a SQLite store, the stop once left
    that write's lock held, the run could not be ended KILLED and the command exited 1,
    not 143. A second signal stops at once. (Lightning's own SIGTERM handler, which it
    puts before this one, may stop the fit first, with its `SIGTERMException`: `fit` in
    `journeys.train` turns that into `Interrupted`.)"""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.raised = False
        self.active = False
        self.previous: dict[int, Any] = {}

    def _signalled(self, signum: int, _frame: object) -> None:
        if not self.active:  # left installed by a stopped fit (Lightning restores it)
            self._restore()
            signal.raise_signal(signum)  # to the handler from before the fit
            return
        if self.signum is not None:
            raise Interrupted(signum)
        self.signum = signum

    def _restore(self) -> None:
        self.active = False
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _stop_if_signalled(self) -> None:
        if self.signum is not None and not self.raised:
            self.raised = True
            raise Interrupted(self.signum)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if threading.current_thread() is threading.main_thread():
            self.active = True
            self.previous = {
                signum: signal.signal(signum, self._signalled) for signum in STOP_SIGNALS
            }

    def on_train_batch_end(self, *_args: Any) -> None:
        self._stop_if_signalled()

    def on_validation_batch_end(self, *_args: Any) -> None:
        self._stop_if_signalled()

    def on_exception(self, *_args: Any) -> None:
        self._restore()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore()
        self._stop_if_signalled()  # after the last batch: the fit stops all the same


class EpochLines(Callback):
    """One line per validated epoch, for logs that are not a terminal (a scheduled run's
    file, a Prefect worker): a progress bar there shows nothing until it is flushed."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.validated = False

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.validated = not trainer.sanity_checking

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Here, not after validation (which runs inside the epoch): the epoch's train_loss
        # is reduced by now.
        validated, self.validated = self.validated, False
        if not validated or trainer.global_rank != 0:
            return
        metrics = trainer.callback_metrics
        shown = ", ".join(
            f"{name} {float(metrics[name]):.4f}"
            for name in ("train_loss", "val_loss", "val_roc_auc")
            if name in metrics
        )
        epochs = f"{trainer.current_epoch + 1}/{trainer.max_epochs}"
        elapsed = time.monotonic() - self.started
        print(f"epoch {epochs}: {shown} ({elapsed:.0f} s)", flush=True)


def global_rank() -> int:
    """This process's rank, known before the Trainer starts (env set by the launcher)."""
    return int(rank_zero_only.rank)


def min_epoch_journeys(settings: Train, world_size: int) -> int:
    """Journeys an epoch needs for `train.min_steps` optimiser steps in `train.max_epochs`
    (a step takes `batch_size` journeys on each of `world_size` ranks)."""
    steps_per_epoch = math.ceil(settings.min_steps / settings.max_epochs)
    return steps_per_epoch * settings.batch_size * world_size


@dataclass(frozen=True)
class StepSchedule:
    """How many journeys a step takes and how many epochs a run may go (`step_schedule`)."""

    batch_size: int
    epochs: int
    steps_per_epoch: int
    val_every_epochs: int

    @property
    def steps(self) -> int:
        return self.epochs * self.steps_per_epoch


def step_schedule(settings: Train, epoch_journeys: float, world_size: int) -> StepSchedule:
    """The run's schedule, counted in optimiser steps: at least `train.step_floor`,
    whatever the data's size.

    Most logs: `train.batch_size` journeys a step for `train.max_epochs` epochs. An epoch
    with fewer than `step_floor / max_epochs` batches takes smaller batches (down to
    `train.min_batch_size`); if that is still too few steps, the run gets more epochs
    until it makes `step_floor`, validated as often in steps as `max_epochs` epochs would
    be (so `train.patience` still spans a share of the run, not of its warm-up). Why: a
    log of a few hundred journeys is one batch an epoch, and 12 steps train nothing.
    """
    per_rank = epoch_journeys / max(1, world_size)
    wanted = math.ceil(settings.step_floor / settings.max_epochs)  # steps an epoch
    batch = settings.batch_size
    if wanted > math.ceil(per_rank / batch):  # too few steps at `batch_size`: smaller batches
        batch = min(batch, max(settings.min_batch_size, math.ceil(per_rank / wanted)))
    steps = max(1, math.ceil(per_rank / batch))
    epochs = max(settings.max_epochs, math.ceil(settings.step_floor / steps))
    val_every = max(settings.val_every_epochs, epochs // settings.max_epochs)
    return StepSchedule(batch, epochs, steps, val_every)


def build_trainer(
    config: Config, logger: Logger | bool, checkpoint_dir: Path | None, *, progress: bool = True
) -> tuple[L.Trainer, ModelCheckpoint]:
    """The Trainer, and its checkpoint of the best `train.monitor` (`val_roc_auc`).

    `progress=False` leaves out the progress bar and the model summary (benchmarks that
    train many models). Without val batches nothing stops early and the last weights count.
    """
    settings = config.train
    monitor = settings.monitor
    checkpoint = ModelCheckpoint(
        dirpath=checkpoint_dir,  # None off rank 0: Lightning broadcasts rank 0's
        filename=f"best-{{epoch:02d}}-{{{monitor}:.4f}}",
        monitor=monitor,
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
    # strict=False: a fit without val batches (a benchmark's refit on train + val) runs its
    # epochs; a monitor missing after validation still fails, in ModelCheckpoint.
    early_stopping = EarlyStopping(
        monitor=monitor, mode="max", patience=settings.patience, check_finite=False, strict=False
    )
    # A terminal gets the progress bar; a log file gets one line per epoch instead.
    bar = progress and sys.stdout.isatty()
    callbacks: list[Callback] = [
        checkpoint,
        last,
        early_stopping,
        ValidateLastEpoch(),
        StopBetweenSteps(),
        *weight_averaging(settings),
        *([EpochLines()] if progress and not bar else []),
    ]
    trainer = L.Trainer(
        accelerator=settings.accelerator,
        devices=settings.devices,
        num_nodes=settings.num_nodes,
        strategy=settings.strategy,
        precision=settings.precision,
        max_epochs=settings.max_epochs,
        check_val_every_n_epoch=settings.val_every_epochs,
        gradient_clip_val=settings.grad_clip or None,
        logger=logger,
        callbacks=callbacks,
        default_root_dir=config.paths.checkpoints,
        log_every_n_steps=1,  # only epoch-level metrics are logged; this just silences a warning
        enable_progress_bar=bar,
        enable_model_summary=progress,
    )
    return trainer, checkpoint

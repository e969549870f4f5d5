"""Self-supervised pre-training on the event stream, before conversion (`train.pretrain`).

Why: a small log has a few hundred conversions, so the transformer gets a few hundred
labels; its events are thousands of targets. Before it learns conversion, the network
learns what happens in journeys. A share of each journey's events is hidden (their event
type and features; their times stay), and a linear head names each hidden event's type
from its representation: BERT's masked language model (Devlin et al. 2019), over events.
The head is then dropped, and `journeys.train` fine-tunes the same network on conversion.

It reads the train split's journeys and the open ones (`journeys.datasets.
pretraining_journeys`), never a label and never val's or test's journeys. A hidden event
reads as padding (id 0, whose embedding is zero), so the network needs no mask token, and
the model it leaves has the shape of one trained without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from journeys.encoding import EncodedJourneys, JourneyBatch, make_dataloader
from journeys.lightning_parts import ADAM_EPS, decay_groups, lr_factor
from journeys.model import JourneyTransformer
from journeys.vocab import PAD_ID

if TYPE_CHECKING:
    from journeys.config import Pretrain, Train

LOG_EVERY = 50  # steps averaged into one logged point of the pre-training loss


@dataclass
class Pretrained:
    """What pre-training did: its steps, on how many journeys, and per `LOG_EVERY` steps the
    mean loss and the share of hidden events named right (step, loss, accuracy)."""

    steps: int
    journeys: int
    curve: list[tuple[int, float, float]] = field(default_factory=list)


def hide_events(
    batch: JourneyBatch, share: float, generator: torch.Generator
) -> tuple[JourneyBatch, Tensor]:
    """The batch with about `share` of each journey's events hidden (at least one in every
    journey), and where [B, L]: their event type and features read as padding."""
    noise = torch.rand(batch.mask.shape, generator=generator).to(batch.mask.device)
    noise = noise.masked_fill(~batch.mask, 2.0)  # padding is never hidden
    hidden = (noise < share) | ((noise == noise.amin(dim=1, keepdim=True)) & batch.mask)
    tokens = batch.tokens.masked_fill(hidden, PAD_ID)
    features = batch.features.masked_fill(hidden[:, None, :], PAD_ID)
    return batch._replace(tokens=tokens, features=features), hidden


def masked_event_loss(
    model: JourneyTransformer, head: nn.Linear, batch: JourneyBatch, hidden: Tensor, targets: Tensor
) -> tuple[Tensor, Tensor]:
    """Cross-entropy of naming each hidden event's type, and how many were named right."""
    states = model.hidden_states(
        batch.tokens, batch.features, batch.time_buckets, batch.mask, batch.continuous
    )
    logits = head(states[hidden]).float()
    loss = F.cross_entropy(logits, targets[hidden])
    return loss, (logits.argmax(dim=1) == targets[hidden]).sum()


def pretrain(
    model: JourneyTransformer,
    journeys: EncodedJourneys,
    settings: Pretrain,
    train: Train,
    batch_size: int,
    device: torch.device,
) -> Pretrained:
    """`settings.steps` optimiser steps of the masked-event objective on `journeys`, with
    `train`'s optimiser settings (AdamW, warm-up and decay, clipping), on `device`; the
    model is left on `device`."""
    model.to(device).train()
    head = nn.Linear(model.config.d_model, model.config.vocab_size).to(device)
    parameters = [*model.parameters(), *head.parameters()]
    optimizer = torch.optim.AdamW(
        decay_groups(parameters, train.weight_decay),
        lr=settings.lr or train.lr,
        betas=train.adam_betas,
        eps=ADAM_EPS,
    )
    schedule = partial(
        lr_factor,
        warmup_steps=min(train.warmup_steps, settings.steps // 10),
        total_steps=settings.steps,
        schedule=train.schedule,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    loader = make_dataloader(journeys, batch_size, shuffle=True, seed=train.seed)
    generator = torch.Generator().manual_seed(train.seed)
    bf16 = train.precision.startswith("bf16")
    done = Pretrained(steps=0, journeys=len(journeys))
    losses, named, hidden_count, epoch = [], 0, 0, 0
    while len(journeys) and done.steps < settings.steps:
        loader.batch_sampler.set_epoch(epoch)  # type: ignore[union-attr]
        for batch in loader:
            batch = JourneyBatch(*(t.to(device) if t is not None else t for t in batch))
            targets = batch.tokens
            batch, hidden = hide_events(batch, settings.mask_share, generator)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss, right = masked_event_loss(model, head, batch, hidden, targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if train.grad_clip:
                nn.utils.clip_grad_norm_(parameters, train.grad_clip)
            optimizer.step()
            scheduler.step()
            done.steps += 1
            losses.append(loss.item())
            named, hidden_count = named + int(right), hidden_count + int(hidden.sum())
            if done.steps % LOG_EVERY == 0 or done.steps == settings.steps:
                done.curve.append((done.steps, sum(losses) / len(losses), named / hidden_count))
                losses, named, hidden_count = [], 0, 0
            if done.steps == settings.steps:
                break
        epoch += 1
    return done

"""The one inference path: a model over encoded journeys, in batches, outputs in input order.

Training's evaluation, the packaged model, scoring and attribution all call `run_model`
(probabilities come from `journeys.metrics.sigmoid`, the one logistic function). Integrated gradients (per-event
attributions for the attribution report and the faithfulness benchmark) live here too,
beside the forward pass they differentiate. Attention rollout is computed inside the
model's forward pass (`attention="rollout"`), as is the pooled attention row.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import torch

from journeys.encoding import EncodedJourneys, make_dataloader
from journeys.model import AttentionMode, JourneyTransformer

IG_STEPS = 32  # Riemann steps along the integrated-gradients path (midpoint rule)
IG_BATCH_JOURNEYS = 32  # journeys per IG pass (each expands to IG_STEPS rows)


def pick_device(threads: int | None = None) -> torch.device:
    """The GPU when there is one; on CPU, use `threads` PyTorch threads (default: every
    core this process may run on)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if threads is None:
        try:
            threads = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            threads = os.cpu_count() or 1
    torch.set_num_threads(max(1, threads))
    return torch.device("cpu")


@dataclass(frozen=True)
class Outputs:
    """Model outputs in the journeys' order; per-event arrays are flat (journey i's events
    at `offsets[i]:offsets[i + 1]`, as in `EncodedJourneys`)."""

    logits: np.ndarray  # [n] float32
    offsets: np.ndarray  # [n + 1] int64
    attention: np.ndarray | None  # [events] float32, when asked for
    prefix_logits: np.ndarray | None  # [events] float32 (causal models)


def run_model(
    model: JourneyTransformer,
    encoded: EncodedJourneys,
    batch_size: int,
    attention: AttentionMode | None = None,
    device: torch.device | None = None,
) -> Outputs:
    """Run `model` over `encoded` in length-grouped batches, in eval mode, without grad.

    The model's training mode is restored afterwards (training evaluates mid-run).
    """
    device = device or next(model.parameters()).device
    causal = bool(model.config.causal)
    offsets = encoded.offsets
    logits = np.zeros(len(encoded), dtype=np.float32)
    weights = np.zeros(encoded.n_events, dtype=np.float32) if attention else None
    prefix = np.zeros(encoded.n_events, dtype=np.float32) if causal else None
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            # Grouped by length: batches of similar journeys waste little compute on
            # padding; `batch.index` puts every row back where it came from.
            loader = make_dataloader(encoded, batch_size, shuffle=False, group_by_length=True)
            for batch in loader:
                out = model(
                    batch.tokens.to(device),
                    batch.features.to(device),
                    batch.time_buckets.to(device),
                    batch.mask.to(device),
                    attention=attention,
                    continuous=_to(batch.continuous, device),
                )
                index = batch.index
                logits[index.numpy()] = out.logits.float().cpu().numpy()
                if weights is None and prefix is None:
                    continue
                positions = _flat_positions(offsets, index, batch.mask)
                if weights is not None:
                    weights[positions] = out.attention.float().cpu()[batch.mask].numpy()
                if prefix is not None:
                    prefix[positions] = out.prefix_logits.float().cpu()[batch.mask].numpy()
    finally:
        model.train(was_training)
    return Outputs(logits, offsets.numpy(), weights, prefix)


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device)


def _flat_positions(offsets: torch.Tensor, index: torch.Tensor, mask: torch.Tensor) -> np.ndarray:
    """Flat position of every real event of a batch, row-major like mask selection."""
    return (offsets[index][:, None] + torch.arange(mask.size(1)))[mask].numpy()


def list_series(name: str, offsets: np.ndarray, values: np.ndarray) -> pl.Series:
    """Flat values + offsets -> a List series without a Python loop (via Arrow)."""
    import pyarrow as pa

    array = pa.LargeListArray.from_arrays(pa.array(offsets, pa.int64()), pa.array(values))
    return pl.Series(name, array)


def attention_by_token(
    encoded: EncodedJourneys, attention: np.ndarray, tokens: list[str]
) -> dict[str, tuple[float, int]]:
    """Per event type: (mean attention x journey length, occurrences).

    Multiplying by the journey length makes 1 the uniform share, so long and short
    journeys weigh alike: > 1 means the model looks at that event type more than average.
    """
    ids = encoded.tokens.numpy().astype(np.int64)
    lengths = np.repeat(encoded.lengths.numpy(), encoded.lengths.numpy())
    relative = attention.astype(np.float64) * lengths
    sums = np.bincount(ids, weights=relative, minlength=len(tokens))
    counts = np.bincount(ids, minlength=len(tokens))
    return {
        tokens[i]: (float(sums[i] / counts[i]), int(counts[i]))
        for i in range(len(tokens))
        if counts[i] > 0
    }


# ----------------------------------------------------------------------------- IG


def integrated_gradients(
    model: JourneyTransformer,
    tokens: torch.Tensor,
    features: torch.Tensor,
    time_buckets: torch.Tensor,
    mask: torch.Tensor,
    steps: int = IG_STEPS,
    continuous: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-event IG of the conversion logit w.r.t. the summed input embedding [B, L].

    Sundararajan et al. (2017), in a few lines rather than captum. Baseline: zero
    embeddings (= padding, whose rows are zero). The embedding modules' outputs are scaled
    by alpha through forward hooks, so the model runs unchanged; since the input to the
    first block is their sum, the gradient w.r.t. any one of them is the gradient w.r.t.
    the sum. Positions and the CLS token are held fixed. Padded positions get 0.
    """
    batch, _ = tokens.shape
    device = tokens.device
    embeddings = model.input_modules()
    model.eval()
    with torch.no_grad():
        summed = model.event_embeddings(tokens, features, time_buckets, mask, continuous)

    def repeat(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.repeat_interleave(steps, dim=0)

    alphas = (torch.arange(steps, device=device, dtype=summed.dtype) + 0.5) / steps
    scale = alphas.repeat(batch)[:, None, None]  # row b * steps + s has alpha_s
    captured: list[torch.Tensor] = []

    def scale_output(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        scaled = output * scale
        if module is model.event_embedding:
            captured.append(scaled)
        return scaled

    hooks = [embedding.register_forward_hook(scale_output) for embedding in embeddings]
    try:
        with torch.enable_grad():
            logits = model(
                repeat(tokens),
                repeat(features),
                repeat(time_buckets),
                repeat(mask),
                continuous=repeat(continuous),
            ).logits
            (grad,) = torch.autograd.grad(logits.sum(), captured[0])
    finally:
        for hook in hooks:
            hook.remove()
    mean_grad = grad.view(batch, steps, *grad.shape[1:]).mean(dim=1)
    return (summed * mean_grad).sum(dim=-1) * mask


def run_integrated_gradients(
    model: JourneyTransformer,
    encoded: EncodedJourneys,
    steps: int = IG_STEPS,
    batch_journeys: int = IG_BATCH_JOURNEYS,
) -> np.ndarray:
    """Integrated gradients of every event of `encoded`, flat like `Outputs.attention`."""
    device = next(model.parameters()).device
    values = np.zeros(encoded.n_events, dtype=np.float32)
    for batch in make_dataloader(encoded, batch_journeys, shuffle=False, group_by_length=True):
        attributions = integrated_gradients(
            model,
            batch.tokens.to(device),
            batch.features.to(device),
            batch.time_buckets.to(device),
            batch.mask.to(device),
            steps,
            _to(batch.continuous, device),
        )
        positions = _flat_positions(encoded.offsets, batch.index, batch.mask)
        values[positions] = attributions.detach().float().cpu()[batch.mask].numpy()
    return values

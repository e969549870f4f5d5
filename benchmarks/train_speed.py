"""Training throughput of the conversion transformer: journeys/s, events/s, ms/step, memory.

Runs the product's training path (Lightning `JourneyModule`, the length-grouped loader,
the configured precision and device, the weight average when `train.ema_decay` is set) for a fixed number of optimiser steps on random
journeys, and times the steps after a warm-up. In the same run it trains the reference:
the same embeddings, pooling and head around `torch.nn.TransformerEncoder` of the same
size (same parameter count), on the same batches in the same loop, and prints the ratio.
With `--compare-grouping` it also runs plain (unsorted) batches, to show what length
grouping saves in padding. Each `--variant` also times the product model with other
settings (comma-separated overrides) and prints how much faster the configured model is.

Usage::

    .venv/bin/python benchmarks/train_speed.py                          # conf/default.yaml
    .venv/bin/python benchmarks/train_speed.py --config conf/gpu.yaml --set train.devices=1
    .venv/bin/python benchmarks/train_speed.py --quick --compare-grouping
    .venv/bin/python benchmarks/train_speed.py --variant model.attention_dropout=0.1 \\
        --variant model.attention_dropout=0.1,model.dropout=0.1     # what dropout costs

Only one device is used (devices=1, no DDP): the number is per GPU / per CPU process.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def random_journeys(
    n: int,
    mean_events: float,
    max_len: int,
    vocab_sizes: list[int],
    seed: int,
    n_continuous: int = 0,
):
    """`EncodedJourneys` of n random journeys with geometric lengths (1..max_len), with
    `n_continuous` standard-normal continuous inputs per event (time encodings, numbers)."""
    import torch

    from journeys.encoding import EncodedJourneys

    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.geometric(1 / mean_events, size=n), max_len)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    total = int(offsets[-1])

    def ids(size: int) -> torch.Tensor:  # ids >= 2: neither padding nor unknown
        return torch.from_numpy(rng.integers(2, size, total, dtype=np.int32))

    return EncodedJourneys(
        tokens=ids(vocab_sizes[0]),
        features=torch.stack([ids(size) for size in vocab_sizes[2:]])
        if len(vocab_sizes) > 2
        else torch.zeros(0, total, dtype=torch.int32),
        time_buckets=ids(vocab_sizes[1]),
        offsets=torch.from_numpy(offsets.astype(np.int64)),
        labels=torch.from_numpy((rng.random(n) < 0.1).astype(np.float32)),
        journey_ids=None,
        continuous=torch.from_numpy(rng.standard_normal((n_continuous, total), dtype=np.float32))
        if n_continuous
        else None,
    )


def torch_encoder_model(model_config):
    """`JourneyTransformer` with its blocks replaced by `torch.nn.TransformerEncoder`."""
    from torch import nn

    from journeys.model import JourneyTransformer, ModelOutput

    class TorchEncoderTransformer(JourneyTransformer):
        def __init__(self, config) -> None:
            super().__init__(config)
            layer = nn.TransformerEncoderLayer(
                config.d_model,
                config.n_heads,
                dim_feedforward=4 * config.d_model,
                dropout=config.dropout,
                activation="gelu",
                batch_first=True,
                norm_first=config.norm == "pre",
            )
            # One `dropout` covers everything in torch's layer; match ours on the weights.
            layer.self_attn.dropout = config.attention_dropout
            self.blocks = nn.ModuleList()
            self.encoder = nn.TransformerEncoder(layer, config.n_layers, enable_nested_tensor=False)

        def forward(self, tokens, features, time_buckets, mask, attention=None, continuous=None):
            mask = mask.bool()
            lengths = mask.sum(dim=1)
            events = self.event_embeddings(tokens, features, time_buckets, mask, continuous)
            x, seq_mask = self._sequence(events, mask, lengths)
            h = self.ln_f(self.encoder(x, src_key_padding_mask=~seq_mask))
            pooled = self._pool(h, mask, (lengths - 1).clamp(min=0))
            return ModelOutput(self.head(pooled).squeeze(-1))

    return TorchEncoderTransformer(model_config)


def run(
    config, encoded, steps: int, warmup: int, group_by_length: bool, reference: bool = False
) -> dict[str, float]:
    import lightning as L
    import torch

    from journeys.encoding import make_dataloader, model_config_from_sizes
    from journeys.lightning_parts import JourneyModule, weight_averaging

    settings = config.train
    n_features = encoded.features.size(0)
    model_config = model_config_from_sizes(
        config.model,
        vocab_size=int(encoded.tokens.max()) + 1,
        feature_vocab_sizes=tuple(int(encoded.features[i].max()) + 1 for i in range(n_features)),
        n_time_buckets=config.model.time_buckets,  # what `random_journeys` drew from
        n_continuous=0 if encoded.continuous is None else encoded.continuous.size(0),
        max_len=config.journey.max_events,
    )
    module = JourneyModule(model_config, settings)
    if reference:
        module.model = torch_encoder_model(model_config)
    loader = make_dataloader(
        encoded,
        settings.batch_size,
        shuffle=True,
        group_by_length=group_by_length,
        num_workers=settings.num_workers,
    )
    padded = 0
    real = 0
    for i, batch in enumerate(loader):  # padding share over the batches the run will see
        if i >= steps:
            break
        padded += batch.mask.numel()
        real += int(batch.mask.sum())

    class Clock(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.journeys = 0
            self.events = 0

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            if batch_idx >= warmup:
                self.journeys += len(batch.labels)
                self.events += int(batch.mask.sum())

    clock = Clock()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer = L.Trainer(
        accelerator=settings.accelerator,
        devices=1,
        precision=settings.precision,
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        gradient_clip_val=settings.grad_clip or None,
        callbacks=[clock, *weight_averaging(settings)],  # the EMA update is part of a step
    )
    trainer.fit(module, train_dataloaders=loader)
    elapsed = clock.times[-1] - clock.times[warmup - 1]
    measured = len(clock.times) - warmup
    memory = (
        torch.cuda.max_memory_allocated() / 2**20
        if torch.cuda.is_available()
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    return {
        "model": "torch.nn.TransformerEncoder" if reference else "journeys",
        "group_by_length": group_by_length,
        "steps_timed": measured,
        "ms_per_step": 1000 * elapsed / measured,
        "journeys_per_s": clock.journeys / elapsed,
        "events_per_s": clock.events / elapsed,
        "padding_share": 1 - real / padded,
        "peak_memory_mib": memory,
        "parameters": module.model.num_parameters(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "conf" / "default.yaml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--journeys", type=int, default=50_000)
    parser.add_argument("--mean-events", type=float, default=12.0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--runs", type=int, default=2, help="runs per model (even)")
    parser.add_argument("--compare-grouping", action="store_true")
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="also time the product model with these overrides (repeatable)",
    )
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    if args.quick:
        args.journeys, args.steps, args.warmup = 5_000, 12, 3
    if args.runs < 2 or args.runs % 2:
        parser.error("--runs must be an even number, at least 2")

    import lightning as L

    from journeys.config import load_config
    from journeys.inputs import TimeInput, columns_of

    config = load_config(args.config, args.overrides)
    L.seed_everything(config.train.seed, verbose=False)
    sizes = [64, config.model.time_buckets, *(16 for _ in config.data.features)]
    # The configuration's continuous inputs: the time's (encodings, the journey so far) and
    # each number's.
    time = TimeInput(
        config.model.time_buckets,
        "UTC" if config.model.time_encodings else None,
        journey_so_far=config.model.journey_so_far,
    )
    n_continuous = time.n_continuous + sum(c.n_continuous for c in columns_of(config.data))
    encoded = random_journeys(
        args.journeys,
        args.mean_events,
        config.journey.max_events,
        sizes,
        config.train.seed,
        n_continuous,
    )
    # Interleaved A B B A (variants: A B C C B A), repeated; best of `--runs` each: every
    # model sees the same machine load, none always runs first (the first run in a process
    # pays one-off start-up costs), and the best run is the one least disturbed by others.
    entries = [("journeys", config, False), ("torch.nn.TransformerEncoder", config, True)]
    for variant in args.variant:
        varied = load_config(args.config, [*args.overrides, *variant.split(",")])
        entries.append((variant, varied, False))
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in entries}
    for _ in range(args.runs // 2):
        for name, settings, reference in entries + entries[::-1]:
            result = run(settings, encoded, args.steps, args.warmup, True, reference=reference)
            runs[name].append(result | {"model": name})
    best = {name: max(results, key=lambda r: r["journeys_per_s"]) for name, results in runs.items()}
    results = list(best.values())
    if args.compare_grouping:
        results.append(run(config, encoded, args.steps, args.warmup, group_by_length=False))

    print(
        f"model d={config.model.d_model} layers={config.model.n_layers} "
        f"heads={config.model.n_heads}; batch {config.train.batch_size}; "
        f"precision {config.train.precision}; accelerator {config.train.accelerator}"
    )
    for r in results:
        print(
            f"  {r['model']:<28} grouped={r['group_by_length']!s:5}  {r['parameters']:,} params"
            f"  {r['ms_per_step']:8.1f} ms/step  "
            f"{r['journeys_per_s']:9.0f} journeys/s  {r['events_per_s']:10.0f} events/s  "
            f"padding {r['padding_share']:.0%}  process peak so far {r['peak_memory_mib']:.0f} MiB"
        )
    ours = best["journeys"]["journeys_per_s"]
    ratio = ours / best["torch.nn.TransformerEncoder"]["journeys_per_s"]
    print(f"journeys/s, this model / torch.nn.TransformerEncoder: {ratio:.2f} (target >= 1)")
    for variant in args.variant:
        faster = ours / best[variant]["journeys_per_s"]
        print(f"journeys/s, configured / with {variant}: {faster:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

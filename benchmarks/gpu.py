"""Training and scoring throughput of the transformer on one device: bf16 against fp32,
default and large sizes for training; the product's inference path for scoring, and
`journeys score` end to end against a bare loop on the device.

One prepared script for a single device call: for each model size and precision it runs
`--steps` optimiser steps on random journeys (after `--warmup` steps), and prints
journeys/s, tokens/s, achieved TFLOP/s and model FLOPs utilisation (MFU) against the
device's peak. FLOPs are counted analytically (matmuls only, forward + backward = 3x
forward), as in the PaLM / nanoGPT MFU estimates.

Scoring: `journeys.inference.run_model` (what `journeys score` runs per chunk: length-grouped
batches, pooled attention exported to NumPy) on random journeys of 1-64 events with the
default model, at `score.batch_size` 1024 and 8192; then `journeys score` end to end on
a simulated log (200k users), in order and on 2 and 4 thread workers, against a bare loop
whose padded batches are already on the device, and whether in-order and 4-worker
scores are the same.

    python benchmarks/gpu.py                         # on a GPU: default and large sizes
    python benchmarks/gpu.py --quick                 # tiny sizes, runs on CPU too
    python benchmarks/gpu.py --peak-tflops 989       # peak bf16 dense TFLOP/s of the device
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from journeys.config import load_config  # noqa: E402
from journeys.encoding import model_config_from_sizes  # noqa: E402
from journeys.inputs import TimeInput  # noqa: E402
from journeys.model import JourneyTransformer  # noqa: E402

# Dense bf16 peak (TFLOP/s) by device name; fp32 runs are compared with the same peak.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L4": 121.0}
VOCAB, FEATURE_VOCABS, TIME_BUCKETS = 64, (16, 8), 32


def synthetic_config(settings, max_len: int):
    """The architecture of `settings` over made-up inputs: `VOCAB` event types, features of
    `FEATURE_VOCABS` tokens, `TIME_BUCKETS` and the time's continuous inputs (time
    encodings, the journey so far) when they are on."""
    time = TimeInput(
        TIME_BUCKETS,
        "UTC" if settings.time_encodings else None,
        journey_so_far=settings.journey_so_far,
    )
    return model_config_from_sizes(
        settings,
        vocab_size=VOCAB,
        feature_vocab_sizes=FEATURE_VOCABS,
        n_time_buckets=TIME_BUCKETS,
        n_continuous=time.n_continuous,
        max_len=max_len,
    )


@dataclass(frozen=True)
class Size:
    name: str
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch: int


SIZES = [Size("default", 64, 2, 4, 64, 256), Size("large", 512, 6, 8, 256, 128)]
QUICK_SIZES = [Size("tiny", 32, 1, 2, 16, 32), Size("small", 64, 2, 4, 32, 32)]


def forward_flops_per_token(size: Size) -> float:
    """Matmul FLOPs per token of one forward pass: QKV+out (8d²), attention (4Ld), FFN (16d²)."""
    d, length = size.d_model, size.seq_len
    return size.n_layers * (24 * d * d + 4 * length * d)


def peak_tflops(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def measure(size: Size, precision: str, device: torch.device, steps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    # The product's model settings (conf defaults) at this size.
    settings = load_config(
        None,
        [
            f"model.d_model={size.d_model}",
            f"model.n_heads={size.n_heads}",
            f"model.n_layers={size.n_layers}",
            f"model.time_buckets={TIME_BUCKETS}",
        ],
    ).model
    config = synthetic_config(settings, size.seq_len)
    model = JourneyTransformer(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    b, length = size.batch, size.seq_len
    tokens = torch.randint(2, VOCAB, (b, length), device=device)
    features = torch.stack(
        [torch.randint(2, v, (b, length), device=device) for v in FEATURE_VOCABS], dim=1
    )
    buckets = torch.randint(1, TIME_BUCKETS, (b, length), device=device)
    mask = torch.ones(b, length, dtype=torch.bool, device=device)
    labels = torch.randint(0, 2, (b,), device=device).float()
    # The time encodings the default model reads (None when it reads none).
    continuous = (
        torch.randn(b, config.n_continuous, length, device=device) if config.n_continuous else None
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def step() -> None:
        with autocast:
            logits = model(tokens, features, buckets, mask, continuous=continuous).logits.float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = time.perf_counter() - start
    journeys_per_s = steps * b / seconds
    tokens_per_s = journeys_per_s * length
    tflops = 3 * forward_flops_per_token(size) * tokens_per_s / 1e12
    return {
        "size": size.name,
        "precision": precision,
        "params": model.num_parameters(),
        "journeys_per_s": journeys_per_s,
        "tokens_per_s": tokens_per_s,
        "tflops": tflops,
    }


def measure_scoring(device: torch.device, n_journeys: int, batch_size: int) -> dict:
    """Journeys/s of the product's inference path with the pooled attention exported."""
    from journeys.encoding import EncodedJourneys
    from journeys.inference import run_model

    torch.manual_seed(0)
    settings = load_config(None, [f"model.time_buckets={TIME_BUCKETS}"]).model
    config = synthetic_config(settings, 64)
    model = JourneyTransformer(config).to(device).eval()
    lengths = torch.randint(1, 65, (n_journeys,))
    offsets = torch.zeros(n_journeys + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    events = int(offsets[-1])
    encoded = EncodedJourneys(
        tokens=torch.randint(2, VOCAB, (events,), dtype=torch.int32),
        features=torch.stack(
            [torch.randint(2, v, (events,), dtype=torch.int32) for v in FEATURE_VOCABS]
        ),
        time_buckets=torch.randint(1, TIME_BUCKETS, (events,), dtype=torch.int32),
        offsets=offsets,
        labels=torch.zeros(n_journeys),
        journey_ids=None,
        continuous=torch.randn(config.n_continuous, events) if config.n_continuous else None,
    )
    run_model(model, encoded, batch_size, "pooled", device)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    run_model(model, encoded, batch_size, "pooled", device)  # ends with copies to the host
    seconds = time.perf_counter() - start
    return {
        "batch_size": batch_size,
        "journeys": n_journeys,
        "journeys_per_s": n_journeys / seconds,
    }


def measure_end_to_end(device: torch.device, users: int, repeats: int) -> list[dict]:
    """`journeys score` end to end (read Parquet, encode, forward, write Parquet) in order
    and on thread workers, against a bare loop over the same model and journeys whose
    padded batches are already on the device: how much of scoring on a GPU is the host's."""
    import shutil
    import tempfile

    from benchmarks.score import bare_batches, prepare, random_model
    from journeys.score import chunks_in_pool, score_dataset
    from journeys.trained_model import load_model

    folder = prepare(users)
    loaded = load_model(str(random_model(folder)))
    loaded.model.to(device)
    out = Path(tempfile.mkdtemp(prefix="gpu-score-"))

    def on_device(batch_size: int) -> list:
        return [
            batch._replace(
                **{
                    name: getattr(batch, name).to(device)
                    for name in ("tokens", "features", "time_buckets", "mask", "continuous")
                    if getattr(batch, name) is not None
                }
            )
            for batch in bare_batches(loaded, str(folder), batch_size)
        ]

    def bare(batches: list) -> float:
        began = time.perf_counter()
        with torch.inference_mode():
            for batch in batches:
                result = loaded.model(
                    batch.tokens, batch.features, batch.time_buckets, batch.mask,
                    attention="pooled", continuous=batch.continuous,
                )  # fmt: skip
                result.logits.cpu().numpy()
                result.attention[batch.mask].cpu().numpy()
        return time.perf_counter() - began

    def product(batch_size: int, workers: int) -> tuple[int, float]:
        began = time.perf_counter()
        rows = score_dataset(
            loaded, folder, out / "scores", batch_size=batch_size, progress=False,
            map_chunks=chunks_in_pool("thread", workers),
        ).rows  # fmt: skip
        return rows, time.perf_counter() - began

    rows_out = []
    try:
        for batch_size in (1024, 8192):
            batches = on_device(batch_size)
            bare(batches)  # warm-up
            bare_best = min(bare(batches) for _ in range(repeats))
            for workers in (1, 2, 4):
                product(batch_size, workers)  # warm-up
                runs = [product(batch_size, workers) for _ in range(repeats)]
                rows, best = runs[0][0], min(seconds for _, seconds in runs)
                rows_out.append(
                    {
                        "batch_size": batch_size,
                        "workers": workers,
                        "journeys": rows,
                        "product_journeys_per_s": rows / best,
                        "bare_journeys_per_s": rows / bare_best,
                    }
                )
        rows_out.append(same_scores_on_workers(loaded, folder, out))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return rows_out


def same_scores_on_workers(loaded: Any, folder: Path, out: Path) -> dict:
    """`journeys score` on the device in order and on 4 thread workers (batch 8192): the
    same rows, the model's floats equal up to the largest difference reported."""
    import polars as pl

    from journeys.score import chunks_in_pool, score_dataset

    frames = []
    for name, workers in (("in-order", 1), ("workers", 4)):
        score_dataset(
            loaded, folder, out / name, batch_size=8192, progress=False,
            map_chunks=chunks_in_pool("thread", workers),
            metadata={"scored_at": "2026-01-01T00:00:00+00:00"},
        )  # fmt: skip
        frames.append(pl.read_parquet(out / name).sort("journey_id"))
    in_order, workers = frames
    floats = ["conversion_probability", "events_probability", "attention"]
    return {
        "same_rows_and_columns": in_order.drop(floats).equals(workers.drop(floats)),
        "max_probability_difference": float(
            (in_order["conversion_probability"] - workers["conversion_probability"]).abs().max()
        ),
        "max_attention_difference": float(
            (in_order["attention"].explode() - workers["attention"].explode()).abs().max()
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: no silent TF32
    peak = peak_tflops(device, args.peak_tflops)
    sizes = QUICK_SIZES if args.quick else SIZES
    steps, warmup = (5, 2) if args.quick else (args.steps, args.warmup)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; peak {peak or 'unknown'} TFLOP/s; torch {torch.__version__}")
    rows = []
    for size in sizes:
        for precision in ("fp32", "bf16"):
            row = measure(size, precision, device, steps, warmup)
            row["mfu"] = row["tflops"] / peak if peak else None
            rows.append(row)
            mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "n/a"
            print(
                f"{row['size']:>8} {precision:>5}  {row['params']:>11,} params  "
                f"{row['journeys_per_s']:>11,.0f} journeys/s  {row['tokens_per_s']:>13,.0f} "
                f"tokens/s  {row['tflops']:8.2f} TFLOP/s  MFU {mfu}"
            )
    for size in sizes:
        fp32, bf16 = (r for r in rows if r["size"] == size.name)
        print(
            f"{size.name}: bf16 / fp32 throughput = {bf16['tokens_per_s'] / fp32['tokens_per_s']:.2f}x"
        )
    n_journeys = 2_000 if args.quick else 200_000
    for batch_size in (1024, 8192):
        row = measure_scoring(device, n_journeys, batch_size)
        rows.append({"scoring": True, **row})
        print(
            f"scoring, default model, batch {batch_size}: {row['journeys_per_s']:,.0f} "
            f"journeys/s ({n_journeys:,} journeys, pooled attention exported)"
        )
    users = 2_000 if args.quick else 200_000  # ~337k journeys: 7 chunks of the default 50k
    *timed, same = measure_end_to_end(device, users, repeats=1 if args.quick else 3)
    rows.append({"same_scores_on_workers": True, **same})
    for row in timed:
        rows.append({"end_to_end": True, **row})
        print(
            f"`journeys score` end to end, batch {row['batch_size']}, {row['workers']} thread "
            f"worker(s): {row['product_journeys_per_s']:,.0f} journeys/s against "
            f"{row['bare_journeys_per_s']:,.0f} for a bare loop on the device "
            f"({row['product_journeys_per_s'] / row['bare_journeys_per_s']:.2f}x; "
            f"{row['journeys']:,} journeys)"
        )
    print(
        "in order against 4 thread workers on the device: rows and columns "
        f"{'identical' if same['same_rows_and_columns'] else 'DIFFERENT'}, largest difference "
        f"{same['max_probability_difference']:.2e} in probability, "
        f"{same['max_attention_difference']:.2e} in attention"
    )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

"""Benchmark `journeys score`: throughput with and without the attention export, against a
bare PyTorch loop, on 1 and 2 workers, and peak memory at 1x and 10x the input size.

- Throughput: the same journeys dataset is scored end to end (`journeys.score.
  score_dataset`: read Parquet, encode, forward, write Parquet) with `attention=None`
  and with the exported attention (`pooled`, the default; `rollout` for reference),
  alternating runs in one process so that all see the same machine load.
  Two measurements: journeys/s with every core (the best run of each mode: on a shared
  machine other processes slow single runs down by up to 8x, and multi-threaded CPU time
  is no help, OpenMP threads spin while they wait), and the export cost from the CPU time
  of a single-threaded child (median per mode): one thread's CPU time is the work done,
  which other processes hardly disturb. Target: the export costs < 15%.
- Against a bare loop: the same model over the same journeys in plain PyTorch (batches
  encoded, length-grouped and padded beforehand, untimed; then forward passes with the
  pooled attention and the outputs copied to NumPy: no Polars, no Parquet), alternating
  with the product's end-to-end run in order and on the CLI's default 2 thread workers
  (each with one PyTorch thread: one worker's reading and writing overlap the other's
  forward passes), best wall time of each. Target: >= 0.8x.
- Workers: the 10x input's chunks on 2 workers (`chunks_in_pool`: threads, and spawned
  processes whose start-up counts) against 1 worker, each worker with one PyTorch
  thread (`shared_cores`), best wall time of each; and against 1 worker with every
  core, the default before scoring was mapped. Target: 2 workers >= 1.6x one.
- Memory: each size runs in its own fresh child process; its peak RSS (VmHWM) after one
  full scoring run is compared with the peak after imports and model loading. Chunks are
  cut equal in size (at most `score.chunk_journeys`), so both sizes use chunks of half
  the 1x input: 1x is then two whole chunks, as large as every 10x chunk.
  Target: flat (scoring streams in chunks of `score.chunk_journeys` journeys).

The model has the default architecture (conf/default.yaml) with random weights unless
`--model URI` names one: speed and memory do not depend on trained weights.

Usage::

    .venv/bin/python benchmarks/score.py                 # 1x = 40k users (~67k journeys), 10x
    .venv/bin/python benchmarks/score.py --quick         # 2k users, smoke run
    .venv/bin/python benchmarks/score.py --users 50000 --repeats 5 --no-record

Data are cached under data/bench/score/ (simulator seed 0); results are appended to
benchmarks/RESULTS.md unless `--no-record`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.recording import machine, record_section  # noqa: E402

WORK = ROOT / "data" / "bench" / "score"
# 1x: about 1.7 journeys (20 events) per user, so ~67k journeys: more than one chunk of
# the default `score.chunk_journeys` (50k), or 1x would only show a smaller single chunk.
USERS = 40_000
SCALES = (1, 10)
REPEATS = 5  # alternating (no export, pooled, rollout) runs at 1x
MODES = ("none", "pooled", "rollout")
BARE_MODES = ("product, in order", "product, 2 thread workers", "bare")
WORKER_MODES = ("1 worker", "2 threads", "2 processes", "1 worker, all cores")
EXPORT_TARGET = 0.15
BARE_TARGET = 0.8
WORKERS_TARGET = 1.6
ENV = {"MLFLOW_DISABLE_TELEMETRY": "true", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}


def prepare(users: int) -> Path:
    """A simulated log of `users` users, ingested with the default config (cached)."""
    from journeys.config import load_config
    from journeys.ingest import run_ingest
    from journeys.simulate import simulate

    folder = WORK / f"journeys-{users}"
    if (folder / "vocab.json").exists():
        return folder
    raw = WORK / f"raw-{users}"
    simulate(raw, users=users, seed=0)
    config = load_config(ROOT / "conf" / "default.yaml", [])
    run_ingest(config, raw=raw, journeys_folder=folder, quarantine_folder=WORK / "quarantine")
    shutil.rmtree(raw)  # the journeys are what scoring reads
    return folder


def random_model(journeys: Path) -> Path:
    """The default architecture with random weights, saved as the product's model files."""
    import polars as pl
    import torch

    from journeys.config import load_config
    from journeys.encoding import JourneyEncoder, model_config_from
    from journeys.model import JourneyTransformer
    from journeys.trained_model import JourneyRules, TrainedModel
    from journeys.vocab import Vocabularies

    folder = WORK / "model"
    config = load_config(ROOT / "conf" / "default.yaml", [])
    vocabs = Vocabularies.load(journeys)
    # No numeric feature in the default configuration: nothing to fit the encoder on.
    encoder = JourneyEncoder.fit(
        pl.DataFrame(),
        vocabs,
        config.model,
        max_len=config.journey.max_events,
        timezone=config.data.timezone,
    )
    torch.manual_seed(0)
    model = JourneyTransformer(model_config_from(config.model, encoder)).eval()
    TrainedModel(model, encoder, JourneyRules.from_config(config)).save(folder)
    return folder


def peak_mb() -> float:
    """This process's peak resident memory (MiB) so far.

    /proc's VmHWM, not `ru_maxrss`: Linux carries `ru_maxrss` across fork + exec, so a
    child started by a large parent would report the parent's peak.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(spec: dict) -> dict:
    """One measurement in a fresh process: `memory` (one full run, peak per chunk) or
    `throughput` (alternating runs per attention mode, wall and CPU seconds)."""
    import torch

    import journeys.encoding  # Lightning (~4 s): imported before any clock starts
    import journeys.inference
    import journeys.score
    from journeys.score import score_dataset
    from journeys.trained_model import load_model

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
        # The product uses every core; this child measures the work of one.
        journeys.inference.pick_device = lambda threads=None: torch.device("cpu")
    loaded = load_model(spec["model"], tracking_uri=spec.get("tracking_uri"))
    baseline = peak_mb()  # imports + model: the floor every size shares
    # Every run scores every journey: a run after another would keep its scores (a
    # nightly run's reuse, which `benchmarks/daily.py` measures).
    settings = dict(
        batch_size=spec["batch_size"], chunk_journeys=spec["chunk"], progress=False,
        keep_earlier=False,
    )  # fmt: skip
    out = Path(tempfile.mkdtemp(prefix="score-bench-", dir=WORK))

    def run(attention: str | None) -> tuple[int, float, float]:
        """Rows, wall seconds, CPU seconds of one end-to-end scoring run."""
        wall, cpu = time.perf_counter(), time.process_time()
        rows = score_dataset(
            loaded, spec["journeys"], out / "scores", attention=attention, **settings
        ).rows
        return rows, time.perf_counter() - wall, time.process_time() - cpu

    result: dict = {"threads": torch.get_num_threads()}
    try:
        if spec["task"] == "memory":
            # The peak after every chunk: flat means it stops rising after the first ones.
            chunk_peaks: list[float] = []
            release = journeys.score.release_freed_memory

            def traced_release() -> None:
                chunk_peaks.append(peak_mb())
                release()

            journeys.score.release_freed_memory = traced_release
            rows, seconds, _ = run("pooled")  # the product's path
            result |= {
                "rows": rows,
                "chunk": spec["chunk"],
                "baseline_mb": baseline,
                "peak_mb": peak_mb(),
                "chunk_peaks_mb": [round(p) for p in chunk_peaks],
                "seconds": seconds,
            }
        elif spec["task"] == "bare":
            batches = bare_batches(loaded, spec["journeys"], spec["batch_size"])
            default_pool = journeys.score.chunks_in_pool("thread", 2)  # the CLI's default
            cores = torch.get_num_threads()
            wall = {mode: [] for mode in BARE_MODES}
            for _ in range(spec["repeats"]):
                rows, seconds, _ = run("pooled")
                wall["product, in order"].append(seconds)
                began = time.perf_counter()
                score_dataset(
                    loaded, spec["journeys"], out / "scores", attention="pooled",
                    map_chunks=default_pool, **settings,
                )  # fmt: skip
                wall["product, 2 thread workers"].append(time.perf_counter() - began)
                torch.set_num_threads(cores)
                wall["bare"].append(bare_loop(loaded.model, batches))
            result |= {"rows": rows, "wall": wall}
        elif spec["task"] == "workers":

            def one_thread(score, chunks):  # in order, one PyTorch thread
                single = dataclasses.replace(score, torch_threads=1)
                return [single(index, chunk) for index, chunk in enumerate(chunks)]

            pools = {
                "1 worker": one_thread,
                "2 threads": journeys.score.chunks_in_pool("thread", 2),
                "2 processes": journeys.score.chunks_in_pool("process", 2),
            }
            cores = torch.get_num_threads()
            wall = {mode: [] for mode in WORKER_MODES}
            for _ in range(spec["repeats"]):
                for mode in WORKER_MODES:
                    torch.set_num_threads(cores)  # workers set their own share
                    began = time.perf_counter()
                    rows = score_dataset(
                        loaded, spec["journeys"], out / "scores", attention="pooled",
                        map_chunks=pools.get(mode), **settings,
                    ).rows  # fmt: skip
                    wall[mode].append(time.perf_counter() - began)
            result |= {
                "rows": rows,
                "wall": wall,
                "chunks": -(-rows // spec["chunk"]),
            }
        else:
            wall: dict[str, list[float]] = {mode: [] for mode in MODES}
            cpu: dict[str, list[float]] = {mode: [] for mode in MODES}
            for _ in range(spec["repeats"]):
                for mode in MODES:
                    rows, seconds, used = run(None if mode == "none" else mode)
                    wall[mode].append(seconds)
                    cpu[mode].append(used)
            result |= {"rows": rows, "wall": wall, "cpu": cpu}
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return result


def bare_batches(loaded, journeys: str, batch_size: int) -> list:
    """The journeys as the model's padded, length-grouped batches, built beforehand."""
    import polars as pl

    from journeys.encoding import make_dataloader

    frame = pl.read_parquet(Path(journeys) / "part-*.parquet")
    encoded = loaded.encode(frame)
    return list(make_dataloader(encoded, batch_size, shuffle=False, group_by_length=True))


def bare_loop(model, batches: list) -> float:
    """Wall seconds of a plain PyTorch pass over `batches`: logits and pooled attention
    out to NumPy, as any scoring loop must."""
    import torch

    began = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            out = model(
                batch.tokens, batch.features, batch.time_buckets, batch.mask,
                attention="pooled", continuous=batch.continuous,
            )  # fmt: skip
            out.logits.numpy()
            out.attention[batch.mask].numpy()
    return time.perf_counter() - began


def run_child(spec: dict) -> dict:
    env = {**os.environ, **ENV}
    if spec.get("threads"):
        env |= {"OMP_NUM_THREADS": str(spec["threads"]), "POLARS_MAX_THREADS": str(spec["threads"])}
    command = [sys.executable, __file__, "--child", json.dumps(spec)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(results: dict, args: argparse.Namespace, command: str, host: str) -> str:
    fast, single = results["throughput"], results["single_thread"]
    rows = fast["rows"]
    best = {mode: min(values) for mode, values in fast["wall"].items()}
    work = {mode: statistics.median(values) for mode, values in single["cpu"].items()}

    def cost(times: dict[str, float], mode: str) -> str:
        return f"{100 * (times[mode] / times['none'] - 1):+.1f}%"

    from journeys.config import load_config

    default = load_config(ROOT / "conf" / "default.yaml", []).model
    model = args.model or (
        f"default architecture (d_model {default.d_model}, {default.n_heads} heads, "
        f"{default.n_layers} layers, {default.pooling} pooling), random weights"
    )

    lines = [
        "",
        f"## Scoring throughput and memory ({datetime.now(UTC):%Y-%m-%d})",
        "",
        f"- Command: `{command}`",
        f"- Machine: {host}",
        f"- Model: {model}; "
        f"`score.batch_size` {args.batch_size}, `score.chunk_journeys` {args.chunk}; end to end "
        "(read Parquet, encode, forward, write Parquet), imports and model loading excluded; "
        f"{args.repeats} alternating runs per mode.",
        "",
        f"| 1x: {rows:,} journeys | no export | pooled (default) | rollout |",
        "|---|---:|---:|---:|",
        f"| journeys/s, {fast['threads']} threads (best run) | {rows / best['none']:,.0f} | "
        f"{rows / best['pooled']:,.0f} | {rows / best['rollout']:,.0f} |",
        f"| export cost, {fast['threads']} threads (best wall times) | | {cost(best, 'pooled')} | "
        f"{cost(best, 'rollout')} |",
        f"| CPU seconds, 1 thread (median) | {work['none']:.2f} | {work['pooled']:.2f} | "
        f"{work['rollout']:.2f} |",
        f"| **export cost, 1 thread (CPU time; target < 15%)** | | **{cost(work, 'pooled')}** | "
        f"{cost(work, 'rollout')} |",
        "",
        "All runs, wall seconds with every core: "
        + "; ".join(f"{m} {', '.join(f'{w:.1f}' for w in fast['wall'][m])}" for m in MODES)
        + ". CPU seconds with one thread: "
        + "; ".join(f"{m} {', '.join(f'{c:.2f}' for c in single['cpu'][m])}" for m in MODES)
        + ".",
        "",
        *bare_and_workers(results),
        f"| input | journeys | chunks of {results['memory'][min(results['memory'])]['chunk']:,} | peak RSS after imports + model | peak RSS after scoring | scoring adds | peak after chunk 1, 2, 4, 8, ... (MiB) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for scale, r in results["memory"].items():
        peaks = r["chunk_peaks_mb"]
        shown = [peaks[i - 1] for i in (1, 2, 4, 8, 16, 32, 64) if i <= len(peaks)]
        if peaks and len(peaks) not in (1, 2, 4, 8, 16, 32, 64):
            shown.append(peaks[-1])  # and the last chunk
        lines.append(
            f"| {scale}x | {r['rows']:,} | {len(peaks)} | {r['baseline_mb']:,.0f} MiB | "
            f"{r['peak_mb']:,.0f} MiB | {r['peak_mb'] - r['baseline_mb']:,.0f} MiB | "
            f"{', '.join(f'{p:,}' for p in shown)} |"
        )
    return "\n".join(lines) + "\n"


def bare_and_workers(results: dict) -> list[str]:
    """The table lines against the bare loop and on 1 or 2 workers."""
    bare, workers = results["bare"], results["workers"]
    best = {mode: min(values) for mode, values in bare["wall"].items()}
    fastest = {mode: min(values) for mode, values in workers["wall"].items()}
    one = fastest["1 worker"]
    lines = [
        f"| against the bare loop, {bare['rows']:,} journeys, pooled attention, "
        f"{bare['threads']} cores | journeys/s (best run) | against the bare loop "
        "(target >= 0.8x) |",
        "|---|---:|---:|",
        *(
            f"| {mode} | {bare['rows'] / best[mode]:,.0f} | "
            + ("" if mode == "bare" else f"**{best['bare'] / best[mode]:.2f}x**")
            + " |"
            for mode in BARE_MODES
        ),
        "",
        f"| {workers['rows']:,} journeys in {workers['chunks']} chunks, pooled attention | "
        + " | ".join(WORKER_MODES)
        + " |",
        "|---|" + "---:|" * len(WORKER_MODES),
        "| journeys/s (best run) | "
        + " | ".join(f"{workers['rows'] / fastest[m]:,.0f}" for m in WORKER_MODES)
        + " |",
        "| against 1 worker (target: 2 workers >= 1.6x) | "
        + " | ".join(f"**{one / fastest[m]:.2f}x**" for m in WORKER_MODES)
        + " |",
        "",
        "All runs, wall seconds: "
        + "; ".join(f"{m} {', '.join(f'{w:.1f}' for w in bare['wall'][m])}" for m in bare["wall"])
        + "; "
        + "; ".join(
            f"{m} {', '.join(f'{w:.1f}' for w in workers['wall'][m])}" for m in WORKER_MODES
        )
        + ".",
        "",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--users", type=int, default=USERS, help="users at 1x")
    parser.add_argument("--scales", type=int, nargs="+", default=list(SCALES))
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed runs per mode")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=50_000)
    parser.add_argument("--model", default=None, help="model URI (default: random weights)")
    parser.add_argument("--tracking-uri", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.quick:
        args.users, args.repeats = 2_000, 1
    os.environ.update(ENV)
    WORK.mkdir(parents=True, exist_ok=True)
    host = machine(with_load=True)

    folders = {scale: prepare(args.users * scale) for scale in args.scales}
    model = args.model or str(random_model(folders[min(folders)]))
    base = {
        "model": model,
        "tracking_uri": args.tracking_uri,
        "batch_size": args.batch_size,
        "chunk": args.chunk,
        "repeats": args.repeats,
    }
    results: dict = {"memory": {}}
    # Chunks are equal in size, so the smallest input's are smaller than the setting: both
    # sizes use chunks of half the smallest input, which makes it two whole chunks too.
    from journeys.datasets import count_rows, parquet_parts

    smallest_rows = count_rows(parquet_parts(folders[min(folders)]))
    memory_chunk = min(args.chunk, -(-smallest_rows // 2))
    for scale, folder in folders.items():  # each size in its own fresh process
        spec = {**base, "task": "memory", "journeys": str(folder), "chunk": memory_chunk}
        results["memory"][scale] = run_child(spec)
        print(f"memory {scale}x: {json.dumps(results['memory'][scale])}", flush=True)
    smallest = str(folders[min(folders)])
    for name, task, threads in (
        ("throughput", "throughput", None),
        ("single_thread", "throughput", 1),
        ("bare", "bare", None),
        ("workers", "workers", None),
    ):
        # Workers need chunks to share out: the largest input (14 chunks at 10x).
        folder = str(folders[max(folders)]) if task == "workers" else smallest
        repeats = min(args.repeats, 2) if task == "workers" else args.repeats
        spec = {**base, "task": task, "journeys": folder, "threads": threads, "repeats": repeats}
        results[name] = run_child(spec)
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    command = "python benchmarks/score.py " + " ".join(sys.argv[1:])
    text = markdown(results, args, command.strip(), host)
    print(text)
    if not args.no_record:
        record_section(text)


if __name__ == "__main__":
    main()

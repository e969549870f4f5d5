"""Benchmark `journeys score`: throughput with and without the attention export, and peak
memory at 1x and 10x the input size.

- Throughput: the same journeys dataset is scored end to end (`journeys.score.
  score_dataset`: read Parquet, encode, forward, write Parquet) with `attention=None`
  and with the exported attention (`pooled`, the default; `rollout` for reference),
  alternating runs in one process so that all see the same machine load; the best
  journeys/s of each is reported (on a shared machine other processes slow single runs
  down by up to 8x, so the least disturbed run is the signal). Target: the export
  costs < 15%.
- Memory: each size runs in its own fresh child process; its peak RSS (VmHWM) after one
  full scoring run is compared with the peak after imports and model loading.
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

WORK = ROOT / "data" / "bench" / "score"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
# 1x: about 1.7 journeys (20 events) per user, so ~67k journeys: more than one chunk of
# the default `score.chunk_journeys` (50k), or 1x would only show a smaller single chunk.
USERS = 40_000
SCALES = (1, 10)
REPEATS = 5  # alternating (no export, pooled, rollout) runs at 1x
EXPORT_TARGET = 0.15
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
    import torch

    from journeys import packaging
    from journeys.config import load_config
    from journeys.model import JourneyTransformer, ModelConfig
    from journeys.vocab import Vocabularies

    folder = WORK / "model"
    config = load_config(ROOT / "conf" / "default.yaml", [])
    vocabs = Vocabularies.load(journeys)
    torch.manual_seed(0)
    settings = ModelConfig.from_config(config.model, vocabs, config.journey.max_events)
    model = JourneyTransformer(settings).eval()
    packaging.save_model_files(folder, model, vocabs, packaging.preprocessing_settings(config))
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
    """One size, in a fresh process: a memory run, then alternating throughput runs."""
    import journeys.data  # Lightning (~4 s): imported before any clock starts
    import journeys.score
    from journeys.packaging import load_model
    from journeys.score import score_dataset

    loaded = load_model(spec["model"], tracking_uri=spec.get("tracking_uri"))
    baseline = peak_mb()  # imports + model: the floor every size shares

    # The peak after every chunk: flat means it stops rising after the first chunks.
    chunk_peaks: list[float] = []
    release = journeys.score.release_freed_memory

    def traced_release() -> None:
        chunk_peaks.append(peak_mb())
        release()

    journeys.score.release_freed_memory = traced_release
    settings = dict(batch_size=spec["batch_size"], chunk_journeys=spec["chunk"], progress=False)
    out = Path(tempfile.mkdtemp(prefix="score-bench-", dir=WORK))

    def run(attention: str | None) -> tuple[int, float]:
        started = time.perf_counter()
        rows = score_dataset(
            loaded, spec["journeys"], out / "scores", attention=attention, **settings
        )
        return rows, time.perf_counter() - started

    rows, seconds = run("pooled")  # the product's path; its peak is the memory number
    journeys.score.release_freed_memory = release
    result = {
        "rows": rows,
        "baseline_mb": baseline,
        "peak_mb": peak_mb(),
        "chunk_peaks_mb": [round(p) for p in chunk_peaks],
        "first_run_s": seconds,
        "threads": __import__("torch").get_num_threads(),
    }
    timings: dict[str, list[float]] = {"none": [], "pooled": [], "rollout": []}
    for _ in range(spec["repeats"]):
        for mode in (None, "pooled", "rollout"):
            timings[mode or "none"].append(run(mode)[1])
    result["seconds"] = timings
    shutil.rmtree(out, ignore_errors=True)
    return result


def run_child(spec: dict) -> dict:
    env = {**os.environ, **ENV}
    command = [sys.executable, __file__, "--child", json.dumps(spec)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> str:
    import platform

    import torch

    cpu = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0))
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    load = os.getloadavg()[0]
    return (
        f"{cpu}, {cores} cores, {gpu}; torch {torch.__version__}; "
        f"load average {load:.1f} at the start (the machine is shared)"
    )


def markdown(results: dict[int, dict], args: argparse.Namespace, command: str, host: str) -> str:
    lines = [
        "",
        f"## Scoring throughput and memory ({datetime.now(UTC):%Y-%m-%d})",
        "",
        f"- Command: `{command}`",
        f"- Machine: {host}",
        f"- Model: {args.model or 'default architecture (d_model 64, 4 heads, 2 layers, CLS), random weights'}; "
        f"`score.batch_size` {args.batch_size}, `score.chunk_journeys` {args.chunk}; end to end "
        "(read Parquet, encode, forward, write Parquet), imports and model loading excluded.",
        "",
        f"Best of {args.repeats} alternating runs each (the minimum time is the least disturbed "
        "by other load on a shared machine); the export cost of the medians in brackets.",
        f"All timed runs (s): {json.dumps({k: [round(x, 1) for x in v] for k, v in results[min(results)]['seconds'].items()})}.",
        "",
        "| input | journeys | no export (j/s) | pooled (j/s) | export cost | rollout (j/s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for scale, r in results.items():
        seconds = r["seconds"]
        if not seconds["none"]:
            continue
        none, pooled, rollout = (min(seconds[m]) for m in ("none", "pooled", "rollout"))
        cost = pooled / none - 1
        median_cost = statistics.median(seconds["pooled"]) / statistics.median(seconds["none"]) - 1
        lines.append(
            f"| {scale}x | {r['rows']:,} | {r['rows'] / none:,.0f} | {r['rows'] / pooled:,.0f} | "
            f"**{100 * cost:+.1f}%** ({100 * median_cost:+.1f}%) | {r['rows'] / rollout:,.0f} |"
        )
    lines += [
        "",
        "| input | journeys | chunks | peak RSS after imports + model | peak RSS after scoring | scoring adds | peak after chunk 1, 2, 4, 8, ... (MiB) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for scale, r in results.items():
        peaks = r["chunk_peaks_mb"]
        shown = [peaks[i - 1] for i in (1, 2, 4, 8, 16, 32, 64) if i <= len(peaks)]
        if peaks and len(peaks) not in (1, 2, 4, 8, 16, 32, 64):
            shown.append(peaks[-1])  # and the last chunk
        lines.append(
            f"| {scale}x | {r['rows']:,} | {len(peaks)} | {r['baseline_mb']:,.0f} MiB | {r['peak_mb']:,.0f} MiB | "
            f"{r['peak_mb'] - r['baseline_mb']:,.0f} MiB | {', '.join(f'{p:,}' for p in shown)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--users", type=int, default=USERS, help="users at 1x")
    parser.add_argument("--scales", type=int, nargs="+", default=list(SCALES))
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed pairs at 1x")
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
    host = machine()

    folders = {scale: prepare(args.users * scale) for scale in args.scales}
    model = args.model or str(random_model(folders[min(folders)]))
    results: dict[int, dict] = {}
    for scale, folder in folders.items():
        spec = {
            "journeys": str(folder),
            "model": model,
            "tracking_uri": args.tracking_uri,
            "batch_size": args.batch_size,
            "chunk": args.chunk,
            # Throughput is timed at the smallest size; larger ones get one memory run.
            "repeats": args.repeats if scale == min(folders) else 0,
        }
        results[scale] = run_child(spec)
        print(f"{scale}x: {json.dumps(results[scale])}", flush=True)
    command = "python benchmarks/score.py " + " ".join(sys.argv[1:])
    text = markdown(results, args, command.strip(), host)
    print(text)
    if not args.no_record:
        with RESULTS.open("a") as handle:
            if handle.tell() == 0:
                handle.write("# Benchmark results\n")
            handle.write(text)
        print(f"appended to {RESULTS}")


if __name__ == "__main__":
    main()

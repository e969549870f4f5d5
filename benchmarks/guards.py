"""What the ingest guards cost: `journeys ingest` with them (the defaults) against the same
run with each one stood aside, on the benchmark's simulated log.

The guards (issue 20): copies judged on every column of the source row (a hash of the
whole row, `data.dedupe: all_columns`, against `read_columns`), the plausible-timestamp
window, the quarantined-share stop and the absent-conversions stop. Runs alternate
(on, off, on, off, ...) in fresh child processes so both see the same machine; the best
wall time and CPU time of each are printed, and their medians. Target: the guards cost < 3% at 10M events.

    .venv/bin/python benchmarks/guards.py                 # 10M events, 3 runs each
    .venv/bin/python benchmarks/guards.py --size 1000000 --runs 2

The log is the one `benchmarks/ingest.py` caches under `data/bench/events-<size>/`.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.ingest import BENCH, CONFIG, ROOT, ensure_events, warm_cache

GUARDS_OFF = [
    "data.dedupe=read_columns",
    "data.plausible_from=1678-01-01T00:00:00",
    "data.plausible_future=10000w",
    "ingest.max_quarantined_share=1",
    "ingest.require_conversions=false",
]


def child(csv: str, out: str, guards: str) -> None:
    """One ingest; prints its wall seconds and the report's counts as JSON."""
    from journeys.config import load_config
    from journeys.ingest import run_ingest

    overrides = [f"paths.raw={csv}", f"paths.journeys={out}/journeys",
                 f"paths.quarantine={out}/quarantine"]  # fmt: skip
    if guards == "off":
        overrides += GUARDS_OFF
    config = load_config(CONFIG, overrides)
    start = time.perf_counter()
    report = run_ingest(config).report.to_json()
    wall = time.perf_counter() - start
    keys = ("rows_read", "duplicates_dropped", "quarantined_total", "journeys")
    print(json.dumps({"wall_s": wall, **{k: report[k] for k in keys}}))


def measure(csv: Path, guards: str) -> dict:
    out = BENCH / "out" / f"guards-{guards}"
    warm_cache(csv)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [sys.executable, __file__, "--child", str(csv), str(out), guards],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=10_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return 0
    csv, n_events = ensure_events(args.size)
    results: dict[str, list[dict]] = {"on": [], "off": []}
    for _ in range(args.runs):
        for guards in ("on", "off"):
            result = measure(csv, guards)
            results[guards].append(result)
            print(f"guards {guards:>3}: {result['wall_s']:.1f} s, {result['cpu_s']:.1f} cpu s")
    on, off = results["on"][0], results["off"][0]
    # Best and median: one lucky run moves the best by several percent on a shared machine.
    for name, pick in (("best", min), ("median", statistics.median)):
        print(f"\n{n_events:,} events, {name} of {args.runs}:")
        for key in ("wall_s", "cpu_s"):
            values = {g: pick([r[key] for r in rs]) for g, rs in results.items()}
            ratio = values["on"] / values["off"]
            print(f"  {key}: guards on {values['on']:.1f}, off {values['off']:.1f}: {ratio:.3f}x")
    print(f"  rows {on['rows_read']:,}; duplicates dropped: on {on['duplicates_dropped']:,}, "
          f"off {off['duplicates_dropped']:,}; journeys on {on['journeys']:,}, off {off['journeys']:,}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

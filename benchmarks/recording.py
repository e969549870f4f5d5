"""What the benchmark scripts share: a one-line description of the machine, and the
append to `benchmarks/RESULTS.md` that keeps every measured result with its context."""

from __future__ import annotations

import os
import platform
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def machine(with_load: bool = False) -> str:
    """CPU model, usable cores, GPU, Python and torch versions (and the load average)."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    text = f"{cpu}, {cores} cores, {gpu}; Python {platform.python_version()}, torch {torch.__version__}"
    if with_load:
        text += f"; load average {os.getloadavg()[0]:.1f} at the start (the machine is shared)"
    return text


def append_results(text: str) -> None:
    """Append a markdown section to RESULTS.md (creating it with its title)."""
    with RESULTS.open("a") as handle:
        if handle.tell() == 0:
            handle.write("# Benchmark results\n")
        handle.write(text)
    print(f"appended to {RESULTS}")

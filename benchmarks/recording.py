"""What the benchmark scripts share: a one-line description of the machine, and
`record_section`, which keeps each benchmark's latest run in `benchmarks/RESULTS.md`.

RESULTS.md holds one `## <name> (<date or note>)` section per benchmark, and each section
holds only that benchmark's latest run; earlier runs live in git
(`git log -p benchmarks/RESULTS.md`). A benchmark records a run by passing its markdown,
which starts with its own heading line, to `record_section(text)`:

- the section's *name* is the heading's text before the first " (": the heading
  `## Attribution faithfulness (2026-12-02)` has the name `Attribution faithfulness`;
- the section of RESULTS.md whose name is the same (its heading line up to the next `## `
  heading outside a code fence, or the end of the file) is replaced by the text, and any
  later section of that name is removed; when there is none, the text is appended;
- the file is written whole to a temporary file in the same folder and moved over
  RESULTS.md with `os.replace`, so a crash leaves the old file or the new one, never half.

The table of current figures at the top of RESULTS.md is not rewritten: update its row by
hand when a run moves a figure.
"""

from __future__ import annotations

import os
import platform
import tempfile
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
TITLE = "# Benchmark results\n"


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


def section_name(heading: str) -> str:
    """`## Name (anything)` -> `Name`."""
    return heading.removeprefix("## ").split(" (", 1)[0].strip()


def _sections(lines: list[str]) -> list[tuple[int, int, str]]:
    """(first line, end line, name) of every `## ` section, skipping fenced code."""
    starts: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            starts.append((number, section_name(line)))
    ends = [start for start, _ in starts[1:]] + [len(lines)] * bool(starts)
    return [(start, end, name) for (start, name), end in zip(starts, ends, strict=True)]


def record_section(text: str, results: Path = RESULTS) -> None:
    """Replace (or append) the section of `results` that `text`'s `## ` heading names."""
    body = text.strip("\n").splitlines()
    if not body or not body[0].startswith("## "):
        raise ValueError("a recorded section must start with its '## <name> (...)' heading")
    name = section_name(body[0])
    old = results.read_text() if results.exists() else TITLE
    lines = old.rstrip("\n").splitlines()
    matches = [(start, end) for start, end, found in _sections(lines) if found == name]
    if matches:
        # Later sections of the same name (left by the old appending scheme) go too.
        for start, end in reversed(matches[1:]):
            del lines[start:end]
        start, end = matches[0]
        tail = lines[end:]
        lines = lines[:start] + body + ([""] if tail else []) + tail
    else:
        lines = [*lines, "", *body]
    new = "\n".join(lines) + "\n"
    handle, temporary = tempfile.mkstemp(
        prefix=f".{results.name}.", suffix=".tmp", dir=results.parent
    )
    try:
        with os.fdopen(handle, "w") as out:
            out.write(new)
        os.chmod(temporary, results.stat().st_mode & 0o777 if results.exists() else 0o644)
        os.replace(temporary, results)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    print(f"{'replaced' if matches else 'appended'} section {name!r} in {results}")

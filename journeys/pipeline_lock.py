"""An inter-process lock, so two runs never write the same outputs at the same time.

Scheduled runs (daily ingest, daily scoring, weekly training), a manual `journeys
pipeline` and a manual `journeys ingest | train | score | attribute` may overlap. Each
stage holds the data folder's lock while it runs; a second run waits for it (up to
`orchestration.lock_timeout`) instead of racing the atomic folder swaps.
The lock is an OS file lock (`flock`): it is released when its holder exits, even on a
crash, so a stale lock file never blocks anyone.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from journeys.config import Config
from journeys.errors import JourneysError

POLL_S = 0.5
LOCK_FILE = ".journeys.lock"
# Set in a lock holder's environment, so its own child processes (a flow's training
# subprocess, Lightning's DDP workers) know the lock is theirs and do not wait for it.
HELD_ENV = "JOURNEYS_LOCK_HELD"
# Launchers' rank variables (torchrun, Lightning, SLURM): only rank 0 takes the lock.
RANK_ENVS = ("RANK", "LOCAL_RANK", "SLURM_PROCID")


def lock_path(config: Config) -> Path:
    """One lock per data folder (the folder holding `paths.journeys`)."""
    return Path(config.paths.journeys).absolute().parent / LOCK_FILE


def _holder(handle) -> str:
    handle.seek(0)
    try:
        info = json.loads(handle.read() or "{}")
    except json.JSONDecodeError:
        return "another process"
    return f"{info.get('what', 'a run')} (pid {info.get('pid')} on {info.get('host')}, since {info.get('since')})"


@contextlib.contextmanager
def hold_lock(
    path: str | Path,
    what: str,
    timeout: float | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> Iterator[None]:
    """Hold the exclusive lock at `path` for the block; wait up to `timeout` seconds for it.

    `on_wait` is told once who holds it, when we have to wait. Raises `JourneysError` on
    timeout. Not re-entrant: a process must not take the same lock twice.
    """
    import fcntl  # POSIX only; imported here so the module imports everywhere

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        deadline = None if timeout is None else time.monotonic() + timeout
        told = False
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not told and on_wait is not None:
                    on_wait(f"waiting for {_holder(handle)} to release {path}")
                    told = True
                if deadline is not None and time.monotonic() > deadline:
                    raise JourneysError(
                        f"{path} is still locked by {_holder(handle)} after {timeout:.0f} s"
                    ) from None
                time.sleep(POLL_S)
        try:
            info = {
                "what": what,
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": datetime.now(UTC).isoformat(timespec="seconds"),
            }
            handle.seek(0)
            handle.truncate()
            handle.write(json.dumps(info))
            handle.flush()
            yield
        finally:
            handle.seek(0)
            handle.truncate()
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def stage_lock(
    config: Config, stage: str, on_wait: Callable[[str], None] | None = None
) -> Iterator[None]:
    """The data folder's lock for one stage (`ingest`, `train`, ...) of a command or a flow,
    unless a parent already holds it; `on_wait` is told who holds it (default: stderr).

    A process started by the lock's holder (see `HELD_ENV`) or a DDP rank other than 0
    runs without it: waiting for its own parent would wait forever.
    """
    path = lock_path(config)
    launched_rank = max(int(os.environ.get(name) or 0) for name in RANK_ENVS)
    if os.environ.get(HELD_ENV) == str(path) or launched_rank != 0:
        yield
        return
    what = f"journeys {stage}"

    def tell(message: str) -> None:
        print(f"{what}: {message}", file=sys.stderr, flush=True)

    with hold_lock(path, what, config.orchestration.lock_timeout_s, on_wait or tell):
        os.environ[HELD_ENV] = str(path)
        try:
            yield
        finally:
            os.environ.pop(HELD_ENV, None)

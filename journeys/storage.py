"""Atomic writes: a reader sees the previous complete output or the new one, never half.

Files are written to a temporary name in the same folder and renamed into place
(`os.replace` is atomic on POSIX). Folders holding several files that belong together
(journeys + vocabularies + report) are built beside the target and swapped in.

Every temporary name carries its owner, `.<name>.<host>-<pid>.<random>.tmp`, so the next
writer in that folder can remove what a killed process (`kill -9`, power loss) left
behind, and never what a live writer is still building.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Host names may hold dots; a short digest keeps the temporary names parseable.
_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]
_OWNED_TEMPORARY = re.compile(r"^\..+\.(?P<host>[0-9a-f]{8})-(?P<pid>\d+)\.\w+\.tmp$")


def _prefix(name: str) -> str:
    """This process's prefix for temporary names of `name`: `.<name>.<host>-<pid>.`."""
    return f".{name}.{_HOST}-{os.getpid()}."


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def sweep_crash_litter(folder: str | Path) -> list[Path]:
    """Remove temporaries in `folder` whose owner was a process of this host that is gone.

    Temporaries of other hosts (a shared file system) and of live processes stay.
    Returns what was removed.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for path in folder.iterdir():
        owner = _OWNED_TEMPORARY.match(path.name)
        if owner is None or owner["host"] != _HOST or _is_alive(int(owner["pid"])):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


@contextlib.contextmanager
def scratch_dir(parent: str | Path, name: str) -> Iterator[Path]:
    """A temporary working folder in `parent` (same file system as the outputs), removed
    after the block; a killed run's leftover is swept by the next run."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    sweep_crash_litter(parent)
    with tempfile.TemporaryDirectory(prefix=_prefix(name), suffix=".tmp", dir=parent) as path:
        yield Path(path)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside `target`; rename it onto `target` if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_crash_litter(target.parent)
    fd, tmp_name = tempfile.mkstemp(prefix=_prefix(target.name), suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    # mkstemp creates 0600 files; give the output the permissions a plain open() would.
    os.chmod(tmp, 0o666 & ~_umask())
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_parquet(frame: pl.DataFrame, target: str | Path) -> None:
    with atomic_path(target) as tmp:
        frame.write_parquet(tmp)


def write_json(data: Any, target: str | Path) -> None:
    with atomic_path(target) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary folder beside `target`; swap it in if the block succeeds.

    The old folder is renamed aside before the new one is renamed in, so a crash leaves
    either the old complete folder, the new complete one, or (between the two renames)
    none at `target` with the old one recoverable at `<target>.old`.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_crash_litter(target.parent)
    staging = Path(tempfile.mkdtemp(prefix=_prefix(target.name), suffix=".tmp", dir=target.parent))
    os.chmod(staging, 0o777 & ~_umask())
    try:
        yield staging
        _fsync_dir(staging)
        # Two runs may finish at once: serialise the two renames with a lock on the parent
        # folder (no lock file left behind), so the last swap wins whole.
        parent = os.open(target.parent, os.O_RDONLY)
        try:
            fcntl.flock(parent, fcntl.LOCK_EX)
            aside = target.with_name(f".{target.name}.old")
            if aside.exists():
                shutil.rmtree(aside)
            if target.exists():
                os.replace(target, aside)
            os.replace(staging, target)
            _fsync_dir(target.parent)
            shutil.rmtree(aside, ignore_errors=True)
        finally:
            os.close(parent)  # closing releases the lock
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def restore_interrupted_swap(target: str | Path) -> bool:
    """Put back the old folder that `atomic_dir` had renamed aside when a kill stopped it
    between its two renames (no folder at `target`). Returns whether it did."""
    target = Path(target)
    aside = target.with_name(f".{target.name}.old")
    if target.exists() or not aside.is_dir():
        return False
    os.replace(aside, target)
    return True


def link_or_copy(source: Path, target: Path) -> None:
    """A file kept from the previous folder: a hard link (no bytes copied), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def file_key(path: Path) -> str:
    """A file's identity for reuse: its name, size and modification time (our outputs
    are written whole and swapped in, never rewritten in place; a hard link keeps all
    three)."""
    stat = path.stat()
    return f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}"

"""Child processes that never outlive their supervisor: `run_supervised`, `tethered`.

A supervised command runs in a process group (and session) of its own, so a terminal's
Ctrl+C or a scheduler's SIGTERM reaches only the supervisor, which then stops the WHOLE
group, grandchildren included (an `mlflow ui` server and its workers, DDP ranks): SIGTERM
first, SIGKILL after a grace period. The same happens on a timeout, and when the command
exits while processes it started are still running.

`tethered` covers what no supervisor can: its own death by SIGKILL. A watcher process
holds the read end of a pipe whose write end only the supervisor has; when the pipe
closes, however the supervisor ended, the watcher stops the command's group.

Standard library only (Linux and macOS: process groups); the flows use it for training in
its own process and for the Prefect server a run reports to, `journeys ui` for the MLflow
server.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import IO, Any

GRACE_S = 8.0  # after SIGTERM, before SIGKILL
KILL_WAIT_S = 2.0  # after SIGKILL, before giving up on a process that will not go
POLL_S = 0.05
DRAIN_S = 1.0  # after the command exits, how long its last output may still arrive
WATCHER_EXIT_S = GRACE_S + KILL_WAIT_S + 5.0  # a tether's watcher stopping its command
_END = None  # the reader's last item: the output is closed


def run_supervised(
    command: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    on_line: Callable[[str], None] | None = None,
    *,
    cwd: str | os.PathLike[str] | None = None,
    grace: float = GRACE_S,
) -> int:
    """Run `command` to its end in a process group of its own; return its exit code.

    With `on_line`, stdout and stderr are merged and each line (without its line end) is
    passed to it, in the calling thread; without, the child shares this process's output.
    On a timeout (`TimeoutError`), an exception in the caller (KeyboardInterrupt, the
    exception a SIGTERM handler raises, an error in `on_line`) or SIGTERM, the whole group
    is stopped (SIGTERM, SIGKILL after `grace` seconds) before the exception propagates.
    A process left at default SIGTERM handling exits with 143 (`SystemExit`), not at once.
    """
    process = subprocess.Popen(
        list(command),
        env=None if env is None else dict(env),
        cwd=cwd,
        stdout=subprocess.PIPE if on_line else None,
        stderr=subprocess.STDOUT if on_line else None,
        text=True,
        errors="replace",
        start_new_session=True,  # own session and process group: pgid == pid
    )
    deadline = None if timeout is None else time.monotonic() + timeout
    with _sigterm_raises():  # also while stopping: a second SIGTERM must not cut it short
        try:
            if on_line is not None:
                assert process.stdout is not None
                _stream(process.stdout, on_line, deadline, process)
            remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            code = process.wait(remaining)
        except subprocess.TimeoutExpired:
            stop_group(process, grace)
            raise TimeoutError(f"{shlex.join(command)} ran longer than {timeout:g} s") from None
        except BaseException:
            stop_group(process, grace)
            raise
        stop_group(process, grace)  # what it started and left running
    return code


# The write ends of the tethers' pipes, closed in a child forked without exec (a
# DataLoader worker, say): one it held open would keep its tethered command running.
_tether_pipes: set[int] = set()


def _close_tether_pipes() -> None:
    for fd in _tether_pipes:
        with contextlib.suppress(OSError):
            os.close(fd)
    _tether_pipes.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_tether_pipes)


@contextlib.contextmanager
def tethered(command: Sequence[str], **popen: Any) -> Iterator[subprocess.Popen]:
    """Run `command` for the block and never past this process, even one killed with
    SIGKILL. The command runs under a watcher (`python -m journeys.processes`) in a group
    of its own; the watcher reads a pipe only this process writes to, and when the pipe
    closes (the block ends, this process dies) it stops the command's whole group. Should
    the watcher itself die, Linux stops the command (`PR_SET_PDEATHSIG`).
    Yields the watcher, which exits when the command does; `popen`: its output, env."""
    watcher = subprocess.Popen(
        [sys.executable, "-m", "journeys.processes", *command],
        stdin=subprocess.PIPE,
        start_new_session=True,  # a terminal's Ctrl+C reaches this process alone
        **popen,
    )
    assert watcher.stdin is not None
    _tether_pipes.add(watcher.stdin.fileno())
    try:
        yield watcher
    finally:
        _tether_pipes.discard(watcher.stdin.fileno())
        watcher.stdin.close()  # the watcher stops the command, then exits
        try:
            watcher.wait(WATCHER_EXIT_S)
        except subprocess.TimeoutExpired:
            stop_group(watcher)  # and with it, on Linux, the command


def watch(command: Sequence[str]) -> int:
    """The watcher of `tethered`: run `command` in a group of its own until it exits or
    standard input closes; return its exit code."""
    process = subprocess.Popen(
        list(command),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        # Single-threaded here (the reader thread starts after), as preexec_fn needs.
        preexec_fn=_killed_with(os.getpid()) if sys.platform.startswith("linux") else None,
    )

    def stop_when_closed() -> None:
        sys.stdin.buffer.read()  # returns at end of input: the starter is done or gone
        stop_group(process)

    threading.Thread(target=stop_when_closed, daemon=True).start()
    with _sigterm_raises():
        try:
            return process.wait()
        finally:
            stop_group(process)


def _killed_with(parent: int) -> Callable[[], None]:
    """For a child of `parent`, run before exec: SIGKILL when `parent` dies (Linux)."""
    import ctypes

    def arrange() -> None:
        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)
        if os.getppid() != parent:  # it died before the signal was arranged
            os.kill(os.getpid(), signal.SIGKILL)

    return arrange


def stop_group(process: subprocess.Popen, grace: float = GRACE_S) -> None:
    """Stop every process of the group `process` leads (SIGTERM, then SIGKILL); bounded.

    A signal or KeyboardInterrupt arriving meanwhile does not cut the clean-up short: it
    is raised once the group is gone.
    """
    stop_at = time.monotonic() + grace
    give_up_at = stop_at + KILL_WAIT_S
    pending: BaseException | None = None
    sent: set[int] = set()
    while True:
        try:
            _stop_group(process, stop_at, give_up_at, sent)
            break
        except BaseException as err:  # a second Ctrl+C or SIGTERM: finish first
            pending = pending or err
    if pending is not None:
        raise pending


def _stop_group(process: subprocess.Popen, stop_at: float, give_up_at: float, sent: set) -> None:
    while _group_alive(process):
        now = time.monotonic()
        signum = signal.SIGTERM if now < stop_at else signal.SIGKILL
        if now >= give_up_at:
            return  # not even SIGKILL helped (e.g. uninterruptible I/O): stop waiting
        if signum not in sent:
            sent.add(signum)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signum)
        time.sleep(POLL_S)


def _group_alive(process: subprocess.Popen) -> bool:
    """Some process of the group still runs (the leader is reaped here, so not a zombie)."""
    process.poll()
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return process.returncode is None or _members_running(process.pid)


def _members_running(pgid: int) -> bool:
    """Whether any member of group `pgid` is not a zombie (where /proc tells; else True).

    Grandchildren left by an exited leader belong to init (or a subreaper), which reaps
    them on its own time: until then they count for `killpg` but no longer run.
    """
    proc = "/proc"
    if not os.path.isdir(proc):
        return True
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()  # state ppid pgrp ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _stream(
    output: IO[str],
    on_line: Callable[[str], None],
    deadline: float | None,
    process: subprocess.Popen,
) -> None:
    """Pass the child's lines to `on_line` until its output closes, the command exits (a
    grandchild may hold the output open: `run_supervised` stops it) or the deadline passes.

    A thread reads (a read cannot time out); this thread waits in short slices, so
    signals and the deadline are handled even while the child prints nothing.
    """
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        try:
            for line in output:
                lines.put(line)
        except (OSError, ValueError):
            pass
        finally:
            lines.put(_END)

    threading.Thread(target=read, name="supervised-output", daemon=True).start()
    drain_until = None
    while True:
        now = time.monotonic()
        if deadline is not None and now > deadline:
            raise subprocess.TimeoutExpired("", 0)  # run_supervised names the command
        if drain_until is None and process.poll() is not None:
            drain_until = now + DRAIN_S  # the command is done: take what it printed last
        if drain_until is not None and now > drain_until:
            return
        try:
            line = lines.get(timeout=0.5 if drain_until is None else 0.05)
        except queue.Empty:
            continue
        if line is _END:
            return
        on_line(line.rstrip("\r\n"))


class _Terminated(SystemExit):
    """SIGTERM under default handling: unwind (children stopped), exit 128 + 15."""


def _raise_terminated(signum: int, _frame: FrameType | None) -> None:
    raise _Terminated(128 + signum)


@contextlib.contextmanager
def _sigterm_raises():
    """While the child runs, SIGTERM at default handling raises instead of killing this
    process outright (which would leave the child's group running). A handler someone
    installed (the command line's, Prefect's) is left alone: it raises on its own, or
    ignores the signal on purpose. Only the main thread can set handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":  # the watcher `tethered` starts
    sys.exit(watch(sys.argv[1:]))

"""Supervised child processes: a SIGTERM, a timeout or Ctrl+C leaves none of the child's
process group alive (grandchildren, and one that ignores SIGTERM, included)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from journeys.processes import run_supervised

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc (Linux)")

# Two grandchildren, one of which ignores SIGTERM (SIGKILL must follow); then their pids.
CHILD = """
import subprocess, sys, time
sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
stubborn = [sys.executable, "-c", "import signal, time; "
            "signal.signal(signal.SIGTERM, signal.SIG_IGN); print('armed', flush=True); "
            "time.sleep(60)"]
a = subprocess.Popen(sleeper)
b = subprocess.Popen(stubborn, stdout=subprocess.PIPE, text=True)
b.stdout.readline()
print("pids", a.pid, b.pid, flush=True)
time.sleep(60)
"""
# The supervisor: prints the child's pid and lines, with a short grace before SIGKILL.
SUPERVISOR = """
import sys
from journeys.processes import run_supervised
timeout = float(sys.argv[1]) if sys.argv[1] != "none" else None
code = run_supervised([sys.executable, "-c", sys.argv[2]], timeout=timeout, grace=1.0,
                      on_line=lambda line: print(line, flush=True))
"""


def alive(pid: int) -> bool:
    """Runs (a zombie has ended: its parent just has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def start_supervisor(timeout: str) -> tuple[subprocess.Popen, list[int]]:
    """The supervisor in its own process; returns it and the child's group (child first)."""
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, timeout, CHILD],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in supervisor.stdout], daemon=True
    ).start()
    try:
        line = lines.get(timeout=10)
    except queue.Empty:
        supervisor.kill()
        raise AssertionError("the child never started its grandchildren") from None
    grandchildren = [int(pid) for pid in line.split()[1:]]
    child = os.getpgid(grandchildren[0])  # the group's leader: the supervised child
    return supervisor, [child, *grandchildren]


def assert_all_gone(pids: list[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:  # never leave them behind, even when the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running: {left}"


def test_sigterm_to_the_supervisor_stops_the_whole_group() -> None:
    supervisor, group = start_supervisor("none")
    assert all(alive(pid) for pid in group)
    started = time.monotonic()
    os.kill(supervisor.pid, signal.SIGTERM)
    assert supervisor.wait(timeout=10) == 128 + signal.SIGTERM
    assert_all_gone(group, within=10 - (time.monotonic() - started))


def test_a_timeout_stops_the_whole_group() -> None:
    supervisor, group = start_supervisor("2")
    code = supervisor.wait(timeout=12)
    assert code not in (0, None)
    assert_all_gone(group, within=2)


def test_lines_exit_code_and_interrupt_in_process() -> None:
    lines: list[str] = []
    script = "print('one'); print('two', flush=True); raise SystemExit(3)"
    assert run_supervised([sys.executable, "-c", script], on_line=lines.append) == 3
    assert lines == ["one", "two"]

    started: list[int] = []

    def interrupt(line: str) -> None:  # Ctrl+C arriving while the child runs
        started.append(int(line))
        raise KeyboardInterrupt

    sleeper = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    with pytest.raises(KeyboardInterrupt):
        run_supervised([sys.executable, "-c", sleeper], on_line=interrupt, grace=2)
    assert_all_gone(started, within=1)


def test_a_silent_child_still_times_out() -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ran longer than 0\.5 s"):
        run_supervised([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)
    assert time.monotonic() - started < 5


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_journeys_ui_under_sigterm_leaves_no_process_and_no_listening_port(
    tmp_path: Path,
) -> None:
    import socket

    import psutil

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    command = [sys.executable, "-m", "journeys.cli", "ui", "--port", str(port),
               "--set", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]  # fmt: skip
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    env.pop("MLFLOW_TRACKING_URI", None)
    ui = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 120  # the server's start is slow on a busy machine
        while not _listening(port):
            assert ui.poll() is None, "journeys ui exited before the server listened"
            assert time.monotonic() < deadline, "the MLflow server never listened"
            time.sleep(0.5)
        started = psutil.Process(ui.pid).children(recursive=True)
        assert started  # the server and its workers
        stopped_at = time.monotonic()
        ui.send_signal(signal.SIGTERM)
        assert ui.wait(timeout=15) == 143
        assert time.monotonic() - stopped_at < 12
    finally:
        ui.kill()
    _, alive = psutil.wait_procs(started, timeout=3)
    assert not alive, [p.pid for p in alive]
    assert not _listening(port)


@pytest.mark.slow
def test_journeys_serve_under_sigterm_stops_its_prefect_server(tmp_path: Path) -> None:
    import psutil

    if _listening(4200):
        pytest.skip("a Prefect server already listens on 127.0.0.1:4200: serve would use it")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}  # fmt: skip
    env.pop("PREFECT_API_URL", None)
    serve = subprocess.Popen(
        [sys.executable, "-m", "journeys.cli", "serve"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in serve.stdout], daemon=True).start()
    try:
        deadline = time.monotonic() + 180  # a first server start migrates its database
        while True:
            assert serve.poll() is None, "journeys serve exited early"
            assert time.monotonic() < deadline, "journeys serve never started serving"
            try:
                if lines.get(timeout=1).startswith("serving"):
                    break
            except queue.Empty:
                continue
        started = psutil.Process(serve.pid).children(recursive=True)
        assert started and _listening(4200)
        serve.send_signal(signal.SIGTERM)
        code = serve.wait(timeout=20)
    finally:
        serve.kill()
    assert code != 0  # a stopped command says so
    _, alive = psutil.wait_procs(started, timeout=3)
    assert not alive, [p.pid for p in alive]
    assert not _listening(4200)


def test_a_command_that_exits_is_not_held_open_by_a_grandchild() -> None:
    """A grandchild holding the output pipe must not keep the supervisor waiting: the
    command's exit code comes back at once, and the grandchild is stopped with the group."""

    lines: list[str] = []
    script = "import subprocess, sys; print(subprocess.Popen(['sleep', '60']).pid); sys.exit(3)"
    started = time.monotonic()
    code = run_supervised([sys.executable, "-c", script], on_line=lines.append, grace=1.0)
    assert code == 3 and len(lines) == 1
    assert time.monotonic() - started < 10
    assert _wait_gone(int(lines[0]), 5), "the grandchild outlived the supervisor"


# ----------------------------------------------------------------------------- tethered

TETHER_STOP_S = 30  # the watcher's SIGTERM grace and SIGKILL wait, with room to spare
SLEEPER = ["sleep", "300"]


def _wait_gone(pid: int, timeout: float) -> bool:
    """`pid` ends within `timeout` s (a zombie has ended: its reaper may be slow)."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _command_of(watcher_pid: int) -> Any:
    """The tethered command (a `psutil.Process`), once it runs: not the watcher's fork
    before it execs the command."""
    import psutil

    deadline = time.monotonic() + 10
    while True:
        children = psutil.Process(watcher_pid).children()
        if [p.cmdline() for p in children] == [SLEEPER]:
            return children[0]
        assert time.monotonic() < deadline, [p.cmdline() for p in children]
        time.sleep(0.05)


def test_a_tethered_command_dies_with_its_starter_even_after_sigkill() -> None:
    script = (
        "import sys, time\n"
        "from journeys.processes import tethered\n"
        f"with tethered({SLEEPER!r}) as watcher:\n"
        "    print(watcher.pid, flush=True)\n"
        "    time.sleep(300)\n"
    )
    starter = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert starter.stdout is not None
        watcher = int(starter.stdout.readline())
        command = _command_of(watcher)
        starter.kill()  # SIGKILL: no clean-up of its own runs
        starter.wait()
        assert _wait_gone(command.pid, TETHER_STOP_S), "the command outlived its starter"
        assert _wait_gone(watcher, TETHER_STOP_S)
    finally:
        starter.kill()


def test_a_tethered_command_stops_when_the_block_ends() -> None:
    from journeys.processes import tethered

    with tethered(SLEEPER) as watcher:
        command = _command_of(watcher.pid)
    assert watcher.returncode is not None
    assert _wait_gone(command.pid, 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG: Linux")
def test_a_tethered_command_dies_with_its_watcher() -> None:
    from journeys.processes import tethered

    with tethered(SLEEPER) as watcher:
        command = _command_of(watcher.pid)
        watcher.kill()  # the watcher itself dies (the OOM killer, say)
        assert _wait_gone(command.pid, TETHER_STOP_S), "the command outlived its watcher"


@pytest.mark.slow
def test_journeys_pipeline_killed_with_sigkill_leaves_no_prefect_server(tmp_path: Path) -> None:
    """With no Prefect API configured, `journeys pipeline` reports to a temporary server
    of its own, which goes when the command is killed, however it is killed."""
    import psutil

    from flows.prefect_server import api_answers
    from tests.test_reliability import ENV, TINY, cli, path_args, sets

    env = {**ENV, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    tracking = f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"
    command = cli("pipeline", *path_args(tmp_path, tmp_path / "raw"), *sets(*TINY, tracking))
    pipeline = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert pipeline.stderr is not None
        said = pipeline.stderr.readline()
        assert said.startswith("Prefect: a temporary server on http://127.0.0.1:"), said
        api = said.split()[5] + "/api"
        threading.Thread(target=pipeline.stderr.read, daemon=True).start()  # never full
        deadline = time.monotonic() + 180  # a first start migrates a new database
        while not api_answers(api):
            assert pipeline.poll() is None and time.monotonic() < deadline, "no server"
            time.sleep(0.2)
        # The watcher and the server it runs (both name `prefect server start`).
        tether = [
            p
            for p in psutil.Process(pipeline.pid).children(recursive=True)
            if "server start" in " ".join(p.cmdline())
        ]
        assert len(tether) == 2, [p.cmdline() for p in tether]
        pipeline.kill()  # SIGKILL: no clean-up of its own runs
        pipeline.wait()
        _, alive = psutil.wait_procs(tether, timeout=TETHER_STOP_S)
        assert not alive, [p.cmdline() for p in alive]
        assert not api_answers(api)
    finally:
        pipeline.kill()

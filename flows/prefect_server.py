"""The Prefect server a command's runs report to: `PREFECT_API_URL` when set, else one started
here that never outlives this process, not even one killed with SIGKILL
(`journeys.processes.tethered`). Prefect's own temporary server, which a flow run starts when
no API is set, stops only when its process exits normally: after a `kill -9` it runs on with
no parent.

- `run_server`: for `journeys pipeline`, on a free port of 127.0.0.1, for one run.
- `scheduling_server`: for `journeys serve`, on 127.0.0.1:4200 (reused when one answers there),
  with the scheduler that deployments' schedules need.
"""

from __future__ import annotations

from flows import _env  # isort: skip  (environment defaults before Prefect)

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from journeys.errors import JourneysError
from journeys.processes import tethered

LOCAL_API = "http://127.0.0.1:4200/api"
HEALTH_POLL_S = 0.5  # between health checks of a server starting
HEALTH_TIMEOUT_S = 2.0  # one health check of a server on this machine
DRAIN_TIMEOUT_S = 5.0  # Prefect's own bound on sending what its workers hold
ASKS_FOR_CREDENTIALS = (401, 403)  # a server with an auth string answers health so
_started_here: set[str] = set()  # API URLs of the servers this process runs


def started_here(api_url: str) -> bool:
    """`api_url` is a server this process started (gone when it ends)."""
    return api_url in _started_here


def api_answers(api_url: str, timeout: float = HEALTH_TIMEOUT_S) -> bool:
    """A Prefect API answers its health check at `api_url` (asking for credentials
    counts: it is there)."""
    try:
        with urllib.request.urlopen(api_url.rstrip("/") + "/health", timeout=timeout):
            return True
    except urllib.error.HTTPError as err:
        return err.code in ASKS_FOR_CREDENTIALS
    except (urllib.error.URLError, OSError, ValueError):
        return False


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def configured_api() -> str | None:
    """The API in Prefect's settings (`PREFECT_API_URL`, a profile), if any."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    return str(url) if url else None


@contextlib.contextmanager
def run_server() -> Iterator[str]:
    """The API URL this process's runs report to: the configured one, else a server
    started on a free port for the block (its runs kept in Prefect's home database, as
    Prefect's own temporary server keeps them)."""
    if configured := configured_api():
        yield configured
        return
    port = free_port()
    print(
        f"Prefect: a temporary server on http://127.0.0.1:{port} for this run "
        "(set PREFECT_API_URL to report to a server of your own)",
        file=sys.stderr,
    )
    with _started(port, "--no-ui", "--no-scheduler") as api_url:
        yield api_url


@contextlib.contextmanager
def scheduling_server() -> Iterator[str]:
    """The API URL of a Prefect server with a scheduler: the configured one, else one
    answering on 127.0.0.1:4200, else one started there for the block."""
    if configured := configured_api():
        yield configured
        return
    if api_answers(LOCAL_API):
        with _reporting_to(LOCAL_API):
            yield LOCAL_API
        return
    print("starting a local Prefect server (prefect server start) on 127.0.0.1:4200")
    with _started(4200) as api_url:
        yield api_url


@contextlib.contextmanager
def _started(port: int, *options: str) -> Iterator[str]:
    """`prefect server start` on 127.0.0.1:`port` for the block, tethered to this process;
    its log in a temporary file (a pipe nobody reads would fill and stall it)."""
    api_url = f"http://127.0.0.1:{port}/api"
    timeout = _env.SERVER_START_TIMEOUT_S  # a first start migrates a new database
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
               "--port", str(port), *options]  # fmt: skip
    with (
        tempfile.TemporaryFile() as log,
        tethered(command, stdout=subprocess.DEVNULL, stderr=log) as watcher,
    ):
        deadline = time.monotonic() + timeout
        while not api_answers(api_url):
            if watcher.poll() is not None:
                log.seek(0)
                error = log.read().decode(errors="replace")
                last = (error.strip().splitlines() or ["no output"])[-1]
                raise JourneysError(f"the Prefect server on port {port} stopped: {last}")
            if time.monotonic() > deadline:
                raise JourneysError(
                    f"the Prefect server on port {port} did not answer within {timeout} s: "
                    "set PREFECT_API_URL to a running server"
                )
            time.sleep(HEALTH_POLL_S)
        _started_here.add(api_url)
        try:
            with _reporting_to(api_url):
                yield api_url
        finally:
            _started_here.discard(api_url)
            _send_what_is_queued()


def _send_what_is_queued() -> None:
    """Send the run logs and events Prefect still holds while the server is up: Prefect
    sends them at exit otherwise, to a server gone ("Error logging to API")."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=DRAIN_TIMEOUT_S)
    EventsWorker.drain_all(timeout=DRAIN_TIMEOUT_S)


@contextlib.contextmanager
def _reporting_to(api_url: str) -> Iterator[None]:
    """Prefect's settings, and the environment of the processes started meanwhile (flow
    runs `serve` starts, training in its own process), point at `api_url`."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    before = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = api_url
    try:
        with temporary_settings({PREFECT_API_URL: api_url}):
            yield
    finally:
        if before is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = before

"""Scheduled deployments: daily ingest, daily scoring, weekly retraining (`journeys serve`).

`build_deployments(config)` returns the deployment objects (cron schedules and time zone
from `config.schedule`, the resolved config as their parameter); `serve_command` serves
them from this process. Schedules need a Prefect server (the temporary one a plain flow
run starts has no scheduler): `PREFECT_API_URL` when set, else a server already listening
on 127.0.0.1:4200, else one started here for as long as `journeys serve` runs.

For a work pool instead of this process, `prefect.yaml` at the repository root offers the
same deployments (`prefect deploy --all`, then `prefect worker start --pool journeys`).
"""

from __future__ import annotations

from flows import _env  # noqa: F401  # isort: skip  (environment defaults before Prefect)

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prefect.deployments.runner import EntrypointType
from prefect.schedules import Cron

from flows.pipeline import ingest_flow, pipeline_flow, score_flow, train_flow
from journeys import tracking
from journeys.config import Config, redact_uri
from journeys.errors import JourneysError
from journeys.processes import stop_group

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

DEPLOYMENT = "scheduled"  # runs show as ingest/scheduled, score/scheduled, train/scheduled
ON_DEMAND = "on-demand"  # pipeline/on-demand: no schedule, start it from the UI
LOCAL_API = "http://127.0.0.1:4200/api"
SERVER_START_TIMEOUT_S = 90


def build_deployments(config: Config) -> list[RunnerDeployment]:
    """The deployments `journeys serve` runs, with the schedules of `config.schedule`."""
    schedule = config.schedule
    parameters = {"config": config.model_dump(mode="json")}
    scheduled = [
        (ingest_flow, schedule.ingest_cron, "Daily: new raw events -> journeys"),
        (score_flow, schedule.score_cron, "Daily: score the journeys with the champion"),
        (train_flow, schedule.train_cron, "Weekly: retrain, compare, maybe promote"),
    ]
    deployments = [
        flow.to_deployment(
            name=DEPLOYMENT,
            schedules=[Cron(cron, timezone=schedule.timezone)],
            parameters=parameters,
            description=description,
            tags=["journeys"],
            entrypoint_type=EntrypointType.MODULE_PATH,  # importable from any folder
        )
        for flow, cron, description in scheduled
    ]
    deployments.append(
        pipeline_flow.to_deployment(
            name=ON_DEMAND,
            parameters=parameters,
            description="The whole pipeline, when started by hand",
            tags=["journeys"],
            entrypoint_type=EntrypointType.MODULE_PATH,
        )
    )
    return deployments


def _answers(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(api_url.rstrip("/") + "/health", timeout=2):
            return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


@contextlib.contextmanager
def prefect_server() -> Iterator[str]:
    """The API URL of a Prefect server with a scheduler, started here if none is running.

    A server started here runs in its own process group, its log in a temporary file (a
    pipe nobody reads would fill and stall it); leaving the block, on Ctrl+C or SIGTERM
    too, stops the whole group (`journeys.processes.stop_group`): nothing is left listening.
    """
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    configured = get_current_settings().api.url
    if configured:
        yield str(configured)
        return
    if _answers(LOCAL_API):
        with _local_api(PREFECT_API_URL, temporary_settings):
            yield LOCAL_API
        return
    print("starting a local Prefect server (prefect server start) on 127.0.0.1:4200")
    command = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1"]
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True
        )
        try:
            deadline = time.monotonic() + SERVER_START_TIMEOUT_S
            while not _answers(LOCAL_API):
                if process.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    error = log.read().decode(errors="replace")
                    last = (error.strip().splitlines() or ["no output"])[-1]
                    raise JourneysError(f"the Prefect server did not start: {last}")
                time.sleep(0.5)
            with _local_api(PREFECT_API_URL, temporary_settings):
                yield LOCAL_API
        finally:
            stop_group(process)


@contextlib.contextmanager
def _local_api(setting: Any, temporary_settings: Any) -> Iterator[None]:
    before = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = LOCAL_API  # for the flow-run processes serve starts
    try:
        with temporary_settings({setting: LOCAL_API}):
            yield
    finally:
        if before is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = before


def serve_command(config: Config) -> None:
    """`journeys serve`: serve the scheduled deployments until Ctrl+C."""
    from prefect import serve

    deployments = build_deployments(config)
    # The deployments' parameters hold the configuration redacted: the flow-run processes
    # serve starts reach the MLflow store through the environment they inherit.
    os.environ.update(tracking.tracking_environment(config))
    with prefect_server() as api_url:
        ui = redact_uri(api_url.removesuffix("/api"))
        tz = config.schedule.timezone
        print(f"serving {len(deployments)} deployments; runs and schedules at {ui} (Ctrl+C stops)")
        for deployment in deployments:
            crons = [s.schedule.cron for s in deployment.schedules or []]
            when = f"cron {crons[0]} ({tz})" if crons else "on demand"
            print(f"  {deployment.flow_name}/{deployment.name}: {when}")
        serve(*deployments, print_starting_message=False)

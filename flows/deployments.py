"""Scheduled deployments: daily ingest, daily scoring, weekly retraining (`journeys serve`).

`build_deployments(config)` returns the deployment objects (cron schedules and time zone
from `config.schedule`, the resolved config as their parameter); `serve_command` serves
them from this process. Schedules need a Prefect server (the temporary one a plain flow
run starts has no scheduler): `PREFECT_API_URL` when set, else a server already listening
on 127.0.0.1:4200, else one started here for as long as `journeys serve` runs
(`flows.prefect_server`: it never outlives `journeys serve`, not even a `kill -9`).

For a work pool instead of this process, `prefect.yaml` at the repository root offers the
same deployments (`prefect deploy --all`, then `prefect worker start --pool journeys`).
"""

from __future__ import annotations

from flows import _env  # noqa: F401  # isort: skip  (environment defaults before Prefect)

import os
from typing import TYPE_CHECKING

from prefect.deployments.runner import EntrypointType
from prefect.schedules import Cron

from flows.pipeline import ingest_flow, pipeline_flow, score_flow, train_flow
from flows.prefect_server import scheduling_server
from journeys import tracking
from journeys.config import Config, redact_uri

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment

DEPLOYMENT = "scheduled"  # runs show as ingest/scheduled, score/scheduled, train/scheduled
ON_DEMAND = "on-demand"  # pipeline/on-demand: no schedule, start it from the UI


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


def serve_command(config: Config) -> None:
    """`journeys serve`: serve the scheduled deployments until Ctrl+C."""
    from prefect import serve

    deployments = build_deployments(config)
    # The deployments' parameters hold the configuration redacted: the flow-run processes
    # serve starts reach the MLflow store through the environment they inherit.
    os.environ.update(tracking.tracking_environment(config))
    with scheduling_server() as api_url:
        ui = redact_uri(api_url.removesuffix("/api"))
        tz = config.schedule.timezone
        print(f"serving {len(deployments)} deployments; runs and schedules at {ui} (Ctrl+C stops)")
        for deployment in deployments:
            crons = [s.schedule.cron for s in deployment.schedules or []]
            when = f"cron {crons[0]} ({tz})" if crons else "on demand"
            print(f"  {deployment.flow_name}/{deployment.name}: {when}")
        serve(*deployments, print_starting_message=False)

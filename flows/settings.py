"""Orchestration settings: the task runner, retries, timeouts, caching, the stage lock.

They are the `orchestration` section of the configuration (`journeys.config.Orchestration`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from journeys.config import (
    Config,
    Orchestration,
    is_redacted,
    load_config,
    with_absolute_paths,
)
from journeys.errors import ConfigError, JourneysError

if TYPE_CHECKING:
    from prefect.task_runners import TaskRunner

LOCAL_DASHBOARD = "127.0.0.1:8787"  # a local Dask cluster's dashboard: this machine only


def orchestration(config: Config) -> Orchestration:
    """The orchestration settings of `config` (section `orchestration`)."""
    return config.orchestration


def make_task_runner(settings: Orchestration) -> TaskRunner:
    """The configured Prefect task runner (Dask is an optional extra, imported lazily)."""
    from prefect.task_runners import ProcessPoolTaskRunner, ThreadPoolTaskRunner

    if settings.task_runner == "thread":
        return ThreadPoolTaskRunner(max_workers=settings.max_workers)
    if settings.task_runner == "process":
        return ProcessPoolTaskRunner(max_workers=settings.max_workers)
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError:
        raise JourneysError(
            "orchestration.task_runner=dask needs prefect-dask: pip install 'journeys[dask]'"
        ) from None
    if settings.dask_address:
        if is_redacted(settings.dask_address):  # a configuration read back from JSON
            raise ConfigError(
                f"orchestration.dask_address {settings.dask_address} has its password "
                "redacted: authenticate to Dask with TLS certificates (tls://), not a password"
            )
        return DaskTaskRunner(address=settings.dask_address)
    # A local cluster: Dask's dashboard would listen on every interface (":8787").
    cluster: dict[str, Any] = {"dashboard_address": LOCAL_DASHBOARD}
    if settings.max_workers:
        cluster["n_workers"] = settings.max_workers
    return DaskTaskRunner(cluster_kwargs=cluster)


def resolve_config(
    config: Config | None = None,
    config_file: str | None = None,
    overrides: list[str] | None = None,
) -> Config:
    """A flow's configuration: the given object, else the file plus `--set` overrides;
    its paths made absolute here, on the flow's host, before any task ships them to a
    worker (`with_absolute_paths`)."""
    if config is None:
        config = load_config(config_file, overrides)
    return with_absolute_paths(config)

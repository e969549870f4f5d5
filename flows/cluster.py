"""Work shipped to a Dask cluster (`orchestration.task_runner=dask`).

With every task Prefect ships its settings and its run contexts (the flow's and the calling
task's parameters among them) to the worker. Here, around the submission:

- the workers get the flow's Prefect API (a real server, or the flow's temporary one when
  they can reach it), so their task runs are recorded beside the flow's and no worker starts
  a temporary server of its own;
- no secret goes with them: the configuration's passwords are redacted, and a section of
  Prefect's settings that holds a secret (the API's key or auth string, a database URL) is
  left out, so each worker builds it from its own environment (`PREFECT_API_URL` with
  `PREFECT_API_KEY` or `PREFECT_API_AUTH_STRING`; `MLFLOW_TRACKING_URI`);
- every worker is asked first whether it reaches that API (through its own settings, when
  they are left to it) and sees the folders the work reads and writes; one that does not
  stops the run with one line naming it.

On the worker, `worker_cores` is the worker's share of the cores (its `--nthreads`).
"""

from __future__ import annotations

import contextlib
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, SecretStr
from pydantic_core import to_jsonable_python

from journeys.errors import ConfigError

if TYPE_CHECKING:
    from distributed import Client
    from prefect.settings import Settings

HEALTH_TIMEOUT_S = 10.0  # a worker's wait for the flow's Prefect API to answer
MOUNT_FIX = "mount the paths.* folders on every worker at the flow host's paths"
API_FIX = (
    "start a Prefect server the workers can reach and set PREFECT_API_URL where the flow "
    "runs (docs/operations.md)"
)


@contextlib.contextmanager
def shipping_to(client: Client, needed: Sequence[Path]) -> Iterator[None]:
    """For the block that submits tasks to the Dask cluster behind `client`: check every
    worker (it reaches the flow's Prefect API, sees `needed`), then ship the run contexts
    with that API and without secrets."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext, SettingsContext, TaskRunContext
    from prefect.settings import PREFECT_API_URL

    api_url = str(get_client(sync_client=True).api_url)
    current = SettingsContext.get()
    assert current is not None  # Prefect always has a root settings context
    settings = current.settings.copy_with_update(updates={PREFECT_API_URL: api_url})
    own = _leave_secret_sections_out(settings)
    check_workers(client, api_url, needed, own_api="api" in own)
    profile = current.profile.model_copy(
        update={"settings": {k: v for k, v in current.profile.settings.items() if not k.is_secret}}
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(SettingsContext(profile=profile, settings=settings))
        for context in (FlowRunContext.get(), TaskRunContext.get()):
            if context is not None:  # parameters as JSON: SecretUris come out redacted
                plain = to_jsonable_python(context.parameters, fallback=repr)
                stack.enter_context(context.model_copy(update={"parameters": plain}))
        yield


def check_workers(
    client: Client, api_url: str, needed: Sequence[Path], own_api: bool = False
) -> None:
    """Raise `ConfigError` naming the first worker that cannot reach `api_url` or see one
    of `needed`; with `own_api`, also one whose own Prefect settings name another API."""
    parts = urllib.parse.urlsplit(api_url)  # no user or password goes to the workers
    bare = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    lacking = client.run(what_this_worker_lacks, bare, [str(p) for p in needed], own_api)
    for worker, problem in sorted(lacking.items()):
        if problem:
            raise ConfigError(f"Dask worker {worker} {problem}")


def what_this_worker_lacks(api_url: str, needed: list[str], own_api: bool) -> str | None:
    """Run on each worker: what it cannot see or reach, else None."""
    for path in needed:
        if not Path(path).exists():
            return f"cannot see {path}: {MOUNT_FIX}"
    try:
        with urllib.request.urlopen(api_url.rstrip("/") + "/health", timeout=HEALTH_TIMEOUT_S):
            pass
    except urllib.error.HTTPError:
        pass  # it answered (perhaps asking for credentials, which the worker has)
    except OSError as err:
        reason = getattr(err, "reason", err)
        return f"cannot reach the flow's Prefect API at {api_url} ({reason}): {API_FIX}"
    if own_api:
        from prefect.settings import get_current_settings

        own = str(get_current_settings().api.url or "").rstrip("/")
        if own != api_url.rstrip("/"):
            return (
                f"reports to {own or 'a temporary Prefect server of its own'}, not to the "
                f"flow's Prefect API {api_url}, whose credentials stay in each worker's "
                f"environment: set PREFECT_API_URL={api_url} and PREFECT_API_KEY or "
                "PREFECT_API_AUTH_STRING there"
            )
    return None


def _leave_secret_sections_out(settings: Settings) -> set[str]:
    """Mark unset every top-level section of `settings` that holds a secret (`api` when a
    key or auth string is set): Prefect ships settings with `exclude_unset`, and renders a
    shipped section whole, secrets in clear. A worker builds the sections left out from its
    own environment. The values stay in memory here. Returns the sections left out."""
    left_out = set()
    for name in type(settings).model_fields:
        section = getattr(settings, name)
        if isinstance(section, BaseModel) and _holds_secret(section):
            _unset_all(section)
            settings.model_fields_set.discard(name)
            left_out.add(name)
    return left_out


def _holds_secret(model: BaseModel) -> bool:
    values = [getattr(model, name) for name in type(model).model_fields]
    return any(
        isinstance(v, SecretStr) or (isinstance(v, BaseModel) and _holds_secret(v)) for v in values
    )


def _unset_all(model: BaseModel) -> None:
    model.model_fields_set.clear()
    for name in type(model).model_fields:
        if isinstance(child := getattr(model, name), BaseModel):
            _unset_all(child)


def worker_cores() -> int | None:
    """On a Dask worker, its share of the cores (its `--nthreads`); elsewhere None."""
    try:
        from distributed import get_worker

        return get_worker().state.nthreads
    except (ImportError, ValueError):  # not installed / not on a worker
        return None

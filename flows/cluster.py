"""Work shipped to a Dask cluster (`orchestration.task_runner=dask`).

With every task Prefect ships its settings and its run contexts (the flow's and the calling
task's parameters and result store among them) to the worker. Here, around the submission:

- the workers get the flow's Prefect API (a real server, or the flow's temporary one when
  they can reach it), so their task runs are recorded beside the flow's and no worker starts
  a temporary server of its own;
- no secret goes with them: the configuration's passwords are redacted, and a section of
  Prefect's settings that holds a secret (an API key or auth string, a password in the API
  URL, custom client headers, a database URL: `server` always has one) is left out, so each
  worker builds it from its own environment (`PREFECT_API_URL` with `PREFECT_API_KEY` or
  `PREFECT_API_AUTH_STRING`; `MLFLOW_TRACKING_URI`). A result storage that holds
  credentials is refused: Prefect ships it whole;
- every worker is asked first whether it reaches that API (through its own settings, when
  they are left to it) and sees the folders the work needs; one that does not stops the run
  with one line naming it.

On the worker, `worker_share` is a task's share of the worker's cores (its `--nthreads`).
"""

from __future__ import annotations

import contextlib
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Secret, SecretBytes, SecretStr
from pydantic_core import to_jsonable_python

from flows.prefect_server import api_answers
from journeys.config import redact_uri
from journeys.errors import ConfigError

if TYPE_CHECKING:
    from distributed import Client
    from prefect.settings import Settings

HEALTH_TIMEOUT_S = 5.0  # a worker's wait for the flow's Prefect API (it blocks the worker)
SECRETS = (SecretStr, SecretBytes, Secret)
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
    from prefect.context import FlowRunContext, SettingsContext, TaskRunContext
    from prefect.settings import PREFECT_API_URL

    runs = [context for context in (FlowRunContext.get(), TaskRunContext.get()) if context]
    if not runs:
        raise RuntimeError("shipping_to runs inside a flow run")
    for run in runs:
        if run.result_store is not None and holds_secret(run.result_store):
            raise ConfigError(
                "the flow's result storage holds credentials, which Prefect ships to every "
                "Dask worker: store results where the workers reach them without any "
                "(PREFECT_RESULTS_LOCAL_STORAGE_PATH on shared storage)"
            )
    api_url = str(runs[-1].client.api_url)
    current = SettingsContext.get()
    assert current is not None  # Prefect always has a root settings context
    settings = current.settings.copy_with_update(updates={PREFECT_API_URL: api_url})
    left_out = _leave_secret_sections_out(settings)
    check_workers(client, api_url, needed, api_from_worker_env="api" in left_out)
    profile = current.profile.model_copy(
        update={"settings": {k: v for k, v in current.profile.settings.items() if not k.is_secret}}
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(SettingsContext(profile=profile, settings=settings))
        for run in runs:  # parameters as JSON: SecretUris come out redacted
            plain = to_jsonable_python(run.parameters, fallback=repr)
            stack.enter_context(run.model_copy(update={"parameters": plain}))
        yield


def bare(url: str) -> str:
    """`url` without a user or password."""
    parts = urllib.parse.urlsplit(url)
    return parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()


def same_api(a: str, b: str) -> bool:
    """The two URLs name the same API (case of the host, default port, user, trailing /)."""

    def normal(url: str) -> tuple[str, str, int | None, str]:
        parts = urllib.parse.urlsplit(url.strip())
        scheme = parts.scheme.lower()
        port = parts.port if parts.port != {"http": 80, "https": 443}.get(scheme) else None
        return scheme, (parts.hostname or "").lower(), port, parts.path.rstrip("/")

    return normal(a) == normal(b)


def check_workers(
    client: Client, api_url: str, needed: Sequence[Path], api_from_worker_env: bool = False
) -> None:
    """Raise `ConfigError` naming the first worker that cannot reach `api_url` or see one
    of `needed`; with `api_from_worker_env`, also one whose own settings name another API."""
    lacking = client.run(
        what_this_worker_lacks, bare(api_url), [str(p) for p in needed], api_from_worker_env
    )
    for worker, problem in sorted(lacking.items()):
        if problem:
            raise ConfigError(f"Dask worker {worker} {problem}")


def what_this_worker_lacks(
    api_url: str, needed: list[str], api_from_worker_env: bool
) -> str | None:
    """Run on each worker: what it cannot see or reach, else None."""
    try:
        for path in needed:
            if not Path(path).exists():
                return f"cannot see {path}: {MOUNT_FIX}"
        if not api_answers(api_url, HEALTH_TIMEOUT_S):
            return f"cannot reach the flow's Prefect API at {api_url}: {API_FIX}"
        if api_from_worker_env:
            from prefect.settings import get_current_settings

            own = str(get_current_settings().api.url or "")
            if not own or not same_api(own, api_url):
                return (
                    f"reports to {redact_uri(own) or 'a temporary Prefect server of its own'}, "
                    f"not to the flow's Prefect API {api_url}, whose credentials stay in each "
                    f"worker's environment: set PREFECT_API_URL={api_url} and PREFECT_API_KEY "
                    "or PREFECT_API_AUTH_STRING there"
                )
    except Exception as err:  # a worker's problem, said with its name
        return f"failed its check: {redact_uri(f'{type(err).__name__}: {err}')}"
    return None


def _leave_secret_sections_out(settings: Settings) -> set[str]:
    """Mark unset every top-level section of `settings` that holds a secret: Prefect ships
    settings with `exclude_unset`, and renders a shipped section whole, secrets in clear.
    A worker builds the sections left out from its own environment; the values stay in
    memory here. Returns the sections left out."""
    left_out = set()
    for name in type(settings).model_fields:
        section = getattr(settings, name)
        if isinstance(section, BaseModel) and holds_secret(section):
            _unset_all(section)
            settings.model_fields_set.discard(name)
            left_out.add(name)
    return left_out


def holds_secret(model: BaseModel) -> bool:
    """A secret anywhere in `model`: a secret type, a URL with a password, or headers."""

    def secret(name: str, value: Any) -> bool:
        if isinstance(value, SECRETS):
            return True
        if isinstance(value, BaseModel):
            return holds_secret(value)
        if isinstance(value, str) and redact_uri(value) != value:
            return True
        return "header" in name and bool(value)  # Authorization and the like

    return any(secret(name, getattr(model, name)) for name in type(model).model_fields)


def _unset_all(model: BaseModel) -> None:
    model.model_fields_set.clear()
    for name in type(model).model_fields:
        if isinstance(child := getattr(model, name), BaseModel):
            _unset_all(child)


def worker_share(chunks: int) -> int | None:
    """On a Dask worker, the PyTorch threads of one of `chunks` tasks: its `--nthreads`
    shared by the tasks it may run at once (each thread sizes its own pool); elsewhere
    None."""
    try:
        from distributed import get_worker

        cores = get_worker().state.nthreads
    except (ImportError, ValueError):  # not installed / not on a worker
        return None
    return max(1, cores // max(1, min(cores, chunks)))

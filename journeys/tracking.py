"""MLflow: where runs go, what every run logs, the registry's champion rule, and the UI.

The tracking URI comes from `mlflow.tracking_uri` unless `MLFLOW_TRACKING_URI`
is set (a password in it is never written anywhere: see `config.SecretUri`); runs go to
experiment `mlflow.experiment`; the registered model is
`mlflow.registered_model`, and its alias `champion` moves as `journeys.promotion` decides
on the val split (never on test).

MLflow is imported inside functions: `journeys ui` and the fail-fast checks stay light.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from journeys.config import Config, is_redacted, redact_uri
from journeys.datasets import REPORT_FILE, IngestReport
from journeys.errors import ConfigError, InputError, JourneysError, first_line, run_status
from journeys.processes import run_supervised
from journeys.promotion import BASELINE_PREFIX

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

    from journeys.promotion import Decision

CHAMPION_ALIAS = "champion"
# Tags the product sets on runs and model versions, and reads back (flows, summaries).
MODEL_FAMILY_TAG = "model_family"  # transformer, or baseline_<name>
STAGE_TAG = "journeys.stage"  # on runs that are not trainings (e.g. score)
PARENT_RUN_TAG = "mlflow.parentRunId"  # MLflow's own: the UI nests the run under its parent
SEARCH_TRIAL_TAG = "search_trial"  # on a `train.search` trial's run: its number, from 1
COMPARISON_GROUP_TAG = "comparison_group"  # the transformer run's id, on it and its baselines
BEST_CHECKPOINT_TAG = "best_checkpoint"
REGISTERED_VERSION_TAG = "registered_model_version"  # "<name>/<version>"
CHAMPION_DECISION_TAG = "champion_decision"  # promoted | kept_previous
CHAMPION_REASON_TAG = "champion_reason"
# Which check of `journeys.promotion` decided: promoted, first_champion, below_baseline, ...
CHAMPION_CHECK_TAG = "champion_check"
VAL_ROC_AUC_TAG = "val_roc_auc"  # on each model version: what promotion compared
MODEL_KIND_TAG = "model_kind"  # on each model version: transformer, stack or baseline_<name>
# On the transformer run: the baselines whose test ROC AUC beat its 95% interval ("none").
BASELINES_AHEAD_TAG = "baselines_ahead"
# A tracking server that does not answer this fast is treated as unreachable: training
# must fail before it spends minutes of compute, not when it tries to log the result.
REACHABILITY_TIMEOUT_S = 5.0
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def best_val_metric(monitor: str) -> str:
    """The metric holding a fit's best epoch's value of `train.monitor` (what picks the
    checkpoint and a search's trial): `best_val_roc_auc` with the default monitor."""
    return f"best_{monitor}"


def tracking_uri(config: Config) -> str:
    """`MLFLOW_TRACKING_URI` if set, else `mlflow.tracking_uri` from the config."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or config.mlflow.tracking_uri
    if is_redacted(uri):  # a config that went through JSON (a flow parameter, say)
        raise ConfigError(
            f"tracking URI {uri} has its password redacted: give the real one in the "
            "environment of this process (MLFLOW_TRACKING_URI, or PGPASSWORD for PostgreSQL)"
        )
    return uri


def tracking_environment(config: Config) -> dict[str, str]:
    """The environment a child process needs to reach the same store: the configuration it
    reads is redacted, so the real URI travels in its environment, never in a file."""
    return {"MLFLOW_TRACKING_URI": tracking_uri(config)}


def tracking_ready(uri: str) -> bool:
    """True when the tracking store exists already: scoring logs there but never creates
    one (a `sqlite:///mlflow.db` file appearing after `journeys score` would surprise)."""
    if uri.startswith("sqlite:///"):
        path = uri.removeprefix("sqlite:///")
        return path not in ("", ":memory:") and Path(path).exists()
    if uri.startswith("file:"):
        return Path(uri.removeprefix("file://").removeprefix("file:")).exists()
    if "://" not in uri:  # a plain folder store
        return Path(uri).exists()
    return True  # a server or a database: it exists by definition


def check_tracking_uri(uri: str, timeout: float = REACHABILITY_TIMEOUT_S) -> None:
    """Raise `JourneysError` (one line) unless the tracking store answers now.

    HTTP stores get one short request to `/health` (MLflow's own client would retry with
    back-off for minutes); database and file stores get one cheap query.
    """
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
                pass
        except urllib.error.HTTPError:
            pass  # it answered: reachable (a proxy may not expose /health)
        except (urllib.error.URLError, OSError, ValueError) as err:
            reason = getattr(err, "reason", err)
            raise JourneysError(
                f"MLflow tracking URI {redact_uri(uri)} is unreachable: {reason}"
            ) from None
        return
    if uri.startswith("sqlite:///"):
        # SQLite creates the file but not its folder; create it rather than fail later.
        database = Path(uri.removeprefix("sqlite:///"))
        if str(database) not in ("", ":memory:"):
            database.parent.mkdir(parents=True, exist_ok=True)
    try:
        from mlflow import MlflowClient

        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    except Exception as err:  # any backend error means "cannot track here"
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise JourneysError(
            f"MLflow tracking URI {redact_uri(uri)} is not usable: {redact_uri(first_line)}"
        ) from None


@contextlib.contextmanager
def use_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's process-wide ("fluent") tracking URI at `uri` for a block, on MLflow's
    public API, and restore it exactly afterwards: the URI the process pinned with
    `mlflow.set_tracking_uri` (None: none) and `MLFLOW_TRACKING_URI`.

    Why: `mlflow.set_tracking_uri` also exports the variable, which would then override
    every later configuration of this process, and Lightning's MLflow logger pins the URI
    it is given; a URI left pinned would also hide a later `MLFLOW_TRACKING_URI`.
    """
    import mlflow

    saved_env = os.environ.pop("MLFLOW_TRACKING_URI", None)
    # With the variable out of the way, MLflow tells whether the process pinned a URI.
    pinned = mlflow.get_tracking_uri() if mlflow.tracking.is_tracking_uri_set() else None
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(pinned)  # None unpins (what MLflow's own reset passes)
        if saved_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = saved_env


@dataclass(frozen=True)
class TrackedRun:
    """One MLflow run the product writes to: a training, a baseline, a scoring job."""

    client: MlflowClient
    run_id: str
    experiment_id: str
    uri: str

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        """Metrics in one request; NaN is kept (e.g. AUC on a one-class split)."""
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()]
        )

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        self.client.log_batch(self.run_id, params=[Param(k, str(v)) for k, v in params.items()])

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: str | Path, folder: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), folder)

    def log_artifacts(self, directory: str | Path, folder: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(directory), folder)

    def log_dict(self, value: dict[str, Any], file: str) -> None:
        self.client.log_dict(self.run_id, value, file)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """This run as MLflow's active run, the process-wide URI at its store, for the
        fluent calls that know no other (`mlflow.pyfunc.log_model`, `mlflow.register_model`)."""
        import mlflow

        with use_tracking_uri(self.uri), mlflow.start_run(run_id=self.run_id):
            yield


@contextlib.contextmanager
def mlflow_run(
    uri: str,
    experiment: str,
    *,
    run_id: str | None = None,
    name: str | None = None,
    tags: dict[str, str] | None = None,
    optional: bool = False,
) -> Iterator[TrackedRun | None]:
    """The one way the product holds an MLflow run: create one in `experiment` (or reopen
    `run_id`), yield it, and end it FINISHED, or FAILED / KILLED as the exception that left
    the block says (Ctrl+C and SIGTERM are KILLED).

    `optional`: tracking is a bonus (scoring, attribution): a store that cannot be reached
    or does not exist yet (`tracking_ready`) yields None with a warning instead of failing,
    and no store is ever created.
    """
    from mlflow import MlflowClient

    tracked = None
    if not optional or tracking_ready(uri):
        try:
            client = MlflowClient(tracking_uri=uri)
            if run_id is None:
                experiment_id = get_experiment_id(uri, experiment)
                run = client.create_run(experiment_id, run_name=name, tags=tags)
            else:
                run = client.get_run(run_id)
            tracked = TrackedRun(client, run.info.run_id, run.info.experiment_id, uri)
        except Exception as err:
            if not optional:
                raise
            print(
                f"warning: not logging to MLflow ({redact_uri(uri)}): "
                f"{redact_uri(first_line(err))}",
                file=sys.stderr,
            )
    if tracked is None:
        yield None
        return
    try:
        yield tracked
    except BaseException as err:
        end_run(tracked, run_status(err))
        raise
    end_run(tracked, "FINISHED")


def end_run(run: TrackedRun, status: str) -> None:
    """Mark `run` as `status`; a store that fails here only warns (the run's state is a
    courtesy, and the error that stopped us, if any, wins)."""
    try:
        run.client.set_terminated(run.run_id, status)
    except Exception as err:
        print(
            f"could not mark MLflow run {run.run_id} {status}: {redact_uri(first_line(err))}",
            file=sys.stderr,
        )


def get_experiment_id(uri: str, name: str) -> str:
    """The id of experiment `name` in the store at `uri`, created if missing."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:  # created meanwhile by a concurrent training
        return client.get_experiment_by_name(name).experiment_id


def log_config(run: TrackedRun, config: Config, skip: Collection[str] = ()) -> None:
    """The whole resolved config as params, but the keys in `skip` (logged once known).
    On resume, keys already logged are kept.

    MLflow params are immutable, so a value changed for a resumed run is recorded as a
    `resume_override.<key>` tag instead of failing the run.
    """
    from mlflow.entities import Param, RunTag

    client, run_id = run.client, run.run_id
    logged = client.get_run(run_id).data.params
    params, tags = [], []
    values = config.flat()
    # The store actually used (MLFLOW_TRACKING_URI wins over the config), redacted.
    values["mlflow.tracking_uri"] = redact_uri(tracking_uri(config))
    for key, value in values.items():
        if key in skip:
            continue
        if key not in logged:
            params.append(Param(key, value))
        elif logged[key] != value:
            tags.append(RunTag(f"resume_override.{key}", value))
    client.log_batch(run_id, params=params, tags=tags)


def copy_metric_histories(run: TrackedRun, source_run_id: str, skip: Collection[str] = ()) -> None:
    """Every metric of `source_run_id` but those in `skip`, step by step, onto `run` (a
    search's kept trial's epochs onto the training run, which then holds its model's
    epochs as any training run does)."""
    from mlflow.entities import Metric

    client = run.client
    history = [
        Metric(m.key, m.value, m.timestamp, m.step)
        for key in client.get_run(source_run_id).data.metrics
        if key not in skip
        for m in client.get_metric_history(source_run_id, key)
    ]
    client.log_batch(run.run_id, metrics=history)  # MLflow sends it in chunks it takes


def _flatten_counts(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten_counts(f"{prefix}_{key}", inner, out)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        out[prefix] = float(value)


# Report entries keyed by file paths: not names to compare runs by (the artifact has them).
UNLOGGED_REPORT_KEYS = ("by_source", "sources")


def ingest_counts(report: dict[str, Any]) -> dict[str, float]:
    """Numeric entries of the ingest report as flat metric names (`ingest_rows_read`, ...;
    the last run's own figures, the report's `ingest` entry, as `ingest_run_*`)."""
    out: dict[str, float] = {}
    for key, value in report.items():
        if key not in UNLOGGED_REPORT_KEYS:
            _flatten_counts("ingest_run" if key == "ingest" else f"ingest_{key}", value, out)
    return out


def log_ingest_report(run: TrackedRun, journeys_folder: str | Path) -> None:
    """The ingest report as an artifact, and its counts as metrics (comparable across runs)."""
    report = IngestReport.read(journeys_folder)
    if report is None:
        return  # a dataset built by hand may have none; training does not need it
    run.log_artifact(Path(journeys_folder) / REPORT_FILE)
    run.log_metrics(ingest_counts(report.to_json()))


# ----------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class Registration:
    """The outcome of registering one model version."""

    version: int
    champion_version: int | None  # None: no champion yet (a degenerate first evaluation)
    promoted: bool
    reason: str


def logged_val_roc_auc(uri: str, version: ModelVersion) -> float:
    """A registered version's val ROC AUC as logged when it was registered (its tag), else
    its run's best validation AUC; NaN when neither is there."""
    from mlflow import MlflowClient

    value = version.tags.get(VAL_ROC_AUC_TAG)
    if value is None and version.run_id:
        # The run may have been deleted: then there is nothing to compare with.
        with contextlib.suppress(Exception):
            run = MlflowClient(tracking_uri=uri).get_run(version.run_id)
            value = run.data.metrics.get(best_val_metric("val_roc_auc"))
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def register_model(run: TrackedRun, model_uri: str, name: str, decision: Decision) -> Registration:
    """Register `model_uri` (logged by `run`) as a new version of `name`, and move
    `champion` to it when `decision` (`journeys.promotion`, on the val split) says so.
    The decision, its check and why are tagged on both the run and the new version."""
    import mlflow
    from mlflow.exceptions import MlflowException

    client = run.client
    auc = decision.val_roc_auc.get(decision.kind, math.nan)
    version_tags = {VAL_ROC_AUC_TAG: str(auc), MODEL_KIND_TAG: decision.kind}
    with use_tracking_uri(run.uri):  # mlflow.register_model knows no other store
        version = mlflow.register_model(model_uri, name, tags=version_tags)
    new = int(version.version)
    if decision.promote:
        client.set_registered_model_alias(name, CHAMPION_ALIAS, str(new))
        champion_version = new
    else:
        try:
            champion_version = int(client.get_model_version_by_alias(name, CHAMPION_ALIAS).version)
        except MlflowException:
            champion_version = None
    tags = {
        CHAMPION_DECISION_TAG: "promoted" if decision.promote else "kept_previous",
        CHAMPION_CHECK_TAG: decision.check,
        CHAMPION_REASON_TAG: decision.summary,
    }
    for key, value in tags.items():
        client.set_model_version_tag(name, str(new), key, value)
    run.set_tags({**tags, MODEL_KIND_TAG: decision.kind, REGISTERED_VERSION_TAG: f"{name}/{new}"})
    return Registration(new, champion_version, decision.promote, decision.summary)


def tag_model_version(config: Config, version: str, key: str, value: str) -> None:
    """Tag a registered version of the configured model; a store that is not there, or
    fails, only warns (the tag marks what is written elsewhere)."""
    from mlflow import MlflowClient

    uri = tracking_uri(config)
    if not tracking_ready(uri):
        return
    try:
        MlflowClient(tracking_uri=uri).set_model_version_tag(
            config.mlflow.registered_model, str(version), key, value[:5000]
        )
    except Exception as err:  # the monitor's report is written; the tag is a bonus
        print(f"journeys: warning: could not tag the model version: {first_line(err)}")


def champion_version(uri: str, name: str) -> ModelVersion | None:
    """The version of model `name` the `champion` alias points at (None: no such model,
    no champion). Never creates a store: one that does not exist yet has no champion."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    if not tracking_ready(uri):
        return None
    try:
        return MlflowClient(tracking_uri=uri).get_model_version_by_alias(name, CHAMPION_ALIAS)
    except MlflowException:
        return None


def champion_uri(uri: str, name: str) -> tuple[str, str]:
    """The champion as a pinned `models:/<name>/<version>` URI, and its run id ("" if none).

    `InputError` (train first) when there is no store or no champion yet.
    """
    if not tracking_ready(uri):
        raise InputError(f"no MLflow store at {redact_uri(uri)}: train first")
    version = champion_version(uri, name)
    if version is None:
        raise no_champion(uri, name)
    return f"models:/{name}/{version.version}", version.run_id or ""


def no_champion(uri: str, name: str) -> InputError:
    """The error for a model `name` without a champion: what the last training's guard
    decided and its fix when a training registered a version, else "train first"."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        versions = MlflowClient(tracking_uri=uri).search_model_versions(
            f"name = '{name}'", order_by=["version_number DESC"], max_results=1
        )
    except MlflowException:
        versions = []
    reason = versions[0].tags.get(CHAMPION_REASON_TAG) if versions else None
    if not reason:
        return InputError(f"no champion version of model {name!r}: train first")
    return InputError(
        f"no champion version of model {name!r}: the last training (version "
        f"{versions[0].version}) served none: {reason}"
    )


def training_summary(uri: str, run_id: str, registered_model: str) -> dict[str, Any]:
    """A training run read back from the store: its metrics, its registered version, its
    baselines' runs and metrics, and the champion now (which may have moved since)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    version = run.data.tags.get(REGISTERED_VERSION_TAG, "").rpartition("/")[2] or None
    champion = champion_version(uri, registered_model)
    baselines = client.search_runs(
        [run.info.experiment_id], filter_string=f"tags.{COMPARISON_GROUP_TAG} = '{run_id}'"
    )
    return {
        "run_id": run_id,
        "experiment_id": run.info.experiment_id,
        "tracking_uri": redact_uri(uri),
        "registered_model": registered_model,
        "model_version": int(version) if version else None,
        "champion_version": int(champion.version) if champion else None,
        "promoted": run.data.tags.get(CHAMPION_DECISION_TAG) == "promoted",
        "champion_check": run.data.tags.get(CHAMPION_CHECK_TAG, ""),
        "model_kind": run.data.tags.get(MODEL_KIND_TAG, "transformer"),
        "champion_reason": run.data.tags.get(CHAMPION_REASON_TAG, ""),
        "baselines_ahead": [
            name
            for name in run.data.tags.get(BASELINES_AHEAD_TAG, "none").split(",")
            if name not in ("", "none")
        ],
        "metrics": dict(run.data.metrics),
        "baselines": {
            family.removeprefix(BASELINE_PREFIX): {
                "run_id": baseline.info.run_id,
                "metrics": dict(baseline.data.metrics),
            }
            for baseline in baselines
            if (family := baseline.data.tags.get(MODEL_FAMILY_TAG, "")).startswith(BASELINE_PREFIX)
        },
    }


# ----------------------------------------------------------------------------- UI


def ui_command(config: Config, host: str = "127.0.0.1", port: int = 5000) -> None:
    """Run `mlflow ui` on the configured store, bound to 127.0.0.1 unless asked otherwise.

    The server runs supervised: when this command stops (Ctrl+C, SIGTERM), so do the
    server and its workers, none left listening on the port.
    """
    uri = tracking_uri(config)
    if uri.startswith(("http://", "https://")):
        print(f"tracking URI {redact_uri(uri)} is a server already: open it in a browser")
        return
    if host not in _LOOPBACK:
        print(f"warning: binding to {host} exposes the MLflow UI to the network", file=sys.stderr)
    command = [sys.executable, "-m", "mlflow", "ui", "--host", host, "--port", str(port)]
    print(f"MLflow UI for {redact_uri(uri)} on http://{host}:{port} (Ctrl+C stops it)")
    env = {
        **os.environ,
        # The store goes in the environment, not the command line that `ps` shows anyone.
        "MLFLOW_BACKEND_STORE_URI": uri,
        "MLFLOW_DISABLE_TELEMETRY": os.environ.get("MLFLOW_DISABLE_TELEMETRY", "true"),
    }
    returncode = run_supervised(command, env=env)
    if returncode not in (0, -2, 130):  # -2 / 130: stopped with Ctrl+C
        raise JourneysError(f"mlflow ui exited with code {returncode}")

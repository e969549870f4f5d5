"""Security: servers bind to loopback, models never unpickle, data cannot steer writes
outside the configured paths, and credentials stay out of logs and MLflow (issue 7).

docs/reliability.md maps each threat to the test here that covers it.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
import pytest

from journeys.cli import main
from journeys.config import Config, load_config
from journeys.pipeline_lock import LOCK_FILE
from tests.test_reliability import ENV, cli, journeys_dataset, one_line, path_args

ROOT = Path(__file__).resolve().parents[1]
SECRET = "s3cr3t-pa55"
URI_WITH_PASSWORD = f"http://alice:{SECRET}@127.0.0.1:9"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A model folder exactly as `journeys train` logs it (the five artifact files), with
    untrained weights: what is loaded matters here, not how well it scores."""
    import polars as pl

    from journeys.encoding import JourneyEncoder, model_config_from
    from journeys.model import JourneyTransformer
    from journeys.trained_model import JourneyRules, TrainedModel
    from journeys.vocab import Vocabularies

    root = tmp_path_factory.mktemp("model")
    journeys = journeys_dataset(root / "journeys", n=100, seed=0)
    config = load_config(None, ["model.d_model=16", "model.n_heads=2", "model.n_layers=1"])
    vocabs = Vocabularies.load(journeys)
    folder = root / "artifacts"
    encoder = JourneyEncoder.fit(
        pl.DataFrame(), vocabs, config.model, max_len=config.journey.max_events, timezone="UTC"
    )
    settings = model_config_from(config.model, encoder)
    rules = JourneyRules.from_config(config)
    TrainedModel(JourneyTransformer(settings), encoder, rules).save(folder)
    env = {**ENV, "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'no-store.db'}"}
    return {"folder": folder, "uri": str(folder), "env": env}


# ----------------------------------------------------------------------------- servers


def test_ui_binds_to_loopback_by_default(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`journeys ui` builds `mlflow ui --host 127.0.0.1` unless the user asks otherwise."""
    from journeys import tracking

    commands: list[list[str]] = []

    def fake_run(command, **kwargs):
        commands.append(command)
        return 0

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(tracking, "run_supervised", fake_run)
    assert main(["ui"]) == 0
    command = commands[-1]
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert "0.0.0.0" not in command


def test_ui_warns_when_the_user_exposes_it(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """An explicit `--host 0.0.0.0` is honoured, with a warning on stderr."""
    from journeys import tracking

    commands: list[list[str]] = []
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setattr(
        tracking, "run_supervised", lambda command, **kw: commands.append(command) or 0
    )
    assert main(["ui", "--host", "0.0.0.0"]) == 0
    assert commands[-1][commands[-1].index("--host") + 1] == "0.0.0.0"
    assert "exposes the MLflow UI" in capsys.readouterr().err


def test_prefect_server_started_by_serve_binds_to_loopback() -> None:
    """The only other server the product starts (`journeys serve` and `journeys pipeline`
    when no Prefect API is configured) is `prefect server start --host 127.0.0.1`."""
    import inspect

    from flows import deployments, prefect_server

    source = inspect.getsource(prefect_server._started)
    assert '"server", "start", "--host", "127.0.0.1"' in source
    assert "0.0.0.0" not in inspect.getsource(deployments) + inspect.getsource(prefect_server)


# ----------------------------------------------------------------------------- no unpickling


class _Payload:
    """Unpickling this runs `open(marker, "w")`: proof that something unpickled it."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _tampered_model(model: dict, folder: Path) -> Path:
    """A copy of the model's artifacts with the weights replaced by a pickle."""
    from journeys.trained_model import WEIGHTS

    tampered = folder / "model"
    shutil.copytree(model["folder"], tampered)
    model = tampered
    (model / WEIGHTS).write_bytes(pickle.dumps(_Payload(folder / "PWNED")))
    return model


@pytest.mark.parametrize("loader", ["weights.safetensors", "torch.load-style .pt beside it"])
def test_tampered_pickle_in_model_is_never_unpickled(
    model: dict, tmp_path: Path, loader: str
) -> None:
    """Weights replaced by a pickle whose `__reduce__` would create a marker file:
    `journeys score --model <that model>` fails and the marker never appears."""
    env = model["env"]
    model = _tampered_model(model, tmp_path)
    if loader != "weights.safetensors":  # also plant pickles MLflow flavours would load
        for name in ("model.pth", "python_model.pkl", "data.pkl"):
            (model / name).write_bytes(pickle.dumps(_Payload(tmp_path / "PWNED")))
    journeys = journeys_dataset(tmp_path / "journeys", n=20, seed=1)
    done = subprocess.run(
        cli("score", *path_args(tmp_path), "--model", str(model), "--input", str(journeys)),
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0
    assert not (tmp_path / "PWNED").exists()
    assert not (tmp_path / "scores").exists()


def test_tampered_model_fails_with_one_line_exit_2(model: dict, tmp_path: Path) -> None:
    """A model whose weights are not safetensors is bad input: exit 2, one line."""
    env = model["env"]
    model = _tampered_model(model, tmp_path)
    journeys = journeys_dataset(tmp_path / "journeys", n=20, seed=1)
    done = subprocess.run(
        cli("score", *path_args(tmp_path), "--model", str(model), "--input", str(journeys)),
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-1500:]
    assert one_line(done.stderr) and "weights.safetensors" in done.stderr, done.stderr


# ----------------------------------------------------------------------------- paths

HOSTILE_IDS = ["../../../escaped", "/tmp/absolute-escape", "..", "a/../../b", "C:\\x\\..\\y", "~"]


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_hostile_ids_and_event_types_never_create_files_outside_configured_paths(
    tmp_path: Path,
) -> None:
    """User ids and event types such as `../../../escaped` are data, never path parts:
    ingest writes only under paths.journeys / paths.quarantine (partitions and part
    files are named from integers), and nothing appears beside the work folder."""
    work = tmp_path / "work"
    work.mkdir()
    start = datetime(2026, 1, 1, tzinfo=UTC)
    n = len(HOSTILE_IDS) * 6
    pl.DataFrame(
        {
            "user_id": [HOSTILE_IDS[i % len(HOSTILE_IDS)] for i in range(n)],
            "timestamp": [start + timedelta(hours=i) for i in range(n)],
            "event_type": [["../evil", "click", "purchase"][i % 3] for i in range(n)],
            "channel": ["../../channel"] * n,
            "device": ["/dev/null"] * n,
        }
    ).write_parquet(tmp_path / "raw.parquet")
    outside_before = _files(tmp_path.parent)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        code = main(["ingest", *path_args(work, tmp_path / "raw.parquet")])
    assert code == 0
    made = _files(work)
    top = {name.split(os.sep)[0] for name in made}
    assert top <= {"journeys", "quarantine", LOCK_FILE}, top  # the data folder's lock
    assert all("evil" not in name and "escape" not in name for name in made)
    new_outside = _files(tmp_path.parent) - outside_before
    assert all(name.startswith(tmp_path.name + os.sep) for name in new_outside), new_outside
    assert not Path("/tmp/absolute-escape").exists()
    journeys = pl.read_parquet(work / "journeys" / "*.parquet")
    assert set(journeys.get_column("user_id")) <= set(HOSTILE_IDS)  # kept as data


def test_hostile_journey_ids_in_scoring_input_stay_data(model: dict, tmp_path: Path) -> None:
    """Scoring journeys whose ids look like paths writes only `part-<hash>.parquet` files
    under the output folder."""
    journeys = journeys_dataset(tmp_path / "journeys", n=30, seed=2)
    part = journeys / "part-00000.parquet"
    frame = pl.read_parquet(part)
    hostile = [f"../../{i}-escaped" for i in range(frame.height)]
    frame.with_columns(journey_id=pl.Series(hostile), user_id=pl.Series(hostile)).write_parquet(
        part
    )
    outside_before = _files(tmp_path.parent)
    out = tmp_path / "scores"
    done = subprocess.run(
        cli("score", *path_args(tmp_path), "--model", model["uri"], "--input", str(journeys)),
        cwd=tmp_path, env=model["env"], capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    (written,) = out.iterdir()
    assert re.fullmatch(r"part-[0-9a-f]{16}\.parquet", written.name), written.name
    new_outside = _files(tmp_path.parent) - outside_before
    assert all(name.startswith(tmp_path.name + os.sep) for name in new_outside), new_outside
    assert not any("escaped" in name for name in _files(tmp_path))


# ----------------------------------------------------------------------------- credentials


def test_tracking_uri_password_is_not_in_logged_params() -> None:
    """The params every training run logs (`config.flat()`) never carry a password."""
    config = load_config(None, [f"mlflow.tracking_uri={URI_WITH_PASSWORD}"])
    assert not any(SECRET in value for value in config.flat().values())


def test_configuration_leaves_the_process_without_its_passwords(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The JSON form of a config (flow parameters, deployments, the YAML a training child
    reads) redacts URI passwords while the object in memory keeps them; a config read back
    from that form cannot connect and says where the real URI goes, one line."""
    import yaml
    from fastapi.encoders import jsonable_encoder  # what Prefect stores parameters with

    from journeys.errors import ConfigError
    from journeys.tracking import tracking_environment, tracking_uri

    dask = f"tcp://bob:{SECRET}@127.0.0.1:8786"
    config = load_config(
        None, [f"mlflow.tracking_uri={URI_WITH_PASSWORD}", f"orchestration.dask_address={dask}"]
    )
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri(config) == URI_WITH_PASSWORD  # in memory: the real one
    assert tracking_environment(config) == {"MLFLOW_TRACKING_URI": URI_WITH_PASSWORD}
    for form in (config.model_dump(mode="json"), jsonable_encoder(config)):
        text = json.dumps(form)
        assert SECRET not in text and "alice:***@127.0.0.1:9" in text and "bob:***@" in text
    read_back = Config.model_validate(
        yaml.safe_load(yaml.safe_dump(config.model_dump(mode="json")))
    )
    with pytest.raises(ConfigError, match="MLFLOW_TRACKING_URI") as error:
        tracking_uri(read_back)
    assert "\n" not in str(error.value) and SECRET not in str(error.value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", URI_WITH_PASSWORD)  # as a child process gets it
    assert tracking_uri(read_back) == URI_WITH_PASSWORD


@pytest.mark.parametrize(
    ("uri", "redacted"),
    [
        ("postgresql://u:s3cret@db:5432/mlflow", "postgresql://u:***@db:5432/mlflow"),
        ("redis://:s3cret@cache:6379/0", "redis://:***@cache:6379/0"),  # no user name
        ("postgresql://u:pa/ss@db/mlflow", "postgresql://u:***@db/mlflow"),  # `/` in it
        ("http://mlflow:5000/api", "http://mlflow:5000/api"),  # no password: untouched
        ("sqlite:///mlflow.db", "sqlite:///mlflow.db"),
    ],
)
def test_every_password_in_a_uri_is_redacted(uri: str, redacted: str) -> None:
    from journeys.config import is_redacted, redact_uri

    assert redact_uri(f"tracking at {uri} failed") == f"tracking at {redacted} failed"
    assert is_redacted(redact_uri(uri)) == (uri != redacted)


def test_run_logs_redact_passwords_before_prefect_stores_them() -> None:
    """Messages and tracebacks logged on Prefect's run loggers (which go to its database)
    lose URI passwords, whoever logs them (the engine's 'View at <url>' line included)."""
    import logging

    import flows.pipeline  # noqa: F401  (installs the filter)

    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(self.format(record))

    logger = logging.getLogger("prefect.task_runs")
    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning("View at %s/runs", URI_WITH_PASSWORD)
        try:
            raise RuntimeError(f"cannot connect to {URI_WITH_PASSWORD}")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    assert len(seen) == 2 and "alice:***@" in seen[0] and "cannot connect" in seen[1]
    assert not any(SECRET in line for line in seen)


def test_pipeline_summary_names_the_servers_used() -> None:
    """The closing summary points at the MLflow server and Prefect API the run used."""
    from flows.summary import mlflow_ui, prefect_ui

    servers = {"mlflow": "http://mlflow.internal:5000", "prefect": "http://prefect:4200/api"}
    assert mlflow_ui(servers).startswith("http://mlflow.internal:5000")
    assert prefect_ui(servers).startswith("http://prefect:4200 ")
    local = {"mlflow": "sqlite:///mlflow.db", "prefect": None}
    assert "journeys ui" in mlflow_ui(local) and "sqlite:///mlflow.db" in mlflow_ui(local)
    assert "prefect server start" in prefect_ui(local)


def test_a_temporary_prefect_server_is_not_named_as_where_to_see_the_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server `journeys pipeline` starts goes with it: the summary says how to see the
    runs afterwards instead of naming its address."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows import prefect_server
    from flows.pipeline import servers_used
    from journeys.config import load_config

    config = load_config(None, [])
    temporary, shared = "http://127.0.0.1:41234/api", "http://prefect.internal:4200/api"
    monkeypatch.setattr(prefect_server, "_started_here", {temporary})
    with temporary_settings({PREFECT_API_URL: temporary}):
        assert servers_used(config)["prefect"] is None
    with temporary_settings({PREFECT_API_URL: shared}):
        assert servers_used(config)["prefect"] == shared


def test_tracking_uri_password_is_not_in_error_messages(tmp_path: Path) -> None:
    """`journeys train` against an unreachable server with user:password@ in the URI:
    the one-line error names the server but not the password."""
    journeys_dataset(tmp_path / "journeys", n=100, seed=3)
    env = {**ENV, "MLFLOW_TRACKING_URI": URI_WITH_PASSWORD}
    done = subprocess.run(
        cli("train", *path_args(tmp_path)),
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-1500:]
    assert "127.0.0.1:9" in done.stderr
    assert SECRET not in done.stderr + done.stdout


def test_no_credentials_in_default_config_or_repository_conf() -> None:
    """The shipped configurations carry no user:password@ URIs."""
    import re

    pattern = re.compile(r"://[^/\s:@]+:[^/\s@]+@")
    for path in sorted((ROOT / "conf").glob("*.yaml")):
        assert not pattern.search(path.read_text()), path

"""Serving: the logged pyfunc has a signature and an input example, reads journeys as JSON
(ISO 8601 text or epoch numbers), and a real `mlflow models serve` answers with what
`journeys score` writes for the same journey; bad requests get HTTP 400 with one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pandas as pd
import polars as pl
import pytest

from journeys import serving
from journeys.errors import InputError
from journeys.inputs import CategoricalInput, NumericInput
from journeys.serving import journeys_from_request
from journeys.trained_model import load_model, log_model
from journeys.vocab import Vocabularies
from tests.test_score import MAX_EVENTS, config_for, journeys_folder, save_tiny_model

MODEL_NAME = "journey-conversion"
CHAMPION = f"models:/{MODEL_NAME}@champion"
TEMPERATURE = 1.7  # not 1: the served probability must be the calibrated one
SERVER_START_S = 120  # `mlflow models serve` imports MLflow, torch and the model (~6 s)
BIN = Path(sys.executable).parent  # the venv's bin: `mlflow`, and the `uvicorn` it execs


def records(frame: pl.DataFrame, features: tuple[str, ...] = ("channel", "device")) -> list:
    """Journeys (ingest schema) as a JSON request's records, event times as ISO 8601 `Z`."""
    iso = pl.element().dt.strftime("%Y-%m-%dT%H:%M:%S%.fZ")
    return frame.select("event_type", pl.col("event_time").list.eval(iso), *features).to_dicts()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: Any) -> tuple[int, dict]:
    """POST `body` as JSON: (HTTP status, decoded JSON answer)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def server_env(uri: str) -> dict[str, str]:
    """The environment `mlflow models serve` runs in: the store, and the venv's commands."""
    return {
        **os.environ,
        "MLFLOW_TRACKING_URI": uri,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }


class Server:
    """`mlflow models serve` in its own process group (it execs uvicorn in a child)."""

    def __init__(self, model_uri: str, env: dict[str, str], log: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = log
        command = [str(BIN / "mlflow"), "models", "serve", "-m", model_uri]
        command += ["--env-manager", "local", "--host", "127.0.0.1"]
        command += ["-p", self.url.rsplit(":", 1)[1]]
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self) -> str:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"mlflow models serve exited: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/ping", timeout=2) as answer:
                    if answer.status == 200:
                        return self.url
            except OSError:
                time.sleep(0.25)
        pytest.fail(f"mlflow models serve not ready in {SERVER_START_S} s")

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=15)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def registered(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A tiny model logged and registered as the champion of a fresh SQLite store."""

    root = tmp_path_factory.mktemp("serving")
    journeys = journeys_folder(root / "journeys")
    folder = save_tiny_model(root / "model", Vocabularies.load(journeys), temperature=TEMPERATURE)
    loaded = load_model(str(folder))
    uri, info = register_champion(root, loaded)
    return {"root": root, "journeys": journeys, "loaded": loaded, "uri": uri, "info": info}


def register_champion(root: Path, trained: Any) -> tuple[str, Any]:
    """Log `trained` to a fresh SQLite store in `root` and make it the champion: the
    store's URI and MLflow's model info."""
    import mlflow
    from mlflow import MlflowClient

    from journeys.tracking import use_tracking_uri

    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    # Artifacts beside the store, not in ./mlruns of whatever folder pytest runs in.
    experiment = client.create_experiment("journeys", (root / "artifacts").as_uri())
    with use_tracking_uri(uri), mlflow.start_run(experiment_id=experiment):
        info = log_model(trained)
    with use_tracking_uri(uri):
        version = mlflow.register_model(info.model_uri, MODEL_NAME).version
    client.set_registered_model_alias(MODEL_NAME, "champion", version)
    return uri, info


@pytest.fixture(scope="module")
def server(registered: dict):
    """The champion served by a real `mlflow models serve`, started (not yet ready)."""
    running = Server(CHAMPION, server_env(registered["uri"]), registered["root"] / "serve.log")
    try:
        yield running
    finally:
        running.stop()


# --- the logged model ---------------------------------------------------------------------


def test_logged_model_has_a_signature_naming_its_features_and_an_example(
    registered: dict, tmp_path: Path
) -> None:
    import mlflow

    from journeys.tracking import use_tracking_uri

    info = registered["info"]
    with use_tracking_uri(registered["uri"]):
        local = mlflow.artifacts.download_artifacts(info.model_uri, dst_path=str(tmp_path))
    logged = mlflow.models.Model.load(local)
    assert logged.signature == info.signature
    assert logged.get_serving_input(local) is not None  # what MLflow validated at logging
    inputs = info.signature.inputs
    assert inputs.input_names() == ["event_type", "event_time", "channel", "device"]
    assert inputs.required_input_names() == ["event_type", "event_time"]
    assert info.signature.outputs.input_names() == [
        "conversion_probability",
        "n_events",
        "attention",
    ]
    example = logged.load_input_example(local)
    assert list(example.columns) == ["event_type", "event_time", "channel", "device"]
    # Made of vocabulary tokens, not of a real journey.
    assert set(example["event_type"][0]) <= set(
        registered["loaded"].encoder.vocabs.event_type.tokens
    )

    # Another model's signature names its own features.
    other = serving.signature([CategoricalInput("campaign")], causal=True)
    assert other.inputs.input_names() == ["event_type", "event_time", "campaign"]
    assert other.outputs.input_names()[-1] == "prefix_probability"


def test_pyfunc_reads_every_timestamp_form_as_the_same_instants(registered: dict) -> None:
    import mlflow

    from journeys.tracking import use_tracking_uri

    start = datetime(2026, 1, 5, 10, tzinfo=UTC)
    moments = [start + timedelta(seconds=gap) for gap in (0, 47, 3827, 169_200)]
    seconds = [int(m.timestamp()) for m in moments]
    forms = {
        "Z": [m.strftime("%Y-%m-%dT%H:%M:%SZ") for m in moments],
        # +05:30: an offset that is not a whole number of hours.
        "offset": [m.astimezone(ZoneInfo("Asia/Kolkata")).isoformat() for m in moments],
        "naive (model time zone UTC)": [m.strftime("%Y-%m-%dT%H:%M:%S") for m in moments],
        "space": [m.strftime("%Y-%m-%d %H:%M:%S") for m in moments],
        "epoch s": seconds,
        "epoch ms": [s * 1000 for s in seconds],
        "epoch s float": [float(s) for s in seconds],
        "mixed": [seconds[0], f"{moments[1]:%Y-%m-%dT%H:%M:%SZ}", seconds[2] * 1000, seconds[3]],
    }
    journey = {
        "event_type": ["impression", "click", "add_to_cart", "search"],
        "channel": ["display", "search", None, "email"],
    }  # no device: a missing feature is a missing value on every event
    request = pd.DataFrame([{**journey, "event_time": times} for times in forms.values()])
    with use_tracking_uri(registered["uri"]):
        pyfunc = mlflow.pyfunc.load_model(registered["info"].model_uri)
    served = pyfunc.predict(request)

    probabilities = served["conversion_probability"].to_numpy()
    assert np.ptp(probabilities) == 0, dict(zip(forms, probabilities, strict=True))
    for weights in served["attention"]:
        np.testing.assert_array_equal(weights, served["attention"][0])
    # ... and it is what the model gives for those instants as Polars datetimes.
    frame = pl.DataFrame(
        [{**journey, "event_time": moments, "device": [None] * len(moments)}],
        schema_overrides={
            "event_time": pl.List(pl.Datetime("us", "UTC")),
            "device": pl.List(pl.String),
        },
    )
    expected = registered["loaded"].predict_proba(frame)
    np.testing.assert_allclose(probabilities, expected[0], atol=1e-6)
    # The same frame through pandas (numpy datetimes, which carry no zone: UTC).
    from_pandas = pyfunc.predict(frame.to_pandas())["conversion_probability"]
    np.testing.assert_allclose(from_pandas.to_numpy(), expected, atol=1e-6)
    assert served["n_events"].tolist() == [len(moments)] * len(forms)

    with pytest.raises(mlflow.exceptions.MlflowException) as err:
        pyfunc.predict(pd.DataFrame([{**journey, "event_time": ["2026-01-05", "soon", 1, 2]}]))
    assert err.value.message.endswith(
        "journey 0, event 1: cannot read event_time 'soon' (ISO 8601 with or without an "
        "offset, or epoch seconds or milliseconds)"
    )


# --- the request format -------------------------------------------------------------------


def test_naive_times_are_read_in_the_model_time_zone() -> None:
    frame = journeys_from_request(
        [{"event_type": ["a", "b"], "event_time": ["2026-01-05T11:00:00", "2026-07-05T12:00:00"]}],
        (),
        "Europe/Paris",
    )
    assert frame["event_time"].to_list() == [
        [datetime(2026, 1, 5, 10, tzinfo=UTC), datetime(2026, 7, 5, 10, tzinfo=UTC)]
    ]


def test_features_are_text_and_a_missing_one_is_null() -> None:
    frame = journeys_from_request(
        {"event_type": ["a", "b"], "event_time": [1, 2], "channel": [7, None]},
        [CategoricalInput("channel"), CategoricalInput("device")],
    )
    assert frame.schema["channel"] == frame.schema["device"] == pl.List(pl.String)
    assert frame.row(0, named=True)["channel"] == ["7", None]
    assert frame.row(0, named=True)["device"] == [None, None]


def test_each_column_is_read_as_its_kind_reads_text() -> None:
    """A feature stays text, a number is read as one (null or absent: missing)."""
    columns = [CategoricalInput("channel"), NumericInput("price"), NumericInput("cost")]
    frame = journeys_from_request(
        {"event_type": ["a", "b"], "event_time": [1, 2], "channel": [7, 8], "price": ["2.5", None]},
        columns,
    )
    assert frame.columns == ["event_type", "event_time", "channel", "price", "cost"]
    assert frame.schema["price"] == frame.schema["cost"] == pl.List(pl.Float64)
    assert frame.row(0, named=True)["price"] == [2.5, None]
    assert frame.row(0, named=True)["cost"] == [None, None]
    assert serving.signature(columns).inputs.input_names()[2:] == ["channel", "price", "cost"]


def test_an_empty_request_is_an_empty_frame() -> None:
    empty = pd.DataFrame(columns=["event_type", "event_time"])
    frame = journeys_from_request(empty, [CategoricalInput("x")])
    assert frame.height == 0
    assert frame.columns == ["event_type", "event_time", "x"]


GOOD = {"event_type": ["a", "b"], "event_time": ["2026-01-05T10:00:00Z", 1767607300]}


@pytest.mark.parametrize(
    ("journey", "message"),
    [
        ({"event_type": ["a"]}, "journey 1: event_time is missing"),
        ({**GOOD, "event_time": "2026-01-05T10:00:00Z"}, "event_time must be a list per journey"),
        ({**GOOD, "event_type": []}, "journey 1: no events"),
        ({**GOOD, "event_type": ["a", None]}, "journey 1: event_type has a null"),
        ({**GOOD, "event_time": [1767607300]}, "journey 1: needs one event_time per event_type"),
        ({**GOOD, "channel": ["x"]}, "journey 1: needs one channel value per event_type"),
        ({**GOOD, "event_time": [1767607300, "2026-02-30T10:00:00"]}, "journey 1, event 1: "),
        ({**GOOD, "event_time": [1767607300, None]}, "journey 1, event 1: "),
        ({**GOOD, "event_time": [1767607300, 1767607200]}, "journey 1: event_time goes back"),
    ],
)
def test_bad_journeys_are_one_line_errors(journey: dict, message: str) -> None:
    with pytest.raises(InputError) as err:
        journeys_from_request([GOOD, journey], [CategoricalInput("channel")])
    assert message in str(err.value) and "\n" not in str(err.value)


# --- a real server ------------------------------------------------------------------------


@pytest.mark.slow
def test_served_champion_answers_what_journeys_score_writes(
    registered: dict, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    from journeys.score import score_command

    # The batch scores of the champion while the server starts.
    root = registered["root"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registered["uri"])
    score_command(config_for(root), input_path=str(registered["journeys"]))
    scores = pl.read_parquet(root / "scores" / "*.parquet")
    journeys = pl.read_parquet(registered["journeys"] / "part-00000.parquet")
    longest = journeys.sort("n_events", "journey_id").tail(1)  # cut to the last MAX_EVENTS
    short = journeys.filter(pl.col("n_events") == 3).sort("journey_id").head(1)
    sent = pl.concat([short, longest])
    assert longest["n_events"][0] > MAX_EVENTS

    status, answer = post(
        f"{server.wait_ready()}/invocations", {"dataframe_records": records(sent)}
    )

    assert status == 200, answer
    served = pl.DataFrame(answer["predictions"])
    expected = sent.select("journey_id").join(scores, on="journey_id", how="left")
    np.testing.assert_allclose(
        served["conversion_probability"].to_numpy(),
        expected["conversion_probability"].to_numpy(),
        atol=1e-6,
    )
    assert served["n_events"].to_list() == expected["n_events"].to_list() == [3, MAX_EVENTS]
    for got, want in zip(served["attention"], expected["attention"], strict=True):
        assert len(got) == len(want)
        np.testing.assert_allclose(got.to_numpy(), want.to_numpy(), atol=1e-6)


@pytest.mark.slow
def test_served_bad_request_is_http_400_with_one_line(server: Server) -> None:
    url = f"{server.wait_ready()}/invocations"
    bad = {"event_type": ["click", "search"], "event_time": ["2026-01-05T10:00:00Z", "2026-13-05"]}
    status, answer = post(url, {"dataframe_records": [bad]})
    assert status == 400
    assert answer["error_code"] == "INVALID_PARAMETER_VALUE"
    # MLflow puts the request's data before the model's message: "... \nError: <ours>".
    ours = answer["message"].rsplit("\nError: ", 1)[1]
    assert ours == (
        "journey 0, event 1: cannot read event_time '2026-13-05' (ISO 8601 with or without "
        "an offset, or epoch seconds or milliseconds)"
    )

    # A required column missing: MLflow's own check, also a 400.
    status, answer = post(url, {"dataframe_records": [{"event_type": ["click"]}]})
    assert status == 400
    assert "event_time" in answer["message"]


# --- a baseline champion ------------------------------------------------------------------


@pytest.fixture(scope="module")
def baseline_champion(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The tiny transformer serving a fitted `hgb_aggregates` (its trees saved with Treelite,
    timing aggregates, last-touch levels), registered as the champion of a fresh store."""

    from journeys.baselines import BaselineSettings, fit_baseline

    root = tmp_path_factory.mktemp("serving-baseline")
    journeys = journeys_folder(root / "journeys", n=400)
    folder = save_tiny_model(root / "model", Vocabularies.load(journeys), temperature=TEMPERATURE)
    frame = pl.read_parquet(journeys / "part-00000.parquet")
    trained = load_model(str(folder))
    settings = BaselineSettings((CategoricalInput("channel"), CategoricalInput("device")))
    trained.baseline = fit_baseline(
        "hgb_aggregates", frame.filter(pl.col("split") == "train"), settings
    )
    uri, _ = register_champion(root, trained)
    return {"root": root, "journeys": journeys, "frame": frame, "trained": trained, "uri": uri}


@pytest.mark.slow
def test_a_baseline_champion_serves_alike_in_batch_pyfunc_and_http(
    baseline_champion: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batch scoring, the pyfunc and `mlflow models serve` give the baseline's probability
    and the transformer's attention, the same on every path."""
    import mlflow

    from journeys.score import score_command, score_frame
    from journeys.tracking import use_tracking_uri

    root, uri = baseline_champion["root"], baseline_champion["uri"]
    server = Server(CHAMPION, server_env(uri), root / "serve.log")  # starts while the batch scores
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        score_command(config_for(root), input_path=str(baseline_champion["journeys"]))
        scores = pl.read_parquet(root / "scores" / "*.parquet")
        frame = baseline_champion["frame"]
        # A request lists every event it has: journeys ingest did not truncate.
        whole = frame.filter(pl.col("n_events_total") == pl.col("n_events"))
        sent = whole.sort("journey_id").head(6)
        batch = sent.select("journey_id").join(scores, on="journey_id", how="left")

        # The registered model serves the baseline: its probability, as fitted.
        trained = baseline_champion["trained"]
        assert trained.kind == "baseline_hgb_aggregates"
        expected = trained.baseline.predict_proba(sent)
        np.testing.assert_allclose(batch["conversion_probability"].to_numpy(), expected, atol=1e-9)
        # The attention is the transformer's own, as if it served alone.
        alone = load_model(str(root / "model"))
        assert alone.kind == "transformer"
        own = score_frame(alone, sent)
        for got, want in zip(batch["attention"], own["attention"], strict=True):
            np.testing.assert_allclose(got.to_numpy(), want.to_numpy(), atol=1e-6)
        assert not np.allclose(own["conversion_probability"].to_numpy(), expected)

        with use_tracking_uri(uri):
            pyfunc = mlflow.pyfunc.load_model(CHAMPION)
        answered = pyfunc.predict(pd.DataFrame(records(sent)))
        np.testing.assert_allclose(
            answered["conversion_probability"].to_numpy(), expected, atol=1e-9
        )

        status, answer = post(
            f"{server.wait_ready()}/invocations", {"dataframe_records": records(sent)}
        )
        assert status == 200, answer
        served = pl.DataFrame(answer["predictions"])
        np.testing.assert_allclose(served["conversion_probability"].to_numpy(), expected, atol=1e-9)
        for got, want in zip(served["attention"], batch["attention"], strict=True):
            np.testing.assert_allclose(got.to_numpy(), want.to_numpy(), atol=1e-6)
    finally:
        server.stop()

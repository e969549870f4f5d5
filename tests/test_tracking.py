"""MLflow wiring: fail-fast checks, the champion rule, params on resume, the UI command."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import make_journeys_dataset
from mlflow import MlflowClient

from journeys import tracking
from journeys.cli import main
from journeys.config import load_config
from journeys.errors import InputError, JourneysError

UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens there


def test_env_tracking_uri_overrides_the_config(monkeypatch) -> None:
    config = load_config(None, ["mlflow.tracking_uri=sqlite:///from-config.db"])
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking.tracking_uri(config) == "sqlite:///from-config.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///from-env.db")
    assert tracking.tracking_uri(config) == "sqlite:///from-env.db"


@pytest.mark.parametrize("user_env", [None, "sqlite:///user.db"])
def test_use_tracking_uri_restores_the_setting_and_the_variable(monkeypatch, user_env) -> None:
    import mlflow

    if user_env is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", user_env)
    before = mlflow.get_tracking_uri()
    with tracking.use_tracking_uri("sqlite:///inside.db"):
        assert mlflow.get_tracking_uri() == "sqlite:///inside.db"
        mlflow.set_tracking_uri("sqlite:///inside.db")  # as Lightning's logger pins it
    assert os.environ.get("MLFLOW_TRACKING_URI") == user_env
    assert mlflow.get_tracking_uri() == before
    # Nothing stays pinned: a variable set later is still what MLflow reads.
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///later.db")
    assert mlflow.get_tracking_uri() == "sqlite:///later.db"


def test_use_tracking_uri_pins_back_a_uri_the_process_set(monkeypatch) -> None:
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri("sqlite:///pinned.db")
    try:
        with tracking.use_tracking_uri("sqlite:///inside.db"):
            assert mlflow.get_tracking_uri() == "sqlite:///inside.db"
        assert mlflow.get_tracking_uri() == "sqlite:///pinned.db"
    finally:
        mlflow.set_tracking_uri(None)  # the test's own pin, undone (MLflow's reset)


@pytest.mark.parametrize("via_env", [False, True])
def test_unreachable_tracking_uri_fails_fast_with_exit_2(
    tmp_path, monkeypatch, capsys, via_env
) -> None:
    monkeypatch.chdir(tmp_path)
    make_journeys_dataset(tmp_path / "journeys", n=120)
    args = ["train", "--set", f"paths.journeys={tmp_path / 'journeys'}"]
    args += ["--set", f"paths.checkpoints={tmp_path / 'checkpoints'}"]
    if via_env:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", UNREACHABLE)
        args += ["--set", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'unused.db'}"]
    else:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
        args += ["--set", f"mlflow.tracking_uri={UNREACHABLE}"]
    import journeys.train  # noqa: F401  (imported up front: time only the check itself)

    start = time.perf_counter()
    assert main(args) == 2
    assert time.perf_counter() - start < 10
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert UNREACHABLE in err and "unreachable" in err
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "unused.db").exists()


def test_missing_journeys_exits_2_with_one_line(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code = main(["train", "--set", f"paths.journeys={tmp_path / 'nope'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "journeys ingest" in err


def test_sqlite_store_folder_is_created(tmp_path) -> None:
    uri = f"sqlite:///{tmp_path / 'deep' / 'er' / 'mlflow.db'}"
    tracking.check_tracking_uri(uri)
    assert (tmp_path / "deep" / "er" / "mlflow.db").exists()


def test_ingest_report_counts_become_flat_metric_names() -> None:
    report = {
        "rows_read": 10,
        "quarantined": {"bad_timestamp": 2},
        "journeys_by_split": {"train": 3},
    }
    counts = tracking.ingest_counts(
        {
            **report,
            "source": "data/raw",
            "ok": True,
            "ingest": {"rows_read": 4},  # the last run's own figures: named once
            "by_source": {"/data/raw/day-1.csv": {"rows": 10}},  # paths: not metric names
        }
    )
    assert counts == {
        "ingest_rows_read": 10.0,
        "ingest_quarantined_bad_timestamp": 2.0,
        "ingest_journeys_by_split_train": 3.0,
        "ingest_run_rows_read": 4.0,
    }


def test_resumed_run_keeps_its_params_and_tags_changed_values(mlflow_env) -> None:
    with tracking.mlflow_run(mlflow_env, "journeys") as first:
        tracking.log_config(first, load_config(None, ["train.max_epochs=2"]))
    with tracking.mlflow_run(mlflow_env, "journeys", run_id=first.run_id) as resumed:
        tracking.log_config(resumed, load_config(None, ["train.max_epochs=5"]))
    run = MlflowClient(mlflow_env).get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_epochs"] == "2"
    assert run.data.tags["resume_override.train.max_epochs"] == "5"


def test_params_record_the_store_actually_used(mlflow_env) -> None:
    """`MLFLOW_TRACKING_URI` wins over the config: the run's `mlflow.tracking_uri` param
    says which store it really went to, not the config's value."""
    with tracking.mlflow_run(mlflow_env, "journeys") as run:
        tracking.log_config(run, load_config(None, ["mlflow.tracking_uri=sqlite:///x.db"]))
    params = MlflowClient(mlflow_env).get_run(run.run_id).data.params
    assert params["mlflow.tracking_uri"] == mlflow_env


def test_a_run_left_by_an_exception_is_marked_as_it_says(mlflow_env) -> None:
    """`mlflow_run` ends its run FAILED on an error and KILLED on Ctrl+C or SIGTERM."""
    from journeys.errors import Interrupted

    client = MlflowClient(mlflow_env)
    for error, status in ((ValueError("boom"), "FAILED"), (KeyboardInterrupt(), "KILLED")):
        with pytest.raises(type(error)), tracking.mlflow_run(mlflow_env, "journeys") as run:
            raise error
        assert client.get_run(run.run_id).info.status == status
    with pytest.raises(Interrupted), tracking.mlflow_run(mlflow_env, "journeys") as run:
        raise Interrupted(15)
    assert client.get_run(run.run_id).info.status == "KILLED"


def test_an_optional_run_never_creates_a_store(tmp_path, capsys) -> None:
    uri = f"sqlite:///{tmp_path / 'absent.db'}"
    with tracking.mlflow_run(uri, "journeys", optional=True) as run:
        assert run is None
    assert not (tmp_path / "absent.db").exists()


def test_champion_moves_on_improvement_and_stays_on_regression(mlflow_env) -> None:

    import polars as pl

    from journeys.config import Model, Promotion
    from journeys.encoding import JourneyEncoder
    from journeys.model import JourneyTransformer, ModelConfig
    from journeys.promotion import decide
    from journeys.trained_model import JourneyRules, TrainedModel, log_model
    from journeys.vocab import Vocabularies, Vocabulary

    vocabs = Vocabularies({"event_type": Vocabulary(("<pad>", "<unk>", "view", "click"))})
    trained = TrainedModel(
        JourneyTransformer(ModelConfig(vocab_size=4, d_model=8, n_heads=2, n_layers=1)),
        JourneyEncoder.fit(pl.DataFrame(), vocabs, Model(), max_len=64, timezone="UTC"),
        JourneyRules.from_config(load_config(None)),
    )
    client = MlflowClient(mlflow_env)

    labels = np.arange(100) % 4 == 0  # 25 conversions in 100 val journeys

    def register(auc: float) -> tracking.Registration:
        """A version whose val scores reach about `auc` (NaN: noise), registered as
        `decide` says against the champion's logged val ROC AUC."""
        noise = np.random.default_rng(0).normal(size=labels.size)
        scores = noise if math.isnan(auc) else labels * 2 * auc**4 + noise * (1 - auc)
        champion = tracking.champion_version(mlflow_env, "jc")
        logged = None if champion is None else tracking.logged_val_roc_auc(mlflow_env, champion)
        decision = decide(labels, {"transformer": scores}, logged, Promotion())
        with tracking.mlflow_run(mlflow_env, "journeys") as run:
            with run.active():
                info = log_model(trained)
            return tracking.register_model(run, info.model_uri, "jc", decision)

    def champion() -> int:
        return int(client.get_model_version_by_alias("jc", "champion").version)

    def val_auc(version: int) -> float:
        return float(client.get_model_version("jc", str(version)).tags["val_roc_auc"])

    noise = register(math.nan)  # below chance: registered, but never the champion
    assert (noise.promoted, noise.champion_version) == (False, None)
    assert tracking.champion_version(mlflow_env, "jc") is None
    first = register(0.70)
    assert (first.version, first.promoted, champion()) == (2, True, 2)
    better = register(0.90)
    assert (better.version, better.promoted, champion()) == (3, True, 3)
    assert val_auc(3) > val_auc(2)
    worse = register(0.80)
    assert (worse.version, worse.promoted, worse.champion_version, champion()) == (4, False, 3, 3)
    tie = register(0.90)
    assert not tie.promoted and champion() == 3  # must beat, not equal

    version = client.get_model_version("jc", "4")
    assert version.tags["champion_decision"] == "kept_previous"
    assert version.tags["champion_check"] == "not_better_than_champion"
    assert f"<= champion's {val_auc(3):.4f} (logged)" in version.tags["champion_reason"]
    assert client.get_run(version.run_id).data.tags["champion_decision"] == "kept_previous"
    assert client.get_model_version("jc", "3").tags["champion_decision"] == "promoted"
    assert client.get_model_version("jc", "1").tags["champion_check"] == "not_above_chance"


def test_ui_binds_to_loopback_on_the_configured_store(monkeypatch, capsys) -> None:
    calls = []

    class Done:
        returncode = 0

    environments = []
    monkeypatch.setattr(
        tracking,
        "run_supervised",
        lambda cmd, **kw: calls.append(cmd) or environments.append(kw["env"]) or Done.returncode,
    )
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = load_config(None, ["mlflow.tracking_uri=sqlite:///x.db"])
    tracking.ui_command(config, host="127.0.0.1", port=5123)
    command = calls[0]
    assert command[1:4] == ["-m", "mlflow", "ui"]
    # The store (a password, maybe) is in the child's environment, not in its arguments.
    assert environments[0]["MLFLOW_BACKEND_STORE_URI"] == "sqlite:///x.db"
    assert "sqlite:///x.db" not in command
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--port") + 1] == "5123"
    assert "warning" not in capsys.readouterr().err

    tracking.ui_command(config, host="0.0.0.0", port=5000)
    assert "exposes" in capsys.readouterr().err

    Done.returncode = 1
    with pytest.raises(JourneysError, match="exited with code 1"):
        tracking.ui_command(config)


def test_champion_and_training_summary_read_back_from_the_store(mlflow_env, tmp_path) -> None:
    name = "jc"
    missing = f"sqlite:///{tmp_path / 'none' / 'mlflow.db'}"
    assert tracking.champion_version(missing, name) is None
    with pytest.raises(InputError, match="no MLflow store"):
        tracking.champion_uri(missing, name)
    assert not (tmp_path / "none").exists()  # looking never creates a store

    client = MlflowClient(mlflow_env)
    experiment = tracking.get_experiment_id(mlflow_env, "journeys")
    with pytest.raises(InputError, match="no champion version of model 'jc'"):
        tracking.champion_uri(mlflow_env, name)

    run_id = client.create_run(experiment).info.run_id
    client.log_metric(run_id, "test_roc_auc", 0.7)
    tags = {tracking.MODEL_FAMILY_TAG: "transformer", tracking.COMPARISON_GROUP_TAG: run_id}
    tags |= {
        tracking.REGISTERED_VERSION_TAG: f"{name}/1",
        tracking.CHAMPION_DECISION_TAG: "promoted",
        tracking.CHAMPION_CHECK_TAG: "first_champion",
        tracking.CHAMPION_REASON_TAG: "first champion (val ROC AUC 0.7100)",
        tracking.MODEL_KIND_TAG: "baseline_hgb_aggregates",
        tracking.BASELINES_AHEAD_TAG: "hgb_aggregates,last_touch",
    }
    for key, value in tags.items():
        client.set_tag(run_id, key, value)
    baseline = client.create_run(experiment).info.run_id
    client.log_metric(baseline, "test_roc_auc", 0.6)
    client.set_tag(baseline, tracking.MODEL_FAMILY_TAG, "baseline_logreg")
    client.set_tag(baseline, tracking.COMPARISON_GROUP_TAG, run_id)
    other = client.create_run(experiment).info.run_id  # another training's baseline
    client.set_tag(other, tracking.MODEL_FAMILY_TAG, "baseline_prior")
    client.set_tag(other, tracking.COMPARISON_GROUP_TAG, "someone-else")
    client.create_registered_model(name)
    client.create_model_version(name, source=str(tmp_path / "model"), run_id=run_id)
    client.set_registered_model_alias(name, tracking.CHAMPION_ALIAS, "1")

    assert tracking.champion_uri(mlflow_env, name) == (f"models:/{name}/1", run_id)
    assert tracking.champion_version(mlflow_env, "other") is None
    summary = tracking.training_summary(mlflow_env, run_id, name)
    assert summary == {
        "run_id": run_id,
        "experiment_id": experiment,
        "tracking_uri": mlflow_env,
        "registered_model": name,
        "model_version": 1,
        "champion_version": 1,
        "promoted": True,
        "champion_check": "first_champion",
        "model_kind": "baseline_hgb_aggregates",
        "champion_reason": "first champion (val ROC AUC 0.7100)",
        "baselines_ahead": ["hgb_aggregates", "last_touch"],
        "metrics": {"test_roc_auc": 0.7},
        "baselines": {"logreg": {"run_id": baseline, "metrics": {"test_roc_auc": 0.6}}},
    }


def test_ui_on_a_tracking_server_just_points_at_it(monkeypatch, capsys) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.internal:5000")
    tracking.ui_command(load_config(None, []))
    assert "http://mlflow.internal:5000" in capsys.readouterr().out


def test_cli_ui_uses_the_same_command(monkeypatch) -> None:
    seen = {}
    monkeypatch.setattr(
        tracking, "ui_command", lambda config, host, port: seen.update(h=host, p=port)
    )
    assert main(["ui", "--port", "5001"]) == 0
    assert seen == {"h": "127.0.0.1", "p": 5001}


def test_tracking_module_stays_light() -> None:
    import subprocess
    import sys

    code = (
        "import sys, journeys.tracking; "
        "print('mlflow' in sys.modules, 'torch' in sys.modules, 'prefect' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        check=True,
    ).stdout
    assert out.split() == ["False", "False", "False"]

"""`train.search`: a short Optuna search on val, each trial a nested MLflow run, the best
trial kept with its settings, and the choice among trials judged honestly."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import optuna
import pytest
from conftest import make_journeys_dataset, make_learnable_journeys
from mlflow import MlflowClient
from test_train import tiny_config

from journeys.config import load_config
from journeys.errors import ConfigError
from journeys.search import drawn_settings

SPACE = (
    "train.search.space={train.lr: {low: 0.001, high: 0.01, log: true}, model.d_model: [16, 32]}"
)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.search.space={model.widht: [1, 2]}", "model.widht: unknown setting"),
        ("train.search.space={journey.max_gap: [1d]}", "model.<key> or train.<key>"),
        ("train.search.space={model.d_model: [30]}", "model.d_model=30 is not a valid setting"),
        (
            "train.search.space={train.lr: {low: 0, high: 1, log: true}}",
            "a log range needs low > 0",
        ),
        ("train.search.space={train.lr: {low: 2, high: 1}}", "low must be below high"),
        ("train.search.space={model.n_layers: []}", "model.n_layers: no choices"),
        ("train.search.space={train.window: [30d, 60d]}", "not a setting a search may change"),
        ("train.search.space={model.pooling: {low: 0, high: 1}}", "a range needs a number"),
    ],
)
def test_a_search_space_that_cannot_run_is_refused_when_read(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["train.search.trials=2", override])


def test_a_search_off_checks_the_space_s_keys_but_not_its_values() -> None:
    """The default space's widths (32, 64, 128) do not suit 3 heads: with the search off
    the model is not refused for it; a search over it would be."""
    load_config(None, ["model.n_heads=3", "model.d_model=48"])
    with pytest.raises(ConfigError, match=r"model\.d_model=32 is not a valid setting"):
        load_config(None, ["model.n_heads=3", "model.d_model=48", "train.search.trials=2"])
    with pytest.raises(ConfigError, match=r"model\.widht: unknown setting"):
        load_config(None, ["train.search.space={model.widht: [1, 2]}"])  # off, still a key
    with pytest.raises(ConfigError, match="not a setting a search may change"):
        load_config(None, ["train.search.trials=2", "train.search.space={train.stack: [true]}"])


def test_a_later_configuration_file_replaces_the_search_space_whole(tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text("train:\n  search:\n    space:\n      train.lr: [0.001, 0.003]\n")
    config = load_config([Path(__file__).parents[1] / "conf" / "default.yaml", mine], [])
    assert list(config.train.search.space) == ["train.lr"]
    assert config.train.search.space["train.lr"] == [0.001, 0.003]


def test_a_search_runs_in_one_process() -> None:
    with pytest.raises(ConfigError, match="devices 1 and num_nodes 1"):
        load_config(None, ["train.search.trials=4", "train.devices=2"])
    load_config(None, ["train.search.trials=0", "train.devices=2"])  # off: no objection


def test_drawn_settings_keep_each_setting_s_type_and_range() -> None:
    config = load_config(None, [])  # the default space
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    draws = [drawn_settings(study.ask(), config) for _ in range(40)]
    assert {key for draw in draws for key in draw} == set(config.train.search.space)
    assert all(0.0005 <= d["train.lr"] <= 0.01 for d in draws)
    assert all(type(d["model.n_layers"]) is int and d["model.n_layers"] in (1, 2, 3) for d in draws)
    assert {d["model.continuous_encoding"] for d in draws} == {"linear", "piecewise"}
    # A range over an integer setting draws integers.
    ranged = load_config(None, ["train.search.space={model.n_layers: {low: 1, high: 4}}"])
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    layers = {drawn_settings(study.ask(), ranged)["model.n_layers"] for _ in range(40)}
    assert layers == {1, 2, 3, 4}


@pytest.mark.slow
def test_a_search_keeps_its_best_trial_and_logs_every_trial_under_the_run(
    tmp_path: Path, mlflow_env: str
) -> None:
    from journeys.tracking import PARENT_RUN_TAG, SEARCH_TRIAL_TAG
    from journeys.train import train_command
    from journeys.trained_model import load_model

    make_learnable_journeys(tmp_path / "journeys", n=400, seed=0)
    config = tiny_config(
        tmp_path, mlflow_env, "train.max_epochs=2", "promotion.min_val_conversions=10",
        "train.search.trials=3", SPACE,
    )  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = train_command(config)
    client = MlflowClient(mlflow_env)
    parent = client.get_run(result.run_id)
    trials = client.search_runs(
        [result.experiment_id], filter_string=f"tags.{SEARCH_TRIAL_TAG} != ''"
    )
    assert len(trials) == 3 == parent.data.metrics["search_trials"]
    assert {t.data.tags[PARENT_RUN_TAG] for t in trials} == {result.run_id}
    best = max(trials, key=lambda t: t.data.metrics["best_val_roc_auc"])
    assert parent.data.metrics["search_best_trial"] == int(best.data.tags[SEARCH_TRIAL_TAG])
    assert parent.data.metrics["best_val_roc_auc"] == best.data.metrics["best_val_roc_auc"]
    # The run's params are the kept trial's settings, the ones its model was trained with,
    # and the steps after the search (here the baselines' runs) read them too.
    assert len({t.data.params["model.d_model"] for t in trials}) == 2  # the draws differ
    baseline = client.get_run(result.baselines["logreg"].run_id)
    for key in ("train.lr", "model.d_model"):
        assert parent.data.params[key] == best.data.params[key] == baseline.data.params[key]
    served = load_model(result.model_uri, mlflow_env).model
    assert served.config.d_model == int(best.data.params["model.d_model"])
    # Every trial's epochs went to its own run; the training run holds the kept one's, as
    # any training run holds its model's; only the kept trial's checkpoints stay.
    assert all(len(client.get_metric_history(t.info.run_id, "val_roc_auc")) == 2 for t in trials)
    for key in ("train_loss", "val_loss", "val_roc_auc"):
        epochs = client.get_metric_history(result.run_id, key)
        assert [(m.step, m.value) for m in epochs] == [
            (m.step, m.value) for m in client.get_metric_history(best.info.run_id, key)
        ]
    folders = sorted(p.name for p in (tmp_path / "checkpoints" / result.run_id).iterdir())
    assert folders == [f"trial-{best.data.tags[SEARCH_TRIAL_TAG]}"]
    assert out.getvalue().count("search trial") == 6  # a line as each starts and ends
    assert [t.data.tags[SEARCH_TRIAL_TAG] for t in trials][::-1] == ["1", "2", "3"]


@pytest.mark.slow
def test_a_trial_lucky_on_val_is_judged_on_the_half_that_did_not_choose_it(
    tmp_path: Path, mlflow_env: str
) -> None:
    """Sixteen trials that learn nothing (a learning rate of all but 0, only the seed
    differs): the best of them on val clears chance by luck; judged on the half of val
    that did not choose it, it does not, and it is not served."""
    from journeys.train import train_command

    make_journeys_dataset(tmp_path / "journeys", n=3000, seed=3)
    config = tiny_config(
        tmp_path, mlflow_env, "train.max_epochs=1", "train.lr=1e-9", "train.warmup_steps=0",
        "promotion.min_val_conversions=10", "train.baselines=[prior]", "train.stack=false",
        "train.search.trials=16", "train.search.space={train.seed: {low: 0, high: 1000}}",
    )  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        result = train_command(config)
    kept = result.metrics["best_val_roc_auc"]  # the search's choice, on all of val
    judged = result.metrics["val_roc_auc_transformer"]
    assert kept > 0.56  # 0.577 here: 450 val journeys, the best of sixteen draws
    assert judged < kept - 0.03  # 0.533
    assert not result.promoted and "above chance" in result.registration.reason


def test_a_search_does_not_resume(tmp_path: Path, mlflow_env: str) -> None:
    from journeys.train import train_command

    make_learnable_journeys(tmp_path / "journeys", n=200, seed=0)
    config = tiny_config(tmp_path, mlflow_env, "train.search.trials=2")
    with pytest.raises(ConfigError, match=r"train\.search cannot resume"):
        train_command(config, resume=True)


@pytest.mark.slow
def test_a_trial_whose_draws_clash_is_skipped_and_the_search_goes_on(
    tmp_path: Path, mlflow_env: str
) -> None:
    """Both ends of a width range are valid alone (the two heads divide 30 and 34), the
    widths between may not be: such a trial is skipped, trains nothing, and the search
    keeps a valid one."""
    from journeys.train import train_command

    make_learnable_journeys(tmp_path / "journeys", n=200, seed=0)
    config = tiny_config(
        tmp_path, mlflow_env, "train.max_epochs=1", "promotion.min_val_conversions=1",
        "train.baselines=[]", "train.search.trials=6",
        "train.search.space={model.d_model: {low: 30, high: 34}}",
    )  # fmt: skip
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = train_command(config)
    skipped = len(re.findall(r"^search trial \d+ of 6: skipped", out.getvalue(), re.MULTILINE))
    assert skipped >= 1 and "d_model must be divisible by n_heads" in out.getvalue()
    client = MlflowClient(mlflow_env)
    trained = client.search_runs([result.experiment_id], "tags.search_trial != ''")
    assert len(trained) == 6 - skipped
    parent = client.get_run(result.run_id)
    assert parent.data.metrics["search_trials"] == 6 - skipped  # trained, not drawn
    assert {int(t.data.params["model.d_model"]) % 2 for t in trained} == {0}


def test_a_retried_pipeline_task_starts_a_search_afresh(tmp_path: Path) -> None:
    """A Prefect retry resumes an interrupted training, but never a search (which
    `journeys train --resume` refuses): it would fail the same way on every retry."""
    from flows.pipeline import _resumable
    from journeys.train import write_state

    write_state(tmp_path, {"run_id": "r", "status": "training"})
    config = load_config(None, [f"paths.checkpoints={tmp_path}"])
    assert _resumable(config)
    assert not _resumable(
        load_config(None, [f"paths.checkpoints={tmp_path}", "train.search.trials=2"])
    )

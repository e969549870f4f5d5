"""Training end to end on a tiny dataset: what lands in MLflow, and loading it back safely."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
from pathlib import Path

import mlflow
import numpy as np
import polars as pl
import pytest
import torch
from conftest import make_journeys_dataset, make_learnable_journeys
from mlflow import MlflowClient

from journeys import metrics as M
from journeys.baselines import ahead_of_transformer
from journeys.config import Config, load_config
from journeys.datasets import dataset_features
from journeys.errors import ConfigError, InputError, JourneysError

TINY = [
    # The fixture's journeys carry no time signal: with six time inputs of noise, 2 epochs
    # of a tiny model on 280 journeys rank worse than chance.
    "model.time_encodings=false",
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=1",
    "model.dropout=0.0",
    "train.batch_size=64",
    "train.warmup_steps=4",
    "train.lr=0.005",
    "train.accelerator=cpu",
    "train.num_workers=0",
]
CONTRACT_METRICS = ("test_roc_auc", "test_pr_auc", "test_log_loss", "test_brier", "test_ece")
EPOCH_METRICS = ("train_loss", "val_loss", "val_roc_auc")
PLOTS = ("roc.png", "pr.png", "calibration.png", "attention_by_event_type.png")


def tiny_config(folder: Path, uri: str, *overrides: str) -> Config:
    return load_config(
        None,
        [
            *TINY,
            f"paths.journeys={folder / 'journeys'}",
            f"paths.checkpoints={folder / 'checkpoints'}",
            f"mlflow.tracking_uri={uri}",
            *overrides,
        ],
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory):
    """One real training (2 epochs, all baselines) shared by the tests of this module."""
    from journeys.train import train_command

    tmp = tmp_path_factory.mktemp("train")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)  # the config's URI, this time
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        # A rule the model learns in enough steps: the champion guard promotes it.
        make_learnable_journeys(tmp / "journeys", n=400, seed=0)
        overrides = (
            "train.max_epochs=2",
            "train.step_floor=1000",
            "promotion.min_val_conversions=10",
        )
        config = tiny_config(tmp, uri, *overrides)
        fluent_before = mlflow.get_tracking_uri()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            result = train_command(config)
        # MLflow's set_tracking_uri exports the variable; training must not leave it behind
        # (it would override the next config's URI in this process).
        assert "MLFLOW_TRACKING_URI" not in os.environ
        assert mlflow.get_tracking_uri() == fluent_before
        yield result, config, uri, out.getvalue()


@pytest.mark.slow
def test_run_logs_every_contract_metric_param_tag_and_plot(trained) -> None:
    result, config, uri, _ = trained
    client = MlflowClient(uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["model_family"] == "transformer"
    assert client.get_experiment(run.info.experiment_id).name == config.mlflow.experiment
    # The whole resolved config, nothing else (data.features as the journeys have them).
    assert run.data.params == dataset_features(config).flat()
    for name in (*CONTRACT_METRICS, "test_ece_calibrated", "temperature"):
        assert name in run.data.metrics, name
    assert 0.5 <= run.data.metrics["test_roc_auc"] <= 1 or math.isnan(
        run.data.metrics["test_roc_auc"]
    )
    # Once per epoch (train) or per validation (val): a small log gets more epochs than
    # train.max_epochs (the step schedule), validated every few of them.
    epochs = {m.step for m in client.get_metric_history(result.run_id, "train_loss")}
    for name in EPOCH_METRICS:
        history = client.get_metric_history(result.run_id, name)
        steps = [m.step for m in history]
        assert len(history) >= 2 and len(set(steps)) == len(steps), name
        assert set(steps) <= epochs, name
    report = json.loads((Path(config.paths.journeys) / "ingest_report.json").read_text())
    assert run.data.metrics["ingest_rows_read"] == report["rows_read"]
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert "ingest_report.json" in artifacts
    plots = {Path(a.path).name for a in client.list_artifacts(result.run_id, "plots")}
    assert set(PLOTS) <= plots
    for plot in PLOTS:
        local = client.download_artifacts(result.run_id, f"plots/{plot}")
        assert Path(local).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_loads_without_pickle_and_scores_like_the_trained_model(trained, monkeypatch) -> None:
    from journeys.datasets import scan_journeys
    from journeys.tracking import use_tracking_uri
    from journeys.trained_model import load_model

    result, config, uri, _ = trained
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "false")
    test = (
        scan_journeys(config.paths.journeys)
        .filter(pl.col("split") == "test")
        .collect()
        .join(result.test_predictions, on="journey_id")
    )
    for uri_form in (f"runs:/{result.run_id}/model", "models:/journey-conversion@champion"):
        loaded = load_model(uri_form, tracking_uri=uri)
        assert loaded.model_uri == uri_form
        assert list(loaded.rules.features) == loaded.encoder.features == config.data.features
        assert loaded.rules.max_events == loaded.max_len == config.journey.max_events
        assert loaded.encoder.vocabs.features == config.data.features
        # The network is the run's transformer whatever candidate serves ...
        probs = M.sigmoid(loaded.predict_logits(test))
        np.testing.assert_allclose(probs, test.get_column("probability").to_numpy(), atol=1e-6)
        # ... and the probability is the chosen candidate's, as training measured it.
        assert loaded.kind == result.model_kind
        served = M.binary_metrics(test["label"].to_numpy(), loaded.predict_proba(test))
        assert served["test_roc_auc"] == pytest.approx(result.metrics["served_test_roc_auc"])
    assert loaded.model_version == str(result.model_version)
    assert loaded.temperature == pytest.approx(result.metrics["temperature"])

    # The registered pyfunc flavour loads too (models-from-code: no pickled object).
    with use_tracking_uri(uri):
        pyfunc = mlflow.pyfunc.load_model(f"models:/journey-conversion/{result.model_version}")
    # With a signature MLflow checks the input first, and it takes pandas (what it serves).
    scored = pyfunc.predict(test.head(5).to_pandas())
    expected = loaded.predict_proba(test.head(5))
    np.testing.assert_allclose(scored["conversion_probability"].to_numpy(), expected, atol=1e-6)


def test_missing_model_or_alias_is_a_one_line_input_error(trained) -> None:
    from journeys.trained_model import load_model

    _, _, uri, _ = trained
    for bad in (
        "models:/journey-conversion@nope",
        "models:/journey-conversion/99",
        "runs:/0/model",
    ):
        with pytest.raises(InputError) as err:
            load_model(bad, tracking_uri=uri)
        assert "\n" not in str(err.value) and bad in str(err.value)


def test_first_model_becomes_champion_and_baselines_share_the_experiment(trained) -> None:
    result, config, uri, printed = trained
    client = MlflowClient(uri)
    assert result.promoted and result.champion_version == result.model_version == 1
    champion = client.get_model_version_by_alias(config.mlflow.registered_model, "champion")
    assert champion.run_id == result.run_id
    assert champion.tags["champion_decision"] == "promoted"

    runs = client.search_runs([result.experiment_id])
    families = {r.data.tags["model_family"]: r for r in runs}
    assert set(families) == {"transformer", *(f"baseline_{b}" for b in config.train.baselines)}
    for name, baseline in result.baselines.items():
        run = families[f"baseline_{name}"]
        assert run.info.run_id == baseline.run_id
        assert set(CONTRACT_METRICS) <= set(run.data.metrics)
        plots = {Path(a.path).name for a in client.list_artifacts(run.info.run_id, "plots")}
        assert {"roc.png", "pr.png", "calibration.png"} <= plots
    assert families["baseline_prior"].data.metrics["test_roc_auc"] == pytest.approx(0.5)
    # The strong baseline is on by default, on the very same test journeys.
    transformer = families["transformer"]
    assert "hgb_aggregates" in config.train.baselines
    for name in config.train.baselines:
        metrics = families[f"baseline_{name}"].data.metrics
        assert metrics["n_test"] == transformer.data.metrics["n_test"], name
    ahead = ahead_of_transformer(
        transformer.data.metrics, {n: b.metrics for n, b in result.baselines.items()}
    )
    assert transformer.data.tags["baselines_ahead"] == (",".join(ahead) or "none")
    # One comparison table with every model.
    assert printed.count("Test metrics") == 1
    for family in families:
        assert family in printed


def add_callback(monkeypatch: pytest.MonkeyPatch, callback) -> None:
    """Make `journeys train` run with one more Lightning callback."""
    from journeys import train

    build = train.build_trainer

    def with_callback(*args, **kwargs):
        trainer, checkpoint = build(*args, **kwargs)
        trainer.callbacks.append(callback)
        return trainer, checkpoint

    monkeypatch.setattr(train, "build_trainer", with_callback)


def test_resume_continues_the_interrupted_run(tmp_path: Path, mlflow_env: str, monkeypatch) -> None:
    import lightning as L

    from journeys import train

    make_journeys_dataset(tmp_path / "journeys", n=300, seed=1)
    config = tiny_config(tmp_path, mlflow_env, "train.max_epochs=2", "train.baselines=[]")

    class Interrupt(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module) -> None:
            if trainer.current_epoch == 1:  # epoch 0 and its checkpoint are done
                raise RuntimeError("simulated crash after epoch 0")

    build = train.build_trainer
    add_callback(monkeypatch, Interrupt())
    with pytest.raises(RuntimeError, match="simulated crash"):
        train.train_command(config)
    state = json.loads((tmp_path / "checkpoints" / "latest.json").read_text())
    assert (Path(state["checkpoint_dir"]) / "last.ckpt").exists()

    monkeypatch.setattr(train, "build_trainer", build)
    result = train.train_command(config, resume=True)
    assert result.run_id == state["run_id"]
    client = MlflowClient(mlflow_env)
    assert len(client.search_runs([result.experiment_id])) == 1
    steps = [m.step for m in client.get_metric_history(result.run_id, "val_roc_auc")]
    assert len(steps) == 2 and steps[0] < steps[1]  # epoch 0 before the crash, epoch 1 after
    assert client.get_run(result.run_id).info.status == "FINISHED"
    with pytest.raises(JourneysError, match="nothing to resume"):
        train.train_command(config, resume=True)


def test_last_checkpoint_is_the_latest_epoch_not_the_best(
    tmp_path: Path, mlflow_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from journeys import train

    make_journeys_dataset(tmp_path / "journeys", n=300, seed=3)
    config = tiny_config(tmp_path, mlflow_env, "train.max_epochs=3", "train.baselines=[]")

    def falling_auc(self, batch, batch_idx) -> None:  # the best epoch is always the first
        self.log("val_roc_auc", 0.9 - 0.1 * self.current_epoch, batch_size=len(batch.labels))

    monkeypatch.setattr(train.JourneyModule, "validation_step", falling_auc)
    with contextlib.redirect_stdout(io.StringIO()):
        result = train.train_command(config)
    best = torch.load(result.checkpoint, weights_only=True)
    last = torch.load(Path(result.checkpoint).parent / train.LAST_CHECKPOINT, weights_only=True)
    assert best["epoch"] == 0
    assert last["epoch"] == 2  # what `--resume` continues from


def test_validation_every_n_epochs_still_validates_the_last(
    tmp_path: Path, mlflow_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from journeys import train

    make_journeys_dataset(tmp_path / "journeys", n=300, seed=3)
    config = tiny_config(
        tmp_path, mlflow_env, "train.max_epochs=5", "train.val_every_epochs=2", "train.baselines=[]"
    )
    validated: list[int] = []

    def rising_auc(self, batch, batch_idx) -> None:  # the best epoch is always the latest
        if not self.trainer.sanity_checking:
            validated.append(self.current_epoch)
        self.log("val_roc_auc", 0.5 + 0.1 * self.current_epoch, batch_size=len(batch.labels))

    monkeypatch.setattr(train.JourneyModule, "validation_step", rising_auc)
    with contextlib.redirect_stdout(io.StringIO()):
        result = train.train_command(config)
    assert sorted(set(validated)) == [1, 3, 4]  # every 2nd epoch, and the last one
    assert torch.load(result.checkpoint, weights_only=True)["epoch"] == 4


def test_ema_update_ramps_up_then_keeps_the_configured_decay() -> None:
    from journeys.lightning_parts import EMA_WARMUP, ema_update

    averaged, current = torch.zeros(3), torch.ones(3)
    first = ema_update(averaged, current, torch.tensor(0), decay=0.999)
    # decay 1 / EMA_WARMUP on the first step: the average jumps most of the way
    assert torch.allclose(first, torch.full((3,), 1 - 1 / EMA_WARMUP))
    late = ema_update(averaged, current, torch.tensor(10_000), decay=0.999)
    assert torch.allclose(late, torch.full((3,), 0.001))


@pytest.mark.parametrize("ema_decay", ["0.99", "null"])
def test_checkpoints_hold_the_weight_average_and_resume_keeps_the_raw_weights(
    tmp_path: Path, mlflow_env: str, ema_decay: str
) -> None:
    from journeys.train import train_command

    make_journeys_dataset(tmp_path / "journeys", n=300, seed=2)
    config = tiny_config(
        tmp_path,
        mlflow_env,
        "train.max_epochs=2",
        "train.baselines=[]",
        f"train.ema_decay={ema_decay}",
    )
    with contextlib.redirect_stdout(io.StringIO()):
        result = train_command(config)
    last = torch.load(Path(result.checkpoint).parent / "last.ckpt", weights_only=True)
    best = torch.load(result.checkpoint, weights_only=True)["state_dict"]
    from journeys.trained_model import load_model

    shipped = load_model(result.model_uri, mlflow_env).model.state_dict()
    for name, value in shipped.items():  # the shipped model is the best checkpoint
        assert torch.equal(value, best[f"model.{name}"]), name
    if ema_decay == "null":
        assert "current_model_state" not in last
        return
    raw, average = last["current_model_state"], last["state_dict"]
    weight = "model.head.weight"
    assert not torch.equal(raw[weight], average[weight])  # two sets of weights kept


def test_missing_dataset_fails_before_any_compute(tmp_path: Path, mlflow_env: str) -> None:
    from journeys.train import train_command

    config = tiny_config(tmp_path, mlflow_env)
    with pytest.raises(InputError, match="journeys ingest"):
        train_command(config)
    assert not (tmp_path / "checkpoints").exists()


def test_lr_schedule_warms_up_then_decays() -> None:
    from journeys.lightning_parts import lr_factor

    warm = [lr_factor(s, 10, 100, "inverse_sqrt") for s in range(10)]
    assert warm == sorted(warm) and warm[-1] == 1.0
    assert lr_factor(39, 10, 100, "inverse_sqrt") == pytest.approx(0.5)  # sqrt(10 / 40)
    cosine = [lr_factor(s, 10, 100, "cosine") for s in range(10, 101)]
    assert cosine == sorted(cosine, reverse=True)
    assert cosine[-1] == pytest.approx(0.1)


def test_loss_uses_label_smoothing_and_pos_weight() -> None:
    from journeys.encoding import JourneyBatch
    from journeys.lightning_parts import JourneyModule
    from journeys.model import ModelConfig

    settings = load_config(None, ["train.label_smoothing=0.2", "train.pos_weight=3"]).train
    module = JourneyModule(
        ModelConfig(vocab_size=5, d_model=8, n_heads=2, n_layers=1, dropout=0.0), settings
    )
    module.log = lambda *args, **kwargs: None  # no Trainer attached
    batch = JourneyBatch(
        tokens=torch.tensor([[2, 3], [4, 0]]),
        features=torch.zeros(2, 0, 2, dtype=torch.long),
        time_buckets=torch.tensor([[1, 2], [1, 0]]),
        mask=torch.tensor([[True, True], [True, False]]),
        labels=torch.tensor([1.0, 0.0]),
        index=torch.arange(2),
        continuous=torch.randn(2, module.model.config.n_continuous, 2),  # time encodings
    )
    logits = module._logits(batch)
    expected = torch.nn.functional.binary_cross_entropy_with_logits(
        logits, torch.tensor([0.9, 0.1]), pos_weight=torch.tensor(3.0)
    )
    assert module.training_step(batch, 0).item() == pytest.approx(expected.item())

    # The head starts at the prior's log-odds (shifted by pos_weight), not at p = 0.5.
    module = JourneyModule(
        ModelConfig(vocab_size=5, d_model=8, n_heads=2, n_layers=1), settings, 0.1
    )
    assert module.model.head.bias.item() == pytest.approx(math.log(0.1 / 0.9) + math.log(3))


def test_negative_sampling_draws_other_negatives_each_epoch_and_stays_calibrated(
    tmp_path: Path, mlflow_env: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning as L

    from journeys import train
    from journeys.encoding import fraction_of_negatives
    from journeys.trained_model import load_model

    make_journeys_dataset(tmp_path / "journeys", n=600, seed=4)
    config = tiny_config(
        tmp_path,
        mlflow_env,
        "train.positive_share=0.8",
        "train.min_steps=0",  # 600 journeys: any step floor would keep every negative
        "train.max_epochs=15",
        "train.patience=15",
        "train.lr=0.03",
        "train.ema_decay=null",
        "train.baselines=[]",
    )
    seen: dict[int, set[int]] = {}

    class Record(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            seen.setdefault(trainer.current_epoch, set()).update(batch.index.tolist())

    add_callback(monkeypatch, Record())
    with contextlib.redirect_stdout(io.StringIO()):
        result = train.train_command(config)

    frame = pl.read_parquet(tmp_path / "journeys" / "part-00000.parquet").sort("journey_id")
    frame = frame.filter(~pl.col("censored"))  # in the order training reads them
    labels = frame.filter(pl.col("split") == "train").get_column("label").to_numpy()
    positives, negatives = set(np.flatnonzero(labels)), set(np.flatnonzero(labels == 0))
    fraction = fraction_of_negatives(len(positives), len(negatives), 0.8)
    assert 0.2 < fraction < 0.3  # this data has about 50% positives
    assert result.metrics["negative_fraction"] == pytest.approx(fraction)
    assert len(seen) == 15
    for indices in seen.values():
        assert positives <= indices  # every positive, every epoch
        assert len(indices - positives) == round(fraction * len(negatives))
    assert seen[0] != seen[1]  # a fresh draw of negatives
    # Over 15 epochs nearly every negative is drawn (all but 1.3-3.5% expected), where one
    # fixed draw would leave three quarters of them unused.
    drawn = set().union(*seen.values()) - positives
    assert drawn <= negatives and len(drawn) > 0.95 * len(negatives)

    # Batches held about 4x the odds of conversion; the loss's offset keeps the model's
    # probabilities on the full data's scale.
    rate = float(frame.get_column("label").mean())
    sampled = rate / (rate + fraction * (1 - rate))
    logits = load_model(result.model_uri, mlflow_env).predict_logits(frame)
    predicted = float(M.sigmoid(logits).mean())
    assert abs(predicted - rate) < 0.25 * (sampled - rate), (predicted, rate, sampled)


def test_step_floor_keeps_every_negative_on_small_data(tmp_path: Path, mlflow_env: str) -> None:
    from journeys import train

    make_journeys_dataset(tmp_path / "journeys", n=600, seed=4)
    overrides = ("train.positive_share=0.8", "train.max_epochs=1", "train.baselines=[]")
    # The share alone would leave ~5 steps an epoch at batch 64, far below the default floor.
    config = tiny_config(tmp_path, mlflow_env, *overrides)
    with contextlib.redirect_stdout(io.StringIO()):
        result = train.train_command(config)
    assert result.metrics["negative_fraction"] == 1.0


def test_step_floor_counts_every_rank_batch() -> None:
    from journeys.lightning_parts import min_epoch_journeys

    settings = load_config(None, ["train.min_steps=3000", "train.max_epochs=12"]).train
    assert min_epoch_journeys(settings, world_size=1) == 250 * 256  # ceil(3000 / 12) steps
    assert min_epoch_journeys(settings, world_size=4) == 4 * 250 * 256
    assert min_epoch_journeys(settings.model_copy(update={"min_steps": 0}), world_size=4) == 0


def configured_optimizer(*overrides: str) -> torch.optim.Optimizer:
    """The optimizer `JourneyModule` builds for a tiny model under these config overrides."""
    import lightning as L

    from journeys.lightning_parts import JourneyModule
    from journeys.model import ModelConfig

    settings = load_config(None, list(overrides))
    module = JourneyModule(
        ModelConfig(vocab_size=5, d_model=8, n_heads=2, n_layers=1), settings.train
    )
    module.trainer = L.Trainer(max_steps=10, logger=False, enable_checkpointing=False)
    return module.configure_optimizers()["optimizer"]


def test_optimizer_takes_the_configured_betas_and_decays_only_matrices() -> None:
    optimizer = configured_optimizer("train.adam_betas=[0.95, 0.999]", "train.weight_decay=0.2")
    assert optimizer.defaults["betas"] == (0.95, 0.999)
    decayed, undecayed = optimizer.param_groups
    assert decayed["weight_decay"] == 0.2 and all(p.dim() >= 2 for p in decayed["params"])
    assert undecayed["weight_decay"] == 0.0 and all(p.dim() < 2 for p in undecayed["params"])
    with pytest.raises(JourneysError, match="adam_betas"):
        load_config(None, ["train.adam_betas=[0.9, 1.0]"])


def test_sgd_optimizer_takes_nesterov_momentum_and_decays_only_matrices() -> None:
    optimizer = configured_optimizer(
        "train.optimizer=sgd", "train.momentum=0.8", "train.weight_decay=1e-4", "train.lr=0.5"
    )
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.defaults["momentum"] == 0.8 and optimizer.defaults["nesterov"]
    decayed, undecayed = optimizer.param_groups
    assert decayed["weight_decay"] == 1e-4 and all(p.dim() >= 2 for p in decayed["params"])
    assert undecayed["weight_decay"] == 0.0 and all(p.dim() < 2 for p in undecayed["params"])
    with pytest.raises(JourneysError, match="momentum"):
        load_config(None, ["train.momentum=1.0"])


def test_ece_and_temperature_scaling() -> None:
    rng = np.random.default_rng(0)
    true_logits = rng.normal(0, 2, 20_000)
    labels = (rng.random(true_logits.size) < M.sigmoid(true_logits)).astype(int)
    assert M.expected_calibration_error(labels, M.sigmoid(true_logits)) < 0.02
    overconfident = 3 * true_logits
    assert M.expected_calibration_error(labels, M.sigmoid(overconfident)) > 0.05
    assert M.fit_temperature(overconfident, labels) == pytest.approx(3.0, rel=0.1)
    assert M.fit_temperature(true_logits, np.zeros_like(labels)) == 1.0  # one class: no fit
    scores = M.binary_metrics(labels, M.sigmoid(true_logits))
    bounds = {f"test_{m}_ci_{end}" for m in M.INTERVAL_METRICS for end in ("low", "high")}
    assert set(scores) == {f"test_{m}" for m in M.METRIC_NAMES} | bounds
    assert math.isnan(M.binary_metrics(np.ones(4), np.full(4, 0.5))["test_roc_auc"])


def test_code_defaults_are_those_of_conf_default_yaml() -> None:
    from journeys.config import Config

    root = Path(__file__).resolve().parents[1]
    from_yaml = load_config(root / "conf" / "default.yaml").flat()
    from_code = Config().flat()
    # The file spells the identity column mapping out; in code an empty mapping means it.
    spelled_out = {key for key in from_yaml if key.startswith("data.columns.")}
    assert from_code.keys() == from_yaml.keys() - spelled_out
    assert {key: from_code[key] for key in from_code} == {key: from_yaml[key] for key in from_code}


def test_conf_default_yaml_spells_every_key_out() -> None:
    """The file is the full reference: every key of every section is written in it (the
    features only as a comment: unset, they are those of the defaults the log has)."""
    import yaml

    from journeys.config import Config

    root = Path(__file__).resolve().parents[1]
    text = (root / "conf" / "default.yaml").read_text()
    raw = yaml.safe_load(text)
    missing = [
        f"{section}.{key}"
        for section, settings in Config()
        for key in type(settings).model_fields
        if key not in (raw.get(section) or {})
    ]
    assert missing == ["data.features"]
    assert "  # features: [channel, device]" in text


def test_gpu_config_scales_training_and_keeps_everything_else() -> None:
    root = Path(__file__).resolve().parents[1]
    default_file, gpu_file = root / "conf" / "default.yaml", root / "conf" / "gpu.yaml"
    gpu = load_config([default_file, gpu_file]).flat()
    default = load_config(default_file).flat()
    assert gpu.keys() == default.keys()
    # gpu.yaml holds only what differs: alone, it gives the same training settings.
    alone = load_config(gpu_file).flat()
    assert {k: v for k, v in alone.items() if not k.startswith("data.columns.")} == {
        k: v for k, v in gpu.items() if not k.startswith("data.columns.")
    }
    assert len(gpu_file.read_text().splitlines()) < 60
    changed = {key.split(".")[0] for key in gpu if gpu[key] != default[key]}
    assert changed == {"model", "train", "score", "orchestration"}
    assert (gpu["train.accelerator"], gpu["train.strategy"]) == ("gpu", "ddp")
    assert gpu["train.precision"] == "bf16-mixed"
    # Scoring on a GPU is host-bound: larger batches, more workers overlapping host work.
    assert gpu["score.batch_size"] > default["score.batch_size"]
    assert gpu["orchestration.max_workers"] > default["orchestration.max_workers"]


def test_later_config_files_override_earlier_ones_key_by_key(tmp_path: Path) -> None:
    first, second = tmp_path / "first.yaml", tmp_path / "second.yaml"
    first.write_text("train: {max_epochs: 3, batch_size: 32}\ndata: {features: [channel]}\n")
    second.write_text("train: {max_epochs: 5}\n")
    config = load_config([first, second], ["train.lr=0.01"])
    assert (config.train.max_epochs, config.train.batch_size) == (5, 32)  # merged, not replaced
    assert config.data.features == ["channel"] and config.train.lr == 0.01
    assert load_config([second, first]).train.max_epochs == 3
    (tmp_path / "bad.yaml").write_text("train: {max_epoch: 5}\n")
    with pytest.raises(ConfigError, match=r"train.max_epoch: unknown key"):
        load_config([first, tmp_path / "bad.yaml"])


# --- evaluation that says how much it knows ------------------------------------------------


def test_test_metrics_carry_95_percent_intervals_around_them(trained) -> None:
    result, _, uri, printed = trained
    metrics = MlflowClient(uri).get_run(result.run_id).data.metrics
    for name in ("roc_auc", "pr_auc"):
        low, high = metrics[f"test_{name}_ci_low"], metrics[f"test_{name}_ci_high"]
        assert 0 <= low < metrics[f"test_{name}"] < high <= 1, name
    # ~60 test journeys: the interval is wide, and the table shows it.
    assert metrics["test_roc_auc_ci_high"] - metrics["test_roc_auc_ci_low"] > 0.1
    assert f"[{metrics['test_roc_auc_ci_low']:.4f}," in printed
    for baseline in result.baselines.values():
        assert "test_roc_auc_ci_low" in baseline.metrics


def test_delong_interval_matches_sklearn_and_covers_the_true_auc() -> None:
    from scipy.stats import norm
    from sklearn.metrics import roc_auc_score

    rng = np.random.default_rng(0)
    true_auc = float(norm.cdf(1 / math.sqrt(2)))  # two unit normals one apart
    covered = 0
    for _ in range(200):
        labels = rng.random(1500) < 0.06
        scores = M.sigmoid(rng.normal(size=labels.size) + labels)  # AUC is rank-invariant
        metrics = M.binary_metrics(labels, scores)
        assert metrics["test_roc_auc"] == pytest.approx(roc_auc_score(labels, scores))
        low, high = M.roc_auc_interval(labels, scores)
        assert low < metrics["test_roc_auc"] < high
        covered += low <= true_auc <= high
    assert 0.9 <= covered / 200 <= 0.99
    one_class = M.binary_metrics(np.ones(5), np.linspace(0, 1, 5))
    assert math.isnan(one_class["test_roc_auc_ci_low"])


def test_delong_placements_equal_the_pairwise_comparisons_ties_included() -> None:
    rng = np.random.default_rng(1)
    labels = rng.random(700) < 0.2
    scores = np.round(rng.normal(size=labels.size) + labels, 1)  # many ties
    v10, v01 = M._placements(labels, scores)
    positives, negatives = scores[labels], scores[~labels]
    wins = (positives[:, None] > negatives[None, :]) + 0.5 * (
        positives[:, None] == negatives[None, :]
    )
    np.testing.assert_allclose(v10, wins.mean(axis=1), rtol=0, atol=1e-12)
    np.testing.assert_allclose(v01, wins.mean(axis=0), rtol=0, atol=1e-12)
    from sklearn.metrics import roc_auc_score

    assert v10.mean() == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    unordered = M._placements(labels, scores, in_order=False)[1]  # for a variance
    np.testing.assert_array_equal(np.sort(unordered), np.sort(v01))
    with_nan = np.where(np.arange(scores.size) == 3, np.nan, scores)  # ranks nowhere: no AUC
    assert all(math.isnan(x) for x in M.roc_auc_with_se(labels, with_nan))
    assert all(math.isnan(x) for x in M.paired_roc_auc_difference(labels, with_nan, scores))


def _one_class_split(folder: Path, split: str) -> None:
    """Relabel the journeys of `split` so that all of them converted."""
    part = folder / "part-00000.parquet"
    frame = pl.read_parquet(part)
    frame.with_columns(
        label=pl.when(pl.col("split") == split).then(1).otherwise(pl.col("label")).cast(pl.Int8)
    ).write_parquet(part)


@pytest.mark.parametrize("split", ["val", "test"])
def test_one_class_val_or_test_exits_2_and_registers_nothing(
    tmp_path: Path, split: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from journeys.cli import main

    make_journeys_dataset(tmp_path / "journeys", n=400, seed=0)
    _one_class_split(tmp_path / "journeys", split)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [
        f"paths.journeys={tmp_path / 'journeys'}",
        f"paths.checkpoints={tmp_path / 'checkpoints'}",
        f"mlflow.tracking_uri={uri}",
    ]
    code = main(["train", *[arg for o in overrides for arg in ("--set", o)]])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"the {split} split" in err and "one class" in err and "split.fractions" in err
    assert not (tmp_path / "mlflow.db").exists()  # nothing created, nothing registered
    assert not (tmp_path / "checkpoints").exists()


def test_a_split_setting_the_ingest_did_not_make_is_refused_naming_ingest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The split is made at ingest: a different split.fractions at train time would not
    act, and would be logged as if it had. It is refused with the command that applies it."""
    import subprocess
    import sys

    from journeys.cli import main

    raw = tmp_path / "raw"
    subprocess.run(
        [sys.executable, "-m", "journeys.cli", "simulate", "--out", str(raw), "--users", "300"],
        check=True, capture_output=True,
    )  # fmt: skip
    common = [
        f"paths.raw={raw}",
        f"paths.journeys={tmp_path / 'journeys'}",
        f"paths.quarantine={tmp_path / 'quarantine'}",
        f"paths.checkpoints={tmp_path / 'checkpoints'}",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
    ]

    def command(name: str, *extra: str) -> int:
        return main([name, *[arg for o in (*common, *extra) for arg in ("--set", o)]])

    assert command("ingest") == 0
    capsys.readouterr()
    assert command("train", "split.fractions=[0.5, 0.25, 0.25]") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "split.fractions is 0.5/0.25/0.25 but the journeys" in err
    assert "were split 0.7/0.15/0.15 at ingest" in err
    assert "`journeys ingest --full --set split.fractions=[0.5, 0.25, 0.25]`" in err
    assert not (tmp_path / "mlflow.db").exists()  # nothing logged as if it had acted


def test_few_evaluation_conversions_and_a_warmup_longer_than_the_run_warn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from journeys.datasets import check_trainable, evaluation_warnings
    from journeys.lightning_parts import step_schedule
    from journeys.train import describe_schedule

    make_journeys_dataset(tmp_path / "journeys", n=150, seed=0)
    sizes = check_trainable(tmp_path / "journeys", ["channel", "device"], (0.7, 0.15, 0.15))
    warnings = evaluation_warnings(sizes)
    assert sizes["test"]["positives"] < 30 and any("the test split holds" in w for w in warnings)
    assert all("fewer than 30" in w for w in warnings)
    overrides = ["train.warmup_steps=100", "train.max_epochs=3"]
    settings = load_config(None, overrides).train
    describe_schedule(settings, step_schedule(settings, 256, 1))  # 1 step an epoch: 3 steps
    err = capsys.readouterr().err
    assert "train.warmup_steps (100) is longer than the whole run (3 optimiser steps)" in err
    describe_schedule(settings, step_schedule(settings, 256 * 100, 1))  # 300 steps: fine
    assert capsys.readouterr().err == ""


def test_the_schedule_gives_small_logs_their_steps_and_leaves_large_ones_alone() -> None:
    """Counted in optimiser steps: a few hundred journeys get smaller batches and more
    epochs until they make `train.min_steps`; a large log keeps the configured ones."""
    from journeys.lightning_parts import step_schedule

    settings = load_config(None, ["train.step_floor=600"]).train  # batch 256, 12 epochs
    for journeys in (400_000 * 0.2, 14_000):  # the demo's 20k users: 55 batches an epoch
        schedule = step_schedule(settings, journeys, world_size=1)
        assert (schedule.batch_size, schedule.epochs, schedule.val_every_epochs) == (256, 12, 1)
    # A log that makes the floor's steps at the configured batch keeps it (15 batches of
    # 256 an epoch, 12 epochs: 180 steps), rather than batches a little smaller for as many.
    enough = step_schedule(settings.model_copy(update={"step_floor": 180}), 3_668, world_size=1)
    assert (enough.batch_size, enough.steps_per_epoch, enough.epochs) == (256, 15, 12)
    medium = step_schedule(settings, 5_000, world_size=1)  # smaller batches suffice
    assert medium.batch_size == 100 and medium.epochs == 12 and medium.steps >= 600
    small = step_schedule(settings, 150, world_size=1)  # the old rule: 1 batch, 12 steps
    assert (small.batch_size, small.steps_per_epoch, small.epochs) == (32, 5, 120)
    assert small.val_every_epochs == 10  # 12 validations, as many as a large log's
    two_ranks = step_schedule(settings, 150, world_size=2)  # a step takes both ranks' batch
    assert two_ranks.steps_per_epoch == 3 and two_ranks.steps >= 600


def test_a_stop_signal_during_a_fit_waits_for_the_batch_under_way() -> None:
    """SIGTERM during a fit is held until the batch under way ends (never raised inside a
    write to the run's store), a second one stops at once, and the handlers come back."""
    import signal

    from journeys.errors import Interrupted
    from journeys.lightning_parts import StopBetweenSteps

    before = signal.getsignal(signal.SIGTERM)
    stop = StopBetweenSteps()
    stop.setup(None, None, "fit")  # type: ignore[arg-type]
    assert signal.getsignal(signal.SIGTERM) == stop._signalled
    stop._signalled(signal.SIGTERM, None)  # what the signal does: nothing raised yet
    with pytest.raises(Interrupted) as stopped:
        stop.on_train_batch_end()
    assert stopped.value.exit_code == 143
    stop.on_validation_batch_end()  # Lightning's teardown after the stop: not raised twice
    with pytest.raises(Interrupted):
        stop._signalled(signal.SIGTERM, None)  # a second signal: at once
    stop.teardown(None, None, "fit")  # type: ignore[arg-type]
    assert signal.getsignal(signal.SIGTERM) == before

    late = StopBetweenSteps()  # a signal after the last batch: the fit still stops
    late.setup(None, None, "fit")  # type: ignore[arg-type]
    late._signalled(signal.SIGINT, None)
    with pytest.raises(Interrupted) as stopped:
        late.teardown(None, None, "fit")  # type: ignore[arg-type]
    assert stopped.value.exit_code == 130 and signal.getsignal(signal.SIGTERM) == before

    # Put back after the fit stopped (Lightning restores what it found): the handler from
    # before the fit gets the signal.
    got = []
    signal.signal(signal.SIGUSR1, lambda signum, _frame: got.append(signum))
    left = StopBetweenSteps()
    left.previous = {signal.SIGUSR1: signal.getsignal(signal.SIGUSR1)}
    signal.signal(signal.SIGUSR1, left._signalled)
    try:
        signal.raise_signal(signal.SIGUSR1)
        assert got == [signal.SIGUSR1] and left.signum is None
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


@pytest.mark.slow
def test_train_stopped_by_sigterm_exits_143_and_marks_its_run_killed(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    make_journeys_dataset(tmp_path / "journeys", n=400, seed=0)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    overrides = [
        *TINY,
        f"paths.journeys={tmp_path / 'journeys'}",
        f"paths.checkpoints={tmp_path / 'checkpoints'}",
        f"mlflow.tracking_uri={uri}",
        "train.max_epochs=1000",
        "train.patience=1000",
        "train.baselines=[]",
    ]
    command = [sys.executable, "-m", "journeys.cli", "train"]
    command += [arg for o in overrides for arg in ("--set", o)]
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    child = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 120
        # The last checkpoint appears after the first epoch: the fit is under way.
        while not list((tmp_path / "checkpoints").glob("*/last.ckpt")):
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "training never started"
            time.sleep(0.2)
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 143, err.decode()[-2000:]
    assert "stopped (SIGTERM)" in err.decode()
    state = json.loads((tmp_path / "checkpoints" / "latest.json").read_text())
    run = MlflowClient(uri).get_run(state["run_id"])
    assert run.info.status == "KILLED"
    assert not MlflowClient(uri).search_registered_models()


def test_a_log_that_is_not_a_terminal_gets_a_line_per_epoch(trained) -> None:
    """Captured output is no terminal: no progress bar, one line per validated epoch with
    its figures (a scheduled run's log shows progress as it goes)."""
    printed = trained[3]
    lines = [line for line in printed.splitlines() if line.startswith("epoch ")]
    assert lines and all("val_roc_auc" in line for line in lines)
    # Validated every few epochs here (a small log's step schedule): the last one ends it.
    assert re.match(r"epoch \d+/\d+: .*\(\d+ s\)$", lines[0])


def test_piecewise_inputs_train_with_edges_fitted_on_the_train_split(
    tmp_path: Path, mlflow_env: str
) -> None:
    """`model.continuous_encoding: piecewise`: training fits each continuous input's bin
    edges on the train split's events, and the saved model carries them."""
    from journeys import train
    from journeys.lightning_parts import JourneyDataModule
    from journeys.model import PiecewiseLinearInputs
    from journeys.trained_model import load_model
    from journeys.vocab import Vocabularies

    make_learnable_journeys(tmp_path / "journeys", n=300, seed=1)
    overrides = (
        "model.time_encodings=true",
        "model.continuous_encoding=piecewise",
        "model.continuous_bins=8",
        "train.max_epochs=1",
        "train.baselines=[]",
        "promotion.min_val_conversions=1",
    )
    config = tiny_config(tmp_path, mlflow_env, *overrides)
    with contextlib.redirect_stdout(io.StringIO()):
        result = train.train_command(config)
    served = load_model(result.model_uri, mlflow_env).model
    assert isinstance(served.continuous_projection, PiecewiseLinearInputs)

    vocabs = Vocabularies.load(config.paths.journeys)
    data = JourneyDataModule.from_config(config, vocabs, 1.0)
    data.setup()
    train_inputs = data.splits["train"].continuous
    assert train_inputs is not None
    expected = PiecewiseLinearInputs(served.config)
    expected.fit_edges(train_inputs)
    torch.testing.assert_close(served.continuous_projection.edges, expected.edges)
    assert not torch.equal(expected.edges[0], torch.linspace(0, 1, 9))  # not the placeholder

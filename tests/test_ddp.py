"""Two-process DDP on CPU (gloo), started as its own process like a user would.

`strategy=ddp` re-launches `sys.argv` once per extra rank, so it cannot run inside pytest:
the test runs `python -m journeys.cli train` in a subprocess and checks what it left.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import make_journeys_dataset
from mlflow import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 2


def ddp_config(tmp_path: Path, folder: Path, uri: str) -> None:
    """config.yaml in `tmp_path`: a tiny model, 2 epochs, both ranks drawing alike."""
    config = {
        "paths": {"journeys": str(folder), "checkpoints": str(tmp_path / "checkpoints")},
        "model": {"d_model": 16, "n_heads": 2, "n_layers": 1, "dropout": 0.0},
        "train": {
            "max_epochs": EPOCHS,
            "batch_size": 32,
            "warmup_steps": 2,
            "baselines": ["prior"],
            # Negative sampling rebuilds the train loader every epoch: both ranks must draw
            # the same journeys and run as many steps, or DDP waits forever (timeout below).
            "positive_share": 0.7,
            "min_steps": 0,
        },
        "mlflow": {"tracking_uri": uri},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))


def ddp_env() -> dict[str, str]:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "OMP_NUM_THREADS": "1",  # two ranks on two cores
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


@pytest.mark.slow
def test_torchrun_on_a_new_tracking_store_makes_one_run_and_one_version(tmp_path: Path) -> None:
    """torchrun starts `journeys train` once per rank: only rank 0 may touch the store (two
    ranks creating a new SQLite store's tables at once failed 3 times of 3) or the lock."""
    folder = make_journeys_dataset(tmp_path / "journeys", n=300, seed=3)
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"  # not there yet
    ddp_config(tmp_path, folder, uri)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["-m", "journeys.cli", "train", "--config", "config.yaml"]
    command += ["--set", "train.devices=2", "--set", "train.strategy=ddp"]
    command += ["--set", "train.accelerator=cpu"]
    done = subprocess.run(
        command, cwd=tmp_path, env=ddp_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(uri)
    runs = client.search_runs(client.search_experiments()[0].experiment_id)
    assert sorted(r.data.tags["model_family"] for r in runs) == ["baseline_prior", "transformer"]
    assert len(client.search_model_versions()) == 1


@pytest.mark.slow
def test_two_process_ddp_logs_one_run_with_synced_metrics(tmp_path: Path) -> None:
    from torchmetrics.classification import BinaryAUROC

    from journeys.inference import run_model
    from journeys.lightning_parts import JourneyDataModule
    from journeys.model import JourneyTransformer
    from journeys.trained_model import load_model
    from journeys.vocab import Vocabularies

    folder = make_journeys_dataset(tmp_path / "journeys", n=300, seed=3)
    n_val = pl.read_parquet(folder / "part-00000.parquet").filter(pl.col("split") == "val").height
    assert n_val % 2 == 0, "an even val split: DistributedSampler then repeats no journey"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ddp_config(tmp_path, folder, uri)
    env = ddp_env()
    command = [sys.executable, "-m", "journeys.cli", "train", "--config", "config.yaml"]
    command += ["--set", "train.devices=2", "--set", "train.strategy=ddp"]
    command += ["--set", "train.accelerator=cpu"]
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("Test metrics") == 1  # rank 0 alone prints the comparison

    client = MlflowClient(uri)
    runs = client.search_runs(client.search_experiments()[0].experiment_id)
    transformer = [r for r in runs if r.data.tags["model_family"] == "transformer"]
    assert len(transformer) == 1 and len(runs) == 2  # + baseline_prior
    run_id = transformer[0].info.run_id
    val_auc = client.get_metric_history(run_id, "val_roc_auc")
    val_loss = client.get_metric_history(run_id, "val_loss")
    assert len(val_auc) == len(val_loss) == EPOCHS  # logged once per epoch, by rank 0

    # The last checkpoint loads (safely) and, scored on the whole val split in one
    # process, reproduces the last epoch's logged metrics: both ranks' halves were synced.
    state = torch.load(
        tmp_path / "checkpoints" / run_id / "last.ckpt", map_location="cpu", weights_only=True
    )
    weights = {k.removeprefix("model."): v for k, v in state["state_dict"].items()}
    vocabs = Vocabularies.load(folder)
    model_config = load_model(f"runs:/{run_id}/model", tracking_uri=uri).config
    model = JourneyTransformer(model_config)
    model.load_state_dict(weights)
    datamodule = JourneyDataModule(folder, vocabs, max_len=64)  # the default time encodings
    datamodule.setup()
    val = datamodule.splits["val"]
    logits = run_model(model, val, batch_size=1024).logits
    probs = torch.sigmoid(torch.from_numpy(logits))  # float32, as in training: same ties

    def auc(rows: slice) -> float:
        return BinaryAUROC()(probs[rows], val.labels[rows].long()).item()

    def loss(rows: slice) -> float:
        return F.binary_cross_entropy(probs[rows], val.labels[rows]).item()

    assert val_auc[-1].value == pytest.approx(auc(slice(None)), abs=1e-6)
    assert val_loss[-1].value == pytest.approx(loss(slice(None)), abs=1e-5)
    # Rank 0 alone saw every other journey (DistributedSampler without shuffling):
    # unsynced, it would have logged these instead.
    assert val_auc[-1].value != pytest.approx(auc(slice(0, None, 2)), abs=1e-6)
    assert val_loss[-1].value != pytest.approx(loss(slice(0, None, 2)), abs=1e-5)
    assert np.isfinite(transformer[0].data.metrics["test_roc_auc"])

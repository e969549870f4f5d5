"""Shared test fixtures: tiny journeys datasets and an isolated MLflow store.

`make_journeys_dataset` writes a journeys folder in the ingest schema (docs/contract.md, journeys) from
random journeys with a learnable signal, so training tests need neither the simulator
nor ingest. Runs in well under a second for a few hundred journeys.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import polars as pl
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `pytest` (not `python -m pytest`) does not add the checkout
    sys.path.insert(0, str(ROOT))

from flows.prefect_server import free_port  # noqa: E402, F401  (for the tests' servers)
from journeys.vocab import Vocabularies, Vocabulary  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with the most `slow` tests run first, each module kept whole (its fixtures
    are set up once): spread over workers (`make test` runs `pytest -n`), the long modules
    start early instead of leaving one worker alone with them at the end."""
    slow: dict[object, int] = {}
    for item in items:
        module = getattr(item, "module", None)
        slow[module] = slow.get(module, 0) + bool(item.get_closest_marker("slow"))
    items.sort(
        key=lambda item: -slow[getattr(item, "module", None)]
    )  # stable: same order within a module


EVENT_TYPES = ("impression", "click", "search", "view_product", "add_to_cart", "email_open")
CHANNELS = ("display", "search", "social", "email", "direct")
DEVICES = ("mobile", "desktop", "tablet")
T0 = datetime(2026, 1, 1, tzinfo=UTC)
SPAN_DAYS = 60
COLUMNS = [
    *("journey_id", "user_id", "start_time", "end_time", "n_events", "n_events_total"),
    *("label", "censored", "split", "event_type", "event_time", "channel", "device"),
]
CENSOR_DAYS = 2  # unconverted journeys ending this close to the data's end are censored


def _journey(rng: np.random.Generator, index: int) -> dict:
    n = int(min(1 + rng.geometric(0.25), 20))
    intent = rng.random()  # latent: high-intent users browse deeper and convert more
    deep = np.array([0.25, 0.2, 0.15, 0.2, 0.1, 0.1]) + intent * np.array(
        [-0.2, 0, 0, 0.05, 0.2, -0.05]
    )
    events = list(rng.choice(EVENT_TYPES, size=n, p=deep / deep.sum()))
    channels = list(rng.choice(CHANNELS, size=n))
    devices = list(rng.choice(DEVICES, size=n))
    start = T0 + timedelta(days=float(rng.uniform(0, SPAN_DAYS - 3)))
    gaps = np.cumsum(rng.exponential(3600.0, size=n)) - 3600.0
    times = [start + timedelta(seconds=float(max(g, 0.0))) for g in np.sort(gaps)]
    score = -2.2 + 2.0 * ("add_to_cart" in events) + 0.8 * (channels[-1] == "email") + 1.5 * intent
    label = int(rng.random() < 1 / (1 + np.exp(-score)))
    return {
        "journey_id": f"u{index}-{int(times[0].timestamp() * 1e6)}",
        "user_id": f"u{index}",
        "start_time": times[0],
        "end_time": times[-1],
        "n_events": n,
        "n_events_total": n + int(rng.random() < 0.05),  # a few were truncated
        "label": label,
        "event_type": [str(e) for e in events],
        "event_time": times,
        "channel": [str(c) for c in channels],
        "device": [str(d) for d in devices],
    }


def make_journeys_dataset(folder: str | Path, n: int = 400, seed: int = 0) -> Path:
    """Write `part-00000.parquet` (as ingest names it), `vocab.json` and `ingest_report.json`."""
    rng = np.random.default_rng(seed)
    frame = pl.DataFrame(
        [_journey(rng, i) for i in range(n)],
        schema={
            "journey_id": pl.String,
            "user_id": pl.String,
            "start_time": pl.Datetime("us", "UTC"),
            "end_time": pl.Datetime("us", "UTC"),
            "n_events": pl.Int32,
            "n_events_total": pl.Int32,
            "label": pl.Int8,
            "event_type": pl.List(pl.String),
            "event_time": pl.List(pl.Datetime("us", "UTC")),
            "channel": pl.List(pl.String),
            "device": pl.List(pl.String),
        },
    ).sort("end_time")
    data_end = frame.get_column("end_time").max()
    censored = (pl.col("label") == 0) & (
        pl.col("end_time") > data_end - timedelta(days=CENSOR_DAYS)
    )
    frame = frame.with_columns(censored=censored)
    # Time-ordered split of the uncensored journeys: 70 / 15 / 15 by end time.
    rank = pl.when(~pl.col("censored")).then(pl.col("censored").not_().cum_sum())
    n_known = frame.height - int(frame.get_column("censored").sum())
    frame = frame.with_columns(
        split=pl.when(pl.col("censored"))
        .then(pl.lit("none"))
        .when(rank <= 0.7 * n_known)
        .then(pl.lit("train"))
        .when(rank <= 0.85 * n_known)
        .then(pl.lit("val"))
        .otherwise(pl.lit("test"))
    ).select(COLUMNS)

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    frame.write_parquet(folder / "part-00000.parquet")
    train = frame.filter(pl.col("split") == "train")
    vocabs = {}
    for column in ("event_type", "channel", "device"):
        counts = (
            train.select(pl.col(column).explode().alias("token")).group_by("token").len("count")
        )
        vocabs[column] = Vocabulary.from_counts(counts, min_count=1)
    Vocabularies(by_column=vocabs, min_count=1).save(folder)

    events = int(frame.get_column("n_events").sum())
    splits = frame.group_by("split").len().rows()
    report = {
        "rows_read": events + int(frame.get_column("label").sum()),
        "rows_valid": events + int(frame.get_column("label").sum()),
        "quarantined": {},
        "quarantined_total": 0,
        "duplicates_dropped": 0,
        "dropped_by_config": 0,
        "journeys": frame.height,
        "journeys_converted": int(frame.get_column("label").sum()),
        "journeys_censored": int(frame.get_column("censored").sum()),
        "journeys_by_split": dict(splits),
    }
    (folder / "ingest_report.json").write_text(json.dumps(report, indent=2))
    return folder


def make_learnable_journeys(folder: str | Path, n: int = 400, seed: int = 0) -> Path:
    """`make_journeys_dataset`, relabelled so that a journey with a cart converts (90%)
    and one without does not (10%): a rule any model that learns picks up from a few
    hundred journeys, so the champion guard (`journeys.promotion`) promotes it."""
    folder = make_journeys_dataset(folder, n=n, seed=seed)
    part = Path(folder) / "part-00000.parquet"
    frame = pl.read_parquet(part)
    rng = np.random.default_rng(seed)
    cart = frame.get_column("event_type").list.contains("add_to_cart").to_numpy()
    label = (rng.random(frame.height) < np.where(cart, 0.9, 0.1)).astype(np.int8)
    frame.with_columns(label=pl.Series(label)).write_parquet(part)
    return Path(folder)


def make_reversed_journeys(folder: str | Path, n: int = 1200, seed: int = 0) -> Path:
    """`make_learnable_journeys` whose rule turns around after the train split: a cart
    converts in train and does not in val and test (the shape of a real touchpoint log
    whose val AUC peaked at the first epoch and fell below chance as the model learned).
    Whatever learns train ranks val below chance."""
    folder = make_journeys_dataset(folder, n=n, seed=seed)
    part = Path(folder) / "part-00000.parquet"
    frame = pl.read_parquet(part)
    rng = np.random.default_rng(seed)
    cart = frame.get_column("event_type").list.contains("add_to_cart").to_numpy()
    later = frame.get_column("split").is_in(["val", "test"]).to_numpy()
    rate = np.where(cart != later, 0.6, 0.05)
    label = (rng.random(frame.height) < rate).astype(np.int8)
    frame.with_columns(label=pl.Series(label)).write_parquet(part)
    return Path(folder)


@pytest.fixture
def mlflow_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh SQLite tracking store in tmp_path, with artifacts and cwd there too."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    return uri

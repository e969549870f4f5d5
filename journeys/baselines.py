"""Baselines the transformer must beat, scored on the same test split and logged beside it.

- `prior`: the train base rate for every journey.
- `last_touch`: the train conversion rate of the journey's last event type (and channel),
  shrunk towards the base rate for rarely seen keys.
- `logreg`, `hgb`: logistic regression and histogram gradient boosting on bag-of-events
  counts: event types, feature values, optionally event bigrams, plus the true length.

Each is its own MLflow run in the same experiment, tagged `model_family=baseline_<name>`,
with the same `test_*` metrics and plots as the transformer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from journeys.datasets import MISSING_VALUE
from journeys.errors import run_status

if TYPE_CHECKING:
    from scipy.sparse import csr_matrix

    from journeys.config import Config

BASELINES = ("logreg", "hgb", "last_touch", "prior")
# Pseudo-count of train journeys at the base rate added to every last-touch key, so a key
# seen twice with one conversion does not predict 50 %.
LAST_TOUCH_PSEUDO_COUNT = 20.0
# Feature columns last-touch keys on, when configured (the classic "last click" view).
LAST_TOUCH_FEATURES = ("channel",)
# Gradient boosting needs dense input: keep the most frequent train tokens only.
MAX_DENSE_COLUMNS = 1024


@dataclass(frozen=True)
class BaselineResult:
    name: str
    run_id: str | None
    metrics: dict[str, float]
    probs: np.ndarray


# ----------------------------------------------------------------------------- features


def token_counts(frame: pl.DataFrame, features: list[str], bigrams: bool) -> pl.DataFrame:
    """Long format (row, token, count): one row per journey and distinct token in it.

    Tokens are `event_type=click`, `channel=email`, ... and, with `bigrams`,
    `bigram=click>view`. Built with explode + group_by: no Python loop over events.
    """
    columns = ["event_type", *features]
    events = (
        frame.select(pl.int_range(pl.len(), dtype=pl.UInt32).alias("row"), *columns)
        .explode(columns)  # the lists of one journey have equal lengths: exploded in parallel
        .filter(pl.col("event_type").is_not_null())  # an empty journey explodes to one null
    )
    parts = [
        events.select("row", token=pl.lit(f"{c}=") + pl.col(c).fill_null(MISSING_VALUE))
        for c in columns
    ]
    if bigrams:
        following = pl.col("event_type").shift(-1).over("row")
        parts.append(
            events.select(
                "row", token=pl.lit("bigram=") + pl.col("event_type") + ">" + following
            ).drop_nulls("token")
        )
    return pl.concat(parts).group_by("row", "token").agg(count=pl.len())


class BagOfEvents:
    """Journeys -> sparse count matrix over the tokens seen in train (+ log true length)."""

    def __init__(self, features: list[str], bigrams: bool, max_columns: int | None = None):
        self.features = features
        self.bigrams = bigrams
        self.max_columns = max_columns
        self.columns: pl.DataFrame | None = None  # token -> column index

    def fit(self, frame: pl.DataFrame) -> BagOfEvents:
        counts = token_counts(frame, self.features, self.bigrams)
        totals = counts.group_by("token").agg(total=pl.col("count").sum())
        totals = totals.sort(["total", "token"], descending=[True, False])  # deterministic
        if self.max_columns is not None:
            totals = totals.head(self.max_columns)
        self.columns = totals.select("token", col=pl.int_range(pl.len(), dtype=pl.UInt32))
        return self

    @property
    def n_columns(self) -> int:
        assert self.columns is not None, "fit first"
        return self.columns.height + 1  # the last column is log1p(n_events_total)

    def transform(self, frame: pl.DataFrame) -> csr_matrix:
        from scipy import sparse

        assert self.columns is not None, "fit first"
        counts = token_counts(frame, self.features, self.bigrams).join(self.columns, on="token")
        rows = counts.get_column("row").to_numpy()
        cols = counts.get_column("col").to_numpy()
        # log1p: the tenth view of a page says less than the first.
        values = np.log1p(counts.get_column("count").to_numpy().astype(np.float32))
        length = np.log1p(frame.get_column("n_events_total").to_numpy().astype(np.float32))
        n = frame.height
        rows = np.concatenate([rows, np.arange(n)])
        cols = np.concatenate([cols, np.full(n, self.n_columns - 1)])
        values = np.concatenate([values, length])
        return sparse.csr_matrix((values, (rows, cols)), shape=(n, self.n_columns))


# ----------------------------------------------------------------------------- models


def _labels(frame: pl.DataFrame) -> np.ndarray:
    return frame.get_column("label").cast(pl.Int64).to_numpy()


def prior(train: pl.DataFrame, test: pl.DataFrame, **_) -> np.ndarray:
    return np.full(test.height, float(_labels(train).mean()))


def last_touch(train: pl.DataFrame, test: pl.DataFrame, features: list[str], **_) -> np.ndarray:
    keys = ["event_type", *[f for f in LAST_TOUCH_FEATURES if f in features]]
    last = [pl.col(k).list.last().fill_null(MISSING_VALUE).alias(k) for k in keys]
    base_rate = float(_labels(train).mean())
    rates = (
        train.select(*last, "label")
        .group_by(keys)
        .agg(n=pl.len(), positives=pl.col("label").cast(pl.Float64).sum())
        .with_columns(
            rate=(pl.col("positives") + LAST_TOUCH_PSEUDO_COUNT * base_rate)
            / (pl.col("n") + LAST_TOUCH_PSEUDO_COUNT)
        )
    )
    scored = (
        test.select(*last)
        .with_row_index("_row")
        .join(rates.select(*keys, "rate"), on=keys, how="left")
        .sort("_row")  # joins do not keep order
    )
    return scored.get_column("rate").fill_null(base_rate).to_numpy()


def logreg(
    train: pl.DataFrame, test: pl.DataFrame, features: list[str], bigrams: bool, seed: int
) -> np.ndarray:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import MaxAbsScaler

    bag = BagOfEvents(features, bigrams).fit(train)
    model = make_pipeline(MaxAbsScaler(), LogisticRegression(max_iter=2000, random_state=seed))
    model.fit(bag.transform(train), _labels(train))
    return model.predict_proba(bag.transform(test))[:, 1]


def hgb(
    train: pl.DataFrame, test: pl.DataFrame, features: list[str], bigrams: bool, seed: int
) -> np.ndarray:
    from sklearn.ensemble import HistGradientBoostingClassifier

    bag = BagOfEvents(features, bigrams, max_columns=MAX_DENSE_COLUMNS).fit(train)
    model = HistGradientBoostingClassifier(max_iter=200, early_stopping=True, random_state=seed)
    model.fit(bag.transform(train).toarray(), _labels(train))
    return model.predict_proba(bag.transform(test).toarray())[:, 1]


PREDICTORS: dict[str, Callable[..., np.ndarray]] = {
    "logreg": logreg,
    "hgb": hgb,
    "last_touch": last_touch,
    "prior": prior,
}


def fit_predict(
    name: str,
    train: pl.DataFrame,
    test: pl.DataFrame,
    features: list[str],
    bigrams: bool = False,
    seed: int = 0,
) -> np.ndarray:
    """Fit baseline `name` on `train`, return conversion probabilities for `test`."""
    return PREDICTORS[name](train, test, features=features, bigrams=bigrams, seed=seed)


# ----------------------------------------------------------------------------- runs


def run_baselines(
    names: list[str],
    train: pl.DataFrame,
    test: pl.DataFrame,
    config: Config,
    experiment_id: str,
    workdir: Path,
    tags: dict[str, str] | None = None,
) -> list[BaselineResult]:
    """Fit, score and log each baseline as its own MLflow run; return their test metrics."""
    from mlflow import MlflowClient

    from journeys import metrics as M
    from journeys import plots, tracking

    client = MlflowClient(tracking_uri=tracking.tracking_uri(config))
    labels = _labels(test)
    results = []
    for name in names:
        print(f"baseline {name}: fitting on {train.height:,} train journeys")
        probs = fit_predict(
            name, train, test, config.data.features, config.train.bigrams, config.train.seed
        )
        scores = M.binary_metrics(labels, probs)
        family = f"baseline_{name}"
        run = client.create_run(
            experiment_id,
            run_name=family,
            tags={tracking.MODEL_FAMILY_TAG: family, **(tags or {})},
        )
        run_id = run.info.run_id
        try:
            tracking.log_config(client, run_id, config)
            tracking.log_ingest_report(client, run_id, config.paths.journeys)
            tracking.log_metrics(
                client, run_id, {**scores, "n_train": train.height, "n_test": test.height}
            )
            folder = workdir / family
            for plot in (plots.plot_roc, plots.plot_pr, plots.plot_calibration):
                path = plot(labels, {family: probs}, folder / f"{plot.__name__[5:]}.png")
                client.log_artifact(run_id, str(path), "plots")
        except BaseException as err:
            client.set_terminated(run_id, run_status(err))
            raise
        client.set_terminated(run_id, "FINISHED")
        results.append(BaselineResult(name, run_id, scores, probs))
    return results

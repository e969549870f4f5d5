"""Baselines the transformer must beat, scored on the same test split and logged beside it.

- `prior`: the train base rate for every journey.
- `last_touch`: the train conversion rate of the journey's last event type (and channel),
  shrunk towards the base rate for rarely seen keys.
- `logreg`, `hgb`: logistic regression and histogram gradient boosting on bag-of-events
  counts: event types, feature values, optionally event bigrams, plus the true length.
- `hgb_aggregates`: the strong one, gradient boosting on what a practitioner would build
  per journey (the aggregation encoding of Teinemaa et al., 2019): the counts above, the
  number of visits, the duration, the gaps between touches (mean, shortest, longest,
  last), hour of day and weekday of the first and last event, the last touch itself, and
  each numeric feature's mean, minimum, maximum, last value, sum and missing count.

The per-event columns come typed (`journeys.inputs`): the categorical ones are tokens for
the bag of events and the last touch, and each column adds its own aggregates to
`hgb_aggregates` (a number its `journeys.inputs.NUMERIC_AGGREGATES`).

Each is its own MLflow run in the same experiment, tagged `model_family=baseline_<name>`,
with the same `test_*` metrics and plots as the transformer, and each fitted model is a
candidate for the champion (`journeys.promotion`): its fitted state is JSON values plus,
for the boosted ones, the trees scikit-learn fitted, held and evaluated by Treelite (`Trees`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, get_args

import numpy as np
import polars as pl

from journeys.config import BaselineName
from journeys.datasets import MISSING_VALUE
from journeys.inputs import (
    KINDS,
    CategoricalInput,
    EventInput,
    NumericInput,
    columns_from_names,
    columns_of,
    names_by_setting,
)

if TYPE_CHECKING:
    import treelite
    from scipy.sparse import csr_matrix
    from sklearn.ensemble import HistGradientBoostingClassifier

    from journeys.config import Config

BASELINES: tuple[str, ...] = get_args(BaselineName)
# The keys that name the per-event columns in saved settings, one per kind of column.
KIND_SETTINGS = {kind.setting for kind in KINDS}
# Pseudo-count of train journeys at the base rate added to every last-touch key, so a key
# seen twice with one conversion does not predict 50 %.
LAST_TOUCH_PSEUDO_COUNT = 20.0
# Feature columns last-touch keys on, when configured (the classic "last click" view).
LAST_TOUCH_FEATURES = ("channel",)
# Gradient boosting needs dense input: keep the most frequent train tokens only.
MAX_DENSE_COLUMNS = 1024
HGB_MAX_ITER = 200  # boosting rounds at most; early stopping on 10% of train picks fewer
# Categorical columns of gradient boosting take at most 255 levels (its bins): the rarer
# train levels of a last-touch column are treated as missing.
MAX_CATEGORIES = 254


@dataclass(frozen=True)
class BaselineResult:
    """A baseline's run: its test metrics, its probabilities on the val and test journeys
    (in their order) and the fitted model, a candidate for the champion."""

    name: str
    run_id: str | None
    metrics: dict[str, float]  # test_* and val_roc_auc
    test_scores: np.ndarray
    val_scores: np.ndarray
    model: Baseline


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

    def tokens(self) -> list[str]:
        """The fitted tokens in column order (`set_tokens` restores them)."""
        assert self.columns is not None, "fit first"
        return self.columns.sort("col").get_column("token").to_list()

    def set_tokens(self, tokens: list[str]) -> None:
        series = pl.Series("token", tokens, dtype=pl.String)
        self.columns = pl.DataFrame(
            {"token": series, "col": pl.int_range(len(series), dtype=pl.UInt32, eager=True)}
        )

    def transform(self, frame: pl.DataFrame) -> csr_matrix:
        from scipy import sparse

        assert self.columns is not None, "fit first"
        frame = with_total_events(frame)
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


TIMING_AGGREGATES = (
    "n_events",
    "visits",
    "duration_s",
    "gap_mean_s",
    "gap_min_s",
    "gap_max_s",
    "gap_last_s",
    "first_hour",
    "first_weekday",
    "last_hour",
    "last_weekday",
)


def timing_aggregates(
    frame: pl.DataFrame, timezone: str = "UTC", visit_gap_s: float | None = None
) -> pl.DataFrame:
    """Per journey: length, visits, duration, gap statistics and the local hour and
    weekday of its first and last event (null where a journey has too few events).

    A visit opens at every gap of at least `visit_gap_s` seconds (the model's
    `model.visit_gap`); without one, every journey is one visit.
    """
    from journeys.encoding import gap_seconds_expr

    time = pl.col("event_time")
    gaps = gap_seconds_expr(time).list.slice(1)  # the first event has no gap
    first = time.list.first().dt.convert_time_zone(timezone)
    last = time.list.last().dt.convert_time_zone(timezone)
    opened = gaps.list.eval(pl.element() >= visit_gap_s).list.sum() if visit_gap_s else pl.lit(0)
    return frame.select(
        n_events=pl.col("n_events_total").cast(pl.Float64),
        visits=(1 + opened).cast(pl.Float64),
        duration_s=(time.list.last() - time.list.first()).dt.total_seconds(fractional=True),
        gap_mean_s=gaps.list.mean(),
        gap_min_s=gaps.list.min(),
        gap_max_s=gaps.list.max(),
        gap_last_s=gaps.list.last(),
        first_hour=first.dt.hour().cast(pl.Float64),
        first_weekday=first.dt.weekday().cast(pl.Float64),
        last_hour=last.dt.hour().cast(pl.Float64),
        last_weekday=last.dt.weekday().cast(pl.Float64),
    )


def token_columns(columns: Sequence[EventInput]) -> list[str]:
    """The columns whose values the bag of events and the last touch count as tokens."""
    return [column.name for column in columns if column.tokens]


class JourneyAggregates:
    """Journeys -> a dense matrix for gradient boosting: bag-of-events counts, the timing
    aggregates, each column's own aggregates (`EventInput.aggregates`: a number's mean,
    minimum, ...) and the last event's type and token values as categorical columns
    (levels from train; unseen or rare ones are missing)."""

    def __init__(self, columns: Sequence[EventInput], timezone: str, visit_gap_s: float | None):
        self.columns = tuple(columns)
        self.features = token_columns(columns)
        self.timezone = timezone
        self.visit_gap_s = visit_gap_s
        self.bag = BagOfEvents(self.features, bigrams=False, max_columns=MAX_DENSE_COLUMNS)
        self.levels: dict[str, dict[str, int]] = {}  # last-touch column -> level -> code

    @property
    def last_touch_columns(self) -> list[str]:
        return ["event_type", *self.features]

    @property
    def column_aggregates(self) -> list[pl.Expr]:
        return [expr for column in self.columns for expr in column.aggregates()]

    def _last(self, frame: pl.DataFrame) -> pl.DataFrame:
        return frame.select(
            pl.col(c).list.last().fill_null(MISSING_VALUE).alias(c) for c in self.last_touch_columns
        )

    def fit(self, frame: pl.DataFrame) -> JourneyAggregates:
        self.bag.fit(frame)
        last = self._last(frame)
        for column in self.last_touch_columns:
            counts = last.group_by(column).len().sort(["len", column], descending=[True, False])
            levels = counts.head(MAX_CATEGORIES).get_column(column).to_list()
            self.levels[column] = {level: code for code, level in enumerate(levels)}
        return self

    def to_dict(self) -> dict[str, Any]:
        """The fitted state as JSON values (`from_dict` reads it back)."""
        names = names_by_setting(self.columns)
        return {
            "features": names[CategoricalInput.setting],
            "numeric": names[NumericInput.setting],
            "timezone": self.timezone,
            "visit_gap_s": self.visit_gap_s,
            "tokens": self.bag.tokens(),
            "levels": self.levels,
        }

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> JourneyAggregates:
        names = {
            CategoricalInput.setting: state["features"],
            NumericInput.setting: state["numeric"],
        }
        aggregates = cls(columns_from_names(names), state["timezone"], state["visit_gap_s"])
        aggregates.bag.set_tokens(state["tokens"])
        aggregates.levels = {column: dict(levels) for column, levels in state["levels"].items()}
        return aggregates

    @property
    def categorical(self) -> np.ndarray:
        """Which columns of `transform` are categorical (the last-touch ones, at the end)."""
        n_numeric = self.bag.n_columns + len(TIMING_AGGREGATES) + len(self.column_aggregates)
        return np.r_[np.zeros(n_numeric, bool), np.ones(len(self.last_touch_columns), bool)]

    def transform(self, frame: pl.DataFrame) -> np.ndarray:
        codes = self._last(frame).select(
            pl.col(c).replace_strict(self.levels[c], default=None, return_dtype=pl.Float64)
            for c in self.last_touch_columns
        )
        timing = timing_aggregates(frame, self.timezone, self.visit_gap_s)
        blocks = [self.bag.transform(frame).toarray(), timing.to_numpy()]
        if self.column_aggregates:  # (no columns would also mean no rows)
            aggregates = frame.select(self.column_aggregates).cast(pl.Float64)
            blocks.append(aggregates.to_numpy())
        blocks.append(codes.to_numpy())
        return np.hstack(blocks).astype(np.float32)  # nulls are NaN: missing for the trees


# ----------------------------------------------------------------------------- models


@dataclass(frozen=True)
class BaselineSettings:
    """What the baselines read from the configuration: the per-event columns (typed:
    `journeys.inputs`), bigrams, the seed, where hours are read (`data.timezone`) and the
    gap that opens a visit."""

    columns: tuple[EventInput, ...] = ()
    bigrams: bool = False
    seed: int = 0
    timezone: str = "UTC"
    visit_gap_s: float | None = None

    @classmethod
    def from_config(cls, config: Config) -> BaselineSettings:
        return cls(
            columns=columns_of(config.data),
            bigrams=config.train.bigrams,
            seed=config.train.seed,
            timezone=config.data.timezone,
            visit_gap_s=config.model.visit_gap_s,
        )

    @property
    def features(self) -> list[str]:
        """The columns counted as tokens (`token_columns`)."""
        return token_columns(self.columns)

    def to_dict(self) -> dict[str, Any]:
        """As JSON values: the columns' names by the `data` setting that lists them
        (`features`, `numeric_features`), as saved since baselines were served."""
        names = names_by_setting(self.columns)
        return {
            "features": names.pop(CategoricalInput.setting),
            "bigrams": self.bigrams,
            "seed": self.seed,
            "timezone": self.timezone,
            "visit_gap_s": self.visit_gap_s,
            **names,
        }

    @classmethod
    def from_dict(cls, settings: dict[str, Any]) -> BaselineSettings:
        rest = {k: v for k, v in settings.items() if k not in KIND_SETTINGS}
        return cls(columns=columns_from_names(settings), **rest)


def _labels(frame: pl.DataFrame) -> np.ndarray:
    return frame.get_column("label").cast(pl.Int64).to_numpy()


def with_total_events(frame: pl.DataFrame) -> pl.DataFrame:
    """A frame with `n_events_total`: a served journey without it counts the events it lists."""
    if "n_events_total" in frame.columns:
        return frame
    return frame.with_columns(n_events_total=pl.col("event_type").list.len())


class Baseline:
    """A fitted baseline: journeys (ingest schema) in, conversion probabilities out.

    Its fitted state is plain JSON values (`state`) and, for the boosted ones, their
    `Trees` (`booster`), which `journeys.trained_model` saves as Treelite's checkpoint: a
    baseline can be served like the transformer, never through pickle.
    """

    name: ClassVar[str]
    booster: Trees | None = None

    def __init__(self, settings: BaselineSettings) -> None:
        self.settings = settings

    def fit(self, train: pl.DataFrame) -> Baseline:
        raise NotImplementedError

    def predict_proba(self, frame: pl.DataFrame) -> np.ndarray:
        raise NotImplementedError

    def fitted_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def restore(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """The fitted baseline as JSON values (`load_baseline` reads it back)."""
        settings = self.settings.to_dict()
        return {"name": self.name, "settings": settings, "fitted": self.fitted_state()}


class Prior(Baseline):
    """The train base rate for every journey."""

    name = "prior"
    rate = math.nan

    def fit(self, train: pl.DataFrame) -> Prior:
        self.rate = float(_labels(train).mean())
        return self

    def predict_proba(self, frame: pl.DataFrame) -> np.ndarray:
        return np.full(frame.height, self.rate)

    def fitted_state(self) -> dict[str, Any]:
        return {"rate": self.rate}

    def restore(self, state: dict[str, Any]) -> None:
        self.rate = float(state["rate"])


class LastTouch(Baseline):
    """The train conversion rate of the journey's last event type (and channel), shrunk
    towards the base rate by `LAST_TOUCH_PSEUDO_COUNT` journeys."""

    name = "last_touch"
    base_rate = math.nan
    rates: pl.DataFrame | None = None  # one row per key seen in train: keys..., rate

    @property
    def keys(self) -> list[str]:
        features = self.settings.features
        return ["event_type", *[f for f in LAST_TOUCH_FEATURES if f in features]]

    def _last(self) -> list[pl.Expr]:
        return [pl.col(k).list.last().fill_null(MISSING_VALUE).alias(k) for k in self.keys]

    def fit(self, train: pl.DataFrame) -> LastTouch:
        base_rate = float(_labels(train).mean())
        self.base_rate = base_rate
        self.rates = (
            train.select(*self._last(), "label")
            .group_by(self.keys)
            .agg(n=pl.len(), positives=pl.col("label").cast(pl.Float64).sum())
            .select(
                *self.keys,
                rate=(pl.col("positives") + LAST_TOUCH_PSEUDO_COUNT * base_rate)
                / (pl.col("n") + LAST_TOUCH_PSEUDO_COUNT),
            )
            .sort(self.keys)
        )
        return self

    def predict_proba(self, frame: pl.DataFrame) -> np.ndarray:
        assert self.rates is not None, "fit first"
        scored = (
            frame.select(*self._last())
            .with_row_index("_row")
            .join(self.rates, on=self.keys, how="left")
            .sort("_row")  # joins do not keep order
        )
        return scored.get_column("rate").fill_null(self.base_rate).to_numpy()

    def fitted_state(self) -> dict[str, Any]:
        assert self.rates is not None, "fit first"
        return {"base_rate": self.base_rate, "rates": self.rates.to_dict(as_series=False)}

    def restore(self, state: dict[str, Any]) -> None:
        self.base_rate = float(state["base_rate"])
        schema = {**dict.fromkeys(self.keys, pl.String), "rate": pl.Float64}
        self.rates = pl.DataFrame(state["rates"], schema=schema)


class LogReg(Baseline):
    """Logistic regression on bag-of-events counts (scaled by each column's largest train
    value). Served as its weights: a sparse dot product, no scikit-learn at scoring."""

    name = "logreg"
    weights: np.ndarray | None = None  # per bag column, the scaling folded in
    intercept = 0.0

    def __init__(self, settings: BaselineSettings) -> None:
        super().__init__(settings)
        self.bag = BagOfEvents(settings.features, settings.bigrams)

    def fit(self, train: pl.DataFrame) -> LogReg:
        from sklearn.linear_model import LogisticRegression
        from sklearn.preprocessing import MaxAbsScaler

        inputs = self.bag.fit(train).transform(train)
        scaler = MaxAbsScaler().fit(inputs)
        model = LogisticRegression(max_iter=2000, random_state=self.settings.seed)
        model.fit(scaler.transform(inputs), _labels(train))
        self.weights = model.coef_[0] / scaler.scale_
        self.intercept = float(model.intercept_[0])
        return self

    def logits(self, frame: pl.DataFrame) -> np.ndarray:
        assert self.weights is not None, "fit first"
        return self.bag.transform(frame) @ self.weights + self.intercept

    def predict_proba(self, frame: pl.DataFrame) -> np.ndarray:
        from journeys.metrics import sigmoid

        return sigmoid(self.logits(frame))

    def fitted_state(self) -> dict[str, Any]:
        assert self.weights is not None, "fit first"
        return {
            "tokens": self.bag.tokens(),
            "weights": self.weights.tolist(),
            "intercept": self.intercept,
        }

    def restore(self, state: dict[str, Any]) -> None:
        self.bag.set_tokens(state["tokens"])
        self.weights = np.asarray(state["weights"], dtype=np.float64)
        self.intercept = float(state["intercept"])


class Hgb(Baseline):
    """Gradient boosting on bag-of-events counts (the `MAX_DENSE_COLUMNS` commonest)."""

    name = "hgb"

    def __init__(self, settings: BaselineSettings) -> None:
        super().__init__(settings)
        self.bag = BagOfEvents(settings.features, settings.bigrams, max_columns=MAX_DENSE_COLUMNS)

    def fit(self, train: pl.DataFrame) -> Hgb:
        inputs = self.bag.fit(train).transform(train).toarray()
        self.booster = Trees.of(_booster(self.settings.seed).fit(inputs, _labels(train)))
        return self

    def predict_proba(self, frame: pl.DataFrame) -> np.ndarray:
        assert self.booster is not None, "fit first"
        return self.booster.predict_proba(self.bag.transform(frame).toarray())

    def fitted_state(self) -> dict[str, Any]:
        return {"tokens": self.bag.tokens()}

    def restore(self, state: dict[str, Any]) -> None:
        self.bag.set_tokens(state["tokens"])


class HgbAggregates(Baseline):
    """The strong baseline: gradient boosting on `JourneyAggregates`."""

    name = "hgb_aggregates"

    def __init__(self, settings: BaselineSettings) -> None:
        super().__init__(settings)
        self.aggregates = JourneyAggregates(
            settings.columns, settings.timezone, settings.visit_gap_s
        )

    def fit(self, train: pl.DataFrame) -> HgbAggregates:
        inputs = self.aggregates.fit(train).transform(train)
        booster = _booster(self.settings.seed, self.aggregates.categorical)
        self.booster = Trees.of(booster.fit(inputs, _labels(train)))
        return self

    def predict_proba(self, frame: pl.DataFrame) -> np.ndarray:
        assert self.booster is not None, "fit first"
        return self.booster.predict_proba(self.aggregates.transform(with_total_events(frame)))

    def fitted_state(self) -> dict[str, Any]:
        return {"aggregates": self.aggregates.to_dict()}

    def restore(self, state: dict[str, Any]) -> None:
        self.aggregates = JourneyAggregates.from_dict(state["aggregates"])


def _booster(seed: int, categorical: np.ndarray | None = None) -> HistGradientBoostingClassifier:
    from sklearn.ensemble import HistGradientBoostingClassifier

    return HistGradientBoostingClassifier(
        max_iter=HGB_MAX_ITER,
        early_stopping=True,
        categorical_features=categorical,
        random_state=seed,
    )


class Trees:
    """A fitted gradient boosting's trees, held and evaluated by Treelite.

    scikit-learn fits the booster; its trees are then Treelite's, in training as in
    serving (one inference path: what training measured is what a served model gives, to
    the last few bits). Treelite's checkpoint holds numbers only, never code, and reading
    it needs neither scikit-learn nor skops: 0.2 s of imports against 2 s, which every
    scoring process of a stack or booster champion used to pay (docs/nightly.md).
    """

    def __init__(self, model: treelite.Model) -> None:
        self.model = model

    @classmethod
    def of(cls, booster: HistGradientBoostingClassifier) -> Trees:
        """The trees of a fitted binary `HistGradientBoostingClassifier`."""
        import treelite.sklearn

        with warnings.catch_warnings():
            # Its importer casts each categorical column's levels to integers, the
            # "missing" level (NaN) included, which NumPy warns of; missing values take
            # the trees' missing branch before any level is looked up.
            warnings.filterwarnings("ignore", "invalid value encountered in cast", RuntimeWarning)
            return cls(treelite.sklearn.import_model(booster))

    def predict_proba(self, inputs: np.ndarray) -> np.ndarray:
        """P(class 1) for each row of `inputs` (NaN: missing, as in fitting). A categorical
        column holds levels seen in fitting or NaN (`JourneyAggregates.transform` makes
        an unseen level NaN): scikit-learn reads an unseen level as missing, Treelite not."""
        import treelite.gtil

        rows = np.ascontiguousarray(inputs, dtype=np.float64)
        return treelite.gtil.predict(self.model, rows).reshape(-1)

    def to_bytes(self) -> bytes:
        return bytes(self.model.serialize_bytes())

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        # A Treelite model is a handle to native memory: pickled (to scoring processes and
        # Dask workers, with the rest of the model) as its checkpoint bytes.
        return Trees.from_bytes, (self.to_bytes(),)

    @classmethod
    def from_bytes(cls, data: bytes) -> Trees:
        import treelite

        return cls(treelite.Model.deserialize_bytes(data))


BASELINE_TYPES: dict[str, type[Baseline]] = {
    kind.name: kind for kind in (LogReg, Hgb, HgbAggregates, LastTouch, Prior)
}
assert tuple(BASELINE_TYPES) == BASELINES


def fit_baseline(name: str, train: pl.DataFrame, settings: BaselineSettings) -> Baseline:
    """Baseline `name` fitted on the `train` journeys."""
    return BASELINE_TYPES[name](settings).fit(with_total_events(train))


def load_baseline(state: dict[str, Any], booster: Trees | None = None) -> Baseline:
    """A fitted baseline from its `state()` (and booster, for the boosted ones)."""
    baseline = BASELINE_TYPES[state["name"]](BaselineSettings.from_dict(state["settings"]))
    baseline.restore(state["fitted"])
    baseline.booster = booster
    if state["name"] in ("hgb", "hgb_aggregates") and booster is None:
        raise ValueError(f"baseline {state['name']} needs its booster")
    return baseline


def fit_predict(
    name: str,
    train: pl.DataFrame,
    test: pl.DataFrame,
    columns: Sequence[EventInput] = (),
    bigrams: bool = False,
    seed: int = 0,
    timezone: str = "UTC",
    visit_gap_s: float | None = None,
) -> np.ndarray:
    """Fit baseline `name` on `train`, return conversion probabilities for `test`.

    `columns` are the per-event columns (`journeys.inputs`); `timezone` is where hours and
    weekdays are read, `visit_gap_s` the gap that opens a visit (both only used by
    `hgb_aggregates`).
    """
    settings = BaselineSettings(tuple(columns), bigrams, seed, timezone, visit_gap_s)
    return fit_baseline(name, train, settings).predict_proba(with_total_events(test))


# ----------------------------------------------------------------------------- runs


def ahead_of_transformer(
    transformer: dict[str, float], baselines: dict[str, dict[str, float]]
) -> list[str]:
    """The baselines whose test ROC AUC lies above the transformer's 95% interval: a user
    must hear that a simpler model did better, whatever the registry's champion is."""
    high = transformer.get("test_roc_auc_ci_high", math.nan)
    return sorted(name for name, m in baselines.items() if m.get("test_roc_auc", math.nan) > high)


def run_baselines(
    names: list[str],
    train: pl.DataFrame,
    val: pl.DataFrame,
    test: pl.DataFrame,
    config: Config,
    workdir: Path,
    tags: dict[str, str] | None = None,
) -> list[BaselineResult]:
    """Fit each baseline on `train`, score `val` (what promotion compares the candidates
    on) and `test` (what is reported), and log it as its own MLflow run; the fitted models
    come back as candidates for the champion."""
    from journeys import metrics as M
    from journeys import plots, tracking
    from journeys.promotion import baseline_kind

    uri = tracking.tracking_uri(config)
    labels = _labels(test)
    settings = BaselineSettings.from_config(config)
    results = []
    for name in names:
        print(f"baseline {name}: fitting on {train.height:,} train journeys")
        model = fit_baseline(name, train, settings)
        # One call scores both splits.
        probs = model.predict_proba(
            with_total_events(pl.concat([val, test], how="diagonal_relaxed"))
        )
        val_probs, probs = probs[: val.height], probs[val.height :]
        scores = M.binary_metrics(labels, probs)
        scores["val_roc_auc"] = M.binary_metrics(
            _labels(val), val_probs, prefix="val_", intervals=False
        )["val_roc_auc"]
        family = baseline_kind(name)
        family_tags = {tracking.MODEL_FAMILY_TAG: family, **(tags or {})}
        with tracking.mlflow_run(
            uri, config.mlflow.experiment, name=family, tags=family_tags
        ) as run:
            tracking.log_config(run, config)
            tracking.log_ingest_report(run, config.paths.journeys)
            run.log_metrics({**scores, "n_train": train.height, "n_test": test.height})
            folder = workdir / family
            for plot in (plots.plot_roc, plots.plot_pr, plots.plot_calibration):
                run.log_artifact(
                    plot(labels, {family: probs}, folder / f"{plot.__name__[5:]}.png"), "plots"
                )
        results.append(BaselineResult(name, run.run_id, scores, probs, val_probs, model))
    return results

"""The per-event inputs (`journeys.inputs`): one typed description that the encoder, the
model's sizes, the baselines and serving all read. A new kind of input is one class: a toy
kind reaches every consumer from the description alone."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import ClassVar

import numpy as np
import polars as pl
import torch

from journeys import serving
from journeys.baselines import BaselineSettings, JourneyAggregates, fit_baseline, load_baseline
from journeys.config import Model, load_config
from journeys.encoding import JourneyCollator, JourneyEncoder, model_config_from
from journeys.inputs import (
    NUMERIC_AGGREGATES,
    NUMERIC_INPUTS,
    CategoricalInput,
    EventInput,
    EventInputs,
    NumericInput,
    TimeInput,
    columns_from_names,
    columns_of,
    names_by_setting,
)
from journeys.model import JourneyTransformer
from journeys.vocab import Vocabularies, Vocabulary

START = datetime(2026, 1, 5, tzinfo=UTC)
FORMAT_1 = Path(__file__).parent / "data" / "model_format1"


@dataclass(frozen=True)
class FlagInput(EventInput):
    """A toy kind, defined here and nowhere else: a per-event yes/no, as one embedding
    table (id 1: no or missing, 2: yes) and one continuous input, with its share of yes
    per journey for `hgb_aggregates`, read from a request's "yes"."""

    setting: ClassVar[str] = "flag_features"
    dtype: ClassVar[type[pl.DataType]] = pl.Boolean

    @property
    def embedding_sizes(self) -> tuple[int, ...]:
        return (3,)

    @property
    def n_continuous(self) -> int:
        return 1

    def ids(self, key: str) -> list[pl.Expr]:
        return [pl.when(pl.col(key)).then(2).otherwise(1)]

    def continuous(self, key: str) -> list[pl.Expr]:
        return [pl.col(key).fill_null(False)]

    def aggregates(self) -> list[pl.Expr]:
        share = pl.col(self.name).list.eval(pl.element().fill_null(False)).list.mean()
        return [share.alias(f"{self.name}_share")]

    def from_text(self, values: pl.Expr) -> pl.Expr:
        return values.list.eval(pl.element() == "yes")


VOCABS = Vocabularies(
    by_column={
        "event_type": Vocabulary(("<pad>", "<unk>", "view", "click")),
        "channel": Vocabulary(("<pad>", "<unk>", "search", "email")),
    }
)


def journeys(n: int, seed: int) -> pl.DataFrame:
    """Journeys with a channel, a promo flag and a price per event; those with a promo on
    their last event convert."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        k = int(rng.integers(1, 6))
        promo = [bool(x) for x in rng.random(k) < 0.3]
        rows.append(
            {
                "event_type": rng.choice(["view", "click"], k).tolist(),
                "event_time": [START + timedelta(minutes=5 * i) for i in range(k)],
                "channel": rng.choice(["search", "email", "tv"], k).tolist(),
                "promo": promo,
                "price": [float(p) if p > 5 else None for p in rng.uniform(0, 50, k)],
                "n_events_total": k,
                "label": int(promo[-1]),
            }
        )
    return pl.DataFrame(
        rows,
        schema_overrides={
            "event_time": pl.List(pl.Datetime("us", "UTC")),
            "promo": pl.List(pl.Boolean),
            "price": pl.List(pl.Float64),
        },
    )


def test_a_new_kind_reaches_every_consumer_from_the_description_alone() -> None:
    """The toy kind, placed between the features and the numbers: the encoder gives its
    ids and continuous input in that place, `ModelConfig` is sized for them, a network
    reads them, `hgb_aggregates` adds its aggregate, serving reads it from a request;
    nothing but the description names it."""
    train, test = journeys(300, seed=0), journeys(100, seed=1)
    declared = (CategoricalInput("channel"), FlagInput("promo"), NumericInput("price"))
    settings = Model(d_model=16, n_heads=2, n_layers=1, time_encodings=False)
    encoder = JourneyEncoder.fit(
        train, VOCABS, settings, max_len=8, timezone="UTC", columns=declared
    )
    channel, promo, price = encoder.inputs.columns
    assert promo == FlagInput("promo") and channel.vocabulary == VOCABS.by_column["channel"]
    assert price.scale != 1.0  # fitted on train

    # The encoder: channel's and promo's ids; promo's input, then the price's.
    encoded = encoder.encode(test)
    flags = test.get_column("promo").explode().to_list()
    assert encoded.feature_names == ("channel", "promo")
    assert encoded.features[1].tolist() == [2 if f else 1 for f in flags]
    assert encoded.continuous.shape == (1 + len(NUMERIC_INPUTS), encoded.n_events)
    assert encoded.continuous[0].tolist() == [float(f) for f in flags]

    # The model, sized from the encoder alone, reads them.
    config = model_config_from(settings, encoder)
    assert config.feature_vocab_sizes == (4, 3)
    assert config.n_continuous == 1 + len(NUMERIC_INPUTS)
    assert (config.max_len, config.n_time_buckets) == (8, settings.time_buckets)
    batch = JourneyCollator(encoded)(list(range(4)))
    out = JourneyTransformer(config)(
        batch.tokens, batch.features, batch.time_buckets, batch.mask, continuous=batch.continuous
    )
    assert out.logits.shape == (4,)

    # The baselines: channel is a token, promo and price add their own aggregates.
    baseline_settings = BaselineSettings(encoder.inputs.columns)
    assert baseline_settings.features == ["channel"]
    aggregates = JourneyAggregates(baseline_settings.columns, "UTC", None).fit(train)
    width = aggregates.transform(test).shape[1]
    without = JourneyAggregates([channel], "UTC", None).fit(train).transform(test).shape[1]
    assert width == without + 1 + len(NUMERIC_AGGREGATES)
    booster = fit_baseline("hgb_aggregates", train, baseline_settings)
    assert booster.predict_proba(test).shape == (test.height,)

    # Serving: promo is an optional column of the signature, read from a request's text.
    signature = serving.signature(encoder.inputs.columns)
    assert signature.inputs.input_names() == ["event_type", "event_time", *encoder.event_columns]
    request = {"event_type": ["view", "click"], "event_time": [1, 2], "promo": ["no", "yes"]}
    frame = serving.journeys_from_request(request, encoder.inputs.columns)
    assert frame.row(0, named=True)["promo"] == [False, True]
    assert frame.row(0, named=True)["price"] == [None, None]
    assert encoder.encode(frame).features[1].tolist() == [1, 2]


def test_the_configuration_declares_the_columns_every_consumer_reads() -> None:
    """`data.features` and `data.numeric_features` become one description: the encoder
    fitted from it, the model it sizes, the baselines' settings and the pyfunc's signature
    name the same columns in the same order."""
    config = load_config(
        None, ["data.features=[channel]", "data.numeric_features=[price]", "model.d_model=16"]
    )
    declared = columns_of(config.data)
    assert declared == (CategoricalInput("channel"), NumericInput("price"))
    train = journeys(200, seed=2)
    encoder = JourneyEncoder.fit(
        train,
        VOCABS,
        config.model,
        max_len=config.journey.max_events,
        timezone=config.data.timezone,
        columns=declared,
    )
    assert encoder.event_columns == config.data.event_columns == ["channel", "price"]
    model = model_config_from(config.model, encoder)
    assert model.feature_vocab_sizes == (len(VOCABS.by_column["channel"]),)
    assert model.n_continuous == 6 + len(NUMERIC_INPUTS)  # time encodings on by default
    assert model.max_len == config.journey.max_events
    assert model.n_time_buckets == config.model.time_buckets
    assert [c.name for c in BaselineSettings.from_config(config).columns] == encoder.event_columns
    names = serving.signature(encoder.inputs.columns).inputs.input_names()
    assert names[2:] == encoder.event_columns


def test_columns_are_saved_by_the_setting_that_lists_them() -> None:
    """A baseline's saved settings keep their JSON (`features`, `numeric_features`), and
    read back as the same typed columns."""
    columns = (CategoricalInput("channel"), NumericInput("price"))
    assert names_by_setting(columns) == {"features": ["channel"], "numeric_features": ["price"]}
    assert columns_from_names(names_by_setting(columns)) == columns
    settings = BaselineSettings(columns, bigrams=True, seed=3, visit_gap_s=1800.0)
    saved = settings.to_dict()
    assert saved == {
        "features": ["channel"],
        "bigrams": True,
        "seed": 3,
        "timezone": "UTC",
        "visit_gap_s": 1800.0,
        "numeric_features": ["price"],
    }
    assert BaselineSettings.from_dict(saved) == settings
    fitted = fit_baseline("prior", journeys(50, seed=4), settings)
    assert load_baseline(fitted.state()).settings == settings


def test_a_saved_model_is_sized_by_its_encoder() -> None:
    """Loaded from its files, a model's encoder sizes the network it came with (a format-1
    model with a numeric feature and time encodings)."""
    from journeys.trained_model import load_model

    loaded = load_model(str(FORMAT_1 / "model"))
    sized = model_config_from(Model(), loaded.encoder)
    for key in ("vocab_size", "feature_vocab_sizes", "n_continuous", "n_time_buckets", "max_len"):
        assert getattr(sized, key) == getattr(loaded.config, key), key
    (price,) = loaded.encoder.inputs.of_kind(NumericInput)
    assert price.name == "price" and math.isfinite(price.centre)


def test_the_time_input_gives_buckets_and_encodings() -> None:
    inputs = EventInputs(VOCABS.event_type, TimeInput(8, "UTC"))
    assert inputs.n_continuous == 6 and inputs.embedding_sizes == ()
    assert EventInputs(VOCABS.event_type, TimeInput(8)).n_continuous == 0
    encoded = JourneyEncoder(inputs, max_len=4).encode(journeys(5, seed=5))
    assert int(encoded.time_buckets.max()) < 8
    assert torch.isfinite(encoded.continuous).all()


def test_journey_so_far_inputs_are_the_journey_up_to_each_event() -> None:
    """With `model.journey_so_far`, each event carries its journey's counts and gap
    statistics up to it (on the last event, the journey's own), the same whether the
    journey is encoded whole or cut after that event (what in-flight scoring sees)."""
    from journeys.inputs import JOURNEY_SO_FAR, LOG_COUNT_SCALE, LOG_SECONDS_SCALE

    gaps = [0, 10, 3590, 5]  # seconds since the previous event
    times = [START + timedelta(seconds=s) for s in np.cumsum(gaps).tolist()]
    frame = pl.DataFrame(
        {"event_type": [["view", "click", "view", "view"]], "event_time": [times]},
        schema_overrides={"event_time": pl.List(pl.Datetime("us", "UTC"))},
    )
    inputs = EventInputs(VOCABS.event_type, TimeInput(8, "UTC", journey_so_far=True))
    assert inputs.n_continuous == 6 + len(JOURNEY_SO_FAR)
    encoder = JourneyEncoder(inputs, max_len=8)
    so_far = encoder.encode(frame).continuous[6:].T.double().numpy()  # [events, 4]

    counts = np.expm1(so_far[:, :2] * LOG_COUNT_SCALE)
    np.testing.assert_allclose(counts[:, 0], [1, 2, 3, 4], atol=1e-4)  # events so far
    np.testing.assert_allclose(counts[:, 1], [1, 1, 2, 3], atol=1e-4)  # of this event's type
    log_gaps = np.log1p(gaps) / LOG_SECONDS_SCALE
    np.testing.assert_allclose(so_far[:, 2], np.maximum.accumulate(log_gaps), atol=1e-6)
    means = np.cumsum(log_gaps) / np.arange(1, 5)
    np.testing.assert_allclose(so_far[:, 3], means, atol=1e-6)

    cut = frame.with_columns(pl.col("event_type", "event_time").list.head(2))
    np.testing.assert_array_equal(
        encoder.encode(cut).continuous[6:].T.numpy(), so_far[:2].astype(np.float32)
    )
    # Off (the default), the encodings are the time's alone, as before the option.
    assert EventInputs(VOCABS.event_type, TimeInput(8, "UTC")).n_continuous == 6


def test_journey_so_far_inputs_start_again_with_each_journey() -> None:
    """Journeys side by side (types interleaved) each count from their own first event,
    over the events the model reads (`max_len`), with or without time encodings."""
    from journeys.inputs import JOURNEY_SO_FAR, LOG_COUNT_SCALE

    frame = journeys(40, seed=3)
    inputs = EventInputs(VOCABS.event_type, TimeInput(8, None, journey_so_far=True))
    assert inputs.n_continuous == len(JOURNEY_SO_FAR)
    encoded = JourneyEncoder(inputs, max_len=3).encode(frame)
    counts = np.rint(np.expm1(encoded.continuous[:2].double().numpy() * LOG_COUNT_SCALE))
    kept = frame.select(pl.col("event_type").list.tail(3)).to_series().to_list()
    expected_events = [i + 1 for types in kept for i in range(len(types))]
    expected_type = [types[: i + 1].count(t) for types in kept for i, t in enumerate(types)]
    assert counts[0].tolist() == expected_events
    assert counts[1].tolist() == expected_type
    assert max(expected_type) > 1 and max(len(t) for t in kept) == 3  # cut, with repeats

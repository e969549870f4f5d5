"""The trained model's one home: models saved by older versions load and score the same."""

from __future__ import annotations

import json
import shutil
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from journeys.attribution import integrated_gradients_frame
from journeys.errors import InputError
from journeys.score import score_dataset
from journeys.trained_model import PREPROCESSING, TrainedModel, load_model

FORMAT_1 = Path(__file__).parent / "data" / "model_format1"
AS_OF = datetime(2026, 2, 20, tzinfo=UTC)


def assert_lists_close(actual: pl.Series, expected: pl.Series) -> None:
    assert actual.list.len().to_list() == expected.list.len().to_list()
    np.testing.assert_allclose(
        actual.explode().to_numpy(), expected.explode().to_numpy(), rtol=1e-4, atol=1e-6
    )


def test_a_format_1_model_scores_and_explains_as_the_code_that_saved_it(tmp_path: Path) -> None:
    expected = pl.read_parquet(FORMAT_1 / "expected.parquet").sort("journey_id")
    loaded = load_model(str(FORMAT_1 / "model"))
    score_dataset(loaded, FORMAT_1 / "journeys", tmp_path / "scores", as_of=AS_OF, progress=False)
    scores = pl.read_parquet(tmp_path / "scores").sort("journey_id")

    assert scores.get_column("journey_id").to_list() == expected.get_column("journey_id").to_list()
    assert scores.get_column("open").to_list() == expected.get_column("open").to_list()
    assert scores.get_column("open").sum() == 3  # the in-flight path is exercised
    np.testing.assert_allclose(
        scores.get_column("conversion_probability").to_numpy(),
        expected.get_column("conversion_probability").to_numpy(),
        rtol=1e-5,
    )
    assert_lists_close(scores.get_column("attention"), expected.get_column("attention"))

    # Integrated gradients were taken on the whole journeys (not cut at as_of) of a sample.
    sample = expected.filter(pl.col("integrated_gradients").is_not_null())
    journeys = pl.read_parquet(FORMAT_1 / "journeys" / "part-00000.parquet")
    journeys = journeys.join(sample.select("journey_id"), on="journey_id").sort("journey_id")
    assert journeys.height == sample.height > 20
    explained = integrated_gradients_frame(loaded, journeys)
    assert_lists_close(explained, sample.get_column("integrated_gradients"))


def test_model_config_defaults_are_what_the_product_ships() -> None:
    """A `ModelConfig` built by hand is the model the default configuration trains."""
    from journeys.config import load_config
    from journeys.encoding import JourneyEncoder, model_config_from
    from journeys.inputs import columns_of
    from journeys.model import ModelConfig
    from journeys.vocab import Vocabularies, Vocabulary

    config = load_config(None)  # conf/default.yaml
    assert config.data.numeric_features == []  # so no numeric input below
    sizes = {"event_type": 9, **dict(zip(config.data.features, (5, 4), strict=True))}
    vocabs = Vocabularies(
        {name: Vocabulary(tuple(map(str, range(n)))) for name, n in sizes.items()}
    )
    encoder = JourneyEncoder.fit(
        pl.DataFrame(),
        vocabs,
        config.model,
        max_len=config.journey.max_events,
        timezone=config.data.timezone,
        columns=columns_of(config.data),
    )
    shipped = model_config_from(config.model, encoder)
    assert ModelConfig(vocab_size=9, feature_vocab_sizes=(5, 4)) == shipped


def test_a_saved_model_loads_back_the_same_and_predicts_with_its_inputs(tmp_path: Path) -> None:
    """Format 2 round-trips: the same settings, the same probabilities; `predict_proba`
    feeds the continuous inputs (time encodings, numbers) the default model reads."""
    from journeys.score import score_frame

    legacy = load_model(str(FORMAT_1 / "model"))
    assert legacy.config.n_continuous == 6 + 4  # time encodings, and four inputs for price
    legacy.save(tmp_path / "model")
    again = TrainedModel.load(tmp_path / "model")
    assert again.encoder.inputs == legacy.encoder.inputs
    assert again.rules == legacy.rules
    assert again.quiet_survival == legacy.quiet_survival
    assert again.temperature == legacy.temperature == 1.3

    journeys = pl.read_parquet(FORMAT_1 / "journeys" / "part-00000.parquet")
    expected = score_frame(legacy, journeys).get_column("conversion_probability").to_numpy()
    np.testing.assert_allclose(again.predict_proba(journeys), expected, rtol=1e-6)


def test_a_model_folder_is_named_the_same_however_its_path_is_spelled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scores record their model's name, and keep earlier scores of the same model only:
    a folder given relative and then absolute is one model."""
    shutil.copytree(FORMAT_1 / "model", tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    relative = load_model("model")
    absolute = load_model(str(tmp_path / "model"))
    assert relative.model_uri == absolute.model_uri == str((tmp_path / "model").resolve())


@pytest.mark.parametrize(
    ("stored", "inputs"),
    [({}, 2), ({"numeric_relative": True}, 3), ({"numeric_inputs": 4}, 4)],
)
def test_format_1_models_read_the_numeric_inputs_they_were_trained_with(
    tmp_path: Path, stored: dict, inputs: int
) -> None:
    """Models trained before the relative or the carried input existed keep reading two or
    three inputs per number; new ones read all of `NUMERIC_INPUTS`."""
    from journeys.inputs import NUMERIC_INPUTS, NumericInput

    folder = tmp_path / "model"
    shutil.copytree(FORMAT_1 / "model", folder)
    settings = json.loads((folder / PREPROCESSING).read_text())
    settings.pop("numeric_inputs")
    (folder / PREPROCESSING).write_text(json.dumps({**settings, **stored}))
    # The weights were made for four inputs: only the settings are read here.
    (price,) = _read_encoder(folder).inputs.of_kind(NumericInput)
    assert price.n_inputs == price.n_continuous == inputs
    assert load_model(str(FORMAT_1 / "model")).settings()["encoder"]["numeric_inputs"] == len(
        NUMERIC_INPUTS
    )


def _read_encoder(folder: Path):
    from journeys.model import ModelConfig
    from journeys.trained_model import MODEL_CONFIG, _migrate_format_1, _read_settings
    from journeys.vocab import Vocabularies

    config = ModelConfig.from_dict(json.loads((folder / MODEL_CONFIG).read_text()))
    stored = _migrate_format_1(json.loads((folder / PREPROCESSING).read_text()), config)
    return _read_settings(stored, Vocabularies.load(folder), config)[0]


def test_a_model_from_a_newer_version_is_refused_with_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(FORMAT_1 / "model", folder)
    (folder / PREPROCESSING).write_text(json.dumps({"format_version": 99}))
    with pytest.raises(InputError, match=r"format 99 is newer .* upgrade journeys"):
        TrainedModel.load(folder)


def test_only_the_trained_model_module_reads_the_saved_settings() -> None:
    """The saved model's settings have one reader: every other module goes through the
    typed `TrainedModel`."""
    library = Path(__file__).resolve().parents[1] / "journeys"
    readers = {
        path.name
        for path in library.glob("*.py")
        if "PREPROCESSING" in path.read_text() or "preprocessing.json" in path.read_text()
    }
    assert readers == {"trained_model.py"}


def test_a_format_1_architecture_without_the_newer_keys_is_what_it_was(tmp_path: Path) -> None:
    """Keys `ModelConfig` gained later take the values older models were built with, not
    today's defaults (here: positions counted from the start, not from the end)."""
    from journeys.model import ModelConfig
    from journeys.trained_model import FORMAT_1_ARCHITECTURE, MODEL_CONFIG

    folder = tmp_path / "model"
    shutil.copytree(FORMAT_1 / "model", folder)
    architecture = json.loads((folder / MODEL_CONFIG).read_text())
    assert architecture.pop("position_origin") == "end"  # written by the code of its day
    (folder / MODEL_CONFIG).write_text(json.dumps(architecture))
    assert TrainedModel.load(folder).config.position_origin == "start"
    defaults = ModelConfig(vocab_size=5)
    assert all(
        getattr(defaults, key) != value
        for key, value in FORMAT_1_ARCHITECTURE.items()
        if key in ("pooling", "position_origin", "visit_bucket", "n_continuous")
    )


def test_saving_over_a_model_leaves_none_of_its_head_behind(tmp_path: Path) -> None:
    """A model saved into a folder that held a stack champion is the model saved, not that
    champion's booster: the folder's head (and reference) go with it."""
    from test_score import journeys_folder, save_tiny_model

    from journeys.baselines import BaselineSettings, fit_baseline
    from journeys.vocab import Vocabularies

    journeys = journeys_folder(tmp_path / "journeys", n=120)
    folder = save_tiny_model(tmp_path / "model", Vocabularies.load(journeys))
    plain = TrainedModel.load(folder)
    frame = pl.read_parquet(journeys / "*.parquet")
    with_head = TrainedModel.load(folder)
    with_head.baseline = fit_baseline("hgb_aggregates", frame, BaselineSettings())
    with_head.save(folder)
    assert TrainedModel.load(folder).kind == "baseline_hgb_aggregates"
    plain.save(folder)
    assert TrainedModel.load(folder).kind == "transformer"
    assert not list(folder.glob("head.*"))

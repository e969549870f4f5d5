"""The trained model's one home: models saved by older versions load and score the same."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import polars as pl

from journeys.attribution import integrated_gradients_frame
from journeys.packaging import load_model
from journeys.score import score_dataset

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

"""Batch scoring: one row per journey, valid attention, the model's own journey rules and
vocabularies, one-line errors, empty input, MLflow logging."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from conftest import EVENT_TYPES, make_journeys_dataset

from journeys.cli import main
from journeys.config import load_config
from journeys.datasets import (
    count_rows,
    is_journeys_dataset,
    parquet_parts,
    read_metadata,
    scores_schema,
)
from journeys.encoding import JourneyCollator, JourneyEncoder, model_config_from
from journeys.ingest import run_ingest
from journeys.model import JourneyTransformer
from journeys.score import score_command, score_frame
from journeys.trained_model import JourneyRules, TrainedModel, load_model, log_model
from journeys.vocab import UNK_ID, Vocabularies

MAX_EVENTS = 16  # below the fixture's longest journeys (20): scoring must cut the lists
TINY = ["model.d_model=16", "model.n_heads=2", "model.n_layers=2", "model.dropout=0"]
CONTRACT_COLUMNS = [
    *("journey_id", "user_id", "n_events", "conversion_probability", "event_type"),
    *("event_time", "attention", "model_uri", "model_version", "scored_at"),
]


def journeys_folder(folder: Path, n: int = 240, seed: int = 0) -> Path:
    """The conftest dataset, laid out as ingest writes it (part files + vocab.json)."""
    make_journeys_dataset(folder, n=n, seed=seed)
    return folder


def tiny_model(vocabs: Vocabularies, *overrides: str, temperature: float = 1.0) -> TrainedModel:
    """A tiny random transformer (no training needed).

    Weights are scrambled so that outputs and attention really depend on the input.
    """
    config = load_config(None, [*TINY, f"journey.max_events={MAX_EVENTS}", *overrides])
    # No numeric feature: the encoder needs no train split to fit on.
    encoder = JourneyEncoder.fit(
        pl.DataFrame(), vocabs, config.model, max_len=MAX_EVENTS, timezone=config.data.timezone
    )
    torch.manual_seed(0)
    model = JourneyTransformer(model_config_from(config.model, encoder)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.3 if param.dim() > 1 else 0.1)
    return TrainedModel(model, encoder, JourneyRules.from_config(config), temperature)


def save_tiny_model(
    folder: Path, vocabs: Vocabularies, *overrides: str, temperature: float = 1.0
) -> Path:
    """`tiny_model` saved as the five model files."""
    tiny_model(vocabs, *overrides, temperature=temperature).save(folder)
    return folder


def settings(tmp: Path, *extra: str) -> list[str]:
    """--set arguments that keep every output (and any MLflow store) inside `tmp`."""
    pairs = [
        f"paths.journeys={tmp / 'journeys'}",
        f"paths.scores={tmp / 'scores'}",
        f"paths.reports={tmp / 'reports'}",
        f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
        *extra,
    ]
    return [arg for pair in pairs for arg in ("--set", pair)]


def config_for(tmp: Path, *extra: str):
    return load_config(None, settings(tmp, *extra)[1::2])


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(journeys folder, model folder), shared by the tests of this module."""
    root = tmp_path_factory.mktemp("score")
    journeys = journeys_folder(root / "journeys")
    model = save_tiny_model(root / "model", Vocabularies.load(journeys))
    return journeys, model


def direct_forward(model_dir: Path, frame: pl.DataFrame, attention: str | None = None):
    """The same model, loaded again, run by hand on `frame`: (probabilities, attention)."""
    loaded = load_model(str(model_dir))
    encoded = loaded.encoder.encode(frame)
    batch = JourneyCollator(encoded)(list(range(len(encoded))))
    with torch.no_grad():
        out = loaded.model(
            batch.tokens, batch.features, batch.time_buckets, batch.mask,
            attention=attention, continuous=batch.continuous,
        )  # fmt: skip
    probability = torch.sigmoid(out.logits.double() / loaded.temperature).numpy()
    weights = None
    if out.attention is not None:
        weights = [row[mask].numpy() for row, mask in zip(out.attention, batch.mask, strict=True)]
    return probability, weights


# --- the scores ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pooled", "rollout"])
def test_one_row_per_journey_and_valid_attention(
    setup: tuple[Path, Path], tmp_path: Path, mode: str
) -> None:
    journeys, model = setup
    # Small chunks and batches: several part files, several forward passes per chunk.
    config = config_for(
        tmp_path, "score.chunk_journeys=70", "score.batch_size=16", f"score.attention={mode}"
    )
    result = score_command(config, model_uri=str(model), input_path=str(journeys))
    source = pl.read_parquet(journeys / "part-00000.parquet")
    scores = pl.read_parquet(tmp_path / "scores" / "*.parquet")

    assert result.rows == scores.height == source.height
    assert result.parts == len(list((tmp_path / "scores").glob("part-*.parquet"))) == 4
    assert sorted(scores["journey_id"]) == sorted(source["journey_id"])
    assert scores["censored"].sum() == source["censored"].sum() > 0  # censored ones scored too
    assert set(CONTRACT_COLUMNS) <= set(scores.columns)
    assert scores.schema["conversion_probability"] == pl.Float64
    assert scores.schema["attention"] == pl.List(pl.Float32)
    assert scores["conversion_probability"].is_between(0, 1).all()

    lengths = scores.select(
        n=pl.col("n_events"),
        types=pl.col("event_type").list.len(),
        times=pl.col("event_time").list.len(),
        weights=pl.col("attention").list.len(),
        channels=pl.col("channel").list.len(),
    )
    for column in lengths.columns[1:]:
        assert (lengths[column] == lengths["n"]).all(), column
    assert lengths["n"].max() == MAX_EVENTS  # longer journeys cut to what the model read
    flat = scores["attention"].explode()
    assert flat.null_count() == 0 and not flat.is_nan().any() and (flat >= 0).all()
    sums = scores["attention"].list.sum().to_numpy()
    np.testing.assert_allclose(sums, 1.0, atol=1e-5)
    assert scores["model_uri"].unique().to_list() == [str(model)]
    assert scores["scored_at"].null_count() == 0
    assert read_metadata(tmp_path / "scores")["attention"] == mode
    assert not (tmp_path / "reports").exists()  # the report is its own stage


def test_cli_scores_then_attributes_and_out_leaves_the_main_report_alone(
    setup: tuple[Path, Path], tmp_path: Path
) -> None:
    journeys, model = setup
    common = ["--model", str(model), "--input", str(journeys), *settings(tmp_path)]
    assert main(["score", *common]) == 0
    report = tmp_path / "reports" / "credit.csv"
    assert report.exists()  # default output: score, then the attribution report
    before = report.stat().st_mtime_ns, report.read_bytes()

    other = tmp_path / "other-scores"
    assert main(["score", *common, "--out", str(other)]) == 0
    assert pl.read_parquet(other / "*.parquet").height > 0
    assert (report.stat().st_mtime_ns, report.read_bytes()) == before
    assert not (tmp_path / "other-scores-report").exists()

    asked = tmp_path / "other-report"
    assert main(["score", *common, "--out", str(other), "--report", str(asked)]) == 0
    assert (asked / "credit.csv").exists()
    assert (report.stat().st_mtime_ns, report.read_bytes()) == before


def test_probability_and_attention_equal_a_direct_forward_pass(
    setup: tuple[Path, Path], tmp_path: Path
) -> None:
    journeys, model = setup
    score_command(config_for(tmp_path), model_uri=str(model), input_path=str(journeys))
    scores = pl.read_parquet(tmp_path / "scores" / "*.parquet")
    source = pl.read_parquet(journeys / "part-00000.parquet")
    frame = source.join(scores.select("journey_id"), on="journey_id").sample(25, seed=1)
    probability, weights = direct_forward(model, frame, attention="pooled")
    expected = frame.select("journey_id").with_columns(
        expected=pl.Series(probability), weights=pl.Series(weights)
    )
    joined = expected.join(scores, on="journey_id")
    np.testing.assert_allclose(
        joined["conversion_probability"].to_numpy(), joined["expected"].to_numpy(), atol=1e-6
    )
    for got, want in zip(joined["attention"], joined["weights"], strict=True):
        np.testing.assert_allclose(got.to_numpy(), want.to_numpy(), atol=1e-6)


def test_probability_is_calibrated_by_the_model_temperature(setup: tuple[Path, Path]) -> None:
    journeys, model = setup
    frame = pl.read_parquet(journeys / "part-00000.parquet").head(10)
    loaded = load_model(str(model))
    plain = score_frame(loaded, frame)["conversion_probability"].to_numpy()
    loaded.temperature = 2.0
    calibrated = score_frame(loaded, frame)["conversion_probability"].to_numpy()
    logits = np.log(plain / (1 - plain))
    np.testing.assert_allclose(calibrated, 1 / (1 + np.exp(-logits / 2.0)), atol=1e-9)


def test_causal_model_exports_prefix_probabilities(tmp_path: Path) -> None:
    journeys = journeys_folder(tmp_path / "journeys", n=60)
    model = save_tiny_model(tmp_path / "model", Vocabularies.load(journeys), "model.causal=true")
    score_command(config_for(tmp_path), model_uri=str(model), input_path=str(journeys))
    scores = pl.read_parquet(tmp_path / "scores" / "*.parquet")
    assert scores.schema["prefix_probability"] == pl.List(pl.Float64)
    last = scores["prefix_probability"].list.last().to_numpy()
    np.testing.assert_allclose(last, scores["conversion_probability"].to_numpy(), atol=1e-12)
    assert (scores["prefix_probability"].list.len() == scores["n_events"]).all()


# --- raw logs: the model's journey rules and vocabularies, never refitted ---------------


def raw_log() -> pl.DataFrame:
    """Two users' raw events in the model's column names; `imp` needs the model's
    event_map, `teleport` was never seen in training, `buy` is the model's conversion."""
    rows = [
        ("a", "2026-01-01T10:00:00Z", "imp", "display", "mobile"),
        ("a", "2026-01-01T10:05:00Z", "teleport", "email", "desktop"),
        ("a", "2026-01-01T10:09:00Z", "add_to_cart", "search", "mobile"),
        ("a", "2026-01-01T10:10:00Z", "buy", "search", "mobile"),
        ("a", "2026-01-20T09:00:00Z", "click", "brand_new_channel", "watch"),
        ("b", "2026-01-02T08:00:00Z", "search", "search", "tablet"),
        ("b", "2026-01-02T08:01:00Z", "teleport", "display", "tablet"),
        ("b", "2026-01-19T08:01:00Z", "impression", "display", "tablet"),
    ]
    names = ["user_id", "timestamp", "event_type", "channel", "device"]
    return pl.DataFrame(rows, schema=names, orient="row")


def test_raw_log_is_ingested_with_the_model_settings_and_vocabularies(
    setup: tuple[Path, Path], tmp_path: Path
) -> None:
    journeys, _ = setup
    vocabs = Vocabularies.load(journeys)
    assert "teleport" not in vocabs.event_type.tokens
    model = save_tiny_model(
        tmp_path / "model",
        vocabs,
        "data.event_map={imp: impression}",
        "data.conversion_events=[buy]",
    )
    raw = tmp_path / "raw.csv"
    bad_row = {"user_id": ["z"], "timestamp": ["not a time"]}  # quarantined, kept beside
    pl.concat(
        [raw_log(), raw_log().head(1).with_columns(**{k: pl.lit(v[0]) for k, v in bad_row.items()})]
    ).write_csv(raw)
    # The current configuration disagrees with the model on purpose: the model wins.
    config = config_for(tmp_path, "data.features=[channel]", "data.conversion_events=[purchase]")
    result = score_command(config, model_uri=str(model), input_path=str(raw))
    scores = pl.read_parquet(tmp_path / "scores" / "*.parquet").sort("journey_id")

    loaded = load_model(str(model))
    expected = run_ingest(
        loaded.rules.ingest_config(config),
        raw=raw,
        journeys_folder=tmp_path / "expected",
        quarantine_folder=tmp_path / "q",
    ).journeys.sort("journey_id")
    assert result.rows == scores.height == expected.height == 4  # a's 2 + b's 2, censored too
    quarantined = pl.read_parquet(tmp_path / "scores-quarantine" / "quarantine.parquet")
    assert quarantined["user_id"].to_list() == ["z"]
    assert quarantined["reason"].to_list() == ["bad_timestamp"]
    assert scores["label"].to_list() == expected["label"].to_list()
    assert scores["label"].sum() == 1  # `buy` converted, as the model's settings say
    assert {"channel", "device"} <= set(scores.columns)  # the model's features, not config's
    first = scores.filter(pl.col("user_id") == "a").row(0, named=True)
    assert first["event_type"] == ["impression", "teleport", "add_to_cart"]  # event_map applied

    # The unseen event is the unknown token: renaming it to another unseen name changes
    # nothing, and the probability is the model's on the journey encoded with its vocabs.
    assert Vocabularies.load(model).to_json() == vocabs.to_json()  # nothing refitted
    renamed = expected.with_columns(
        pl.col("event_type").list.eval(pl.element().replace("teleport", "warp_drive"))
    )
    encoded = loaded.encode(renamed)
    assert (encoded.tokens == UNK_ID).sum() == 2
    probability, _ = direct_forward(model, renamed)
    np.testing.assert_allclose(scores["conversion_probability"].to_numpy(), probability, atol=1e-6)
    np.testing.assert_allclose(scores["attention"].list.sum().to_numpy(), 1.0, atol=1e-5)


def test_empty_input_gives_an_empty_file_with_the_full_schema(
    setup: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    journeys, model = setup
    empty = tmp_path / "empty"
    empty.mkdir()
    pl.read_parquet(journeys / "part-00000.parquet").head(0).write_parquet(
        empty / "part-00000.parquet"
    )
    (empty / "vocab.json").write_bytes((journeys / "vocab.json").read_bytes())
    result = score_command(config_for(tmp_path), model_uri=str(model), input_path=str(empty))
    assert result.rows == 0
    assert "empty scores file" in capsys.readouterr().out
    scores = pl.read_parquet(tmp_path / "scores" / "part-00000.parquet")
    assert scores.height == 0
    features = ["channel", "device"]
    optional = ["label", "censored", "split", "n_events_total"]
    assert scores.schema == scores_schema(features, optional)
    assert set(CONTRACT_COLUMNS) <= set(scores.columns)
    # The report over it (the score flow's next stage) has nothing to credit, and says so.
    from journeys.attribution import attribute_command

    report = attribute_command(config_for(tmp_path))
    assert report.summary["journeys"] == 0 and "note" in report.summary


# --- one-line errors ------------------------------------------------------------------------


def test_bad_model_or_input_exits_2_with_one_line(
    setup: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    journeys, model = setup
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "part-00000.parquet").write_bytes(b"PAR1 not really parquet")
    (broken / "vocab.json").write_bytes((journeys / "vocab.json").read_bytes())
    no_device = tmp_path / "no_device"
    no_device.mkdir()
    pl.read_parquet(journeys / "part-00000.parquet").drop("device").write_parquet(
        no_device / "part-00000.parquet"
    )
    (no_device / "vocab.json").write_bytes((journeys / "vocab.json").read_bytes())
    other_columns = tmp_path / "other.csv"
    pl.DataFrame({"visitor": ["a"], "ts": ["2026-01-01"], "action": ["x"]}).write_csv(other_columns)

    cases = [
        (["--input", str(journeys)], "no MLflow store"),  # default champion, no store at all
        (["--model", str(tmp_path / "nope"), "--input", str(journeys)], "not found"),
        (["--model", str(model), "--input", str(tmp_path / "missing.csv")], "input not found"),
        (["--model", str(model), "--input", str(broken)], "cannot read"),
        (["--model", str(model), "--input", str(no_device)], "lack column(s) ['device']"),
        (["--model", str(model), "--input", str(other_columns)], "missing column"),
        # A Dask cluster is the flows': refused here, never replaced by local processes.
        (
            ["--model", str(model), "--input", str(journeys), "--set",
             "orchestration.task_runner=dask", "--set", "orchestration.max_workers=2"],
            "--set orchestration.task_runner=process here",
        ),
    ]  # fmt: skip
    for args, needle in cases:
        code = main(["score", *args, *settings(tmp_path)])
        err = capsys.readouterr().err
        assert code == 2, (args, err)
        assert len(err.strip().splitlines()) == 1, err
        assert needle in err, err
        assert "Traceback" not in err
    assert not (tmp_path / "mlflow.db").exists()  # scoring never creates a store
    assert not (tmp_path / "scores").exists()  # nothing half-written


def test_missing_alias_in_an_existing_store_exits_2(
    setup: tuple[Path, Path], tmp_path: Path, mlflow_env: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from mlflow import MlflowClient

    MlflowClient(tracking_uri=mlflow_env).search_experiments()  # creates the store
    capsys.readouterr()  # MLflow's own log lines about creating it
    for uri in ("models:/journey-conversion@champion", "models:/nope/3"):
        code = main(["score", "--model", uri, "--input", str(setup[0]), *settings(tmp_path)])
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"model {uri} not found" in err


# --- MLflow ---------------------------------------------------------------------------------


def test_champion_is_scored_and_the_run_logged(
    setup: tuple[Path, Path], tmp_path: Path, mlflow_env: str
) -> None:
    import mlflow
    from mlflow import MlflowClient

    journeys, model_dir = setup
    loaded = load_model(str(model_dir))
    mlflow.set_tracking_uri(mlflow_env)
    try:
        mlflow.set_experiment("journeys")
        with mlflow.start_run():
            info = log_model(loaded)
    finally:  # unpinned: a later test in this process reads MLFLOW_TRACKING_URI again
        mlflow.set_tracking_uri(None)
    client = MlflowClient(tracking_uri=mlflow_env)
    version = mlflow.register_model(info.model_uri, "journey-conversion").version
    client.set_registered_model_alias("journey-conversion", "champion", version)

    # The command line scores, then builds the report into the same MLflow run.
    assert main(["score", "--input", str(journeys), *settings(tmp_path)]) == 0
    run_id = read_metadata(tmp_path / "scores")["run_id"]
    scores = pl.read_parquet(tmp_path / "scores" / "*.parquet")
    assert scores["model_version"].unique().to_list() == [str(version)]
    assert scores["model_uri"].unique().to_list() == ["models:/journey-conversion@champion"]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["rows"] == str(scores.height)
    assert run.data.params["model_uri"] == "models:/journey-conversion@champion"
    logged = {a.path for a in client.list_artifacts(run_id, "attribution")}
    assert {"attribution/credit.csv", "attribution/credit_by_channel.png"} <= logged


def test_journeys_datasets_are_told_apart_from_raw_logs(
    setup: tuple[Path, Path], tmp_path: Path
) -> None:
    journeys, _ = setup
    assert is_journeys_dataset(journeys)
    bare = tmp_path / "bare"  # journeys without vocab.json: still journeys (lists inside)
    bare.mkdir()
    (bare / "part-00000.parquet").write_bytes((journeys / "part-00000.parquet").read_bytes())
    assert is_journeys_dataset(bare)
    raw = tmp_path / "raw"  # raw events that happen to be named part-*.parquet
    raw.mkdir()
    raw_log().write_parquet(raw / "part-00000.parquet")
    assert not is_journeys_dataset(raw)
    assert not is_journeys_dataset(tmp_path / "raw" / "part-00000.parquet")


def test_event_types_of_the_fixture_are_known() -> None:
    """Guard for the raw-log test: its known events must be in the fixture's vocabulary."""
    assert {"impression", "add_to_cart", "click", "search"} <= set(EVENT_TYPES)


def test_after_conversion_travels_with_the_model(setup: tuple[Path, Path], tmp_path: Path) -> None:
    """A model trained with `after_conversion: drop` rebuilds scoring journeys the same way."""
    journeys, _ = setup
    model = save_tiny_model(
        tmp_path / "model", Vocabularies.load(journeys), "journey.after_conversion=drop"
    )
    loaded = load_model(str(model))
    assert loaded.rules.after_conversion == "drop"
    current = config_for(tmp_path)  # the default: new_journey
    assert loaded.rules.ingest_config(current).journey.after_conversion == "drop"


# --- scoring mapped over workers -------------------------------------------------------


def split_into_parts(journeys: Path, folder: Path, n_parts: int) -> Path:
    """The same journeys as `n_parts` part files (as ingest's partitions lay them out)."""
    import shutil

    folder.mkdir()
    for name in ("vocab.json", "ingest_report.json"):
        shutil.copy(journeys / name, folder / name)
    frame = pl.read_parquet(journeys / "part-00000.parquet")
    part = frame.get_column("user_id").hash(seed=0) % n_parts
    for index in range(n_parts):
        frame.filter(part == index).write_parquet(folder / f"part-{index:05d}.parquet")
    return folder


def test_scores_are_identical_in_order_on_threads_or_processes_and_from_any_parts(
    setup: tuple[Path, Path], tmp_path: Path
) -> None:
    """The input is cut into chunks that depend on the data alone, each scored on its own
    (`ScoreChunk`) and mapped over workers: a pool of threads and one of spawned processes
    write the same files byte for byte, and those of scoring in order up to float rounding
    (a worker's one PyTorch thread sums in another order than two); the same journeys in
    four part files give the same rows to float precision (other batch neighbours)."""
    from journeys.score import chunks_in_pool, score_dataset

    journeys, model = setup
    four = split_into_parts(journeys, tmp_path / "four", 4)
    loaded = load_model(str(model))
    scored_at = {"scored_at": "2026-03-01T00:00:00+00:00"}  # one run's moment for all
    settings = dict(chunk_journeys=40, batch_size=16, progress=False, metadata=scored_at)
    outputs = {}
    for name, folder, map_chunks in (
        ("one part", journeys, None),
        ("in order", four, None),
        ("threads", four, chunks_in_pool("thread", 2)),
        ("processes", four, chunks_in_pool("process", 2)),
    ):
        out = tmp_path / name.replace(" ", "-")
        scored = score_dataset(loaded, folder, out, map_chunks=map_chunks, **settings)
        assert scored.rows == scored.journeys == 240
        outputs[name] = out
    files = sorted(p.name for p in outputs["in order"].iterdir())
    # A file per part (piece) each chunk holds: together they hold every part once.
    assert covered_parts(outputs["in order"]) == {
        p.name: count_rows([p]) for p in parquet_parts(four)
    }
    for name in ("threads", "processes"):
        assert sorted(p.name for p in outputs[name].iterdir()) == files
    for file in files:
        threads = pl.read_parquet(outputs["threads"] / file)
        assert threads.equals(pl.read_parquet(outputs["processes"] / file)), file
        assert_same_scores(threads, pl.read_parquet(outputs["in order"] / file))
    one = pl.read_parquet(outputs["one part"]).sort("journey_id")
    assert_same_scores(one, pl.read_parquet(outputs["in order"]).sort("journey_id"))


def covered_parts(scores: Path) -> dict[str, int]:
    """Input part name -> rows, over what every scores file in `scores` says it holds."""
    from journeys.datasets import chunk_facts

    covered: dict[str, int] = {}
    for path in sorted(scores.glob("*.parquet")):
        for key, _, rows in chunk_facts(path)["segments"]:
            name = key.split(":")[0]
            covered[name] = covered.get(name, 0) + rows
    return covered


def assert_same_scores(got: pl.DataFrame, expected: pl.DataFrame) -> None:
    """Every row and column equal, the model's floats to float precision."""
    floats = ["conversion_probability", "events_probability", "attention"]
    assert got.drop(floats).equals(expected.drop(floats))
    for probability in floats[:2]:
        np.testing.assert_allclose(got[probability], expected[probability], rtol=1e-5)
    np.testing.assert_allclose(
        got["attention"].explode(), expected["attention"].explode(), atol=1e-6
    )


def test_a_chunk_is_read_from_the_row_groups_that_hold_it(tmp_path: Path) -> None:
    """`read_rows` gives rows `start` to `start + count` of the parts read back to back,
    across part files and row groups, whatever row group it starts in."""
    from journeys.datasets import read_rows

    frame = pl.DataFrame({"journey_id": [f"j{i}" for i in range(100)], "n": range(100)})
    parts = []
    for index, (low, high) in enumerate(((0, 30), (30, 30), (30, 100))):  # one file empty
        parts.append(tmp_path / f"part-{index:05d}.parquet")
        frame.slice(low, high - low).write_parquet(parts[-1], row_group_size=7)
    for start, count in ((0, 100), (0, 10), (25, 10), (29, 2), (64, 36), (99, 1)):
        got = read_rows(parts, ["n"], start, count)
        assert got["n"].to_list() == list(range(start, start + count)), (start, count)


@pytest.mark.parametrize("total", [0, 1, 49, 50, 51, 67_393, 674_028])
def test_chunks_are_the_fewest_of_at_most_the_setting_and_equal_in_size(total: int) -> None:
    """Chunks cover the rows back to back, the fewest that hold at most `most` rows each,
    their sizes within one row of each other (no small last chunk idling a worker)."""
    from journeys.score import chunk_bounds

    most = 50 if total < 1000 else 50_000
    chunks = chunk_bounds(total, most)
    assert len(chunks) == -(-total // most)
    assert [first for first, _ in chunks] == list(
        itertools.accumulate((rows for _, rows in chunks[:-1]), initial=0)
    )[: len(chunks)]
    assert sum(rows for _, rows in chunks) == total
    sizes = {rows for _, rows in chunks}
    assert max(sizes, default=0) <= most and max(sizes, default=0) - min(sizes, default=0) <= 1


def test_a_model_with_journey_so_far_inputs_loads_back_and_scores_the_same(
    tmp_path: Path,
) -> None:
    """`model.journey_so_far` is saved with the model: loaded back, the encoder gives the
    network the inputs it was trained on and the probabilities are those of the model as
    it was saved; a model saved before the option loads without them."""
    import json

    from journeys.inputs import JOURNEY_SO_FAR, TIME_ENCODINGS
    from journeys.trained_model import PREPROCESSING

    data = journeys_folder(tmp_path / "journeys")
    vocabs = Vocabularies.load(data)
    frame = pl.read_parquet(data / "*.parquet")
    saved = tiny_model(vocabs, "model.journey_so_far=true")
    saved.save(tmp_path / "model")
    loaded = load_model(str(tmp_path / "model"))
    assert loaded.encoder.inputs.time.journey_so_far
    assert loaded.config.n_continuous == len(TIME_ENCODINGS) + len(JOURNEY_SO_FAR)
    np.testing.assert_allclose(loaded.predict_proba(frame), saved.predict_proba(frame), rtol=1e-6)

    older = save_tiny_model(tmp_path / "older", vocabs)
    settings = json.loads((older / PREPROCESSING).read_text())
    del settings["encoder"]["journey_so_far"]  # as a model saved before the option
    (older / PREPROCESSING).write_text(json.dumps(settings))
    assert not load_model(str(older)).encoder.inputs.time.journey_so_far

"""Attribution: Markov removal effects worked out by hand, first/last/linear rules,
attention aggregation, integrated gradients' completeness, the report and its command."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch
from test_score import config_for, journeys_folder, save_tiny_model, settings

from journeys.attribution import CONVERTED, METHODS, build_report
from journeys.cli import main
from journeys.inference import integrated_gradients
from journeys.model import JourneyTransformer, ModelConfig
from journeys.score import score_command
from journeys.vocab import Vocabularies

# Five journeys over two channels A and B (label 1 = converted):
#   J1: A B      -> conversion
#   J2: A        -> null
#   J3: B        -> conversion
#   J4: B        -> null
#   J5: A B A B  -> conversion
PATHS = [(["A", "B"], 1), (["A"], 0), (["B"], 1), (["B"], 0), (["A", "B", "A", "B"], 1)]


def scores_frame(paths: list[tuple[list[str], int]] = PATHS) -> pl.LazyFrame:
    """A scores-like frame: channel = the path, event_type = one type, uniform attention."""
    return pl.LazyFrame(
        {
            "journey_id": [f"j{i + 1}" for i in range(len(paths))],
            "conversion_probability": [0.5] * len(paths),
            "event_type": [["view"] * len(p) for p, _ in paths],
            "channel": [p for p, _ in paths],
            "attention": [[1.0 / len(p)] * len(p) for p, _ in paths],
            "label": [label for _, label in paths],
            "censored": [False] * len(paths),
        },
        schema_overrides={"attention": pl.List(pl.Float32), "label": pl.Int8},
    )


def test_markov_removal_effects_match_the_hand_calculation() -> None:
    """By hand, from the transition counts of PATHS:

    start -> A: 3 (J1, J2, J5)      start -> B: 2 (J3, J4)       => P(start->A) = 3/5, ->B 2/5
    A -> B: 3 (J1, J5 twice)        A -> null: 1 (J2)            => P(A->B) = 3/4, A->null 1/4
    B -> conv: 3 (J1, J3, J5)       B -> null: 1 (J4), B -> A: 1 (J5)
                                                           => P(B->conv) = 3/5, ->null 1/5, ->A 1/5
    Conversion probabilities a (from A), b (from B):
        a = 3/4 b,  b = 3/5 + 1/5 a  =>  b = 3/5 + 3/20 b  =>  b = (3/5) / (17/20) = 12/17,
        a = 9/17;  P(conv) = 3/5 a + 2/5 b = (27 + 24) / 85 = 51/85 = 3/5
        (= the observed 3 conversions in 5 journeys, as a fitted chain must give).
    Remove A (B -> A goes to null):  b' = 3/5,  P = 2/5 * 3/5 = 6/25;  RE_A = 1 - (6/25)/(3/5) = 3/5.
    Remove B (A -> B goes to null):  a' = 0,    P = 0;               RE_B = 1.
    Shares: A = (3/5) / (8/5) = 3/8 = 0.375,  B = 1 / (8/5) = 5/8 = 0.625.
    """
    report = build_report(scores_frame())  # by channel: event_type is one type throughout
    assert report.summary["markov_conversion_probability"]["channel"] == pytest.approx(
        3 / 5, abs=1e-9
    )
    removal = {
        row["touchpoint"]: row
        for row in report.tables["markov_removal_effects"].iter_rows(named=True)
    }
    assert removal["A"]["removal_effect"] == pytest.approx(3 / 5, abs=1e-9)
    assert removal["B"]["removal_effect"] == pytest.approx(1.0, abs=1e-9)
    assert removal["A"]["p_without"] == pytest.approx(6 / 25, abs=1e-9)
    assert removal["A"]["markov"] == pytest.approx(3 / 8, abs=1e-9)
    assert removal["B"]["markov"] == pytest.approx(5 / 8, abs=1e-9)

    transitions = {
        (r["from"], r["to"]): (r["count"], r["probability"])
        for r in report.tables["markov_transitions"].iter_rows(named=True)
    }
    assert transitions[("(start)", "A")] == (3, pytest.approx(3 / 5))
    assert transitions[("B", "A")] == (1, pytest.approx(1 / 5))
    assert transitions[("A", "(null)")] == (1, pytest.approx(1 / 4))

    # The same numbers reach the report's credit table.
    credit = report.credit
    markov = dict(zip(credit["touchpoint"], credit["markov"], strict=True))
    assert markov["A"] == pytest.approx(3 / 8, abs=1e-9)
    assert markov["B"] == pytest.approx(5 / 8, abs=1e-9)


def test_a_feature_constant_within_every_journey_is_skipped_unless_named() -> None:
    """A device per journey moves no credit between touchpoints: not in the default
    breakdown (the summary says so), still there when `attribution.by` names it."""
    from journeys.config import Attribution

    devices = [["mobile"] * len(path) for path, _ in PATHS]
    devices[1] = [None]  # a missing value is constant too
    scores = scores_frame().with_columns(device=pl.Series(devices))
    report = build_report(scores)
    assert report.credit["dimension"].unique().to_list() == ["channel"]
    # (event_type too: every journey here is views only.)
    assert report.summary["constant_features_skipped"] == ["event_type", "device"]
    named = build_report(scores, settings=Attribution(by=["channel", "device"])).credit
    assert sorted(named["dimension"].unique().to_list()) == ["channel", "device"]
    # One journey whose device changes is enough to keep it.
    devices[4] = ["mobile", "desktop", "mobile", "mobile"]
    varied = build_report(scores_frame().with_columns(device=pl.Series(devices)))
    assert sorted(varied.credit["dimension"].unique().to_list()) == ["channel", "device"]


def test_first_last_and_linear_on_a_tiny_example() -> None:
    """Converted journeys J1 (A B), J3 (B), J5 (A B A B):
    first touch A, B, A -> A 2/3, B 1/3;  last touch B, B, B -> B 1;
    linear: J1 A 1/2 B 1/2, J3 B 1, J5 A 1/2 B 1/2 -> A 1/3, B 2/3."""
    credit = {r["touchpoint"]: r for r in build_report(scores_frame()).credit.iter_rows(named=True)}
    assert credit["A"]["first_touch"] == pytest.approx(2 / 3)
    assert credit["B"]["first_touch"] == pytest.approx(1 / 3)
    assert credit["A"]["last_touch"] == 0.0
    assert credit["B"]["last_touch"] == pytest.approx(1.0)
    assert credit["A"]["linear"] == pytest.approx(1 / 3)
    assert credit["B"]["linear"] == pytest.approx(2 / 3)


def test_credit_columns_each_sum_to_one() -> None:
    credit = build_report(scores_frame()).credit
    for method in ("attention", "first_touch", "last_touch", "linear", "markov"):
        assert credit[method].sum() == pytest.approx(1.0), method
    # Uniform attention is linear credit.
    np.testing.assert_allclose(credit["attention"].to_numpy(), credit["linear"].to_numpy())


def test_attention_tables_by_event_type_channel_and_position() -> None:
    scores = pl.LazyFrame(
        {
            "journey_id": ["x", "y", "z"],
            "event_type": [["view", "cart"], ["view", "view", "cart"], ["view"]],
            "channel": [["A", None], ["B", "A", "A"], ["B"]],
            "attention": [[0.2, 0.8], [0.1, 0.3, 0.6], [1.0]],
            "label": [1, 1, 0],
            "censored": [False, False, False],
        },
        schema_overrides={"attention": pl.List(pl.Float32)},
    )
    tables = build_report(scores).tables
    converted = pl.col("outcome") == CONVERTED
    by_type = tables["attention_by_event_type"].filter(converted)
    cart = by_type.filter(pl.col("event_type") == "cart").row(0, named=True)
    assert cart["events"] == 2
    assert cart["attention"] == pytest.approx(1.4)
    assert cart["attention_share"] == pytest.approx(1.4 / 2)  # 2 converting journeys
    assert cart["lift"] == pytest.approx((1.4 / 2) / (2 / 5))
    by_channel = tables["attention_by_channel"].filter(converted)
    assert "(none)" in by_channel["channel"].to_list()  # a missing channel is a value
    by_position = tables["attention_by_position"].filter(converted)  # cap 20
    last = by_position.filter(pl.col("position_from_end") == 0).row(0, named=True)
    assert last["events"] == 2
    assert last["mean_attention"] == pytest.approx(0.7)


@pytest.mark.parametrize(("n_continuous", "wide"), [(0, False), (6, False), (6, True)])
def test_integrated_gradients_are_complete(n_continuous: int, wide: bool) -> None:
    """IG sums to logit(input) - logit(baseline), the baseline being padding embeddings
    (and no continuous input: time encodings are attributed to their event too); the wide
    part reads the same summed embeddings, so it is attributed to the events as well."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=9, feature_vocab_sizes=(5,), n_time_buckets=6, d_model=16)
    config = ModelConfig(
        **config.to_dict()
        | {"n_heads": 2, "max_len": 8, "n_continuous": n_continuous, "wide": wide}
    )
    model = JourneyTransformer(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.3 if param.dim() > 1 else 0.1)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    tokens = torch.randint(2, 9, mask.shape) * mask
    features = torch.randint(2, 5, (2, 1, 6)) * mask[:, None]
    buckets = torch.randint(1, 6, mask.shape) * mask
    continuous = torch.randn(2, n_continuous, 6) * mask[:, None] if n_continuous else None

    attributions = integrated_gradients(
        model, tokens, features, buckets, mask, steps=256, continuous=continuous
    )
    with torch.no_grad():
        logits = model(tokens, features, buckets, mask, continuous=continuous).logits
        # Every input module (events, time, features, the visit gap, continuous inputs).
        hooks = [e.register_forward_hook(lambda m, i, o: o * 0) for e in model.input_modules()]
        baseline = model(tokens, features, buckets, mask, continuous=continuous).logits
        for hook in hooks:
            hook.remove()
    assert (attributions[~mask] == 0).all()
    np.testing.assert_allclose(
        attributions.sum(dim=1).numpy(), (logits - baseline).numpy(), rtol=1e-2, atol=1e-3
    )


def test_attribute_command_writes_tables_plots_and_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    journeys = journeys_folder(tmp_path / "journeys", n=120)
    model = save_tiny_model(tmp_path / "model", Vocabularies.load(journeys))
    score_command(config_for(tmp_path), model_uri=str(model), input_path=str(journeys))
    assert not (tmp_path / "reports").exists()
    assert main(["attribute", *settings(tmp_path)]) == 0
    report = tmp_path / "reports"
    for table in (
        "credit",
        "attention_by_event_type",
        "attention_by_channel",
        "markov_transitions",
    ):
        assert (report / f"{table}.parquet").exists() and (report / f"{table}.csv").exists()
    for plot in ("credit_by_channel.png", "credit_by_device.png", "attention_examples.png"):
        assert (report / plot).read_bytes()[:4] == b"\x89PNG"
    credit = pl.read_parquet(report / "credit.parquet")
    assert credit.columns == ["dimension", "touchpoint", *METHODS]  # IG from the scores' model
    # By default event types and every feature the model read are dimensions; each one's
    # credit sums to 1.
    assert set(credit["dimension"]) == {"event_type", "channel", "device"}
    for (dimension,), part in credit.group_by("dimension"):
        for method in METHODS:
            assert part[method].sum() == pytest.approx(1.0), (dimension, method)
    printed = capsys.readouterr().out
    assert "credit by channel" in printed and "credit by device" in printed
    # Again on the same scores with the same settings (`journeys score` then `journeys
    # attribute`, as documented): the report is not built twice.
    stamp = (report / "credit.parquet").stat().st_mtime_ns
    assert main(["attribute", *settings(tmp_path)]) == 0
    assert "is up to date with these scores: not rebuilt" in capsys.readouterr().out
    assert (report / "credit.parquet").stat().st_mtime_ns == stamp

    # attribution.by chooses the breakdown; an unknown dimension is one line, exit 2.
    only = tmp_path / "by-device"
    args = ["attribute", "--out", str(only), "--set", "attribution.by=[device, event_type]"]
    assert main([*args, *settings(tmp_path)]) == 0
    chosen = pl.read_parquet(only / "credit.parquet")
    assert chosen["dimension"].unique(maintain_order=True).to_list() == ["device", "event_type"]
    markov = pl.read_parquet(only / "markov_removal_effects.parquet")
    assert set(markov["dimension"]) == {"device", "event_type"}
    assert not (only / "credit_by_channel.png").exists()
    capsys.readouterr()
    code = main(["attribute", "--set", "attribution.by=[campaign]", *settings(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "attribution.by" in err

    code = main(["attribute", "--scores", str(tmp_path / "nowhere"), *settings(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "scores not found" in err


def test_by_default_credit_is_by_event_type_and_every_feature_with_the_same_touchpoints() -> None:
    """Event types beside the features (a feature does not hide them), and the rare
    touchpoints lumped into `(other)` for every method alike, not for the Markov column
    alone: the columns compare, each summing to one over the same touchpoints."""
    from journeys.config import Attribution

    events = [["view", "click"][: len(p)] + ["view"] * (len(p) - 2) for p, _ in PATHS]
    scores = scores_frame().with_columns(event_type=pl.Series(events))
    report = build_report(scores)
    assert report.credit["dimension"].unique(maintain_order=True).to_list() == [
        "event_type", "channel",
    ]  # fmt: skip
    rare = [[f"C{i}" for i in range(len(p))] for p, _ in PATHS]  # 10 touchpoints, most once
    lumped = build_report(
        scores_frame().with_columns(channel=pl.Series(rare)),
        settings=Attribution(by=["channel"], markov_max_states=3),
    ).credit
    assert sorted(lumped["touchpoint"].to_list()) == ["(other)", "C0", "C1"]
    for method in ("attention", "first_touch", "last_touch", "linear", "markov"):
        assert lumped[method].sum() == pytest.approx(1.0), method
    for method in ("attention", "linear", "markov"):  # every touch takes a share
        assert lumped.filter(pl.col("touchpoint") == "(other)")[method].item() > 0, method


def test_a_report_from_kept_sums_equals_one_from_nothing_and_reads_only_what_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each scores file's sums are kept beside the report: the next report reads only the
    files that changed (a nightly scoring rewrites a few) and equals one built from
    nothing, also when `attribution.window` cuts into the files; integrated gradients
    explain only the journeys new to the sample."""
    from polars.testing import assert_frame_equal

    from journeys import attribution
    from journeys.attribution import attribute_command, read_report
    from journeys.config import Attribution
    from journeys.datasets import scan_scores
    from journeys.storage import file_key

    journeys = journeys_folder(tmp_path / "journeys", n=240)
    model = save_tiny_model(tmp_path / "model", Vocabularies.load(journeys))
    config = config_for(tmp_path, "score.chunk_journeys=40", "attribution.window=null")
    score_command(config, model_uri=str(model), input_path=str(journeys))
    files = sorted((tmp_path / "scores").glob("*.parquet"))
    assert len(files) == 6
    attribute_command(config)

    read: list[int] = []  # files whose sums were worked out (by number) in each report
    report_sums = attribution.report_sums

    def recording(scores: pl.LazyFrame, by: tuple[str, ...] = (), **options: bool) -> dict:
        read.append(scores.select(pl.col("file").n_unique()).collect().item())
        return report_sums(scores, by, **options)

    monkeypatch.setattr(attribution, "report_sums", recording)
    explained: list[str] = []
    explain = attribution.integrated_gradients_frame

    def counting(trained: object, frame: pl.DataFrame) -> pl.Series:
        explained.extend(frame.get_column("journey_id"))
        return explain(trained, frame)  # type: ignore[arg-type]

    monkeypatch.setattr(attribution, "integrated_gradients_frame", counting)
    sampled: list[set[str]] = []  # the sample's journeys whose rows each report read
    rows_of = attribution.rows_of

    def reading(
        journeys: pl.LazyFrame,
        ids: pl.Series,
        files: list[Path] | None = None,
        located: pl.DataFrame | None = None,
    ) -> pl.DataFrame:
        if located is not None:  # the sample's (the examples' are found afresh)
            sampled.append(set(ids))
        return rows_of(journeys, ids, files, located)

    monkeypatch.setattr(attribution, "rows_of", reading)

    def equal_to_one_from_nothing(settings: object, out: Path) -> None:
        kept = read_report(tmp_path / "reports")
        fresh = attribute_command(settings, out=out)  # type: ignore[arg-type]
        assert kept is not None and sorted(kept.tables) == sorted(fresh.tables)
        for name, table in fresh.tables.items():
            # Float noise only: integrated gradients of a journey vary by about 1e-7 with
            # its batch-mates (padding), and sums add up in another order.
            assert_frame_equal(kept.tables[name], table, check_dtypes=False, rel_tol=1e-5)
        assert kept.summary["journeys_by_outcome"] == fresh.summary["journeys_by_outcome"]

    # The next night: one file re-scored (its attention changed, and one converting
    # journey's channels: the model reads them), one gone.
    converting = (pl.col("label") == 1) & ~pl.col("censored")
    changed = next(f for f in files if pl.read_parquet(f).filter(converting).height)
    gone = next(f for f in files if f != changed)
    metadata = pl.read_parquet_metadata(changed)
    scores = pl.read_parquet(changed).with_columns(pl.col("attention").list.reverse())
    moved = scores.filter(converting).get_column("journey_id")[0]
    scores = scores.with_columns(
        channel=pl.when(pl.col("journey_id") == moved)
        .then(pl.col("channel").list.eval(pl.lit("email")))
        .otherwise("channel")
    )
    scores.write_parquet(changed, metadata=metadata)
    gone.unlink()
    attribute_command(config)
    assert read == [1]  # the changed file (its attention and channels differ: see below)
    assert explained == [moved]  # the others are the same journeys, explained before
    # ... and only those of the changed file were read again: a journey in a file that did
    # not change is the row explained then.
    assert moved in sampled[-1] <= set(pl.read_parquet(changed).get_column("journey_id"))
    equal_to_one_from_nothing(config, tmp_path / "fresh")

    # A window that starts inside the data: the files it cuts into are read again with
    # the new cut, those it leaves whole are kept, those before it are not opened.
    ends = pl.read_parquet(tmp_path / "scores").select(
        end=pl.col("event_time").list.last(), as_of="as_of"
    )
    days = (ends["as_of"].max() - ends["end"].median()).days  # type: ignore[operator]
    windowed = config_for(tmp_path, "score.chunk_journeys=40", f"attribution.window={days}d")
    read.clear()
    attribute_command(windowed)
    since = ends["as_of"].max() - timedelta(days=days)  # type: ignore[operator]
    earliest = {
        file_key(path): pl.read_parquet(path)["event_time"].list.last().min()
        for path in sorted((tmp_path / "scores").glob("*.parquet"))
    }
    cut = {key for key, end in earliest.items() if end < since}
    cut_at = dict(
        pl.read_parquet(tmp_path / "reports" / "_sums" / "files.parquet")
        .select("file", "since")
        .iter_rows()
    )
    # Read again with the new cut: the files in the window that it cuts into (those wholly
    # before it are not opened at all).
    recut = {key for key, at in cut_at.items() if at is not None}
    assert recut and recut <= cut and sum(read) == len(recut)
    assert set(earliest) - cut, "some file lies wholly inside the window and is kept"
    equal_to_one_from_nothing(windowed, tmp_path / "fresh-windowed")

    # A window with no journey in it (scores read later than the data), by a named feature.
    empty = build_report(
        scan_scores(tmp_path / "scores"),
        sums=attribution.scores_sums(
            tmp_path / "scores", ends["as_of"].max() + timedelta(days=1), {}, 40
        ),  # type: ignore[operator]
        settings=Attribution(by=["channel"], ig_sample=0),
    )
    assert empty.summary["journeys"] == 0 and "note" in empty.summary

    # Files read a batch at a time (here one each) or all at once: the same sums.
    one_by_one = attribution.scores_sums(tmp_path / "scores", None, {}, 40)
    at_once = attribution.scores_sums(tmp_path / "scores", None, {}, 10_000)
    for name in attribution.SUM_TABLES:
        table = attribution.added_up(one_by_one)[name]
        other = attribution.added_up(at_once)[name]
        assert_frame_equal(table.sort(pl.all()), other.sort(pl.all()), check_exact=False)

    # The window widened again: the files it had cut are read whole, and the converting
    # journeys that come back into the sample are explained again (they left it).
    read.clear()
    explained.clear()
    attribute_command(config)
    assert sum(read) == len(cut)
    back = pl.read_parquet(tmp_path / "scores").filter(
        pl.col("event_time").list.last() < since, pl.col("label") == 1, ~pl.col("censored")
    )
    assert sorted(explained) == sorted(back.get_column("journey_id")) != []
    equal_to_one_from_nothing(config, tmp_path / "fresh-whole")

    # Sums kept by another version of journeys (another layout) are not reused.
    files_kept = tmp_path / "reports" / "_sums" / "files.parquet"
    pl.read_parquet(files_kept).drop("version").write_parquet(files_kept)
    assert attribution.read_sums(tmp_path / "reports") == {}

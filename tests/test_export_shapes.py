"""The shapes teams really export, each from a small committed file (data/samples/shapes/,
written by its make.py): a conversion flag column, a header renamed between daily files,
text and minute-precision timestamps, events sharing a second, a short export, and the
skew warnings."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import polars as pl
import pytest
from test_ingest import assert_accounting, config_for
from test_log_shapes import cli_ingest

from journeys.cli import main
from journeys.config import load_config
from journeys.ingest import ingest, run_ingest

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "data" / "samples" / "shapes"


def test_the_committed_samples_are_what_make_writes(tmp_path: Path) -> None:
    """The files are reproducible: make.py, run into a copy of the folder, writes the same
    bytes (so a reader can trust the shapes the docstring describes)."""
    import shutil
    import subprocess
    import sys

    copy = tmp_path / "shapes"
    shutil.copytree(SHAPES, copy)
    subprocess.run([sys.executable, str(copy / "make.py")], check=True, cwd=tmp_path)
    for path in SHAPES.rglob("*.csv"):
        assert (copy / path.relative_to(SHAPES)).read_bytes() == path.read_bytes(), path.name


# --- 1. the conversion as a flag column -------------------------------------------------------


def ad_clicks_config(tmp: Path, *extra: str):
    return load_config(
        ROOT / "conf" / "ad_clicks.yaml",
        [f"paths.journeys={tmp / 'journeys'}", f"paths.quarantine={tmp / 'quarantine'}", *extra],
    )


def test_a_conversion_flag_column_labels_the_journey_of_its_touch(tmp_path: Path) -> None:
    clicks = pl.read_csv(SHAPES / "ad_clicks" / "clicks.csv", infer_schema=False)
    flagged = clicks.filter(pl.col("is_attributed") == "1")
    result = run_ingest(ad_clicks_config(tmp_path))
    report, journeys = result.report, result.journeys
    assert_accounting(report)
    assert report.rows_read == report.rows_valid == clicks.height
    # Every flagged click converts its journey; every click stays in a journey's sequence.
    assert report.journeys_converted == flagged.height > 100
    assert journeys["n_events_total"].sum() == clicks.height
    (source,) = report.sources
    assert report.by_source[source] == {
        "rows": clicks.height,
        "quarantined": 0,
        "quarantined_by_reason": {},
        "conversions": flagged.height,
    }
    # The converting click is the journey's last event, and the journey ends at the
    # conversion's own time (attributed_time), not the click's.
    converted = journeys.filter(pl.col("label") == 1)
    last_click = converted.select(pl.col("event_time").list.last()).to_series()
    assert (converted["end_time"] > last_click).all()
    expected_end = flagged.select(
        pl.col("attributed_time").str.to_datetime(time_zone="UTC", time_unit="us")
    ).to_series()
    assert sorted(converted["end_time"].to_list()) == sorted(expected_end.to_list())
    assert "conversion" not in journeys["event_type"].explode().to_list()  # never an input


def test_a_flagged_click_without_a_conversion_time_converts_at_its_own(tmp_path: Path) -> None:
    clicks = pl.read_csv(SHAPES / "ad_clicks" / "clicks.csv", infer_schema=False).head(400)
    clicks.with_columns(attributed_time=pl.lit("")).write_csv(tmp_path / "clicks.csv")
    journeys = run_ingest(
        ad_clicks_config(tmp_path, f"paths.raw={tmp_path / 'clicks.csv'}")
    ).journeys
    converted = journeys.filter(pl.col("label") == 1)
    assert converted.height == clicks["is_attributed"].cast(int).sum() > 0
    assert (converted["end_time"] == converted["event_time"].list.last()).all()


def test_an_unreadable_conversion_time_is_quarantined_not_guessed(tmp_path: Path) -> None:
    clicks = pl.read_csv(SHAPES / "ad_clicks" / "clicks.csv", infer_schema=False).head(400)
    broken = pl.when(pl.col("is_attributed") == "1").then(pl.lit("yesterday"))
    clicks.with_columns(attributed_time=broken.otherwise(pl.lit(""))).write_csv(
        tmp_path / "clicks.csv"
    )
    # Every conversion is quarantined: the log has none left, which ingest allows only so.
    report = ingest(
        ad_clicks_config(
            tmp_path, f"paths.raw={tmp_path / 'clicks.csv'}", "ingest.require_conversions=false"
        )
    )
    assert_accounting(report)
    assert report["quarantined"]["bad_timestamp"] == clicks["is_attributed"].cast(int).sum()
    assert report["journeys_converted"] == 0


@pytest.mark.slow
def test_the_flag_sample_ingests_and_trains_end_to_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    sets = [
        f"paths.raw={SHAPES / 'ad_clicks' / 'clicks.csv'}",
        f"paths.journeys={tmp_path / 'journeys'}",
        f"paths.quarantine={tmp_path / 'quarantine'}",
        f"paths.checkpoints={tmp_path / 'checkpoints'}",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "train.accelerator=cpu",
        "train.num_workers=0",
        "train.baselines=[logreg]",
    ]
    args = [arg for s in sets for arg in ("--set", s)]
    config = ["--config", str(ROOT / "conf" / "ad_clicks.yaml")]
    assert main(["ingest", *config, *args]) == 0
    from journeys.train import train_command

    result = train_command(load_config(ROOT / "conf" / "ad_clicks.yaml", sets))
    assert result.metrics["n_test"] > 150
    # The app advertised and the number of clicks decide (make.py): learnable.
    assert result.metrics["test_roc_auc"] > 0.6  # 0.71 with hgb_aggregates at 0.76
    assert result.promoted  # above chance on val, and no baseline ahead of it there

    # The champion scores the raw clicks with its own rules: the flag is read again.
    raw = str(SHAPES / "ad_clicks" / "clicks.csv")
    out = tmp_path / "scores"
    assert main(["score", *config, *args, "--input", raw, "--out", str(out)]) == 0
    scores = pl.read_parquet(out)
    assert (
        scores.height
        == result.metrics["n_train"]
        + result.metrics["n_val"]
        + (result.metrics["n_test"])
        + scores.filter(pl.col("split") == "none").height
    )
    mean = (
        scores.filter(pl.col("split") != "none")
        .group_by("label")
        .agg(pl.col("conversion_probability").mean())
    )
    by_label = dict(mean.iter_rows())
    assert by_label[1] > by_label[0]


# --- 2. a header renamed between files ---------------------------------------------------------


def test_column_aliases_read_a_folder_whose_header_changed(tmp_path: Path) -> None:
    folder = SHAPES / "renamed_daily"
    aliases = ["data.columns={user_id: [client_id, clientId], event_type: event}"]
    config = config_for(folder, tmp_path, *aliases)
    result = run_ingest(config)
    report, journeys = result.report, result.journeys
    assert_accounting(report)
    days = sorted(folder.glob("*.csv"))
    rows = {str(p): pl.read_csv(p).height for p in days}
    assert {s: c["rows"] for s, c in report.by_source.items()} == rows
    assert report.quarantined_total == 0
    assert report.users == 40  # one user, whatever the header called the column
    # The last day has no device column: its events carry a missing device, not an error.
    events = journeys.select("event_time", "device").explode("event_time", "device")
    last_day = pl.col("event_time") >= pl.datetime(2017, 11, 8, time_zone="UTC")
    assert events.filter(last_day)["device"].is_null().all()
    assert events.filter(~last_day)["device"].is_not_null().all()
    assert events.filter(last_day).height > 0


def test_without_the_alias_the_error_lists_what_the_file_has(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli_ingest(
        SHAPES / "renamed_daily", tmp_path, "data.columns={user_id: client_id, event_type: event}"
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "day-2017-11-07.csv: missing column(s) client_id (user_id)" in err[0]
    assert "the file has: clientId, timestamp, event, channel, device" in err[0]
    assert "a list gives a column's other names" in err[0]


def test_a_feature_no_file_has_is_still_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    aliases = "data.columns={user_id: [client_id, clientId], event_type: event}"
    code = cli_ingest(
        SHAPES / "renamed_daily", tmp_path, aliases, "data.features=[channel, region]"
    )
    assert code == 2
    err = capsys.readouterr().err
    assert "missing column(s) region (region)" in err and "drop it from data.features" in err


# --- 3. timestamps -------------------------------------------------------------------------------


def test_timestamp_format_reads_text_times_in_the_log_zone(tmp_path: Path) -> None:
    config = config_for(
        SHAPES / "text_times.csv",
        tmp_path,
        "data.features=[]",
        "data.timestamp_format=%d/%m/%Y %H:%M",
        "data.timezone=Europe/Paris",
    )
    journeys = run_ingest(config).journeys.sort("start_time")
    assert journeys["start_time"].dt.to_string("%Y-%m-%d %H:%M").to_list() == [
        "2017-11-07 08:30",  # 9:30 in Paris is 8:30 UTC
        "2017-11-08 17:05",
    ]


def test_an_hour_only_timestamp_format_reads(tmp_path: Path) -> None:
    """`%Y-%m-%d %H` (hourly exports): Polars reads an hour only with its minute, so the
    product supplies one; every row reads, in the log's zone."""
    raw = tmp_path / "hourly.csv"
    raw.write_text(
        "user_id,timestamp,event_type\n"
        "u1,2026-03-02 09,view\nu1,2026-03-02 10,click\nu1,2026-03-02 23,purchase\n"
    )
    config = config_for(
        raw, tmp_path, "data.features=[]", "data.timestamp_format=%Y-%m-%d %H",
        "data.timezone=Europe/Paris", "ingest.require_conversions=false",
    )  # fmt: skip
    result = run_ingest(config)
    assert result.report.quarantined_total == 0
    (journey,) = result.journeys.iter_rows(named=True)
    assert [t.strftime("%d %H:%M") for t in journey["event_time"]] == ["02 08:00", "02 09:00"]
    assert journey["end_time"].strftime("%d %H:%M") == "02 22:00"  # the purchase, 23h Paris


def test_without_timestamp_format_the_error_shows_a_value_and_the_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_ingest(SHAPES / "text_times.csv", tmp_path, "data.features=[]") == 2
    err = capsys.readouterr().err.strip()
    assert "most as bad_timestamp" in err
    assert "'07/11/2017 9:30' reads with data.timestamp_format: '%d/%m/%Y %H:%M'" in err


def test_iso_8601_without_seconds_and_with_any_offset_is_read(tmp_path: Path) -> None:
    config = config_for(SHAPES / "iso_minutes.csv", tmp_path, "data.features=[]")
    result = run_ingest(config)
    assert result.report.quarantined_total == 0
    (journey,) = result.journeys.iter_rows(named=True)
    assert [t.strftime("%H:%M:%S") for t in journey["event_time"]] == [
        "08:33:00",  # 09:33+01:00
        "09:31:00",  # 09:31Z
        "09:35:00",  # naive: data.timezone (UTC)
    ]
    assert journey["end_time"].strftime("%H:%M:%S.%f") == "09:40:30.250000"


# --- 4. order within the same second -------------------------------------------------------------


def session_config(raw: Path, tmp: Path, *extra: str):
    columns = "data.columns={user_id: session, event_type: action"
    return config_for(
        raw, tmp, "data.features=[]", "data.conversion_events=[clickout]", "journey.max_gap=30m",
        *([f"{columns}, sequence: step}}"] if "sequence" in extra else [f"{columns}}}"]),
        *(e for e in extra if e != "sequence"),
    )  # fmt: skip


def test_same_second_events_follow_the_sequence_column_or_the_file_order(tmp_path: Path) -> None:
    shuffled = SHAPES / "same_second.csv"
    in_order = tmp_path / "in_order.csv"
    pl.read_csv(shuffled).sort("session", "step").write_csv(in_order)
    expected = pl.read_csv(in_order).filter(pl.col("action") != "clickout")
    expected = expected.group_by("session", maintain_order=True).agg("action")

    def sequences(raw: Path, out: str, *extra: str) -> pl.DataFrame:
        journeys = run_ingest(session_config(raw, tmp_path / out, *extra)).journeys
        return journeys.sort("user_id").select(session="user_id", action="event_type")

    by_step = sequences(shuffled, "a", "sequence")
    by_file_order = sequences(in_order, "b")
    assert by_step.equals(expected) and by_file_order.equals(expected)
    assert (
        run_ingest(session_config(shuffled, tmp_path / "c", "sequence")).report.journeys_converted
        == pl.read_csv(shuffled)["session"].n_unique()
    )
    # Shuffled rows without the sequence column: the file's order, wrong here. Never the
    # event's name (which would put every `clickout` before the `search` of its second).
    assert not sequences(shuffled, "d").equals(expected)


def test_a_sequence_that_is_not_a_number_is_quarantined(tmp_path: Path) -> None:
    log = pl.read_csv(SHAPES / "same_second.csv", infer_schema=False)
    log.with_columns(
        step=pl.when(pl.col("step") == "2").then(pl.lit("two")).otherwise("step")
    ).write_csv(tmp_path / "log.csv")
    report = ingest(session_config(tmp_path / "log.csv", tmp_path, "sequence"))
    assert_accounting(report)
    assert report["quarantined"]["bad_sequence"] == (log["step"] == "2").sum() > 0


# --- 5. a short export ---------------------------------------------------------------------------


def test_a_short_export_warns_and_train_refuses_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_ingest(SHAPES / "short_export.csv", tmp_path) == 0
    err = capsys.readouterr().err
    assert "take no split: they end within journey.max_gap (7d)" in err
    assert "the log spans 3.0 days" in err or "the log spans 2.9 days" in err
    report = json.loads((tmp_path / "journeys" / "ingest_report.json").read_text())
    assert report["short_export"] in report["warnings"]

    code = main(["train", "--set", f"paths.journeys={tmp_path / 'journeys'}"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lower journey.max_gap" in err[0] and "data.observed_until" in err[0]
    assert "split.fractions" not in err[0]  # the wrong fix before

    assert cli_ingest(SHAPES / "short_export.csv", tmp_path / "short", "journey.max_gap=2h") == 0
    report = json.loads((tmp_path / "short" / "journeys" / "ingest_report.json").read_text())
    assert report["short_export"] is None
    assert min(report["journeys_by_split"][s] for s in ("train", "val", "test")) > 20


# --- 6. skew ---------------------------------------------------------------------------------------


def test_a_placeholder_user_and_a_file_with_more_quarantine_are_warned_about(
    tmp_path: Path,
) -> None:
    days = sorted((SHAPES / "renamed_daily").glob("*.csv"))
    first = pl.read_csv(days[0], infer_schema=False)
    placeholder = first.with_columns(client_id=pl.lit("anonymous")).head(150)
    pl.concat([first, placeholder]).write_csv(tmp_path / "a.csv")
    broken = pl.read_csv(days[1], infer_schema=False)
    broken.with_columns(timestamp=pl.lit("n/a")).head(30).vstack(broken).write_csv(
        tmp_path / "b.csv"
    )
    config = config_for(
        tmp_path,
        tmp_path / "out",
        "data.columns={user_id: [client_id, clientId], event_type: event}",
    )
    warnings = ingest(config)["warnings"]
    assert any(
        f"user id 'anonymous' holds {placeholder.height} of" in w and "data.exclude_users" in w
        for w in warnings
    )
    assert any(w.startswith(f"{tmp_path / 'b.csv'}: 30 of ") for w in warnings)
    assert not any(str(tmp_path / "a.csv") in w for w in warnings)

    excluded = ingest(
        config_for(
            tmp_path, tmp_path / "ex",
            "data.columns={user_id: [client_id, clientId], event_type: event}",
            "data.exclude_users=[anonymous]",
        )
    )  # fmt: skip
    assert_accounting(excluded)
    assert excluded["dropped_by_config"] == placeholder.height
    assert not any("anonymous" in w for w in excluded["warnings"])


def test_conversions_that_label_no_journey_are_warned_about(tmp_path: Path) -> None:
    log = pl.read_csv(SHAPES / "same_second.csv")
    # Conversions logged under another id than the touches: none labels a journey.
    log.with_columns(
        session=pl.when(pl.col("action") == "clickout")
        .then(pl.concat_str(pl.lit("x"), "session"))
        .otherwise("session")
    ).write_csv(tmp_path / "log.csv")
    warnings = ingest(session_config(tmp_path / "log.csv", tmp_path, "sequence"))["warnings"]
    assert any("conversions (100%) label no journey" in w for w in warnings)


# --- 7. messages and defaults --------------------------------------------------------------------


def test_the_default_features_do_not_trip_a_log_without_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`data.features` unset: the defaults the log has (none here), said in a warning after
    the report; train reads them from the journeys. Named explicitly, a missing one is
    still an error."""
    from journeys.datasets import dataset_features
    from journeys.vocab import Vocabularies

    assert cli_ingest(SHAPES / "iso_minutes.csv", tmp_path) == 0
    err = capsys.readouterr().err
    assert "the default features ['channel', 'device'] are not in the log" in err
    assert Vocabularies.load(tmp_path / "journeys").features == []
    config = load_config(None, [f"paths.journeys={tmp_path / 'journeys'}"])
    assert config.data.features == ["channel", "device"] and not config.data.features_given
    assert dataset_features(config).data.features == []

    named = cli_ingest(SHAPES / "iso_minutes.csv", tmp_path / "b", "data.features=[channel]")
    assert named == 2
    assert "missing column(s) channel (channel)" in capsys.readouterr().err


def test_a_yaml_number_where_text_is_expected_says_to_quote_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["ingest", "--set", "data.conversion_events=[2024]"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "2024 is read as a number, not text: quote it ('2024')" in err


def test_an_unknown_file_extension_names_data_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "events.log").write_text("user_id,timestamp,event_type\n")
    assert cli_ingest(tmp_path / "events.log", tmp_path) == 2
    err = capsys.readouterr().err
    assert "unsupported file type '.log'" in err and "data.format" in err


def test_with_a_flag_and_after_conversion_drop_only_log_rows_are_counted_dropped(
    tmp_path: Path,
) -> None:
    """Two flagged clicks and a third in one visit: the second and third are the converted
    journey's aftermath (dropped and counted); the conversions a flag adds are no rows."""
    clicks = pl.DataFrame(
        {
            "ip": ["1", "1", "1"],
            "app": ["a", "b", "c"],
            "channel": ["x", "x", "x"],
            "os": ["o", "o", "o"],
            "click_time": ["2017-11-06 10:00:00", "2017-11-06 10:05:00", "2017-11-06 10:09:00"],
            "attributed_time": ["", "", ""],
            "is_attributed": ["1", "1", "0"],
        }
    )
    clicks.write_csv(tmp_path / "clicks.csv")
    report = ingest(
        ad_clicks_config(
            tmp_path, f"paths.raw={tmp_path / 'clicks.csv'}", "journey.after_conversion=drop"
        )
    )
    assert_accounting(report)
    assert report["dropped_by_config"] == report["dropped_after_conversion"] == 2
    assert report["rows_valid"] == report["events_in_journeys"] == 1
    assert report["journeys_converted"] == 1


def test_a_feature_that_reads_the_flag_is_refused_as_the_label() -> None:
    from journeys.config import Data

    flag = {"column": "is_attributed", "values": ["1"], "time": "attributed_time"}
    for settings in (
        {"features": ["is_attributed"]},
        {"features": ["when"], "columns": {"when": ["attributed_time"]}},
        {"numeric_features": ["from_flag"]},
    ):
        with pytest.raises(ValueError, match=r"label|cannot be named"):
            Data(conversion_flag=flag, conversion_events=[], **settings)


def test_unset_features_stay_unset_when_the_configuration_travels_as_a_dict() -> None:
    """Flows hand the configuration to deployments and training subprocesses as a dict:
    `data.features` unset must still mean the defaults the log has."""
    from journeys.config import Config

    travelled = Config.model_validate(load_config(None, []).model_dump(mode="json"))
    assert not travelled.data.features_given
    named = load_config(None, ["data.features=[channel]"]).model_dump(mode="json")
    assert Config.model_validate(named).data.features == ["channel"]


# --- repeat conversions ---------------------------------------------------------------------


REPEATS = (
    "user_id,timestamp,event_type\n"
    # u1: a search, a clickout, a second and a third clickout, then a search and a clickout
    "u1,2026-03-02T09:00:00Z,search\nu1,2026-03-02T09:01:00Z,clickout\n"
    "u1,2026-03-02T09:02:00Z,clickout\nu1,2026-03-02T09:03:00Z,clickout\n"
    "u1,2026-03-02T09:10:00Z,search\nu1,2026-03-02T09:11:00Z,clickout\n"
    # u2: a clickout with nothing before it at all (an orphan, not a repeat)
    "u2,2026-03-02T10:00:00Z,clickout\n"
)


@pytest.mark.parametrize("mode", ["with_previous", "new_journey"])
def test_repeat_conversions_are_counted_as_such_and_a_setting_says_what_they_are(
    tmp_path: Path, mode: str
) -> None:
    raw = tmp_path / "clickouts.csv"
    raw.write_text(REPEATS)
    config = config_for(
        raw, tmp_path, "data.features=[]", "data.conversion_events=[clickout]",
        f"journey.repeat_conversions={mode}", "journey.max_gap=1h",
        "data.observed_until=2026-03-03T00:00:00Z",
    )  # fmt: skip
    result = run_ingest(config)
    report = result.report
    assert_accounting(report)
    assert report.repeat_conversions == 2  # the second and third clickouts of u1
    journeys = result.journeys.filter(pl.col("user_id") == "u1").sort("start_time")
    warnings = " ".join(report.warnings)
    if mode == "with_previous":
        assert journeys["event_type"].to_list() == [["search"], ["search"]]
        assert report.conversions_without_journey == 3  # two repeats and u2's orphan
        assert "2 of 5 conversions (40%) come straight after another conversion" in warnings
        assert "journey.repeat_conversions: new_journey" in warnings
        # u2's orphan alone is what may point at the user id or max_gap.
        assert "1 of 5 conversions (20%) label no journey" in warnings
    else:
        # The repeats start the next journey: the last clickout labels it.
        assert journeys["event_type"].to_list() == [["search"], ["clickout", "clickout", "search"]]
        assert journeys["label"].to_list() == [1, 1]
        assert report.conversions_without_journey == 1
        assert "come straight after another conversion" not in warnings


def test_journeys_starting_at_one_instant_get_ids_of_their_own(tmp_path: Path) -> None:
    """An export stamped to the minute: within one minute u1 searches and clicks out, then
    views a hotel and books it, so both journeys start at the same instant; each still has
    an id of its own, and a journey alone at its instant keeps the plain id."""
    raw = tmp_path / "clickouts.csv"
    raw.write_text(
        "user_id,timestamp,event_type\n"
        "u1,2026-03-02T09:00:00Z,search\nu1,2026-03-02T09:00:00Z,clickout\n"
        "u1,2026-03-02T09:00:00Z,view\nu1,2026-03-02T09:00:00Z,booking\n"
        "u1,2026-03-02T09:30:00Z,search\n"
    )
    config = config_for(
        raw, tmp_path, "data.features=[]", "data.conversion_events=[clickout, booking]",
        "journey.max_gap=1h", "data.observed_until=2026-03-03T00:00:00Z",
    )  # fmt: skip
    result = run_ingest(config)
    assert_accounting(result.report)
    journeys = result.journeys.sort("journey_id")
    start = int(datetime(2026, 3, 2, 9, tzinfo=UTC).timestamp() * 1_000_000)
    later = start + 30 * 60 * 1_000_000
    assert journeys["journey_id"].to_list() == [f"u1-{start}", f"u1-{start}-1", f"u1-{later}"]
    assert journeys["label"].to_list() == [1, 1, 0]
    assert journeys["event_type"].to_list() == [["search"], ["view"], ["search"]]


def test_a_file_quarantined_far_more_than_the_others_is_named_with_its_commonest_reason(
    tmp_path: Path,
) -> None:
    """Not "a changed header?" when the file lost its user ids: the warning names the
    reason most of its rows were quarantined for, their count and that reason's fix."""
    raw = tmp_path / "days"
    raw.mkdir()
    good = "".join(f"u{i},2026-03-02T09:{i % 60:02d}:00Z,view\n" for i in range(200))
    (raw / "day-1.csv").write_text("user_id,timestamp,event_type\n" + good)
    anonymous = "".join(f",2026-03-03T09:{i % 60:02d}:00Z,view\n" for i in range(60))
    bad_times = "".join(f"u{i},not a time,view\n" for i in range(5))
    (raw / "day-2.csv").write_text(
        "user_id,timestamp,event_type\n" + anonymous + bad_times + good.replace("03-02", "03-03")
    )
    config = config_for(raw, tmp_path, "data.features=[]", "ingest.require_conversions=false")
    report = run_ingest(config).report
    source = next(s for s in report.by_source if s.endswith("day-2.csv"))
    assert report.by_source[source]["quarantined_by_reason"] == {
        "bad_timestamp": 5,
        "missing_user_id": 60,
    }
    (warning,) = [w for w in report.warnings if "day-2.csv" in w]
    assert "65 of 265 rows (25%) quarantined, against 0.0% in the other files" in warning
    assert "most as missing_user_id (60 rows): check data.columns.user_id" in warning


def test_a_feature_missing_from_a_whole_split_is_warned_about(tmp_path: Path) -> None:
    """`referrer` on most train events and on none of the later ones (the column left the
    export): the report has each split's share and a warning names the feature."""
    rows = ["user_id,timestamp,event_type,referrer"]
    for day in range(1, 29):
        for user in range(12):
            referrer = "google" if day < 18 else ""
            stamp = f"2026-02-{day:02d}T{9 + user % 8:02d}:00:00Z"
            rows.append(f"u{day}-{user},{stamp},view,{referrer}")
            if user % 4 == 0:
                rows.append(f"u{day}-{user},{stamp[:-3]}30Z,purchase,{referrer}")
    raw = tmp_path / "export.csv"
    raw.write_text("\n".join(rows) + "\n")
    config = config_for(raw, tmp_path, "data.features=[referrer]", "journey.max_gap=1h")
    report = run_ingest(config).report
    presence = report.feature_presence["referrer"]
    assert presence["train"] > 0.8 and presence["test"] == 0.0
    warnings = [w for w in report.warnings if w.startswith("feature referrer")]
    assert any("on 0% of the test events against" in w for w in warnings)
    assert all("did the column leave the export?" in w for w in warnings)


def test_end_events_end_a_journey_unconverted_and_with_drop_what_follows_goes(
    tmp_path: Path,
) -> None:
    """A declined application ends its journey as an approval does: neither decision is
    in the sequence, and what follows either (the work items closed afterwards) is
    dropped, so no kept event tells the outcome."""
    raw = tmp_path / "cases.csv"
    raw.write_text(
        "user_id,timestamp,event_type\n"
        "c1,2026-03-02T09:00:00Z,submitted\nc1,2026-03-02T09:05:00Z,validate_start\n"
        "c1,2026-03-02T09:06:00Z,approved\nc1,2026-03-02T09:07:00Z,validate_complete\n"
        "c2,2026-03-02T10:00:00Z,submitted\nc2,2026-03-02T10:05:00Z,validate_start\n"
        "c2,2026-03-02T10:06:00Z,declined\nc2,2026-03-02T10:07:00Z,validate_complete\n"
    )
    config = config_for(
        raw, tmp_path, "data.features=[]", "data.conversion_events=[approved]",
        "data.end_events=[declined]", "journey.after_conversion=drop",
        "data.observed_until=2026-04-01T00:00:00Z",
    )  # fmt: skip
    result = run_ingest(config)
    assert_accounting(result.report)
    journeys = result.journeys.sort("user_id")
    assert journeys["event_type"].to_list() == [["submitted", "validate_start"]] * 2
    assert journeys["label"].to_list() == [1, 0]
    assert [t.strftime("%H:%M") for t in journeys["end_time"]] == ["09:06", "10:06"]
    assert result.report.dropped_after_conversion == 2
    assert result.report.conversions_without_journey == 0
    with pytest.raises(Exception, match="end_events"):
        load_config(None, ["data.end_events=[purchase]"])


def test_a_folder_holding_another_table_names_the_glob_remedy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "events.csv").write_text(
        "user_id,timestamp,event_type\nu1,2026-03-02T09:00:00Z,view\n"
    )
    (folder / "users.csv").write_text("user_id,country\nu1,FR\n")
    assert cli_ingest(folder, tmp_path, "data.features=[]") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "users.csv: missing column(s) timestamp (timestamp), event_type (event_type)" in err
    assert "if that file is another table, point paths.raw at the events' files alone" in err

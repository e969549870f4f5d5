"""Logs nobody here wrote: headerless and tab-separated text, nested records (GA4, Segment),
epoch numbers of any unit, repeated interactions that are not copies, timestamps that
cannot be right, and paths that do not exist. Every file is written by the tests (or is a
committed sample)."""

from __future__ import annotations

import gzip
from datetime import UTC, datetime
from pathlib import Path

import polars as pl
import pytest
from test_ingest import assert_accounting, clean_log, config_for, journeys_of

from journeys.cli import main
from journeys.config import load_config
from journeys.datasets import FAILED_INGEST_FILE
from journeys.errors import InputError
from journeys.ingest import ingest, run_ingest

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["user_id", "timestamp", "event_type", "channel", "device"]


def positions(*extra: str) -> list[str]:
    """The overrides that read `COLUMNS` by position from a file without a header."""
    mapping = ", ".join(f"{name}: {i}" for i, name in enumerate(COLUMNS, start=1))
    return ["data.header=false", f"data.columns={{{mapping}}}", *extra]


# --- duplicates -----------------------------------------------------------------------------


def interactions() -> pl.DataFrame:
    """A session log: the same user, time, event and channel twice with another item
    clicked (a repeated interaction, not a copy), and one exact copy of a row."""
    rows = [
        ("u1", "2026-01-05T10:00:00Z", "click", "email", "mobile", 1, "sku-1"),
        ("u1", "2026-01-05T10:00:00Z", "click", "email", "mobile", 2, "sku-2"),
        ("u1", "2026-01-05T10:01:00Z", "add_to_cart", "email", "mobile", 3, "sku-2"),
        ("u1", "2026-01-05T10:01:00Z", "add_to_cart", "email", "mobile", 3, "sku-2"),  # copy
        ("u1", "2026-01-05T10:02:00Z", "purchase", "email", "mobile", 4, "sku-2"),
    ]
    return pl.DataFrame(rows, schema=[*COLUMNS, "step", "item"], orient="row")


@pytest.mark.parametrize(
    ("dedupe", "dropped", "events"),
    [("all_columns", 1, 3), ("read_columns", 2, 2), ("none", 0, 4)],
)
def test_repeated_interactions_are_kept_and_exact_copies_dropped(
    tmp_path: Path, dedupe: str, dropped: int, events: int
) -> None:
    interactions().write_csv(tmp_path / "log.csv")
    config = config_for(tmp_path / "log.csv", tmp_path, f"data.dedupe={dedupe}")
    report = ingest(config)
    assert_accounting(report)
    assert report["duplicates_dropped"] == dropped
    journeys = run_ingest(config).journeys
    assert journeys["n_events_total"].to_list() == [events]  # the purchase is the label


# --- text shapes ----------------------------------------------------------------------------


def test_headerless_csv_and_tsv_give_the_journeys_of_the_csv_with_a_header(
    tmp_path: Path,
) -> None:
    log = clean_log(n_users=30, seed=3).select(COLUMNS)
    log.write_csv(tmp_path / "header.csv")
    reference = journeys_of(tmp_path / "header.csv", tmp_path / "a")
    log.write_csv(tmp_path / "plain.csv", include_header=False)
    log.write_csv(tmp_path / "tabs.tsv", separator="\t")
    with gzip.open(tmp_path / "tabs.tsv.gz", "wb") as handle:
        log.write_csv(handle, separator="\t")
    log.write_csv(tmp_path / "bare.txt", separator="|", include_header=False)
    variants = {
        "headerless": (tmp_path / "plain.csv", positions()),
        "tsv": (tmp_path / "tabs.tsv", []),
        "tsv.gz": (tmp_path / "tabs.tsv.gz", []),
        "pipes": (tmp_path / "bare.txt", positions("data.separator='|'")),
    }
    for name, (raw, extra) in variants.items():
        assert journeys_of(raw, tmp_path / name, *extra).equals(reference), name


def test_a_headerless_file_read_by_name_says_how_to_read_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clean_log(n_users=3).select(COLUMNS).write_csv(tmp_path / "plain.csv", include_header=False)
    code = main(["ingest", "--set", f"paths.raw={tmp_path / 'plain.csv'}",
                 "--set", f"paths.journeys={tmp_path / 'j'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "data.header: false" in err


def test_positions_need_header_false_and_every_column_placed() -> None:
    from journeys.errors import ConfigError

    with pytest.raises(ConfigError, match=r"set data\.header: false"):
        load_config(None, ["data.columns={user_id: 1}"])
    with pytest.raises(ConfigError, match=r"position for \['timestamp'"):
        load_config(None, ["data.header=false", "data.columns={user_id: 1}"])


# --- nested records -------------------------------------------------------------------------


def test_nested_jsonl_equals_its_flat_copy(tmp_path: Path) -> None:
    log = clean_log(n_users=30, seed=4).select(COLUMNS)
    log.write_ndjson(tmp_path / "flat.jsonl")
    nested = log.select(
        visitor=pl.struct(id=pl.col("user_id")),
        sent_at=pl.col("timestamp"),
        event=pl.col("event_type"),
        context=pl.struct(
            campaign=pl.struct(medium=pl.col("channel")), device=pl.struct(kind=pl.col("device"))
        ),
    )
    nested.write_ndjson(tmp_path / "nested.jsonl")
    nested.write_parquet(tmp_path / "nested.parquet")
    flat = journeys_of(tmp_path / "flat.jsonl", tmp_path / "flat")
    mapping = (
        "data.columns={user_id: visitor.id, timestamp: sent_at, event_type: event, "
        "channel: context.campaign.medium, device: context.device.kind}"
    )
    assert journeys_of(tmp_path / "nested.jsonl", tmp_path / "n", mapping).equals(flat)
    assert journeys_of(tmp_path / "nested.parquet", tmp_path / "p", mapping).equals(flat)


@pytest.mark.parametrize("shape", ["ga4", "segment"])
def test_ga4_and_segment_samples_ingest_by_their_configs_alone(tmp_path: Path, shape: str) -> None:
    config = load_config(
        ROOT / "conf" / f"{shape}.yaml",
        [f"paths.journeys={tmp_path / 'j'}", f"paths.quarantine={tmp_path / 'q'}"],
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)  # the config names the committed sample relative to the repository
        result = run_ingest(config)
    report = result.report
    assert_accounting(report)
    assert report.quarantined_total == 0 and report.journeys_converted > 0
    journeys = result.journeys
    assert journeys.height == report.journeys > 100
    channels = set(journeys["channel"].explode().drop_nulls())
    assert {"cpc", "email", "display"} <= channels
    assert set(journeys["device"].explode()) == {"mobile", "desktop", "tablet"}
    # Both samples hold the same simulated events: the same journeys come out.
    assert report.journeys == 189 and report.journeys_converted == 6


# --- timestamps -----------------------------------------------------------------------------


def test_auto_unit_gives_the_same_journeys_for_s_ms_us_ns(tmp_path: Path) -> None:
    log = clean_log(n_users=20, seed=5).select(COLUMNS)
    seconds = log.with_columns(
        pl.col("timestamp").str.to_datetime(time_zone="UTC").dt.epoch("s").alias("timestamp")
    )
    reference = None
    for unit, factor in (("s", 1), ("ms", 10**3), ("us", 10**6), ("ns", 10**9)):
        frame = seconds.with_columns(pl.col("timestamp") * factor)
        frame.write_parquet(tmp_path / f"{unit}.parquet")
        frame.write_csv(tmp_path / f"{unit}.csv")
        for path in (tmp_path / f"{unit}.parquet", tmp_path / f"{unit}.csv"):
            out = tmp_path / f"out-{path.name}"
            journeys = journeys_of(path, out / "auto", "data.timestamp_unit=auto")
            explicit = journeys_of(path, out / unit, f"data.timestamp_unit={unit}")
            assert journeys.equals(explicit), path.name
            reference = journeys if reference is None else reference
            assert journeys.equals(reference), path.name
    start = reference["start_time"].min()
    assert datetime(2026, 1, 1, tzinfo=UTC) <= start < datetime(2026, 2, 1, tzinfo=UTC)


def test_timestamps_that_cannot_be_right_are_quarantined_as_implausible(tmp_path: Path) -> None:
    log = clean_log(n_users=10, seed=6).select(COLUMNS)
    bad = pl.DataFrame(
        {
            "user_id": ["z1", "z2", "z3"],
            "timestamp": ["1970-01-18T04:00:00Z", "1999-12-31T23:59:59Z", "2099-01-01T00:00:00Z"],
            "event_type": ["click"] * 3,
            "channel": ["email"] * 3,
            "device": ["mobile"] * 3,
        }
    )
    pl.concat([log, bad]).write_csv(tmp_path / "log.csv")
    report = ingest(config_for(tmp_path / "log.csv", tmp_path))
    assert_accounting(report)
    assert report["quarantined"]["implausible_timestamp"] == 3
    quarantine = pl.read_parquet(tmp_path / "quarantine" / "quarantine.parquet")
    assert sorted(quarantine["user_id"]) == ["z1", "z2", "z3"]
    assert set(quarantine["reason"]) == {"implausible_timestamp"}
    # The window is configuration: an archive of the nineties is read as it is.
    wider = config_for(
        tmp_path / "log.csv", tmp_path / "w", "data.plausible_from=1990-01-01T00:00:00"
    )
    assert ingest(wider)["quarantined"]["implausible_timestamp"] == 2


# --- paths ----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["ingest", "score", "attribute", "train"])
def test_a_missing_input_names_its_absolute_path_and_creates_nothing(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        code = main([command, "--set", "paths.raw=nowhere/events.csv",
                     "--set", f"paths.journeys={data / 'journeys'}",
                     "--set", f"paths.scores={data / 'scores'}",
                     "--set", f"paths.checkpoints={data / 'checkpoints'}",
                     "--set", f"mlflow.tracking_uri=sqlite:///{data / 'mlflow.db'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(tmp_path) in err, err  # the absolute path tried
    assert not data.exists()  # no lock file, no folder


# --- guards: what would turn into silent garbage ----------------------------------------------


def cli_ingest(raw: Path, tmp: Path, *extra: str) -> int:
    sets = [f"paths.raw={raw}", f"paths.journeys={tmp / 'journeys'}",
            f"paths.quarantine={tmp / 'quarantine'}", "vocab.min_count=1", *extra]  # fmt: skip
    return main(["ingest", *[arg for s in sets for arg in ("--set", s)]])


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_epoch_seconds_read_as_ms_stop_with_the_fix_and_keep_the_old_journeys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seconds = clean_log(n_users=30, seed=8).with_columns(
        pl.col("timestamp").str.to_datetime(time_zone="UTC").dt.epoch("s").alias("timestamp")
    )
    seconds.write_csv(tmp_path / "log.csv")
    assert cli_ingest(tmp_path / "log.csv", tmp_path, "data.timestamp_unit=s") == 0
    before = folder_bytes(tmp_path / "journeys")
    capsys.readouterr()

    code = cli_ingest(tmp_path / "log.csv", tmp_path, "data.timestamp_unit=ms")
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "implausible_timestamp" in err and "timestamp_unit (now ms" in err
    assert "1970-01-" in err  # the parsed range shows what went wrong
    after = folder_bytes(tmp_path / "journeys")
    assert FAILED_INGEST_FILE in after  # beside them: their refresh stopped (for scoring)
    del after[FAILED_INGEST_FILE]
    assert after == before  # the previous journeys stand
    quarantine = pl.read_parquet(tmp_path / "quarantine" / "quarantine.parquet")
    assert quarantine.height == seconds.height  # written, so the user can look
    assert cli_ingest(tmp_path / "log.csv", tmp_path / "auto", "data.timestamp_unit=auto") == 0


def test_an_absent_conversion_event_stops_ingest_and_names_the_event_types(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clean_log(n_users=30, seed=9).write_csv(tmp_path / "log.csv")
    code = cli_ingest(tmp_path / "log.csv", tmp_path, "data.conversion_events=[order]")
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "data.conversion_events ['order']" in err and "page_view (" in err
    assert not (tmp_path / "journeys").exists()
    # A misspelt event_map key is a warning, not an error.
    assert cli_ingest(tmp_path / "log.csv", tmp_path, "data.event_map={Purchse: purchase}") == 0
    assert "data.event_map keys ['Purchse'] match no event type" in capsys.readouterr().err


def test_observed_until_past_the_data_censors_nothing(tmp_path: Path) -> None:
    clean_log(n_users=40, seed=10).write_csv(tmp_path / "log.csv")
    default = run_ingest(config_for(tmp_path / "log.csv", tmp_path / "a")).report
    assert default.journeys_censored > 0
    final = run_ingest(
        config_for(tmp_path / "log.csv", tmp_path / "b", "data.observed_until=2027-01-01T00:00:00")
    )
    assert final.report.journeys_censored == 0 and final.report.journeys_by_split["none"] == 0
    assert final.journeys.height == default.journeys
    with pytest.raises(InputError, match=r"observed_until .* is before the last event"):
        run_ingest(
            config_for(tmp_path / "log.csv", tmp_path / "c", "data.observed_until=2026-01-02")
        )

"""Ingest: row accounting, quarantine, ordering, timestamps, labels, censoring, split, vocab."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from journeys.cli import main
from journeys.config import load_config
from journeys.datasets import REPORT_FILE, IngestReport, read_journeys
from journeys.ingest import ingest, run_ingest
from journeys.pipeline_lock import LOCK_FILE
from journeys.vocab import Vocabularies

EVENTS = ["search", "page_view", "click", "add_to_cart", "checkout", "purchase"]
CHANNELS = ["email", "display", "direct"]


def clean_log(n_users: int = 40, seed: int = 0) -> pl.DataFrame:
    """A small valid log: unique per-user timestamps, a few weeks, some purchases."""
    rng = np.random.default_rng(seed)
    per_user = rng.integers(1, 25, n_users)
    users = np.repeat([f"u{i:03d}" for i in range(n_users)], per_user)
    # Gaps from seconds to ~12 days so some users have several journeys.
    gaps = rng.choice(
        [30, 600, 7200, 3 * 86400, 12 * 86400], size=users.size, p=[0.4, 0.3, 0.15, 0.1, 0.05]
    )
    frame = pl.DataFrame({"user_id": users, "gap": gaps}).with_columns(
        (pl.col("gap").cum_sum().over("user_id") + pl.int_range(pl.len()) % 7).alias("offset")
    )
    start = datetime(2026, 1, 1, tzinfo=UTC)
    times = [start + timedelta(seconds=int(s)) for s in frame.get_column("offset").to_list()]
    return pl.DataFrame(
        {
            "user_id": users,
            "timestamp": [t.strftime("%Y-%m-%dT%H:%M:%SZ") for t in times],
            "event_type": rng.choice(EVENTS, users.size, p=[0.25, 0.3, 0.2, 0.12, 0.05, 0.08]),
            "channel": rng.choice(CHANNELS, users.size),
            "device": rng.choice(["mobile", "desktop"], users.size),
        }
    )


def config_for(raw: Path, tmp: Path, *extra: str):
    return load_config(
        None,
        [
            f"paths.raw={raw}",
            f"paths.journeys={tmp / 'journeys'}",
            f"paths.quarantine={tmp / 'quarantine'}",
            "vocab.min_count=1",
            *extra,
        ],
    )


def journeys_of(raw: Path, tmp: Path, *extra: str) -> pl.DataFrame:
    return run_ingest(config_for(raw, tmp, *extra)).journeys


def assert_accounting(report: dict | IngestReport) -> None:
    """The contract's row accounting, on the typed report or the JSON one (the file's,
    `ingest()`'s)."""
    if isinstance(report, IngestReport):
        report = report.to_json()
    assert report["rows_read"] == (
        report["rows_valid"]
        + report["quarantined_total"]
        + report["duplicates_dropped"]
        + report["dropped_by_config"]
    )
    assert report["quarantined_total"] == sum(report["quarantined"].values())


# --- accounting and quarantine -------------------------------------------------------------


def test_dirty_rows_are_quarantined_by_reason_and_accounted(tmp_path: Path) -> None:
    clean = clean_log()
    dirty = pl.DataFrame(
        {
            "user_id": [None, "", "u001", "u002", "u003", "u004"],
            "timestamp": ["2026-01-02T00:00:00Z"] * 3 + ["not-a-time", "2026-13-45T99:00:00Z", ""],
            "event_type": ["click", "click", None, "click", "click", "click"],
            "channel": ["email"] * 6,
            "device": ["mobile"] * 6,
        }
    )
    duplicates = clean.head(5)
    log = pl.concat([clean, dirty, duplicates])
    log.write_csv(tmp_path / "events.csv")
    config = config_for(tmp_path / "events.csv", tmp_path, "data.drop_events=[checkout]")
    report = ingest(config)

    assert_accounting(report)
    assert report["rows_read"] == log.height
    assert report["quarantined"] == {
        "missing_user_id": 2,
        "missing_event_type": 1,
        "bad_timestamp": 3,
        "implausible_timestamp": 0,
        "out_of_range": 0,
        "bad_numeric": 0,
        "bad_sequence": 0,
        "late": 0,
    }
    assert report["duplicates_dropped"] == 5
    assert report["dropped_by_config"] == clean.filter(pl.col("event_type") == "checkout").height
    quarantine = pl.read_parquet(tmp_path / "quarantine" / "quarantine.parquet")
    assert quarantine.height == 6
    # Original values, source file and row number survive for inspection.
    bad = quarantine.filter(pl.col("timestamp") == "not-a-time").row(0, named=True)
    assert bad["user_id"] == "u002"
    assert bad["row_number"] == clean.height + 4
    assert bad["source_file"].endswith("events.csv")
    assert json.loads((tmp_path / "journeys" / REPORT_FILE).read_text()) == report


def test_out_of_range_rows_are_quarantined(tmp_path: Path) -> None:
    clean_log().write_csv(tmp_path / "e.csv")
    result = run_ingest(
        config_for(tmp_path / "e.csv", tmp_path, "data.valid_until=2026-01-10T00:00:00")
    )
    late = clean_log().filter(pl.col("timestamp") > "2026-01-10T00:00:00Z").height
    assert late > 0
    assert result.report.quarantined["out_of_range"] == late
    assert_accounting(result.report)


dirty_row = st.fixed_dictionaries(
    {
        "user_id": st.one_of(st.none(), st.just(""), st.sampled_from(["a", "b", "c", " d "])),
        "timestamp": st.one_of(
            st.none(),
            st.sampled_from(["garbage", "2026-02-30T00:00:00Z", "", "12:00"]),
            st.datetimes(datetime(2025, 1, 1), datetime(2027, 1, 1)).map(
                lambda t: t.strftime("%Y-%m-%dT%H:%M:%S") + "Z"
            ),
        ),
        "event_type": st.one_of(st.none(), st.just(""), st.sampled_from([*EVENTS, "odd,one"])),
        "channel": st.sampled_from([*CHANNELS, ""]),
        "device": st.just("mobile"),
    }
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(rows=st.lists(dirty_row, min_size=1, max_size=60))
def test_accounting_invariant_holds_for_any_rows(tmp_path: Path, rows: list[dict]) -> None:
    frame = pl.DataFrame(rows, schema={k: pl.String for k in rows[0]})
    frame.write_csv(tmp_path / "fuzz.csv")
    expected = {"missing_user_id": 0, "missing_event_type": 0, "bad_timestamp": 0}
    for row in rows:
        if not (row["user_id"] or "").strip():
            expected["missing_user_id"] += 1
        elif not (row["event_type"] or "").strip():
            expected["missing_event_type"] += 1
        elif (
            not row["timestamp"]
            or not row["timestamp"][:4].isdigit()
            or "02-30" in row["timestamp"]
        ):
            expected["bad_timestamp"] += 1
    # Any rows at all: the guards for a wrong configuration stand aside here.
    guards_off = ["ingest.max_quarantined_share=1", "ingest.require_conversions=false"]
    config = config_for(tmp_path / "fuzz.csv", tmp_path, *guards_off)
    report = run_ingest(config, full=True).report  # the same file, rewritten each example
    assert_accounting(report)
    assert {k: report.quarantined[k] for k in expected} == expected


# --- order independence ---------------------------------------------------------------------


def test_shuffled_and_split_input_give_identical_journeys(tmp_path: Path) -> None:
    log = clean_log(n_users=60, seed=3)
    (tmp_path / "one").mkdir()
    log.write_csv(tmp_path / "one" / "events.csv")
    (tmp_path / "shuffled").mkdir()
    log.sample(fraction=1.0, shuffle=True, seed=11).write_csv(tmp_path / "shuffled" / "e.csv")
    (tmp_path / "parts").mkdir()
    shuffled = log.sample(fraction=1.0, shuffle=True, seed=5)
    for i, part in enumerate(shuffled.iter_slices(n_rows=log.height // 3 + 1)):
        if i == 1:
            part.write_ndjson(tmp_path / "parts" / f"part-{i}.jsonl")
        else:
            part.write_parquet(tmp_path / "parts" / f"part-{i}.parquet")

    outputs = []
    for name in ("one", "shuffled", "parts"):
        journeys = journeys_of(tmp_path / name, tmp_path / f"out-{name}")
        outputs.append(journeys.sort("journey_id"))
    assert outputs[0].height > 50
    assert outputs[0].equals(outputs[1])
    assert outputs[0].equals(outputs[2])


def test_glob_input(tmp_path: Path) -> None:
    log = clean_log()
    log.head(100).write_csv(tmp_path / "a.csv")
    log.tail(log.height - 100).write_csv(tmp_path / "b.csv")
    log.write_csv(tmp_path / "whole.csv")
    from_glob = journeys_of(tmp_path / "[ab].csv", tmp_path / "g")
    whole = journeys_of(tmp_path / "whole.csv", tmp_path / "w")
    assert from_glob.equals(whole)


# --- timestamps -----------------------------------------------------------------------------


def test_every_timestamp_form_gives_the_same_utc_instant(tmp_path: Path) -> None:
    instant = datetime(2026, 3, 1, 12, 30, 15, tzinfo=UTC)
    epoch = int(instant.timestamp())
    forms = {
        "z": ("2026-03-01T12:30:15Z", []),
        "offset": ("2026-03-01T14:30:15+02:00", []),
        "naive_utc": ("2026-03-01 12:30:15", []),
        "naive_local": ("2026-03-01T13:30:15", ["data.timezone=Europe/Amsterdam"]),
        "epoch_s": (str(epoch), ["data.timestamp_unit=s"]),
        "epoch_ms": (str(epoch * 1000), ["data.timestamp_unit=ms"]),
        "epoch_us": (str(epoch * 1_000_000), ["data.timestamp_unit=us"]),
    }
    for name, (text, extra) in forms.items():
        raw = tmp_path / f"{name}.csv"
        pl.DataFrame(
            {
                "user_id": ["u"],
                "timestamp": [text],
                "event_type": ["click"],
                "channel": ["x"],
                "device": ["y"],
            }
        ).write_csv(raw)
        journeys = journeys_of(raw, tmp_path / name, *extra, "ingest.require_conversions=false")
        assert journeys.get_column("start_time").to_list() == [instant], name


MIXED_FORMS = [
    "2026-01-05T10:00:00Z",
    "2026-01-05T10:00:00.123z",
    " 2026-01-05 10:00:00 ",
    "2026-01-05T10:00:00+02:00",
    "2026-01-05",
    "2026-03-29T02:30:00",  # does not exist in Amsterdam (clocks go forward)
    "2026-10-25 02:30:00",  # happens twice there: the earlier is meant
    "1700000000",
    "junk",
    None,
]


@pytest.mark.parametrize(
    "first",
    [
        "2026-01-05T10:00:00Z",
        "2026-01-05 10:00:00",
        "2026-01-05T10:00:00+01:00",
        "2026-01-05T10:00:00",
        "noise",
    ],
)
def test_timestamps_read_with_the_samples_layout_equal_every_form_parsing(first: str) -> None:
    """Ingest parses each batch with the layout its first values have and only the rows
    that layout fails in every form: a log whose later rows take other forms gets
    exactly the instants of parsing every row in every form (`parse_timestamp`)."""
    from journeys.config import load_config
    from journeys.events import parse_timestamp, read_timestamp

    data = load_config(None, ["data.timezone=Europe/Amsterdam"]).data
    rng = np.random.default_rng(0)
    later = rng.choice(np.array(MIXED_FORMS, dtype=object), 3000).tolist()
    frame = pl.DataFrame({"ts": [first] * 150 + later}, schema={"ts": pl.String})
    every_form = frame.select(parse_timestamp(pl.col("ts"), pl.String, data)).to_series()
    read = frame.lazy().select(read_timestamp(pl.col("ts"), pl.String, data))
    fast = read.collect(engine="streaming").to_series()
    assert fast.equals(every_form)
    assert every_form.null_count() < frame.height - 150  # most later forms are read
    if first != "noise":
        assert every_form.head(150).null_count() == 0


def test_a_bad_value_in_the_sample_keeps_the_batch_on_the_samples_layout() -> None:
    """One unreadable value among the first ones (a 1% dirty log has one in most samples)
    must not send the whole batch through every form: the layout read by most of the
    sample parses it, the bad value alone is null, and the instants are every form's."""
    from journeys.config import load_config
    from journeys.events import _fast_parse, parse_timestamp

    data = load_config(None, []).data
    text = pl.Series("ts", ["2026-01-05T10:00:00Z", "noise"] * 3 + ["2026-01-05T11:30:00Z"] * 200)
    fast = _fast_parse(text, data.timezone)
    assert fast is not None and fast.null_count() == 3
    assert fast.equals(text.to_frame().select(parse_timestamp(pl.col("ts"), pl.String, data))["ts"])
    assert _fast_parse(pl.Series("ts", ["noise"] * 5), data.timezone) is None


def test_numeric_epoch_column_in_parquet(tmp_path: Path) -> None:
    instant = datetime(2026, 3, 1, 12, 30, 15, 250000, tzinfo=UTC)
    pl.DataFrame(
        {
            "u": ["a"],
            "t": [int(instant.timestamp() * 1000)],
            "e": ["click"],
            "channel": ["x"],
            "device": ["y"],
        }
    ).write_parquet(tmp_path / "e.parquet")
    journeys = journeys_of(
        tmp_path / "e.parquet",
        tmp_path,
        "data.columns={user_id: u, timestamp: t, event_type: e}",
        "data.timestamp_unit=ms",
        "ingest.require_conversions=false",
    )
    assert journeys.get_column("start_time").to_list() == [instant]


# --- journeys, labels, censoring, split, vocabularies ---------------------------------------


def test_hand_made_journeys(tmp_path: Path) -> None:
    rows = [
        # user a: converts after 3 events; the next event starts a new journey.
        ("a", "2026-01-01T10:00:00Z", "search"),
        ("a", "2026-01-01T10:05:00Z", "click"),
        ("a", "2026-01-01T10:09:00Z", "add_to_cart"),
        ("a", "2026-01-01T10:10:00Z", "purchase"),
        ("a", "2026-01-01T11:00:00Z", "page_view"),
        # user b: a lone purchase makes no journey; then an 8-day gap splits two journeys.
        ("b", "2026-01-02T00:00:00Z", "purchase"),
        ("b", "2026-01-03T00:00:00Z", "search"),
        ("b", "2026-01-11T00:00:01Z", "search"),
        ("b", "2026-01-11T00:00:02Z", "BRAND_NEW"),
        # user c: late unconverted journey -> censored (within 7d of the data end).
        ("c", "2026-01-30T00:00:00Z", "search"),
        ("c", "2026-02-01T00:00:00Z", "page_view"),
    ]
    frame = pl.DataFrame(rows, schema=["user_id", "timestamp", "event_type"], orient="row")
    frame.with_columns(channel=pl.lit("email"), device=pl.lit("m")).write_csv(tmp_path / "e.csv")
    journeys = journeys_of(tmp_path / "e.csv", tmp_path).sort("journey_id")
    by_events = {tuple(j["event_type"]): j for j in journeys.iter_rows(named=True)}

    converted = by_events[("search", "click", "add_to_cart")]
    assert converted["label"] == 1 and not converted["censored"]
    assert converted["end_time"] == datetime(2026, 1, 1, 10, 10, tzinfo=UTC)
    assert by_events[("page_view",)]["label"] == 0
    assert ("purchase",) not in by_events
    assert by_events[("search",)]["user_id"] == "b"
    assert by_events[("search", "BRAND_NEW")]["user_id"] == "b"
    late = by_events[("search", "page_view")]
    assert late["censored"] and late["split"] == "none"
    assert journeys.height == 5
    report = run_ingest(config_for(tmp_path / "e.csv", tmp_path)).report
    assert report.conversions_without_journey == 1
    expected_id = f"a-{int(datetime(2026, 1, 1, 10, tzinfo=UTC).timestamp() * 1_000_000)}"
    assert converted["journey_id"] == expected_id


@pytest.mark.parametrize("exclude", [True, False])
def test_late_converted_journeys_take_no_split_unless_configured(
    tmp_path: Path, exclude: bool
) -> None:
    rows = [
        ("a", "2026-01-01T10:00:00Z", "search"),  # early, unconverted: train
        ("b", "2026-01-02T10:00:00Z", "search"),  # early, converted: train
        ("b", "2026-01-02T10:05:00Z", "purchase"),
        ("c", "2026-01-28T00:00:00Z", "search"),  # late, converted: near the end
        ("c", "2026-01-28T00:05:00Z", "purchase"),
        ("d", "2026-01-30T00:00:00Z", "search"),  # late, unconverted: censored
        ("e", "2026-02-01T00:00:00Z", "page_view"),  # the data's end
    ]
    frame = pl.DataFrame(rows, schema=["user_id", "timestamp", "event_type"], orient="row")
    frame.with_columns(channel=pl.lit("email"), device=pl.lit("m")).write_csv(tmp_path / "e.csv")
    config = config_for(
        tmp_path / "e.csv",
        tmp_path,
        f"split.exclude_recent_conversions={str(exclude).lower()}",
    )
    result = run_ingest(config)
    by_user = {j["user_id"]: j for j in result.journeys.iter_rows(named=True)}
    assert by_user["c"]["label"] == 1 and not by_user["c"]["censored"]  # the contract's rule
    assert (by_user["c"]["split"] == "none") == exclude
    assert by_user["d"]["censored"] and by_user["d"]["split"] == "none"
    assert by_user["a"]["split"] == "train" and by_user["b"]["split"] != "none"
    assert result.report.journeys_converted_near_end == (1 if exclude else 0)
    assert result.report.journeys_censored == 2  # d and e
    assert result.report.journeys_by_split["none"] == (3 if exclude else 2)


def test_test_split_conversion_rate_is_not_inflated_by_censoring(tmp_path: Path) -> None:
    """Selecting late journeys on their label would raise the test rate above the truth."""
    from journeys.simulate import simulate

    simulate(tmp_path / "raw", users=10_000, seed=0)
    truth = pl.read_parquet(tmp_path / "raw" / "_truth" / "journeys.parquet")
    rates = {}
    for exclude in (True, False):
        config = config_for(
            tmp_path / "raw", tmp_path, f"split.exclude_recent_conversions={str(exclude).lower()}"
        )
        test = (
            run_ingest(config)
            .journeys.filter(pl.col("split") == "test")
            .join(truth.select("journey_id", "true_probability"), on="journey_id")
        )
        rates[exclude] = test.select(
            excess=pl.col("label").mean() - pl.col("true_probability").mean(),
            stderr=(pl.col("true_probability") * (1 - pl.col("true_probability"))).sum().sqrt()
            / pl.len(),
        ).row(0, named=True)
    # Label-blind exclusion: the realised rate matches the true one within 3 standard errors;
    # keeping the late converted journeys inflates it far beyond (0.7 and 8 here).
    assert abs(rates[True]["excess"]) < 3 * rates[True]["stderr"]
    assert rates[False]["excess"] > 5 * rates[False]["stderr"]


def test_no_conversion_inside_sequences_and_splits_are_ordered(tmp_path: Path) -> None:
    clean_log(n_users=200, seed=1).write_csv(tmp_path / "e.csv")
    config = config_for(tmp_path / "e.csv", tmp_path, "journey.max_events=5")
    result = run_ingest(config)
    journeys = result.journeys
    assert journeys.height > 200
    assert not journeys.get_column("event_type").list.contains("purchase").any()
    # max_events keeps the most recent events; n_events_total keeps the true length.
    assert journeys.get_column("n_events").max() == 5
    long = journeys.filter(pl.col("n_events_total") > 5)
    assert long.height > 0
    assert (long.get_column("event_time").list.last() <= long.get_column("end_time")).all()
    assert (journeys.get_column("event_type").list.len() == journeys.get_column("n_events")).all()
    # Censored journeys are exactly the late unconverted ones and carry no split.
    data_end = result.report.data_end
    late = (pl.col("label") == 0) & (pl.lit(data_end) - pl.col("end_time") <= timedelta(days=7))
    assert journeys.filter(late).height == journeys.filter(pl.col("censored")).height > 0
    assert (journeys.filter(pl.col("censored")).get_column("split") == "none").all()
    # Temporal split: every train journey ends before every val journey, val before test.
    ends = {
        s: journeys.filter(pl.col("split") == s).get_column("end_time")
        for s in ("train", "val", "test")
    }
    assert all(len(v) for v in ends.values())
    assert ends["train"].max() < ends["val"].min()
    assert ends["val"].max() < ends["test"].min()


def test_vocabularies_come_from_train_only(tmp_path: Path) -> None:
    log = clean_log(n_users=100, seed=2)
    # A token that exists only late in the data (so only in val/test journeys).
    late_users = log.filter(pl.col("timestamp") > "2026-01-25").head(3)
    extra = late_users.with_columns(
        event_type=pl.lit("late_only"),
        channel=pl.lit("late_channel"),
        timestamp=pl.lit("2026-03-01T00:00:00Z"),
    )
    pl.concat([log, extra]).write_csv(tmp_path / "e.csv")
    config = config_for(tmp_path / "e.csv", tmp_path)
    ingest(config)
    vocabs = Vocabularies.load(tmp_path / "journeys")
    journeys = read_journeys(tmp_path / "journeys")
    train_tokens = set(
        journeys.filter(pl.col("split") == "train").get_column("event_type").explode()
    )
    assert set(vocabs.event_type.tokens[2:]) == train_tokens
    assert "late_only" not in vocabs.event_type.tokens
    assert "late_channel" not in vocabs.by_column["channel"].tokens
    assert vocabs.event_type.tokens[:2] == ("<pad>", "<unk>")


def test_vocabulary_min_count(tmp_path: Path) -> None:
    clean_log(n_users=100).write_csv(tmp_path / "e.csv")
    journeys = run_ingest(config_for(tmp_path / "e.csv", tmp_path, "vocab.min_count=1")).journeys
    counts = (
        journeys.filter(pl.col("split") == "train")
        .select(pl.col("channel").explode())
        .to_series()
        .value_counts()
    )
    threshold = int(counts.get_column("count").min()) + 1
    vocabs = run_ingest(
        config_for(tmp_path / "e.csv", tmp_path, f"vocab.min_count={threshold}")
    ).vocabularies
    kept = set(counts.filter(pl.col("count") >= threshold).get_column("channel"))
    assert set(vocabs.by_column["channel"].tokens[2:]) == kept


# --- BPIC 2012 ------------------------------------------------------------------------------

BPIC = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "bpic2012" / "events.csv.gz"
OUTCOMES = [
    "A_APPROVED", "A_DECLINED", "A_CANCELLED", "A_ACTIVATED", "A_REGISTERED",
    "O_ACCEPTED", "O_DECLINED", "O_CANCELLED",
]  # fmt: skip


@pytest.mark.skipif(not BPIC.exists(), reason="../shared/data/bpic2012 not present")
def test_bpic2012_through_its_config(tmp_path: Path) -> None:
    config = load_config(
        "conf/bpic2012.yaml",
        [
            f"paths.journeys={tmp_path / 'j'}",
            f"paths.quarantine={tmp_path / 'q'}",
            f"paths.raw={BPIC}",
        ],
    )
    result = run_ingest(config)
    report = result.report
    assert report.rows_read == 262_200
    assert report.users == 13_087
    assert report.quarantined_total == 0
    assert_accounting(report)
    raw = pl.read_csv(BPIC, infer_schema=False)
    approved_cases = raw.filter(pl.col("activity") == "A_APPROVED").get_column("case_id").n_unique()
    assert report.journeys_converted == approved_cases == 2_246
    sequences = result.journeys.get_column("event_type").explode()
    assert not sequences.is_in(OUTCOMES).any()
    # One case is one journey, except the few that pause for more than max_gap (30 days).
    assert 13_087 <= report.journeys <= 13_087 + 20


def test_bpic2012_committed_sample_ingests(tmp_path: Path) -> None:
    config = load_config(
        "conf/bpic2012.yaml",
        [
            "paths.raw=data/samples/bpic2012/events.csv.gz",
            f"paths.journeys={tmp_path / 'j'}",
            f"paths.quarantine={tmp_path / 'q'}",
        ],
    )
    report = ingest(config)
    assert report["users"] == 785
    assert report["journeys_converted"] == 133
    assert_accounting(report)


# --- the command line -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["ingest", "--config", "missing.yaml"], "config file not found"),
        (["ingest", "--set", "journey.max_gapp=3d"], "journey.max_gapp: unknown key"),
        (["ingest", "--set", "journey.max_events=many"], "journey.max_events"),
        (["ingest", "--set", "journey.max_gap=soon"], "not a duration"),
        (["ingest", "--set", "paths.raw=/nonexistent/events.csv"], "input not found"),
        # Validated once, at config time, against what training needs.
        (["ingest", "--set", "split.fractions=[0.8,0.2,0]"], "test share must be positive"),
    ],
)
def test_bad_configuration_or_input_exits_2_with_one_line(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code = main([*args, "--set", f"paths.journeys={tmp_path / 'j'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1
    assert needle in err
    assert "Traceback" not in err


def test_unreadable_and_mismatched_input_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    pl.DataFrame({"visitor": ["a"], "ts": ["2026-01-01"], "action": ["x"]}).write_csv(
        tmp_path / "other.csv"
    )
    for raw, needle in [("broken.parquet", "broken.parquet"), ("other.csv", "missing column")]:
        code = main(
            [
                "ingest",
                "--set",
                f"paths.raw={tmp_path / raw}",
                "--set",
                f"paths.journeys={tmp_path / 'j'}",
            ]
        )
        err = capsys.readouterr().err
        assert code == 2, err
        assert needle in err and len(err.strip().splitlines()) == 1


def test_ingest_command_writes_outputs_and_keeps_previous_on_failure(tmp_path: Path) -> None:
    clean_log().write_csv(tmp_path / "e.csv")
    base = [
        "--set", f"paths.journeys={tmp_path / 'j'}",
        "--set", f"paths.quarantine={tmp_path / 'q'}",
        "--set", "vocab.min_count=1",
    ]  # fmt: skip
    assert main(["ingest", "--set", f"paths.raw={tmp_path / 'e.csv'}", *base]) == 0
    names = {p.name for p in (tmp_path / "j").iterdir()}
    assert {REPORT_FILE, "vocab.json", "manifest.json"} <= names
    assert any(name.startswith("part-") and name.endswith(".parquet") for name in names)
    names = {p.name for p in (tmp_path / "j").iterdir() if p.is_file()}
    before = {name: (tmp_path / "j" / name).read_bytes() for name in names}
    # A failing run leaves the previous complete output in place and no temporary files.
    assert main(["ingest", "--set", f"paths.raw={tmp_path / 'missing.csv'}", *base]) == 2
    assert {name: (tmp_path / "j" / name).read_bytes() for name in names} == before
    # The data folder's lock file (an flock target, empty once released) is the only dot file.
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [LOCK_FILE]


def test_partitioned_ingest_equals_single_partition(tmp_path: Path) -> None:
    clean_log(n_users=120, seed=4).write_csv(tmp_path / "e.csv")
    single = run_ingest(config_for(tmp_path / "e.csv", tmp_path / "one", "ingest.partitions=1"))
    many = run_ingest(config_for(tmp_path / "e.csv", tmp_path / "many", "ingest.partitions=7"))
    assert many.report.partitions == 7
    assert single.journeys.sort("journey_id").equals(many.journeys.sort("journey_id"))
    assert single.vocabularies == many.vocabularies
    drop = ("partitions", "sources")
    assert {k: v for k, v in single.report.to_json().items() if k not in drop} == {
        k: v for k, v in many.report.to_json().items() if k not in drop
    }


# --- with the simulator's injected dirt ------------------------------------------------------


def test_quarantine_matches_the_simulators_injected_dirt(tmp_path: Path) -> None:
    from journeys.simulate import simulate

    sim = simulate(tmp_path / "raw", users=400, seed=9, dirty_rate=0.05, shuffle=True, n_files=3)
    report = run_ingest(config_for(tmp_path / "raw", tmp_path)).report
    assert_accounting(report)
    assert report.rows_read == sim.n_events
    for reason in ("missing_user_id", "missing_event_type", "bad_timestamp"):
        assert report.quarantined[reason] == sim.dirty[reason] > 0, reason
    assert report.duplicates_dropped == sim.dirty["duplicates"] > 0
    assert report.journeys == sim.n_journeys


def test_simulated_log_gives_same_journeys_shuffled_split_and_dirty(tmp_path: Path) -> None:
    from journeys.simulate import simulate

    simulate(tmp_path / "clean", users=300, seed=5)
    simulate(tmp_path / "messy", users=300, seed=5, dirty_rate=0.03, shuffle=True, n_files=4)
    clean = journeys_of(tmp_path / "clean", tmp_path / "a").sort("journey_id")
    messy = journeys_of(tmp_path / "messy", tmp_path / "b").sort("journey_id")
    truth = pl.read_parquet(tmp_path / "clean" / "_truth" / "journeys.parquet")
    assert clean.equals(messy)
    assert set(clean.get_column("journey_id")) == set(truth.get_column("journey_id"))


def test_a_raw_column_named_like_an_internal_one_is_harmless(tmp_path: Path) -> None:
    """A log may carry its own `row_number` / `source_file` columns; ours do not clash."""
    log = clean_log(n_users=5).with_columns(
        row_number=pl.lit(-1), source_file=pl.lit("elsewhere.csv")
    )
    log.write_csv(tmp_path / "e.csv")
    result = run_ingest(config_for(tmp_path / "e.csv", tmp_path))
    assert result.report.rows_read == log.height == result.report.rows_valid

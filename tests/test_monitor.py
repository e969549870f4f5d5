"""`journeys monitor`: each planted fault is flagged on its night and named, quiet nights
raise no alert, a matured cohort's realised figures equal an offline computation, and the
thresholds know their sample size."""

from __future__ import annotations

import json
import math
import shutil
from datetime import timedelta
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from test_flows import isolated, tiny_config

# The nights and their faults (night -> fault, the check that must name it), planted as
# the benchmark that compares the monitor with Evidently and NannyML plants them.
from benchmarks.monitor_compare import DAYS, FAULTS, TRAIN_DAYS, plant, settings, simulated_days
from journeys.cli import main
from journeys.config import Monitor, load_config
from journeys.monitor import (
    MONITOR_DIR,
    OPEN_SNAPSHOT,
    PAGE_FILE,
    REPORT_JSON,
    Check,
    benjamini_hochberg,
    checks,
    cohort_checks,
    expected_roc_auc,
    js_distance,
    moved_columns,
    read_history,
)
from journeys.reference import DelayCurve, Profile, Reference, Sketch


@pytest.fixture(scope="module")
def nights(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """Train on 30 days of the simulator, then run the nightly ingest, scoring and monitor
    for each later day, faults planted on their nights; each night's report.json."""
    folder = tmp_path_factory.mktemp("monitor")
    log = simulated_days(folder / "log")
    raw = folder / "raw"
    raw.mkdir()
    config = tiny_config(
        folder, "journey.max_gap=1d", "ingest.late_allowed=1d", "attribution.ig_sample=0",
        "monitor.min_cohort_conversions=2",
    )  # fmt: skip

    def land(number: int) -> None:
        rows = log.filter(pl.col("_day") == number).drop("_day")
        if number in FAULTS:
            rows = plant(rows, FAULTS[number][0])
        rows.write_csv(raw / f"day-{number:03d}.csv")

    reports = {}
    with isolated(folder) as mp:
        mp.setattr("sys.argv", ["journeys"])
        for number in range(1, TRAIN_DAYS + 1):
            land(number)
        assert main(["ingest", *overrides(config)]) == 0
        assert main(["train", *overrides(config)]) == 0
        assert main(["score", *overrides(config)]) == 0
        for number in range(TRAIN_DAYS + 1, DAYS):
            land(number)
            assert main(["ingest", *overrides(config)]) == 0
            assert main(["score", *overrides(config)]) == 0
            code = main(["monitor", *overrides(config)])
            nights_done = sorted((folder / "reports" / MONITOR_DIR).glob("*/" + REPORT_JSON))
            report = json.loads(nights_done[-1].read_text(), parse_constant=not_json)
            reports[number] = {"code": code, "report": report, "folder": nights_done[-1].parent}
        # Monitoring the last night again measures it again and replaces its row.
        again = main(["monitor", *overrides(config)])
        reports[DAYS] = {"code": again, "history": read_history(folder / "reports" / MONITOR_DIR)}
    reports[0] = {"config": config, "folder": folder}
    return reports


def not_json(constant: str) -> None:
    raise AssertionError(f"report.json holds {constant}, which is not JSON")


def overrides(config) -> list[str]:
    """The configuration as command-line settings (every path, the tiny model), as the
    benchmark sets them."""
    folder = Path(config.paths.raw).parent
    return [arg for pair in settings(folder) for arg in ("--set", pair)]


@pytest.mark.slow
def test_each_planted_fault_is_flagged_on_its_night_and_quiet_nights_raise_none(
    nights: dict[int, dict],
) -> None:
    quiet = [number for number in range(TRAIN_DAYS + 1, DAYS) if number not in FAULTS]
    assert len(quiet) >= 30  # false alarms measured on 30 quiet nights, faults' aftermath included
    for number in range(TRAIN_DAYS + 1, DAYS):
        night = nights[number]
        alerts = night["report"]["alerts"]
        named = {(a["check"], a["column"]) for a in alerts}
        if number in FAULTS:
            _, check, column = FAULTS[number]
            assert night["code"] == 3, (number, night["report"]["checks"])
            assert (check, column) in named, (number, alerts)
        else:
            assert night["code"] == 0 and not alerts, (number, alerts)
    renamed = next(a for a in nights[33]["report"]["alerts"] if a["check"] == "unknown_values")
    assert "'addToCart'" in renamed["message"]  # the value the model does not know, named
    flood = next(a for a in nights[37]["report"]["alerts"] if a["check"] == "flood")
    assert "bot-0" in flood["message"] and flood["figure"] >= flood["threshold"]
    for alert in nights[33]["report"]["alerts"]:
        assert {"check", "message", "figure", "threshold"} <= set(alert)


@pytest.mark.slow
def test_a_night_writes_its_page_snapshot_and_history_row(nights: dict[int, dict]) -> None:
    night = nights[DAYS - 1]
    folder = night["folder"]
    page = (folder / PAGE_FILE).read_text()
    assert page.startswith("<!doctype html>") and "data:image/png;base64," in page
    assert (folder / OPEN_SNAPSHOT).exists()
    history = pl.read_parquet(folder.parent / "history.parquet")
    assert history.height == DAYS - 1 - TRAIN_DAYS  # one row a night
    rerun = nights[DAYS]["history"]  # the last night monitored again: its row replaced
    assert rerun.height == history.height and nights[DAYS]["code"] == night["code"]
    assert rerun.get_column("night").to_list() == history.get_column("night").to_list()
    assert history.get_column("night").n_unique() == history.height
    alerted = dict(zip(history["night"], history["alerts"], strict=True))
    assert alerted[nights[33]["report"]["night"]] >= 1


@pytest.mark.slow
def test_the_page_opens_in_a_headless_browser_and_shows_its_plots(
    nights: dict[int, dict], tmp_path: Path
) -> None:
    """Chromium renders the last night's page: a screenshot that is not blank, and holds
    the probability plot's two lines (matplotlib's first two colours)."""
    import subprocess

    from PIL import Image

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    runs = chromium and subprocess.run([chromium, "--version"], capture_output=True).returncode == 0
    if not runs:  # none, or a stub that cannot start
        pytest.skip("no Chromium here: scripts/install_test_tools.sh installs Debian's chromium")
    shot = tmp_path / "page.png"
    page = nights[DAYS - 1]["folder"] / PAGE_FILE
    subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--screenshot={shot}", "--window-size=1000,6000", page.as_uri()],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(np.int64)
    assert (pixels < 200).any(axis=2).mean() > 0.01  # text, tables and plots, not blank

    def near(colour: tuple[int, int, int]) -> int:
        return int((np.abs(pixels - np.array(colour)).sum(axis=2) < 60).sum())

    assert near((31, 119, 180)) > 100 and near((255, 127, 14)) > 100  # tonight, reference


@pytest.mark.slow
def test_a_matured_cohort_equals_an_offline_computation(nights: dict[int, dict]) -> None:
    """The matured cohort with the most conversions, its open journeys looked up offline in
    the journeys the last night holds: the same ROC AUC and ECE as the report says."""
    from sklearn.metrics import roc_auc_score

    from journeys.metrics import expected_calibration_error
    from journeys.monitor import settled

    config, root = nights[0]["config"], nights[0]["folder"]
    cohorts = nights[DAYS - 1]["report"]["cohorts"]
    before = nights[DAYS - 2]["report"]["cohorts"]  # a cohort settled then kept its figures
    name = max(
        (
            n for n in cohorts
            if "roc_auc" in cohorts[n] and not (n in before and settled(before[n], config.monitor))
        ),
        key=lambda n: cohorts[n]["converted"],
    )  # fmt: skip
    cohort = cohorts[name]
    assert cohort["matured"]
    night = next(
        nights[n] for n in range(TRAIN_DAYS + 1, DAYS) if nights[n]["report"]["night"] == name
    )
    snapshot = pl.read_parquet(night["folder"] / OPEN_SNAPSHOT)
    journeys = pl.read_parquet(
        Path(config.paths.journeys) / "*.parquet", include_file_paths="file"
    ).filter(pl.col("journey_id").is_in(snapshot.get_column("journey_id").implode()))
    known = journeys.filter(
        (pl.col("label") == 1) | (~pl.col("file").str.contains("part-open") & ~pl.col("censored"))
    )
    joined = snapshot.join(known.select("journey_id", "label"), on="journey_id")
    labels = joined.get_column("label").to_numpy()
    probs = joined.get_column("conversion_probability").to_numpy()
    assert cohort["known"] == joined.height and cohort["converted"] == labels.sum() >= 2
    assert cohort["roc_auc"] == pytest.approx(roc_auc_score(labels, probs))
    assert cohort["ece"] == pytest.approx(expected_calibration_error(labels, probs))
    low, high = cohort["roc_auc_ci"]
    assert low <= cohort["roc_auc"] <= high
    assert root.exists()


def test_expected_roc_auc_is_the_mean_of_the_realised_one_under_calibration() -> None:
    rng = np.random.default_rng(0)
    p = rng.beta(1, 8, 2_000)
    from sklearn.metrics import roc_auc_score

    realised = [roc_auc_score(rng.random(p.size) < p, p) for _ in range(200)]
    assert expected_roc_auc(p) == pytest.approx(np.mean(realised), abs=0.003)


def test_thresholds_know_their_sample_size() -> None:
    """Identical samples raise no alert at 100 rows or at 100,000 (a fixed cut-off on a
    drift figure fires on small ones); a real shift alerts once the sample can tell."""
    settings = load_config(None).monitor
    rng = np.random.default_rng(1)
    shares = [0.5, 0.3, 0.2]

    def mix(n: int, p: list[float]) -> dict[str, int]:
        counts = rng.multinomial(n, p)
        return {k: int(c) for k, c in zip("abc", counts, strict=True)}

    reference = Reference(Profile(events=50_000, categories={"channel": mix(50_000, shares)}))
    alarms = {n: 0 for n in (100, 1_000, 100_000)}
    for n in alarms:
        for _ in range(50):
            night = Profile(events=n, categories={"channel": mix(n, shares)})
            found = checks(_night(night), reference, {}, settings)
            alarms[n] += any(c.alert for c in found if c.check == "category_mix")
    assert alarms == {100: 0, 1_000: 0, 100_000: 0}
    shifted = Profile(events=5_000, categories={"channel": mix(5_000, [0.2, 0.3, 0.5])})
    assert any(c.alert for c in checks(_night(shifted), reference, {}, settings))
    # The same shift on 20 events cannot be told from chance.
    few = Profile(events=20, categories={"channel": mix(20, [0.2, 0.3, 0.5])})
    assert not any(c.alert for c in checks(_night(few), reference, {}, settings))


def test_a_baseline_that_saw_no_unknown_value_is_not_taken_as_certain() -> None:
    """The reference saw no unknown value in 100,000 events. One in a 40-event night is
    then about as surprising as Fisher's exact test says (p ~ 4e-4), not p = 4e-11 as
    against a rate of exactly 0, which would sway Benjamini-Hochberg's cut for every other
    test of the night; 2% of 5,000 still alerts."""
    from scipy.stats import fisher_exact

    settings = load_config(None).monitor
    reference = Reference(Profile(events=100_000, unknown={"event_type": 0}))

    def unknown_check(events: int, lacked: int):
        night = Profile(events=events, unknown={"event_type": lacked})
        found = checks(_night(night), reference, {}, settings)
        return next(c for c in found if c.check == "unknown_values")

    exact = fisher_exact([[1, 39], [0, 100_000]], alternative="greater").pvalue
    assert exact / 3 < unknown_check(40, 1).p_value < exact * 3
    assert unknown_check(5_000, 100).alert


def test_a_whole_number_column_from_one_distribution_does_not_differ() -> None:
    """Journey lengths are whole numbers: their sketches repeat values over many levels.
    Two samples of one geometric distribution are not a shift at any size; twice the
    mean length is."""
    from journeys.monitor import sketch_shift

    rng = np.random.default_rng(3)
    reference = Sketch.of(rng.geometric(0.3, 200_000))
    for n in (2_000, 20_000, 200_000):
        _, p = sketch_shift(Sketch.of(rng.geometric(0.3, n)), reference)
        assert p > 1e-3, n
    shift, p = sketch_shift(Sketch.of(rng.geometric(0.15, 20_000)), reference)
    assert p < 1e-9 and shift > 0.25


def _night(measured: Profile):
    from datetime import UTC, datetime

    from journeys.monitor import Night

    end = datetime(2026, 2, 1, tzinfo=UTC)
    return Night("2026-02-01", end - timedelta(days=1), end, measured)


def test_an_unchanged_heavy_tailed_number_raises_nothing_on_large_nights() -> None:
    """A price drawn from the same lognormal: its extremes move night to night, its
    distribution does not; a tenfold price (cents for euros) alerts."""
    settings = load_config(None).monitor
    rng = np.random.default_rng(2)
    reference = Reference(
        Profile(events=500_000, numeric={"price": Sketch.of(rng.lognormal(3, 1.5, 500_000))})
    )
    for n in (1_000, 50_000, 200_000):
        night = Profile(events=n, numeric={"price": Sketch.of(rng.lognormal(3, 1.5, n))})
        assert not any(c.alert for c in checks(_night(night), reference, {}, settings)), n
    cents = Profile(events=5_000, numeric={"price": Sketch.of(10 * rng.lognormal(3, 1.5, 5_000))})
    alerts = [c for c in checks(_night(cents), reference, {}, settings) if c.alert]
    assert [(c.check, c.column) for c in alerts] == [("numeric_shift", "price")]


def test_benjamini_hochberg_and_js_distance() -> None:
    assert benjamini_hochberg([0.001, 0.02, 0.04, 0.5], 0.05) == [True, True, False, False]
    assert benjamini_hochberg([0.01, 0.012, 0.013], 0.05) == [True, True, True]
    assert js_distance({"a": 5, "b": 5}, {"a": 50, "b": 50}) == pytest.approx(0.0)
    assert js_distance({"a": 1}, {"b": 1}) == pytest.approx(1.0)
    assert Sketch.of(np.array([])).n == 0


def test_monitor_without_an_ingest_exits_2_with_one_line(tmp_path: Path, capsys) -> None:
    args = ["--set", f"paths.journeys={tmp_path / 'nothing'}", "--set",
            f"mlflow.tracking_uri=sqlite:///{tmp_path / 'm.db'}"]  # fmt: skip
    with isolated(tmp_path):
        assert main(["monitor", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "journeys monitor: error:" in err[0]
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_the_conversion_share_conditions_on_the_quiet_time() -> None:
    """Exponential delays forget how long a journey has waited: the share arriving within
    t is the same whatever the quiet time q, 1 - exp(-t / mean); none within 0, all in time."""
    delays = np.random.default_rng(0).exponential(10.0, 200_000)
    curve = DelayCurve.of(delays)
    quiet = np.array([0.0, 5.0, 20.0])
    for hours in (3.0, 10.0, 25.0):
        share = curve.share(quiet, np.full(3, hours))
        assert share == pytest.approx(1 - np.exp(-hours / 10.0), abs=0.03), hours
    assert curve.share(quiet, np.zeros(3)) == pytest.approx(0.0, abs=1e-9)
    assert curve.share(quiet, np.full(3, 1e4)) == pytest.approx(1.0)
    assert np.isnan(Reference(Profile()).conversion_delay.share(quiet, quiet)).all()  # no curve


@pytest.mark.slow
def test_maturing_cohorts_meet_their_delay_adjusted_expectation(nights: dict[int, dict]) -> None:
    """Each night, last night's open journeys: conversions since against their probabilities
    times the share of conversions due by now, pooled over the nights conversions were
    logged: within the 99% Poisson interval. Among the journeys already known the plain sum
    of probabilities would expect almost nothing (they are the few that converted fast)."""
    from scipy.stats import poisson

    observed = expected = 0.0
    for number in range(TRAIN_DAYS + 2, DAYS):
        if FAULTS.get(number, ("",))[0] == "no_conversions":
            continue
        check = next(
            c for c in nights[number]["report"]["checks"] if c["check"] == "cohort_conversions"
        )
        cohort = nights[number]["report"]["cohorts"][check["column"]]
        assert not cohort["matured"] and check["column"] < nights[number]["report"]["night"]
        observed += cohort["converted"]
        expected += cohort["expected_so_far"]
        assert cohort["expected_so_far"] > 10 * cohort["expected_conversions"], cohort
    low, high = poisson.interval(0.99, expected)
    assert expected > 20 and low <= observed <= high, (observed, expected)


def test_cohort_checks_alert_on_missing_conversions_and_a_broken_promise() -> None:
    settings, night_before, long_ago = Monitor(), "2026-02-01", "2025-12-01"

    def checked(cohorts: dict, earlier: dict | None = None) -> dict:
        found = cohort_checks(cohorts, earlier or {}, night_before, long_ago, settings)
        return {c.check: c for c in found}

    quiet = {"journeys": 5000, "known": 10, "converted": 38, "expected_so_far": 40.0}
    assert not checked({night_before: quiet})["cohort_conversions"].over_floor
    gone = checked({night_before: {**quiet, "converted": 0}})["cohort_conversions"]
    assert gone.over_floor and gone.p_value < 1e-10
    # Only the previous night's cohort: an older one would count its conversions again.
    assert "cohort_conversions" not in checked({"2026-01-31": {**quiet, "converted": 0}})
    matured = {
        "journeys": 5000, "known": 4990, "converted": 200, "expected_so_far": 190.0,
        "matured": True, "roc_auc": 0.62, "roc_auc_ci": [0.58, 0.66], "roc_auc_se": 0.02,
        "estimated_roc_auc": 0.80,
    }  # fmt: skip
    broken = checked({"2026-01-20": dict(matured)})["cohort_roc_auc"]
    assert broken.over_floor and broken.p_value < 1e-10
    # The same drop on a cohort too small to tell is not significant.
    small = checked({"2026-01-20": {**matured, "roc_auc_se": 0.2}})["cohort_roc_auc"]
    assert small.p_value > 0.1
    # Not judged while the outcomes still unknown are many (they are the journeys not
    # converted yet), unless it is the cohort's last night; and judged once only.
    unsettled = {**matured, "known": 4000}
    assert "cohort_roc_auc" not in checked({"2026-01-20": dict(unsettled)})
    last_night = cohort_checks({long_ago: dict(unsettled)}, {}, night_before, long_ago, settings)
    assert [c.check for c in last_night] == ["cohort_roc_auc"]
    again = {"2026-01-20": dict(matured)}
    assert "cohort_roc_auc" not in checked(again, {"2026-01-20": {"judged": True}})
    assert again["2026-01-20"]["judged"]  # carried forward


def test_an_older_reference_without_a_delay_curve_still_loads(tmp_path: Path) -> None:
    reference = Reference(Profile(), roc_auc=0.7)
    data = reference.to_dict()
    del data["conversion_delay"]  # saved before the curve was kept
    (tmp_path / "reference.json").write_text(json.dumps(data))
    loaded = Reference.load(tmp_path)
    assert loaded is not None and loaded.roc_auc == 0.7 and loaded.conversion_delay.hours == ()
    curve = DelayCurve.of(np.array([1.0, 2.0, 5.0]))
    Reference(Profile(), conversion_delay=curve).save(tmp_path)
    assert Reference.load(tmp_path).conversion_delay == curve  # round-trips as it was


def test_a_column_is_plotted_once_its_mix_moved_half_its_floor() -> None:
    def mix(column: str, figure: float) -> Check:
        return Check("category_mix", column, "", figure, 0.1, 0.5, figure >= 0.1)

    found = [
        mix("channel", 0.06),
        mix("device", 0.04),
        Check("flood", "user_id", "", 9, 5, None, True),
    ]
    assert moved_columns(found) == {"channel"}


@pytest.mark.slow
def test_cohort_figures_kept_from_last_night_equal_a_recompute(nights: dict[int, dict]) -> None:
    """The last night reused the labelled figures of cohorts with no new outcome: worked
    out again from nothing, but for the cohorts settled before (their figures stand), every
    cohort's figures are the same. A settled cohort keeps the figures of its settling night."""
    from datetime import datetime

    from journeys.attribution import scoring_model_uri
    from journeys.datasets import read_metadata
    from journeys.monitor import cohort_history, settled
    from journeys.trained_model import load_model

    config, root = nights[0]["config"], nights[0]["folder"]
    report = nights[DAYS - 1]["report"]
    with isolated(root):
        uri = scoring_model_uri(read_metadata(config.paths.scores))
        trained = load_model(uri, tracking_uri=config.mlflow.tracking_uri)
    folder = Path(config.paths.reports) / MONITOR_DIR
    end = datetime.fromisoformat(report["end"])
    before = nights[DAYS - 2]["report"]["cohorts"]
    standing = {n: c for n, c in before.items() if settled(c, config.monitor)}
    assert 0 < len(standing) < len(before)  # some cohorts settled, some still updating
    journeys = Path(config.paths.journeys)
    fresh = cohort_history(folder, journeys, end, standing, trained.reference, config)
    fresh = json.loads(json.dumps(fresh, default=float, allow_nan=True))  # as report.json holds
    reused = report["cohorts"]
    assert set(fresh) == set(reused) and len(fresh) >= 30
    for name in standing:  # as on the night it settled
        night = min(n for n in range(TRAIN_DAYS + 1, DAYS) if name in nights[n]["report"]["cohorts"] and settled(nights[n]["report"]["cohorts"][name], config.monitor))  # fmt: skip
        settling = nights[night]["report"]["cohorts"][name]
        assert reused[name] == settling, name
    for name, cohort in fresh.items():
        for key, value in cohort.items():
            if isinstance(value, float) and not math.isfinite(value):
                assert reused[name][key] is None, (name, key)
            else:
                assert reused[name][key] == pytest.approx(value), (name, key)

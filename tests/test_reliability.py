"""Reliability: crashes, bad input and load lose nothing (issue 7).

Every test here injects the real fault: a SIGKILL of the real CLI in a child process,
random bytes and wrong encodings fed to `journeys ingest`, truncated Parquet, a user
with a million events, an unreachable MLflow server, two ingests racing on one folder.
Data are tiny so the whole file runs in a few minutes on a loaded 2-core machine.
docs/reliability.md maps each fault to the test that proves what the product does.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from journeys.cli import main
from journeys.pipeline_lock import HELD_ENV, LOCK_FILE, hold_lock
from journeys.storage import sweep_crash_litter
from tests.conftest import make_journeys_dataset

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PYTHONUNBUFFERED": "1",
}
ENV.pop("MLFLOW_TRACKING_URI", None)
TINY = [
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=1",
    "model.time_buckets=8",
    "train.max_epochs=1",
    "train.baselines=[prior]",
    "train.accelerator=cpu",
    "train.batch_size=64",
    "train.warmup_steps=5",
    # One epoch on a few hundred journeys: too little to judge a model on (the champion
    # guard has its own tests); these test what a crash leaves, which needs a champion.
    "promotion.guard=false",
]
MODEL_URI = "models:/journey-conversion@champion"
# Fractions of an uninterrupted run's wall time at which the child is killed.
KILL_POINTS = (0.3, 0.55, 0.75, 0.9, 0.97)
SCORE_KILL_POINTS = (0.5, 0.9)  # scoring: mostly imports, then one swap


# ----------------------------------------------------------------------------- helpers


def path_args(folder: Path, raw: Path | None = None) -> list[str]:
    """`--set paths.*=...` for every product path under `folder`."""
    items = {
        "journeys": folder / "journeys",
        "quarantine": folder / "quarantine",
        "scores": folder / "scores",
        "reports": folder / "reports",
        "checkpoints": folder / "checkpoints",
    }
    if raw is not None:
        items["raw"] = raw
    return [arg for key, value in items.items() for arg in ("--set", f"paths.{key}={value}")]


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "journeys.cli", *args]


def run_cli(args: list[str], env: dict[str, str] | None = None, timeout: float = 300):
    """Run the CLI in a child process to completion; (exit code, stdout, stderr, seconds)."""
    started = time.perf_counter()
    done = subprocess.run(
        cli(*args), cwd=ROOT, env=env or ENV, capture_output=True, text=True, timeout=timeout
    )
    return done.returncode, done.stdout, done.stderr, time.perf_counter() - started


PROBE = (
    "import json, resource, subprocess, sys;"
    "rc = subprocess.call(sys.argv[1:]);"
    "use = resource.getrusage(resource.RUSAGE_CHILDREN);"
    "print(json.dumps([rc, use.ru_maxrss, use.ru_utime + use.ru_stime]), file=sys.stderr)"
)


def run_measured(args: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT):
    """Run the CLI in a grandchild and measure it alone (`getrusage(RUSAGE_CHILDREN)`).

    Returns (exit code, stderr without the probe line, wall s, CPU s, peak RSS GB).
    """
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *cli(*args)],
        cwd=cwd, env=env or ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    wall = time.perf_counter() - started
    *lines, last = done.stderr.strip().splitlines()
    code, peak_kb, cpu = json.loads(last)
    return code, "\n".join(lines), wall, cpu, peak_kb / 1024**2


def kill_after(args: list[str], delay: float, env: dict[str, str] | None = None) -> int | None:
    """Start the CLI, SIGKILL it after `delay` s; its exit code if it finished first."""
    process = subprocess.Popen(
        cli(*args), cwd=ROOT, env=env or ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        return process.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        process.wait()
        return None


def snapshot(folder: Path) -> dict[str, bytes] | None:
    """Every file under `folder` (relative path -> bytes); None when the folder is absent."""
    if not folder.exists():
        return None
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def hidden_litter(parent: Path) -> list[str]:
    """Temporary names (starting with '.') a crash left beside the outputs."""
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def scores_frame(folder: Path) -> pl.DataFrame:
    """The scores without the per-run column (`scored_at`), in journey order."""
    frame = pl.read_parquet(sorted(folder.glob("*.parquet")))
    return frame.drop("scored_at").sort("journey_id")


def journeys_dataset(folder: Path, n: int, seed: int) -> Path:
    """`make_journeys_dataset` into `folder`; returns the folder."""
    make_journeys_dataset(folder, n=n, seed=seed)
    return folder


def one_line(stderr: str) -> bool:
    lines = [line for line in stderr.splitlines() if line.strip()]
    return len(lines) == 1


@contextlib.contextmanager
def captured() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        yield out, err


def ingest_in_process(raw: Path, folder: Path, *extra: str) -> tuple[int, str]:
    """`journeys.cli.main(["ingest", ...])`; (exit code, stderr)."""
    with captured() as (_, err):
        code = main(["ingest", "--full", *path_args(folder, raw), *extra])
    return code, err.getvalue()


def accounting_holds(report: dict) -> bool:
    accounted = (
        report["rows_valid"]
        + report["quarantined_total"]
        + report["duplicates_dropped"]
        + report["dropped_by_config"]
    )
    return report["rows_read"] == accounted


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two simulated logs: `old` (small, the previous day's output) and `new` (~1-3 s)."""
    from journeys.simulate import simulate

    root = tmp_path_factory.mktemp("logs")
    simulate(root / "old", users=300, seed=1)
    simulate(root / "new", users=15_000, seed=2)
    return {"old": root / "old", "new": root / "new"}


@pytest.fixture(scope="module")
def reference_ingest(logs, tmp_path_factory) -> dict:
    """An uninterrupted ingest of the `new` log: its output and wall time."""
    folder = tmp_path_factory.mktemp("reference")
    code, _, err, seconds = run_cli(["ingest", "--full", *path_args(folder, logs["new"])])
    assert code == 0, err
    return {"snapshot": snapshot(folder / "journeys"), "seconds": seconds, "folder": folder}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One tiny model trained once with the real `journeys train` (SQLite tracking in tmp)."""
    folder = tmp_path_factory.mktemp("model")
    make_journeys_dataset(folder / "journeys", n=400, seed=3)
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    env = {**ENV, "MLFLOW_TRACKING_URI": uri}
    args = ["train", *path_args(folder), *sets(*TINY)]
    done = subprocess.run(cli(*args), cwd=folder, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"folder": folder, "tracking_uri": uri, "env": env, "uri": MODEL_URI}


# ----------------------------------------------------------------------------- kill -9


@pytest.mark.slow
def test_kill_9_during_ingest_leaves_previous_output_or_none_and_rerun_matches(
    logs, reference_ingest, tmp_path: Path
) -> None:
    """SIGKILL `journeys ingest` at several points: `paths.journeys` is always the previous
    complete output (byte-identical), the new complete one, or absent - never partial -
    and a rerun gives exactly the uninterrupted run's output and removes the killed
    runs' temporary folders."""
    new = reference_ingest["snapshot"]
    code, _, err, _ = run_cli(["ingest", *path_args(tmp_path, logs["old"])])
    assert code == 0, err
    previous = snapshot(tmp_path / "journeys")
    saved = tmp_path / "previous-journeys"
    shutil.copytree(tmp_path / "journeys", saved)

    outcomes, litter = [], set()
    for fraction in KILL_POINTS:
        shutil.rmtree(tmp_path / "journeys", ignore_errors=True)
        shutil.copytree(saved, tmp_path / "journeys")
        delay = fraction * reference_ingest["seconds"]
        finished = kill_after(["ingest", "--full", *path_args(tmp_path, logs["new"])], delay)
        seen = snapshot(tmp_path / "journeys")
        if seen is None:
            state = "none"
        else:
            state = "previous" if seen == previous else "new" if seen == new else "PARTIAL"
        outcomes.append((fraction, finished, state))
        litter |= set(hidden_litter(tmp_path))
    assert all(state != "PARTIAL" for *_, state in outcomes), outcomes
    print(f"kill outcomes {outcomes}; temporary names left by the kills: {sorted(litter)}")

    code, _, err, _ = run_cli(["ingest", "--full", *path_args(tmp_path, logs["new"])])
    assert code == 0, err
    assert snapshot(tmp_path / "journeys") == new
    assert hidden_litter(tmp_path) == [LOCK_FILE]  # the rerun swept the killed runs' litter


@pytest.mark.slow
def test_kill_9_during_a_nightly_ingest_and_its_scoring_then_the_next_run_completes(
    tiny_model, tmp_path: Path
) -> None:
    """SIGKILL a nightly `journeys ingest` (one new day file) and then the `journeys score`
    after it, at several points: the journeys (manifest and state included) and the scores
    are the previous night's or the new ones, never a mix, and the next runs give exactly
    what uninterrupted ones give: no row counted twice, no journey lost."""
    from test_nightly import event_log, write_days

    env = tiny_model["env"]
    files = write_days(event_log(seed=21, users=3000, days=30), tmp_path / "days")
    raw = tmp_path / "raw"
    raw.mkdir()
    for file in files[:-1]:
        shutil.copy2(file, raw / file.name)
    features = sets(
        "data.features=[channel,device]", "vocab.min_count=1", "score.chunk_journeys=500"
    )
    ingest = ["ingest", *path_args(tmp_path, raw), *features]
    score = ["score", *path_args(tmp_path, raw), *features, "--model", tiny_model["uri"]]
    for args in (ingest, score):  # last night
        code, _, err, _ = run_cli(args, env)
        assert code == 0, err
    shutil.copy2(files[-1], raw / files[-1].name)  # tonight's file
    saved = tmp_path / "saved"
    for name in ("journeys", "quarantine", "scores"):
        shutil.copytree(tmp_path / name, saved / name)
    previous = {name: snapshot(tmp_path / name) for name in ("journeys", "scores")}

    def restore() -> None:
        for name in ("journeys", "quarantine", "scores"):
            shutil.rmtree(tmp_path / name, ignore_errors=True)
            shutil.copytree(saved / name, tmp_path / name)

    # Uninterrupted, for reference: the journeys and scores tonight's runs must end with.
    code, _, err, ingest_seconds = run_cli(ingest, env)
    assert code == 0, err
    new_journeys = snapshot(tmp_path / "journeys")
    assert (
        json.loads((tmp_path / "journeys" / "ingest_report.json").read_text())["ingest"]["mode"]
        == "incremental"
    )
    code, _, err, score_seconds = run_cli(score, env)
    assert code == 0, err
    new_scores = scores_frame(tmp_path / "scores").drop("as_of", "quiet_seconds")

    outcomes = []
    for fraction in KILL_POINTS:
        restore()
        kill_after(ingest, fraction * ingest_seconds, env)
        seen = snapshot(tmp_path / "journeys")
        state = "none" if seen is None else (
            "previous" if seen == previous["journeys"] else "new" if seen == new_journeys
            else "PARTIAL"
        )  # fmt: skip
        outcomes.append(("ingest", fraction, state))
        code, _, err, _ = run_cli(ingest, env)  # the next run completes the night
        assert code == 0, err
        assert snapshot(tmp_path / "journeys") == new_journeys
    for fraction in SCORE_KILL_POINTS:
        restore()
        assert run_cli(ingest, env)[0] == 0
        kill_after(score, fraction * score_seconds, env)
        seen = snapshot(tmp_path / "scores")
        state = "none" if seen is None else "previous" if seen == previous["scores"] else "new"
        if state == "new":  # complete: every journey once, with tonight's scores
            assert_frame_equal(
                scores_frame(tmp_path / "scores").drop("as_of", "quiet_seconds"), new_scores,
                abs_tol=1e-6,
            )  # fmt: skip
        outcomes.append(("score", fraction, state))
        code, _, err, _ = run_cli(score, env)
        assert code == 0, err
        assert_frame_equal(
            scores_frame(tmp_path / "scores").drop("as_of", "quiet_seconds"), new_scores,
            abs_tol=1e-6,
        )  # fmt: skip
    assert all(state != "PARTIAL" for *_, state in outcomes), outcomes
    print(f"nightly kill outcomes {outcomes}")


@pytest.mark.slow
def test_kill_9_during_scoring_leaves_previous_scores_or_none_and_rerun_matches(
    tiny_model, tmp_path: Path
) -> None:
    """SIGKILL `journeys score --model <uri>` at several points: `paths.scores` is the
    previous complete scores, the new complete ones, or absent; a rerun equals an
    uninterrupted run (all columns but `scored_at`)."""
    env = tiny_model["env"]
    journeys_dataset(tmp_path / "big", n=3000, seed=5)

    def score(input_folder: Path, out: Path) -> list[str]:
        return [
            "score", *path_args(tmp_path), "--model", tiny_model["uri"],
            "--input", str(input_folder), "--out", str(out),
            *sets("score.chunk_journeys=500"),
        ]  # fmt: skip

    code, _, err, seconds = run_cli(score(tmp_path / "big", tmp_path / "reference"), env)
    assert code == 0, err
    reference = scores_frame(tmp_path / "reference")
    assert reference.height == 3000
    (tmp_path / "scores").mkdir()  # the previous day's complete scores
    (tmp_path / "scores" / "part-00000.parquet").write_bytes(b"previous scores")
    previous = snapshot(tmp_path / "scores")
    saved = tmp_path / "previous-scores"
    shutil.copytree(tmp_path / "scores", saved)

    outcomes = []
    for fraction in SCORE_KILL_POINTS:
        shutil.rmtree(tmp_path / "scores", ignore_errors=True)
        shutil.copytree(saved, tmp_path / "scores")
        finished = kill_after(score(tmp_path / "big", tmp_path / "scores"), fraction * seconds, env)
        seen = snapshot(tmp_path / "scores")
        if seen is None:
            state = "none"
        elif seen == previous:
            state = "previous"
        elif scores_frame(tmp_path / "scores").equals(reference):
            state = "new"
        else:
            state = "PARTIAL"
        outcomes.append((fraction, finished, state))
    assert all(state != "PARTIAL" for *_, state in outcomes), outcomes
    print(f"kill outcomes {outcomes}; litter: {hidden_litter(tmp_path)}")

    code, _, err, _ = run_cli(score(tmp_path / "big", tmp_path / "scores"), env)
    assert code == 0, err
    assert scores_frame(tmp_path / "scores").equals(reference)
    assert hidden_litter(tmp_path) == [LOCK_FILE]


@pytest.mark.slow
def test_kill_9_during_training_then_resume_finishes_in_the_same_single_run(
    tmp_path: Path,
) -> None:
    """SIGKILL `journeys train` right after its first `last.ckpt` appears; `journeys
    train --resume` continues that run to the configured number of epochs: one MLflow
    transformer run, FINISHED, with one val_roc_auc per epoch."""
    from mlflow import MlflowClient

    make_journeys_dataset(tmp_path / "journeys", n=1500, seed=6)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**ENV, "MLFLOW_TRACKING_URI": uri}
    epochs = 3
    args = ["train", *path_args(tmp_path), *sets(*TINY, f"train.max_epochs={epochs}")]
    process = subprocess.Popen(
        cli(*args), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 240
    checkpoints = tmp_path / "checkpoints"
    while not list(checkpoints.glob("*/last.ckpt")):
        assert process.poll() is None, "training ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint within 240 s"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    state = json.loads((checkpoints / "latest.json").read_text())
    assert state["status"] == "training"

    code, out, err, _ = run_cli([*args, "--resume"], env)
    assert code == 0, err[-3000:]
    assert f"resuming MLflow run {state['run_id']}" in out
    assert "training from the start" not in out
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("journeys")
    runs = client.search_runs(
        [experiment.experiment_id], filter_string="tags.model_family = 'transformer'"
    )
    assert [r.info.run_id for r in runs] == [state["run_id"]]
    assert runs[0].info.status == "FINISHED"
    epochs_logged = {int(m.value) for m in client.get_metric_history(state["run_id"], "epoch")}
    assert epochs_logged == set(range(epochs))
    assert len(client.get_metric_history(state["run_id"], "val_roc_auc")) == epochs
    assert json.loads((checkpoints / "latest.json").read_text())["status"] == "done"


# ----------------------------------------------------------------------------- bad input

_FUZZ_ROOT = Path(tempfile.mkdtemp(prefix="journeys-fuzz-"))
atexit.register(shutil.rmtree, _FUZZ_ROOT, True)
_counter = iter(range(10**9))
FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
HEADERS = [
    "user_id,timestamp,event_type,channel,device",
    "user_id,timestamp,event_type",  # missing feature columns
    "user_id,event_type,channel,device",  # missing timestamp
    "timestamp,event_type,channel,device",  # missing user_id
    "",
]
cell = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["2026-01-01T00:00:00Z", "2026-13-45", "1e308", "purchase", "click", ""]),
    st.integers().map(str),
)
json_value = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=True),
        st.text(max_size=20),
        st.sampled_from(["2026-01-01T00:00:00Z", "u1", "click", "purchase"]),
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=5,
)
json_key = st.sampled_from(["user_id", "timestamp", "event_type", "channel", "device", "x"])


def check_ingest_outcome(raw: Path) -> None:
    """The fuzz property: no exception; exit 0 with balanced accounting, or exit 2 and
    exactly one stderr line."""
    folder = raw.parent / "out"
    code, err = ingest_in_process(raw, folder)
    assert code in (0, 2), (code, err)
    if code == 0:
        report = json.loads((folder / "journeys" / "ingest_report.json").read_text())
        assert accounting_holds(report), report
    else:
        assert one_line(err), err


def fuzz_file(name: str, content: bytes) -> Path:
    folder = _FUZZ_ROOT / str(next(_counter))
    folder.mkdir()
    path = folder / name
    path.write_bytes(content)
    return path


@FUZZ
@given(
    content=st.binary(max_size=2000),
    name=st.sampled_from(["e.csv", "e.jsonl", "e.parquet", "e.csv.gz", "e.tsv"]),
)
def test_fuzz_random_bytes_never_crash_ingest(content: bytes, name: str) -> None:
    """Random bytes under any supported extension: exit 0 or a one-line exit 2."""
    check_ingest_outcome(fuzz_file(name, content))


@FUZZ
@given(
    header=st.sampled_from(HEADERS),
    rows=st.lists(st.lists(cell, min_size=0, max_size=6), max_size=20),
    encoding=st.sampled_from(["utf-8", "latin-1", "utf-16", "utf-8-sig", "cp1252"]),
)
def test_fuzz_csv_encodings_missing_columns_and_ragged_rows(header, rows, encoding) -> None:
    """CSV in wrong encodings, with missing columns, ragged rows, a header only or
    nothing: exit 0 with balanced accounting or a one-line exit 2."""
    lines = [header, *[",".join(f'"{c}"' for c in row) for row in rows]]
    text = "\n".join(lines) + ("\n" if lines else "")
    content = text.encode(encoding, errors="replace")
    check_ingest_outcome(fuzz_file("events.csv", content))


@FUZZ
@given(rows=st.lists(st.dictionaries(json_key, json_value, max_size=6), max_size=15))
def test_fuzz_json_lines_with_mixed_types(rows) -> None:
    """JSON Lines whose values change type between rows (numbers, strings, lists,
    objects, null): exit 0 with balanced accounting or a one-line exit 2."""
    content = "\n".join(json.dumps(row) for row in rows).encode()
    check_ingest_outcome(fuzz_file("events.jsonl", content))


@pytest.mark.parametrize(
    "name, content",
    [
        ("empty.csv", b""),
        ("header_only.csv", b"user_id,timestamp,event_type,channel,device\n"),
        ("empty.jsonl", b""),
        ("blank_lines.jsonl", b"\n\n\n"),
        (
            "huge_field.csv",
            b"user_id,timestamp,event_type,channel,device\n"
            + b"u1,2026-01-01T00:00:00Z,"
            + b"x" * 5_000_000
            + b",web,mobile\n"
            + b"u1,2026-01-01T00:01:00Z,purchase,web,mobile\n",
        ),
        (
            "latin1.csv",
            "user_id,timestamp,event_type,channel,device\n"
            "usér,2026-01-01T00:00:00Z,clíck,wéb,mobile\n".encode("latin-1"),
        ),
        (
            "utf16.csv",
            "user_id,timestamp,event_type,channel,device\n"
            "u1,2026-01-01T00:00:00Z,click,web,mobile\n".encode("utf-16"),
        ),
    ],
)
def test_named_bad_inputs_exit_0_with_accounting_or_one_line_exit_2(
    name: str, content: bytes, tmp_path: Path
) -> None:
    """The bad inputs the issue names, each once (huge field: 5 MB in one cell)."""
    raw = tmp_path / name
    raw.write_bytes(content)
    check_ingest_outcome(raw)


def _valid_parquet(path: Path, n: int = 2000) -> None:
    start = datetime(2026, 1, 1, tzinfo=UTC)
    pl.DataFrame(
        {
            "user_id": [f"u{i % 50}" for i in range(n)],
            "timestamp": [start + timedelta(minutes=i) for i in range(n)],
            "event_type": ["click"] * n,
            "channel": ["web"] * n,
            "device": ["mobile"] * n,
        }
    ).write_parquet(path)


@pytest.mark.parametrize("damage", ["truncated", "garbled_footer", "zero_bytes"])
def test_corrupt_parquet_raw_log_exits_2_naming_the_file(damage: str, tmp_path: Path) -> None:
    """A truncated or corrupt Parquet event log: exit 2, one line, naming the file."""
    raw = tmp_path / "raw"
    raw.mkdir()
    _valid_parquet(raw / "good.parquet")
    bad = raw / "bad.parquet"
    _valid_parquet(bad)
    data = bad.read_bytes()
    if damage == "truncated":
        bad.write_bytes(data[: len(data) // 2])
    elif damage == "garbled_footer":
        bad.write_bytes(data[:-12] + b"\xff" * 12)
    else:
        bad.write_bytes(b"")
    code, err = ingest_in_process(raw, tmp_path / "out")
    assert code == 2, err
    assert one_line(err) and "bad.parquet" in err, err
    assert not (tmp_path / "out" / "journeys").exists()


def test_corrupt_parquet_scoring_input_exits_2_naming_the_file(
    tiny_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A journeys folder with a truncated part file: `journeys score` exits 2 naming it,
    and the previous scores stay."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tiny_model["tracking_uri"])
    journeys = journeys_dataset(tmp_path / "journeys", n=100, seed=7)
    part = journeys / "part-00000.parquet"
    part.write_bytes(part.read_bytes()[:-200])
    (tmp_path / "scores").mkdir()
    (tmp_path / "scores" / "part-00000.parquet").write_bytes(b"previous scores")
    with captured() as (_, err):
        code = main(
            ["score", *path_args(tmp_path), "--model", tiny_model["uri"], "--input", str(journeys)]
        )
    assert code == 2, err.getvalue()
    assert one_line(err.getvalue()) and "part-00000.parquet" in err.getvalue(), err.getvalue()
    assert (tmp_path / "scores" / "part-00000.parquet").read_bytes() == b"previous scores"


# ----------------------------------------------------------------------------- one huge user

MEMORY_BOUND_GB = 1.5


def test_one_user_with_a_million_events_is_truncated_in_bounded_memory(tmp_path: Path) -> None:
    """1,000,000 events of one user, one long journey (1 s apart, no conversion): ingest
    keeps the last `journey.max_events` events, records the true length, and the child's
    peak RSS stays under 1.5 GB."""
    n = 1_000_000
    start = datetime(2026, 1, 1, tzinfo=UTC)
    types = ["impression", "click", "search", "view_product"]
    pl.DataFrame(
        {
            "user_id": pl.repeat("whale", n, eager=True),
            "timestamp": pl.datetime_range(
                start, start + timedelta(seconds=n - 1), "1s", eager=True, time_zone="UTC"
            ),
            "event_type": pl.Series([types[i % 4] for i in range(n)]),
            "channel": pl.repeat("search", n, eager=True),
            "device": pl.repeat("mobile", n, eager=True),
        }
    ).write_parquet(tmp_path / "whale.parquet")

    no_conversion = sets("ingest.require_conversions=false")  # the whale never buys
    args = ["ingest", *path_args(tmp_path, tmp_path / "whale.parquet"), *no_conversion]
    code, err, _, _, peak_gb = run_measured(args)
    assert code == 0, err[-2000:]
    print(f"peak RSS of ingest with one 1M-event user: {peak_gb:.2f} GB")
    assert peak_gb < MEMORY_BOUND_GB

    journeys = pl.read_parquet(tmp_path / "journeys" / "*.parquet")
    assert journeys.height == 1
    row = journeys.row(0, named=True)
    assert row["n_events"] == 64 and len(row["event_type"]) == 64
    assert row["n_events_total"] == n
    assert row["event_time"][-1] == start + timedelta(seconds=n - 1)  # the most recent kept


# ----------------------------------------------------------------------------- MLflow down

UNREACHABLE = "http://127.0.0.1:9"


def test_training_fails_fast_with_one_line_when_mlflow_is_unreachable(tmp_path: Path) -> None:
    """Tracking URI http://127.0.0.1:9: `journeys train` exits 2 with one stderr line,
    using < 15 s of CPU (wall time on a loaded shared machine is mostly waiting for
    the CPU to import torch and Lightning), before any checkpoint or state is written."""
    make_journeys_dataset(tmp_path / "journeys", n=300, seed=8)
    args = ["train", *path_args(tmp_path), *sets(*TINY, f"mlflow.tracking_uri={UNREACHABLE}")]
    code, err, wall, cpu, _ = run_measured(args)
    assert code == 2, err[-2000:]
    assert one_line(err) and "127.0.0.1:9" in err, err
    print(f"failed after {wall:.1f} s wall, {cpu:.1f} s CPU")
    assert cpu < 15, (wall, cpu)
    assert not (tmp_path / "checkpoints").exists()


def test_unreachable_mlflow_is_reported_before_torch_is_imported(tmp_path: Path) -> None:
    """The tracking check needs no torch: the one-line error comes before the heavy
    imports, so it is instant even on a loaded machine."""
    make_journeys_dataset(tmp_path / "journeys", n=300, seed=8)
    args = ["train", *path_args(tmp_path), *sets(*TINY, f"mlflow.tracking_uri={UNREACHABLE}")]
    script = (
        "import sys; from journeys.cli import main; code = main(sys.argv[1:]);"
        "print('torch' in sys.modules, 'lightning' in sys.modules); sys.exit(code)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, *args], cwd=ROOT, env=ENV, capture_output=True, text=True
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "False"]


@pytest.fixture(scope="module")
def prefect_api() -> Iterator[None]:
    """A temporary Prefect API (own PREFECT_HOME) for the flow tests of this module."""
    from prefect.testing.utilities import prefect_test_harness

    home = tempfile.mkdtemp(prefix="journeys-prefect-home-")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFECT_HOME", home)
        with prefect_test_harness(server_startup_timeout=120):
            yield
    shutil.rmtree(home, ignore_errors=True)


@pytest.mark.slow
def test_scheduled_train_flow_fails_and_keeps_last_good_outputs_when_mlflow_is_down(
    prefect_api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The train flow with an unreachable tracking server ends Failed, and the journeys
    and scores folders of the last good run stay byte-identical."""
    from flows.pipeline import train_flow
    from journeys.config import load_config

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    make_journeys_dataset(tmp_path / "journeys", n=300, seed=9)
    scores = tmp_path / "scores"
    scores.mkdir()
    (scores / "part-00000.parquet").write_bytes(b"last good scores")
    before = (snapshot(tmp_path / "journeys"), snapshot(scores))
    config = load_config(
        None,
        [a for a in path_args(tmp_path) if a != "--set"]
        + [*TINY, f"mlflow.tracking_uri={UNREACHABLE}", "orchestration.retries=0"],
    )
    started = time.perf_counter()
    state = train_flow(config=config, return_state=True)
    assert state.is_failed(), state
    assert time.perf_counter() - started < 60
    assert (snapshot(tmp_path / "journeys"), snapshot(scores)) == before


# ----------------------------------------------------------------------------- concurrency


@pytest.mark.slow
def test_two_ingests_at_once_on_the_same_paths_never_mix_outputs(
    logs, reference_ingest, tmp_path: Path
) -> None:
    """Two `journeys ingest` processes started together on the same paths (3 rounds):
    each finishes or is refused with one line, and the journeys folder equals one
    uninterrupted run's output, with no half-swapped folder left beside it."""
    args = ["ingest", "--full", *path_args(tmp_path, logs["new"])]
    for _ in range(3):
        processes = [
            subprocess.Popen(
                cli(*args),
                cwd=ROOT,
                env=ENV,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(2)
        ]
        results = [(p.wait(timeout=300), p.stderr.read()) for p in processes]
        for code, err in results:
            assert code == 0 or (code == 2 and one_line(err)), (code, err[-2000:])
        assert any(code == 0 for code, _ in results)
        assert snapshot(tmp_path / "journeys") == reference_ingest["snapshot"]
        assert not (tmp_path / ".journeys.old").exists()


def test_a_cli_stage_waits_for_the_data_folders_lock_and_says_who_holds_it(
    logs, reference_ingest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a scheduled run holds the data folder's lock, `journeys ingest` waits for it:
    past `orchestration.lock_timeout` it exits 2 with one line naming the holder and
    writes nothing. A process the holder started (its training subprocess) goes ahead."""
    monkeypatch.delenv(HELD_ENV, raising=False)
    quick = ("--set", "orchestration.lock_timeout=1s")
    with hold_lock(tmp_path / LOCK_FILE, "journeys score"):
        code, err = ingest_in_process(logs["new"], tmp_path, *quick)
        notice, error = err.strip().splitlines()  # told once why it waits, then the error
        assert code == 2 and "waiting for journeys score" in notice, err
        assert (
            error.startswith("journeys ingest: error:")
            and "still locked by journeys score" in error
        )
        assert not (tmp_path / "journeys").exists()

        monkeypatch.setenv(HELD_ENV, str((tmp_path / LOCK_FILE).absolute()))
        code, err = ingest_in_process(logs["new"], tmp_path, *quick)
        assert code == 0, err
    assert snapshot(tmp_path / "journeys") == reference_ingest["snapshot"]


def test_crash_litter_of_dead_processes_is_swept_and_live_work_is_kept(tmp_path: Path) -> None:
    """Temporaries named for a dead process of this host are removed by the next writer;
    those of a live process, of another host, and other hidden files stay."""
    from journeys import storage

    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    host = storage._HOST
    other_host = "0" * 8 if host != "0" * 8 else "1" * 8
    dead = [f".journeys.{host}-{finished.pid}.ab_12.tmp", f".ingest.{host}-{finished.pid}.x9.tmp"]
    kept = [
        f".journeys.{host}-{os.getpid()}.live1.tmp",  # a live writer's staging folder
        f".journeys.{other_host}-{finished.pid}.far.tmp",
        LOCK_FILE,
        ".journeys.old",
    ]
    for name in dead + kept:
        (tmp_path / name).mkdir()
        (tmp_path / name / "part-00000.parquet").write_bytes(b"x")
    (tmp_path / f".report.json.{host}-{finished.pid}.f1.tmp").write_text("{")  # a file too

    removed = sweep_crash_litter(tmp_path)
    assert sorted(p.name for p in removed) == sorted(
        [*dead, f".report.json.{host}-{finished.pid}.f1.tmp"]
    )
    assert hidden_litter(tmp_path) == sorted(kept)

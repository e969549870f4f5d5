"""Benchmark `journeys ingest` against the same job written in DuckDB SQL and in pandas.

The job, identical for every engine (the product's rules, docs/contract.md, ingest and journeys):

- read the raw CSV with every column as text; parse timestamps (ISO 8601) to UTC;
- quarantine rows missing `user_id` / `event_type` or with an unparseable timestamp
  (written to Parquet with their original values, source file, row number and reason);
- drop exact duplicate rows (same original values in every column the product reads);
- order each user's events by (time, event type, features, row number) and split them into
  journeys after a gap longer than 7 days or after a `purchase`; label = the journey ended
  in a purchase, which is cut from the sequence; a purchase with nothing before it makes no
  journey; keep the last 64 events of each sequence, plus the true length;
- censor unconverted journeys ending within 7 days of the data's end; split the others
  70/15/15 by end time (the product's cut rule: the cut is the end time at index
  floor(n * fraction) of the sorted end times; journeys at the cut go to the later split);
- write the journeys as Parquet.

Each engine runs in its own fresh child process, so its peak memory (the kernel's high-water
mark of the child's resident set, `VmHWM`) is its own. The wall time is the job's alone (from
reading the CSV to the last Parquet byte written); interpreter start and imports are not
counted. `cpu s` is the child's whole user + system CPU time, all threads (interpreter start
and imports included: 0.1-0.4 s). `background` is the share of the machine's CPUs that other
processes used meanwhile: on a shared machine wall times grow with it while CPU seconds
barely move. The CSV is read once before every run so that every engine sees a warm page
cache; `--quiet` waits for idle CPUs first. With `--repeat`, the fastest run counts (and the
highest peak). After the runs, the outputs are compared journey by journey and row by row.
A run over `--timeout` (e.g. pandas on a big input) is reported as skipped.

Usage::

    .venv/bin/python benchmarks/ingest.py                       # 1M and 10M events
    .venv/bin/python benchmarks/ingest.py --quick               # 100k events, smoke run
    .venv/bin/python benchmarks/ingest.py --sizes 1000000 --engines journeys duckdb
    .venv/bin/python benchmarks/ingest.py --partitions 8 32     # journeys at two settings

Generated logs are cached under `data/bench/events-<size>/` (simulator, seed 0,
dirty_rate 0.01, about 20.7 events per user); outputs go to `data/bench/out/`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "data" / "bench"
CONFIG = ROOT / "conf" / "default.yaml"
EVENTS_PER_USER = 20.7  # the simulator's average with its default behaviour
ENGINES = ("journeys", "duckdb", "pandas")
SEED = 0
DIRTY_RATE = 0.01

# The job's settings, the same as conf/default.yaml (checked against it in the journeys child).
FEATURES = ("channel", "device")
CONVERSIONS = ("purchase",)
MAX_GAP_US = 7 * 86_400 * 1_000_000
MAX_EVENTS = 64
FRACTIONS = (0.7, 0.15, 0.15)
RAW_COLUMNS = ("user_id", "timestamp", "event_type", *FEATURES)
JOURNEY_COLUMNS = (
    "journey_id", "user_id", "start_time", "end_time", "n_events", "n_events_total",
    "label", "censored", "split", "event_type", "event_time", *FEATURES,
)  # fmt: skip


# --- the engines (each runs inside its own child process) ------------------------------------


def run_journeys(csv: Path, out: Path, partitions: int) -> dict[str, float]:
    """The product: `journeys.ingest.run_ingest` with conf/default.yaml and path overrides."""
    import journeys.ingest as ingest
    import journeys.sessionise as sessionise
    from journeys.config import load_config

    overrides = [f"ingest.partitions={partitions}", f"paths.raw={csv}"]
    if csv.stat().st_size < 1024:  # the start-up line's empty log: nothing to require
        overrides.append("ingest.require_conversions=false")
    config = load_config(CONFIG, overrides)
    data = config.data
    assert tuple(data.features) == FEATURES and tuple(data.conversion_events) == CONVERSIONS
    assert config.journey.max_gap_delta.total_seconds() * 1e6 == MAX_GAP_US
    assert config.journey.max_events == MAX_EVENTS and config.split.fractions == FRACTIONS

    # Time the three passes by wrapping the module's functions; ingest and pass 2 look
    # them up at call time, so this is the product's own code path with a clock around each pass.
    phases: dict[str, float] = {}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - start

        return wrapper

    ingest.stage = timed("1 stage", ingest.stage)
    sessionise.build_partition = timed("2 build partitions", sessionise.build_partition)
    ingest.finish = timed("3 finish", ingest.finish)
    ingest.run_ingest(
        config, raw=csv, journeys_folder=out / "journeys", quarantine_folder=out / "quarantine"
    )
    return phases


DUCKDB_STAGE = """
CREATE TEMP TABLE staged AS
SELECT *,
       CASE WHEN nullif(trim(user_id), '') IS NULL THEN 'missing_user_id'
            WHEN nullif(trim(event_type), '') IS NULL THEN 'missing_event_type'
            WHEN ts IS NULL THEN 'bad_timestamp' END AS reason
FROM (
    SELECT user_id, "timestamp", event_type, channel, device,
           TRY_CAST(trim("timestamp") AS TIMESTAMPTZ) AS ts,
           $source AS source_file,
           row_number() OVER () AS row_number
    FROM {reader}
)
"""
DUCKDB_READERS = {
    "csv": "read_csv($source, all_varchar = true, header = true)",
    "parquet": "read_parquet($source)",
}

DUCKDB_QUARANTINE = """
COPY (
    SELECT user_id, "timestamp", event_type, channel, device, source_file, row_number, reason
    FROM staged WHERE reason IS NOT NULL
) TO '{path}' (FORMAT parquet)
"""

# Dedupe on the original values, then normalise; sessionise with window functions over each
# user's ordered events; aggregate ordered lists and keep their last MAX_EVENTS elements.
DUCKDB_BUILD = """
CREATE TEMP TABLE built AS
WITH deduped AS (
    SELECT user_id, "timestamp", event_type, channel, device,
           any_value(ts) AS ts, min(row_number) AS row_number
    FROM staged WHERE reason IS NULL
    GROUP BY user_id, "timestamp", event_type, channel, device
),
events AS (
    SELECT trim(user_id) AS user_id, ts, trim(event_type) AS event_type,
           trim(channel) AS channel, trim(device) AS device, row_number,
           trim(event_type) IN (SELECT unnest($conversions)) AS conv
    FROM deduped
),
flagged AS (
    SELECT *,
           coalesce(
               epoch_us(ts) - epoch_us(lag(ts) OVER w) > $max_gap_us OR lag(conv) OVER w, true
           ) AS new_journey
    FROM events
    WINDOW w AS (PARTITION BY user_id ORDER BY ts, event_type, channel, device, row_number)
),
tagged AS (
    SELECT *,
           sum(new_journey::INTEGER) OVER (
               PARTITION BY user_id ORDER BY ts, event_type, channel, device, row_number
               ROWS UNBOUNDED PRECEDING
           ) AS journey
    FROM flagged
),
journeys AS (
    SELECT user_id, journey,
           min(ts) FILTER (WHERE NOT conv) AS start_time,
           max(ts) AS end_time,
           max(ts) FILTER (WHERE NOT conv) AS last_event_time,
           count(*) FILTER (WHERE NOT conv) AS n_events_total,
           bool_or(conv) AS label,  -- a purchase can only be a journey's last event
           list(struct_pack(event_type, ts, channel, device)
                ORDER BY ts, event_type, channel, device, row_number)
               FILTER (WHERE NOT conv) AS seq
    FROM tagged
    GROUP BY user_id, journey
    HAVING count(*) FILTER (WHERE NOT conv) > 0
)
SELECT user_id || '-' || epoch_us(start_time) || CASE WHEN same_start > 0
           THEN '-' || same_start ELSE '' END AS journey_id,
       user_id, start_time, end_time,
       least(n_events_total, $max_events)::INTEGER AS n_events,
       n_events_total::INTEGER AS n_events_total,
       label::TINYINT AS label,
       NOT label AND near_end AS censored,
       near_end,
       seq[-$max_events:] AS seq
FROM (
    SELECT *,
           (SELECT epoch_us(max(ts)) FROM events) - epoch_us(last_event_time) <= $max_gap_us
               AS near_end,
           -- journeys of one user starting at one instant: the later ones' place among them
           row_number() OVER (PARTITION BY user_id, start_time ORDER BY journey) - 1
               AS same_start
    FROM journeys
)
"""

DUCKDB_CUTS = """
WITH ends AS (
    SELECT end_time, row_number() OVER (ORDER BY end_time) - 1 AS i, count(*) OVER () AS n
    FROM built WHERE NOT near_end  -- censored, or converted as late: no split
)
SELECT max(end_time) FILTER (WHERE i = least(floor(n * $val), n - 1)) AS val_cut,
       max(end_time) FILTER (WHERE i = least(floor(n * $test), n - 1)) AS test_cut
FROM ends
"""

DUCKDB_WRITE = """
COPY (
    SELECT journey_id, user_id, start_time, end_time, n_events, n_events_total, label,
           censored,
           CASE WHEN near_end THEN 'none'
                WHEN end_time < $val_cut THEN 'train'
                WHEN end_time < $test_cut THEN 'val'
                ELSE 'test' END AS split,
           [s.event_type FOR s IN seq] AS event_type,
           [s.ts FOR s IN seq] AS event_time,
           [s.channel FOR s IN seq] AS channel,
           [s.device FOR s IN seq] AS device
    FROM built
) TO '{path}' (FORMAT parquet)
"""


class PhaseTimer:
    """Called with a phase's name when the phase ends: records the seconds since the last call."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._clock = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self._clock
        self._clock = now


def run_duckdb(csv: Path, out: Path) -> dict[str, float]:
    """The job as DuckDB SQL: temp tables for the staged rows and the built journeys."""
    import duckdb

    con = duckdb.connect()  # in memory; DuckDB spills to a temp folder if it must
    con.execute("SET TimeZone = 'UTC'")
    for name in ("journeys", "quarantine"):
        (out / name).mkdir(parents=True)
    phase = PhaseTimer()

    reader = DUCKDB_READERS[csv.suffix.lstrip(".")]
    con.execute(DUCKDB_STAGE.format(reader=reader), {"source": str(csv)})
    con.execute(DUCKDB_QUARANTINE.format(path=out / "quarantine" / "quarantine.parquet"))
    phase("read, validate, quarantine")
    # Row numbers are assigned; from here on nothing depends on row order, and letting
    # DuckDB reorder freely made the build faster in trials (16-23 s vs 27 s at 10M).
    con.execute("SET preserve_insertion_order = false")
    con.execute(
        DUCKDB_BUILD,
        {"conversions": list(CONVERSIONS), "max_gap_us": MAX_GAP_US, "max_events": MAX_EVENTS},
    )
    con.execute("DROP TABLE staged")
    phase("dedupe, sessionise, aggregate")
    cuts = con.execute(
        DUCKDB_CUTS, {"val": FRACTIONS[0], "test": FRACTIONS[0] + FRACTIONS[1]}
    ).fetchone()
    assert cuts is not None
    con.execute(
        DUCKDB_WRITE.format(path=out / "journeys" / "part-00000.parquet"),
        {"val_cut": cuts[0], "test_cut": cuts[1]},
    )
    phase("split, write")
    return phase.phases


def run_pandas(csv: Path, out: Path) -> dict[str, float]:
    """The job in vectorised pandas: sort, shift, cumsum, groupby; lists via groupby.agg(list)."""
    import numpy as np
    import pandas as pd

    phase = PhaseTimer()

    # Everything as text; an empty field stays "" (no NA guessing on values like "NA").
    if csv.suffix == ".parquet":  # text columns; a missing value reads as "", as in a CSV
        raw = pd.read_parquet(csv, columns=list(RAW_COLUMNS)).fillna("")
    else:
        raw = pd.read_csv(csv, dtype=str, keep_default_na=False, usecols=list(RAW_COLUMNS))
    raw["source_file"] = str(csv)
    raw["row_number"] = np.arange(1, len(raw) + 1, dtype=np.int64)
    ts = pd.to_datetime(
        raw["timestamp"].str.strip(), format="ISO8601", utc=True, errors="coerce"
    ).dt.as_unit("us")
    reason = pd.Series(
        np.select(
            [
                raw["user_id"].str.strip().eq("").to_numpy(),
                raw["event_type"].str.strip().eq("").to_numpy(),
                ts.isna().to_numpy(),
            ],
            ["missing_user_id", "missing_event_type", "bad_timestamp"],
            default="",
        ),
        index=raw.index,
    )
    bad = reason.ne("")
    quarantine = raw[bad].assign(reason=reason[bad])
    (out / "quarantine").mkdir(parents=True)
    quarantine.to_parquet(out / "quarantine" / "quarantine.parquet", index=False)
    phase("read, validate, quarantine")

    valid = raw[~bad].assign(ts=ts[~bad]).drop(columns="source_file")
    del raw, ts, reason, quarantine
    events = valid.drop_duplicates(subset=list(RAW_COLUMNS), keep="first")
    del valid
    events = events.drop(columns="timestamp")
    for name in ("user_id", "event_type", *FEATURES):
        events[name] = events[name].str.strip()
    data_end = events["ts"].max()
    phase("dedupe, normalise")

    events = events.sort_values(
        ["user_id", "ts", "event_type", *FEATURES, "row_number"], ignore_index=True
    )
    conv = events["event_type"].isin(CONVERSIONS)
    new_journey = (
        events["user_id"].ne(events["user_id"].shift())
        | (events["ts"].diff() > pd.Timedelta(microseconds=MAX_GAP_US))
        | conv.shift(fill_value=False)
    )
    events["journey"] = new_journey.cumsum()
    events["conv"] = conv
    phase("sort, sessionise")

    by_journey = events.groupby("journey", sort=False)
    ends = by_journey.agg(
        user_id=("user_id", "first"), end_time=("ts", "last"), label=("conv", "last")
    )
    seq = events[~conv]
    by_seq = seq.groupby("journey", sort=False)
    starts = by_seq.agg(
        start_time=("ts", "first"), last_event_time=("ts", "last"), n_events_total=("ts", "size")
    )
    tail = seq[by_seq.cumcount(ascending=False) < MAX_EVENTS]
    lists = tail.groupby("journey", sort=False)[["event_type", "ts", *FEATURES]].agg(list)
    lists = lists.rename(columns={"ts": "event_time"})
    journeys = ends.join(starts, how="inner").join(lists, how="inner")
    del events, seq, tail, lists
    phase("aggregate lists")

    journeys["n_events"] = journeys["n_events_total"].clip(upper=MAX_EVENTS).astype("int32")
    journeys["n_events_total"] = journeys["n_events_total"].astype("int32")
    journeys["label"] = journeys["label"].astype("int8")
    near_end = data_end - journeys["last_event_time"] <= pd.Timedelta(microseconds=MAX_GAP_US)
    journeys["censored"] = (journeys["label"] == 0) & near_end
    end_times = np.sort(journeys.loc[~near_end, "end_time"].to_numpy())
    n = len(end_times)
    val_cut = end_times[min(int(n * FRACTIONS[0]), n - 1)]
    test_cut = end_times[min(int(n * (FRACTIONS[0] + FRACTIONS[1])), n - 1)]
    end = journeys["end_time"].to_numpy()
    journeys["split"] = np.where(
        near_end,
        "none",
        np.where(end < val_cut, "train", np.where(end < test_cut, "val", "test")),
    )
    epoch_us = (journeys["start_time"] - pd.Timestamp(0, tz="UTC")) // pd.Timedelta(microseconds=1)
    journeys["journey_id"] = journeys["user_id"] + "-" + epoch_us.astype(str)
    same_start = journeys.groupby(["user_id", "start_time"]).cumcount()  # in journey order
    later = same_start > 0
    journeys.loc[later, "journey_id"] += "-" + same_start[later].astype(str)
    (out / "journeys").mkdir(parents=True)
    journeys[list(JOURNEY_COLUMNS)].to_parquet(out / "journeys" / "part-00000.parquet", index=False)
    phase("censor, split, write")
    return phase.phases


# --- child process: one engine, one input, one measurement -----------------------------------


def child(engine: str, csv: Path, out: Path, partitions: int) -> None:
    """Run one engine and print one JSON line: wall time, peak RSS, phase times."""
    rss_start = _rss_mb("VmRSS")
    start = time.perf_counter()
    if engine == "journeys":
        phases = run_journeys(csv, out, partitions)
    elif engine == "duckdb":
        phases = run_duckdb(csv, out)
    else:
        phases = run_pandas(csv, out)
    wall = time.perf_counter() - start
    print(
        json.dumps(
            {"wall_s": wall, "peak_mb": _rss_mb("VmHWM"), "start_mb": rss_start, "phases": phases}
        )
    )


def _rss_mb(field: str) -> float:
    """This process's current (`VmRSS`) or peak (`VmHWM`) resident set size, in MiB.

    Not `ru_maxrss`: Linux carries it over from the parent into a child started with
    fork/vfork + exec, so a child would report the parent's peak when that is higher.
    `VmHWM` belongs to the process image and starts afresh at exec.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # not Linux


# --- parent: data, runs, checks, table ---------------------------------------------------------


@dataclass
class Run:
    engine: str  # "journeys", "journeys p=32", "duckdb", "pandas"
    size: int  # nominal size (--sizes)
    events: int  # rows in the log
    input: str = "csv"  # or parquet
    wall_s: float | None = None  # the best (lowest) of the repeats
    walls: list[float] = field(default_factory=list)  # every repeat
    cpu_s: float | None = None  # the best repeat's CPU seconds (user + system)
    background: float | None = None  # the best repeat's CPU share used by other processes
    peak_mb: float | None = None  # the highest of the repeats
    start_mb: float | None = None  # the child's RSS when the job starts (interpreter, argparse)
    phases: dict[str, float] = field(default_factory=dict)  # the best repeat's
    counts: dict[str, int] = field(default_factory=dict)
    note: str = ""


def ensure_events(size: int) -> tuple[Path, int]:
    """The cached simulated log for `size` events (generated in a child if missing)."""
    folder = BENCH / f"events-{size}"
    summary = folder / "_truth" / "summary.json"
    if not summary.exists():
        users = max(1, round(size / EVENTS_PER_USER))
        print(f"generating ~{size:,} events ({users:,} users) in {folder} ...", flush=True)
        code = (
            "import sys; from journeys.simulate import simulate; "
            f"simulate(sys.argv[1], users={users}, seed={SEED}, dirty_rate={DIRTY_RATE})"
        )
        subprocess.run([sys.executable, "-c", code, str(folder)], check=True, cwd=ROOT)
    return folder / "events.csv", json.loads(summary.read_text())["n_events"]


def ensure_parquet(csv: Path) -> Path:
    """The same log as Parquet, every column as text (a warehouse export), cached."""
    import polars as pl

    path = csv.with_suffix(".parquet")
    if not path.exists():
        pl.scan_csv(csv, infer_schema=False).sink_parquet(path)
    return path


def empty_log() -> Path:
    """A log with the header row only: what each engine costs before any row is read."""
    path = BENCH / "events-0" / "events.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(",".join(RAW_COLUMNS) + "\n")
    return path


def warm_cache(path: Path) -> None:
    """Read the file once so that no engine pays for (or gains from) a cold page cache."""
    with open(path, "rb") as handle:
        while handle.read(1 << 24):
            pass


def wait_quiet(limit_s: float, busy_max: float = 0.15) -> float:
    """Wait (up to `limit_s`) until other processes use < `busy_max` of the CPUs; return it."""
    import psutil

    deadline = time.monotonic() + limit_s
    busy = psutil.cpu_percent(interval=1.0) / 100
    while busy >= busy_max and time.monotonic() < deadline:
        busy = psutil.cpu_percent(interval=2.0) / 100
    return busy


def _busy_s() -> float:
    """CPU seconds spent by the whole machine (all cores, all processes) since boot."""
    import psutil

    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def measure(
    engine: str, csv: Path, out: Path, partitions: int, timeout: float, quiet_s: float
) -> dict[str, Any]:
    """One fresh child for one engine; returns its JSON line (or an error note).

    Adds the child's CPU seconds and `background`: the share of the machine's CPUs that
    *other* processes used while the child ran (the machine may be shared; > 0.1 means the
    wall time is probably inflated by contention).
    """
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    warm_cache(csv)
    wait_quiet(quiet_s)
    command = [sys.executable, __file__, "--child", engine, str(csv), str(out), str(partitions)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy_before, start = _busy_s(), time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return {"error": f"over the {timeout:.0f} s limit"}
    elapsed, busy = time.perf_counter() - start, _busy_s() - busy_before
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"exit {done.returncode}: {tail}"}
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["cpu_s"] = cpu
    result["process_s"] = elapsed  # interpreter start and imports included
    result["background"] = max(0.0, busy - cpu) / (elapsed * (os.cpu_count() or 1))
    return result


def summarise(out: Path) -> dict[str, int]:
    """Counts from an engine's output files (the same reader for every engine)."""
    import polars as pl

    journeys = pl.scan_parquet(sorted((out / "journeys").glob("*.parquet")))
    row = journeys.select(
        journeys=pl.len(),
        converted=pl.col("label").cast(pl.Int64).sum(),
        censored=pl.col("censored").cast(pl.Int64).sum(),
        train=(pl.col("split") == "train").sum(),
        val=(pl.col("split") == "val").sum(),
        test=(pl.col("split") == "test").sum(),
        events_kept=pl.col("n_events").cast(pl.Int64).sum(),
        events_total=pl.col("n_events_total").cast(pl.Int64).sum(),
    ).collect()
    quarantined = pl.scan_parquet(sorted((out / "quarantine").glob("*.parquet"))).select(pl.len())
    return {**row.row(0, named=True), "quarantined": quarantined.collect().item()}


def canonical(out: Path) -> Any:
    """An engine's journeys in one canonical form (types, order) for exact comparison."""
    import polars as pl

    frame = pl.scan_parquet(sorted((out / "journeys").glob("*.parquet"))).select(
        pl.col("journey_id", "user_id"),
        pl.col("start_time", "end_time").cast(pl.Datetime("us", "UTC")),
        pl.col("n_events", "n_events_total", "label").cast(pl.Int64),
        pl.col("censored").cast(pl.Boolean),
        pl.col("split"),
        pl.col("event_type", *FEATURES).cast(pl.List(pl.String)),
        pl.col("event_time").cast(pl.List(pl.Datetime("us", "UTC"))),
    )
    return frame.sort("journey_id").collect()


def canonical_quarantine(out: Path) -> Any:
    """An engine's quarantined rows, ordered by row number, without the source path."""
    import polars as pl

    columns = [*RAW_COLUMNS, "row_number", "reason"]
    frame = pl.scan_parquet(sorted((out / "quarantine").glob("*.parquet")))
    return (
        frame.select(
            pl.col(columns).cast(pl.String).replace("", None)  # pandas keeps "" for empty fields
        )
        .collect()
        .sort(pl.col("row_number").cast(pl.Int64))
    )


def compare(outs: dict[str, Path]) -> list[str]:
    """Every engine's journeys and quarantine against the first one's."""
    names = list(outs)
    if len(names) < 2:
        return []
    reference = canonical(outs[names[0]])
    quarantine = canonical_quarantine(outs[names[0]])
    lines = []
    for name in names[1:]:
        same_quarantine = canonical_quarantine(outs[name]).equals(quarantine)
        lines.append(
            f"{name}: quarantine (values, row numbers, reasons) "
            + ("identical" if same_quarantine else "DIFFERS")
            + f" ({quarantine.height:,} rows)"
        )
        other = canonical(outs[name])
        if other.equals(reference):
            lines.append(f"{name}: journeys identical to {names[0]} ({reference.height:,})")
            continue
        differing = [
            c
            for c in reference.columns
            if other.height != reference.height
            or not other.get_column(c).equals(reference.get_column(c))
        ]
        lines.append(f"{name}: DIFFERS from {names[0]} in {', '.join(differing)}")
    return lines


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def table(runs: list[Run]) -> str:
    """The results as a Markdown table (readable in a terminal too).

    Ratios compare with `journeys` (the first --partitions value) on the same input: time
    (or cpu) > 1 means journeys is faster, memory > 1 means journeys uses less. `peak growth` is the
    engine's peak at this size over its peak at the smallest size measured.
    """
    base = {(r.size, r.input): r for r in runs if r.engine == "journeys" and r.wall_s}
    smallest: dict[tuple[str, str], Run] = {}
    for r in runs:
        if r.peak_mb and (r.engine, r.input) not in smallest:
            smallest[r.engine, r.input] = r
    lines = [
        "| engine | input | events | wall s | events/s | cpu s | background | peak MB "
        "| time ratio | cpu ratio | memory ratio | peak growth |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        if r.wall_s is None or r.peak_mb is None:
            lines.append(f"| {r.engine} | {r.input} | {r.events:,} |" + " - |" * 8 + f" {r.note} |")
            continue
        ref = base.get((r.size, r.input))
        first = smallest[r.engine, r.input]
        growth = "-" if first is r else f"{r.peak_mb / first.peak_mb:.2f}"
        lines.append(
            f"| {r.engine} | {r.input} | {r.events:,} | {r.wall_s:.1f} | {r.events / r.wall_s:,.0f} "
            f"| {r.cpu_s or 0:.1f} | {r.background or 0:.0%} | {r.peak_mb:,.0f} "
            f"| {ratio(r.wall_s, ref.wall_s if ref else None)} "
            f"| {ratio(r.cpu_s, ref.cpu_s if ref else None)} "
            f"| {ratio(r.peak_mb, ref.peak_mb if ref else None)} | {growth} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 3_000_000, 10_000_000])
    parser.add_argument(
        "--inputs", nargs="+", choices=("csv", "parquet"), default=["csv", "parquet"]
    )
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument(
        "--partitions",
        type=int,
        nargs="+",
        default=[8],
        help="ingest.partitions for journeys; the first is the reference for the ratios",
    )
    parser.add_argument("--quick", action="store_true", help="one small size (100k events)")
    parser.add_argument(
        "--timeout", type=float, default=900, help="seconds before a run is abandoned"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="fresh runs per engine and size; the best counts"
    )
    parser.add_argument(
        "--quiet",
        type=float,
        default=60,
        help="seconds to wait before each run for other processes to leave the CPUs idle",
    )
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        engine, csv, out, partitions = args.child
        child(engine, Path(csv), Path(out), int(partitions))
        return 0

    sizes = [100_000] if args.quick else args.sizes
    runs: list[Run] = []
    checks: list[str] = []
    startup = {}
    for engine in args.engines:  # an empty log: interpreter, imports, set-up
        out = BENCH / "out" / f"{engine}-empty"
        result = measure(engine, empty_log(), out, args.partitions[0], args.timeout, args.quiet)
        startup[engine] = result
        print(f"{engine:>16} empty log: {json.dumps(result)}", flush=True)
    logs = []
    for size in sizes:
        csv, n_events = ensure_events(size)
        logs += [
            (size, n_events, csv if kind == "csv" else ensure_parquet(csv), kind)
            for kind in args.inputs
        ]
    for size, n_events, csv, kind in logs:
        outs: dict[str, Path] = {}
        for engine in args.engines:
            settings = args.partitions if engine == "journeys" else [0]
            for partitions in settings:
                label = engine
                if engine == "journeys" and partitions != args.partitions[0]:
                    label = f"journeys p={partitions}"
                out = BENCH / "out" / f"{label.replace(' ', '_').replace('=', '')}-{size}-{kind}"
                run = Run(label, size, n_events, kind)
                for _ in range(args.repeat):
                    print(f"{label:>16} {n_events:>11,} events ({kind}) ...", end=" ", flush=True)
                    result = measure(engine, csv, out, partitions, args.timeout, args.quiet)
                    if "error" in result:
                        run.note = result["error"]
                        print(run.note, flush=True)
                        break
                    print(
                        f"{result['wall_s']:.1f} s, {result['cpu_s']:.1f} cpu s, "
                        f"{result['peak_mb']:,.0f} MB, background {result['background']:.0%}  ("
                        + ", ".join(f"{k} {v:.1f}" for k, v in result["phases"].items())
                        + ")",
                        flush=True,
                    )
                    run.walls.append(result["wall_s"])
                    run.peak_mb = max(run.peak_mb or 0.0, result["peak_mb"])
                    if run.wall_s is None or result["wall_s"] < run.wall_s:
                        run.wall_s, run.cpu_s = result["wall_s"], result["cpu_s"]
                        run.background, run.phases = result["background"], result["phases"]
                        run.start_mb = result["start_mb"]
                if run.wall_s is not None and not run.note:
                    run.counts = summarise(out)
                    outs[label] = out
                runs.append(run)
        checks.append(f"{n_events:,} events ({kind}):")
        checks.extend(f"  {line}" for line in compare(outs))

    print()
    print("start-up, an empty log (the child process from start to exit; the job alone):")
    for engine, result in startup.items():
        if "error" in result:
            print(f"  {engine:>16}: {result['error']}")
        else:
            print(
                f"  {engine:>16}: {result['process_s']:.2f} s ({result['wall_s']:.2f} s), "
                f"{result['cpu_s']:.2f} cpu s, {result['peak_mb']:,.0f} MB"
            )
    print()
    print(table(runs))
    print()
    print("counts per engine (from the output files):")
    for r in runs:
        if r.counts:
            print(f"  {r.engine:>16} {r.events:>11,}: " + json.dumps(r.counts))
    print("outputs compared exactly (journeys: every column and list; quarantine: every row):")
    print("\n".join(checks))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Raw event logs -> validated events, with every rejected row quarantined with a reason.

Stage one of the pipeline. Reads CSV (also `.csv.gz`), JSON Lines and Parquet from a file,
a folder or a glob; maps configured column names to the logical ones; parses every
timestamp form of the contract to UTC; and sorts each row into exactly one bucket:
valid, quarantined (with a reason code), exact duplicate, or dropped by configuration.
"""

from __future__ import annotations

import glob
from collections.abc import Collection
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar
from zoneinfo import ZoneInfo

import polars as pl

from journeys.config import (
    FLAG,
    FLAG_TIME,
    FLAG_TS,
    FROM_FLAG,
    SEQUENCE_COLUMN,
    Data,
    parse_duration,
)
from journeys.config import REQUIRED_COLUMNS as REQUIRED
from journeys.datasets import UTC_US
from journeys.errors import InputError, first_line

REASONS = (
    "missing_user_id",
    "missing_event_type",
    "bad_timestamp",
    "implausible_timestamp",
    "out_of_range",
    "bad_numeric",
    "bad_sequence",
    "late",  # older than ingest.late_allowed before the last ingest's data end
)

SOURCE, ROW = "source_file", "row_number"
TS = "ts"  # the parsed UTC timestamp; `timestamp` keeps the original text
REASON = "reason"
ROW_HASH = "row_hash"  # a hash of the source row's unread columns (data.dedupe: all_columns)

# Accepted ISO 8601 layouts after normalising `Z` to `+00:00` and a space to `T`: with
# seconds (and fractions) or without, with an offset or naive (read in `data.timezone`).
_ISO_WITH_OFFSET = ("%Y-%m-%dT%H:%M:%S%.f%:z", "%Y-%m-%dT%H:%M%:z")
_ISO_NAIVE = ("%Y-%m-%dT%H:%M:%S%.f", "%Y-%m-%dT%H:%M")
_ISO_DATE = "%Y-%m-%d"
# Layouts offered, in the all-rows-failed message, as a `data.timestamp_format` that reads
# a sample value (the first that does).
COMMON_FORMATS = (
    "%Y-%m-%d %H:%M:%S", "%Y-%m-%d %H:%M", "%Y/%m/%d %H:%M:%S", "%Y/%m/%d %H:%M",
    "%d/%m/%Y %H:%M:%S", "%d/%m/%Y %H:%M", "%m/%d/%Y %H:%M:%S", "%m/%d/%Y %H:%M",
    "%d.%m.%Y %H:%M:%S", "%d.%m.%Y %H:%M", "%Y%m%d%H%M%S", "%d-%b-%Y %H:%M:%S",
)  # fmt: skip
# The layouts logs mostly hold, as they come (no normalising), each with the zone it
# implies (None: `data.timezone`). `read_timestamp` parses a batch with the one that reads
# most of its first `_SAMPLE` values, and only the rows that one fails in every form.
_FAST_FORMATS = (
    ("%Y-%m-%dT%H:%M:%S%.fZ", "UTC"),
    ("%Y-%m-%dT%H:%M:%S%.f%:z", "UTC"),  # an offset, converted to UTC
    ("%Y-%m-%d %H:%M:%S%.f", None),
    ("%Y-%m-%dT%H:%M:%S%.f", None),
)
_SAMPLE = 100
ExprOrSeries = TypeVar("ExprOrSeries", pl.Expr, pl.Series)
_EPOCH_PER_US = {"s": 1e6, "ms": 1e3, "us": 1.0, "ns": 1e-3}
# With timestamp_unit auto, an epoch number's magnitude tells its unit: today is about
# 1.8e9 s, 1.8e12 ms, 1.8e15 us, 1.8e18 ns, and the bounds below sit between them
# (1e11 s is the year 5138; 1e11 ms is 1973).
_AUTO_UNIT_BOUNDS = ((1e11, "s"), (1e14, "ms"), (1e17, "us"))

_SUFFIX_FORMATS = {
    ".csv": "csv",
    ".gz": "csv",  # .csv.gz; other compressed formats are not accepted
    ".tsv": "csv",
    ".txt": "csv",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
}


def resolve_sources(raw: str | Path) -> list[Path]:
    """A file, a folder (its supported files, not recursive) or a glob -> sorted file list.

    Names starting with `_` or `.` are skipped in folders (e.g. the simulator's `_truth/`).
    Relative paths resolve against the working directory; errors show the absolute path.
    """
    raw = str(raw)
    path = Path(raw)
    if any(ch in raw for ch in "*?["):
        files = [Path(p) for p in glob.glob(raw, recursive=True) if Path(p).is_file()]
    elif path.is_dir():
        files = [
            p
            for p in path.iterdir()
            if p.is_file() and not p.name.startswith(("_", ".")) and _format_of(p) is not None
        ]
    elif path.is_file():
        files = [path]
    else:
        raise InputError(f"input not found: {path.absolute()}")
    if not files:
        where = raw if any(ch in raw for ch in "*?[") else path.absolute()
        raise InputError(f"no event files (csv, csv.gz, tsv, jsonl, parquet) in {where}")
    return sorted(files)


def _format_of(path: Path) -> str | None:
    if path.name.endswith((".csv.gz", ".tsv.gz")):
        return "csv"
    if path.suffix == ".gz":
        return None
    return _SUFFIX_FORMATS.get(path.suffix.lower())


def _separator(path: Path, data: Data) -> str:
    if data.separator is not None:
        return data.separator
    return "\t" if path.name.endswith((".tsv", ".tsv.gz")) else ","


def _scan(path: Path, fmt: str, data: Data) -> pl.LazyFrame:
    """Read one file lazily; CSV columns all as text so nothing is coerced before validation.

    Without a header row the columns are named column_1, column_2, ... (`Data.column`).
    """
    if fmt == "csv":
        options = dict(
            infer_schema=False,
            separator=_separator(path, data),
            has_header=data.header,
            encoding="utf8-lossy",
        )
        if path.name.endswith(".gz"):
            # scan_csv does not read compressed files; read_csv decompresses in memory.
            frame = pl.read_csv(path, **options).lazy()
        else:
            frame = pl.scan_csv(path, **options)
        if not data.header:
            # 1-based names, whatever Polars' own default for a headerless file is.
            names = frame.collect_schema().names()
            frame = frame.rename({name: f"column_{i}" for i, name in enumerate(names, start=1)})
        return frame
    if fmt == "jsonl":
        # JSON values may mix types between rows; read eagerly and let errors name the file.
        return pl.read_ndjson(path, infer_schema_length=None).lazy()
    return pl.scan_parquet(path)


def parse_timestamp(raw: pl.Expr, dtype: pl.DataType, data: Data) -> pl.Expr:
    """Any contract timestamp form -> datetime[us, UTC]; unparseable values become null."""
    if isinstance(dtype, pl.Datetime):
        if dtype.time_zone is None:
            return (
                raw.dt.replace_time_zone(data.timezone, ambiguous="earliest")
                .dt.convert_time_zone("UTC")
                .cast(UTC_US)
            )
        return raw.dt.convert_time_zone("UTC").cast(UTC_US)
    if dtype.is_numeric():
        if data.timestamp_unit is None:
            raise InputError(
                "numeric timestamps need data.timestamp_unit (s, ms, us, ns or auto) in the "
                "configuration"
            )
        return _from_epoch(raw.cast(pl.Float64, strict=False), data.timestamp_unit)

    text = raw.cast(pl.String).str.strip_chars()
    if data.timestamp_format is not None:
        return with_format(text, data.timestamp_format, data.timezone)
    iso = text.str.replace(r"[zZ]$", "+00:00").str.replace(" ", "T", literal=True)
    # Give the formats explicitly: inference has silently returned all-null columns
    # (docs/stack.md).
    with_offset = pl.coalesce(
        iso.str.to_datetime(layout, strict=False, time_zone="UTC", time_unit="us")
        for layout in _ISO_WITH_OFFSET
    )
    naive = pl.coalesce(
        *(iso.str.to_datetime(layout, strict=False, time_unit="us") for layout in _ISO_NAIVE),
        iso.str.to_datetime(_ISO_DATE, strict=False, time_unit="us"),
    )
    parsed = pl.coalesce(with_offset, local_to_utc(naive, data.timezone))
    if data.timestamp_unit is not None:
        epoch = _from_epoch(text.cast(pl.Float64, strict=False), data.timestamp_unit)
        parsed = pl.coalesce(epoch, parsed)
    return parsed.cast(UTC_US)


# Polars (chrono) reads an hour only with its minute: a layout with an hour and no minute
# ("%Y-%m-%d %H") reads each value with this minute appended, in both.
_HOURS, _MINUTE = ("%H", "%I", "%k", "%l"), "%M"
_MINUTE_PAD, _MINUTE_PAD_LAYOUT = "@00", "@%M"


def check_timestamp_format(layout: str | None) -> None:
    """`InputError` naming the fix when Polars cannot read with `layout` at all."""
    if layout is None:
        return
    try:
        pl.Series(["2026-01-01"]).to_frame("t").select(with_format(pl.col("t"), layout, "UTC"))
    except (pl.exceptions.PolarsError, ValueError) as err:
        raise InputError(
            f"data.timestamp_format {layout!r} cannot be read ({first_line(err)}): write it "
            "with strftime directives, e.g. '%Y-%m-%d %H:%M:%S', '%d/%m/%Y %H:%M' or "
            "'%Y-%m-%d %H'"
        ) from None


def with_format(text: pl.Expr, layout: str, timezone: str) -> pl.Expr:
    """Text in a strftime `layout` -> datetime[us, UTC]: read in `timezone` unless the
    layout holds an offset (%z); null where it does not match."""
    if any(hour in layout for hour in _HOURS) and _MINUTE not in layout:
        text, layout = text + _MINUTE_PAD, layout + _MINUTE_PAD_LAYOUT
    if "%z" in layout or "%:z" in layout:
        return text.str.to_datetime(layout, strict=False, time_zone="UTC", time_unit="us")
    naive = text.str.to_datetime(layout, strict=False, time_unit="us")
    return local_to_utc(naive, timezone).cast(UTC_US)


def format_that_reads(value: str) -> str | None:
    """The first of `COMMON_FORMATS` that reads `value` (for an error message), or None."""
    for layout in COMMON_FORMATS:
        parsed = pl.Series([value.strip()]).str.to_datetime(layout, strict=False)
        if parsed.null_count() == 0:
            return layout
    return None


def read_timestamp(raw: pl.Expr, dtype: pl.DataType, data: Data) -> pl.Expr:
    """`parse_timestamp`, faster on text: each batch is parsed with the one layout that
    reads a sample of it (`_FAST_FORMATS`) and only the rows that layout fails go through
    every form, so a uniform log is parsed once instead of once per form. Same values;
    epoch text (`data.timestamp_unit`) and typed columns take `parse_timestamp` whole."""
    if dtype != pl.String or data.timestamp_unit is not None or data.timestamp_format:
        return parse_timestamp(raw, dtype, data)

    def parse(text: pl.Series) -> pl.Series:
        every_form = parse_timestamp(pl.col(text.name), dtype, data)
        fast = _fast_parse(text, data.timezone)
        if fast is None:
            return text.to_frame().select(every_form).to_series()
        failed = (fast.is_null() & text.is_not_null()).arg_true()
        if failed.len():
            again = text.gather(failed).to_frame().select(every_form).to_series()
            fast = fast.scatter(failed, again)
        return fast

    return raw.map_batches(parse, return_dtype=UTC_US, is_elementwise=True)


def _fast_parse(text: pl.Series, timezone: str) -> pl.Series | None:
    """`text` parsed with the one of `_FAST_FORMATS` that reads most of its first `_SAMPLE`
    values (the first of equals; null where it fails), or None when none reads any.

    Most, not all: one bad value in the sample (a 1% dirty log has one in 63% of samples)
    would otherwise send the whole batch through every form."""
    sample = text.head(_SAMPLE).drop_nulls()
    read = [
        sample.str.to_datetime(layout, strict=False, time_unit="us").count()
        for layout, _ in _FAST_FORMATS
    ]
    if max(read, default=0) == 0:
        return None
    layout, zone = _FAST_FORMATS[read.index(max(read))]
    if zone is not None:
        return text.str.to_datetime(layout, strict=False, time_zone=zone, time_unit="us")
    naive = text.str.to_datetime(layout, strict=False, time_unit="us")
    return local_to_utc(naive, timezone).cast(UTC_US)


def local_to_utc(naive: ExprOrSeries, timezone: str) -> ExprOrSeries:
    """Naive local times read in `timezone`, to UTC: a time that happens twice (clocks going
    back) is the earlier; one that never happens (clocks going forward) is null."""
    local = naive.dt.replace_time_zone(timezone, ambiguous="earliest", non_existent="null")
    return local.dt.convert_time_zone("UTC")


def _from_epoch(value: pl.Expr, unit: str) -> pl.Expr:
    if unit == "auto":
        magnitude = value.abs()
        factor = pl.lit(_EPOCH_PER_US["ns"])
        for bound, guess in reversed(_AUTO_UNIT_BOUNDS):
            factor = pl.when(magnitude < bound).then(pl.lit(_EPOCH_PER_US[guess])).otherwise(factor)
    else:
        factor = pl.lit(_EPOCH_PER_US[unit])
    micros = (value * factor).round(0)
    # Years outside ~1677..2262 overflow; treat them as unparseable rather than wrapping.
    in_range = micros.is_finite() & (micros.abs() < 9.2e18)
    return pl.when(in_range).then(micros.cast(pl.Int64, strict=False)).cast(UTC_US)


def as_utc(moment: datetime | None, zone: str) -> datetime | None:
    """A configured moment in UTC (read in `zone` when it names none)."""
    if moment is None:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=ZoneInfo(zone))
    return moment.astimezone(UTC)


def column_expr(raw: str, schema: pl.Schema) -> tuple[pl.Expr, pl.DataType] | None:
    """A raw column, or a dotted path into struct columns (`context.campaign.source`).

    A top-level column whose name contains dots wins over a path. None when absent.
    """
    if raw in schema:
        return pl.col(raw), schema[raw]
    parts = raw.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        head = ".".join(parts[:cut])
        if head not in schema:
            continue
        expr, dtype = pl.col(head), schema[head]
        for name in parts[cut:]:
            fields = {f.name: f.dtype for f in dtype.fields} if isinstance(dtype, pl.Struct) else {}
            if name not in fields:
                return None
            expr, dtype = expr.struct.field(name), fields[name]
        return expr, dtype
    return None


def read_columns(data: Data) -> dict[str, list[str]]:
    """Every logical column read -> the raw names it may have (`Data.aliases`): the required
    ones, the features, then the sequence and the conversion flag (and its time) if set."""
    names = {logical: data.aliases(logical) for logical in (*REQUIRED, *data.event_columns)}
    if data.sequence:
        names[SEQUENCE_COLUMN] = data.aliases(SEQUENCE_COLUMN)
    if data.conversion_flag is not None:
        names[FLAG] = [data.conversion_flag.column]
        if data.conversion_flag.time is not None:
            names[FLAG_TIME] = [data.conversion_flag.time]
    return names


def _read_file(
    path: Path, data: Data, names: dict[str, list[str]]
) -> tuple[pl.LazyFrame, list[str], list[str]]:
    """One file -> the logical columns as text, plus `ts`, the source file and row number
    (and, for `data.dedupe: all_columns`, a hash of the whole source row); also the optional
    logical columns it lacks (null here) and the columns it has.

    A required column missing is an error; a feature, the sequence or the flag missing from
    one file is null there (a header that changed between exports): `scan_events` refuses
    one that no file has."""
    fmt = _format_of(path) if data.format == "auto" else data.format
    if fmt is None:
        raise InputError(
            f"{path}: unsupported file type {path.suffix!r}: name the format with "
            "data.format (csv, jsonl or parquet; .tsv is csv)"
        )
    try:
        frame = _scan(path, fmt, data)
        schema = frame.collect_schema()
    except (pl.exceptions.PolarsError, OSError, ValueError) as err:
        raise InputError(f"{path}: cannot read as {fmt}: {first_line(err)}") from None

    found: dict[str, tuple[pl.Expr, pl.DataType, str] | None] = {}
    for logical, aliases in names.items():
        hits = ((column_expr(raw, schema), raw) for raw in aliases)
        found[logical] = next(((*hit, raw) for hit, raw in hits if hit is not None), None)
    missing = [name for name in REQUIRED if found[name] is None]
    if missing:
        raise InputError(missing_columns_message(path, data, names, missing, schema, fmt))
    absent = [name for name, hit in found.items() if hit is None]

    ts_raw, ts_type, _ = found["timestamp"]  # type: ignore[misc]
    # with_row_index streams; an int_range over pl.len() would make the scan collect first
    # (1.3 GB instead of 0.85 GB peak at 10M events, same output).
    index = "__journeys_row_index"  # not ROW: the raw file may have a `row_number` column
    extra = []
    if data.dedupe == "all_columns":
        # Rows that differ only in a column the product ignores (a step number, the item
        # clicked) are repeated interactions, not copies: the columns read are compared
        # as they are, the others through one hash (a nested record a feature reads from
        # is hashed whole). A log with no other column hashes nothing.
        # Sorted: files that hold the same columns in another order hash alike.
        used = {hit[2] for hit in found.values() if hit is not None}
        unread = sorted(name for name in schema.names() if name not in used)
        if not unread:
            row_hash = pl.lit(0, pl.UInt32)
        else:
            unread_values = pl.col(unread[0]) if len(unread) == 1 else pl.struct(unread)
            # 32 bits suffice: a hash only has to tell apart rows already equal in every
            # column read (the same user, instant, event and features), a handful at most.
            row_hash = (unread_values.hash(seed=0) % (1 << 32)).cast(pl.UInt32)
        extra.append(row_hash.alias(ROW_HASH))
    if FLAG_TIME in names:
        hit = found[FLAG_TIME]
        flag_ts = pl.lit(None, UTC_US) if hit is None else read_timestamp(hit[0], hit[1], data)
        extra.append(flag_ts.alias(FLAG_TS))
    text = [
        (pl.lit(None, pl.String) if hit is None else hit[0].cast(pl.String)).alias(logical)
        for logical, hit in found.items()
    ]
    selected = frame.with_row_index(index, offset=1).select(
        *text,
        read_timestamp(ts_raw, ts_type, data).alias(TS),
        pl.lit(str(path)).alias(SOURCE),
        pl.col(index).cast(pl.Int64).alias(ROW),
        *extra,
    )
    return selected, absent, schema.names()


def missing_columns_message(
    path: Path,
    data: Data,
    names: dict[str, list[str]],
    missing: list[str],
    schema: pl.Schema,
    fmt: str,
) -> str:
    """One line: which logical columns no name of reads, what the file has, and the fix."""
    listed = ", ".join(f"{' / '.join(names[name])} ({name})" for name in missing)
    shown = [name if name.isprintable() and name else repr(name) for name in schema.names()]
    has = ", ".join(shown[:20]) + (", ..." if len(shown) > 20 else "")
    # Without a header row the required columns go missing too.
    headerless = data.header and any(name in REQUIRED for name in missing) and fmt == "csv"
    hint = "; the file has no header row? set data.header: false" if headerless else ""
    keys = [
        key
        for key, logical in (
            ("features", data.features),
            ("numeric_features", data.numeric_features),
        )
        if set(logical) & set(missing)
    ]
    remedy = " or drop it from " + " / ".join(f"data.{key}" for key in keys) if keys else ""
    return (
        f"{path}: missing column(s) {listed}; the file has: {has}; name them in data.columns"
        f" (a list gives a column's other names){remedy}{hint}"
    )


def parse_number(text: pl.Expr) -> pl.Expr:
    """A numeric feature's text -> Float64, spaces around it ignored; null when empty or not
    a number (`scan_events` quarantines the latter, `clean_events` casts the rest)."""
    return text.str.strip_chars().cast(pl.Float64, strict=False)


@dataclass(frozen=True)
class ScannedEvents:
    """`scan_events`' result: the rows (lazily), the source files, and the features the
    log has (`data.features`, less the default ones no file holds)."""

    rows: pl.LazyFrame
    sources: list[str]
    features: list[str]


def scan_events(
    raw: str | Path | list[Path], data: Data, held_before: Collection[str] = ()
) -> ScannedEvents:
    """All rows of all sources (a path, folder or glob, or a list of files), lazily: logical
    columns as text, `ts`, source, row, `reason`.

    `reason` is null for a valid row, else the quarantine reason code. A default feature
    (`data.features` not set) that no file holds is left out, not an error; so is one of
    `held_before` (the files of an earlier ingest held it: a column that left the export
    is null in the new files, as a full rebuild of every file leaves it).
    """
    check_timestamp_format(data.timestamp_format)
    sources = raw if isinstance(raw, list) else resolve_sources(raw)
    names = read_columns(data)
    try:
        read = [_read_file(path, data, names) for path in sources]
    except InputError as err:
        if len(sources) > 1 and "missing column(s)" in str(err):
            # A folder that holds other tables beside the events (users, products).
            folder = sources[0].parent
            raise InputError(
                f"{err}; or, if that file is another table, point paths.raw at the events' "
                f"files alone (a glob such as {folder / ('*' + sources[0].suffix)} matched "
                f"to their names, or one file)"
            ) from None
        raise
    nowhere = set.intersection(*(set(absent) for _, absent, _ in read)) if read else set()
    unused = [] if data.features_given else [f for f in data.features if f in nowhere]
    nowhere -= {*unused, *held_before}
    if nowhere:
        missing = [name for name in names if name in nowhere]
        schema = pl.Schema(dict.fromkeys(read[0][2], pl.String()))
        fmt = _format_of(sources[0]) or data.format
        raise InputError(missing_columns_message(sources[0], data, names, missing, schema, fmt))
    rows = pl.concat([frame for frame, _, _ in read], how="vertical").drop(unused)
    if unused:
        data = data.model_copy(update={"features": [f for f in data.features if f not in unused]})
    user = pl.col("user_id").str.strip_chars()
    event = pl.col("event_type").str.strip_chars()
    valid_from = as_utc(data.valid_from, data.timezone)
    valid_until = as_utc(data.valid_until, data.timezone)
    plausible_from = as_utc(data.plausible_from, data.timezone)
    plausible_until = datetime.now(UTC) + parse_duration(data.plausible_future)
    implausible = (pl.col(TS) < plausible_from) | (pl.col(TS) > plausible_until)
    out_of_range = pl.lit(False)
    if valid_from is not None:
        out_of_range = out_of_range | (pl.col(TS) < valid_from)
    if valid_until is not None:
        out_of_range = out_of_range | (pl.col(TS) > valid_until)
    # A number is missing when empty; text that is not a finite number is an error.
    bad_numeric = pl.lit(False)
    for name in data.numeric_features:
        given = pl.col(name).str.strip_chars() != ""
        bad_numeric = bad_numeric | (
            given & ~parse_number(pl.col(name)).is_finite().fill_null(False)
        )
    bad_sequence = pl.lit(False)
    if data.sequence:
        given = pl.col(SEQUENCE_COLUMN).str.strip_chars() != ""
        bad_sequence = given & parse_number(pl.col(SEQUENCE_COLUMN)).is_null()
    flagged_time_unread = pl.lit(False)
    if FLAG_TIME in names:  # a conversion time given but not read: no place for it
        given = pl.col(FLAG_TIME).str.strip_chars() != ""
        flagged_time_unread = (converted_expr(data) & given & pl.col(FLAG_TS).is_null()).fill_null(
            False
        )
    reason = (
        pl.when(user.is_null() | (user == ""))
        .then(pl.lit("missing_user_id"))
        .when(event.is_null() | (event == ""))
        .then(pl.lit("missing_event_type"))
        .when(pl.col(TS).is_null() | flagged_time_unread)
        .then(pl.lit("bad_timestamp"))
        .when(implausible)
        .then(pl.lit("implausible_timestamp"))
        .when(out_of_range)
        .then(pl.lit("out_of_range"))
        .when(bad_numeric)
        .then(pl.lit("bad_numeric"))
        .when(bad_sequence)
        .then(pl.lit("bad_sequence"))
    )
    return ScannedEvents(
        rows.with_columns(reason.alias(REASON)), [str(p) for p in sources], data.features
    )


def converted_expr(data: Data) -> pl.Expr:
    """True on a row whose `data.conversion_flag` column holds one of its values."""
    assert data.conversion_flag is not None
    flag = data.conversion_flag
    return pl.col(FLAG).str.strip_chars().is_in(flag.values).fill_null(False)


def user_bucket(n_buckets: int) -> pl.Expr:
    """Partition key by user: every event of a user lands in the same bucket."""
    return (pl.col("user_id").str.strip_chars().hash(seed=0) % n_buckets).cast(pl.Int64)


@dataclass(frozen=True)
class CleanEvents:
    """One bucket's valid rows after de-duplication and configured drops."""

    # user_id, ts, event_type, <features>, [sequence], source_file, row_number, and for a
    # conversion flag, `from_flag` (True on the conversion event placed after its touch)
    events: pl.DataFrame
    rows_valid: int  # before de-duplication and drops
    duplicates_dropped: int
    dropped_by_config: int
    data_end: datetime | None  # latest timestamp, dropped events included
    event_map_matched: frozenset[str] = frozenset()  # data.event_map keys found in the rows


def clean_events(rows: pl.DataFrame, data: Data) -> CleanEvents:
    """De-duplicate valid rows, normalise values, apply `event_map` and `drop_events`;
    numeric features become Float64 (null where empty)."""
    columns = list(read_columns(data))
    # Copies: identical original values in every column of the source (all_columns: the
    # columns read, and the hash of the whole row to tell apart rows that differ elsewhere),
    # in the columns read only (read_columns), or no row is a copy (none).
    if data.dedupe == "none":
        deduped = rows
    else:
        subset = [*columns, ROW_HASH] if data.dedupe == "all_columns" else columns
        deduped = rows.unique(subset=subset, keep="first", maintain_order=True)
    event = pl.col("event_type").str.strip_chars()
    matched = frozenset()
    if data.event_map:
        raw_types = deduped.select(event.unique()).get_column("event_type")
        matched = frozenset(raw_types.filter(raw_types.is_in(list(data.event_map))))
    deduped = deduped.with_columns(
        pl.col("user_id").str.strip_chars(),
        (event.replace(data.event_map) if data.event_map else event).alias("event_type"),
        *[pl.col(name).str.strip_chars() for name in data.features],
        *[parse_number(pl.col(name)) for name in data.numeric_features],
    )
    dropped = pl.col("event_type").is_in(data.drop_events) | pl.col("user_id").is_in(
        data.exclude_users
    )
    kept = deduped.filter(~dropped) if data.drop_events or data.exclude_users else deduped
    events = kept.select(
        "user_id", TS, "event_type", *data.event_columns, *sequence_exprs(data), SOURCE, ROW
    )
    if data.conversion_flag is not None:
        events = events.with_columns(pl.lit(False).alias(FROM_FLAG))
        events = pl.concat([events, flagged_conversions(kept, data, events.columns)])
    return CleanEvents(
        events=events,
        rows_valid=rows.height,
        duplicates_dropped=rows.height - deduped.height,
        dropped_by_config=deduped.height - kept.height,
        data_end=deduped.get_column(TS).max(),
        event_map_matched=matched,
    )


def sequence_exprs(data: Data) -> list[pl.Expr]:
    """The order column as a number (`data.columns.sequence`), or nothing without one."""
    if not data.sequence:
        return []
    return [parse_number(pl.col(SEQUENCE_COLUMN)).alias(SEQUENCE_COLUMN)]


def flagged_conversions(rows: pl.DataFrame, data: Data, columns: list[str]) -> pl.DataFrame:
    """A conversion event (`conversion_flag.event`) for each flagged touch in `rows`, at the
    conversion's time (never before the touch; the touch's own where none is given), with
    the touch's features, source and row: it sorts right after its touch."""
    assert data.conversion_flag is not None
    at = pl.col(TS)
    if FLAG_TS in rows.columns:
        at = pl.max_horizontal(pl.coalesce(pl.col(FLAG_TS), at), at)
    return (
        rows.filter(converted_expr(data))
        .select(
            "user_id",
            at.alias(TS),
            pl.lit(data.conversion_flag.event).alias("event_type"),
            *data.event_columns,
            *sequence_exprs(data),
            SOURCE,
            ROW,
            pl.lit(True).alias(FROM_FLAG),
        )
        .select(columns)
    )

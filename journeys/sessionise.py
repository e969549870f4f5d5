"""Pass 2 of ingest: one user partition's rows -> labelled journeys, finished and open.

A user's time-ordered events split into journeys after a gap longer than
`journey.max_gap` or after a conversion event. The conversion event labels its journey and
is cut from the sequence, so the model never sees the outcome it predicts. Partitions are
independent (all of a user's events are in one), so they can run in parallel, e.g. as
Prefect tasks (`BuildPartition` is the picklable unit of work).

A visit whose last event is at or after the closing horizon is open: an event still to
come can change it. Its journeys are written apart and its raw rows are kept for the next
nightly run (`OPEN_ROWS_FILE`), with every user seen (`USERS_FILE`); the counts made from
it are provisional (counted again next run), the others settled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import polars as pl

from journeys.config import FROM_FLAG, SEQUENCE_COLUMN, Config, Data
from journeys.datasets import UTC_US
from journeys.events import REASON, ROW, SOURCE, TS, CleanEvents, clean_events
from journeys.staging import SCRATCH_COMPRESSION, staged_schema

OPEN_ROWS_FILE = "open-rows-{:05d}.arrow"  # in the ingest state: one per user bucket
USERS_FILE = "users-{:05d}.arrow"
ROW_ORDER = "_order"


def journey_id_expr(user: str = "user_id", start: str = "start_time") -> pl.Expr:
    """Deterministic id: the user and the first event's UTC instant in microseconds, and
    where one user has several journeys starting at that instant (a log stamped to the
    second or the hour, a conversion straight after a conversion), the later ones' place
    among them: `u1-1772442000000000`, then `u1-1772442000000000-1`.

    Journeys must be ordered by user, then start, then event order, as `build_journeys`
    makes them (all journeys starting at one instant lie in one visit, which every build
    reads whole): the place is counted along neighbours, which costs a shift where a
    window over (user, start) cost 20 times as much.
    """
    same = (pl.col(user) == pl.col(user).shift(1)) & (pl.col(start) == pl.col(start).shift(1))
    row = pl.int_range(pl.len())
    place = row - pl.when(~same.fill_null(False)).then(row).forward_fill()
    base = pl.format("{}-{}", pl.col(user), pl.col(start).dt.epoch("us"))
    return pl.concat_str(
        [base, pl.when(place > 0).then(pl.format("-{}", place))], ignore_nulls=True
    )


def sort_events(events: pl.DataFrame, data: Data) -> pl.DataFrame:
    """Order by user and time; events that share a timestamp by `data.columns.sequence`
    when the log has one, then as the log holds them (file name, then row in the file),
    never by their content: a log's own order is the best record of what came first. A
    conversion from a flag column comes right after its touch."""
    order = [SEQUENCE_COLUMN] if data.sequence else []
    flag = [FROM_FLAG] if data.conversion_flag is not None else []
    return events.sort(["user_id", TS, *order, SOURCE, ROW, *flag], nulls_last=True)


@dataclass(frozen=True)
class Sessionised:
    journeys: pl.DataFrame  # with VISIT_END: when the journey's visit ended
    open_from: pl.DataFrame  # user_id, OPEN_FROM: where each user's open visits start
    orphans_settled: int  # conversions with no event before them, in closed visits
    orphans_open: int  # ... in open visits (counted again by the next run)
    repeats_settled: int  # conversions straight after a conversion, in closed visits
    repeats_open: int
    dropped_after_settled: int  # with journey.after_conversion = drop, in closed visits
    dropped_after_open: int


VISIT_END = "_visit_end"
OPEN_FROM = "_open_from"


def build_journeys(
    events: pl.DataFrame, config: Config, horizon: datetime | None = None
) -> Sessionised:
    """Sessionise sorted events into labelled journeys (censoring and split come later).

    A visit is a user's run of events with no gap longer than `journey.max_gap`; journeys
    never cross one. A visit whose last event is at or after `horizon` is open: an event
    still to come can change it (`closing_horizon`), so its events are kept for the next
    nightly run and the counts made from it are provisional.
    """
    features = config.data.event_columns
    max_gap = config.journey.max_gap_delta
    max_events = config.journey.max_events

    # Events are sorted by user then time, so plain shifts compare each event with the
    # previous one of the same user.
    new_user = (pl.col("user_id") != pl.col("user_id").shift(1)).fill_null(True)
    long_gap = (pl.col(TS).diff() > max_gap).fill_null(True)
    conversion = pl.col("event_type").is_in(config.data.conversions)
    tagged = events.with_columns(
        _conversion=conversion,
        _end=pl.col("event_type").is_in(config.data.end_events),
        _visit=(new_user | long_gap).cum_sum(),
    ).with_columns(
        pl.col(TS).max().over("_visit").alias(VISIT_END),
        # A conversion straight after another of the same visit: a repeat purchase, a
        # second clickout (`journey.repeat_conversions` says what it is).
        _repeat=conversion
        & conversion.shift(1).fill_null(False)
        & (pl.col("_visit") == pl.col("_visit").shift(1)),
    )
    if config.journey.repeat_conversions == "new_journey":  # the next journey's first touch
        tagged = tagged.with_columns(_conversion=pl.col("_conversion") & ~pl.col("_repeat"))
    in_open_visit = pl.col(VISIT_END) >= horizon if horizon is not None else pl.lit(False)
    open_from = (
        tagged.filter(in_open_visit).group_by("user_id").agg(pl.col(TS).min().alias(OPEN_FROM))
    )
    dropped_after = dropped_after_open = 0
    if config.journey.after_conversion == "drop":
        # Drop what follows a conversion until the next long gap (e.g. a loan's back-office
        # steps after approval): such events belong to the converted journey's aftermath.
        outcome = (pl.col("_conversion") | pl.col("_end")).cast(pl.Int32)
        seen = outcome.cum_sum().over("_visit", order_by=ROW_ORDER)
        after = (seen - outcome) > 0
        flagged = tagged.with_row_index(ROW_ORDER).with_columns(_after=after)
        # Rows of the log only: a conversion made from a flag column is not one.
        input_rows = ~pl.col(FROM_FLAG) if FROM_FLAG in events.columns else pl.lit(True)
        dropped = flagged.filter(pl.col("_after") & input_rows)
        dropped_after, dropped_after_open = dropped.height, dropped.filter(in_open_visit).height
        tagged = flagged.filter(~pl.col("_after")).drop(ROW_ORDER, "_after")
    tagged = tagged.with_columns(
        _journey=(
            (pl.col("_visit") != pl.col("_visit").shift(1)).fill_null(True)
            | (pl.col("_conversion") | pl.col("_end")).shift(1).fill_null(False)
        ).cum_sum()
    )

    repeats = tagged.filter(pl.col("_repeat"))
    repeats_open = repeats.filter(in_open_visit).height
    in_sequence = ~(pl.col("_conversion") | pl.col("_end"))
    sequence_columns = ["event_type", *features]
    grouped = tagged.group_by("_journey", maintain_order=True).agg(
        pl.col("user_id").first(),
        pl.col(TS).filter(in_sequence).first().alias("start_time"),
        pl.col(TS).last().alias("end_time"),
        in_sequence.sum().cast(pl.Int32).alias("n_events_total"),
        pl.col("_conversion").last().cast(pl.Int8).alias("label"),
        *[pl.col(name).filter(in_sequence).tail(max_events) for name in sequence_columns],
        pl.col(TS).filter(in_sequence).tail(max_events).alias("event_time"),
        pl.col(VISIT_END).first(),
    )
    # A conversion with no event before it labels no journey (an end event alone ends none).
    empty = grouped.filter((pl.col("n_events_total") == 0) & (pl.col("label") == 1))
    journeys = grouped.filter(pl.col("n_events_total") > 0).drop("_journey")
    journeys = journeys.with_columns(
        journey_id_expr().alias("journey_id"),
        pl.col("event_type").list.len().cast(pl.Int32).alias("n_events"),
    )
    columns = [
        "journey_id", "user_id", "start_time", "end_time", "n_events", "n_events_total",
        "label", "event_type", "event_time", *features, VISIT_END,
    ]  # fmt: skip
    orphans_open = empty.filter(in_open_visit).height
    # Already ordered by user, then start: the groups keep the sorted events' order.
    return Sessionised(
        journeys.select(columns), open_from,
        empty.height - orphans_open, orphans_open,
        repeats.height - repeats_open, repeats_open,
        dropped_after - dropped_after_open, dropped_after_open,
    )  # fmt: skip


def closing_horizon(data_end: datetime | None, config: Config) -> datetime | None:
    """Visits whose last event is before this are closed for good: the next run takes no
    event older than `data_end - ingest.late_allowed`, and one after that is more than
    `journey.max_gap` from such a visit, so it starts a visit of its own."""
    if data_end is None:
        return None
    return data_end - config.ingest.late_allowed_delta - config.journey.max_gap_delta


@dataclass(frozen=True)
class Counts:
    """Row counters that add up across partitions and runs (`ingest_report.json`)."""

    rows_valid: int = 0  # valid rows, before de-duplication and drops
    duplicates_dropped: int = 0
    dropped_by_config: int = 0  # drop_events, exclude_users and after a conversion
    dropped_after_conversion: int = 0
    conversions_without_journey: int = 0
    repeat_conversions: int = 0  # conversions straight after a conversion of the same visit
    conversions_by_source: dict[str, int] = field(default_factory=dict)

    def __add__(self, other: Counts) -> Counts:
        return self._combine(other, 1)

    def __sub__(self, other: Counts) -> Counts:
        return self._combine(other, -1)

    def _combine(self, other: Counts, sign: int) -> Counts:
        sources = {**self.conversions_by_source}
        for source, count in other.conversions_by_source.items():
            sources[source] = sources.get(source, 0) + sign * count
        numbers = {
            name: getattr(self, name) + sign * getattr(other, name)
            for name in self.__dataclass_fields__
            if name != "conversions_by_source"
        }
        kept = {k: v for k, v in sorted(sources.items()) if v}  # sorted: the manifest's bytes
        return Counts(**numbers, conversions_by_source=kept)

    @property
    def conversions(self) -> int:
        return sum(self.conversions_by_source.values())


@dataclass(frozen=True)
class PartitionResult:
    """Pass 2's output for one partition: its journeys, split into finished ones (their
    visit closed) and open ones, the rows it keeps for the next run, and counts."""

    finished: Path
    open: Path
    open_rows: Path  # valid rows of open visits, for the next nightly run
    users_file: Path  # every user seen in this partition, in any run
    settled: Counts  # of rows in closed visits: final
    provisional: Counts  # of rows in open visits: counted again next run
    users: int
    data_start: datetime | None
    event_map_matched: frozenset[str] = frozenset()  # data.event_map keys found in the rows
    top_user: tuple[str, int] | None = None  # the user with the most events, and how many
    events: int = 0  # events kept (after de-duplication and drops)


def conversions_by_source(events: pl.DataFrame, data: Data) -> dict[str, int]:
    converting = events.filter(pl.col("event_type").is_in(data.conversions))
    return dict(converting.group_by(SOURCE).len().sort(SOURCE).iter_rows())  # type: ignore[arg-type]


def cleaned_counts(rows: pl.DataFrame, data: Data) -> tuple[CleanEvents, Counts]:
    clean = clean_events(rows.drop(REASON, strict=False), data)
    counts = Counts(
        rows_valid=clean.rows_valid,
        duplicates_dropped=clean.duplicates_dropped,
        dropped_by_config=clean.dropped_by_config,
        conversions_by_source=conversions_by_source(clean.events, data),
    )
    return clean, counts


def read_or_empty(paths: list[Path], schema: dict[str, pl.DataType]) -> pl.DataFrame:
    frames = [pl.read_parquet(p) if p.suffix == ".parquet" else pl.read_ipc(p) for p in paths]
    frames = [frame.select(pl.col(k).cast(v) for k, v in schema.items()) for frame in frames]
    return pl.concat(frames, how="vertical") if frames else pl.DataFrame(schema=schema)


def build_partition(
    rows: pl.DataFrame,
    users_seen: pl.DataFrame,
    config: Config,
    horizon: datetime | None,
    out: dict[str, Path],
) -> PartitionResult:
    """Pass 2: one partition's rows (those kept open by the last run, then the new ones)
    -> journeys, finished and open, written to `out`."""
    data = config.data
    clean, cleaned = cleaned_counts(rows, data)
    built = build_journeys(sort_events(clean.events, data), config, horizon)
    total = cleaned + Counts(
        dropped_by_config=built.dropped_after_settled + built.dropped_after_open,
        dropped_after_conversion=built.dropped_after_settled + built.dropped_after_open,
        conversions_without_journey=built.orphans_settled + built.orphans_open,
        repeat_conversions=built.repeats_settled + built.repeats_open,
    )
    # A row stays for the next run from its user's first open visit on (a twin of it can
    # only come within that bound); the others are settled, and so are their counts.
    # (The mask from the two columns it needs: joining every column would copy them all.)
    keep_from = pl.min_horizontal(pl.col(OPEN_FROM), pl.lit(horizon, UTC_US))
    stays = (
        rows.select(pl.col("user_id").str.strip_chars(), TS)
        .join(built.open_from, on="user_id", how="left", maintain_order="left")
        .select((pl.col(TS) >= keep_from).fill_null(False))
        .to_series()
        if horizon is not None
        else pl.repeat(False, rows.height, eager=True)
    )
    open_rows = rows.filter(stays).drop(REASON, strict=False)
    # Clean counts are additive (a row and its copies fall on the same side): count the
    # smaller side again and take the other as the rest (a full build settles most rows,
    # a nightly run keeps most open).
    if open_rows.height <= rows.height - open_rows.height:
        _, provisional = cleaned_counts(open_rows, data)
        settled = cleaned - provisional
    else:
        _, settled = cleaned_counts(rows.filter(~stays), data)
    after_conversion = Counts(
        dropped_by_config=built.dropped_after_settled,
        dropped_after_conversion=built.dropped_after_settled,
        conversions_without_journey=built.orphans_settled,
        repeat_conversions=built.repeats_settled,
    )
    settled = settled + after_conversion
    open_rows.write_ipc(out["open_rows"], compression="lz4")
    closed = pl.col(VISIT_END) < horizon if horizon is not None else pl.lit(True)
    journeys = built.journeys
    journeys.filter(closed).drop(VISIT_END).write_parquet(
        out["finished"], compression=SCRATCH_COMPRESSION
    )
    journeys.filter(~closed).drop(VISIT_END).write_parquet(
        out["open"], compression=SCRATCH_COMPRESSION
    )
    seen = clean.events.select(pl.col("user_id").unique())
    users = pl.concat([users_seen, seen.join(users_seen, on="user_id", how="anti").sort("user_id")])
    users.write_ipc(out["users"], compression="lz4")
    # The log's own rows (not the conversions a flag column adds) for the skew warning.
    logged = clean.events
    if FROM_FLAG in logged.columns:
        logged = logged.filter(~pl.col(FROM_FLAG))
    per_user = logged.group_by("user_id").len().sort(["len", "user_id"], descending=[True, False])
    return PartitionResult(
        finished=out["finished"],
        open=out["open"],
        open_rows=out["open_rows"],
        users_file=out["users"],
        settled=settled,
        provisional=total - settled,
        users=users.height,
        data_start=clean.events.get_column(TS).min(),
        event_map_matched=clean.event_map_matched,
        top_user=per_user.row(0) if per_user.height else None,  # type: ignore[arg-type]
        events=logged.height,
    )


PartitionBuilder = Callable[[int], PartitionResult]
# Runs the builder over the user buckets, results in the buckets' order.
MapPartitions = Callable[[PartitionBuilder, list[int]], list[PartitionResult]]


@dataclass(frozen=True, kw_only=True)
class BuildPartition:
    """Pass 2 for one user bucket: the rows the last run kept open and the new ones.

    A plain picklable object, so a task runner can ship it to worker processes; its
    configuration holds no password (`without_secrets`): the partitions never connect.
    """

    config: Config
    staged: dict[int, Path]  # bucket -> its new rows
    state: Path | None  # the previous ingest's state folder (open rows, users seen)
    scratch: Path
    horizon: datetime | None

    def paths(self) -> list[Path]:
        """The folders a worker reads and writes (it must see them at these paths)."""
        return [self.scratch, *self.staged.values(), *([self.state] if self.state else [])]

    def __call__(self, bucket: int) -> PartitionResult:
        schema = {k: v for k, v in staged_schema(self.config).items() if k != REASON}
        kept = []
        users_seen = pl.DataFrame(schema={"user_id": pl.String})
        if self.state is not None:
            kept = [p for p in [self.state / OPEN_ROWS_FILE.format(bucket)] if p.exists()]
            users = self.state / USERS_FILE.format(bucket)
            if users.exists():
                users_seen = pl.read_ipc(users)
        new = sorted(self.staged[bucket].glob("*.parquet")) if bucket in self.staged else []
        rows = read_or_empty([*kept, *new], schema)
        out = {
            name: self.scratch / f"{name}-{bucket:05d}.{suffix}"
            for name, suffix in (
                ("finished", "parquet"), ("open", "parquet"), ("open_rows", "arrow"),
                ("users", "arrow"),
            )
        }  # fmt: skip
        return build_partition(rows, users_seen, self.config, self.horizon, out)


def map_in_order(build: PartitionBuilder, partitions: list[int]) -> list[PartitionResult]:
    """The default `map_partitions`: one partition after the other, in this process."""
    return [build(partition) for partition in partitions]

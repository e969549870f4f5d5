"""Typed configuration: YAML files plus `--set a.b=c` overrides, validated by pydantic.

Every section forbids unknown keys, so a typo is an error rather than a silently ignored
setting. `load_config` is the single entry point; it raises `ConfigError` with a one-line
message that the CLI prints before exiting with code 2.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from journeys.errors import ConfigError

DEFAULT_CONFIG = Path("conf/default.yaml")

# `scheme://user:password@host` -> `scheme://user:***@host`, for anything logged or printed;
# also with no user (`redis://:password@host`) and with a `/` in the password, which
# SQLAlchemy reads (a string with a later `@` loses a little more than its password).
_URI_PASSWORD = re.compile(r"(://[^/:@\s]*):[^@\s]*@")
REDACTED = "***"


def redact_uri(text: str) -> str:
    """Hide passwords embedded in URIs (tracking servers, databases)."""
    return _URI_PASSWORD.sub(rf"\1:{REDACTED}@", text)


def is_redacted(uri: str) -> bool:
    """A URI whose password was replaced by `redact_uri`: it cannot connect anywhere."""
    return f":{REDACTED}@" in uri


# A URI that may carry a password. In memory it is the real value; its JSON form (flow
# parameters, cached results, MLflow params, the YAML a child process reads) is redacted,
# so the password never leaves this process through the configuration. Processes this
# one starts get the real URI in their environment instead (see `tracking.tracking_uri`).
SecretUri = Annotated[str, PlainSerializer(redact_uri, when_used="json")]


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_DURATION_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_duration(text: str | int | float) -> timedelta:
    """'7d', '36h', '90m', '30s', '2w' (or a number of seconds) -> timedelta."""
    if isinstance(text, int | float):
        return timedelta(seconds=float(text))
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"not a duration: {text!r} (use e.g. 30m, 36h, 7d)")
    value, unit = match.groups()
    return timedelta(**{_DURATION_UNITS[unit]: float(value)})


def _valid_duration(text: str) -> str:
    parse_duration(text)
    return text


# A duration written as text (`30m`, `36h`, `7d`), checked when the config is loaded.
Duration = Annotated[str, AfterValidator(_valid_duration)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Paths(Section):
    raw: str = "data/raw"
    journeys: str = "data/journeys"
    quarantine: str = "data/quarantine"
    scores: str = "data/scores"
    reports: str = "data/reports"
    checkpoints: str = "data/checkpoints"


# Logical columns every event log must provide (their raw names come from data.columns).
REQUIRED_COLUMNS = ("user_id", "timestamp", "event_type")


# The features `data.features` stands for when a configuration does not set it.
DEFAULT_FEATURES = ("channel", "device")
# Optional logical columns besides the required ones and the features.
SEQUENCE_COLUMN = "sequence"  # the order of events that share a timestamp
# `data.conversion_flag`'s working columns: the flag's text, the conversion time's text and
# that time parsed, and the mark on the conversion events a flag adds.
FLAG, FLAG_TIME, FLAG_TS = "conversion_flag", "conversion_time", "conversion_ts"
FROM_FLAG = "from_flag"


class ConversionFlag(Section):
    """The conversion as a column of the converting touch, not an event of its own (ad
    logs: `is_attributed`, `conversion`). The touch stays in its journey; a conversion
    event `event` is placed at the `time` column's moment (the touch's own without one)."""

    column: str
    values: list[str] = Field(min_length=1)  # the flag's values that mean converted, as text
    time: str | None = None  # the conversion's own timestamp column (read like timestamps)
    event: str = "conversion"  # the conversion event's name in the journeys

    @field_validator("values", mode="before")
    @classmethod
    def _as_text(cls, values: Any) -> Any:
        # `values: [1]` in YAML is a number; flags are compared as the text the file holds.
        if isinstance(values, list):
            return [str(v).lower() if isinstance(v, bool) else str(v) for v in values]
        return values


class Data(Section):
    # logical name -> column in the raw log: a name (a dotted path reaches into nested
    # records of JSON Lines or Parquet: traffic_source.medium), a list of the names one
    # column has had (`user_id: [client_id, clientId]`: each file uses the first it holds),
    # or with `header: false` a 1-based position. Unmapped logical names are used as-is.
    # `sequence` (optional) orders events that share a timestamp (a step or hit number).
    columns: dict[str, str | int | list[str]] = Field(default_factory=dict)
    # Unset: those of DEFAULT_FEATURES the log has (a log without them is not an error).
    features: list[str] = Field(default_factory=lambda: list(DEFAULT_FEATURES))
    # Per-event numbers (a price, a cost, an amount, dwell time), mapped like features. An
    # empty value is missing (allowed, and flagged to the model); text that is not a
    # finite number quarantines its row (bad_numeric).
    numeric_features: list[str] = Field(default_factory=list)
    format: Literal["auto", "csv", "jsonl", "parquet"] = "auto"
    header: bool = True  # false: CSV/TSV without a header row (columns by position)
    separator: str | None = None  # CSV field separator; null: tab for .tsv, else a comma
    timezone: str = "UTC"
    # Epoch numbers: s, ms, us, ns, or auto (each value's magnitude tells); null: ISO 8601.
    timestamp_unit: Literal["s", "ms", "us", "ns", "auto"] | None = None
    # Text timestamps in another layout (strftime: "%d/%m/%Y %H:%M"), read in `timezone`
    # unless the layout has an offset (%z); null: ISO 8601 (with or without seconds).
    timestamp_format: str | None = None
    event_map: dict[str, str] = Field(default_factory=dict)
    conversion_events: list[str] = Field(default_factory=lambda: ["purchase"])
    # The conversion as a flag column of the converting touch (see ConversionFlag).
    conversion_flag: ConversionFlag | None = None
    drop_events: list[str] = Field(default_factory=list)
    # Outcomes that end a journey unconverted (a declined application, an unsubscribe):
    # like a conversion they are not in its sequence and the next event starts a new
    # journey (with journey.after_conversion: drop, what follows them until the next long
    # gap is dropped), but the journey's label is 0.
    end_events: list[str] = Field(default_factory=list)
    # User ids that are not users (a placeholder for anonymous traffic, a test account):
    # their rows are dropped and counted (dropped_by_config).
    exclude_users: list[str] = Field(default_factory=list)
    valid_from: datetime | None = None
    valid_until: datetime | None = None
    # Timestamps before this, or later than `plausible_future` after the run, cannot be
    # right (a wrong timestamp_unit, a clock at zero): quarantined as implausible_timestamp.
    plausible_from: datetime = datetime(2000, 1, 1)
    plausible_future: Duration = "1d"
    # Which rows are copies: identical in every column of their source (all_columns), in
    # the columns the product reads (read_columns), or none are.
    dedupe: Literal["all_columns", "read_columns", "none"] = "all_columns"
    # Conversions are recorded up to this moment (null: the last event): censoring counts
    # from it, so a log whose outcomes are final sets it past the data.
    observed_until: datetime | None = None

    @property
    def event_columns(self) -> list[str]:
        """Every per-event column read besides the required ones: features, then numbers."""
        return [*self.features, *self.numeric_features]

    @model_serializer(mode="wrap")
    def _unset_features_stay_unset(self, handler: SerializerFunctionWrapHandler) -> Any:
        # A configuration handed on as a dict (a flow's parameters, a subprocess) must
        # still take the defaults the log has, not demand them.
        data = handler(self)
        if not self.features_given and isinstance(data, dict):
            data.pop("features", None)
        return data

    @property
    def features_given(self) -> bool:
        """Whether the configuration sets `features` (else they are the defaults, and ingest
        keeps those the log has)."""
        return "features" in self.model_fields_set

    @property
    def sequence(self) -> bool:
        """Whether an order column breaks timestamp ties (`columns.sequence`)."""
        return SEQUENCE_COLUMN in self.columns

    @property
    def conversions(self) -> list[str]:
        """Every event type that converts: `conversion_events` and the flag's event."""
        flag = [self.conversion_flag.event] if self.conversion_flag else []
        return [*self.conversion_events, *flag]

    @field_validator("columns")
    @classmethod
    def _known_logical_names(
        cls, columns: dict[str, str | int | list[str]]
    ) -> dict[str, str | int | list[str]]:
        for name, raw in columns.items():
            if isinstance(raw, int) and raw < 1:
                raise ValueError(f"column position for {name!r} must be 1 or more")
            if not isinstance(raw, int) and (not raw or not all(raw)):
                raise ValueError(f"column for {name!r} is empty")
        return columns

    @field_validator("separator")
    @classmethod
    def _one_character(cls, separator: str | None) -> str | None:
        if separator is not None and len(separator) != 1:
            raise ValueError(f"separator must be one character, not {separator!r}")
        return separator

    @field_validator("timezone")
    @classmethod
    def _valid_timezone(cls, zone: str) -> str:
        from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

        try:
            ZoneInfo(zone)
        except (ZoneInfoNotFoundError, ValueError) as err:
            raise ValueError(f"unknown time zone {zone!r}") from err
        return zone

    @model_validator(mode="after")
    def _consistent(self) -> Data:
        if not self.conversions:
            raise ValueError(
                "conversion_events must name at least one event type (or set conversion_flag)"
            )
        both = set(self.conversions) & set(self.drop_events)
        if both:
            raise ValueError(f"events both converting and dropped: {sorted(both)}")
        ending = set(self.end_events) & {*self.conversions, *self.drop_events}
        if ending:
            raise ValueError(
                f"end_events {sorted(ending)} are also conversions or drop_events: list each once"
            )
        columns = self.event_columns
        reserved = {*REQUIRED_COLUMNS, SEQUENCE_COLUMN, FLAG, FLAG_TIME, FLAG_TS, FROM_FLAG}
        if reserved & set(columns):
            raise ValueError(f"features cannot be named {sorted(reserved & set(columns))}")
        if self.conversion_flag is not None:
            label = {self.conversion_flag.column, self.conversion_flag.time} - {None}
            leaking = [name for name in columns if label & set(self.aliases(name))]
            if leaking:
                raise ValueError(
                    f"features {leaking} read the conversion flag's columns {sorted(label)}: "
                    "they are the label; drop them from data.features"
                )
        if len(set(columns)) != len(columns):
            raise ValueError("features (and numeric_features) are listed twice")
        if self.valid_from and self.valid_until and self.valid_from >= self.valid_until:
            raise ValueError("valid_from must be before valid_until")
        if self.timestamp_format and self.timestamp_unit:
            raise ValueError(
                "timestamp_format (text) and timestamp_unit (epoch numbers) "
                "describe different timestamps: set one"
            )
        positions = {k: v for k, v in self.columns.items() if isinstance(v, int)}
        if self.header and positions:
            raise ValueError(
                f"columns {sorted(positions)} are given by position: set data.header: false"
            )
        if not self.header:
            unplaced = [n for n in (*REQUIRED_COLUMNS, *self.event_columns) if n not in positions]
            if unplaced:
                raise ValueError(
                    f"with header: false, data.columns must give a 1-based position for "
                    f"{unplaced} (e.g. {{{unplaced[0]}: 1}})"
                )
        return self

    def spelled_columns(self) -> dict[str, str | int | list[str]]:
        """`columns` with every required name spelled out (mapped to itself when left
        unmapped, as it is read): `{}` (the code's default) and `conf/default.yaml`'s
        `{user_id: user_id, ...}` are one configuration, and the keys made of the settings
        (ingest's manifest, the flows' cache) must agree on it."""
        return {**{name: name for name in REQUIRED_COLUMNS}, **self.columns}

    def aliases(self, logical: str) -> list[str]:
        """Every raw name a logical column (user_id, timestamp, event_type, a feature) may
        have in a file, in the order tried: names, dotted paths into nested records, or
        `column_<n>` for position n (the name `journeys.events` gives the n-th column of a
        file without a header)."""
        raw = self.columns.get(logical, logical)
        if isinstance(raw, int):
            return [f"column_{raw}"]
        return [raw] if isinstance(raw, str) else list(raw)


class Journey(Section):
    max_gap: Duration = "7d"
    max_events: Annotated[int, Field(ge=1, le=4096)] = 64
    # After a conversion: start a new journey (contract default), or drop the events that
    # follow it until the next long gap (one case = one journey, as in BPIC 2012).
    after_conversion: Literal["new_journey", "drop"] = "new_journey"
    # A conversion straight after another of the same visit, no touch between (a repeat
    # purchase, a second clickout): counted with the one before it (`with_previous`: it
    # labels no journey, and the report counts it as `repeat_conversions`), or the first
    # touch of the next journey (`new_journey`), which the next conversion labels.
    repeat_conversions: Literal["with_previous", "new_journey"] = "with_previous"

    @property
    def max_gap_delta(self) -> timedelta:
        return parse_duration(self.max_gap)


class Split(Section):
    fractions: tuple[float, float, float] = (0.7, 0.15, 0.15)
    # Converted journeys whose last event is within journey.max_gap of the data's end take
    # no split, like the censored unconverted ones beside them; false keeps them, which
    # over-states the test conversion rate (see ingest.unsplit_expr).
    exclude_recent_conversions: bool = True

    @field_validator("fractions")
    @classmethod
    def _sum_to_one(cls, fractions: tuple[float, float, float]) -> tuple[float, float, float]:
        if any(f < 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-6:
            raise ValueError("split fractions must be non-negative and sum to 1")
        # Validated here once, against what training needs: it fits on train, picks the
        # checkpoint and the temperature on val, and registers by test.
        empty = [
            name for name, f in zip(("train", "val", "test"), fractions, strict=True) if f <= 0
        ]
        if empty:
            raise ValueError(
                f"the {' and '.join(empty)} share must be positive (training needs train, "
                "val and test), e.g. [0.7, 0.15, 0.15]"
            )
        return fractions


class Ingest(Section):
    # Valid rows are hashed by user into this many partitions, processed one at a time:
    # peak memory is about one partition's share of the input.
    partitions: Annotated[int, Field(ge=1, le=4096)] = 8
    # When more than this share of the rows read is quarantined, the configuration is
    # almost surely wrong (timestamp_unit, timezone, columns): ingest stops with exit 2,
    # writes the quarantine for a look and leaves the previous journeys as they were.
    max_quarantined_share: Annotated[float, Field(gt=0, le=1)] = 0.5
    # No row matching data.conversion_events means every label would be 0: stop with exit
    # 2. false: a log ingested only to be scored (scoring a raw log sets it so).
    require_conversions: bool = True
    # Warnings in the report and the summary (with figures) when a log looks wrong though
    # no row is: more than this share of journeys take no split because they end within
    # journey.max_gap of the data's end (a short export; `train` refuses with the fix) ...
    warn_unsplit_share: Annotated[float, Field(gt=0, le=1)] = 0.5
    # ... more than this share of conversions label no journey (nothing before them) ...
    warn_orphan_conversion_share: Annotated[float, Field(gt=0, le=1)] = 0.1
    # ... one user id holds more than this share of the events (a placeholder id?) ...
    warn_top_user_share: Annotated[float, Field(gt=0, le=1)] = 0.2
    # ... a source file's quarantine rate is this many times the other files' (and 5%+).
    warn_source_quarantine_factor: Annotated[float, Field(gt=1)] = 5.0
    # ... a feature holds a value on fewer of the val or test events than this share of
    # train's (when it is on at least `warn_feature_min_share` of train's events).
    warn_feature_split_ratio: Annotated[float, Field(gt=0, le=1)] = 0.5
    warn_feature_min_share: Annotated[float, Field(ge=0, le=1)] = 0.05
    # Nightly runs (incremental ingest): an event may arrive this long after the last
    # ingest's data end and still land where a full rebuild would put it; older ones are
    # quarantined as `late` (`journeys ingest --full` takes them in). A longer bound keeps
    # more journeys open, so each nightly run rebuilds more.
    late_allowed: Duration = "3d"

    @property
    def late_allowed_delta(self) -> timedelta:
        return parse_duration(self.late_allowed)


class Vocab(Section):
    min_count: Annotated[int, Field(ge=1)] = 5


class Simulate(Section):
    users: Annotated[int, Field(ge=1)] = 20_000
    seed: int = 0
    start: datetime = datetime(2026, 1, 1)
    days: Annotated[int, Field(ge=1)] = 90
    conversion_rate: Annotated[float, Field(gt=0, lt=1)] = 0.04
    dirty_rate: Annotated[float, Field(ge=0, lt=0.5)] = 0.0
    shuffle: bool = False
    format: Literal["csv", "jsonl", "parquet"] = "csv"


class Model(Section):
    d_model: Annotated[int, Field(ge=8)] = 64
    n_heads: Annotated[int, Field(ge=1)] = 4
    n_layers: Annotated[int, Field(ge=1)] = 2
    # 0: the weight average, weight decay and the best checkpoint regularise enough; with
    # 0.1 the quality benchmark needed 20 epochs for what 0 reaches in 12 (RESULTS.md).
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    # Dropout on the attention weights. 0 by default: with it, PyTorch's fused CPU attention
    # kernel falls back to the explicit one and a training step is 1.15-1.3x slower (RESULTS.md).
    attention_dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    positional: Literal["sinusoidal", "learned", "none"] = "sinusoidal"
    # Count positions from the journey's last event ("end": recency is one embedding) or
    # from its first; "auto" is "end", and "start" for causal models, whose prefixes
    # cannot know how far the end is.
    position_origin: Literal["auto", "start", "end"] = "auto"
    norm: Literal["pre", "post"] = "pre"
    # The journey as its last event's output ("last"), a prepended CLS token's, or the mean
    # of its events'. The hour, the latest price and the final visit's gap sit on the last
    # event: on the simulator "last" is closer to the best possible AUC from 100k users up
    # and steadier over seeds; on a 20k-user log "cls" did better (docs/model.md).
    pooling: Literal["cls", "mean", "last"] = "last"
    causal: bool = False
    time_buckets: Annotated[int, Field(ge=2)] = 32
    # A gap this long opens a new visit (web analytics' 30-minute session rule; gaps in the
    # same log-scaled time bucket count too: 30m -> from 17 min with 32 buckets);
    # every event also embeds the gap that opened its visit, so how long the user was away
    # before the current visit is on every event, the last one included. null: off.
    visit_gap: Duration | None = "30m"
    # Continuous time inputs on every event, projected into the embedding: log seconds since
    # the previous event and since the journey's first, and the local hour of day and
    # weekday as points on a circle (`data.timezone`). Durations and the time of day that
    # 32 buckets blur, and that gradient boosting on aggregates uses (`hgb_aggregates`).
    time_encodings: bool = True
    # Per event, the journey up to it as counts and gap statistics (events so far, those
    # of the event's type, the largest and the mean log gap so far), continuous inputs after
    # the time encodings: on the last event, a few of the journey aggregates gradient
    # boosting wins with (`journeys.inputs.JOURNEY_SO_FAR`). Off: it lowered attention's
    # deletion effect on the suite (docs/model.md).
    journey_so_far: bool = False
    # How a numeric feature enters an event (`data.numeric_features`): `projection` adds its
    # scaled value, a missing flag, its value against the journey's earlier values and that
    # carried forward to later events to the continuous inputs; `buckets` embeds the value
    # and that relative value each by its train-quantile bucket (`numeric_buckets` of them;
    # missing has its own id).
    numeric_encoding: Literal["projection", "buckets"] = "projection"
    numeric_buckets: Annotated[int, Field(ge=2)] = 16
    # A wide part beside the sequence (Wide & Deep): the mean and maximum of the events'
    # embeddings and the journey's length, through a small MLP, add a logit of their own.
    # Journey aggregates are what gradient boosting wins with on many real logs
    # (`hgb_aggregates`); docs/model.md has the suite it was chosen on.
    wide: bool = False
    # How the continuous inputs (time encodings, numbers) enter an event: one linear
    # projection of them all; `periodic`: each through sin and cos of learned
    # frequencies and a small map of its own (Gorishniy et al. 2022); or `piecewise`: the
    # projection plus each input's piecewise-linear encoding over `continuous_bins` bins of
    # its train quantiles (the same paper's PLE), which places a sharp effect of a
    # duration where the data are dense, as a booster's bins do (docs/model.md).
    continuous_encoding: Literal["linear", "periodic", "piecewise"] = "linear"
    continuous_bins: Annotated[int, Field(ge=2)] = 64

    @property
    def visit_gap_s(self) -> float | None:
        """`visit_gap` in seconds (None when visits are off)."""
        return None if self.visit_gap is None else parse_duration(self.visit_gap).total_seconds()

    @model_validator(mode="after")
    def _heads_divide(self) -> Model:
        if self.d_model % self.n_heads:
            raise ValueError("d_model must be divisible by n_heads")
        if self.causal and self.position_origin == "end":
            raise ValueError("a causal model counts positions from the start (position_origin)")
        return self

    @property
    def resolved_position_origin(self) -> Literal["start", "end"]:
        if self.position_origin == "auto":
            return "start" if self.causal else "end"
        return self.position_origin


Beta = Annotated[float, Field(ge=0, lt=1)]


# The baselines a run can fit beside the transformer (`journeys.baselines` builds them):
# the one list, which the configuration checks and the defaults take whole.
BaselineName = Literal["logreg", "hgb", "hgb_aggregates", "last_touch", "prior"]


class SearchRange(Section):
    """A range a setting is drawn from: an integer setting takes integers in it."""

    low: float
    high: float
    log: bool = False  # drawn evenly on a log scale (a learning rate, a weight decay)

    @model_validator(mode="after")
    def _ordered(self) -> SearchRange:
        if not self.low < self.high:
            raise ValueError("low must be below high")
        if self.log and self.low <= 0:
            raise ValueError("a log range needs low > 0")
        return self


# The sections a trial may change: read when the transformer is built and trained, after
# ingest (a `journey` or `data` setting would need the journeys built again) ...
SEARCHABLE_SECTIONS = ("model", "train")
# ... but not where it trains, on which journeys, or what it is chosen on: the trials of a
# search differ in the model they train, never in what they are compared on.
NOT_SEARCHABLE = frozenset(
    {
        *("train.search", "train.devices", "train.num_nodes", "train.strategy"),
        *("train.accelerator", "train.window", "train.objective", "train.monitor"),
        *("train.prefix_weight", "model.causal"),
        # ... nor which other candidates run beside the transformer
        *("train.baselines", "train.stack", "train.bigrams"),
    }
)


class Search(Section):
    """A short hyperparameter search on val before the transformer is kept
    (`journeys.search`): `trials` runs of the transformer, each with settings drawn from
    `space` (`section.key: [choices]` or `{low, high, log}`), tracked as nested MLflow runs.
    0 trials: off, the settings as given."""

    trials: Annotated[int, Field(ge=0)] = 0
    timeout: Annotated[float, Field(gt=0)] | None = None  # seconds for all trials; null: none
    space: dict[str, list[Any] | SearchRange] = Field(
        default_factory=lambda: {
            "train.lr": SearchRange(low=5e-4, high=1e-2, log=True),
            "train.weight_decay": SearchRange(low=0.01, high=0.3, log=True),
            "model.dropout": SearchRange(low=0.0, high=0.2),
            "model.d_model": [32, 64, 128],
            "model.n_layers": [1, 2, 3],
            "model.continuous_encoding": ["linear", "piecewise"],
        }
    )

    @field_validator("space", mode="before")
    @classmethod
    def _ranges(cls, space: Any) -> Any:
        # A mapping is a range: its own error ("low must be below high"), not the union's.
        if not isinstance(space, dict):
            return space
        ranges = {}
        for key, spec in space.items():
            try:
                ranges[key] = SearchRange.model_validate(spec) if isinstance(spec, dict) else spec
            except ValidationError as err:
                raise ValueError(f"{key}: {_describe(err, 'range')}") from None
        return ranges

    @field_validator("space")
    @classmethod
    def _searchable_keys(
        cls, space: dict[str, list[Any] | SearchRange]
    ) -> dict[str, list[Any] | SearchRange]:
        for key, spec in space.items():
            section, _, name = key.partition(".")
            if section not in SEARCHABLE_SECTIONS or not name:
                raise ValueError(f"{key}: a searched setting is model.<key> or train.<key>")
            fields = (Model if section == "model" else Train).model_fields
            if name not in fields:
                raise ValueError(f"{key}: unknown setting")
            if key in NOT_SEARCHABLE:
                raise ValueError(f"{key}: not a setting a search may change (set it instead)")
            default = fields[name].get_default(call_default_factory=True)
            # (unset by default, as train.pos_weight: a number when set)
            numeric = default is None or (
                isinstance(default, int | float) and not isinstance(default, bool)
            )
            if isinstance(spec, SearchRange) and not numeric:
                raise ValueError(f"{key}: a range needs a number setting; list the choices")
            if isinstance(spec, list) and not spec:
                raise ValueError(f"{key}: no choices")
        return space


class Train(Section):
    max_epochs: Annotated[int, Field(ge=1)] = 12
    batch_size: Annotated[int, Field(ge=1)] = 256
    optimizer: Literal["adam", "adamw", "sgd"] = "adamw"
    lr: Annotated[float, Field(gt=0)] = 3e-3
    adam_betas: tuple[Beta, Beta] = (0.9, 0.98)  # Vaswani et al. (2017); adam / adamw only
    momentum: Beta = 0.9  # Nesterov momentum; sgd only
    weight_decay: Annotated[float, Field(ge=0)] = 0.1
    warmup_steps: Annotated[int, Field(ge=0)] = 100
    schedule: Literal["inverse_sqrt", "cosine"] = "cosine"
    grad_clip: Annotated[float, Field(ge=0)] = 1.0
    # Validate, checkpoint and ship an exponential moving average of the weights (decay per
    # step); null: the raw weights. See `journeys.lightning_parts.ema_update`.
    ema_decay: Annotated[float, Field(ge=0, lt=1)] | None = 0.999
    pos_weight: Annotated[float, Field(gt=0)] | None = None
    label_smoothing: Annotated[float, Field(ge=0, lt=0.5)] = 0.0
    # Negative sampling: each epoch keeps every converted train journey and draws afresh
    # just enough unconverted ones that conversions make up this share of the epoch; the
    # loss corrects for it, so probabilities keep the full data's scale. null, or a share
    # the data already reach: every journey, every epoch. See `journeys.encoding.fraction_of_negatives`.
    positive_share: Annotated[float, Field(gt=0, lt=1)] | None = 0.25
    # ... but sampling never leaves a run fewer optimiser steps than this (where the data
    # have them): on small data it draws more negatives, up to all. 0: the share alone.
    # 4500 (3000 until 2026-12-07): half as many negatives more an epoch at 400k users
    # took the gap to the Bayes-optimal AUC from 0.0102 to 0.0095 (docs/model.md).
    min_steps: Annotated[int, Field(ge=0)] = 4500
    # The fewest optimiser steps a run makes: where the data give fewer at `batch_size`
    # in `max_epochs`, batches shrink down to `min_batch_size`, then epochs grow
    # (`journeys.lightning_parts.step_schedule`). 0 (off) by default: 600 taught a
    # 150-journey toy its rule (test AUC 0.47 -> 0.78) but on the committed samples it
    # was worse on two test splits of three and on one attention deletion test
    # (`benchmarks/suite.py`, RESULTS.md), so it is a setting to try, not a default.
    step_floor: Annotated[int, Field(ge=0)] = 0
    min_batch_size: Annotated[int, Field(ge=1)] = 32
    patience: Annotated[int, Field(ge=1)] = 8  # validations without a better val metric
    # Validate every this many epochs (and always after the last): validation costs about
    # 0.4 of a sampled epoch at 400k users, and with the cosine decay the last epoch wins.
    val_every_epochs: Annotated[int, Field(ge=1)] = 1
    accelerator: Literal["auto", "cpu", "gpu"] = "auto"
    devices: int | str = 1
    num_nodes: Annotated[int, Field(ge=1)] = 1
    strategy: str = "auto"
    precision: str = "32-true"
    num_workers: Annotated[int, Field(ge=0)] = 0
    seed: int = 0
    baselines: list[BaselineName] = Field(default_factory=lambda: list(get_args(BaselineName)))
    bigrams: bool = False
    # A candidate for the champion beside the transformer and the baselines: the transformer
    # blended with gradient boosting on journey aggregates (`hgb_aggregates`' model), the
    # mean of their calibrated log-odds (`journeys.stacking`); attention stays the
    # transformer's. Journey-level models only (not with model.causal).
    stack: bool = True
    # What the loss is on: the journey's logit (its last event), or the logit after every
    # event of a causal model (`model.causal: true`), each prefix labelled with the journey's
    # outcome, so the model also learns to predict mid-journey. See `JourneyModule`.
    objective: Literal["journey", "every_prefix"] = "journey"
    # every_prefix only: "journey" averages the loss over each journey's prefixes, then over
    # journeys (every journey weighs the same, however long); "prefix" weighs every prefix
    # alike (one row per prefix, as prefix-by-prefix benchmarks such as BPIC 2012 train).
    prefix_weight: Literal["journey", "prefix"] = "journey"
    # The val metric that picks the checkpoint and stops early: the journey's AUC (what is
    # scored), or with every_prefix the AUC over every val prefix (prefix-by-prefix use).
    monitor: Literal["val_roc_auc", "val_prefix_roc_auc"] = "val_roc_auc"
    # Train (and validate and test) on the journeys that ended within this long of the
    # data's end, so a weekly retrain over nightly ingests does not grow with the history;
    # null: every journey. The split's cuts stay the ingest's (`journeys.datasets.in_window`).
    window: Duration | None = None
    search: Search = Field(default_factory=Search)

    @property
    def window_delta(self) -> timedelta | None:
        return None if self.window is None else parse_duration(self.window)

    @model_validator(mode="after")
    def _prefix_settings(self) -> Train:
        if self.objective != "every_prefix":
            if self.prefix_weight != "journey":
                raise ValueError("prefix_weight: prefix needs objective: every_prefix")
            if self.monitor == "val_prefix_roc_auc":
                raise ValueError("monitor: val_prefix_roc_auc needs objective: every_prefix")
        return self


class Promotion(Section):
    """Which of a run's candidates is registered and whether it becomes the champion
    (`journeys.promotion`): the transformer, the stack and each baseline's model."""

    # Fewer val conversions than this: nothing can be chosen on them, the champion stays
    # (with 20, a ROC AUC's 95% interval is still about +-0.1 wide).
    min_val_conversions: Annotated[int, Field(ge=1)] = 20
    # Of the interval that must clear chance and of the paired tests between candidates.
    confidence: Annotated[float, Field(gt=0.5, lt=1)] = 0.95
    # What is judged: ROC AUC ranks the candidates; a candidate clearly worse than a rival
    # on another of these (paired test at `confidence`) is passed over for the next.
    metrics: list[Literal["roc_auc", "pr_auc", "log_loss"]] = Field(
        default_factory=lambda: ["roc_auc", "pr_auc", "log_loss"]
    )
    # ... "clearly": beyond doubt, and by more than this share of the rival's figure (a
    # PR AUC of 0.22 against 0.63 is; 0.300 against 0.305 on a large val is not).
    metric_tolerance: Annotated[float, Field(ge=0, lt=1)] = 0.05
    # A val ROC AUC this close to the best is a tie, and a tie goes to the transformer,
    # then the stack (their attention explains the journeys). Wider would serve a model
    # the suite measures as worse (`benchmarks/suite.py`: within 0.005 of the best on test).
    tie_margin: Annotated[float, Field(ge=0, le=0.05)] = 0.002
    # false: skip the guard (enough conversions, above chance, the best candidate) and
    # compare the transformer with the champion alone: for plumbing tests and demos on a
    # few hundred journeys, never for a model users rely on. The decision says it was off.
    guard: bool = True

    @field_validator("metrics")
    @classmethod
    def _ranked_by_roc_auc(cls, metrics: list[str]) -> list[str]:
        if "roc_auc" not in metrics:
            raise ValueError("metrics must hold roc_auc: it ranks the candidates")
        if len(set(metrics)) != len(metrics):
            raise ValueError("metrics are listed twice")
        return metrics


class Mlflow(Section):
    tracking_uri: SecretUri = "sqlite:///mlflow.db"
    experiment: str = "journeys"
    registered_model: str = "journey-conversion"


class Score(Section):
    batch_size: Annotated[int, Field(ge=1)] = 1024
    chunk_journeys: Annotated[int, Field(ge=1)] = 50_000
    attention: Literal["pooled", "rollout"] = "pooled"


class Attribution(Section):
    # The dimensions credit is broken down by: list columns of the scores (features, or
    # event_type). null: every configured feature, or event_type when there is none.
    by: list[str] | None = None
    ig_sample: Annotated[int, Field(ge=0)] = 256  # converting journeys explained by IG; 0: off
    position_cap: Annotated[int, Field(ge=1)] = 20  # positions from the end pooled beyond this
    markov_max_states: Annotated[int, Field(ge=2)] = 100  # rarer touchpoints lumped as (other)
    example_journeys: Annotated[int, Field(ge=0)] = 8  # journeys in the attention heatmap
    seed: int = 0  # which converting journeys IG explains
    # The report covers the journeys whose last event is within this of the moment the
    # scores stand at, so a nightly report costs the same on day 900 as on day 90 (scores
    # files older than that are not opened); null: every journey scored, whatever its age.
    window: Duration | None = "90d"

    @property
    def window_delta(self) -> timedelta | None:
        return None if self.window is None else parse_duration(self.window)


class Monitor(Section):
    """What makes a night's monitor raise an alert (`journeys monitor`, docs/monitoring.md).

    A change alerts only when it is both significant, the night's tests taken together
    (Benjamini-Hochberg at `fdr`, so the threshold knows its sample size), and larger than
    the effect floor of its check (so a huge night does not alert on a trivial shift).
    """

    fdr: Annotated[float, Field(gt=0, lt=1)] = 0.001  # false discovery rate over a night's tests
    min_js_distance: Annotated[float, Field(ge=0, le=1)] = 0.1  # category mix (Jensen-Shannon)
    min_shift: Annotated[float, Field(ge=0)] = 0.25  # numbers: Wasserstein over reference std
    # The probabilities' distribution moves with the weekday and hours a night holds (the
    # model reads time): its floor is a whole reference spread; the mean has its own check.
    min_score_shift: Annotated[float, Field(ge=0)] = 1.0
    min_unknown_share: Annotated[float, Field(ge=0, le=1)] = 0.01  # values the model lacks
    min_quarantine_share: Annotated[float, Field(ge=0, le=1)] = 0.01  # per reason, over rows
    conversion_ratio: Annotated[float, Field(gt=1)] = 2.0  # conversions per row, either way
    score_ratio: Annotated[float, Field(gt=1)] = 1.5  # mean probability, either way
    # A user with more events in a night than this many times the most one user had in a
    # day of the reference window is a flood (a bot, a placeholder id).
    flood_factor: Annotated[float, Field(gt=1)] = 5.0
    recent_nights: Annotated[int, Field(ge=1)] = 14  # the quarantine's baseline
    min_cohort_conversions: Annotated[int, Field(ge=1)] = 10  # a cohort's realised figures
    # A matured cohort's realised ROC AUC this far below what its probabilities promised
    # (CBPE on the same journeys) alerts, when significant.
    min_auc_drop: Annotated[float, Field(ge=0, le=1)] = 0.05
    # A matured cohort's realised ROC AUC is judged once this share of its outcomes is known
    # (or on its last night before `cohort_horizon`): the outcomes still unknown are those of
    # journeys not converted yet, so judging sooner would judge a skewed subset. Its figures
    # stand from then on.
    settled_share: Annotated[float, Field(gt=0, le=1)] = 0.99
    # A cohort's figures stop updating this long after its night (outcomes of journeys
    # still open by then are left unknown), so a night's cost does not grow with history.
    cohort_horizon: Duration = "28d"

    @property
    def cohort_horizon_delta(self) -> timedelta:
        return parse_duration(self.cohort_horizon)


class Schedule(Section):
    timezone: str = "UTC"
    ingest_cron: str = "0 2 * * *"
    score_cron: str = "30 2 * * *"
    train_cron: str = "0 3 * * 1"


class Orchestration(Section):
    """How the Prefect flows run (flows/): task runner, retries, caching, locking."""

    task_runner: Literal["thread", "process", "dask"] = "thread"
    max_workers: Annotated[int, Field(ge=1)] | None = 2  # memory ~ max_workers x one partition
    dask_address: SecretUri | None = None  # tcp://scheduler:8786; None: a local Dask cluster
    retries: Annotated[int, Field(ge=0)] = 2
    retry_delay_s: Annotated[float, Field(ge=0)] = 10.0
    task_timeout: Duration = "12h"
    cache: bool = True  # false: always recompute
    lock_timeout: Duration = "12h"

    @property
    def task_timeout_s(self) -> float:
        return parse_duration(self.task_timeout).total_seconds()

    @property
    def lock_timeout_s(self) -> float:
        """How long a stage waits for another run's stage on the same data to finish."""
        return parse_duration(self.lock_timeout).total_seconds()


class Config(Section):
    paths: Paths = Field(default_factory=Paths)
    data: Data = Field(default_factory=Data)
    journey: Journey = Field(default_factory=Journey)
    split: Split = Field(default_factory=Split)
    ingest: Ingest = Field(default_factory=Ingest)
    vocab: Vocab = Field(default_factory=Vocab)
    simulate: Simulate = Field(default_factory=Simulate)
    model: Model = Field(default_factory=Model)
    train: Train = Field(default_factory=Train)
    mlflow: Mlflow = Field(default_factory=Mlflow)
    promotion: Promotion = Field(default_factory=Promotion)
    score: Score = Field(default_factory=Score)
    attribution: Attribution = Field(default_factory=Attribution)
    monitor: Monitor = Field(default_factory=Monitor)
    schedule: Schedule = Field(default_factory=Schedule)
    orchestration: Orchestration = Field(default_factory=Orchestration)

    def flat(self) -> dict[str, str]:
        """The resolved config as `section.key -> value` strings (MLflow params).

        Passwords inside URIs are redacted: params are visible to everyone with the UI.
        """
        out: dict[str, str] = {}

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for key, inner in value.items():
                    walk(f"{prefix}.{key}" if prefix else str(key), inner)
            else:
                out[prefix] = redact_uri(str(value))

        walk("", self.model_dump(mode="json"))
        return out

    @model_validator(mode="after")
    def _objective_needs_causal(self) -> Config:
        # Spans two sections: the logit after each event exists only in a causal model.
        if self.train.objective == "every_prefix" and not self.model.causal:
            raise ValueError("train.objective: every_prefix needs model.causal: true")
        return self

    @model_validator(mode="after")
    def _search_space_valid(self) -> Config:
        # With a search on, every choice and both ends of every range make a valid
        # configuration alone (a trial whose draws clash, or an integer inside a range that
        # is not valid, is skipped when drawn: `journeys.search`). Off, only the keys are
        # checked (`Search`): the default space's widths need not suit a model of 3 heads.
        search = self.train.search
        if not search.trials:
            return self
        if self.train.devices not in (1, "1") or self.train.num_nodes > 1:
            raise ValueError("train.search runs in one process: devices 1 and num_nodes 1")
        for key, spec in search.space.items():
            values = spec if isinstance(spec, list) else [spec.low, spec.high]
            for value in values:
                try:
                    with_settings(self, {key: value})
                except ConfigError as err:
                    raise ValueError(
                        f"train.search.space: {key}={value!r} is not a valid setting ({err}); "
                        "change that choice"
                    ) from None
        return self


def _apply_override(tree: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"--set expects key=value, got {assignment!r}")
    key, raw_value = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set has an empty key part in {key!r}")
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError:  # `%Y-%m-%d`, `@home`: not YAML, so the text as given
        value = raw_value
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def _describe(error: ValidationError, section: str = "") -> str:
    """`where: what` of a validation error's first problem; `where` starts at `section`
    for a section validated on its own."""
    first = error.errors()[0]
    parts = ([section] if section else []) + [str(p) for p in first["loc"]]
    where = ".".join(parts) or "config"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown key"
    given = first.get("input")
    if first["type"] == "string_type" and isinstance(given, int | float):
        # YAML reads 2024, 1.5 and true as numbers and booleans, not text.
        message = f"{given!r} is read as a number, not text: quote it ('{given}')"
    return f"{where}: {message}"


def _read_yaml(config_path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(config_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {config_path.absolute()}") from None
    except (OSError, yaml.YAMLError, UnicodeDecodeError) as err:
        reason = str(err).splitlines()[0]
        raise ConfigError(f"config file {config_path} is not valid YAML: {reason}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"config file {config_path} must hold a mapping of sections")
    return loaded or {}


# Mappings that are one setting, not a section: a later file's replaces an earlier's whole
# (a search space narrowed in a second file is that space, not the first one's plus it).
WHOLE_MAPPINGS = frozenset({"train.search.space"})


def _merge(base: dict[str, Any], layer: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`layer` over `base`: sections merge key by key; any other value replaces."""
    merged = dict(base)
    for key, value in layer.items():
        path = f"{prefix}{key}"
        if (
            path not in WHOLE_MAPPINGS
            and isinstance(value, dict)
            and isinstance(merged.get(key), dict)
        ):
            merged[key] = _merge(merged[key], value, f"{path}.")
        else:
            merged[key] = value
    return merged


ConfigFiles = str | Path | Sequence[str | Path] | None


def load_config(paths: ConfigFiles = None, overrides: list[str] | None = None) -> Config:
    """Load YAML files (later ones override earlier ones key by key; default
    `conf/default.yaml` if it exists), apply `--set` overrides, validate.

    Every key has a default in code equal to `conf/default.yaml`'s, so an override file
    such as `conf/gpu.yaml` holds only what differs.
    """
    files = [paths] if isinstance(paths, str | Path) else list(paths or [])
    if not files and DEFAULT_CONFIG.exists():
        files = [DEFAULT_CONFIG]
    tree: dict[str, Any] = {}
    for config_path in files:
        tree = _merge(tree, _read_yaml(Path(config_path)))
    for assignment in overrides or []:
        _apply_override(tree, assignment)
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(f"invalid configuration: {_describe(err)}") from None


def with_settings(config: Config, settings: dict[str, Any]) -> Config:
    """`config` with `section.key` settings replaced, each section validated again (as
    `--set` would be): a search trial's configuration (`train.search`)."""
    updates: dict[str, dict[str, Any]] = {}
    for key, value in settings.items():
        section, _, name = key.partition(".")
        updates.setdefault(section, {})[name] = value
    sections: dict[str, Section] = {}
    for section, values in updates.items():
        current = getattr(config, section)
        try:
            sections[section] = type(current).model_validate(current.model_dump() | values)
        except ValidationError as err:
            raise ConfigError(_describe(err, section)) from None
    return config.model_copy(update=sections)


def with_features(config: Config, features: list[str]) -> Config:
    """`config` with `data.features` set to `features` (then counted as given)."""
    data = config.data.model_copy(update={"features": list(features)})
    return config.model_copy(update={"data": data})


def without_secrets(config: Config) -> Config:
    """`config` as its JSON form has it, every password in a URI redacted: what work that
    never connects with them (an ingest partition) carries to another process or machine."""
    return Config.model_validate_json(config.model_dump_json())


def with_absolute_paths(config: Config) -> Config:
    """`config` with every `paths.*` absolute, resolved against this process's working
    folder: a worker started elsewhere (a Dask worker, a process pool) would resolve a
    relative path against its own and read nothing."""
    absolute = {name: str(Path(value).absolute()) for name, value in config.paths}
    return config.model_copy(update={"paths": config.paths.model_copy(update=absolute)})

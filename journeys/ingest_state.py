"""What an ingest leaves for the next one: the typed nightly state of a journeys folder.

A nightly `journeys ingest` builds on the last run's output (docs/nightly.md). What it
needs of it is `IngestState`: the manifest (`manifest.json`, beside the journeys) and the
folder holding the part files and `_state/` (the open visits' raw rows, the users seen, the
train split's token counts). A full build is the same passes from `IngestState.empty()`:
no file read before, no part, no counters, no open rows.

`manifest.json` records
- the key of the configuration the journeys were built with (a change rebuilds);
- every raw file read: its path, size, modification time, content hash and row counts
  (a file already read that changed or vanished stops the run: history is not rewritten
  behind the journeys' back);
- the data's end (late events are measured from it) and the split's cut points;
- every part file with a summary (journeys, labels, split counts, end-time range), so a
  run sums the summaries instead of reading the parts;
- the row counters of events no later run can change (`settled`) and of those it can.

It is written last, inside the folder that is swapped in whole (`storage.atomic_dir`):
the manifest and the files it names always belong together. Scoring keeps its own
"what an earlier run left" in its files' metadata (`journeys.score.ScoreState`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

from journeys.datasets import NO_SPLIT, OPEN_PART_PREFIX, SPLITS
from journeys.errors import InputError
from journeys.sessionise import OPEN_ROWS_FILE, USERS_FILE, Counts, PartitionResult
from journeys.storage import restore_interrupted_swap, write_json
from journeys.vocab import train_token_counts

if TYPE_CHECKING:
    from journeys.config import Config

MANIFEST_FILE = "manifest.json"
STATE_DIR = "_state"  # open events, users seen, train token counts (Arrow, not Parquet)
FORMAT = 1  # bumped when the layout changes: an older folder is rebuilt in full
# The configuration an ingest's journeys depend on: any change rebuilds in full.
KEYED_SECTIONS = ("data", "journey", "split", "vocab")
KEYED_INGEST = ("partitions", "late_allowed")
HASH_CHUNK = 1 << 20


@dataclass
class Manifest:
    config_key: str
    run: int = 0  # 0: the full build; each nightly run adds one
    data_start: str | None = None
    data_end: str | None = None  # the watermark: late events are measured from it
    features: list[str] = field(default_factory=list)
    cuts: list[str | None] = field(default_factory=lambda: [None, None])  # val, test
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # raw path -> facts
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)  # part file -> summary
    settled: dict[str, Any] = field(default_factory=dict)  # `sessionise.Counts` of closed rows
    provisional: dict[str, Any] = field(default_factory=dict)  # ... of the rows kept open
    quarantined: dict[str, int] = field(default_factory=dict)  # reason -> rows, all runs
    event_map_matched: list[str] = field(default_factory=list)
    format: int = FORMAT

    def save(self, folder: Path) -> None:
        write_json(asdict(self), folder / MANIFEST_FILE)


def load_manifest(folder: str | Path) -> Manifest | None:
    """The manifest of a journeys folder, or None (no earlier ingest, or an older layout)."""
    path = Path(folder) / MANIFEST_FILE
    if not path.exists():
        return None
    stored = json.loads(path.read_text())
    if stored.get("format") != FORMAT:
        return None
    return Manifest(**stored)


def config_key(config: Config) -> str:
    """Hash of the settings the journeys depend on (paths and run settings left out)."""
    tree = config.model_dump(mode="json")
    keyed = {name: tree[name] for name in KEYED_SECTIONS}
    keyed["data"]["columns"] = config.data.spelled_columns()
    keyed["ingest"] = {name: tree["ingest"][name] for name in KEYED_INGEST}
    text = json.dumps(keyed, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def file_key(path: str | Path) -> str:
    """How a raw file is named in the manifest: its absolute path, so the command line and a
    flow (which makes paths absolute) agree."""
    return str(Path(path).absolute())


def content_hash(path: Path, stop: threading.Event | None = None) -> str:
    """SHA-256 of the file's bytes; raises `CancelledError` once `stop` is set."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            if stop is not None and stop.is_set():
                raise CancelledError(f"hashing {path} stopped")
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint(path: Path, stop: threading.Event | None = None) -> dict[str, Any]:
    stat = path.stat()
    return {
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "sha256": content_hash(path, stop),
    }


@contextlib.contextmanager
def fingerprints_meanwhile(paths: list[Path]) -> Iterator[Callable[[], dict[str, Any]]]:
    """Fingerprint `paths` in a thread of their own while the block reads the same files
    (hashing frees the GIL); yields the function that waits for them ({str(path): ...}).
    Leaving the block (an error, Ctrl+C) stops the hashing within one chunk."""
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=1) as hasher:
        hashed = hasher.submit(lambda: {str(path): fingerprint(path, stop) for path in paths})
        try:
            yield hashed.result
        finally:
            stop.set()


def unchanged(path: Path, recorded: dict[str, Any]) -> bool:
    """Size and modification time as recorded, or (touched, not changed) the same hash.
    Only a file whose size or time moved is read again."""
    stat = path.stat()
    if stat.st_size != recorded["size"]:
        return False
    if stat.st_mtime_ns == recorded["mtime_ns"]:
        return True
    return content_hash(path) == recorded["sha256"]


def new_sources(manifest: Manifest, sources: list[Path]) -> list[Path]:
    """The raw files not read before; stops (InputError) on one read before that changed or
    is gone, naming it and `--full`."""
    listed = {file_key(path): path for path in sources}
    for key, recorded in manifest.files.items():
        path = listed.get(key)
        if path is None or not path.exists():
            raise InputError(
                f"{key} was ingested and is gone: restore it, or run `journeys ingest --full` "
                "to rebuild the journeys from the files there are now"
            )
        if not unchanged(path, recorded):
            raise InputError(
                f"{key} changed since it was ingested (journeys are never rebuilt behind "
                "your back): restore it and put new events in a new file, or run "
                "`journeys ingest --full` to rebuild from the files as they are"
            )
    return [path for key, path in listed.items() if key not in manifest.files]


Cuts = tuple[datetime | None, datetime | None]  # where val starts, where test starts
TRAIN_TOKENS_FILE = "train-tokens.arrow"  # in STATE_DIR
PRESENT = "_present:"  # the part summaries' working column names


@dataclass(frozen=True)
class IngestState:
    """What the last ingest left for this one (`empty()`: nothing, a full build).

    Every run reads the same fields: for a full build they are empty (no file read, no
    part, zero counters, no cuts), so the passes take one path whatever came before.
    """

    manifest: Manifest
    folder: Path | None = None  # the journeys folder it lies in; None when empty
    why: str = ""  # why this run builds on it, or starts from nothing

    @classmethod
    def empty(cls, config_key: str, why: str) -> IngestState:
        return cls(Manifest(config_key), None, why)

    @classmethod
    def of(cls, config: Config, folder: Path, full: bool) -> IngestState:
        """The state of `folder` a run builds on, or empty and why the run is a full one."""
        restore_interrupted_swap(folder)
        key = config_key(config)
        manifest = load_manifest(folder)
        if full:
            return cls.empty(key, "--full")
        if manifest is None:
            return cls.empty(key, "no earlier ingest in this folder")
        if manifest.config_key != key:
            return cls.empty(key, "the configuration changed since the last ingest")
        return cls(manifest, folder, "new files since the last ingest")

    @property
    def is_empty(self) -> bool:
        return self.folder is None

    @property
    def run(self) -> int:
        """This run's number: 0 for a full build, then one more each nightly run."""
        return 0 if self.is_empty else self.manifest.run + 1

    @property
    def data_start(self) -> datetime | None:
        return from_iso(self.manifest.data_start)

    @property
    def data_end(self) -> datetime | None:
        return from_iso(self.manifest.data_end)

    @property
    def cuts(self) -> Cuts:
        val, test = (from_iso(cut) for cut in self.manifest.cuts)
        return val, test

    @property
    def settled(self) -> Counts:
        return Counts(**self.manifest.settled)

    @property
    def total(self) -> Counts:
        """Every row counter so far, those of the open visits included."""
        return self.settled + Counts(**self.manifest.provisional)

    @property
    def state_folder(self) -> Path | None:
        """`_state/`: the open visits' rows and users seen (pass 2), train token counts."""
        return None if self.folder is None else self.folder / STATE_DIR

    def finished_parts(self) -> dict[str, dict[str, Any]]:
        return {n: s for n, s in self.manifest.parts.items() if s["kind"] == "finished"}

    def paths(self, names: list[str]) -> list[Path]:
        """The part files `names` of this state's folder."""
        return [] if self.folder is None else [self.folder / name for name in names]

    def open_part(self) -> Path | None:
        names = [n for n, s in self.manifest.parts.items() if s["kind"] == "open"]
        return self.paths(names)[0] if names else None

    def new_sources(self, sources: list[Path]) -> list[Path]:
        """The raw files not read before (`new_sources`)."""
        return new_sources(self.manifest, sources)

    def train_tokens(
        self, removed: list[Path], added: list[Path], columns: list[str]
    ) -> pl.DataFrame:
        """The train split's token counts after this run: the last run's, less what the
        replaced files held, plus what the new ones hold (a cut move changes only the
        rewritten days). A full build counts its files."""
        counts = [train_token_counts(added, columns)]
        kept = self.state_folder / TRAIN_TOKENS_FILE if self.state_folder else None
        if kept is not None and kept.exists():
            removed_counts = train_token_counts(removed, columns).with_columns(-pl.col("count"))
            counts = [pl.read_ipc(kept), removed_counts, *counts]
        return (
            pl.concat(counts)
            .group_by("column", "token").agg(pl.col("count").sum())
            .filter(pl.col("count") > 0).sort("column", "token")
        )  # fmt: skip


@dataclass(frozen=True)
class ThisRun:
    """What this run is: its number, full or incremental and why, and the files it reads."""

    state: IngestState  # what it builds on
    files: dict[str, dict[str, Any]]  # raw file key -> fingerprint and row counts

    @property
    def mode(self) -> str:
        return "full" if self.state.is_empty else "incremental"

    @property
    def number(self) -> int:
        return self.state.run

    def manifest(
        self,
        *,
        data_start: datetime | None,
        data_end: datetime | None,
        features: list[str],
        cuts: Cuts,
        parts: dict[str, dict[str, Any]],
        settled: Counts,
        provisional: Counts,
        quarantined: dict[str, int],
        event_map_matched: frozenset[str],
    ) -> Manifest:
        """The manifest this run leaves: its own facts, and the files read and rows
        quarantined by every run so far."""
        before = self.state.manifest
        return Manifest(
            config_key=before.config_key,
            run=self.number,
            data_start=iso(data_start),
            data_end=iso(data_end),
            features=features,
            cuts=[iso(cut) for cut in cuts],
            files={**before.files, **self.files},
            parts=parts,
            settled=asdict(settled),
            provisional=asdict(provisional),
            quarantined=add_counts(before.quarantined, quarantined),
            event_map_matched=sorted(event_map_matched),
        )


def write_state(folder: Path, tokens: pl.DataFrame, parts: list[PartitionResult]) -> None:
    """`_state/` of a journeys folder being written: the train split's token counts, and
    each partition's open rows and users seen (moved from pass 2's scratch files)."""
    state = folder / STATE_DIR
    state.mkdir()
    tokens.write_ipc(state / TRAIN_TOKENS_FILE)
    for index, part in enumerate(parts):
        os.replace(part.open_rows, state / OPEN_ROWS_FILE.format(index))
        os.replace(part.users_file, state / USERS_FILE.format(index))


def from_iso(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text) if text else None


def max_or_none(*moments: datetime | None) -> datetime | None:
    return max((m for m in moments if m is not None), default=None)


def min_or_none(*moments: datetime | None) -> datetime | None:
    return min((m for m in moments if m is not None), default=None)


def iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def add_counts(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {key: a.get(key, 0) + b.get(key, 0) for key in sorted({**a, **b})}


def part_summaries(files: list[Path], features: list[str]) -> dict[str, dict[str, Any]]:
    """Per part file: journeys, labels, split counts, end-time range and, per split, the
    events kept and those holding each feature (one query)."""
    if not files:
        return {}

    def in_split(value: pl.Expr, split: str) -> pl.Expr:
        return value.filter(pl.col("split") == split).sum()

    present = {
        f"{PRESENT}{name}:{split}": in_split(
            pl.col(name).list.eval(pl.element().is_not_null()).list.sum().cast(pl.Int64), split
        )
        for name in features
        for split in SPLITS
    }
    kept = {
        f"{PRESENT}:{split}": in_split(pl.col("n_events").cast(pl.Int64), split) for split in SPLITS
    }
    frame = (
        pl.scan_parquet(files, include_file_paths="_file")
        .group_by("_file")
        .agg(
            **present,
            **kept,
            journeys=pl.len(),
            converted=pl.col("label").cast(pl.Int64).sum(),
            censored=pl.col("censored").sum(),
            converted_near_end=((pl.col("split") == NO_SPLIT) & (pl.col("label") == 1)).sum(),
            events=pl.col("n_events_total").cast(pl.Int64).sum(),
            kept=pl.col("n_events").cast(pl.Int64).sum(),
            min_end=pl.col("end_time").min(),
            max_end=pl.col("end_time").max(),
            **{split: (pl.col("split") == split).sum() for split in (*SPLITS, NO_SPLIT)},
        )
        .collect()
    )
    summaries = {}
    for row in frame.sort("_file").iter_rows(named=True):
        name = Path(row.pop("_file")).name
        row["by_split"] = {split: row.pop(split) for split in (*SPLITS, NO_SPLIT)}
        row["kept_by_split"] = {split: row.pop(f"{PRESENT}:{split}") for split in SPLITS}
        row["present_by_split"] = {
            name: {split: row.pop(f"{PRESENT}{name}:{split}") for split in SPLITS}
            for name in features
        }
        row["min_end"], row["max_end"] = str(row["min_end"]), str(row["max_end"])
        row["kind"] = "open" if name.startswith(OPEN_PART_PREFIX) else "finished"
        row["day"] = name.split("-")[1]  # the end day of a finished part's journeys
        summaries[name] = row
    return summaries


def overlaps(
    summary: dict[str, Any], ranges: list[tuple[datetime | None, datetime | None]]
) -> bool:
    """Does a part's end-time range meet any of `ranges` ([low, high), None: unbounded)?"""
    low_end = datetime.fromisoformat(summary["min_end"])
    high_end = datetime.fromisoformat(summary["max_end"])
    return any(
        (low is None or high_end >= low) and (high is None or low_end < high)
        for low, high in ranges
    )


def empty_summary(features: list[str]) -> dict[str, Any]:
    return {
        "journeys": 0, "converted": 0, "censored": 0, "converted_near_end": 0, "events": 0,
        "kept": 0, "min_end": None, "max_end": None, "kind": "open",
        "by_split": dict.fromkeys((*SPLITS, NO_SPLIT), 0),
        "kept_by_split": dict.fromkeys(SPLITS, 0),
        "present_by_split": {name: dict.fromkeys(SPLITS, 0) for name in features},
    }  # fmt: skip

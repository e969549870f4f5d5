"""What a journeys folder was built from: the manifest a nightly `journeys ingest` reads.

`manifest.json`, beside the journeys, records
- the key of the configuration the journeys were built with (a change rebuilds);
- every raw file read: its path, size, modification time, content hash and row counts
  (a file already read that changed or vanished stops the run: history is not rewritten
  behind the journeys' back);
- the data's end (late events are measured from it) and the split's cut points;
- every part file with a summary (journeys, labels, split counts, end-time range), so a
  run sums the summaries instead of reading the parts;
- the row counters of events no later run can change (`settled`).

It is written last, inside the folder that is swapped in whole (`storage.atomic_dir`):
the manifest and the files it names always belong together.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from journeys.errors import InputError
from journeys.storage import write_json

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
    settled: dict[str, Any] = field(default_factory=dict)  # `ingest.Counts` of closed rows
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

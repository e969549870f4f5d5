"""Cache keys from inputs, and markers that tie outputs on disk to a key.

A stage's key hashes its inputs, the config sections it reads and the source of the
library modules that do the work: unchanged inputs give the same key, so Prefect returns
the cached result instead of recomputing. Inputs that are never rewritten in place (raw
day files, the part files of journeys and scores) are hashed by name, size and time
(`listing_digest`), so a nightly run's key costs what the listing costs, not the bytes of
the history. A cached result is only
trusted while the outputs it describes are still on disk and unchanged since that run:
each cached task leaves a marker (`.<output>.flow-cache.json`, beside the output) with
the key and the size and mtime of every output file; no matching marker, no cache hit.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from journeys.config import Config
from journeys.datasets import KEPT_BESIDE

CHUNK = 1 << 20
MARKER = ".{name}.flow-cache.json"
TRAIN_RECORD = ".flow-cache-train.json"  # in paths.checkpoints: cache key -> MLflow run


def _hasher() -> hashlib.blake2b:
    return hashlib.blake2b(digest_size=16)


def files_under(path: str | Path) -> list[Path]:
    """A file itself, or every file under a folder, sorted: hidden names skipped, and the
    folders another stage keeps inside (the monitor's nights under `paths.reports`)."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        return []

    def ours(parts: tuple[str, ...]) -> bool:
        return parts[0] not in KEPT_BESIDE and not any(part.startswith(".") for part in parts)

    return sorted(p for p in path.rglob("*") if p.is_file() and ours(p.relative_to(path).parts))


def digest_files(files: Iterable[Path]) -> str:
    """Hash of the files' absolute names and bytes (streamed: memory stays flat)."""
    digest = _hasher()
    for path in sorted(Path(f).absolute() for f in files):
        digest.update(f"{path}\0{path.stat().st_size}\0".encode())
        with open(path, "rb") as handle:
            while chunk := handle.read(CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def listing_digest(files: Iterable[Path]) -> str:
    """Hash of the files' absolute names, sizes and modification times, reading no byte of
    them: enough for inputs never rewritten in place (ingest's and scoring's part files;
    raw files, which ingest's manifest checks before it reads anything)."""
    digest = _hasher()
    for path in sorted(Path(f).absolute() for f in files):
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def config_digest(config: Config, keys: Iterable[str]) -> str:
    """Hash of the named config entries (`data`, `paths.raw`, ...); absent ones hash as null."""
    tree = config.model_dump(mode="json")
    tree["data"]["columns"] = config.data.spelled_columns()
    selected: dict[str, Any] = {}
    for key in keys:
        node: Any = tree
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        selected[key] = node
    return _text_digest(json.dumps(selected, sort_keys=True, default=str))


def code_digest(*modules: str) -> str:
    """Hash of the library modules' source files (found without importing them)."""
    digest = _hasher()
    for name in modules:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec else None
        digest.update(name.encode())
        if origin and Path(origin).is_file():
            digest.update(Path(origin).read_bytes())
    return digest.hexdigest()


def library_code(*entries: str, package: str = "journeys") -> tuple[str, ...]:
    """Every module of `package` the entry modules run: what they import, directly or not,
    at module level or inside functions, and modules they load by file name (a string
    `"<module>.py"`, e.g. the MLflow model-from-code file). Read from the source, so a
    stage's code list cannot go stale when the library is reorganised.
    """
    spec = importlib.util.find_spec(package)
    assert spec and spec.submodule_search_locations, package
    folder = Path(next(iter(spec.submodule_search_locations)))
    files = {f"{package}.{path.stem}": path for path in folder.glob("*.py")}
    files.pop(f"{package}.__init__", None)
    seen: set[str] = set()
    todo = list(entries)
    while todo:
        name = todo.pop()
        if name in seen or name not in files:
            continue
        seen.add(name)
        todo.extend(_library_references(files[name], package, files))
    return tuple(sorted(seen))


def _library_references(path: Path, package: str, modules: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Constant) and str(node.value).endswith(".py"):
            found.add(f"{package}.{Path(str(node.value)).stem}")  # loaded by file name
    return {name for name in found if name in modules}


def _text_digest(text: str) -> str:
    digest = _hasher()
    digest.update(text.encode())
    return digest.hexdigest()


def stage_key(stage: str, *parts: str) -> str:
    """The cache key of a stage run (also a valid Prefect result-storage file name)."""
    return f"journeys-{stage}-{_text_digest(chr(0).join(parts))}"


def task_key(_context: Any, parameters: dict[str, Any]) -> str:
    """Prefect `cache_key_fn`: the key the flow computed and passed as parameter `key`."""
    return parameters["key"]


# ----------------------------------------------------------------------------- markers


def marker_path(output: str | Path) -> Path:
    output = Path(output).absolute()
    return output.parent / MARKER.format(name=output.name)


def _stats(output: Path) -> dict[str, list[int]]:
    return {
        str(p.relative_to(output) if output.is_dir() else p.name): [
            p.stat().st_size,
            p.stat().st_mtime_ns,
        ]
        for p in files_under(output)
    }


def write_marker(output: str | Path, key: str, **facts: Any) -> None:
    """Record that `output` (a file or folder) as it is now was produced under `key`."""
    from journeys.storage import write_json

    output = Path(output)
    write_json({"key": key, "files": _stats(output), **facts}, marker_path(output))


def read_marker(output: str | Path) -> dict[str, Any] | None:
    try:
        return json.loads(marker_path(output).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def outputs_match(key: str, *outputs: str | Path) -> bool:
    """True when every output still holds exactly the files the run under `key` wrote."""
    for output in outputs:
        marker = read_marker(output)
        if marker is None or marker.get("key") != key:
            return False
        files = _stats(Path(output))
        if not files or files != marker.get("files"):
            return False
    return True


# ----------------------------------------------------------------------------- training
# A training's outputs live in MLflow, not on disk: a record beside the checkpoints ties
# each cache key to the run (and model version) it produced.


def _train_record(config: Config) -> Path:
    return Path(config.paths.checkpoints) / TRAIN_RECORD


def train_outputs_exist(config: Config, key: str) -> bool:
    """The MLflow run a cached training produced is still there (and its model version)."""
    from mlflow import MlflowClient

    from journeys.tracking import tracking_uri

    try:
        record = json.loads(_train_record(config).read_text())[key]
        client = MlflowClient(tracking_uri=tracking_uri(config))
        if client.get_run(record["run_id"]).info.lifecycle_stage != "active":
            return False
        if record.get("model_version"):
            client.get_model_version(config.mlflow.registered_model, str(record["model_version"]))
        return True
    except Exception:  # no record, no run, no store: train again
        return False


def remember_training(config: Config, key: str, summary: dict[str, Any]) -> None:
    """Record the run (and model version) the training under `key` produced."""
    from journeys.storage import write_json

    path = _train_record(config)
    try:
        records = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        records = {}
    records[key] = {"run_id": summary["run_id"], "model_version": summary["model_version"]}
    write_json(records, path)

"""The library's layout holds: its imports form no cycle, it never imports Prefect or the
flows (the command line aside, which starts them), and the model file imports torch alone.

Imports are read from the source (every `import` statement, at module level, inside
functions and under TYPE_CHECKING alike), so a lazy import cannot hide a cycle.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

LIBRARY = Path(__file__).resolve().parents[1] / "journeys"
ENTRY_POINTS = {"journeys.cli"}  # may start the Prefect flows


def imports_of(path: Path) -> set[str]:
    """Every module name an `import` or `from ... import` in the file names."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            # `from journeys import tracking` imports the module journeys.tracking.
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def library_graph() -> dict[str, set[str]]:
    modules = {f"journeys.{path.stem}": path for path in LIBRARY.glob("*.py")}
    return {
        name: {other for other in imports_of(path) if other in modules and other != name}
        for name, path in modules.items()
        if name != "journeys.__init__"
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_library_imports_form_no_cycle() -> None:
    graph = library_graph()
    assert len(graph) > 15  # the scan found the library
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("path", sorted(LIBRARY.glob("*.py")), ids=lambda p: p.name)
def test_the_library_never_imports_prefect_or_the_flows(path: Path) -> None:
    if f"journeys.{path.stem}" in ENTRY_POINTS:
        return
    offending = {
        name
        for name in imports_of(path)
        if name.split(".")[0] in ("prefect", "prefect_dask", "flows")
    }
    assert not offending, f"{path.name} imports {sorted(offending)}"


def test_the_model_file_imports_torch_alone() -> None:
    imported = imports_of(LIBRARY / "model.py")
    outside = {
        name
        for name in imported
        if name.split(".")[0] not in ("torch", "__future__")
        and name.split(".")[0] not in sys.stdlib_module_names
    }
    assert not outside, f"model.py imports {sorted(outside)}"
    assert any(name.startswith("torch") for name in imported)

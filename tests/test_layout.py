"""The package layout: the engine core never imports a workflow, and no module of astrai
imports, directly or through others, a module that imports it back (imports inside
functions and under ``TYPE_CHECKING`` included)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "astrai"
#: What sits above the engine core (``astrai.dispatch``): it may import the core, never
#: the reverse. The core's own ``__init__`` loads the workflows' public names by name.
ABOVE_CORE = ("record", "lock", "tune", "distributed", "cli", "ops", "integrations", "demo",
              "models")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's astrai imports, as the modules they name (anywhere in the file)."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                           else node.module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for target in targets:
                got = owner(target) if target.startswith("astrai") else None
                if got is not None and got != name:
                    out.add(got)
        edges[name] = out
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    edges = _imports(_modules())
    assert len(edges) > 50  # the walk found the package
    assert _cycles(edges) == []


def test_a_cycle_is_found() -> None:
    """The check itself: a cycle of three, beside modules outside it."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}) == [["a", "b", "c"]]


def test_the_core_imports_no_workflow() -> None:
    edges = _imports(_modules())
    upward = sorted(f"{m} -> {t}" for m, targets in edges.items()
                    if m.startswith("astrai.dispatch.") for t in targets
                    if t.count(".") and t.split(".")[1] in ABOVE_CORE)
    assert upward == []


@pytest.mark.parametrize("module", ["astrai.formats.common", "astrai.lock.enforce",
                                    "astrai.tune.report", "astrai.distributed.collective",
                                    "astrai.cli.parser", "astrai.dispatch.tables.format"])
def test_each_module_imports_first(module: str) -> None:
    """A module imported before anything else of astrai's loads (no partial module)."""
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr

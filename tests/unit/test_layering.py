"""Every module's place is its folder, checked against its imports; the map cannot go stale.

The stack of folders lives in docs/architecture.py (the same file draws the map in
docs/architecture.md): floors every process stands on (core, config, db), then the rooms of
the processes. A module imports its own folder and the layers below, never above, and never
a room beside its own.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _load_architecture() -> ModuleType:
    spec = importlib.util.spec_from_file_location("architecture", DOCS / "architecture.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["architecture"] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["architecture"]
    return module


arch = _load_architecture()
GRAPH: dict[str, set[str]] = arch.graph()
FOLDERS = {folder for line in arch.STACK for folder in line}


def test_the_walker_sees_relative_absolute_and_nested_imports() -> None:
    """The import walker resolves relative imports and finds imports inside functions."""
    source = (
        "import os\n"
        "from .enums import Mode\n"
        "from .. import signals\n"
        "def f():\n"
        "    import sqlalchemy.orm\n"
        "    from ..db.store import Store\n"
    )
    found = arch.imports_of(source, "celery_boundedbeat.core.mod")
    assert {"os", "celery_boundedbeat.core.enums", "sqlalchemy.orm", "celery_boundedbeat.db.store"} <= found
    assert "celery_boundedbeat.signals" in found
    assert "core.loops" in arch.internal(GRAPH["core.ticks"]) or "core.policy" in arch.internal(
        GRAPH["core.ticks"]
    )
    assert "sqlalchemy" in arch.frameworks(GRAPH["db.store"])


def test_every_module_lives_in_a_folder_of_the_stack() -> None:
    """A new folder must be placed in the stack (it cannot escape the checks)."""
    unplaced = {m for m in GRAPH if arch.folder_of(m) not in FOLDERS}
    assert unplaced == set()
    on_disk = {p.name for p in arch.ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert on_disk == FOLDERS - {arch.TOP}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_a_module_imports_only_its_own_folder_and_the_layers_below(module: str) -> None:
    """No import runs upward, and rooms side by side do not import each other."""
    own = arch.folder_of(module)
    wrong = {
        t
        for t in arch.internal(GRAPH[module])
        if arch.folder_of(t) != own and arch.layer_of(t) >= arch.layer_of(module)
    }
    assert wrong == set(), f"{module} imports {sorted(wrong)} (upward or a room beside its own)"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_frameworks_are_imported_only_from_their_folder_up(module: str) -> None:
    """SQLAlchemy from db up, Celery and kombu from config up, Django only in contrib."""
    for framework in arch.frameworks(GRAPH[module]) & set(arch.FRAMEWORKS):
        lowest = arch.FRAMEWORKS[framework]
        if framework == "django":
            assert arch.folder_of(module) == "contrib", f"{module} imports django"
        else:
            assert arch.layer_of(module) >= arch.layer_of(lowest + ".x"), f"{module} imports {framework}"


def test_there_is_no_import_cycle_between_modules() -> None:
    """Modules of one layer may import each other, but never in a circle."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(arch.internal(GRAPH[node]) - {node}):
            assert state.get(target) != 1, "import cycle: " + " -> ".join([*path, target])
            if target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


def test_docs_architecture_md_draws_the_layers_of_today() -> None:
    """Moving a module or an import must also redraw the picture users read."""
    committed = arch.drawn((DOCS / "architecture.md").read_text())
    assert committed == arch.block(), "docs/architecture.md is stale: run `python docs/architecture.py`"


#: Functions allowed past ~60 lines, each with the reason (none today).
LONG_FUNCTIONS: dict[str, str] = {}


def test_no_function_is_longer_than_a_screen_without_a_written_reason() -> None:
    """Functions over 60 lines (docstring included) are listed here with why, or split."""
    long: list[str] = []
    for path in arch.module_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                name = f"{path.relative_to(arch.ROOT)}:{node.name}"
                if length > 60 and name not in LONG_FUNCTIONS:
                    long.append(f"{name} ({length} lines)")
    assert long == []

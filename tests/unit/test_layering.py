"""Every module's layer, checked against its imports; the architecture picture cannot go stale.

The table of layers lives in docs/architecture.py (one owner: the same table draws the picture
in docs/architecture.md). Every module of the package must be in it.
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
LAYER: dict[str, int] = arch.layer_of()
NAMES = [name for name, _, _ in arch.LAYERS]


def test_the_walker_sees_relative_absolute_and_nested_imports() -> None:
    """The import walker resolves relative imports and finds imports inside functions."""
    source = (
        "import os\n"
        "from .enums import Mode\n"
        "from . import schema\n"
        "def f():\n"
        "    import sqlalchemy.orm\n"
        "    from ..x import y\n"
    )
    found = arch.imports_of(source, "celery_boundedbeat.contrib.mod")
    assert {"os", "celery_boundedbeat.contrib.enums", "sqlalchemy.orm", "celery_boundedbeat.x"} <= found
    assert "celery_boundedbeat.contrib.schema" in found
    assert "runtime" in arch.internal(GRAPH["ticks"])
    assert "sqlalchemy" in {n.split(".")[0] for n in GRAPH["store"]}


def test_every_module_has_a_layer() -> None:
    """A new or moved module must be placed in a layer (it cannot escape the checks)."""
    assert set(GRAPH) == set(LAYER), {"unplaced": set(GRAPH) - set(LAYER), "gone": set(LAYER) - set(GRAPH)}


@pytest.mark.parametrize("module", sorted(LAYER))
def test_a_module_imports_only_its_own_layer_and_the_layers_below(module: str) -> None:
    """No import runs upward: the layer of every imported package module is at most the importer's."""
    upward = {t for t in arch.internal(GRAPH[module]) if LAYER[t] > LAYER[module]}
    assert upward == set(), f"{module} ({NAMES[LAYER[module]]}) imports higher layers: {sorted(upward)}"


@pytest.mark.parametrize("module", sorted(LAYER))
def test_frameworks_are_imported_only_from_their_layer_up(module: str) -> None:
    """SQLAlchemy from the SQL layer up, Celery and kombu from the Celery glue up, Django only in contrib."""
    roots = {name.split(".")[0] for name in GRAPH[module]}
    for framework, lowest in arch.FRAMEWORKS.items():
        if framework in roots:
            assert LAYER[module] >= NAMES.index(lowest), f"{module} imports {framework}"
    if "django" in roots:
        assert module == "contrib"


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

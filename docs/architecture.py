"""The package's layers, read from its imports: the picture in docs/architecture.md.

``LAYERS`` says which layer each module belongs to; the import graph is walked with ``ast``
(function-level imports included). ``tests/unit/test_layering.py`` checks the rules against
the same table and that the committed picture is what this file draws today, so neither can
go stale. Run ``python docs/architecture.py`` to redraw it after moving a module.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = "celery_boundedbeat"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
DOC = Path(__file__).resolve().parent / "architecture.md"

#: Bottom to top: a module may import its own layer and the layers below, never above.
LAYERS: list[tuple[str, str, tuple[str, ...]]] = [
    ("foundation", "errors and enums: stdlib only", ("exceptions", "enums")),
    (
        "decisions",
        "pure: values in, values out; no SQL, Celery or Django",
        (
            "redact",
            "runtime",
            "timing",
            "wallclock",
            "settings",
            "policy",
            "ticks",
            "backfill",
            "alerts",
            "messages",
        ),
    ),
    (
        "sql",
        "SQLAlchemy and Alembic: transactions, no Celery",
        (
            "schema",
            "faults",
            "engine",
            "migrate",
            "rows",
            "bulk",
            "held",
            "claims",
            "catalog",
            "alertlog",
            "retention",
            "runlife",
            "store",
            "worklog",
            "reportproc",
            "prepared",
            "notify",
        ),
    ),
    (
        "coordination",
        "the beat lease over the store; the health probe and the metrics that read it",
        ("lease", "health", "metrics", "exporter"),
    ),
    (
        "celery",
        "Celery glue: entries, publishing, the dispatcher, worker signals, reports",
        (
            "entries",
            "definitions",
            "schedules",
            "frames",
            "fsbroker",
            "publish",
            "dispatch",
            "ahead",
            "tracking",
            "receivers",
            "reports",
            "outbox",
            "signals",
        ),
    ),
    ("beat", "the celery.beat contract and housekeeping", ("scheduler",)),
    (
        "entry points",
        "what users call: CLI, public API, Django, the pytest plugin",
        ("cli", "__init__", "contrib", "testing"),
    ),
]

#: Frameworks, and the lowest layer allowed to import each.
FRAMEWORKS = {
    "sqlalchemy": "sql",
    "alembic": "sql",
    "psycopg": "sql",
    "celery": "celery",
    "kombu": "celery",
    "django": "entry points",
    "prometheus_client": "coordination",
}


def short_name(path: Path) -> str:
    """``dispatch`` for dispatch.py, ``contrib`` for anything under contrib/."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return "contrib" if parts[0] == "contrib" else parts[0]


def imports_of(source: str, module: str, *, is_package: bool = False) -> set[str]:
    """Absolute names of everything ``source`` imports, at any depth (function-level included)."""
    package_parts = module.split(".") if is_package else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            if node.level and not node.module:  # from . import x: x may be a module
                found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def module_files() -> list[Path]:
    """Every module of the package (the shipped migrations are Alembic's, not ours)."""
    return [p for p in sorted(ROOT.rglob("*.py")) if "migrations" not in p.relative_to(ROOT).parts]


def graph() -> dict[str, set[str]]:
    """Short module name -> every name it imports (internal ones as short names)."""
    edges: dict[str, set[str]] = {}
    for path in module_files():
        dotted = ".".join([PACKAGE, *path.relative_to(ROOT).with_suffix("").parts])
        is_package = path.name == "__init__.py"
        if is_package:
            dotted = dotted.removesuffix(".__init__")
        names = imports_of(path.read_text(), dotted, is_package=is_package)
        own = edges.setdefault(short_name(path), set())
        for name in names:
            parts = name.split(".")
            if parts[0] == PACKAGE and len(parts) > 1:
                target = "contrib" if parts[1] == "contrib" else parts[1]
                own.add(f"{PACKAGE}.{target}")
            elif parts[0] == PACKAGE:
                own.add(f"{PACKAGE}.__init__")
            else:
                own.add(name)
    return edges


def internal(imports: set[str]) -> set[str]:
    return {n.split(".", 1)[1] for n in imports if n.startswith(f"{PACKAGE}.")}


def layer_of() -> dict[str, int]:
    return {module: index for index, (_, _, modules) in enumerate(LAYERS) for module in modules}


def render() -> str:
    """The layers and every internal import as a Mermaid flowchart (GitHub draws it)."""
    edges = graph()
    lines = ["```mermaid", "flowchart BT"]
    for index, (name, _, modules) in enumerate(LAYERS):
        lines.append(f'  subgraph L{index}["{index + 1}. {name}"]')
        lines.extend(f'    {_node(m)}["{m}"]' for m in modules)
        lines.append("  end")
    for module in sorted(edges):
        for target in sorted(internal(edges[module]) - {module}):
            lines.append(f"  {_node(module)} --> {_node(target)}")
    lines.append("```")
    return "\n".join(lines)


def _node(module: str) -> str:
    return "init" if module == "__init__" else module


_BLOCK = re.compile(r"<!-- layers:begin -->.*?<!-- layers:end -->", re.S)


def drawn(doc: str) -> str:
    """The picture block of docs/architecture.md as committed."""
    match = _BLOCK.search(doc)
    return match.group(0) if match else ""


def block() -> str:
    return f"<!-- layers:begin -->\n{render()}\n<!-- layers:end -->"


if __name__ == "__main__":
    text = DOC.read_text()
    DOC.write_text(_BLOCK.sub(lambda _m: block(), text))
    print(f"redrew the layers in {DOC}")

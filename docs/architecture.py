"""The package's map, read from its folders and imports: the picture in docs/architecture.md.

A module's place is its folder. Folders stack bottom to top (``STACK``): three floors every
process stands on (``core``, ``config``, ``db``), then the rooms of the processes that use
them. A module imports its own folder and the layers below, never above, and never a room
beside its own. ``tests/unit/test_layering.py`` checks those rules and that the committed
picture is what this file draws today. Run ``python docs/architecture.py`` to redraw it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = "celery_boundedbeat"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
DOC = Path(__file__).resolve().parent / "architecture.md"
TOP = "(top)"

#: Bottom to top; folders on one line are rooms side by side (they do not import each other).
STACK: list[tuple[str, ...]] = [
    ("core",),
    ("config",),
    ("db",),
    ("dispatch", "worker", "api", "ops"),
    ("beat",),
    (TOP, "contrib"),
]

#: Top-level modules that are public paths but stand lower, with why. ``signals`` is imported
#: as ``celery_boundedbeat.signals`` by applications and sent by beat, and needs only
#: core and Celery.
LOWER_PUBLIC: dict[str, str] = {"signals": "config"}

#: Frameworks, and the lowest folder allowed to import each (Django: contrib only).
FRAMEWORKS = {
    "sqlalchemy": "db",
    "alembic": "db",
    "psycopg": "db",
    "celery": "config",
    "kombu": "config",
    "prometheus_client": "ops",
    "django": "contrib",
}


def module_files() -> list[Path]:
    """Every module of the package (the shipped Alembic migrations are Alembic's scripts)."""
    return [p for p in sorted(ROOT.rglob("*.py")) if "migrations" not in p.relative_to(ROOT).parts]


def name_of(path: Path) -> str:
    """``db.store`` for db/store.py, ``cli`` for cli.py, ``contrib`` for anything under contrib/."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] == "contrib":
        return "contrib"
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) if parts else "__init__"


def folder_of(name: str) -> str:
    """The folder a module name lives in (``TOP`` for the package's own files)."""
    if name == "contrib":
        return "contrib"
    head, _, rest = name.partition(".")
    return head if rest or head in _folders() else TOP


def _folders() -> set[str]:
    return {f for line in STACK for f in line if f != TOP}


def layer_of(name: str) -> int:
    folder = folder_of(name)
    if folder == TOP and name in LOWER_PUBLIC:
        folder = LOWER_PUBLIC[name]
    return next(index for index, line in enumerate(STACK) if folder in line)


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
            found.update(f"{target}.{alias.name}" for alias in node.names)  # x may be a module
    return found


def graph() -> dict[str, set[str]]:
    """Module name -> the package modules it imports (names as :func:`name_of` gives them)."""
    known = {name_of(p) for p in module_files()}
    edges: dict[str, set[str]] = {}
    for path in module_files():
        dotted = ".".join([PACKAGE, *path.relative_to(ROOT).with_suffix("").parts])
        is_package = path.name == "__init__.py"
        dotted = dotted.removesuffix(".__init__")
        own = edges.setdefault(name_of(path), set())
        for name in imports_of(path.read_text(), dotted, is_package=is_package):
            parts = name.split(".")
            if parts[0] != PACKAGE:
                own.add("!" + parts[0])  # a framework or the standard library
            elif len(parts) > 1 and parts[1] == "contrib":
                own.add("contrib")
            elif ".".join(parts[1:]) in known:
                own.add(".".join(parts[1:]))
            elif len(parts) == 1:
                own.add("__init__")
    return edges


def frameworks(imports: set[str]) -> set[str]:
    return {n[1:] for n in imports if n.startswith("!")}


def internal(imports: set[str]) -> set[str]:
    return {n for n in imports if not n.startswith("!")}


def first_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def render() -> str:
    """The folders and their imports as a Mermaid flowchart, then every module and its purpose."""
    edges = graph()
    arrows: set[tuple[str, str]] = set()
    for module, targets in edges.items():
        for target in internal(targets):
            a, b = folder_of(module), folder_of(target)
            if a != b:
                arrows.add((a, b))
    lines = ["```mermaid", "flowchart BT"]
    for index, line in enumerate(STACK):
        lines.append(f'  subgraph L{index}[" "]')
        lines.extend(f'    {_node(f)}["{f}/"]' if f != TOP else '    top["celery_boundedbeat"]' for f in line)
        lines.append("  end")
    lines.extend(f"  {_node(a)} --> {_node(b)}" for a, b in sorted(arrows))
    lines += ["```", "", "| folder | module | what it is for |", "|---|---|---|"]
    for line in STACK:
        for folder in line:
            for path in module_files():
                name = name_of(path)
                if folder_of(name) != folder or not _listed(path):
                    continue
                shown = "contrib.django" if name == "contrib" else name
                text = first_line(path).replace("|", "\\|")
                lines.append(f"| `{folder}` | `{shown}` | {text} |")
    return "\n".join(lines)


def _listed(path: Path) -> bool:
    """A module of its own: not a folder's ``__init__`` (but Django's app), not inside contrib."""
    rel = path.relative_to(ROOT).parts
    if rel[0] == "contrib":
        return rel == ("contrib", "django", "__init__.py")
    return path.name != "__init__.py" or len(rel) == 1


def _node(folder: str) -> str:
    return "top" if folder == TOP else folder


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
    print(f"redrew the map in {DOC}")

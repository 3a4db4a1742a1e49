"""The module layering of STYLE.md, checked by walking every import with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import celery_boundedbeat

PACKAGE = "celery_boundedbeat"
ROOT = Path(celery_boundedbeat.__file__).resolve().parent

FRAMEWORKS = ("sqlalchemy", "alembic", "celery", "kombu", "django")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


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


def all_modules() -> dict[str, set[str]]:
    modules: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if "migrations" in path.relative_to(ROOT).parts:
            continue
        name = module_name(path)
        modules[name] = imports_of(path.read_text(), name, is_package=path.name == "__init__.py")
    return modules


MODULES = all_modules()


def internal(imports: set[str]) -> set[str]:
    """The package modules imported (``celery_boundedbeat.x`` for ``celery_boundedbeat.x.y`` too)."""
    out = set()
    for name in imports:
        parts = name.split(".")
        if parts[0] == PACKAGE and len(parts) > 1:
            out.add(".".join(parts[:2]))
    return out


def external_roots(imports: set[str]) -> set[str]:
    return {name.split(".")[0] for name in imports}


def mod(short: str) -> str:
    return f"{PACKAGE}.{short}"


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
    found = imports_of(source, "celery_boundedbeat.contrib.mod")
    assert {"os", "celery_boundedbeat.contrib.enums", "sqlalchemy.orm", "celery_boundedbeat.x"} <= found
    assert "celery_boundedbeat.contrib.schema" in found
    assert mod("runtime") in MODULES[mod("ticks")]
    assert "sqlalchemy" in external_roots(MODULES[mod("store")])


@pytest.mark.parametrize("name", ["exceptions", "enums"])
def test_errors_and_enums_import_only_each_other(name: str) -> None:
    """exceptions and enums are the bottom layer: stdlib only, plus each other."""
    imports = MODULES[mod(name)]
    assert internal(imports) <= {mod("exceptions"), mod("enums")}
    assert not external_roots(imports) & set(FRAMEWORKS)


@pytest.mark.parametrize("name", ["timing", "policy", "ticks", "runtime", "settings"])
def test_pure_modules_import_no_framework(name: str) -> None:
    """The pure modules import no SQLAlchemy, Alembic, Celery, kombu, Django or higher layer."""
    imports = MODULES[mod(name)]
    assert not external_roots(imports) & set(FRAMEWORKS), sorted(imports)
    allowed = {mod(m) for m in ("exceptions", "enums", "timing", "policy", "ticks", "runtime", "settings")}
    assert internal(imports) <= allowed, sorted(internal(imports) - allowed)


@pytest.mark.parametrize("name", ["schema", "store", "migrate", "engine"])
def test_sql_modules_import_no_celery(name: str) -> None:
    """The SQL layer (schema, store, migrate, engine) never imports Celery, kombu or the Celery glue."""
    imports = MODULES[mod(name)]
    assert not external_roots(imports) & {"celery", "kombu", "django"}, sorted(imports)
    glue = {mod(m) for m in ("dispatch", "tracking", "reports", "scheduler", "cli", "entries")}
    assert not internal(imports) & glue


def test_only_contrib_imports_django() -> None:
    """Django is imported only under celery_boundedbeat.contrib."""
    offenders = {
        name
        for name, imports in MODULES.items()
        if "django" in external_roots(imports) and not name.startswith(mod("contrib"))
    }
    assert offenders == set()


def test_every_module_was_walked() -> None:
    """The walk covered the whole package (a moved file cannot silently escape the checks)."""
    for short in (
        "exceptions",
        "enums",
        "timing",
        "policy",
        "ticks",
        "runtime",
        "settings",
        "schema",
        "store",
        "migrate",
        "engine",
    ):
        assert mod(short) in MODULES

"""Fixtures shared by the unit and integration suites: throwaway databases.

Every test gets a database of its own. A test that needs the schema (``migrated``, or the
``migrated_*_url`` fixtures) gets a copy of a database migrated once per session: a PostgreSQL
``CREATE DATABASE ... TEMPLATE``, or a copy of a SQLite file. The migrations themselves run on
every session's template, and on empty databases in the tests of ``upgrade`` and ``migrate``.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from pgtools import throwaway_database
from sqlalchemy import Engine

from celery_boundedbeat.db.engine import dispose_all, get_engine
from celery_boundedbeat.db.migrate import upgrade

#: Databases (PostgreSQL names, SQLite paths) made as copies of a migrated template.
_COPIES: set[str] = set()


@pytest.fixture(scope="session")
def postgres_template() -> Iterator[str]:
    """A PostgreSQL database migrated to the newest revision, once per session, to be copied.

    Nothing stays connected to it (CREATE DATABASE ... TEMPLATE refuses a template in use).
    """
    with throwaway_database("bb_template") as database:
        engine = get_engine(database.url)
        try:
            upgrade(engine)
        finally:
            engine.dispose()
        yield database.name


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to the newest revision, once per session, to be copied."""
    path = tmp_path_factory.mktemp("bb_template") / "boundedbeat.sqlite3"
    engine = get_engine(f"sqlite:///{path}")
    upgrade(engine)
    engine.dispose()  # the last connection checkpoints the WAL into the file and removes it
    assert not path.with_name(path.name + "-wal").exists(), "the template's WAL was not checkpointed"
    return path


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """The SQLAlchemy URL of a fresh, empty PostgreSQL database, dropped after the test."""
    with throwaway_database("bb_test") as database:
        yield database.url


@pytest.fixture
def migrated_postgres_url(postgres_template: str) -> Iterator[str]:
    """The URL of a fresh PostgreSQL database with the newest schema, dropped after the test."""
    with throwaway_database("bb_test", template=postgres_template) as database:
        _COPIES.add(database.name)
        try:
            yield database.url
        finally:
            _COPIES.discard(database.name)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """The SQLAlchemy URL of a fresh SQLite file database in the test's temporary directory."""
    return f"sqlite:///{tmp_path}/boundedbeat.sqlite3"


@pytest.fixture
def migrated_sqlite_url(tmp_path: Path, sqlite_template: Path) -> str:
    """The URL of a SQLite file with the newest schema in the test's temporary directory."""
    path = tmp_path / "migrated.sqlite3"
    shutil.copyfile(sqlite_template, path)
    _COPIES.add(str(path))
    return f"sqlite:///{path}"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """A database URL: a SQLite file, then a fresh PostgreSQL database; empty, or already
    migrated (a copy of the session's template) when the test takes ``migrated``."""
    fixture = "sqlite_url" if request.param == "sqlite" else "postgres_url"
    if "migrated" in request.fixturenames:
        fixture = f"migrated_{fixture}"
    return str(request.getfixturevalue(fixture))


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """The package's own engine for ``db_url`` (SQLite in WAL mode with BEGIN IMMEDIATE)."""
    engine = get_engine(db_url)
    try:
        yield engine
    finally:
        dispose_all()


@pytest.fixture
def migrated(engine: Engine) -> Engine:
    """``engine`` with the schema migrated to the newest revision (a copy of the template is)."""
    if engine.url.database not in _COPIES:
        upgrade(engine)
    return engine


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    """A failing end-to-end test shows what its beats, workers and databases were doing.

    Assertion messages carry the runs they are about; the processes' logs explain why (a
    tick that failed, a lock, a slow start), and they are gone once the test's temporary
    directory is cleaned up, so they go into the report while the processes still exist.
    """
    report = yield
    funcargs = getattr(item, "funcargs", {})
    harnesses = [funcargs["bb"]] if "bb" in funcargs else list(funcargs.get("harnesses", []))
    if report.failed and call.when == "call":
        for harness in harnesses:
            try:
                report.sections.append(("end-to-end diagnostics", harness.diagnostics(lines=80)))
            except Exception as exc:  # the report must not hide the failure itself
                report.sections.append(("end-to-end diagnostics", f"could not collect: {exc!r}"))
    return report

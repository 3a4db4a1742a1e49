"""Fixtures shared by the unit and integration suites: throwaway databases."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pgtools import throwaway_database
from sqlalchemy import Engine

from celery_boundedbeat.db.engine import dispose_all, get_engine
from celery_boundedbeat.db.migrate import upgrade


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """The SQLAlchemy URL of a fresh, empty PostgreSQL database, dropped after the test."""
    with throwaway_database("bb_test") as database:
        yield database.url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """The SQLAlchemy URL of a fresh SQLite file database in the test's temporary directory."""
    return f"sqlite:///{tmp_path}/boundedbeat.sqlite3"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """An empty database URL: a SQLite file, then a fresh PostgreSQL database."""
    fixture = "sqlite_url" if request.param == "sqlite" else "postgres_url"
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
    """``engine`` with the schema migrated to the newest revision."""
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

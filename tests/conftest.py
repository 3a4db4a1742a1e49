"""Fixtures shared by the unit and integration suites: throwaway databases."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

#: Server-level connection used to create and drop per-test databases.
POSTGRES_ADMIN = os.environ.get(
    "BOUNDEDBEAT_TEST_POSTGRES", "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
)
POSTGRES_URL = os.environ.get(
    "BOUNDEDBEAT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/{db}"
)


def _admin() -> object:
    import psycopg

    try:
        return psycopg.connect(POSTGRES_ADMIN, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        # The suite never skips a backend: CI must fail when PostgreSQL is missing.
        pytest.fail(f"PostgreSQL is not reachable ({POSTGRES_ADMIN}): {exc}")


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """The SQLAlchemy URL of a fresh, empty PostgreSQL database, dropped after the test."""
    name = f"bb_test_{uuid.uuid4().hex[:16]}"
    with _admin() as conn:  # type: ignore[attr-defined]
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield POSTGRES_URL.format(db=name)
    finally:
        with _admin() as conn:  # type: ignore[attr-defined]
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """The SQLAlchemy URL of a fresh SQLite file database in the test's temporary directory."""
    return f"sqlite:///{tmp_path}/boundedbeat.sqlite3"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    """A failing end-to-end test shows what its beat, worker and database were doing.

    Assertion messages carry the runs they are about; the processes' logs explain why (a
    tick that failed, a lock, a slow start), and they are gone once the test's temporary
    directory is cleaned up, so they go into the report while the processes still exist.
    """
    report = yield
    harness = getattr(item, "funcargs", {}).get("bb")
    if report.failed and call.when == "call" and harness is not None:
        try:
            report.sections.append(("end-to-end diagnostics", harness.diagnostics(lines=80)))
        except Exception as exc:  # the report must not hide the failure itself
            report.sections.append(("end-to-end diagnostics", f"could not collect: {exc!r}"))
    return report

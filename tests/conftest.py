"""Fixtures shared by the unit and integration suites: throwaway databases."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pgtools import throwaway_database


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """The SQLAlchemy URL of a fresh, empty PostgreSQL database, dropped after the test."""
    with throwaway_database("bb_test") as database:
        yield database.url


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

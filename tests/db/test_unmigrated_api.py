"""The Python API on a database nobody migrated: DatabaseNotMigratedError naming the command, not SQL."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from celery import Celery
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.exc import DBAPIError, OperationalError

import celery_boundedbeat as bb
from celery_boundedbeat.db.engine import dispose_all
from celery_boundedbeat.db.migrate import head_revision, upgrade

_HOUR_AGO = datetime.now(UTC) - timedelta(hours=1)

#: Every public function that reads or writes the tables, called as an application would.
CALLS: dict[str, Callable[[Celery], Any]] = {
    "add_schedule": lambda app: bb.add_schedule(app, "report", "proj.report", 10.0),
    "update_schedule": lambda app: bb.update_schedule(app, "report", schedule=5.0),
    "remove_schedule": lambda app: bb.remove_schedule(app, "report"),
    "backfill": lambda app: bb.backfill(app, "report", _HOUR_AGO, _HOUR_AGO + timedelta(minutes=30)),
    "snapshot": lambda app: bb.snapshot(app),
    "history": lambda app: bb.history(app, "report"),
}


@pytest.fixture
def app(db_url: str) -> Iterator[Celery]:
    """An app named ``shop`` (what ``-A`` would name) on an empty database."""
    app = Celery("shop", set_as_current=False)
    app.conf.boundedbeat_database_url = db_url
    try:
        yield app
    finally:
        dispose_all()


@pytest.mark.parametrize("call", sorted(CALLS))
def test_each_api_call_on_an_unmigrated_database_says_what_to_run(app: Celery, call: str) -> None:
    """The call raises DatabaseNotMigratedError with the app's migrate command, never the driver's SQL."""
    with pytest.raises(bb.DatabaseNotMigratedError) as info:
        CALLS[call](app)
    message = str(info.value)
    assert "has no celery_boundedbeat tables" in message and head_revision() in message
    assert "`celery -A shop boundedbeat migrate`" in message
    assert "SELECT" not in message and "boundedbeat_schedules" not in message


def test_an_outdated_schema_is_named_with_its_revision(app: Celery, db_url: str) -> None:
    """A database at an older revision (a column missing) gets the revision it is at and the one needed."""
    engine = create_engine(db_url)
    upgrade(engine, "0001")
    engine.dispose()
    with pytest.raises(bb.DatabaseNotMigratedError, match="is at revision 0001"):
        bb.snapshot(app)


def test_enqueue_on_an_unmigrated_database_says_what_to_run(db_url: str) -> None:
    """enqueue() in the caller's transaction raises DatabaseNotMigratedError, the transaction failed."""
    engine = create_engine(db_url)
    try:
        with pytest.raises(bb.DatabaseNotMigratedError, match="boundedbeat migrate"), engine.begin() as conn:
            bb.enqueue(conn, "proj.report")
    finally:
        engine.dispose()


def test_a_migrated_database_is_unchanged(app: Celery, db_url: str) -> None:
    """After migrate the same calls work: the wrapper changes only the failure."""
    upgrade(create_engine(db_url))
    assert bb.add_schedule(app, "report", "proj.report", 10.0) == "scheduled"
    assert [s.name for s in bb.snapshot(app)] == ["report"]


def test_an_unreachable_database_keeps_its_own_error() -> None:
    """A refused connection is an outage, reported as the driver's error, not as 'not migrated'."""
    app = Celery("shop", set_as_current=False)
    app.conf.boundedbeat_database_url = "postgresql+psycopg://postgres@127.0.0.1:1/x"
    with pytest.raises(OperationalError):
        bb.snapshot(app)


def test_a_database_at_the_head_revision_keeps_the_drivers_error(migrated: Engine, db_url: str) -> None:
    """A table dropped by hand behind a head revision is not 'not migrated': the driver's error stays."""
    app = Celery("shop", set_as_current=False)
    app.conf.boundedbeat_database_url = db_url
    with migrated.begin() as conn:
        conn.execute(text("DROP TABLE boundedbeat_runs"))
    with pytest.raises(DBAPIError) as info:
        bb.history(app)
    assert not isinstance(info.value, bb.DatabaseNotMigratedError)
    assert "boundedbeat_runs" in str(info.value)

"""Rows inserted by ``insert_many`` and ``insert_document`` read back exactly as the ORM's Core
insert writes them.

On PostgreSQL it is a ``COPY`` that bypasses SQLAlchemy's type processing, so the bindings the
ORM would do must match to the SQL value: JSON as JSON (``None`` as JSON ``null``), datetimes
in any offset as the same instant, text with the characters ``COPY`` escapes kept as is.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any, cast

import pytest
from helpers.clock import T0
from sqlalchemy import Engine, Table, func, insert, select, text
from sqlalchemy.exc import StatementError

from celery_boundedbeat.db.bulk import CHUNK, insert_document, insert_many
from celery_boundedbeat.db.driver import Driver
from celery_boundedbeat.db.engine import dispose_all, get_engine
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import QueueRow

QUEUE = cast(Table, QueueRow.__table__)
READ_BACK = (
    "SELECT task_id, task, CAST(args AS text), CAST(kwargs AS text), CAST(options AS text), "
    "due_at, enqueued_at, claimed_by, claimed_until, attempts FROM boundedbeat_queue WHERE task_id = :t"
)


@pytest.fixture
def store(migrated: Engine) -> Store:
    return Store(migrated)


def row(task_id: str, **changes: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "run_id": task_id,
        "task_id": task_id,
        "task": "proj.t\twith\\odd\nchars",
        "args": [1, "two", None, {"x": 'a,b"}'}],
        "kwargs": {"none": None, "tab": "\t", "slash": "\\N"},
        "options": {"headers": {"boundedbeat_run": "r-1"}, "expires": 12.5},
        "due_at": datetime(2030, 1, 1, 2, 0, 5, tzinfo=timezone(timedelta(hours=2))),
        "enqueued_at": T0,
        "claimed_by": None,
        "claimed_until": None,
        "attempts": 0,
    }
    values.update(changes)
    return values


def read_back(store: Store, task_id: str) -> tuple[Any, ...]:
    with store.engine.connect() as conn:
        found = list(conn.execute(text(READ_BACK), {"t": task_id}).one())
    for i in (5, 6, 8):  # SQLite reads naive UTC text back: compare instants
        if isinstance(found[i], str):
            found[i] = datetime.fromisoformat(found[i])
        if isinstance(found[i], datetime) and found[i].tzinfo is None:
            found[i] = found[i].replace(tzinfo=UTC)
    return tuple(found)


def test_rows_read_back_as_the_core_insert_writes_them(store: Store) -> None:
    with store.session() as s:
        s.execute(insert(QUEUE), [row("by-core")])
        insert_many(s, QUEUE, [row("by-bulk")])
    core, bulk = read_back(store, "by-core"), read_back(store, "by-bulk")
    assert bulk[1:] == core[1:]
    assert bulk[5] == datetime(2030, 1, 1, 0, 0, 5, tzinfo=UTC)


def test_a_generator_of_more_rows_than_a_chunk_is_written_whole_in_order(store: Store) -> None:
    count = CHUNK * 2 + 7
    with store.session() as s:
        insert_many(s, QUEUE, (row(f"r{i:05d}", attempts=i) for i in range(count)))
    with store.session() as s:
        found = s.execute(select(QueueRow.task_id, QueueRow.attempts).order_by(QueueRow.id)).all()
    assert [tuple(f) for f in found] == [(f"r{i:05d}", i) for i in range(count)]


def test_nothing_to_insert_touches_nothing(store: Store) -> None:
    with store.session() as s:
        insert_many(s, QUEUE, [])
        insert_many(s, QUEUE, iter(()))
        assert s.scalar(select(func.count()).select_from(QueueRow)) == 0


@pytest.mark.parametrize("column", ["due_at", "claimed_until"])
def test_a_naive_datetime_is_refused_and_nothing_is_written(store: Store, column: str) -> None:
    # SQLAlchemy wraps the type's ValueError (SQLite); COPY raises it as is (PostgreSQL).
    with pytest.raises((ValueError, StatementError), match="timezone-aware"), store.session() as s:
        insert_many(s, QUEUE, [row("fine"), row("naive", **{column: datetime(2030, 1, 1)})])
    with store.session() as s:
        assert s.scalar(select(func.count()).select_from(QueueRow)) == 0


@pytest.mark.postgres
def test_rows_with_other_columns_are_refused_on_postgres(migrated_postgres_url: str) -> None:
    """``COPY`` names its columns once: a row with others must not be written shifted."""
    engine = get_engine(migrated_postgres_url)
    store = Store(engine)
    try:
        short = row("short")
        del short["claimed_by"]
        with pytest.raises(ValueError, match="every row of one insert"), store.session() as s:
            insert_many(s, QUEUE, [row("whole"), short])
        with store.session() as s:
            assert s.scalar(select(func.count()).select_from(QueueRow)) == 0
    finally:
        dispose_all()


def test_a_document_insert_reads_back_as_the_core_insert_writes_it(store: Store) -> None:
    """The tick's rows travel as one JSON document: JSON, odd text and offsets must survive it."""
    with store.session() as s:
        s.execute(insert(QUEUE), [row("by-core")])
        insert_document(Driver.of(s), QUEUE, [row("by-doc"), row("by-doc-2", args=None, kwargs={})])
    core, doc = read_back(store, "by-core"), read_back(store, "by-doc")
    assert doc[1:] == core[1:]
    assert doc[5] == datetime(2030, 1, 1, 0, 0, 5, tzinfo=UTC)
    assert read_back(store, "by-doc-2")[2:4] == ("null", "{}")  # JSON null, not SQL NULL


@pytest.mark.parametrize("bad", ["naive", "short"])
def test_a_document_insert_refuses_a_bad_row_and_writes_nothing(store: Store, bad: str) -> None:
    odd = row(bad, due_at=datetime(2030, 1, 1)) if bad == "naive" else row(bad)
    if bad == "short":
        del odd["claimed_by"]
    with (
        pytest.raises(ValueError, match="timezone-aware" if bad == "naive" else "every row of one insert"),
        store.session() as s,
    ):
        insert_document(Driver.of(s), QUEUE, [row("fine"), odd])
    with store.session() as s:
        assert s.scalar(select(func.count()).select_from(QueueRow)) == 0

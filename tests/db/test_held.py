"""Held schedule rows written back by column read back exactly as the ORM writes them.

``write_changed`` sends one ``UPDATE ... FROM`` a JSON document straight to the driver
(``json_to_recordset`` on PostgreSQL, ``json_each`` on SQLite; JSON columns as text, datetimes
as each dialect stores them) and ``hold`` reads rows through the driver too; both must agree
with the ORM to the SQL value: JSON ``null`` stays JSON ``null``, not SQL ``NULL``.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from helpers.clock import T0
from sqlalchemy import Engine, select, text

from celery_boundedbeat.config.entries import parse_entry
from celery_boundedbeat.db.driver import Sql
from celery_boundedbeat.db.engine import dispose_all, get_engine
from celery_boundedbeat.db.locked import DEFINITION, SCHEDULES, fill_definitions, hold, write_changed
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import ScheduleRow

ONE = Sql("name = %(name)s")
ONE_LOCKED = Sql("name = %(name)s FOR UPDATE", sqlite="name = %(name)s")
#: One value of every kind of column a held row writes back.
CHANGES: dict[str, Any] = {
    "timing": None,
    "pending": ["2030-01-01T00:00:05+00:00", "2030-01-01T00:00:10+00:00"],
    "policy": {"mode": "fixed_rate", "missed_ticks": "skip", "note": 'a,b"}'},
    "grid_at": datetime(2030, 1, 1, 2, 0, 5, tzinfo=timezone(timedelta(hours=2))),
    "failing_since": None,
    "period": 2.5,
    "paused": True,
    "runs": 7,
    "pause_reason": "paused: it said so",
    "stop_reason": None,
}
READ_BACK = (
    "SELECT timing IS NULL, CAST(timing AS text), CAST(pending AS text), CAST(policy AS text), "
    "grid_at, failing_since IS NULL, period, paused, runs, pause_reason, stop_reason "
    "FROM boundedbeat_schedules WHERE name = :name"
)


@pytest.fixture
def store(migrated: Engine) -> Store:
    store = Store(migrated)
    specs = []
    for name in ("by-orm", "by-held"):
        spec, problems = parse_entry(name, {"task": "proj.t", "schedule": 10}, {})
        assert spec is not None, problems
        specs.append(spec)
    store.sync_config(specs, T0, random.Random(1))
    with store.session() as s:  # a JSON value to replace by None
        for name in ("by-orm", "by-held"):
            row = s.get(ScheduleRow, name)
            assert row is not None
            row.timing = {"kind": "interval", "every": 10.0}
    return store


def read_back(engine: Engine, name: str) -> tuple[Any, ...]:
    with engine.connect() as conn:
        row = conn.execute(text(READ_BACK), {"name": name}).one()
    values = list(row)
    if isinstance(values[4], str):  # SQLite keeps naive UTC text
        values[4] = datetime.fromisoformat(values[4]).replace(tzinfo=UTC)
    values[4] = values[4].astimezone(UTC) if values[4].tzinfo else values[4].replace(tzinfo=UTC)
    return tuple(values)


def test_a_held_row_written_back_reads_back_as_the_same_row_written_by_the_orm(store: Store) -> None:
    """Every changed column of a held row lands as the ORM would have written it."""
    with store.session() as s:
        row = s.get(ScheduleRow, "by-orm")
        assert row is not None
        for column, value in CHANGES.items():
            setattr(row, column, value)
    with store.session() as s:
        held = hold(s, ONE_LOCKED, {"name": "by-held"}, leave_out=frozenset())
        target = held.get("by-held")
        assert target is not None
        for column, value in CHANGES.items():
            setattr(target, column, value)
        write_changed(s, held)
    assert read_back(store.engine, "by-held") == read_back(store.engine, "by-orm")
    assert not read_back(store.engine, "by-orm")[0], "JSON null, not SQL NULL"


def orm_values(s: Any, name: str, leave_out: frozenset[str]) -> dict[str, Any]:
    """Row ``name``'s columns but ``leave_out`` as SQLAlchemy reads them."""
    columns = [c for c in SCHEDULES.c if c.name not in leave_out]
    return dict(s.execute(select(*columns).where(SCHEDULES.c.name == name)).one()._mapping)


LEAVE_OUTS = (frozenset(), frozenset({"task", "args", "kwargs", "options", "timing"}))


def test_rows_held_through_the_driver_equal_rows_read_through_the_orm(store: Store) -> None:
    """``hold`` gives the same values as SQLAlchemy reads, on every dialect, datetimes aware UTC."""
    with store.session() as s:
        for leave_out in LEAVE_OUTS:
            raw = hold(s, ONE, {"name": "by-held"}, leave_out=leave_out)
            assert raw.loaded["by-held"] == orm_values(s, "by-held", leave_out)
            assert any(isinstance(v, datetime) for v in raw.loaded["by-held"].values())
            for value in raw.loaded["by-held"].values():
                if isinstance(value, datetime):
                    assert value.tzinfo == UTC


@pytest.mark.postgres
def test_rows_held_through_psycopg_are_utc_whatever_the_session_time_zone(migrated_postgres_url: str) -> None:
    """``hold`` gives the same values as the ORM, every datetime aware UTC, in any session zone."""
    engine = get_engine(migrated_postgres_url)
    try:
        store = Store(engine)
        spec, problems = parse_entry("s", {"task": "proj.t", "schedule": 10}, {})
        assert spec is not None, problems
        store.sync_config([spec], T0, random.Random(1))
        with store.session() as s:
            s.execute(text("SET LOCAL TIME ZONE 'Asia/Kolkata'"))  # psycopg then returns +05:30
            for leave_out in LEAVE_OUTS:
                raw = hold(s, ONE, {"name": "s"}, leave_out=leave_out)
                assert raw.loaded["s"] == orm_values(s, "s", leave_out)
                for value in raw.loaded["s"].values():
                    if isinstance(value, datetime):
                        assert value.tzinfo == UTC
    finally:
        dispose_all()


@pytest.mark.parametrize("fill", [True, False], ids=["filled-in-one-query", "fetched-on-first-read"])
def test_definitions_filled_in_one_query_equal_those_fetched_on_first_read(store: Store, fill: bool) -> None:
    """``fill_definitions`` gives a held row the same left-out columns as its lazy fetch does."""
    with store.session() as s:
        s.execute(
            text("UPDATE boundedbeat_schedules SET args = :a WHERE name = 'by-held'"), {"a": '[1, "x"]'}
        )
        whole = hold(s, ONE, {"name": "by-held"}, leave_out=frozenset()).loaded
        held = hold(s, Sql("name IN (%(a)s, %(b)s)"), {"a": "by-orm", "b": "by-held"})
        filled = fill_definitions(s, held, lambda row: row.name == "by-held") if fill else 0
        assert filled == (1 if fill else 0)
        row = held.get("by-held")
        assert row is not None
        values = {column: getattr(row, column) for column in DEFINITION}
    assert values == {column: whole["by-held"][column] for column in DEFINITION}
    assert values["args"] == [1, "x"] and values["created_at"].tzinfo == UTC
    assert "_fetch" not in vars(row) or vars(row)["_fetch"] is None


def test_a_tick_reads_no_left_out_column_row_by_row(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tick leaves the policy out of its select too; a schedule rebuilt from its row gets it
    from the one prefetch query, and a cached one never reads it (no query per row)."""
    from celery import Celery

    from celery_boundedbeat.config.definitions import Resolver, define
    from celery_boundedbeat.db.locked import Held

    app = Celery("held", broker="memory://", set_as_current=False)
    entry = {"task": "proj.t", "schedule": 10, "policy": {"mode": "fixed_rate", "max_concurrency": 3}}
    for i in range(3):
        assert store.add_schedule(define(f"rt-{i}", entry, app, {}), T0, random.Random(1))
    fetched: list[str] = []
    lazy = Held.__getattr__

    def recording(self: Held, name: str) -> Any:
        if not name.startswith("_") and self.__dict__.get("_fetch") is not None:
            fetched.append(name)
        return lazy(self, name)

    monkeypatch.setattr(Held, "__getattr__", recording)
    resolve = Resolver(app, {})
    first = store.tick(resolve, T0 + timedelta(seconds=1), random.Random(1), 100)
    second = store.tick(resolve, T0 + timedelta(seconds=11), random.Random(1), 100)
    emitted = {e.schedule for e in first.emitted} | {e.schedule for e in second.emitted}
    assert {"rt-0", "rt-1", "rt-2"} <= emitted
    assert len(second.emitted) >= 3, "every runtime schedule ticked again from its cached copy"
    assert fetched == []
    assert resolve(store_row(store, "rt-0")).policy.max_concurrency == 3


def store_row(store: Store, name: str) -> Any:
    with store.session() as s:
        return hold(s, ONE, {"name": name}, leave_out=frozenset()).get(name)


def test_a_datetime_parameter_compares_as_the_instant_it_is_in_any_offset(store: Store) -> None:
    """A driver statement's datetime parameter is bound as the column stores it (SQLite: UTC text)."""
    with store.session() as s:
        due = hold(s, ONE, {"name": "by-held"}).loaded["by-held"]["next_due_at"]
        kolkata = timezone(timedelta(hours=5, minutes=30))
        at_due = Sql("name = %(name)s AND next_due_at <= %(at)s")
        found = hold(s, at_due, {"name": "by-held", "at": due.astimezone(kolkata)})
        before = hold(
            s, at_due, {"name": "by-held", "at": (due - timedelta(microseconds=1)).astimezone(kolkata)}
        )
    assert list(found.loaded) == ["by-held"]
    assert list(before.loaded) == []

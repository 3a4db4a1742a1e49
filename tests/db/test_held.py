"""Held schedule rows written back by column read back exactly as the ORM writes them.

On PostgreSQL ``write_changed`` sends one ``UPDATE ... FROM json_to_recordset(...)`` straight
to psycopg (JSON columns as text cast per row, datetimes as UTC ISO text) and ``hold_pg``
reads rows the same way; both must agree with the ORM to the SQL value: JSON ``null`` stays
JSON ``null``, not SQL ``NULL``.
"""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from helpers.clock import T0
from sqlalchemy import Engine, text

from celery_boundedbeat.engine import dispose_all, get_engine
from celery_boundedbeat.entries import parse_entry
from celery_boundedbeat.held import (
    DEFINITION,
    SCHEDULES,
    fill_definitions,
    hold,
    hold_pg,
    light_select,
    write_changed,
)
from celery_boundedbeat.migrate import upgrade
from celery_boundedbeat.schema import ScheduleRow
from celery_boundedbeat.store import Store

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
        query = light_select(leave_out=frozenset()).where(SCHEDULES.c.name == "by-held").with_for_update()
        held = hold(s, query)
        target = held.get("by-held")
        assert target is not None
        for column, value in CHANGES.items():
            setattr(target, column, value)
        write_changed(s, held)
    assert read_back(store.engine, "by-held") == read_back(store.engine, "by-orm")
    assert not read_back(store.engine, "by-orm")[0], "JSON null, not SQL NULL"


@pytest.mark.postgres
def test_rows_held_through_psycopg_equal_rows_held_through_the_orm(postgres_url: str) -> None:
    """``hold_pg`` gives the same values as ``hold``, every datetime aware UTC."""
    engine = get_engine(postgres_url)
    upgrade(engine)
    try:
        store = Store(engine)
        spec, problems = parse_entry("s", {"task": "proj.t", "schedule": 10}, {})
        assert spec is not None, problems
        store.sync_config([spec], T0, random.Random(1))
        with store.session() as s:
            s.execute(text("SET LOCAL TIME ZONE 'Asia/Kolkata'"))  # psycopg then returns +05:30
            for leave_out in (frozenset(), frozenset({"task", "args", "kwargs", "options", "timing"})):
                orm = hold(s, light_select(leave_out=leave_out).where(SCHEDULES.c.name == "s"))
                raw = hold_pg(s, "name = %(name)s", {"name": "s"}, leave_out=leave_out)
                assert raw.loaded == orm.loaded
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
        whole = hold(s, light_select(leave_out=frozenset()).where(SCHEDULES.c.name.in_(["by-held"]))).loaded
        held = hold(s, light_select().where(SCHEDULES.c.name.in_(["by-orm", "by-held"])))
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

    from celery_boundedbeat.definitions import Resolver, define
    from celery_boundedbeat.held import Held

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
        return hold(s, light_select(leave_out=frozenset()).where(SCHEDULES.c.name == name)).get(name)

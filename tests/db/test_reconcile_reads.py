"""A reconcile reads the config rows and the names it is given, never the whole table.

The lease holder reconciles ``beat_schedule`` at every start. With a million runtime
schedules, reading every row for that took longer than PostgreSQL lets a transaction stay
idle, so the beat's start failed and retried (``bench/scale_bench.py --schedules 1000000``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from helpers.clock import T0, sec
from sqlalchemy import event, insert

from celery_boundedbeat.config.entries import parse_entry
from celery_boundedbeat.core.spec import Definition, EntrySpec
from celery_boundedbeat.db.definition_writes import fresh_values
from celery_boundedbeat.db.row_state import RUNTIME
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import ScheduleRow, new_incarnation

RNG = random.Random(3)
TENANTS = 3000


def spec(name: str) -> EntrySpec:
    built, problems = parse_entry(name, {"task": f"proj.{name}", "schedule": 60}, {})
    assert problems == [] and built is not None, problems
    return built


@pytest.mark.postgres
def test_a_reconcile_reads_the_config_rows_and_clashing_names_alone(pg_store: Store) -> None:
    store = pg_store
    template = fresh_values(Definition.of(spec("tenant")), T0, RNG, origin=RUNTIME, last_run_at=None)
    with store.session() as s:
        s.execute(
            insert(ScheduleRow),
            [{**template, "name": f"tenant-{i}", "incarnation": new_incarnation()} for i in range(TENANTS)],
        )
    store.sync_config([spec("a"), spec("b")], T0, RNG)
    fetched: list[int] = []

    def rows_read(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and "boundedbeat_schedules" in statement:
            fetched.append(cursor.rowcount)

    event.listen(store.engine, "after_cursor_execute", rows_read)
    try:
        report = store.sync_config([spec("a"), spec("c"), spec("tenant-7")], T0 + sec(1), RNG)
    finally:
        event.remove(store.engine, "after_cursor_execute", rows_read)
    # Still every decision: b removed, c added, a runtime schedule's name refused.
    assert (report.removed, report.added, report.clashes) == (["b"], ["c"], ["tenant-7"])
    assert fetched, "the reconcile read the schedules"
    assert sum(fetched) <= 5, f"{sum(fetched)} rows read to reconcile 3 entries among {TENANTS} schedules"

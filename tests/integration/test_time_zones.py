"""A crontab's ``timezone`` policy key under a real beat and worker (PostgreSQL + RabbitMQ, SQLite).

The app's own time zone is UTC; the entry keeps wall-clock time in Asia/Kathmandu (UTC+05:45),
so the minute of the hour it names in Kathmandu is 45 minutes away from the same minute in
UTC: a beat that ignored the key would run nothing within the test. The two fire times are
picked from the wall clock at the start, far enough ahead for the processes to come up.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from .apps import Raw
from .harness import Harness

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

KATHMANDU = ZoneInfo("Asia/Kathmandu")
#: A migrated beat starts within this (two busy cores); the first fire time is at least this far
#: from the moment its app module is written (the worker is already up by then).
START_UP = timedelta(seconds=20)
#: Most seconds from a fire time to its run's completion on a loaded machine.
PICKUP = 20.0


def status(bb: Harness) -> dict[str, dict[str, Any]]:
    rows = json.loads(bb.celery("boundedbeat", "status", "--json", check=True).stdout)
    return {row["name"]: row for row in rows}


def completed_at(bb: Harness, at: datetime) -> bool:
    return any(r.scheduled_for == at and r.state == "completed" for r in bb.runs("kathmandu"))


def test_a_crontab_runs_on_its_policy_zones_clock_and_keeps_it_across_a_beat_restart(bb: Harness) -> None:
    """Two minutes of the hour in Kathmandu time run at those instants, once each, one before and one
    after a beat restart; status shows the zone throughout."""
    # The worker and the migration come first, so the fire times need only the beat's margin.
    bb.write_app({})
    bb.start_worker()
    if bb.processes.migrates:
        bb.migrate()
    first = (datetime.now(UTC) + START_UP).replace(second=0, microsecond=0) + timedelta(minutes=1)
    second = first + timedelta(minutes=1)
    minutes = ",".join(str(t.astimezone(KATHMANDU).minute) for t in (first, second))
    cron = Raw(f"crontab(minute={minutes!r})")
    bb.write_app({"kathmandu": bb.entry("kathmandu", cron, policy={"timezone": "Asia/Kathmandu"})})
    beat = bb.start_beat(migrate=False)
    shown = status(bb)["kathmandu"]
    assert shown["timezone"] == "Asia/Kathmandu", shown
    assert datetime.fromisoformat(shown["next_due_at"]) == first, (shown, first)

    wait = (first - datetime.now(UTC)).total_seconds() + PICKUP
    bb.wait_until(lambda: completed_at(bb, first), timeout=wait, what=f"the run for {first:%H:%M} UTC")
    bb.stop(beat)
    bb.start_beat(migrate=False)
    assert status(bb)["kathmandu"]["timezone"] == "Asia/Kathmandu"

    wait = (second - datetime.now(UTC)).total_seconds() + PICKUP
    bb.wait_until(lambda: completed_at(bb, second), timeout=wait, what=f"the run for {second:%H:%M} UTC")
    runs = bb.runs("kathmandu")
    assert [r.scheduled_for for r in runs] == [first, second], [r.short() for r in runs]
    assert [r.scheduled_for.astimezone(KATHMANDU).minute for r in runs] == [
        int(m) for m in minutes.split(",")
    ]
    row = status(bb)["kathmandu"]
    assert (row["timezone"], row["runs"], row["skips"]) == ("Asia/Kathmandu", 2, 0), row
    bb.assert_no_errors()

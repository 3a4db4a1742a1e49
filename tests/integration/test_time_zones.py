"""A crontab's ``timezone`` policy key under a real beat and worker (PostgreSQL + RabbitMQ, SQLite).

The app's own time zone is UTC; the entry keeps wall-clock time in Asia/Kathmandu (UTC+05:45),
so the minute of the hour it names in Kathmandu is 45 minutes away from the same minute in
UTC: a beat that ignored the key would run nothing within the test. The two fire times are
picked from the wall clock at the start, far enough ahead for the processes to come up.

Both backends run side by side, each with its own database, broker, worker and beat, and
wait for the same two minute boundaries: a crontab cannot fire between minutes, so the
waiting (about two minutes) is the test's cost, and sharing it halves the cost of two tests.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from .apps import Raw
from .backends import BACKENDS, fresh_backend
from .harness import Harness, running_harness
from .processes import RECONCILED, Proc
from .waiting import wait_for_log

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

KATHMANDU = ZoneInfo("Asia/Kathmandu")
#: Both migrated beats start, and both statuses are read, within this (two busy cores); the first
#: fire time is at least this far from the moment the app modules are written (the workers are
#: already up by then).
START_UP = timedelta(seconds=30)
#: Most seconds from a fire time to its run's completion on a loaded machine.
PICKUP = 20.0


@pytest.fixture
def harnesses(tmp_path: Path) -> Iterator[list[Harness]]:
    """One harness per backend, each on its own database and broker; all killed at teardown."""
    with contextlib.ExitStack() as stack:
        created = []
        for name in BACKENDS:
            tmp = tmp_path / name
            tmp.mkdir()
            backend = stack.enter_context(fresh_backend(name, tmp))
            created.append(stack.enter_context(running_harness(backend, tmp)))
        yield created


def status(bb: Harness) -> dict[str, dict[str, Any]]:
    rows = json.loads(bb.celery("boundedbeat", "status", "--json", check=True).stdout)
    return {row["name"]: row for row in rows}


def completed_at(bb: Harness, at: datetime) -> bool:
    return any(r.scheduled_for == at and r.state == "completed" for r in bb.runs("kathmandu"))


def start_beats(harnesses: list[Harness]) -> list[Proc]:
    """Start every harness's beat at once (their start-ups overlap), wait until each reconciled."""
    beats = [bb.start_beat(migrate=False, wait_lease=False) for bb in harnesses]
    for beat in beats:
        wait_for_log(beat, "holds the beat lease", timeout=40)
        wait_for_log(beat, RECONCILED, timeout=30)
    return beats


def wait_completed(harnesses: list[Harness], at: datetime) -> None:
    for bb in harnesses:
        wait = (at - datetime.now(UTC)).total_seconds() + PICKUP
        what = f"the {bb.backend.name} run for {at:%H:%M} UTC"
        bb.wait_until(lambda bb=bb: completed_at(bb, at), timeout=wait, what=what)


def test_a_crontab_runs_on_its_policy_zones_clock_and_keeps_it_across_a_beat_restart(
    harnesses: list[Harness],
) -> None:
    """On each backend, two minutes of the hour in Kathmandu time run at those instants, once each,
    one before and one after a beat restart; status shows the zone throughout."""
    # The workers and the migration come first, so the fire times need only the beats' margin.
    for bb in harnesses:
        bb.write_app({})
        bb.start_worker()
        if bb.processes.migrates:
            bb.migrate()
    first = (datetime.now(UTC) + START_UP).replace(second=0, microsecond=0) + timedelta(minutes=1)
    second = first + timedelta(minutes=1)
    minutes = ",".join(str(t.astimezone(KATHMANDU).minute) for t in (first, second))
    cron = Raw(f"crontab(minute={minutes!r})")
    for bb in harnesses:
        bb.write_app({"kathmandu": bb.entry("kathmandu", cron, policy={"timezone": "Asia/Kathmandu"})})
    beats = start_beats(harnesses)
    for bb in harnesses:
        shown = status(bb)["kathmandu"]
        assert shown["timezone"] == "Asia/Kathmandu", (bb.backend.name, shown)
        assert datetime.fromisoformat(shown["next_due_at"]) == first, (bb.backend.name, shown, first)

    wait_completed(harnesses, first)
    for bb, beat in zip(harnesses, beats, strict=True):
        bb.stop(beat)
    start_beats(harnesses)
    for bb in harnesses:
        assert status(bb)["kathmandu"]["timezone"] == "Asia/Kathmandu", bb.backend.name

    wait_completed(harnesses, second)
    for bb in harnesses:
        runs = bb.runs("kathmandu")
        shown_runs = (bb.backend.name, [r.short() for r in runs])
        assert [r.scheduled_for for r in runs] == [first, second], shown_runs
        assert [r.scheduled_for.astimezone(KATHMANDU).minute for r in runs] == [
            int(m) for m in minutes.split(",")
        ]
        row = status(bb)["kathmandu"]
        assert (row["timezone"], row["runs"], row["skips"]) == ("Asia/Kathmandu", 2, 0), row
        bb.assert_no_errors()

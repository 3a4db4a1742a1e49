"""A schedule removed and added again while its run goes on, with a real beat and worker.

The name is removed (``remove_schedule`` without ``revoke_active``: its run goes on) and
added again at once, several times in a row, each time while the previous schedule's run is
still working. Each schedule of the name is its own: its runs never overlap (``max_concurrency``
1), the last one's counters equal its own runs exactly, and ``stop_schedule()`` in a removed
schedule's run does not stop the schedule that came after it. Every run stays in the history
with the incarnation that emitted it. The same holds for a ``beat_schedule`` entry dropped by
one beat start and restored by the next while its run works (a rolled-back deploy).

The add and remove calls are the Python API in this process (milliseconds apart, so the old
run is certainly still working); the beat picks them up by NOTIFY (PostgreSQL) or by polling
(SQLite, every 0.25 s).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
from celery import Celery

from celery_boundedbeat import add_schedule, remove_schedule, snapshot

from .harness import Harness
from .reads import max_concurrent

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

NAME = "flip"
#: Schedules of the name, one after the other.
ROUNDS = 4
#: How long each run works: far longer than a remove and an add, so every old run is still
#: working when the next schedule of the name starts its first run.
WORK = 4.0


def api_app(bb: Harness) -> Celery:
    app = Celery("incarnations_api", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = bb.backend.database_url
    return app


def runs(bb: Harness) -> list[dict[str, Any]]:
    return bb.sql(
        "SELECT id, incarnation, state, enqueued_at, started_at, finished_at FROM boundedbeat_runs "
        "WHERE schedule = :name ORDER BY enqueued_at",
        name=NAME,
    )


def of(found: list[dict[str, Any]], incarnation: str) -> list[dict[str, Any]]:
    return [r for r in found if r["incarnation"] == incarnation]


def row(bb: Harness) -> dict[str, Any]:
    (found,) = bb.sql(
        'SELECT incarnation, active_runs, runs, failures, "overlaps" AS overlaps, stopped, stop_reason, '
        "paused FROM boundedbeat_schedules WHERE name = :name",
        name=NAME,
    )
    return found


def not_stopped(bb: Harness) -> None:
    """The last schedule is never stopped: only the earlier ones' runs call ``stop_schedule()``."""
    books = row(bb)
    assert not books["stopped"], f"stopped by a removed schedule's run: {books}\n{shown(runs(bb))}"


def shown(found: list[dict[str, Any]]) -> str:
    def t(v: datetime | None) -> str:
        return "-" if v is None else v.strftime("%H:%M:%S.%f")[:-3]

    return "\n".join(
        f"{r['incarnation'][:8] if r['incarnation'] else None} {r['state']:<9} enq={t(r['enqueued_at'])} "
        f"start={t(r['started_at'])} fin={t(r['finished_at'])}"
        for r in found
    )


def test_a_name_removed_and_added_again_while_its_runs_work_is_a_new_schedule_each_time(
    bb: Harness,
) -> None:
    """Removed and re-added ROUNDS times while runs are active: each schedule of the name has at
    most one run at a time, the last one's books hold exactly its own runs, and the earlier
    schedules' ``stop_schedule()`` calls (each one's first run makes one) stop nothing after them."""
    bb.write_app({})
    bb.start(concurrency=ROUNDS + 2)
    app = api_app(bb)
    incarnations: list[str] = []
    added_at: list[datetime] = []
    for i in range(ROUNDS):
        last = i == ROUNDS - 1
        # Each schedule records its task under a name of its own; all but the last stop
        # their schedule from their first run (``stop_on=1``).
        kwargs: dict[str, Any] = {"name": f"{NAME}-{i}", "durations": [WORK]}
        if not last:
            kwargs["stop_on"] = 1
        assert add_schedule(app, NAME, f"{bb.module}.work", 0.5, kwargs=kwargs) == "scheduled"
        (current,) = snapshot(app, [NAME])
        assert current.incarnation is not None and current.incarnation not in incarnations
        incarnations.append(current.incarnation)
        added_at.append(current.updated_at)
        bb.wait_until(
            lambda: any(r["started_at"] for r in of(runs(bb), incarnations[-1])),
            timeout=30,
            what=f"the first run of schedule {i} of the name started",
        )
        if not last:
            assert remove_schedule(app, NAME) is True

    check_books(bb, incarnations, added_at)


def check_books(bb: Harness, incarnations: list[str], added_at: list[datetime]) -> None:
    """Let the earlier schedules' runs end while the last schedule runs, pause it, and check
    that each schedule kept to its one slot and the last one's books hold its own runs only."""
    # Every earlier schedule's run ends (calling stop_schedule) while the last one ticks.
    bb.wait_until(
        lambda: all(r["finished_at"] for r in runs(bb) if r["incarnation"] != incarnations[-1]),
        timeout=60,
        what="the removed schedules' runs settled",
    )
    bb.wait_until(
        lambda: len([r for r in of(runs(bb), incarnations[-1]) if r["state"] == "completed"]) >= 2,
        timeout=60,
        what="two completed runs of the last schedule",
        each=lambda: not_stopped(bb),
    )
    bb.celery("boundedbeat", "pause", NAME)
    bb.wait_until(lambda: all(r["finished_at"] for r in runs(bb)), timeout=60, what="every run settled")

    found = runs(bb)
    books = row(bb)
    own = of(found, incarnations[-1])
    # The removed schedules' runs ended while the next ones were there (the case under test).
    for i, incarnation in enumerate(incarnations[:-1]):
        (first, *_) = of(found, incarnation)
        assert first["finished_at"] > added_at[i + 1], (
            f"schedule {i}'s run ended before the next add\n{shown(found)}"
        )
    for incarnation in incarnations:
        spans = [
            (r["started_at"].timestamp(), r["finished_at"].timestamp())
            for r in of(found, incarnation)
            if r["started_at"]
        ]
        assert max_concurrent(spans) == 1, f"two runs of one schedule at once\n{shown(found)}"
    completed = [r for r in own if r["state"] == "completed"]
    assert (books["incarnation"], books["stopped"], books["stop_reason"]) == (
        incarnations[-1],
        False,
        None,
    ), f"{books}\n{shown(found)}"
    assert (books["active_runs"], books["runs"], books["failures"], books["overlaps"]) == (
        0,
        len(completed),
        0,
        0,
    ), f"{books}\n{shown(found)}"
    assert len(completed) == len(own), shown(found)
    # Every run stays in the history with the schedule that emitted it.
    assert {r["incarnation"] for r in found} == set(incarnations), shown(found)
    assert all(r["state"] == "completed" for r in found), shown(found)


#: How long the run of the configured entry works: past two beat restarts on two busy cores.
SURVIVES_RESTARTS = 30.0


def test_a_config_entry_removed_and_restored_across_beat_starts_is_a_new_schedule(bb: Harness) -> None:
    """A rolled-back deploy: one beat start drops a ``beat_schedule`` entry while its run works,
    the next start restores it. The restored entry is a new schedule: the first one's run,
    which calls ``stop_schedule()`` at its end, neither stops it nor frees its slot."""
    bb.write_app({NAME: bb.entry(f"{NAME}-0", 0.5, durations=[SURVIVES_RESTARTS], stop_on=1)})
    _worker, beat = bb.start(concurrency=4)
    incarnations = [row(bb)["incarnation"]]
    added_at = [
        bb.sql("SELECT created_at FROM boundedbeat_schedules WHERE name = :n", n=NAME)[0]["created_at"]
    ]
    bb.wait_until(
        lambda: any(r["started_at"] for r in of(runs(bb), incarnations[0])),
        timeout=30,
        what="the configured entry's first run started",
    )
    for config in ({}, {NAME: bb.entry(f"{NAME}-1", 0.5, durations=[WORK])}):
        assert bb.stop(beat) == 0, beat.tail()
        bb.write_app(config)
        beat = bb.start_beat(migrate=False)
        found = bb.sql("SELECT incarnation, created_at FROM boundedbeat_schedules WHERE name = :n", n=NAME)
        assert len(found) == len(config), found
    (restored,) = found
    assert restored["incarnation"] not in incarnations
    incarnations.append(restored["incarnation"])
    added_at.append(restored["created_at"])
    check_books(bb, incarnations, added_at)

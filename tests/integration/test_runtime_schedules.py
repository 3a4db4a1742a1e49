"""Schedules added, changed and removed at runtime, from another process, while a real beat runs.

Each change goes through ``celery -A <app> boundedbeat add|update|remove`` in a subprocess
(another process than the beat), on PostgreSQL + RabbitMQ (the beat is woken by NOTIFY) and on
SQLite + the filesystem transport (the beat looks every ``boundedbeat_poll_interval``, 0.25 s
in the generated app). The beat is never restarted unless a test says so. Times are bracketed
by the wall clock before and after each command; bounds on latency are generous for two busy
cores (3 s) yet far below what a change picked up only at a restart would take.
"""

from __future__ import annotations

import json
import os
import subprocess
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from .harness import Harness
from .reads import ACTIVE_STATES, Run, epoch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

#: Most seconds from a run's grid time to its acceptance by the broker on a loaded machine.
PICKUP = 3.0
#: Grid times are exact to the microsecond; 5 ms absorbs float seconds in the comparison.
TOLERANCE = 0.005


def now() -> datetime:
    return datetime.now(UTC)


def work_kwargs(name: str, seconds: float = 0.05) -> str:
    return json.dumps({"name": name, "durations": [seconds]})


def boundedbeat(bb: Harness, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """One ``celery boundedbeat ...`` command in its own process."""
    return bb.celery("boundedbeat", *args, check=check)


def add(bb: Harness, name: str, *options: str, seconds: float = 0.05) -> str:
    out = boundedbeat(bb, "add", name, f"{bb.module}.work", "--kwargs", work_kwargs(name, seconds), *options)
    return out.stdout.strip()


def status(bb: Harness) -> dict[str, dict[str, Any]]:
    rows = json.loads(boundedbeat(bb, "status", "--json").stdout)
    return {row["name"]: row for row in rows}


def definition(bb: Harness, name: str) -> dict[str, Any]:
    """The columns that hold a schedule's definition (not its counters, which move while it runs)."""
    rows = bb.sql(
        "SELECT origin, task, mode, schedule, period, args, kwargs, options, policy, timing, "
        "config_hash, version, created_at FROM boundedbeat_schedules WHERE name = :name",
        name=name,
    )
    assert len(rows) == 1, f"no schedule row {name!r}: {rows}"
    row = rows[0]
    for key in ("args", "kwargs", "options", "policy", "timing"):
        if isinstance(row[key], str):  # SQLite gives JSON as text
            row[key] = json.loads(row[key])
    return row


def on_lattice(run: Run, origin: datetime, period: float) -> bool:
    offset = (epoch(run.scheduled_for) - epoch(origin)) / period
    return abs(offset - round(offset)) * period < TOLERANCE


def shown(runs: list[Run]) -> str:
    return "\n".join(r.short() for r in runs)


def test_a_schedule_added_while_beat_runs_starts_on_time_and_a_new_period_applies_at_once(
    bb: Harness,
) -> None:
    """An added schedule runs at its due time, a duplicate add changes nothing, and --every applies live.

    The period change, precisely: with ``u0``/``u1`` the wall clock before and after ``update
    live --every 3``, every run before ``t_c`` is on the old 1 s grid and every run from ``t_c``
    on is on one 3 s grid ``t_c, t_c + 3, ...`` with ``u0 <= t_c <= u1``; no run emitted after
    ``u1`` is scheduled before ``u0`` (no retroactive tick), no old-grid tick follows the
    change, and the first new run is published within ``PICKUP`` of its grid time by the same
    beat process. The tick at ``t_c`` itself may find the last old run still active and be
    skipped (counted in ``skips``).
    """
    bb.write_app({})
    _worker, beat = bb.start(concurrency=2)
    pid = beat.popen.pid

    a0 = now()
    assert add(bb, "live", "--every", "1") == "scheduled"
    a1 = now()
    bb.wait_until(
        lambda: bb.runs("live") and bb.runs("live")[0].published_at,
        timeout=20,
        what="the first run published",
    )
    first = bb.runs("live")[0]
    assert a0 <= first.scheduled_for <= a1, f"the first tick is at the add: {a0} .. {a1}\n{first.short()}"
    assert first.published_at is not None
    lag = (first.published_at - first.scheduled_for).total_seconds()
    assert lag <= PICKUP, f"the added schedule was published {lag:.2f} s after its due time\n{first.short()}"

    before = definition(bb, "live")
    assert (before["origin"], before["version"], before["timing"]) == (
        "runtime",
        1,
        {"kind": "interval", "every": 1.0},
    )
    assert add(bb, "live", "--every", "5", "--policy", '{"max_runs": 1}', seconds=9) == "already_present"
    assert definition(bb, "live") == before

    bb.wait_until(lambda: len(bb.finished("live")) >= 3, timeout=20, what="3 completed runs on the 1 s grid")
    u0 = now()
    out = boundedbeat(bb, "update", "live", "--every", "3")
    u1 = now()
    assert out.stdout.strip() == "live: updated", out.stdout
    bb.wait_until(
        lambda: len([r for r in bb.finished("live") if r.scheduled_for > u1]) >= 3,
        timeout=25,
        what="three completed runs scheduled after the change",
    )

    runs = bb.runs("live")
    detail = f"update between {u0} and {u1}\n{shown(runs)}"
    # The newest run is on the new grid; that grid's origin is the one of its points in [u0, u1].
    newest = runs[-1].scheduled_for
    origins = [newest - timedelta(seconds=3 * j) for j in range(20)]
    starts = [t for t in origins if u0 - timedelta(seconds=TOLERANCE) <= t <= u1]
    assert len(starts) == 1, f"the new 3 s grid does not start at the change\n{detail}"
    (t_c,) = starts
    new = [r for r in runs if r.scheduled_for >= t_c]
    old = [r for r in runs if r.scheduled_for < t_c]
    assert all(on_lattice(r, t_c, 3.0) for r in new), f"a run off the new grid after the change\n{detail}"
    assert all(on_lattice(r, first.scheduled_for, 1.0) for r in old), f"a run off the old grid\n{detail}"
    assert len(new) >= 3 and len(old) >= 3 and old[0].id == first.id, detail
    # What was emitted once the change had surely committed belongs to no time before the change.
    late = [r for r in runs if r.enqueued_at > u1 and r.scheduled_for < u0]
    assert late == [], f"retroactive ticks emitted after the change:\n{shown(late)}\n{detail}"
    # The change's own tick may find the last old run still active and be skipped: count it.
    missed = round((epoch(new[0].scheduled_for) - epoch(t_c)) / 3.0)
    assert missed <= 1 and status(bb)["live"]["skips"] >= missed, detail
    assert new[0].published_at is not None
    assert (new[0].published_at - new[0].scheduled_for).total_seconds() <= PICKUP, detail
    after = definition(bb, "live")
    assert (after["version"], after["period"], after["timing"]) == (
        2,
        3.0,
        {"kind": "interval", "every": 3.0},
    )
    assert beat.alive and beat.popen.pid == pid, "the beat restarted"
    bb.assert_no_errors()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_remove_with_revoke_active_terminates_the_running_task_and_settles_it_revoked(bb: Harness) -> None:
    """remove --revoke-active settles a running 60 s run revoked at once and kills the prefork child.

    The prefork pool is used because it can terminate a running task (threads and solo cannot:
    there the run still settles revoked, and the task runs on to its end).
    """
    bb.write_app({})
    bb.start(pool="prefork", concurrency=2)
    assert add(bb, "long", "--every", "600", seconds=60) == "scheduled"
    running = bb.wait_until(
        lambda: [iv for iv in bb.intervals("long") if iv.end is None],
        timeout=20,
        what="the long task running",
    )
    (task,) = running
    bb.wait_until(lambda: bb.runs("long")[0].state == "started", timeout=10, what="the run marked started")
    r0 = now()
    out = boundedbeat(bb, "remove", "long", "--revoke-active")
    r1 = now()
    assert out.stdout.strip() == "long: removed, 1 run revoked", out.stdout
    (run,) = bb.runs("long")
    assert (run.id, run.state) == (task.id, "revoked"), run.short()
    assert run.error is not None and "removed" in run.error, run.short()
    assert run.finished_at is not None and r0 <= run.finished_at <= r1, run.short()
    assert bb.sql("SELECT name FROM boundedbeat_schedules") == []
    bb.wait_until(
        lambda: not pid_alive(task.pid), timeout=15, what=f"the child {task.pid} running the task to end"
    )
    # Killed by SIGTERM (its ``finally`` may still record an end): long before its 60 s.
    (ended,) = bb.intervals("long")
    assert ended.end is None or ended.end - ended.start < 30, f"the task ran on instead of ending: {ended}"
    # The worker's own report of the terminated task comes later and changes nothing.
    bb.wait_until(
        lambda: any(f"run {run.id} was already settled" in p.output() for p in bb.procs),
        timeout=15,
        what="the worker's report of the terminated run",
    )
    history = json.loads(boundedbeat(bb, "history", "long", "--json").stdout)
    assert [(h["id"], h["state"], h["error"]) for h in history] == [(run.id, "revoked", run.error)]
    assert bb.runs("long") == [run]


def test_max_runs_and_end_at_end_a_runtime_schedule_with_a_reason(bb: Harness) -> None:
    """max_runs 2 ends a schedule after exactly 2 runs, end_at one with no run past it; resume refuses."""
    bb.write_app({})
    bb.start(concurrency=2)
    assert add(bb, "two", "--every", "1", "--policy", '{"max_runs": 2}') == "scheduled"
    a0 = now()
    end_at = a0 + timedelta(seconds=5)
    assert (
        add(bb, "ending", "--every", "1", "--policy", json.dumps({"end_at": end_at.isoformat()}))
        == "scheduled"
    )

    def ended() -> dict[str, dict[str, Any]] | None:
        rows = status(bb)
        return rows if all(rows[name]["stopped"] for name in ("two", "ending")) else None

    rows = bb.wait_until(ended, timeout=30, what="both schedules stopped", interval=0.5)
    assert (rows["two"]["stop_reason"], rows["ending"]["stop_reason"]) == ("max_runs", "end_at"), rows
    two, ending = bb.runs("two"), bb.runs("ending")
    assert [r.state for r in two] == ["completed", "completed"], shown(two)
    assert rows["two"]["runs"] == 2 and rows["two"]["active_runs"] == 0, rows["two"]
    assert all(r.scheduled_for <= end_at for r in ending), f"a run after end_at {end_at}\n{shown(ending)}"
    # Every grid tick from the add to end_at ran or was skipped (a late beat), none after it.
    start = ending[0].scheduled_for
    assert a0 <= start, shown(ending)
    ticks = int((epoch(end_at) - epoch(start)) // 1.0) + 1
    assert len(ending) + rows["ending"]["skips"] == ticks, (ticks, rows["ending"], shown(ending))
    assert all(on_lattice(r, start, 1.0) for r in ending), shown(ending)

    for name, reason in (("two", "max_runs"), ("ending", "end_at")):
        refused = boundedbeat(bb, "resume", name, check=False)
        assert refused.returncode == 1 and reason in refused.stderr, (refused.stdout, refused.stderr)

    def nothing_more() -> None:
        assert (len(bb.runs("two")), len(bb.runs("ending"))) == (2, len(ending)), shown(bb.runs())

    bb.watch(1.5, nothing_more)

    out = boundedbeat(bb, "update", "two", "--policy", '{"max_runs": 3}')
    assert out.stdout.strip() == "two: updated", out.stdout
    bb.wait_until(
        lambda: status(bb)["two"]["stopped"] and len(bb.finished("two")) == 3,
        timeout=20,
        what="a third run, then stopped again",
        interval=0.5,
    )
    final = status(bb)["two"]
    assert (final["stop_reason"], final["runs"], len(bb.runs("two"))) == ("max_runs", 3, 3), final
    bb.assert_no_errors()


def test_a_restarted_beat_whose_config_lacks_a_runtime_schedule_leaves_it_running(bb: Harness) -> None:
    """A beat restarted with a config lacking the runtime schedule (one entry clashing) leaves it running."""
    bb.write_app({"cfg": bb.entry("cfg", 1.0, durations=[0.05])})
    _worker, beat = bb.start(concurrency=2)
    assert add(bb, "rt", "--every", "1") == "scheduled"
    bb.wait_until(
        lambda: len(bb.finished("rt")) >= 2, timeout=20, what="2 completed runs of the runtime schedule"
    )
    before = definition(bb, "rt")
    assert bb.stop(beat) == 0, beat.tail()
    bb.wait_until(lambda: not any(r.state in ACTIVE_STATES for r in bb.runs()), timeout=15, what="quiet")

    # The new config drops "cfg", adds "cfg2" and has an entry of the runtime schedule's name.
    bb.write_app(
        {
            "cfg2": bb.entry("cfg2", 1.0, durations=[0.05]),
            "rt": bb.entry("rt-config", 5.0, durations=[0.05]),
        }
    )
    restarted_at = now()
    beat = bb.start_beat(migrate=False)
    bb.wait_until(
        lambda: len([r for r in bb.finished("rt") if r.scheduled_for > restarted_at]) >= 2,
        timeout=25,
        what="2 runs of the runtime schedule after the restart",
    )
    assert definition(bb, "rt") == before
    names = {row["name"]: row["origin"] for row in bb.sql("SELECT name, origin FROM boundedbeat_schedules")}
    assert names == {"cfg2": "config", "rt": "runtime"}, names
    after = [r for r in bb.runs("rt") if r.scheduled_for > restarted_at]
    assert all(on_lattice(r, bb.runs("rt")[0].scheduled_for, 1.0) for r in after), shown(after)
    assert not [iv for iv in bb.intervals("rt-config")], "the clashing config entry ran"
    clash = [line for line in beat.output().splitlines() if "runtime schedule of the same name" in line]
    assert clash and "rt" in clash[0], beat.tail()
    bb.assert_no_errors()

"""missed_ticks "replace" under a real beat and a real prefork worker on PostgreSQL and RabbitMQ."""

from __future__ import annotations

import os

import pytest

from celery_boundedbeat.store import REPLACED

from .harness import Harness
from .reads import ACTIVE_STATES

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("backend", ["pg-rabbitmq"], indirect=True)
def test_replace_terminates_the_old_run_and_starts_the_new_one_within_the_bound(bb: Harness) -> None:
    """A 30 s task on a 3 s grid: each tick settles the running run revoked, the prefork child is
    terminated long before its 30 s, the new run starts, and never two runs are active at once."""
    policy = {"mode": "fixed_rate_no_overlap", "missed_ticks": "replace"}
    bb.write_app({"rep": bb.entry("rep", 3.0, policy=policy, durations=[30])})
    bb.start(pool="prefork", concurrency=4)

    def one_active_at_most() -> None:
        active = [r for r in bb.runs("rep") if r.state in ACTIVE_STATES]
        assert len(active) <= 1, "two runs active:\n" + "\n".join(r.short() for r in active)

    bb.wait_until(
        lambda: len([r for r in bb.runs("rep") if r.state == "revoked" and r.started_at]) >= 2,
        timeout=60,
        what="two started runs of 'rep' replaced",
        each=one_active_at_most,
    )
    runs = sorted(bb.runs("rep"), key=lambda r: r.scheduled_for)
    revoked = [r for r in runs if r.state == "revoked"]
    assert all(r.error == REPLACED for r in revoked), [r.short() for r in revoked]
    # Each replaced run was settled by the tick of the next grid time, which emitted its successor.
    for run in revoked:
        successor = next(r for r in runs if r.scheduled_for > run.scheduled_for)
        assert run.finished_at is not None and successor.scheduled_for <= run.finished_at, run.short()
        assert (successor.scheduled_for - run.scheduled_for).total_seconds() == pytest.approx(3.0, abs=0.01)
    # A run that replaced another started at a worker (and was replaced in its turn).
    assert any(r.started_at for r in revoked[1:]), [r.short() for r in revoked]
    # The worker was told: the replaced tasks' prefork children die long before their 30 s.
    started = {iv.id: iv for iv in bb.intervals("rep")}
    killed = [started[r.id] for r in revoked if r.id in started]
    assert killed, "no replaced run reached the worker"
    for task in killed:
        bb.wait_until(lambda t=task: not pid_alive(t.pid), timeout=20, what=f"child {task.pid} terminated")
    for task in killed:
        ended = next(iv for iv in bb.intervals("rep") if iv.id == task.id)
        assert ended.end is None or ended.end - ended.start < 20, f"the task ran on: {ended}"
    # The counters agree with the history (one statement: one snapshot while beat goes on).
    (books,) = bb.sql(
        "SELECT replaced, active_runs, skips, "
        "(SELECT count(*) FROM boundedbeat_runs WHERE schedule = 'rep' AND state = 'revoked') AS revoked, "
        "(SELECT count(*) FROM boundedbeat_runs WHERE schedule = 'rep' "
        "AND state IN ('queued', 'published', 'started')) AS active "
        "FROM boundedbeat_schedules WHERE name = 'rep'"
    )
    assert books["replaced"] == books["revoked"] >= 2, books
    assert books["active_runs"] == books["active"] == 1, books
    assert books["skips"] == 0, books
    bb.assert_no_errors()

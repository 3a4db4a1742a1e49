"""missed_ticks "replace" under a real beat and a real prefork worker on PostgreSQL and RabbitMQ."""

from __future__ import annotations

import os

import pytest

from celery_boundedbeat.db.tick import REPLACED

from .harness import Harness
from .reads import ACTIVE_STATES, epoch

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


@pytest.mark.parametrize("backend", ["pg-rabbitmq"], indirect=True)
def test_replace_in_a_threads_pool_lets_the_old_task_finish_and_ignores_its_outcome(bb: Harness) -> None:
    """threads cannot terminate: a replaced 4 s task runs to its end, yet its run stays revoked
    (settled once, by the tick), its completion is not counted, and one run at most is active."""
    policy = {"missed_ticks": "replace"}
    bb.write_app({"thr": bb.entry("thr", 1.5, policy=policy, durations=[4])})
    bb.start(pool="threads", concurrency=4)

    def one_active_at_most() -> None:
        active = [r for r in bb.runs("thr") if r.state in ACTIVE_STATES]
        assert len(active) <= 1, "two runs active:\n" + "\n".join(r.short() for r in active)

    def replaced_and_ended() -> list[str]:
        revoked = {r.id for r in bb.runs("thr") if r.state == "revoked"}
        return [iv.id for iv in bb.intervals("thr") if iv.id in revoked and iv.end is not None]

    ended = bb.wait_until(
        lambda: len(replaced_and_ended()) >= 2 and replaced_and_ended(),
        timeout=60,
        what="two replaced tasks of 'thr' run to their end",
        each=one_active_at_most,
    )
    tasks = {iv.id: iv for iv in bb.intervals("thr")}
    runs = {r.id: r for r in bb.runs("thr")}
    for run_id in ended:
        task, run = tasks[run_id], runs[run_id]
        assert task.end is not None and task.end - task.start >= 3.9, f"not run to its end: {task}"
        assert (run.state, run.error) == ("revoked", REPLACED), run.short()
        # Settled by the tick that replaced it, long before the task's own end.
        assert run.finished_at is not None and epoch(run.finished_at) < task.end - 1, (run.short(), task)
    bb.wait_until(
        lambda: all(any(f"run {i} was already settled" in p.output() for p in bb.procs) for i in ended),
        timeout=15,
        what="the worker's ignored reports of the replaced runs",
    )
    (books,) = bb.sql(
        "SELECT runs, replaced, active_runs, "
        "(SELECT count(*) FROM boundedbeat_runs WHERE schedule = 'thr' AND state = 'completed') AS done, "
        "(SELECT count(*) FROM boundedbeat_runs WHERE schedule = 'thr' AND state = 'revoked') AS revoked "
        "FROM boundedbeat_schedules WHERE name = 'thr'"
    )
    assert (books["runs"], books["done"]) == (0, 0), books
    assert books["replaced"] == books["revoked"] >= 2, books
    assert books["active_runs"] == 1, books
    # Celery's own answer to revoke(terminate=True) in a pool that cannot terminate (docs/policies.md).
    bb.assert_no_errors("does not implement kill_job", "Traceback (most recent call last)")

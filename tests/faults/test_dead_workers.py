"""Dead workers: a prefork child or a whole worker killed with SIGKILL mid-run."""

from __future__ import annotations

import os
import signal
import time

import pytest
from integration.harness import Harness
from integration.reads import ACTIVE_STATES

from .conftest import Measure
from .support import check_books, doubled, executions, kill9, run, started_run, stuck, task_entry, write_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

#: The default heartbeat interval: a dead worker's run must be settled within 3 1/3 of them
#: (10 s); the margin covers two slow shared cores.
HEARTBEAT = 3.0
DETECTION_BOUND = 10.0
SLACK = 3.0


def never_two_active(bb: Harness, name: str):
    def check() -> None:
        active = [r for r in bb.runs(name) if r.state in ACTIVE_STATES]
        assert len(active) <= 1, "two active runs:\n" + "\n".join(r.short() for r in active)

    return check


def test_prefork_child_killed_mid_run_is_lost_and_frees_its_slot(bb: Harness, measure: Measure) -> None:
    """A prefork child killed by SIGKILL mid-run settles lost within the bound; the schedule goes on."""
    write_app(bb, {"victim": bb.entry("victim", 1.0, durations=[30, 0.3])})
    worker, _beat = bb.start(pool="prefork", concurrency=2)
    first = bb.wait_until(lambda: started_run(bb, "victim"), 30, "the first run to start")
    child = bb.wait_until(
        lambda: next((iv.pid for iv in bb.intervals("victim") if iv.id == first.id), None), 10, "its pid"
    )
    assert child != worker.popen.pid
    killed_at = time.time()
    os.kill(child, signal.SIGKILL)

    lost = bb.wait_until(
        lambda: (r := run(bb, first.id)) is not None and r.state == "lost" and r,
        DETECTION_BOUND + SLACK,
        "the killed run to settle lost",
        each=never_two_active(bb, "victim"),
    )
    assert lost.finished_at is not None
    detection = lost.finished_at.timestamp() - killed_at
    assert "WorkerLostError" in (lost.error or "") or "heartbeat" in (lost.error or ""), lost.error
    bb.wait_until(
        lambda: len(bb.finished("victim")) >= 3, 30, "three later runs", each=never_two_active(bb, "victim")
    )
    assert worker.alive, "the worker itself survives a dead child"
    states = check_books(bb, "victim")
    assert states.get("lost") == 1 and states.get("failed", 0) == 0, states
    twice = doubled(bb, "victim")
    assert twice == []
    measure("lost-run detection (prefork child SIGKILL)", detection, " s")
    measure("settled by", "pool WorkerLostError" if "WorkerLostError" in (lost.error or "") else "reaper")
    measure("runs lost / doubled", f"{len(stuck(bb, 'victim'))} / {len(twice)}")


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_whole_worker_killed_mid_run_is_lost_by_the_reaper(bb: Harness, measure: Measure, pool: str) -> None:
    """A whole worker killed by SIGKILL mid-run: the reaper settles its run lost within 3 1/3 heartbeats."""
    write_app(bb, {"victim": bb.entry("victim", 1.0, durations=[30, 0.3])})
    worker, beat = bb.start(pool=pool, concurrency=2)
    first = bb.wait_until(lambda: started_run(bb, "victim"), 30, "the first run to start")
    # Let at least one heartbeat pass so the kill lands mid-run, not mid-start.
    time.sleep(1.0)
    killed_at = kill9(worker)

    lost = bb.wait_until(
        lambda: (r := run(bb, first.id)) is not None and r.state == "lost" and r,
        DETECTION_BOUND + SLACK,
        "the reaper to settle the dead worker's run lost",
        each=never_two_active(bb, "victim"),
    )
    assert lost.finished_at is not None
    detection = lost.finished_at.timestamp() - killed_at
    assert lost.error == "worker heartbeat stopped", lost.error
    assert "settled lost by the reaper" in beat.output()
    assert 0 < detection <= DETECTION_BOUND + SLACK

    bb.start_worker(pool=pool, concurrency=2)
    bb.wait_until(
        lambda: len(bb.finished("victim")) >= 2,
        40,
        "two runs on a new worker",
        each=never_two_active(bb, "victim"),
    )
    states = check_books(bb, "victim")
    assert states.get("lost") == 1 and states.get("failed", 0) == 0, states
    twice = doubled(bb, "victim")
    assert twice == []
    measure(f"lost-run detection (whole {pool} worker SIGKILL, heartbeat {HEARTBEAT:g} s)", detection, " s")
    measure("runs lost / doubled", f"{len(stuck(bb, 'victim'))} / {len(twice)}")


def test_acks_late_redelivery_after_a_dead_worker_settles_the_run_once(bb: Harness, measure: Measure) -> None:
    """An acks_late run whose worker was killed is redelivered to another worker and counted once."""
    write_app(bb, {"late": task_entry(bb, "redeliverable", "late", 2.0, duration=10.0)})
    workers = [bb.start_worker(pool="threads", concurrency=1, wait_ready=False) for _ in range(2)]
    bb.start_beat()
    for worker in workers:
        bb.wait_for_log(worker, " ready.", timeout=40)
    first = bb.wait_until(lambda: started_run(bb, "late"), 30, "the run to start")
    node = {f"w{bb.uid}-{w.name.split('-')[-1]}@": w for w in workers}
    victim = next(w for prefix, w in node.items() if (first.worker or "").startswith(prefix))
    kill9(victim)

    done = bb.wait_until(
        lambda: (r := run(bb, first.id)) is not None and r.state not in ACTIVE_STATES and r,
        40,
        "the redelivered run to settle",
    )
    assert done.state == "completed", done.short()
    assert executions(bb, "late")[first.id] == 2, "started twice: once per worker"
    assert done.worker != first.worker, "the second worker finished it"
    bb.wait_until(lambda: len(bb.finished("late")) >= 2, 40, "a later run")
    states = check_books(bb, "late")
    assert states.get("lost", 0) == 0 and states.get("failed", 0) == 0, states
    measure("redelivered run (acks_late)", f"settled {done.state} once; counters == rows")


def test_a_retry_keeps_the_run_started_and_counts_it_once(bb: Harness) -> None:
    """A task that retries once keeps its run started and is counted once when it succeeds."""
    write_app(bb, {"flaky": task_entry(bb, "flaky", "flaky", 30.0)})
    bb.start(pool="prefork", concurrency=2)
    done = bb.wait_until(lambda: bb.finished("flaky"), 30, "the retried run to complete")[0]
    assert done.state == "completed"
    states = check_books(bb, "flaky")
    assert states == {"completed": 1}, states


def test_a_run_lost_with_its_worker_is_attempted_again_after_its_backoff(
    bb: Harness, measure: Measure
) -> None:
    """``retry: {"on": ["lost"]}``: the run of a killed worker runs again for its grid time, as
    attempt 2, within its backoff plus a few seconds of being settled lost; one active at a time."""
    backoff = 2.0
    policy = {"retry": {"on": ["lost"], "backoff": backoff}}
    write_app(bb, {"victim": bb.entry("victim", 120.0, policy=policy, durations=[30, 0.3])})
    worker, _beat = bb.start(pool="threads", concurrency=2)
    first = bb.wait_until(lambda: started_run(bb, "victim"), 30, "the first run to start")
    time.sleep(1.0)  # a heartbeat of the run's process has passed: the kill lands mid-run
    kill9(worker)
    bb.start_worker(pool="threads", concurrency=2)

    again = bb.wait_until(
        lambda: next((r for r in bb.finished("victim") if r.retry_of == first.id), None),
        DETECTION_BOUND + backoff + 2 * SLACK,
        "the lost run's second attempt to complete",
        each=never_two_active(bb, "victim"),
    )
    lost = run(bb, first.id)
    assert lost is not None and lost.state == "lost" and lost.finished_at is not None, lost
    assert (again.attempt, again.scheduled_for) == (2, first.scheduled_for), again.short()
    waited = (again.enqueued_at - lost.finished_at).total_seconds()
    assert backoff <= waited <= backoff + SLACK, (
        f"emitted {waited:.2f} s after the loss (backoff {backoff:g} s)"
    )
    states = check_books(bb, "victim")
    assert states == {"lost": 1, "completed": 1}, states
    row = bb.sql("SELECT retried, grid_runs FROM boundedbeat_schedules WHERE name = 'victim'")[0]
    assert row == {"retried": 1, "grid_runs": 1}, row
    measure("lost run attempted again after (backoff 2 s)", waited, " s")

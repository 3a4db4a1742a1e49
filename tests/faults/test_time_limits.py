"""``max_run_time``: Celery time limits on the message, and the reaper for pools that ignore them."""

from __future__ import annotations

import pytest
from integration.harness import Harness
from integration.reads import ACTIVE_STATES, Run

from .conftest import Measure
from .support import check_books, notes, run, task_entry, write_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

MAX_RUN_TIME = 2.0
#: messages.message_options: the hard limit follows the soft one by max(1 s, 10 %).
HARD_LIMIT = MAX_RUN_TIME + max(1.0, MAX_RUN_TIME * 0.1)
#: receivers.POOL_REPORT_GRACE: the reaper waits this long past the hard limit for the pool's report.
REAPER_AFTER = HARD_LIMIT + 1.0
POLICY = {"mode": "fixed_rate_no_overlap", "max_run_time": MAX_RUN_TIME}


def first_run(bb: Harness, name: str) -> Run | None:
    runs = [r for r in bb.runs(name) if r.started_at is not None]
    return runs[0] if runs else None


def settled(bb: Harness, run_id: str) -> Run | None:
    r = run(bb, run_id)
    return r if r is not None and r.state not in ACTIVE_STATES else None


def later_runs_complete(bb: Harness, name: str, after: Run, count: int = 2) -> list[Run]:
    """The schedule goes on by its policy: runs after the timed-out one start once it settled."""
    assert after.finished_at is not None
    later = bb.wait_until(
        lambda: (
            [r for r in bb.finished(name) if r.scheduled_for > after.scheduled_for][:count]
            if len([r for r in bb.finished(name) if r.scheduled_for > after.scheduled_for]) >= count
            else None
        ),
        30,
        f"{count} completed runs of {name} after the timed-out one",
    )
    for r in later:
        assert r.started_at is not None and r.started_at >= after.finished_at, (
            f"{r.short()} started before the timed-out run settled"
        )
    return later


def test_threads_pool_run_past_max_run_time_is_timed_out_by_the_reaper(bb: Harness, measure: Measure) -> None:
    """On a pool that cannot enforce time limits, the reaper settles a run past its limit as timed_out."""
    write_app(bb, {"slow": bb.entry("slow", 1.0, policy=POLICY, durations=[8, 0.2])})
    bb.start(pool="threads", concurrency=4)
    first = bb.wait_until(lambda: first_run(bb, "slow"), 30, "the first run to start")
    timed_out = bb.wait_until(lambda: settled(bb, first.id), REAPER_AFTER + 8, "the reaper to settle it")
    assert timed_out.state == "timed_out", timed_out.short()
    assert timed_out.error is not None and timed_out.error.startswith("passed max_run_time")
    assert timed_out.elapsed_ms is not None
    elapsed = timed_out.elapsed_ms / 1000
    # Not before the pool's turn ends, at most a reaper pass (1 s) + slack after it.
    assert REAPER_AFTER - 0.1 <= elapsed <= REAPER_AFTER + 3.0, elapsed
    later_runs_complete(bb, "slow", timed_out)

    # The task itself went on in its thread and finished at 8 s: the truth is kept, not counted.
    noted = bb.wait_until(
        lambda: (
            (r := run(bb, first.id)) is not None and "late outcome from the worker" in (r.error or "") and r
        ),
        15,
        "the late success to be noted on the timed-out run",
    )
    assert noted.state == "timed_out" and noted.finished_at == timed_out.finished_at
    assert ": completed" in (noted.error or ""), noted.error
    states = check_books(bb, "slow")
    assert states.get("timed_out") == 1 and states.get("failed", 0) == 0, states
    measure(
        "threads: timed_out after",
        elapsed,
        f" s (max_run_time {MAX_RUN_TIME:g} s, hard limit {HARD_LIMIT:g} s + 1 s for the pool)",
    )
    measure("threads: late success", "noted in error, not counted")


def test_prefork_enforces_soft_then_hard_limits_from_max_run_time(bb: Harness, measure: Measure) -> None:
    """Prefork gets a soft limit (the task cleans up), then a hard one (the child dies): both timed_out."""
    write_app(
        bb,
        {
            "tidy": task_entry(bb, "tidy", "tidy", 1.0, policy=POLICY, durations=[30, 0.2]),
            "stubborn": task_entry(bb, "stubborn", "stubborn", 1.0, policy=POLICY, durations=[30, 0.2]),
        },
    )
    worker, _beat = bb.start(pool="prefork", concurrency=3)
    tidy = bb.wait_until(lambda: first_run(bb, "tidy"), 30, "the first tidy run to start")
    stubborn = bb.wait_until(lambda: first_run(bb, "stubborn"), 30, "the first stubborn run to start")

    tidy_done = bb.wait_until(lambda: settled(bb, tidy.id), MAX_RUN_TIME + 8, "the soft limit to end tidy")
    assert tidy_done.state == "timed_out", tidy_done.short()
    assert "SoftTimeLimitExceeded" in (tidy_done.error or ""), tidy_done.error
    assert any(n["event"] == "cleanup" and n["id"] == tidy.id for n in notes(bb)), "the task cleaned up"
    assert tidy_done.elapsed_ms is not None
    soft_elapsed = tidy_done.elapsed_ms / 1000
    assert MAX_RUN_TIME - 0.2 <= soft_elapsed <= MAX_RUN_TIME + 2.0, soft_elapsed

    stubborn_done = bb.wait_until(lambda: settled(bb, stubborn.id), HARD_LIMIT + 8, "the hard limit")
    assert stubborn_done.state == "timed_out", stubborn_done.short()
    error = stubborn_done.error or ""
    assert error.startswith("TimeLimitExceeded"), error  # reported by the pool's parent process
    assert any(n["event"] == "ignored-soft-limit" and n["id"] == stubborn.id for n in notes(bb))
    assert stubborn_done.elapsed_ms is not None
    hard_elapsed = stubborn_done.elapsed_ms / 1000
    assert HARD_LIMIT - 0.2 <= hard_elapsed <= HARD_LIMIT + 3.0, hard_elapsed

    later_runs_complete(bb, "tidy", tidy_done)
    later_runs_complete(bb, "stubborn", stubborn_done)
    assert worker.alive
    for name in ("tidy", "stubborn"):
        states = check_books(bb, name)
        assert states.get("timed_out") == 1 and states.get("failed", 0) == 0, (name, states)
    measure("prefork soft limit: timed_out after", soft_elapsed, " s")
    measure("prefork hard limit: timed_out after", hard_elapsed, " s")

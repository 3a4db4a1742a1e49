"""Seams between the worker and the database: error texts no database stores, tasks no worker knows."""

from __future__ import annotations

import re

import pytest

from .harness import Harness
from .processes import Proc
from .reads import ACTIVE_STATES, Run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

#: The package's one log line for a task name a worker does not register (once per name per process).
UNKNOWN_LINE = "is not registered in this worker"
#: The worker's line for an outcome the database did not take because the run was settled already.
ALREADY_SETTLED = re.compile(r"celery_boundedbeat: run (\S+) was already settled")


def no_outcome_dropped(bb: Harness, worker: Proc) -> None:
    """A run the worker found "already settled" (logged after its write committed) is settled."""
    dropped = set(ALREADY_SETTLED.findall(worker.output()))
    active = [r.short() for r in bb.runs() if r.id in dropped and r.state in ACTIVE_STATES]
    assert not active, "the worker dropped the outcome of runs still active:\n" + "\n".join(active)


def test_error_texts_the_database_cannot_store_settle_failed_escaped(bb: Harness) -> None:
    """A NUL byte or a lone surrogate in a task's exception settles the run failed with the text
    escaped, and a healthy schedule in the same worker process goes on completing right after."""
    # ASCII escapes the task decodes in the worker: the messages carry a real NUL / lone surrogate.
    nul = f"nul\\x00byte-{bb.uid}"
    surrogate = f"caf\\udce9-{bb.uid}"
    bb.write_app(
        {
            "nul": bb.entry("nul", 1.0, fail=nul, fail_escaped=True),
            "surrogate": bb.entry("surrogate", 1.0, fail=surrogate, fail_escaped=True),
            "healthy": bb.entry("healthy", 1.0),
        }
    )
    # One thread: every run of the three schedules executes in the one worker process, in turn.
    worker, _ = bb.start(pool="threads", concurrency=1)

    def first_failures() -> list[Run]:
        firsts = [bb.runs("nul")[:3], bb.runs("surrogate")[:3]]
        return [r for runs in firsts for r in runs if r.state not in ACTIVE_STATES]

    def healthy_after_them() -> list[Run] | None:
        settled = first_failures()
        if len(settled) < 6:
            return None
        last = max(r.finished_at for r in settled if r.finished_at is not None)
        after = [r for r in bb.finished("healthy") if r.started_at is not None and r.started_at > last]
        return after if len(after) >= 3 else None

    after = bb.wait_until(
        healthy_after_them,
        timeout=40,
        what="the first 3 runs of 'nul' and 'surrogate' to settle, then 3 'healthy' runs to complete",
        each=lambda: no_outcome_dropped(bb, worker),
    )
    expected = {"nul": f"ValueError: {nul}", "surrogate": f"ValueError: {surrogate}"}
    for run in first_failures():
        assert run.state == "failed", run.short()
        assert run.error is not None, run.short()
        summary, _, trace = run.error.partition("\n\n")
        assert summary == expected[run.schedule], (run.error, run.short())
        assert trace.startswith("Traceback (most recent call last):"), run.error
        assert run.started_at is not None and run.finished_at is not None, run.short()
    assert "\\x00" in expected["nul"] and "\\udce9" in expected["surrogate"]
    for name in ("nul", "surrogate"):
        assert [r.state for r in bb.runs(name)[:3]] == ["failed"] * 3
        row = bb.schedule(name)
        assert row["failures"] >= 3 and row["runs"] == 0, row
    assert len(after) >= 3
    assert not [r for r in bb.runs("healthy") if r.state not in {"completed", *ACTIVE_STATES}]
    # The same process ran all of them (the healthy runs followed the failures in it).
    seen = bb.intervals()
    assert {iv.name for iv in seen} == {"nul", "surrogate", "healthy"}
    assert {iv.pid for iv in seen} == {worker.popen.pid}, [(iv.name, iv.pid) for iv in seen]
    # The text was escaped before the write: no data error, no fallback text.
    log = worker.output()
    assert "refused to record" not in log and "outcome dropped" not in log, worker.tail(80)
    assert not [r for r in bb.runs() if r.error and "not recordable" in r.error]
    assert not [line for line in log.splitlines() if "ERROR/" in line and "celery_boundedbeat" in line]


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_runs_of_an_unregistered_task_settle_rejected_within_seconds(bb: Harness, pool: str) -> None:
    """Runs of a task no worker registers settle rejected within seconds (not after start_timeout),
    with one log line per worker process, and the schedule goes on emitting."""
    task = "bbtest.no_such_task"
    bb.write_app({"ghost": {"task": task, "schedule": 1.0}})  # default policy and start_timeout (1 h)
    worker, _ = bb.start(pool=pool, concurrency=2)
    bb.wait_until(
        lambda: len(bb.finished("ghost", "rejected")) >= 3,
        timeout=10,
        what="3 rejected runs of 'ghost'",
        each=lambda: no_outcome_dropped(bb, worker),
    )
    runs = bb.runs("ghost")
    assert len(runs) >= 3
    settled = [r for r in runs if r.state not in ACTIVE_STATES]
    assert len(settled) >= 3
    for run in settled:
        assert run.state == "rejected", run.short()
        assert run.error == f"unknown task {task!r}: not registered in the worker", run.error
        assert task in run.error and "not registered" in run.error
        assert run.task == task and run.started_at is None, run.short()
        assert run.published_at is not None and run.finished_at is not None, run.short()
        waited = (run.finished_at - run.published_at).total_seconds()
        assert 0 <= waited < 5, (waited, run.short())

    # Not wedged: the slot of each rejected run is freed, so emissions go on.
    def accounted() -> int:
        row = bb.schedule("ghost")
        return int(row["runs"] + row["failures"])

    before = accounted()
    assert before >= 3
    bb.wait_until(
        lambda: accounted() >= before + 3,
        timeout=10,
        what="3 more runs of 'ghost' accounted",
        each=lambda: no_outcome_dropped(bb, worker),
    )
    row = bb.schedule("ghost")
    assert row["runs"] == 0 and row["failures"] >= before + 3, row
    assert {r.state for r in bb.runs("ghost")} <= {"rejected", *ACTIVE_STATES}

    # Said once by the consumer (the main process), however many runs it rejected.
    lines = [line for line in worker.output().splitlines() if UNKNOWN_LINE in line]
    assert len(lines) == 1, lines
    assert "ERROR/MainProcess]" in lines[0] and repr(task) in lines[0], lines[0]
    assert worker.output().count(f"Received unregistered task of type {task!r}") >= 6

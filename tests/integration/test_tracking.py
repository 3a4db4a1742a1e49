"""Worker-side tracking: outcomes, stop_schedule(), and every pool Celery ships."""

from __future__ import annotations

import os

import pytest

from .harness import Harness
from .reads import ACTIVE_STATES, epoch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_failed_runs_keep_the_error_text(bb: Harness) -> None:
    """A task that raises settles each run as failed with the exception's message; the schedule goes on."""
    message = f"kaboom-{bb.uid}"
    bb.write_app({"boom": bb.entry("boom", 1.0, durations=[0.1], fail=message)})
    bb.start(concurrency=2)
    bb.wait_until(lambda: len(bb.finished("boom", "failed")) >= 3, timeout=30, what="3 failed runs of 'boom'")
    failed = bb.finished("boom", "failed")
    for run in failed:
        assert run.error is not None and message in run.error and "ValueError" in run.error, run.short()
        assert run.started_at is not None and run.finished_at is not None, run.short()
        assert run.finished_at >= run.started_at, run.short()
    assert not [r for r in bb.runs("boom") if r.state not in {"failed", *ACTIVE_STATES}]
    row = bb.schedule("boom")
    assert row["failures"] >= len(failed), row
    assert row["runs"] == 0, row


@pytest.mark.parametrize("backend", ["sqlite-filesystem"], indirect=True)
def test_stop_schedule_ends_the_schedule_across_restarts(bb: Harness) -> None:
    """A run calling stop_schedule() completes, then its schedule emits no more runs, even after a restart."""
    bb.write_app(
        {"stopper": bb.entry("stopper", 0.5, policy={"mode": "fixed_delay"}, durations=[0.1], stop_on=2)}
    )
    _, beat = bb.start(concurrency=2)
    bb.wait_until(lambda: bb.schedule("stopper")["stopped"], timeout=30, what="'stopper' to be stopped")

    def two_completed_runs() -> None:
        runs = bb.runs("stopper")
        assert [r.state for r in runs] == ["completed", "completed"], "\n".join(r.short() for r in runs)

    bb.watch(3.0, two_completed_runs)
    bb.stop(beat)
    bb.start_beat(migrate=False)
    bb.watch(3.0, two_completed_runs)
    row = bb.schedule("stopper")
    assert row["stopped"] and row["active_runs"] == 0 and row["runs"] == 2, row
    assert len(bb.intervals("stopper")) == 2
    status = bb.celery("boundedbeat", "status", "--json", check=True)
    assert '"stopped": true' in status.stdout, status.stdout
    bb.assert_no_errors()


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
def test_every_pool_tracks_runs_with_task_id_equal_to_run_id(bb: Harness, pool: str) -> None:
    """In each worker pool every run reaches completed and the task's own request id is the run id."""
    # Two schedules on one grid: their runs start at the same moment in one worker.
    bb.write_app(
        {
            "tracked": bb.entry("tracked", 0.5, durations=[0.2]),
            "twin": bb.entry("twin", 0.5, durations=[0.2]),
        }
    )
    worker, _ = bb.start(pool=pool, concurrency=2)
    bb.wait_until(
        lambda: len(bb.finished("tracked")) >= 4 and len(bb.finished("twin")) >= 4,
        timeout=30,
        what="4 completed runs of 'tracked' and of 'twin'",
    )
    seen = {iv.id: iv for iv in bb.intervals("tracked") if iv.end is not None}
    runs = {r.id: r for r in bb.runs("tracked")}
    completed = {i for i, r in runs.items() if r.state == "completed"}
    assert len(completed) >= 4
    # Every completed run was executed by the task under its run id, and vice versa.
    assert completed <= seen.keys(), f"completed runs the task never saw: {completed - seen.keys()}"
    for task_id, _interval in seen.items():
        run = runs.get(task_id)
        assert run is not None, f"the task ran as {task_id}, which is no run id"
        assert run.state in {"completed", "started"}, run.short()
    for run_id in completed:
        run = runs[run_id]
        assert run.worker and bb.uid in run.worker, run.short()
        assert run.started_at and run.finished_at and run.published_at, run.short()
        assert run.enqueued_at <= run.published_at <= run.started_at, run.short()
        assert epoch(run.started_at) <= seen[run_id].start <= seen[run_id].end <= epoch(run.finished_at), (
            f"the task ran outside its recorded started/finished window: {run.short()} {seen[run_id]}"
        )
    in_main = {iv.pid == worker.popen.pid for iv in seen.values()}
    assert in_main == {pool != "prefork"}, f"{pool}: tasks ran in pids {[iv.pid for iv in seen.values()]}"
    # Recording runs never failed, not even for the twin runs starting together.
    bb.assert_no_errors()


@pytest.mark.parametrize("backend", ["pg-rabbitmq"], indirect=True)
def test_with_confirm_publish_runs_are_published_confirmed_and_tracked(bb: Harness) -> None:
    """Celery's ``confirm_publish`` switches the in-beat dispatcher to batch confirms; runs flow
    through real beat and worker exactly as without it."""
    bb.write_app(
        {"confirmed": bb.entry("confirmed", 0.5, durations=[0.1])},
        broker_transport_options={"confirm_publish": True},
    )
    bb.start(concurrency=2)
    bb.wait_until(
        lambda: len(bb.finished("confirmed")) >= 4, timeout=40, what="4 completed runs of 'confirmed'"
    )
    for run in bb.finished("confirmed"):
        assert run.published_at is not None and run.started_at is not None, run.short()
        assert run.enqueued_at <= run.published_at <= run.started_at, run.short()
    bb.assert_no_errors()


def _children(parent: int, marker: bytes = b"") -> list[int]:
    """Pids of the processes whose parent is ``parent`` and whose command holds ``marker`` (/proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(") ")[2].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            continue
        if ppid == parent and marker in command:
            found.append(int(entry))
    return found


def _writer_children(worker_pid: int) -> list[int]:
    """Pids of the report writer processes whose parent is ``worker_pid``."""
    return _children(worker_pid, b"celery_boundedbeat.worker.report_writer")


def test_the_report_writer_process_records_every_run_and_ends_with_the_worker(bb: Harness) -> None:
    """By default (``boundedbeat_report_writer = "auto"``) a threads-pool worker has a writer
    process, started with the worker; it records every run, and a warm shutdown writes the
    last outcomes and ends it."""
    bb.write_app({"written": bb.entry("written", 0.5, durations=[0.1])})
    worker, beat = bb.start(pool="threads", concurrency=2)
    pid = worker.popen.pid
    children = bb.wait_until(lambda: _writer_children(pid), timeout=10, what="the writer process")
    bb.wait_until(lambda: len(bb.finished("written")) >= 4, timeout=30, what="4 completed runs of 'written'")
    assert _writer_children(pid) == children and len(children) == 1, children
    bb.stop(beat)
    assert bb.stop(worker) == 0
    assert not _writer_children(pid)
    assert not os.path.exists(f"/proc/{children[0]}"), "the writer process outlived the worker"
    runs = bb.runs("written")
    assert [r.short() for r in runs if r.state == "started"] == [], "a started run was left unsettled"
    executed = {iv.id for iv in bb.intervals("written") if iv.end is not None}
    completed = {r.id for r in runs if r.state == "completed"}
    assert executed == completed, (executed ^ completed, [r.short() for r in runs])
    bb.assert_no_errors()


@pytest.mark.parametrize(("pool", "writer"), [("prefork", "auto"), ("threads", "thread")])
def test_a_worker_writes_its_reports_itself_with_prefork_or_when_told(
    bb: Harness, pool: str, writer: str
) -> None:
    """No writer process for a prefork worker (a pool child runs one task at a time) or with
    ``"thread"``: the reports are written by a thread, in the parent or in each pool child."""
    bb.write_app({"itself": bb.entry("itself", 0.5, durations=[0.1])}, boundedbeat_report_writer=writer)
    worker, _ = bb.start(pool=pool, concurrency=2)
    bb.wait_until(lambda: len(bb.finished("itself")) >= 3, timeout=30, what="3 completed runs of 'itself'")
    tree = [worker.popen.pid, *_children(worker.popen.pid)]
    assert [child for pid in tree for child in _writer_children(pid)] == []
    bb.assert_no_errors()

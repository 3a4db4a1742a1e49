"""A run's message delivered twice, a worker that dies just after a start, reports held up:
what runs, and how each run settles, with real beat and worker processes."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from celery import Celery
from integration.harness import Harness
from integration.processes import Proc
from integration.reads import ACTIVE_STATES, Run

from celery_boundedbeat.core.messages import message_options
from celery_boundedbeat.core.policy import Policy

from .support import check_books, executions, run, started_run, task_entry, write_app

pytestmark = [pytest.mark.integration, pytest.mark.timeout(150)]

#: Appended to the app module: a task that kills its own worker right after it starts.
SUICIDE_TASK = '''

@app.task(bind=True)
def suicide(self, name):
    """The first run kills its whole worker (threads pool) a moment after it started."""
    n = _starts(name)
    _record(event="start", t=time.time(), name=name, id=self.request.id, n=n, pid=os.getpid())
    if n == 0:
        os.kill(os.getpid(), 9)
    _record(event="end", t=time.time(), name=name, id=self.request.id, n=n, pid=os.getpid())
'''


def publish_again(bb: Harness, run_id: str, name: str, task: str, **kwargs: object) -> None:
    """Publish the run's message once more, as a dispatcher that re-published it would."""
    app = Celery("duplicate", broker=bb.backend.broker_url, set_as_current=False)
    if bb.backend.transport_options:
        app.conf.broker_transport_options = bb.backend.transport_options
    options = message_options({}, Policy(), run_id, name)
    try:
        app.send_task(
            f"{bb.module}.{task}", kwargs={"name": name, **kwargs}, task_id=run_id, queue=bb.queue, **options
        )
    finally:
        app.close()


def settled(bb: Harness, run_id: str) -> Run | None:
    """The run once it left the active states (else None)."""
    found = run(bb, run_id)
    return found if found is not None and found.state not in ACTIVE_STATES else None


def skipped(proc: Proc) -> bool:
    return "is not run again by this delivery" in proc.output()


def test_a_duplicate_delivery_of_a_started_run_does_not_run_its_body_again(bb: Harness) -> None:
    """The same run's message delivered a second time while the first delivery runs it (another
    worker process, alive): the second does not run the body; the run settles completed once."""
    write_app(bb, {"dup": task_entry(bb, "redeliverable", "dup", 3600.0, duration=4.0)})
    workers = [bb.start_worker(pool="threads", concurrency=1, wait_ready=False) for _ in range(2)]
    bb.start_beat()
    for worker in workers:
        bb.wait_for_log(worker, " ready.", timeout=40)
    first = bb.wait_until(lambda: started_run(bb, "dup"), 30, "the run to start")
    publish_again(bb, first.id, "dup", "redeliverable", duration=4.0)
    bb.wait_until(
        lambda: any(skipped(w) for w in workers) or executions(bb, "dup")[first.id] > 1,
        20,
        "the duplicate delivery to be skipped or run",
    )
    done = bb.wait_until(
        lambda: (r := run(bb, first.id)) is not None and r.state == "completed" and r,
        30,
        "the run to complete",
    )
    assert executions(bb, "dup")[first.id] == 1, executions(bb, "dup")
    assert done.worker == first.worker, "the run stays with the delivery that started it"
    assert check_books(bb, "dup") == {"completed": 1}


def test_a_run_whose_worker_dies_just_after_its_start_settles_lost(bb: Harness) -> None:
    """A worker killed a moment after a run's body began (before a write-behind start could be
    written): the run was started, so it settles lost, not rejected as never started."""
    module = write_app(
        bb,
        {"gone": task_entry(bb, "suicide", "gone", 3600.0)},
        boundedbeat_heartbeat_interval=1.0,
        boundedbeat_start_timeout=6.0,
    )
    path = bb.tmp / f"{module}.py"
    path.write_text(path.read_text() + SUICIDE_TASK)
    worker, _beat = bb.start(pool="threads", concurrency=1)
    worker.expect_alive = False  # its task kills it
    bb.wait_until(lambda: executions(bb, "gone"), 30, "the body to start")
    (run_id,) = executions(bb, "gone")
    worker.popen.wait(timeout=10)
    done = bb.wait_until(
        lambda: (
            (r := run(bb, run_id)) is not None and r.state not in ("queued", "published", "started") and r
        ),
        30,
        "the run to settle",
    )
    assert done.state == "lost", done.short()
    assert done.started_at is not None


def _report_process_of(worker: Proc) -> int:
    """The pid of the worker's report writer process (a descendant running reportproc)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"celery_boundedbeat.worker.report_writer" not in cmdline:
            continue
        pid = int(entry)
        while pid > 1:  # its ancestry leads to this worker
            if pid == worker.popen.pid:
                return int(entry)
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                break
            pid = int(stat.rsplit(")", 1)[1].split()[1])
    return 0


def test_a_run_finished_while_its_report_is_held_up_is_not_settled_lost(bb: Harness) -> None:
    """A threads worker whose report writer process is frozen (its outcome on the way, as during
    an outage or a lock held elsewhere) keeps its heartbeat: the run that finished meanwhile is
    not settled lost while the worker lives, and settles completed once the writer thaws."""
    write_app(
        bb,
        {"held": bb.entry("held", 3600.0, durations=[1.0])},
        boundedbeat_heartbeat_interval=1.0,
        boundedbeat_report_writer="process",
    )
    worker, _beat = bb.start(pool="threads", concurrency=1)
    writer = bb.wait_until(lambda: _report_process_of(worker), 30, "the report writer process")
    first = bb.wait_until(lambda: started_run(bb, "held"), 30, "the run to start")
    os.kill(writer, signal.SIGSTOP)
    try:
        bb.wait_until(
            lambda: any(iv.id == first.id and iv.end is not None for iv in bb.intervals("held")),
            20,
            "the body to end",
        )

        def not_lost() -> None:
            now = run(bb, first.id)
            assert now is not None and now.state != "lost", now.short() if now else first.id

        # Five heartbeat intervals: the reaper settles a silent worker's run after three.
        bb.watch(5.0, not_lost)
    finally:
        os.kill(writer, signal.SIGCONT)
    done = bb.wait_until(
        lambda: (r := run(bb, first.id)) is not None and r.state not in ("started",) and r,
        30,
        "the run to settle",
    )
    assert done.state == "completed", done.short()

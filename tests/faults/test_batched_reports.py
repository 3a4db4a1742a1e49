"""A batch of worker reports ends exactly where the same reports written one by one end.

The tracker writes what its process queued in one transaction (``worklog.write_reports``);
these tests replay the same mixed reports (starts, outcomes, duplicates, a redelivery, the
reaper settling a run lost before the task's own outcome arrives) once report by report
through ``Store.start_run`` / ``Store.settle_run`` and once batched, on two copies of the
same schedules, and compare every run row, schedule counter and alert.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from helpers.clock import T0, sec
from sqlalchemy import Engine, select

from celery_boundedbeat.config.entries import parse_entry
from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.db.engine import dispose_all, get_engine
from celery_boundedbeat.db.faults import is_outage
from celery_boundedbeat.db.runs import LATE_OUTCOME
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import AlertRow, RunRow, ScheduleRow, WorkerRow
from celery_boundedbeat.worker import report_writer as reportproc
from celery_boundedbeat.worker.report_writer import ReportProcess, ReportsRefused, ReportWriterLost
from celery_boundedbeat.worker.tracking import Tracker
from celery_boundedbeat.worker.worklog import Beat, OutcomeReport, StartReport, write_reports

SCHEDULES = 3
TICKS = 4
OUTCOMES = [RunState.COMPLETED, RunState.FAILED, RunState.TIMED_OUT, RunState.REVOKED, RunState.REJECTED]


@pytest.fixture
def store(migrated: Engine) -> Store:
    return Store(migrated, failing_threshold=2)


def emit_copies(store: Store, *prefixes: str) -> list[dict[tuple[int, int], str]]:
    """Per prefix SCHEDULES schedules x TICKS runs (fixed_rate, room for all): run id by (schedule, tick)."""
    rng = random.Random(3)
    policy = {"mode": "fixed_rate", "max_concurrency": TICKS}
    specs = {}
    for prefix in prefixes:
        for n in range(SCHEDULES):
            entry = {"task": "proj.t", "schedule": 10, "policy": policy}
            spec, problems = parse_entry(f"{prefix}{n}", entry, {})
            assert spec is not None, problems
            specs[spec.name] = spec
    store.sync_config(list(specs.values()), T0, rng)  # one config: a second call would remove the first
    ids: list[dict[tuple[int, int], str]] = [{} for _ in prefixes]
    for tick in range(TICKS):
        for run in store.tick(specs, T0 + sec(10 * tick), rng, 10).emitted:
            prefix, n = run.schedule.rsplit("-", 1)
            ids[prefixes.index(prefix + "-")][(int(n), tick)] = run.id
    assert all(len(copy) == SCHEDULES * TICKS for copy in ids)
    return ids


def script(seed: int) -> list[list[tuple[str, Any]]]:
    """Batches of events for runs named (schedule, tick); ``reap`` events stand between batches."""
    rng = random.Random(seed)
    events: list[tuple[float, tuple[str, Any]]] = []
    for key in [(s, t) for s in range(SCHEDULES) for t in range(TICKS)]:
        at = 10 * key[1] + rng.uniform(0, 3)
        events.append((at, ("start", (key, at))))
        if rng.random() < 0.2:
            events.append((at + 0.1, ("start", (key, at + 0.1))))  # redelivered to another process
        end = at + rng.uniform(0.1, 6)
        if rng.random() < 0.2:
            events.append((end - 0.05, ("reap", (key, end - 0.05))))  # lost before its outcome arrives
        state = rng.choice(OUTCOMES)
        events.append((end, ("outcome", (key, end, state))))
        if rng.random() < 0.3:
            events.append((end + 0.01, ("outcome", (key, end + 0.01, rng.choice(OUTCOMES)))))
    events.sort(key=lambda e: e[0])
    batches: list[list[tuple[str, Any]]] = [[]]
    for _, event in events:
        if event[0] == "reap":
            batches += [[event], []]
        else:
            batches[-1].append(event)
            if rng.random() < 0.25:
                batches.append([])
    return [b for b in batches if b]


def apply_one_by_one(
    store: Store, ids: dict[tuple[int, int], str], batches: list[list[tuple[str, Any]]]
) -> None:
    """Each batch as the tracker's contract says it lands: its starts, then its outcomes, in order."""
    for batch in batches:
        for kind, event in sorted(batch, key=lambda e: e[0] != "start"):
            if kind == "start":
                key, at = event
                store.run_life.start_run(
                    ids[key], worker="w", process=f"h:{at:.1f}", now=T0 + sec(at), max_run_time=30
                )
            elif kind == "outcome":
                key, at, state = event
                store.run_life.settle_run(ids[key], state, now=T0 + sec(at), error=f"e{at:.2f}", late=True)
            else:
                key, at = event
                store.run_life.settle_run(
                    ids[key], RunState.LOST, now=T0 + sec(at), error="heartbeat stopped"
                )


def apply_batched(
    store: Store,
    ids: dict[tuple[int, int], str],
    batches: list[list[tuple[str, Any]]],
    write: Callable[..., Any] | None = None,
) -> None:
    """The batches as the tracker writes them: ``write_reports`` (or ``write``: the writer process)."""
    write = write or (lambda starts, outcomes: write_reports(store, starts, outcomes, rng=random.Random(1)))
    for batch in batches:
        if batch[0][0] == "reap":
            key, at = batch[0][1]
            store.run_life.settle_run(ids[key], RunState.LOST, now=T0 + sec(at), error="heartbeat stopped")
            continue
        starts = [
            StartReport(run_id=ids[key], worker="w", process=f"h:{at:.1f}", at=T0 + sec(at), limit=30)
            for kind, (key, at, *_) in batch
            if kind == "start"
        ]
        outcomes = [
            OutcomeReport(run_id=ids[key], state=rest[0], at=T0 + sec(at), error=f"e{at:.2f}", stop=False)
            for kind, (key, at, *rest) in batch
            if kind == "outcome"
        ]
        write(starts, outcomes)


def picture(store: Store, prefix: str, ids: dict[tuple[int, int], str]) -> dict[str, Any]:
    """Everything the reports changed, keyed by (schedule, tick) instead of the run ids."""
    by_id = {run_id: key for key, run_id in ids.items()}
    cols = ["state", "started_at", "published_at", "finished_at", "elapsed_ms", "error", "worker", "process"]
    cols += ["deadline_at"]
    with store.session() as s:
        runs = {
            by_id[r.id]: tuple(getattr(r, c) for c in cols)
            for r in s.scalars(select(RunRow).where(RunRow.schedule.startswith(prefix)))
        }
        keep = ["runs", "failures", "active_runs", "consecutive_failures", "last_elapsed_ms"]
        keep += ["max_elapsed_ms", "failing_since", "pending", "next_due_at"]
        schedules = {
            row.name.removeprefix(prefix): tuple(getattr(row, c) for c in keep)
            for row in s.scalars(select(ScheduleRow).where(ScheduleRow.name.startswith(prefix)))
        }
        alerts = sorted(
            (a.kind, a.schedule.removeprefix(prefix), by_id.get(a.run_id or ""), a.state, a.count)
            for a in s.scalars(select(AlertRow).where(AlertRow.schedule.startswith(prefix)))
        )
    return {"runs": runs, "schedules": schedules, "alerts": alerts}


@pytest.mark.parametrize("seed", range(6))
def test_batched_reports_end_where_the_same_reports_one_by_one_end(store: Store, seed: int) -> None:
    """Same runs, counters, late-outcome notes and alerts, batched or not."""
    one, many = emit_copies(store, "one-", "many-")
    batches = script(seed)
    apply_one_by_one(store, one, batches)
    apply_batched(store, many, batches)
    expected, got = picture(store, "one-", one), picture(store, "many-", many)
    show_differences(expected, got)
    assert got == expected
    states = [run[0] for run in got["runs"].values()]
    assert all(state in {s.value for s in OUTCOMES} | {"lost"} for state in states), states
    assert sum(row[0] + row[1] for row in got["schedules"].values()) == SCHEDULES * TICKS


@pytest.mark.parametrize("seed", range(2))
def test_batches_written_by_the_writer_process_end_where_the_same_reports_one_by_one_end(
    store: Store, seed: int
) -> None:
    """``boundedbeat_report_writer = "process"``: the child writes the batches, with the same result."""
    one, many = emit_copies(store, "one-", "many-")
    batches = script(seed)
    apply_one_by_one(store, one, batches)
    writer = ReportProcess(
        store.engine.url.render_as_string(hide_password=False), store.run_life.failing_threshold
    )
    try:
        apply_batched(store, many, batches, lambda starts, outcomes: writer.write(starts, outcomes, None))
    finally:
        writer.close()
    expected, got = picture(store, "one-", one), picture(store, "many-", many)
    show_differences(expected, got)
    assert got == expected


def test_a_writer_process_that_dies_loses_no_report(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """A child found dead is replaced before the next batch; one that dies during a batch fails
    that batch as an outage (the tracker keeps it and sends it again), and the retry lands."""
    (ids,) = emit_copies(store, "dead-")
    writer = ReportProcess(
        store.engine.url.render_as_string(hide_password=False), store.run_life.failing_threshold
    )
    first, second = ids[(0, 0)], ids[(1, 0)]
    try:
        assert writer.write([StartReport(first, "w", "h:1", T0 + sec(1), None)], [], None) == []
        dead = writer._child
        assert dead is not None
        dead.kill()
        dead.wait()
        start = [StartReport(second, "w", "h:1", T0 + sec(2), None)]
        assert writer.write(start, [], None) == []  # a new child
        replaced = writer._child
        assert replaced is not None and replaced.pid != dead.pid
        replaced.kill()
        replaced.wait()
        monkeypatch.setattr(replaced, "poll", lambda: None)  # it dies while the batch is sent
        done = [OutcomeReport(second, RunState.COMPLETED, T0 + sec(3), None, False)]
        with pytest.raises(ReportWriterLost) as lost:
            writer.write([], done, None)
        assert is_outage(lost.value)
        assert [x is not None for x in writer.write([], done, None)] == [True]
    finally:
        writer.close()
    run = store.run(second)
    assert run is not None and (run.state, run.elapsed_ms) == ("completed", 1000)
    assert writer._child is None


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_writer_process_outlives_ctrl_c_and_sigterm_to_the_process_group(
    store: Store, signum: int
) -> None:
    """Ctrl-C or a service manager's SIGTERM reach the child too; it must still be there to
    write the warm shutdown's last reports (the same child, not a replacement)."""
    (ids,) = emit_copies(store, "sig-")
    writer = ReportProcess(
        store.engine.url.render_as_string(hide_password=False), store.run_life.failing_threshold
    )
    run = ids[(0, 0)]
    try:
        assert writer.write([StartReport(run, "w", "h:1", T0 + sec(1), None)], [], None) == []
        child = writer._child
        assert child is not None
        os.kill(child.pid, signum)
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(1.0)  # it did not end
        done = [OutcomeReport(run, RunState.COMPLETED, T0 + sec(2), None, False)]
        assert [x is not None for x in writer.write([], done, None)] == [True]
        assert writer._child is child
    finally:
        writer.close()
    written = store.run(run)
    assert written is not None and written.state == "completed"


def test_ready_starts_the_writer_process_in_the_background(store: Store) -> None:
    """The tracker asks ``ready()`` before each batch and writes the batch itself while the
    answer is no: the child's imports (about a second) never delay a worker's first reports."""
    writer = ReportProcess(
        store.engine.url.render_as_string(hide_password=False), store.run_life.failing_threshold
    )
    try:
        started = time.monotonic()
        assert writer.ready() is False
        assert time.monotonic() - started < 0.5, "ready() waited for the child"
        deadline = time.monotonic() + 60
        while not writer.ready():
            assert time.monotonic() < deadline, "the writer process never became ready"
            time.sleep(0.05)
        child = writer._child
        (ids,) = emit_copies(store, "bg-")
        assert writer.write([StartReport(ids[(0, 0)], "w", "h:1", T0, None)], [], None) == []
        assert writer._child is child and writer.ready()
    finally:
        writer.close()


def test_a_writer_process_that_cannot_start_is_not_spawned_for_every_batch(
    store: Store, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(reportproc, "_CHILD", "raise SystemExit(3)")
    spawned = []
    real = subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> Any:
        spawned.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(reportproc.subprocess, "Popen", popen)
    writer = ReportProcess(
        store.engine.url.render_as_string(hide_password=False), store.run_life.failing_threshold
    )
    assert writer.ready() is False
    assert writer._starting is not None
    writer._starting.join(30)
    assert "did not start" in caplog.text
    for _ in range(20):
        assert writer.ready() is False
    assert len(spawned) == 1, "a child that cannot start was spawned again before the delay"


def test_the_tracker_writes_batches_itself_until_its_writer_process_is_ready(store: Store) -> None:
    """A ``"process"`` tracker whose child is not ready yet records the batch in its own thread."""
    app = Celery("not-ready", set_as_current=False)
    app.conf.update(
        boundedbeat_database_url=store.engine.url.render_as_string(hide_password=False),
        boundedbeat_report_writer="process",
    )
    tracker = Tracker(app)
    never = ReportProcess("sqlite://", 1)
    never.ready = lambda: False  # type: ignore[method-assign]
    tracker._reports = never
    (ids,) = emit_copies(store, "early-")
    run = ids[(0, 0)]
    tracker._write_many([StartReport(run, "w", "h:1", T0, None)], [], None)
    written = store.run(run)
    assert written is not None and written.state == "started"


@pytest.mark.postgres
def test_a_batch_the_database_refuses_in_the_writer_process_is_refused_not_an_outage(
    migrated_postgres_url: str,
) -> None:
    """A data error in the child comes back as ``ReportsRefused`` (the tracker then goes one by one)."""
    engine = get_engine(migrated_postgres_url)
    store = Store(engine)
    (ids,) = emit_copies(store, "bad-")
    writer = ReportProcess(migrated_postgres_url, store.run_life.failing_threshold)
    try:
        with pytest.raises((ReportsRefused, ReportWriterLost)) as refused:
            writer.write([StartReport(ids[(0, 0)], "w" * 300, "h:1", T0, None)], [], None)
    finally:
        writer.close()
        dispose_all()
    assert isinstance(refused.value, ReportsRefused), refused.value
    assert "too long" in str(refused.value) and not is_outage(refused.value)


def test_a_batch_writes_its_heartbeat_first_and_notes_a_late_outcome_once(store: Store) -> None:
    """A first start brings the process's heartbeat row; an outcome after ``lost`` is a note only."""
    (ids,) = emit_copies(store, "hb-")
    a, b = ids[(0, 0)], ids[(1, 0)]
    beat = Beat(process="h:7", hostname="h", pid=7, at=T0 + sec(1))
    assert write_reports(store, [StartReport(a, "w", "h:7", T0 + sec(1), None)], [], beat=beat) == []
    with store.session() as s:
        assert s.get(WorkerRow, "h:7") is not None
    store.run_life.settle_run(a, RunState.LOST, now=T0 + sec(5), error="heartbeat stopped")
    done = write_reports(
        store,
        [StartReport(b, "w", "h:7", T0 + sec(2), None)],
        [
            OutcomeReport(a, RunState.COMPLETED, T0 + sec(6), None, False),
            OutcomeReport(b, RunState.COMPLETED, T0 + sec(3), None, False),
            OutcomeReport(b, RunState.FAILED, T0 + sec(4), "dup", False),
        ],
    )
    assert [d is not None for d in done] == [False, True, False]
    run_a, run_b = store.run(a), store.run(b)
    assert run_a is not None and run_a.state == "lost" and (run_a.error or "").count(LATE_OUTCOME) == 1
    assert run_b is not None and (run_b.state, run_b.elapsed_ms, run_b.error) == ("completed", 1000, None)


def show_differences(a: dict[str, Any], b: dict[str, Any]) -> None:
    for part in a:
        for key in sorted(set(a[part]) | set(b[part]) if isinstance(a[part], dict) else []):
            if a[part].get(key) != b[part].get(key):
                print(part, key, "\n  got     ", b[part].get(key), "\n  expected", a[part].get(key))

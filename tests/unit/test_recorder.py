"""IterationRecorder: one owner for how failed background iterations are logged, kept and written."""

from __future__ import annotations

import logging

import pytest

from celery_boundedbeat.core.loops import IterationRecord, IterationRecorder


class Outage(Exception):
    """Stands for a lost database connection."""


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Sink:
    """A ``write`` that stores records, or raises while ``down``."""

    def __init__(self) -> None:
        self.rows: list[IterationRecord] = []
        self.down = False
        self.attempts = 0

    def __call__(self, record: IterationRecord) -> None:
        self.attempts += 1
        if self.down:
            raise Outage("database down")
        self.rows.append(record)


def recorder(sink: Sink, clock: FakeClock | None = None, capacity: int = 500) -> IterationRecorder:
    return IterationRecorder(
        sink,
        logger=logging.getLogger("t.recorder"),
        is_outage=lambda exc: isinstance(exc, Outage),
        label="beat ",
        capacity=capacity,
        clock=clock or FakeClock(),
    )


def test_a_failure_that_is_no_outage_is_written_at_once() -> None:
    """A failed iteration that is not an outage is written at once, with its name, start and error."""
    sink = Sink()
    rec = recorder(sink)
    rec.failed("tick", RuntimeError("tick bug"), 1000.0)
    assert [(r.name, r.started_at, r.error) for r in sink.rows] == [
        ("tick", 1000.0, "RuntimeError: tick bug")
    ]
    assert sink.rows[0].finished_at >= 1000.0
    assert rec.down_since is None and rec.unwritten == 0


def test_outage_failures_wait_for_the_next_success_and_are_written_in_order() -> None:
    """After an outage nothing is written until a success, which writes all in order and times the outage."""
    sink, clock = Sink(), FakeClock()
    sink.down = True
    rec = recorder(sink, clock)
    rec.failed("lease renewal", Outage("refused"), 1.0)
    clock.now += 4.0
    rec.failed("tick", Outage("refused"), 2.0)
    rec.failed("tick", RuntimeError("bug"), 3.0)  # written at once: the database is tried
    assert sink.attempts == 1, "only the failure that was no outage tried the database"
    assert rec.unwritten == 3
    sink.down = False
    clock.now += 2.5
    assert rec.succeeded("tick") == pytest.approx(6.5)
    assert [r.started_at for r in sink.rows] == [1.0, 2.0, 3.0]
    assert rec.unwritten == 0 and rec.down_since is None
    assert rec.succeeded("tick") is None, "a success outside an outage reports nothing"


def test_the_dispatchers_failed_iterations_are_kept_and_written_by_the_next_flush() -> None:
    """record() (the dispatcher's callback) keeps only failed iterations; the next success writes them."""
    sink = Sink()
    rec = recorder(sink)
    rec.record(IterationRecord(name="dispatch", started_at=1.0, finished_at=2.0, error=None))
    rec.record(IterationRecord(name="dispatch", started_at=3.0, finished_at=4.0, error="RuntimeError: drain"))
    assert sink.attempts == 0 and rec.unwritten == 1
    assert rec.succeeded("tick") is None
    assert [(r.name, r.error) for r in sink.rows] == [("dispatch", "RuntimeError: drain")]


def test_a_write_that_fails_stops_the_flush_and_keeps_the_order() -> None:
    """When a write fails the flush stops there; the next one resumes with the same record."""
    sink = Sink()
    rec = recorder(sink)
    for n in range(3):
        rec.record(IterationRecord(name="dispatch", started_at=float(n), finished_at=float(n), error="E"))
    sink.down = True
    assert rec.flush() is False
    assert rec.unwritten == 3
    sink.down = False
    assert rec.flush() is True
    assert [r.started_at for r in sink.rows] == [0.0, 1.0, 2.0]


def test_the_queue_keeps_the_newest_failures_up_to_its_capacity() -> None:
    """While the database is out the queue is bounded: the oldest records give way to the newest."""
    sink = Sink()
    rec = recorder(sink, capacity=3)
    for n in range(5):
        rec.failed("tick", Outage("down"), float(n))
    assert rec.unwritten == 3
    rec.succeeded("tick")
    assert [r.started_at for r in sink.rows] == [2.0, 3.0, 4.0]


def test_each_loop_logs_one_traceback_per_streak_under_its_label(caplog: pytest.LogCaptureFixture) -> None:
    """Each loop has its own streak: a traceback on its first failure, then quiet, then one 'works again'."""
    rec = recorder(Sink())
    with caplog.at_level(logging.INFO, logger="t.recorder"):
        for _ in range(3):
            rec.failed("tick", Outage("down"), 0.0)
        rec.failed("reap", Outage("down"), 0.0)
        rec.succeeded("tick")
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info]
    assert tracebacks == [
        "celery_boundedbeat: beat tick failed; retrying",
        "celery_boundedbeat: beat reap failed; retrying",
    ]
    assert any("beat tick works again" in r.getMessage() for r in caplog.records)
    assert not any("beat reap works again" in r.getMessage() for r in caplog.records)
    assert rec.outage_log("reap").failing and not rec.outage_log("tick").failing


def test_a_record_the_database_refuses_is_dropped_and_later_records_are_written() -> None:
    """A data error on one record (not an outage) drops that record only; the rest are written in order."""
    written: list[str] = []

    def write(record: IterationRecord) -> None:
        if "\x00" in (record.error or ""):
            raise ValueError("PostgreSQL text fields cannot contain NUL (0x00) bytes")
        written.append(record.name)

    rec = IterationRecorder(
        write,
        logger=logging.getLogger("t.recorder"),
        is_outage=lambda exc: isinstance(exc, Outage),
    )
    rec.record(IterationRecord(name="bad", started_at=1.0, finished_at=2.0, error="Bad: \x00"))
    rec.record(IterationRecord(name="good", started_at=3.0, finished_at=4.0, error="Err: x"))
    assert rec.flush() is True
    assert written == ["good"] and rec.unwritten == 0

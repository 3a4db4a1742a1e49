"""The worker's write-behind queue: batched, retried in order through outages, never stalled by bad data."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from sqlalchemy.exc import DataError, OperationalError

from celery_boundedbeat.core.enums import RunState
from celery_boundedbeat.db.runs import Settled
from celery_boundedbeat.worker.tracking import BATCH, Tracker
from celery_boundedbeat.worker.worklog import Beat, OutcomeReport, StartReport


class FakeStore:
    """Records settles; refuses error texts while ``refuse_errors``, everything while ``down``."""

    def __init__(self) -> None:
        self.down = False
        self.refuse_errors = False
        self.written: list[tuple[str, RunState, str | None]] = []
        #: (starts, outcomes) of each batch written whole.
        self.batches: list[tuple[list[str], list[str]]] = []
        #: The run transitions are the store's ``run_life``: here the fake itself.
        self.run_life = self

    def write_many(self, starts: list[StartReport], outcomes: list[OutcomeReport]) -> list[Settled | None]:
        """A batch is one transaction: refused or written whole."""
        if self.down:
            raise OperationalError("UPDATE", {}, ConnectionRefusedError("database is down"))
        if self.refuse_errors and any(o.error is not None for o in outcomes):
            raise DataError("UPDATE", {}, ValueError("invalid byte sequence"))
        self.batches.append(([s.run_id for s in starts], [o.run_id for o in outcomes]))
        self.written += [(o.run_id, o.state, o.error) for o in outcomes]
        return [Settled(run_id=o.run_id, schedule="s", state=o.state, elapsed_ms=1) for o in outcomes]

    def settle_run(self, run_id: str, state: RunState, *, error: str | None = None, **_: Any) -> Settled:
        if self.down:
            raise OperationalError("UPDATE", {}, ConnectionRefusedError("database is down"))
        if self.refuse_errors and error is not None and "not recordable" not in error:
            raise DataError("UPDATE", {}, ValueError("invalid byte sequence"))
        self.written.append((run_id, state, error))
        return Settled(run_id=run_id, schedule="s", state=state, elapsed_ms=1)

    def heartbeat(self, *_: Any) -> None:
        pass

    def start_run(self, *_: Any, **__: Any) -> bool:
        return True


class FakeTracker(Tracker):
    """No writer thread: the tests flush themselves, so what is written when is deterministic."""

    def __init__(self, store: FakeStore) -> None:
        super().__init__(Celery("t", set_as_current=False))
        self.fake = store

    @property
    def store(self) -> Any:  # type: ignore[override]
        return self.fake

    def _ensure_heartbeat(self) -> None:
        pass

    def _write_many(self, starts: Any, outcomes: Any, beat: Beat | None) -> list[Settled | None]:
        return self.fake.write_many(starts, outcomes)


@pytest.fixture
def tracker() -> FakeTracker:
    return FakeTracker(FakeStore())


def test_a_data_error_records_the_outcome_without_its_text_and_later_writes_go_on(
    tracker: FakeTracker,
) -> None:
    """An outcome the database refuses is recorded without its error text; the next one is not held."""
    tracker.fake.refuse_errors = True
    tracker.settle("r1", RunState.FAILED, "boom")
    tracker.settle("r2", RunState.COMPLETED)
    assert tracker.flush() is True
    assert [(run, state) for run, state, _ in tracker.fake.written] == [
        ("r1", RunState.FAILED),
        ("r2", RunState.COMPLETED),
    ]
    assert "not recordable: DataError" in (tracker.fake.written[0][2] or "")
    assert tracker.fake.batches == [] and not tracker._queue


def test_reports_are_queued_without_waiting_and_written_as_one_batch_starts_first(
    tracker: FakeTracker,
) -> None:
    """The task thread only queues; one flush writes everything queued, in batches of ``BATCH``."""
    tracker.started("r1", "w@h", None)
    tracker.settle("r0", RunState.COMPLETED)
    tracker.settle("r1", RunState.COMPLETED)
    tracker.settle("r1", RunState.FAILED, "a second report of r1")  # dropped: the first one wins
    assert tracker.fake.written == [] and len(tracker._queue) == 3
    assert tracker.flush() is True
    assert tracker.fake.batches == [(["r1"], ["r0", "r1"])]
    for n in range(BATCH + 1):
        tracker.settle(f"b{n}", RunState.COMPLETED)
    assert tracker.flush() is True
    assert [len(outcomes) for _, outcomes in tracker.fake.batches[1:]] == [BATCH, 1]
    assert [run for run, _, _ in tracker.fake.written[2:]] == [f"b{n}" for n in range(BATCH + 1)]


def test_an_outage_keeps_every_write_in_order_until_the_database_returns(tracker: FakeTracker) -> None:
    """During an outage nothing is dropped; afterwards the kept writes land in their order."""
    tracker.fake.down = True
    tracker.settle("r1", RunState.FAILED, "boom")
    tracker.settle("r2", RunState.COMPLETED)
    assert tracker.fake.written == []
    assert tracker.flush() is False
    tracker.fake.down = False
    assert tracker.flush() is True
    assert [run for run, _, _ in tracker.fake.written] == ["r1", "r2"]
    assert tracker.fake.written[0][2] == "boom"


def test_a_refused_fallback_during_an_outage_is_retried_not_dropped(tracker: FakeTracker) -> None:
    """If the database goes away between the refusal and the fallback write, the outcome is kept."""
    tracker.fake.refuse_errors = True
    original = tracker.fake.settle_run
    gone = {"now": True}

    def flaky(run_id: str, state: RunState, **kw: Any) -> Settled:
        if gone["now"] and "not recordable" in (kw.get("error") or ""):  # the fallback write
            raise OperationalError("UPDATE", {}, ConnectionRefusedError("gone"))
        return original(run_id, state, **kw)

    tracker.fake.settle_run = flaky  # type: ignore[method-assign]
    tracker.settle("r1", RunState.FAILED, "boom")
    assert tracker.flush() is False  # refused, then the fallback met the outage: kept
    assert tracker.fake.written == [] and len(tracker._queue) == 1
    gone["now"] = False
    assert tracker.flush() is True
    assert [(run, state) for run, state, _ in tracker.fake.written] == [("r1", RunState.FAILED)]


def test_unknown_task_settles_rejected_and_logs_the_name_once(
    tracker: FakeTracker, caplog: pytest.LogCaptureFixture
) -> None:
    """A run of a task the worker does not know settles rejected at once, its name logged once."""
    tracker.unknown_task("r1", "proj.nosuch")
    tracker.unknown_task("r2", "proj.nosuch")
    assert tracker.flush() is True
    assert [(run, state) for run, state, _ in tracker.fake.written] == [
        ("r1", RunState.REJECTED),
        ("r2", RunState.REJECTED),
    ]
    assert "proj.nosuch" in (tracker.fake.written[0][2] or "")
    assert sum("not registered in this worker" in r.getMessage() for r in caplog.records) == 1


def test_error_texts_are_stored_with_nul_and_lone_surrogates_escaped() -> None:
    """NUL and lone surrogates (a non-UTF-8 file name) become escapes every database stores."""
    from celery_boundedbeat.core.messages import error_text

    text = error_text(ValueError("cannot read /data/caf\udce9\x00.csv"))
    assert "\x00" not in text and "\udce9" not in text
    text.encode("utf-8")  # strict: would raise on a lone surrogate
    assert "\\udce9" in text and "\\x00" in text


def test_during_an_outage_new_reports_do_not_hasten_the_next_attempt(tracker: FakeTracker) -> None:
    """The writer sleeps until the retry time however many reports arrive, then tries at once."""
    tracker.fake.down = True
    tracker.settle("r1", RunState.COMPLETED)
    assert tracker.flush() is False
    first = tracker._idle_for(10.0)
    tracker.settle("r2", RunState.COMPLETED)
    assert 0.5 < tracker._idle_for(10.0) <= first <= 1.0
    tracker._retry_at = 0.0  # the retry time has come
    assert tracker._idle_for(10.0) == 0.0
    assert tracker._idle_for(10.0) == 0.0 and len(tracker._queue) == 2
    tracker.fake.down = False
    assert tracker.flush() is True and tracker._idle_for(10.0) == 10.0


def test_a_write_that_fails_once_after_success_is_tried_again_at_once(tracker: FakeTracker) -> None:
    """A cut connection fails one write; the next connection works: no second of waiting.

    Before, every report of the process waited the outage's retry second, and the runs that had
    ended kept their slots: the next tick of each of their schedules was skipped as busy.
    """
    original = tracker.fake.write_many
    calls = {"n": 0}

    def cut_once(starts: list[StartReport], outcomes: list[OutcomeReport]) -> list[Settled | None]:
        calls["n"] += 1
        if calls["n"] in (2, 5):  # the connection is cut under the second and the fifth write
            raise OperationalError("UPDATE", {}, ConnectionResetError("terminating connection"))
        return original(starts, outcomes)

    tracker.fake.write_many = cut_once  # type: ignore[method-assign]
    for n in range(3):
        tracker.settle(f"r{n}", RunState.COMPLETED)
        assert tracker.flush() is True, f"r{n} kept for a retry"
        assert tracker._idle_for(10.0) == 10.0
    assert [run for run, _, _ in tracker.fake.written] == ["r0", "r1", "r2"]
    tracker.fake.down = True  # a real outage: tried twice, then every second as before
    tracker.settle("r3", RunState.COMPLETED)
    assert tracker.flush() is False
    assert 0.5 < tracker._idle_for(10.0) <= 1.0
    tracker._retry_at = 0.0
    assert tracker.flush() is False and calls["n"] == 7, "a retry during an outage is one attempt"
    tracker.fake.down = False
    assert tracker.flush() is True
    assert [run for run, _, _ in tracker.fake.written] == ["r0", "r1", "r2", "r3"]


def test_stop_ends_the_writer_and_heartbeat_threads_of_a_busy_tracker() -> None:
    """A run still active keeps the heartbeat thread beating; ``stop`` ends both threads anyway
    (a tracker dropped while its process goes on must not beat for ever)."""

    class Threaded(FakeTracker):
        _ensure_heartbeat = Tracker._ensure_heartbeat

    tracker = Threaded(FakeStore())
    tracker.app.conf.update(boundedbeat_database_url="sqlite://", boundedbeat_heartbeat_interval=0.05)
    tracker.started("r1", "w", None)
    threads = [tracker._writer_thread, tracker._hb_thread]
    assert all(t is not None and t.is_alive() for t in threads)
    tracker.stop(timeout=5)
    assert not any(t is not None and t.is_alive() for t in threads)

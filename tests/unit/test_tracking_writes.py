"""The worker's write-behind buffer retries outages in order and never stalls on a data error."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from sqlalchemy.exc import DataError, OperationalError

from celery_boundedbeat.enums import RunState
from celery_boundedbeat.store import Settled
from celery_boundedbeat.tracking import Tracker


class FakeStore:
    """Records settles; refuses error texts while ``refuse_errors``, everything while ``down``."""

    def __init__(self) -> None:
        self.down = False
        self.refuse_errors = False
        self.written: list[tuple[str, RunState, str | None]] = []

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
    def __init__(self, store: FakeStore) -> None:
        super().__init__(Celery("t", set_as_current=False))
        self.fake = store

    @property
    def store(self) -> Any:  # type: ignore[override]
        return self.fake


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
    assert [(run, state) for run, state, _ in tracker.fake.written] == [
        ("r1", RunState.FAILED),
        ("r2", RunState.COMPLETED),
    ]
    assert "not recordable: DataError" in (tracker.fake.written[0][2] or "")
    assert tracker.flush() is True


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
    calls = {"n": 0}

    def flaky(run_id: str, state: RunState, **kw: Any) -> Settled:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OperationalError("UPDATE", {}, ConnectionRefusedError("gone"))
        return original(run_id, state, **kw)

    tracker.fake.settle_run = flaky  # type: ignore[method-assign]
    tracker.settle("r1", RunState.FAILED, "boom")
    assert tracker.fake.written == []
    assert tracker.flush() is True
    assert [(run, state) for run, state, _ in tracker.fake.written] == [("r1", RunState.FAILED)]


def test_unknown_task_settles_rejected_and_logs_the_name_once(
    tracker: FakeTracker, caplog: pytest.LogCaptureFixture
) -> None:
    """A run of a task the worker does not know settles rejected at once, its name logged once."""
    tracker.unknown_task("r1", "proj.nosuch")
    tracker.unknown_task("r2", "proj.nosuch")
    assert [(run, state) for run, state, _ in tracker.fake.written] == [
        ("r1", RunState.REJECTED),
        ("r2", RunState.REJECTED),
    ]
    assert "proj.nosuch" in (tracker.fake.written[0][2] or "")
    assert sum("not registered in this worker" in r.getMessage() for r in caplog.records) == 1


def test_error_texts_are_stored_with_nul_and_lone_surrogates_escaped() -> None:
    """NUL and lone surrogates (a non-UTF-8 file name) become escapes every database stores."""
    from celery_boundedbeat.messages import error_text

    text = error_text(ValueError("cannot read /data/caf\udce9\x00.csv"))
    assert "\x00" not in text and "\udce9" not in text
    text.encode("utf-8")  # strict: would raise on a lone surrogate
    assert "\\udce9" in text and "\\x00" in text

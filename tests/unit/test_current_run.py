"""``current_run()``: the grid time in the message, read back inside the task, gone after it."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery
from celery.app.task import Context

import celery_boundedbeat
from celery_boundedbeat import CurrentRun, current_run
from celery_boundedbeat.core.messages import (
    RUN_HEADER,
    SCHEDULE_HEADER,
    SCHEDULED_FOR_HEADER,
    message_options,
    parse_scheduled_for,
)
from celery_boundedbeat.core.policy import Policy
from celery_boundedbeat.worker import receivers

RUN_ID = "6f1c2a3e-0000-4000-8000-000000000001"
GRID = datetime(2026, 12, 1, 6, 0, 5, 250000, tzinfo=UTC)


def test_the_grid_time_travels_in_a_header_in_utc() -> None:
    """``message_options(..., scheduled_for=)`` adds the header as ISO 8601 UTC; without it, none."""
    local = GRID.astimezone(timezone(timedelta(hours=2)))
    headers = message_options({}, Policy(), RUN_ID, "s", scheduled_for=local)["headers"]
    assert headers[SCHEDULED_FOR_HEADER] == "2026-12-01T06:00:05.250000+00:00"
    assert SCHEDULED_FOR_HEADER not in message_options({}, Policy(), RUN_ID, "s")["headers"]


@pytest.mark.parametrize(
    ("raw", "parsed"),
    [
        ("2026-12-01T06:00:05.250000+00:00", GRID),
        ("2026-12-01T08:00:05.250000+02:00", GRID),
        ("2026-12-01T06:00:05.250000", GRID),  # naive: written in UTC
        ("yesterday", None),
        (None, None),
        (1764568805, None),
    ],
)
def test_the_header_reads_back_as_an_aware_utc_time(raw: object, parsed: datetime | None) -> None:
    """Any offset becomes UTC; what is not an ISO 8601 string reads as absent."""
    value = parse_scheduled_for(raw)
    assert value == parsed
    assert value is None or value.tzinfo is UTC


class FakeTracker:
    """Stands in for the worker's tracker: counts run-row reads, writes nothing."""

    def __init__(self, rows: dict[str, Any] | None = None) -> None:
        self.rows = rows or {}
        self.reads = 0
        self.settled: list[str] = []

    @property
    def store(self) -> FakeTracker:
        return self

    def run(self, run_id: str) -> Any:
        self.reads += 1
        return self.rows.get(run_id)

    def begin(self, run_id: str, hostname: str, limit: float | None, *, retried: bool = False) -> bool:
        return True

    def settle(self, run_id: str, state: Any, error: str | None = None) -> None:
        self.settled.append(run_id)


@pytest.fixture
def app() -> Iterator[Celery]:
    app = Celery("currentrun", broker="memory://", set_as_current=False)
    yield app
    receivers._trackers.pop(app, None)


def task_with(app: Celery, tracker: FakeTracker, **headers: Any) -> Any:
    receivers._trackers[app] = tracker  # type: ignore[assignment]
    request = Context({"id": RUN_ID, "hostname": "w1@h", "timelimit": (None, None), **headers})
    return SimpleNamespace(app=app, request=request)


def test_outside_any_task_there_is_no_current_run() -> None:
    """A plain function call, or a thread that never ran a task, sees ``None``."""
    assert current_run() is None
    assert celery_boundedbeat.current_run is current_run


def test_inside_a_run_the_headers_answer_without_a_query(app: Celery) -> None:
    """id, schedule and the aware UTC grid time, from the headers; after the task: ``None``."""
    tracker = FakeTracker()
    task = task_with(
        app,
        tracker,
        **{RUN_HEADER: RUN_ID, SCHEDULE_HEADER: "report", SCHEDULED_FOR_HEADER: GRID.isoformat()},
    )
    receivers._on_prerun(sender=task, task_id=RUN_ID, task=task)
    try:
        assert current_run() == CurrentRun(id=RUN_ID, schedule="report", scheduled_for=GRID)
        assert current_run() is current_run()  # built once per run
        assert tracker.reads == 0
    finally:
        receivers._on_postrun(sender=task, task_id=RUN_ID, task=task, state="SUCCESS")
    assert current_run() is None
    assert tracker.settled == [RUN_ID]


def test_a_message_without_the_grid_time_is_answered_from_the_run_row_once(app: Celery) -> None:
    """A message queued before the header existed: one read of the run's row, then cached."""
    tracker = FakeTracker({RUN_ID: SimpleNamespace(schedule="report", scheduled_for=GRID)})
    task = task_with(app, tracker, **{RUN_HEADER: RUN_ID, SCHEDULE_HEADER: "report"})
    receivers._on_prerun(sender=task, task_id=RUN_ID, task=task)
    try:
        assert current_run() == CurrentRun(id=RUN_ID, schedule="report", scheduled_for=GRID)
        assert current_run() is not None
        assert tracker.reads == 1
    finally:
        receivers._on_postrun(sender=task, task_id=RUN_ID, task=task, state="SUCCESS")


def test_a_task_that_is_not_a_scheduled_run_has_none(app: Celery) -> None:
    """A task sent by other code (no run header) sees ``None`` even with tracking installed."""
    task = task_with(app, FakeTracker())
    receivers._on_prerun(sender=task, task_id="other", task=task)
    try:
        assert current_run() is None
    finally:
        receivers._on_postrun(sender=task, task_id="other", task=task, state="SUCCESS")

"""Backoff, jitter and loop helpers (core.loops), with no real sleeps to speak of."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest

from celery_boundedbeat.core.loops import (
    ERROR_BACKOFF_FLOOR,
    BackgroundLoop,
    DispatchBackoff,
    Iteration,
    IterationRecord,
    Trigger,
    effective_jitter_cap,
    run_dispatch_loop,
    run_recorded_iteration,
)

IDLE = Iteration()
ACTIVE = Iteration(has_activity=True)
FAILED = Iteration(failed=True)


# -- DispatchBackoff -------------------------------------------------------------------------


def test_zero_base_interval_uses_the_one_second_minimum() -> None:
    """A zero base interval sleeps 1 s, then 2 s after an idle drain."""
    backoff = DispatchBackoff(0)
    assert backoff.sleep_duration(0, 30) == 1.0
    backoff.record(Trigger.TIMER, IDLE, 0, 30)
    assert backoff.sleep_duration(0, 30) == 2.0


def test_backoff_grows_on_idle_and_caps() -> None:
    """Idle drains double the sleep (5, 10, 20) until the max (30), where it stays."""
    backoff = DispatchBackoff(5)
    seen = [backoff.sleep_duration(5, 30)]
    for _ in range(4):
        backoff.record(Trigger.TIMER, IDLE, 5, 30)
        seen.append(backoff.sleep_duration(5, 30))
    assert seen == [5, 10, 20, 30, 30]


def test_backoff_resets_on_wakeup_and_activity() -> None:
    """A wakeup or a drain that did work resets the sleep to the base interval."""
    backoff = DispatchBackoff(5)
    backoff.record(Trigger.TIMER, IDLE, 5, 60)
    backoff.record(Trigger.TIMER, IDLE, 5, 60)
    assert backoff.sleep_duration(5, 60) == 20
    backoff.record(Trigger.WAKEUP, IDLE, 5, 60)
    assert backoff.sleep_duration(5, 60) == 5
    backoff.record(Trigger.TIMER, IDLE, 5, 60)
    assert backoff.sleep_duration(5, 60) == 10
    backoff.record(Trigger.TIMER, ACTIVE, 5, 60)
    assert backoff.sleep_duration(5, 60) == 5


def test_backoff_never_polls_faster_than_normal_after_an_error() -> None:
    """After a failed drain the loop sleeps max(base, 5 s); the next idle drain doubles from the base."""
    backoff = DispatchBackoff(30)
    backoff.record(Trigger.TIMER, FAILED, 30, 120)
    assert backoff.sleep_duration(30, 120) == 30

    short = DispatchBackoff(1)
    short.record(Trigger.TIMER, FAILED, 1, 120)
    assert short.sleep_duration(1, 120) == ERROR_BACKOFF_FLOOR == 5.0

    backoff.record(Trigger.TIMER, IDLE, 30, 120)
    assert backoff.sleep_duration(30, 120) == 60


def test_backoff_follows_changed_intervals() -> None:
    """The latest base and max are honoured: a max below the base is raised to the base."""
    backoff = DispatchBackoff(5)
    for _ in range(3):
        backoff.record(Trigger.TIMER, IDLE, 5, 30)
    assert backoff.sleep_duration(5, 30) == 30
    assert backoff.sleep_duration(5, 8) == 8
    assert backoff.sleep_duration(50, 8) == 50


# -- effective_jitter_cap --------------------------------------------------------------------


def test_effective_jitter_cap_is_a_tenth_of_the_interval_at_most() -> None:
    """A 30 s jitter cap on a 5 s (or a 1 s) interval allows a tenth of the interval."""
    assert effective_jitter_cap(5, 30) == 0.5
    assert effective_jitter_cap(1, 30) == 0.1


def test_effective_jitter_cap_uses_a_smaller_requested_cap() -> None:
    """On a one-hour interval a 30 s cap (below 10 %) is the bound."""
    assert effective_jitter_cap(3600, 30) == 30


def test_effective_jitter_cap_handles_a_zero_interval() -> None:
    """A zero interval allows no jitter at all."""
    assert effective_jitter_cap(0, 30) == 0
    assert effective_jitter_cap(100, 30) == 10
    assert effective_jitter_cap(100, 3) == 3


# -- run_recorded_iteration ------------------------------------------------------------------


def test_recorded_iteration_records_success() -> None:
    """A successful iteration returns its result and is recorded once, without an error."""
    records: list[IterationRecord] = []
    result = run_recorded_iteration("cleanup", lambda: ACTIVE, logging.getLogger("t"), records.append)
    assert result == ACTIVE
    assert len(records) == 1
    assert records[0].name == "cleanup"
    assert records[0].error is None
    assert records[0].finished_at >= records[0].started_at


def test_recorded_iteration_survives_an_exception_and_records_it(caplog: pytest.LogCaptureFixture) -> None:
    """An exception becomes a failed iteration, is logged with its traceback and recorded."""
    records: list[IterationRecord] = []

    def boom() -> Iteration:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="t"):
        result = run_recorded_iteration("cleanup", boom, logging.getLogger("t"), records.append)
    assert result.failed is True
    assert [r.error for r in records] == ["RuntimeError: boom"]
    assert any(r.exc_info for r in caplog.records)
    assert "cleanup" in caplog.text


def test_recorded_iteration_without_an_outage_log_logs_every_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without an outage log every failure is logged with its traceback, not only a streak's first."""

    def boom() -> Iteration:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="t"):
        for _ in range(3):
            run_recorded_iteration("cleanup", boom, logging.getLogger("t"))
    assert len([r for r in caplog.records if r.exc_info]) == 3


def test_recorded_iteration_survives_a_failing_recorder(caplog: pytest.LogCaptureFixture) -> None:
    """A recorder that raises is logged and does not hide the iteration's own result."""

    def bad_record(_record: IterationRecord) -> None:
        raise OSError("db down")

    with caplog.at_level(logging.ERROR, logger="t"):
        result = run_recorded_iteration("cleanup", lambda: ACTIVE, logging.getLogger("t"), bad_record)
    assert result == ACTIVE
    assert "could not record" in caplog.text


# -- run_dispatch_loop -----------------------------------------------------------------------


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


def test_dispatch_loop_drains_at_startup_wakes_on_event_and_stops_on_shutdown() -> None:
    """The loop drains once at startup, once per wakeup (long timer notwithstanding) and ends on shutdown."""
    shutdown, wakeup = threading.Event(), threading.Event()
    calls: list[float] = []

    def drain() -> Iteration:
        calls.append(time.monotonic())
        return IDLE

    thread = threading.Thread(
        target=run_dispatch_loop, args=(shutdown, wakeup, drain, lambda: 60.0, lambda: 120.0), daemon=True
    )
    thread.start()
    assert wait_for(lambda: len(calls) == 1)
    time.sleep(0.1)
    assert len(calls) == 1  # the timer is a minute away: no extra drain
    wakeup.set()
    assert wait_for(lambda: len(calls) == 2)
    shutdown.set()
    wakeup.set()
    thread.join(2)
    assert not thread.is_alive()
    assert len(calls) == 2


def test_dispatch_loop_polls_on_its_timer() -> None:
    """Without wakeups the loop drains again when its (short) timer expires."""
    shutdown, wakeup = threading.Event(), threading.Event()
    calls: list[float] = []

    def drain() -> Iteration:
        calls.append(time.monotonic())
        return ACTIVE

    thread = threading.Thread(
        target=run_dispatch_loop, args=(shutdown, wakeup, drain, lambda: 0.02, lambda: 0.02), daemon=True
    )
    thread.start()
    assert wait_for(lambda: len(calls) >= 4)
    shutdown.set()
    thread.join(2)
    assert not thread.is_alive()


def test_dispatch_loop_with_shutdown_already_set_does_not_drain() -> None:
    """A loop started after shutdown returns without draining."""
    shutdown, wakeup = threading.Event(), threading.Event()
    shutdown.set()
    calls: list[int] = []

    def drain() -> Iteration:
        calls.append(1)
        return IDLE

    run_dispatch_loop(shutdown, wakeup, drain, lambda: 1.0, lambda: 1.0)
    assert calls == []


def test_background_loop_stops_within_its_grace() -> None:
    """BackgroundLoop.stop wakes the loop and reports that it ended."""
    drains: list[int] = []

    def drain() -> Iteration:
        drains.append(1)
        return IDLE

    def target(shutdown: threading.Event, wakeup: threading.Event) -> None:
        run_dispatch_loop(shutdown, wakeup, drain, lambda: 60.0, lambda: 60.0)

    loop = BackgroundLoop("test-loop", target)
    loop.start()
    assert wait_for(lambda: drains == [1])
    assert loop.alive
    loop.wake()
    assert wait_for(lambda: len(drains) == 2)
    assert loop.stop(grace=2) is True
    assert not loop.alive


def test_background_loop_reports_a_loop_that_ignores_shutdown() -> None:
    """A loop that does not end within the grace period is reported, not waited for forever."""
    release = threading.Event()

    def stubborn(_shutdown: threading.Event, _wakeup: threading.Event) -> None:
        release.wait(5)

    loop = BackgroundLoop("stubborn", stubborn)
    loop.start()
    started = time.monotonic()
    assert loop.stop(grace=0.05) is False
    assert time.monotonic() - started < 1
    release.set()

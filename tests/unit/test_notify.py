"""The LISTEN thread against the real PostgreSQL: it delivers notifications and stops promptly."""

from __future__ import annotations

import queue
import time

import psycopg
import pytest

from celery_boundedbeat.engine import normalize_url
from celery_boundedbeat.notify import Listener

pytestmark = pytest.mark.timeout(60)


def _plain(url: str) -> str:
    return normalize_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def test_listener_delivers_notifications_and_stops_within_its_check_interval(postgres_url: str) -> None:
    """Beat's exit on SIGTERM waits for this thread: it must not sit out a long poll."""
    got: queue.Queue[tuple[str, str]] = queue.Queue()
    listener = Listener(postgres_url, ["bb_a", "bb_b"], lambda channel, payload: got.put((channel, payload)))
    listener.start()
    try:
        # On (re)connecting it asks everyone to look once: notifications may have been missed.
        first = {got.get(timeout=15), got.get(timeout=15)}
        assert first == {("bb_a", ""), ("bb_b", "")}
        with psycopg.connect(_plain(postgres_url), autocommit=True) as conn:
            conn.execute("SELECT pg_notify('bb_b', 'sched-1')")
            conn.execute("SELECT pg_notify('bb_other', 'not ours')")
            conn.execute("SELECT pg_notify('bb_a', '')")
        assert got.get(timeout=15) == ("bb_b", "sched-1")
        assert got.get(timeout=15) == ("bb_a", "")
    finally:
        # Just after a delivery the thread has begun a fresh wait: stopping now costs at most
        # one check interval (a one-second poll used to hold beat's exit for about a second).
        started = time.monotonic()
        ended = listener.stop(grace=10)
        took = time.monotonic() - started
    assert ended
    assert took < 0.7, f"stop() took {took:.2f} s"
    assert got.empty(), "a notification on another channel was delivered"

"""The LISTEN thread against the real PostgreSQL: it delivers, stops promptly, notices a dead connection."""

from __future__ import annotations

import queue
import time

import psycopg
import pytest
import tcpproxy

from celery_boundedbeat.db.engine import normalize_url
from celery_boundedbeat.db.notify import APPLICATION_NAME, PROBE_EVERY, PROBE_TIMEOUT, Listener

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


class Heard:
    """What a listener told its user, with whether it was listening at each call."""

    def __init__(self) -> None:
        self.calls: queue.Queue[tuple[str, str, bool]] = queue.Queue()
        self.listener: Listener | None = None

    def __call__(self, channel: str, payload: str) -> None:
        assert self.listener is not None
        self.calls.put((channel, payload, self.listener.listening))

    def until(self, wanted: tuple[str, str, bool], timeout: float) -> float:
        """Seconds until the call ``wanted`` came (others are skipped); fails after ``timeout``."""
        started = time.monotonic()
        deadline = started + timeout
        while True:
            try:
                got = self.calls.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {wanted} within {timeout:g} s") from None
            if got == wanted:
                return time.monotonic() - started


def test_a_listener_whose_connection_goes_silent_notices_it_within_its_probe_and_listens_again(
    postgres_url: str,
) -> None:
    """A half-open LISTEN connection (a proxy that stops forwarding, closing nothing) is noticed.

    Nothing fails on such a connection: the old listener kept "listening" while every
    notification was lost, for as long as the kernel's TCP keepalives took (hours). Now a
    silent connection is probed, found dead within ``PROBE_EVERY + PROBE_TIMEOUT``, its users
    are told (so they poll), and the listener listens again once the path is back.
    """
    heard = Heard()
    with tcpproxy.stalling_proxy(postgres_url, APPLICATION_NAME.encode()) as (proxy, url):
        listener = Listener(url, ["bb_a"], heard)
        heard.listener = listener
        listener.start()
        try:
            heard.until(("bb_a", "", True), timeout=15)  # listening: everyone looks once
            assert proxy.marked() == 1
            proxy.stall()
            took = heard.until(("bb_a", "", False), timeout=PROBE_EVERY + PROBE_TIMEOUT + 10)
            assert took <= PROBE_EVERY + PROBE_TIMEOUT + 3, f"a silent connection noticed after {took:.1f} s"
            assert not listener.listening
            time.sleep(1.0)  # reconnecting meanwhile: the new connection is stalled too
            assert not listener.listening
            proxy.resume()
            heard.until(("bb_a", "", True), timeout=20)
            assert proxy.marked() >= 2, "a new connection"
            with psycopg.connect(_plain(postgres_url), autocommit=True) as conn:
                conn.execute("SELECT pg_notify('bb_a', 'again')")
            heard.until(("bb_a", "again", True), timeout=10)
        finally:
            assert listener.stop(grace=10)


def test_a_listener_whose_backend_is_terminated_tells_its_users_and_reconnects(postgres_url: str) -> None:
    """``pg_terminate_backend`` on the listener: its users hear at once (they poll), then it listens again."""
    heard = Heard()
    listener = Listener(postgres_url, ["bb_a"], heard)
    heard.listener = listener
    listener.start()
    try:
        heard.until(("bb_a", "", True), timeout=15)
        with psycopg.connect(_plain(postgres_url), autocommit=True) as conn:
            ended = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = %s AND datname = current_database()",
                [APPLICATION_NAME],
            ).fetchall()
            assert ended == [(True,)]
            took = heard.until(("bb_a", "", False), timeout=10)
            assert took < 2.0, f"the terminated connection noticed after {took:.1f} s"
            heard.until(("bb_a", "", True), timeout=15)
            conn.execute("SELECT pg_notify('bb_a', 'again')")
        heard.until(("bb_a", "again", True), timeout=10)
    finally:
        assert listener.stop(grace=10)

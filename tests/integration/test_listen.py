"""A beat and a standalone dispatcher on PostgreSQL whose LISTEN connection dies or goes half-open.

Changes must never wait for the minute's backstop: while the listener is not known to be
listening they are polled for every ``poll_interval`` (1 s here, the default), and once it
listens again they are heard. The half-open connection is made by a proxy in the test
(``tcpproxy``) that stops forwarding the listener's connection without closing anything, as a
NAT gateway that dropped an idle flow does; the engine's connections go through it untouched.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
import tcpproxy
from celery import Celery
from sqlalchemy.engine import make_url

from celery_boundedbeat import add_schedule
from celery_boundedbeat.db.notify import APPLICATION_NAME, PROBE_EVERY, PROBE_TIMEOUT

from .harness import Harness
from .processes import Proc

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

#: How soon a runtime change must be acted on, heard or polled for (poll_interval is 1 s).
PICKUP = 2.0
#: The log lines of a listener that lost its connection and of one that listens again.
LOST = "celery_boundedbeat: LISTEN on"
BACK = "celery_boundedbeat: LISTEN reconnected"


@pytest.fixture
def proxied(bb: Harness) -> Iterator[tuple[tcpproxy.StallingProxy, str]]:
    """A proxy that can stall the listeners' connections, and the database URL through it."""
    with tcpproxy.stalling_proxy(bb.backend.database_url, APPLICATION_NAME.encode()) as made:
        yield made


def client_app(bb: Harness) -> Celery:
    """The test's own app, for runtime changes (straight to the database)."""
    app = Celery("listentest", broker="memory://", set_as_current=False)
    app.conf.boundedbeat_database_url = bb.backend.database_url
    return app


def added_and_run(bb: Harness, app: Celery, name: str) -> float:
    """Add a schedule due at once; seconds from the add until the beat emitted its first run."""
    added_at = time.time()
    assert add_schedule(app, name, f"{bb.module}.work", 3600.0, kwargs={"name": name}) == "scheduled"
    bb.wait_until(lambda: bb.runs(name), timeout=30, what=f"the first run of {name}")
    (run,) = bb.runs(name)
    return run.enqueued_at.timestamp() - added_at


def listener_pids(bb: Harness) -> list[int]:
    """The backends of the listeners on the test's database."""
    url = make_url(bb.backend.database_url)
    with psycopg.connect(host=url.host, port=url.port, user=url.username, dbname="postgres") as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
            [url.database, APPLICATION_NAME],
        ).fetchall()
    return [int(pid) for (pid,) in rows]


def logged_after(proc: Proc, needle: str, mark: int, timeout: float) -> float:
    """Seconds until ``proc`` logged ``needle`` after its first ``mark`` characters of output."""
    started = time.monotonic()
    deadline = started + timeout
    while needle not in proc.output()[mark:]:
        assert proc.alive, proc.tail(80)
        assert time.monotonic() < deadline, (
            f"{proc.name} did not log {needle!r} in {timeout:g} s\n{proc.tail(80)}"
        )
        time.sleep(0.1)
    return time.monotonic() - started


@pytest.mark.parametrize("backend", ["pg-rabbitmq"], indirect=True)
def test_a_half_open_listen_connection_is_noticed_the_beat_polls_and_then_listens_again(
    bb: Harness, proxied: tuple[tcpproxy.StallingProxy, str]
) -> None:
    """The listener's connection goes silent: noticed within seconds, changes polled for, then heard again.

    Before, the beat kept believing it was listening (for hours, the kernel's keepalive
    defaults) and a runtime change waited for the minute's backstop.
    """
    proxy, url = proxied
    bb.write_app({}, boundedbeat_database_url=url, boundedbeat_poll_interval=1.0)
    beat = bb.start_beat()
    app = client_app(bb)
    bb.wait_until(lambda: proxy.marked() == 1 and listener_pids(bb), timeout=20, what="the beat's listener")
    assert (took := added_and_run(bb, app, "heard")) < PICKUP, f"heard after {took:.2f} s"

    mark = len(beat.output())
    proxy.stall()
    noticed = logged_after(beat, LOST, mark, timeout=PROBE_EVERY + PROBE_TIMEOUT + 15)
    assert noticed <= PROBE_EVERY + PROBE_TIMEOUT + 4, f"the silent connection noticed after {noticed:.1f} s"
    for name in ("polled-1", "polled-2"):  # one look at the loss, then a look every second
        assert (took := added_and_run(bb, app, name)) < PICKUP, f"{name} picked up after {took:.2f} s"
        time.sleep(1.5)
    assert BACK not in beat.output()[mark:], "the stalled path let a new LISTEN through"

    proxy.resume()
    logged_after(beat, BACK, mark, timeout=30)
    assert proxy.marked() >= 2
    assert (took := added_and_run(bb, app, "heard-again")) < PICKUP, f"heard after {took:.2f} s"
    bb.assert_no_errors()


@pytest.mark.parametrize("backend", ["pg-rabbitmq"], indirect=True)
def test_a_terminated_listen_connection_loses_no_change(bb: Harness) -> None:
    """``pg_terminate_backend`` on the beat's listener: changes at once and after are picked up in 2 s."""
    bb.write_app({}, boundedbeat_poll_interval=1.0)
    beat = bb.start_beat()
    app = client_app(bb)
    (first,) = bb.wait_until(lambda: listener_pids(bb), timeout=20, what="the beat's listener")
    mark = len(beat.output())
    url = make_url(bb.backend.database_url)
    with psycopg.connect(host=url.host, port=url.port, user=url.username, dbname="postgres") as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", [first])
    assert (took := added_and_run(bb, app, "at-once")) < PICKUP, f"picked up after {took:.2f} s"
    logged_after(beat, BACK, mark, timeout=20)
    (second,) = bb.wait_until(lambda: listener_pids(bb), timeout=20, what="the new listener")
    assert second != first
    assert (took := added_and_run(bb, app, "after")) < PICKUP, f"picked up after {took:.2f} s"
    bb.assert_no_errors()


@pytest.mark.parametrize("backend", ["pg-rabbitmq"], indirect=True)
def test_a_standalone_dispatcher_with_a_half_open_listener_publishes_within_its_poll_interval(
    bb: Harness, proxied: tuple[tcpproxy.StallingProxy, str]
) -> None:
    """A standalone dispatcher whose LISTEN went silent publishes new rows within about a second.

    It used to back off to ``dispatch_max_interval`` (30 s) whatever its listener's state.
    """
    proxy, url = proxied
    bb.write_app(
        {}, boundedbeat_database_url=url, boundedbeat_poll_interval=1.0, boundedbeat_dispatch_enabled=False
    )
    beat = bb.start_beat()
    dispatcher = bb.processes.spawn("dispatch", ["boundedbeat", "dispatch"])
    app = client_app(bb)
    bb.wait_until(
        lambda: len(listener_pids(bb)) == 2, timeout=20, what="the beat's and dispatcher's listeners"
    )
    mark = len(dispatcher.output())
    proxy.stall()
    logged_after(beat, LOST, 0, timeout=PROBE_EVERY + PROBE_TIMEOUT + 15)
    logged_after(dispatcher, LOST, mark, timeout=PROBE_EVERY + PROBE_TIMEOUT + 15)
    time.sleep(3.0)  # an idle dispatcher's backoff has grown meanwhile
    for name in ("queued-1", "queued-2"):
        added_and_run(bb, app, name)
        bb.wait_until(lambda n=name: bb.runs(n)[0].published_at, timeout=60, what=f"{name} published")
        (run,) = bb.runs(name)
        assert run.published_at is not None
        lag = (run.published_at - run.enqueued_at).total_seconds()
        assert lag < PICKUP, f"{name} published {lag:.2f} s after it was queued"
    proxy.resume()
    logged_after(dispatcher, BACK, mark, timeout=30)

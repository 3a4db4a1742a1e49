"""The lease holder's database connections go silent in the middle of a prepared tick.

A NAT gateway or load balancer that drops the flow leaves the holder's sessions open on the
server: the prepared tick's transaction, with the row locks of every schedule it prepared,
sits idle there until the server ends it. The holder stops renewing and a standby takes the
lease; those schedules tick again only once the server has ended the silent transaction
(``idle_in_transaction_session_timeout``, see ``engine.IDLE_IN_TRANSACTION_SECONDS``).
The silence is made by ``tcpproxy``: the holder reaches the database through it, marked by
its ``application_name``; the standby and the worker connect directly.
"""

from __future__ import annotations

import time

import pytest
import tcpproxy
from integration.apps import Raw
from integration.harness import Harness

from celery_boundedbeat.db.engine import IDLE_IN_TRANSACTION_SECONDS

from .conftest import Measure
from .support import check_books, check_grid, doubled, lease

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SCHEDULES = 20
TTL, RENEW = 6.0, 2.0
#: The application_name that marks the holder's connections for the proxy.
MARK = "bbholder"
#: Slack for two slow shared cores, on top of the server's bound.
SLACK = 4.0


def first_after(bb: Harness, name: str, at: float) -> float | None:
    return min(
        (r.enqueued_at.timestamp() for r in bb.runs(name) if r.enqueued_at.timestamp() > at), default=None
    )


def test_a_holder_gone_silent_in_a_prepared_tick_frees_its_schedules_for_the_standby(
    bb: Harness, measure: Measure
) -> None:
    """The standby ticks the holder's locked schedules within the server's bound, not a minute later."""
    url = bb.backend.database_url
    with tcpproxy.stalling_proxy(url, MARK.encode()) as (proxy, proxied):
        names = [f"s{i:02d}" for i in range(SCHEDULES)]
        bb.write_app(
            {n: bb.entry(n, 1.0, durations=[0.05]) for n in names},
            # The holder's URL comes from its environment: the other processes connect directly.
            boundedbeat_database_url=Raw(f"os.environ.get('BBTEST_URL', {url!r})"),
            boundedbeat_lease_ttl=TTL,
            boundedbeat_lease_renew_interval=RENEW,
        )
        bb.start_worker(pool="threads", concurrency=8)
        bb.env["BBTEST_URL"] = proxied + ("&" if "?" in proxied else "?") + f"application_name={MARK}"
        holder = bb.start_beat()
        del bb.env["BBTEST_URL"]
        standby = bb.start_beat(migrate=False, wait_lease=False)
        bb.wait_for_log(standby, "is standing by", timeout=40)
        bb.wait_until(lambda: len(bb.finished("s00")) >= 3, 30, "three runs of s00")

        # Go silent 0.25 s before a due time: the holder has prepared that tick (0.5 s ahead).
        phase = bb.runs("s00")[-1].scheduled_for.timestamp() % 1.0
        now = time.time()
        target = now - now % 1.0 + phase - 0.25
        while target < now + 0.3:
            target += 1.0
        bb.watch(target - time.time(), lambda: None, interval=0.05)
        stalled_at = time.time()
        proxy.stall()
        pid = holder.popen.pid
        bb.wait_until(
            lambda: (held := lease(bb)) is not None and f":{pid}:" not in held[0],
            TTL + RENEW + SLACK,
            "the standby to take the lease",
        )
        took = time.time() - stalled_at
        bound = IDLE_IN_TRANSACTION_SECONDS + SLACK
        again = bb.wait_until(lambda: first_after(bb, "s00", stalled_at + 0.1), 90, "s00 emitted again")
        gap = again - stalled_at
        measure("standby took the lease after", took, " s")
        measure("the holder's prepared schedules emitted again after", gap, " s")
        assert gap < bound, f"s00 emitted again {gap:.1f} s after the holder went silent (bound {bound:g} s)"

        proxy.resume()  # the holder hears that its session was ended, and stands by
        bb.wait_for_log(holder, "another beat took the beat lease", timeout=30)
        assert holder.alive
        resumed = time.time()
        bb.wait_until(lambda: first_after(bb, "s00", resumed) is not None, 10, "the next run of s00")
        for name in names:
            check_books(bb, name)
            check_grid(bb, name, 1.0)
        assert doubled(bb) == []

"""Every database connection of the app cut (``pg_terminate_backend``) again and again under load.

A lease-holding beat (in-beat dispatcher, prepared ticks on), a standby beat and two workers
(threads and prefork) run 50 schedules at 1 s while the test terminates every backend on the
test's database every 2.5 s for 30 s: the beat's tick and lease connections, its listener,
the dispatcher's, the workers' report writers and the test's own API connection. After each
cut the test adds, updates or removes a runtime schedule and measures how soon the beat acts
on it. Then it stops cutting and checks the books: nothing lost, nothing run twice, nothing
stuck.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
import pytest
from celery import Celery
from integration.harness import Harness
from integration.reads import ACTIVE_STATES
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from celery_boundedbeat import add_schedule, remove_schedule, update_schedule

from .conftest import Measure
from .support import check_books, check_grid, doubled, executions, lease, stuck

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

T = TypeVar("T")

SCHEDULES = 50
WINDOW = 30.0
EVERY = 2.3  # not a whole number of seconds: the cuts land at every phase of the 1 s ticks
#: How soon a runtime change must be acted on after a cut (poll_interval is 1 s, the default).
PICKUP = 2.0
#: How long after the cuts stop every run emitted must have settled.
SETTLE = 30.0
LEASE = {"boundedbeat_lease_ttl": 6.0, "boundedbeat_lease_renew_interval": 2.0}

#: A short task that appends one line per execution (the run's id and the schedule's tag).
TALLY = """

@app.task(bind=True)
def tally(self, name, tag=0):
    _record(event="start", name=name, id=self.request.id, tag=tag, t=time.time(), pid=os.getpid())
"""


def entry(bb: Harness, name: str, period: float = 1.0) -> dict[str, Any]:
    return {"task": f"{bb.module}.tally", "schedule": period, "kwargs": {"name": name}}


def terminate_all(bb: Harness) -> int:
    """Terminate every backend on the test's database; how many were cut."""
    url = make_url(bb.backend.database_url)
    with psycopg.connect(host=url.host, port=url.port, user=url.username, dbname="postgres") as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            [url.database],
        ).fetchall()
    return sum(1 for (done,) in rows if done)


class Client:
    """The test's own app for runtime changes; a call cut mid-way is made again.

    A cut connection makes a call raise ``OperationalError`` (documented): the caller retries.
    A retried add that had committed answers ``already_present``, a retried remove ``False``.
    """

    def __init__(self, bb: Harness) -> None:
        self.app = Celery("terminatetest", broker="memory://", set_as_current=False)
        self.app.conf.boundedbeat_database_url = bb.backend.database_url
        self.retries = 0

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        deadline = time.monotonic() + 20
        while True:
            try:
                return fn(self.app, *args, **kwargs)
            except OperationalError:
                self.retries += 1
                assert time.monotonic() < deadline, "the API call kept failing"
                time.sleep(0.1)


def tags(bb: Harness) -> dict[str, int]:
    """The tag each executed run id carried."""
    found: dict[str, int] = {}
    for line in bb.events_path.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        found[event["id"]] = event.get("tag", 0)
    return found


def test_every_connection_terminated_under_load_loses_nothing_and_doubles_nothing(
    bb: Harness, measure: Measure
) -> None:
    """Cuts every 2.3 s for 30 s: each run settles once, every tick is accounted, changes land in 2 s."""
    names = [f"s{i:02d}" for i in range(SCHEDULES)]
    module = bb.write_app({name: entry(bb, name) for name in names}, boundedbeat_poll_interval=1.0, **LEASE)
    path = bb.tmp / f"{module}.py"
    path.write_text(path.read_text() + TALLY)
    threads = bb.start_worker(pool="threads", concurrency=8, wait_ready=False)
    prefork = bb.start_worker(pool="prefork", concurrency=2, wait_ready=False)
    holder = bb.start_beat()
    standby = bb.start_beat(migrate=False, wait_lease=False)
    for worker in (threads, prefork):
        bb.wait_for_log(worker, " ready.", timeout=40)
    bb.wait_for_log(standby, "is standing by", timeout=40)
    client = Client(bb)
    for k in range(3):  # the schedules the window updates, in place from the start
        client.call(add_schedule, f"upd{k}", f"{bb.module}.tally", 1.0, kwargs={"name": f"upd{k}"})
    bb.wait_until(
        lambda: len(bb.sql("SELECT id FROM boundedbeat_runs WHERE state = 'completed'")) >= 2 * SCHEDULES,
        60,
        "two completed runs a schedule before the cuts",
    )

    added: dict[str, float] = {}  # name -> when added
    removed: dict[str, float] = {}  # name -> when removed
    add_latency: list[float] = []
    update_latency: list[float] = []
    cuts: list[int] = []
    holder_at_start = lease(bb)
    started = time.time()
    step = 0
    while time.time() - started < WINDOW:
        cut_at = time.time()
        cuts.append(terminate_all(bb))
        kind = step % 3
        if kind == 0 or not added:
            name = f"rt{step:02d}"
            outcome = client.call(add_schedule, name, f"{bb.module}.tally", 1.0, kwargs={"name": name})
            assert outcome == "scheduled" or name in bb.schedules()  # a retried add that had committed
            added[name] = at = time.time()
            first = bb.wait_until(
                lambda n=name: min((r.enqueued_at.timestamp() for r in bb.runs(n)), default=None),
                15,
                f"the first run of {name}",
            )
            add_latency.append(first - at)
        elif kind == 1:
            name = f"upd{step // 3 % 3}"
            tag = step
            client.call(update_schedule, name, kwargs={"name": name, "tag": tag})
            at = time.time()

            def first_tagged(n: str = name, t: int = tag) -> float | None:
                seen = tags(bb)
                tagged = [r.enqueued_at.timestamp() for r in bb.runs(n) if seen.get(r.id) == t]
                return min(tagged, default=None)

            first = bb.wait_until(first_tagged, 15, f"a run of {name} with tag {tag}")
            update_latency.append(first - at)
        else:
            name = next(iter(added))
            del added[name]
            client.call(remove_schedule, name)
            removed[name] = time.time()
        step += 1
        bb.watch(max(cut_at + EVERY - time.time(), 0.0), lambda: None, interval=0.2)
    cut_end = time.time()
    measure("cuts / backends terminated", f"{len(cuts)} / {sum(cuts)}")
    measure("API calls retried after a cut", client.retries)
    moved = holder_at_start is None or (held := lease(bb)) is None or held[0] != holder_at_start[0]
    measure("the lease moved to the standby", str(moved))

    # Nothing stuck: every run emitted before the cuts ended settles.
    def unsettled() -> list[Any]:
        return [r for r in bb.runs() if r.state in ACTIVE_STATES and r.enqueued_at.timestamp() < cut_end]

    bb.wait_until(lambda: not unsettled(), SETTLE, "every run emitted during the cuts to settle")
    measure("all runs emitted during the cuts settled after", time.time() - cut_end, " s")
    assert stuck(bb, older_than=10) == []

    # The schedules go on: executions read before the runs all have a row (a run's row is
    # committed before its message is sent), and runs completed by then were executed by then.
    ran = set(executions(bb))
    runs = bb.runs()
    ran_after = set(executions(bb))
    states = Counter(r.state for r in runs)
    assert set(states) <= {"completed", *ACTIVE_STATES}, f"{states}\n{bb.diagnostics()}"
    twice = doubled(bb)
    assert twice == [], f"run ids executed twice: {twice}"
    run_ids = {r.id for r in runs}
    assert ran <= run_ids, f"executed without a run row: {sorted(ran - run_ids)[:5]}"
    completed = {r.id for r in runs if r.state == "completed"}
    assert completed <= ran_after, f"completed but never executed: {sorted(completed - ran_after)[:5]}"
    assert len({(r.schedule, r.scheduled_for) for r in runs}) == len(runs), "two runs for one tick"

    ticks = 0
    for name in [*names, "upd0", "upd1", "upd2", *added]:  # an update of kwargs keeps the grid
        check_books(bb, name)
        ticks += check_grid(bb, name, 1.0)
    for name, at in removed.items():
        late = [r for r in bb.runs(name) if r.enqueued_at.timestamp() > at + 0.05]
        assert late == [], f"{name} emitted after its removal: {[r.short() for r in late]}"

    measure("runs / ticks accounted / doubled", f"{len(runs)} / {ticks} / {len(twice)}")
    (skips,) = bb.sql("SELECT sum(skips) AS skips, sum(busy_skips) AS busy FROM boundedbeat_schedules")
    skipped, busy = int(skips["skips"]), int(skips["busy"])
    measure("ticks skipped (of them as busy)", f"{skipped} ({busy})")
    late = sorted(
        (r.started_at - r.scheduled_for).total_seconds()
        for r in runs
        if r.started_at is not None and started <= r.scheduled_for.timestamp() < cut_end
    )
    measure(
        "run started after its due time, p50 / p99 / max",
        f"{late[len(late) // 2]:.2f} / {late[int(len(late) * 0.99)]:.2f} / {late[-1]:.2f}",
        " s",
    )
    measure("add to first run after a cut, max", max(add_latency), " s")
    measure("update to first run with it after a cut, max", max(update_latency), " s")
    # A run ends in milliseconds: a tick skipped as busy means its report waited. A worker
    # whose connection was cut used to hold every report for the outage's retry second, and
    # 17-43 ticks were skipped a cut (228-558 in the window). None are now; a second's stall
    # of the shared cores may still skip one tick of every schedule: allow two such stalls.
    assert busy <= 2 * (SCHEDULES + 3), f"{busy} ticks skipped as busy over {len(cuts)} cuts"
    assert max(add_latency) < PICKUP, add_latency
    assert max(update_latency) < PICKUP, update_latency
    assert holder.alive and standby.alive and threads.alive and prefork.alive

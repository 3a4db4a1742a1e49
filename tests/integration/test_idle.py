"""An idle beat on PostgreSQL stays off the database, yet hears every change at once."""

from __future__ import annotations

import json
import time

import psycopg
import pytest
from sqlalchemy.engine import make_url

from .harness import Harness

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def transactions(bb: Harness) -> int:
    """Transactions committed or rolled back in the test's database so far (all sessions)."""
    url = make_url(bb.backend.database_url)
    with psycopg.connect(host=url.host, port=url.port, user=url.username, dbname="postgres") as conn:
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", [url.database]
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("backend", ["pg-rabbitmq"], indirect=True)
def test_an_idle_beat_stays_off_the_database_and_still_starts_a_new_schedule_at_once(bb: Harness) -> None:
    """Nothing due for an hour: the beat renews its lease and its dispatcher backs off, and that is
    all it asks of PostgreSQL (before, a tick, a reaper pass and an alert pass every second).
    A schedule added meanwhile wakes it through its notification and runs within two seconds."""
    bb.write_app({"hourly": bb.entry("hourly", 3600.0, policy={"initial_delay": 3600})})
    bb.start_beat()
    time.sleep(8)  # start-up done: reconcile, first tick, the dispatcher's backoff has grown
    before = transactions(bb)
    time.sleep(15)
    spent = transactions(bb) - before
    # Lease renewals every 5 s (3), the dispatcher's backed-off drains (two each), stats lag:
    # well under one a second, where a tick, a reaper and an alert pass each second made 45+.
    assert spent <= 15, f"{spent} transactions in 15 s of idling"

    # The clock starts when the schedule is added, not when the CLI process is started: a
    # `celery boundedbeat add` takes about 2 s to import on two busy cores before it adds
    # anything. Its first run is due at the add's own now (``scheduled_for``).
    started = time.time()
    kwargs = json.dumps({"name": "new", "durations": [0.05]})
    bb.celery(
        "boundedbeat", "add", "new", f"{bb.module}.work", "--kwargs", kwargs, "--every", "3600", check=True
    )
    bb.wait_until(lambda: bb.runs("new"), timeout=10, what="the added schedule's first run")
    (run,) = bb.runs("new")
    added_at = run.scheduled_for.timestamp()
    assert started <= added_at, run.short()
    assert run.enqueued_at.timestamp() - added_at < 2.0, run.short()

"""A beat's last drain cut by its grace records every message the broker took before it returns.

Beat exits right after ``last_drain`` returns (the drain runs in a daemon thread). A batch
still being published then was never recorded: its rows stayed claimed, and once the claim
expired another dispatcher published them again (measured: 1,000 messages twice, one whole
batch, when a beat with a slow broker and a backlog was stopped).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
from celery import Celery, signals
from sqlalchemy import Engine, text
from test_fencing import ROWS, _fill

from celery_boundedbeat.beat.startup import last_drain
from celery_boundedbeat.config.settings import Settings
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.dispatch.dispatcher import Dispatcher

pytestmark = pytest.mark.postgres

#: Per message: a slow broker, so a batch of 1,000 takes seconds and the grace cuts it.
DELAY = 0.01


def _slow_broker(**_: Any) -> None:
    time.sleep(DELAY)


def _messages(app: Celery, queue: str) -> Counter[str]:
    """Messages per task id waiting in kombu's in-memory broker."""
    counts: Counter[str] = Counter()
    with app.connection_for_read() as conn:
        channel = conn.default_channel
        while (message := channel.basic_get(queue, no_ack=True)) is not None:
            counts[message.headers["id"]] += 1
    return counts


@pytest.mark.timeout(60)
def test_a_last_drain_cut_by_the_grace_records_what_it_published(
    pg_url: str, pg_engine: Engine, queue_name: str
) -> None:
    ids = _fill(pg_engine, queue_name, "tests.noop")
    app = Celery("last_drain", broker="memory://", set_as_current=False)
    app.conf.update(task_default_queue=queue_name)
    dispatcher = Dispatcher(app, Store(pg_engine), Settings(database_url=pg_url), name="stopping-beat")
    signals.before_task_publish.connect(_slow_broker, weak=False)
    try:
        last_drain(dispatcher, 3.0)  # ROWS * DELAY is 12 s: the grace ends mid-batch
        # What the process leaves behind if it exits now.
        with pg_engine.connect() as conn:
            published = set(
                conn.execute(text("SELECT id FROM boundedbeat_runs WHERE published_at IS NOT NULL")).scalars()
            )
            claimed = conn.execute(
                text("SELECT count(*) FROM boundedbeat_queue WHERE claimed_by IS NOT NULL")
            ).scalar_one()
        sent = _messages(app, queue_name)
    finally:
        signals.before_task_publish.disconnect(_slow_broker)
    assert 0 < len(sent) < ROWS, "the grace cut the drain short"
    assert set(sent) == published, "every message in the broker has its run recorded published"
    assert max(sent.values()) == 1
    assert claimed == 0, "the rows not published are given back, not left claimed until the claim expires"
    assert published <= set(ids)

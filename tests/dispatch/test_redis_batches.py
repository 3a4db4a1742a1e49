"""Publishing through kombu's publish batches: one Redis pipeline per chunk, counted per flushed chunk."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any, cast

import pytest
import redis
from celery import Celery

from celery_boundedbeat.core.messages import message_options
from celery_boundedbeat.core.policy import Policy
from celery_boundedbeat.db.claims import Claimed
from celery_boundedbeat.dispatch.publish import PUBLISH_CHUNK, Publisher

REDIS = "redis://127.0.0.1:6379/0"


def claimed(n: int, queue: str) -> list[Claimed]:
    rows = []
    for i in range(n):
        run_id = str(uuid.uuid4())
        rows.append(
            Claimed(
                id=i + 1,
                run_id=run_id,
                task_id=run_id,
                task="proj.plain",
                args=[i],
                kwargs={"k": "v"},
                options=message_options({"queue": queue}, Policy(max_run_time=30.0), run_id, "batches"),
                due_at=datetime.now(UTC),
            )
        )
    return rows


@pytest.fixture
def queue() -> Iterator[str]:
    name = f"bb_batch_{uuid.uuid4().hex[:10]}"
    yield name
    redis.Redis.from_url(REDIS).delete(name)


def payload(client: redis.Redis, queue: str) -> dict[str, Any]:
    raw = cast(bytes | None, client.rpop(queue))
    assert raw is not None, f"nothing on {queue}"
    message: dict[str, Any] = json.loads(raw)
    return message


def test_every_row_of_several_chunks_arrives_once_in_order_as_send_task_sends_it(queue: str) -> None:
    """Two and a half chunks: each row once, in claim order, each message equal to send_task's."""
    app = Celery(f"batches_{uuid.uuid4().hex[:6]}", broker=REDIS, set_as_current=False)
    app.conf.task_create_missing_queues = True
    rows = claimed(PUBLISH_CHUNK * 2 + PUBLISH_CHUNK // 2, queue)
    done, error = Publisher(app, confirm_timeout=10).publish(rows)
    assert error is None and done == rows
    client = redis.Redis.from_url(REDIS)
    assert client.llen(queue) == len(rows)
    ours = [payload(client, queue) for _ in rows]  # LPUSH + RPOP: first published first
    assert [m["headers"]["id"] for m in ours] == [r.task_id for r in rows]

    first = rows[0]
    app.send_task(first.task, args=first.args, kwargs=first.kwargs, task_id=first.task_id, **first.options)
    theirs = payload(client, queue)
    for message in (ours[0], theirs):
        message["properties"].pop("delivery_tag")  # a fresh uuid per message
        message["headers"].pop("expires", None)
    assert ours[0] == theirs


class _FlushFails:
    """A producer whose publish batch fails to flush the second chunk (a broker gone mid-batch)."""

    def __init__(self) -> None:
        self.flushes = 0
        self.sent: list[str] = []

    @contextmanager
    def batch(self, max_size: int) -> Iterator[None]:
        yield
        self.flushes += 1
        if self.flushes == 2:
            raise ConnectionError("broker went away during the flush")


def test_a_chunk_counts_as_published_only_once_flushed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flush that fails keeps its whole chunk (and everything after) out of ``done``."""
    app = Celery(f"batches_{uuid.uuid4().hex[:6]}", broker=REDIS, set_as_current=False)
    producer = _FlushFails()

    @contextmanager
    def acquire() -> Iterator[_FlushFails]:
        yield producer

    monkeypatch.setattr(app, "producer_or_acquire", acquire)
    publisher = Publisher(app, confirm_timeout=10)
    monkeypatch.setattr(publisher, "_publish_row", lambda p, row, cache, declared: p.sent.append(row.id))
    rows = claimed(PUBLISH_CHUNK * 3, "unused")
    done, error = publisher.publish(rows)
    assert done == rows[:PUBLISH_CHUNK]
    assert error is not None and "broker went away" in error
    assert len(producer.sent) == 2 * PUBLISH_CHUNK  # the third chunk was never started

"""Publisher confirms: with Celery's ``confirm_publish``, a row counts as published only once
RabbitMQ acknowledged its message, and the dispatcher asks once per batch, not per message."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue
from sqlalchemy import Engine, select

import celery_boundedbeat
from celery_boundedbeat.config.settings import Settings
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import QueueRow
from celery_boundedbeat.dispatch.dispatcher import Dispatcher

pytestmark = [pytest.mark.postgres, pytest.mark.rabbitmq]

RABBIT = "amqp://guest:guest@127.0.0.1:5672//"


@pytest.fixture
def queue(queue_name: str) -> Iterator[str]:
    yield queue_name
    with Connection(RABBIT) as conn:
        conn.default_channel.queue_delete(queue_name)


def confirming_app(queue: str, **queue_arguments: object) -> Celery:
    app = Celery(f"confirms_{uuid.uuid4().hex[:6]}", broker=RABBIT, set_as_current=False)
    app.conf.broker_transport_options = {"confirm_publish": True}
    app.conf.task_default_queue = queue
    app.conf.task_queues = [
        Queue(
            queue, Exchange(queue, type="direct"), routing_key=queue, queue_arguments=queue_arguments or None
        )
    ]
    app.finalize()
    return app


def dispatcher(app: Celery, pg_url: str, engine: Engine) -> Dispatcher:
    settings = Settings(database_url=pg_url, dispatch_batch_size=100)
    return Dispatcher(app, Store(engine), settings)


def enqueue(engine: Engine, n: int) -> list[str]:
    with engine.begin() as conn:
        return [celery_boundedbeat.enqueue(conn, "tests.noop", args=(i,)) for i in range(n)]


def take(queue: str, limit: int = 10_000) -> list[str]:
    """Consume what the broker holds on ``queue`` (confirmed messages are already there)."""
    ids: list[str] = []
    with Connection(RABBIT) as conn:
        channel = conn.default_channel
        while len(ids) < limit and (message := channel.basic_get(queue, no_ack=True)) is not None:
            ids.append(message.headers["id"])
    return ids


def left_in_queue(engine: Engine) -> list[tuple[str, str | None, str | None]]:
    with engine.connect() as conn:
        rows = conn.execute(
            select(QueueRow.task_id, QueueRow.claimed_by, QueueRow.last_error).order_by(QueueRow.id)
        )
        return [tuple(row) for row in rows]  # type: ignore[misc]


def test_with_confirm_publish_every_batch_is_confirmed_and_nothing_is_lost_or_doubled(
    pg_url: str, pg_engine: Engine, queue: str
) -> None:
    ids = enqueue(pg_engine, 250)  # three batches of 100 on one confirming channel
    d = dispatcher(confirming_app(queue), pg_url, pg_engine)
    assert d._publisher.confirms, "confirm_publish on RabbitMQ should switch batch confirms on"

    result = d.drain()

    assert not result.failed and d.published_total == 250
    assert left_in_queue(pg_engine) == []
    assert take(queue) == ids  # all of them, once each, in due order


def test_messages_the_broker_refuses_stay_queued_until_it_takes_them(
    pg_url: str, pg_engine: Engine, queue: str
) -> None:
    """A full queue with ``reject-publish`` nacks what does not fit: those rows are not
    marked published; they go back to the queue and are published once there is room."""
    app = confirming_app(queue, **{"x-max-length": 5, "x-overflow": "reject-publish"})
    ids = enqueue(pg_engine, 12)
    d = dispatcher(app, pg_url, pg_engine)

    first = d.drain()

    assert first.failed, "a refused message must fail the drain (and back off)"
    assert d.published_total == 5
    left = left_in_queue(pg_engine)
    assert [task_id for task_id, _, _ in left] == ids[5:]
    assert all(claimed_by is None for _, claimed_by, _ in left), "refused rows must be released"
    assert all(error and "refused 7 of 12" in error for _, _, error in left), left
    assert take(queue) == ids[:5]

    second = d.drain()  # room for five more

    assert second.failed and d.published_total == 10
    assert [task_id for task_id, _, _ in left_in_queue(pg_engine)] == ids[10:]
    assert take(queue) == ids[5:10]

    third = d.drain()

    assert not third.failed and d.published_total == 12
    assert left_in_queue(pg_engine) == []
    assert take(queue) == ids[10:]

"""An ``enqueue()`` message the dispatcher cannot publish in time is kept and said, never dropped."""

from __future__ import annotations

import logging
import socket
from datetime import timedelta

import pytest
from celery import Celery
from sqlalchemy import Engine, func, select, update

from celery_boundedbeat import enqueue
from celery_boundedbeat.config.settings import Settings
from celery_boundedbeat.db.store import Store, utcnow
from celery_boundedbeat.db.tables import OutboxExpiredRow, QueueRow
from celery_boundedbeat.dispatch.dispatcher import Dispatcher
from celery_boundedbeat.ops.metrics import exposition, read_snapshot


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(60)
def test_an_outbox_message_past_the_publish_timeout_is_kept_logged_and_counted(
    pg_url: str, pg_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Past publish_timeout with the broker down, the message leaves the queue into
    boundedbeat_outbox_expired whole, with a WARNING naming its task and id and a counter."""
    with pg_engine.begin() as conn:
        old = enqueue(conn, "shop.send_receipt", args=[7], kwargs={"lang": "de"}, queue="mail")
        fresh = enqueue(conn, "shop.send_receipt", args=[8])
        # An outage longer than the limit: the first message waited past it.
        conn.execute(
            update(QueueRow)
            .where(QueueRow.task_id == old)
            .values(enqueued_at=utcnow() - timedelta(seconds=120), last_error="broker down")
        )
    app = Celery("dead", broker=f"redis://127.0.0.1:{_free_port()}/0", set_as_current=False)
    settings = Settings(database_url=pg_url, publish_timeout=60.0)
    with caplog.at_level(logging.WARNING, logger="celery_boundedbeat.dispatch"):
        Dispatcher(app, Store(pg_engine), settings).drain()
    with pg_engine.connect() as conn:
        kept = conn.execute(select(OutboxExpiredRow)).mappings().all()
        queued = conn.scalars(select(QueueRow.task_id)).all()
    assert queued == [fresh], "the message within the limit stays queued"
    assert len(kept) == 1
    assert (kept[0]["task_id"], kept[0]["task"], kept[0]["args"], kept[0]["kwargs"]) == (
        old,
        "shop.send_receipt",
        [7],
        {"lang": "de"},
    )
    assert kept[0]["options"] == {"queue": "mail"}
    assert kept[0]["last_error"] == "broker down" and kept[0]["attempts"] >= 0
    said = [r for r in caplog.records if old in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert (
        "shop.send_receipt" in said[0].getMessage() and "boundedbeat_outbox_expired" in said[0].getMessage()
    )
    text = exposition(read_snapshot(pg_engine, utcnow()))
    assert "boundedbeat_outbox_expired_total 1.0" in text


def test_the_expiry_never_takes_a_claimed_message(pg_engine: Engine) -> None:
    """A message a dispatcher holds a live claim on is left to it, however old."""
    with pg_engine.begin() as conn:
        task_id = enqueue(conn, "shop.a")
    store = Store(pg_engine)
    later = utcnow() + timedelta(seconds=120)
    assert [c.task_id for c in store.claim_batch("d", later, 10, claim_timeout=60)] == [task_id]
    assert store.expire_outbox(later, publish_timeout=60) == []
    assert [m.task_id for m in store.expire_outbox(later + timedelta(seconds=61), publish_timeout=60)] == [
        task_id
    ]
    with pg_engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(QueueRow)) == 0
        assert conn.scalar(select(func.count()).select_from(OutboxExpiredRow)) == 1

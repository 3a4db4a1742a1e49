"""enqueue() through Django's own connection and transactions (the transactional outbox)."""

from __future__ import annotations

from contextlib import closing
from typing import Any

import psycopg
import pytest
from sqlalchemy import select

import celery_boundedbeat
from celery_boundedbeat.config.settings import django_default_database_url
from celery_boundedbeat.db.engine import get_engine, normalize_url
from celery_boundedbeat.db.store import QUEUE_CHANNEL
from celery_boundedbeat.db.tables import QueueRow
from celery_boundedbeat.db.wake import Waker


def _queued_task_ids() -> list[str]:
    url = django_default_database_url()
    assert url is not None
    with get_engine(url).connect() as conn:
        return list(conn.scalars(select(QueueRow.task_id).order_by(QueueRow.id)))


@pytest.mark.usefixtures("clean_tables")
def test_enqueue_inside_a_rolled_back_atomic_block_leaves_nothing() -> None:
    """A Django transaction that rolls back takes its enqueued task with it."""
    from django.db import connection, transaction

    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        celery_boundedbeat.enqueue(connection, "proj.tasks.mail", args=("rolled back",))
        raise Boom
    assert _queued_task_ids() == []


@pytest.mark.usefixtures("clean_tables")
def test_enqueue_inside_a_committed_atomic_block_is_queued_with_its_arguments() -> None:
    """A committed Django transaction leaves exactly its task on the queue, arguments intact."""
    from django.db import connection, transaction

    with transaction.atomic():
        task_id = celery_boundedbeat.enqueue(
            connection, "proj.tasks.mail", args=(1, "two"), kwargs={"three": 3}, queue="mail"
        )
    assert _queued_task_ids() == [task_id]
    url = django_default_database_url()
    assert url is not None
    with get_engine(url).connect() as conn:
        row = conn.execute(select(QueueRow)).one()
    assert (row.task, row.args, row.kwargs, row.options) == (
        "proj.tasks.mail",
        [1, "two"],
        {"three": 3},
        {"queue": "mail"},
    )


def _listening() -> psycopg.Connection[Any]:
    url = django_default_database_url()
    assert url is not None
    plain = normalize_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    conn = psycopg.connect(plain, autocommit=True)
    conn.execute(f'LISTEN "{QUEUE_CHANNEL}"')
    return conn


@pytest.mark.usefixtures("clean_tables")
def test_enqueue_sends_no_notify_in_the_atomic_block_and_the_dispatchers_hear_after_its_commit() -> None:
    """Django's transaction runs no NOTIFY; the wake-up comes from another backend after the commit."""
    from django.db import connection, transaction

    statements: list[str] = []

    def record(execute: Any, sql: str, params: Any, many: bool, context: Any) -> Any:
        statements.append(sql)
        return execute(sql, params, many, context)

    with closing(_listening()) as listening:
        with connection.execute_wrapper(record), transaction.atomic():
            celery_boundedbeat.enqueue(connection, "proj.tasks.mail")
            celery_boundedbeat.enqueue(connection, "proj.tasks.mail")
        assert statements and not [s for s in statements if "notify" in s.lower()], statements
        notes = list(listening.notifies(timeout=10, stop_after=1))
    assert notes, "no notification after the commit"
    assert notes[0].pid != connection.connection.info.backend_pid


@pytest.mark.usefixtures("clean_tables")
def test_a_rolled_back_atomic_block_asks_for_no_wake_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wake-up is Django's on_commit: a rollback drops it, a commit asks once per enqueue."""
    from django.db import connection, transaction

    asked: list[str | None] = []
    monkeypatch.setattr(Waker, "wake", lambda self, after_xid=None: asked.append(after_xid))

    class Boom(Exception):
        pass

    with pytest.raises(Boom), transaction.atomic():
        celery_boundedbeat.enqueue(connection, "proj.tasks.mail")
        raise Boom
    assert asked == []
    with transaction.atomic():
        celery_boundedbeat.enqueue(connection, "proj.tasks.mail")
        assert asked == []
    assert asked == [None]

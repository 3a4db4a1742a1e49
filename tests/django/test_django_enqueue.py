"""enqueue() through Django's own connection and transactions (the transactional outbox)."""

from __future__ import annotations

import pytest
from sqlalchemy import select

import celery_boundedbeat
from celery_boundedbeat.config.settings import django_default_database_url
from celery_boundedbeat.db.engine import get_engine
from celery_boundedbeat.db.tables import QueueRow


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

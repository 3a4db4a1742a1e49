"""``enqueue()``: a transactional outbox for application code."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import ColumnElement, Connection, Engine, insert, literal_column
from sqlalchemy.orm import Session, scoped_session

from ..core.limits import MAX_TASK_ID, MAX_TASK_NAME, text_problem
from ..db.store import QUEUE_CHANNEL, utcnow
from ..db.tables import QueueRow
from .after_commit import connection_wakes, connection_xid_wanted, django_wakes, session_wakes
from .unmigrated import explain_enqueue_failure

#: The enqueuing transaction's id (``xid8`` as text), returned by the first insert of a transaction.
_XID: ColumnElement[str] = literal_column("pg_current_xact_id()::text")


def enqueue(
    connection: Any,
    task_name: str,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    **options: Any,
) -> str:
    """Put a task on the DB-backed queue inside the caller's transaction; returns its task id.

    ``connection`` is a SQLAlchemy ``Connection`` or ``Session`` (or a Django
    ``connection``) on the celery_boundedbeat database. The row is visible to the
    dispatcher only when the caller commits, so a rolled-back transaction never publishes.
    On PostgreSQL the dispatchers are woken after that commit, never by a ``NOTIFY`` in the
    caller's transaction (its commit would queue behind every other notifying commit).
    On a database without the tables it raises :class:`DatabaseNotMigratedError` (the
    caller's transaction has failed; roll it back).
    """
    import uuid

    if not isinstance(task_name, str) or not task_name:
        raise ValueError(f"task_name must be a non-empty string, got {task_name!r}")
    task_id = str(options.pop("task_id", None) or uuid.uuid4())
    # Refused here, not by PostgreSQL inside the caller's transaction (SQLite would keep them).
    for key, value, limit in (("task_name", task_name, MAX_TASK_NAME), ("task_id", task_id, MAX_TASK_ID)):
        reason = text_problem(value, limit)
        if reason is not None:
            raise ValueError(f"{key} {reason}")
    now = utcnow()
    values = {
        "task_id": task_id,
        "task": task_name,
        "args": list(args),
        "kwargs": dict(kwargs or {}),
        "options": options,
        "due_at": now,
        "enqueued_at": now,
        "attempts": 0,
    }
    try:
        sqlalchemy = hasattr(connection, "execute") and hasattr(connection, "dialect")
        if sqlalchemy or hasattr(connection, "get_bind"):
            _enqueue_sqlalchemy(connection, values)
            return task_id
        return _enqueue_django(connection, values)
    except Exception as exc:  # SQLAlchemy's or Django's wrapper of the driver's error
        explained = explain_enqueue_failure(connection, exc)
        if explained is None:
            raise
        raise explained from exc


def _enqueue_sqlalchemy(
    connection: Connection | Session | scoped_session[Any], values: dict[str, Any]
) -> None:
    """Insert the row; on PostgreSQL the dispatchers are woken once the caller commits."""
    statement = insert(QueueRow).values(**values)
    if isinstance(connection, scoped_session):
        _enqueue_sqlalchemy(connection(), values)  # this thread's session
        return
    if isinstance(connection, Session):
        bind = connection.get_bind()
        connection.execute(statement)
        if bind.dialect.name == "postgresql":
            session_wakes(connection, bind if isinstance(bind, Engine) else bind.engine)
        return
    if connection.dialect.name != "postgresql":
        connection.execute(statement)
        return
    xid = None
    if connection_xid_wanted(connection):
        # the transaction's id, for the waker to see it commit: in this statement, no round trip
        xid = connection.execute(statement.returning(_XID)).scalar_one()
    else:
        connection.execute(statement)
    connection_wakes(connection, xid)


def _enqueue_django(connection: Any, values: dict[str, Any]) -> str:
    """Django's ``connection``: plain parameterized SQL through its cursor."""
    import json

    vendor = getattr(connection, "vendor", "")
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO boundedbeat_queue"
            " (task_id, task, args, kwargs, options, due_at, enqueued_at, attempts)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, 0)",
            [
                values["task_id"],
                values["task"],
                json.dumps(values["args"]),
                json.dumps(values["kwargs"]),
                json.dumps(values["options"]),
                values["due_at"] if vendor == "postgresql" else values["due_at"].replace(tzinfo=None),
                values["enqueued_at"]
                if vendor == "postgresql"
                else values["enqueued_at"].replace(tzinfo=None),
            ],
        )
        if vendor == "postgresql" and not django_wakes(connection):
            cursor.execute("SELECT pg_notify(%s, '')", [QUEUE_CHANNEL])
    return str(values["task_id"])

"""The dispatch queue's claims: which rows a dispatcher takes, and how they leave the queue.

A dispatcher claims a batch of queue rows for a while (``claimed_until``), publishes them and
marks them published, which deletes their queue rows; a claim it did not finish expires and
another dispatcher takes the rows over (same task ids). :class:`~.store.Store` runs each of
these in its own transaction; here is what the statements are.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from sqlalchemy import (
    BigInteger,
    Connection,
    String,
    Table,
    any_,
    case,
    delete,
    literal,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY

from ..core.enums import RunState
from .tables import QueueRow, RunRow

#: The PostgreSQL claim: pick (skipping rows another dispatcher holds), claim, and return the
#: batch as one JSON text in due order (see ``_claim_postgres``).
_PG_CLAIM = text(
    """
    WITH picked AS (
        SELECT id FROM boundedbeat_queue
        WHERE claimed_until IS NULL OR claimed_until < :now
        ORDER BY due_at, id
        LIMIT :limit
        FOR UPDATE SKIP LOCKED
    ), claimed AS (
        UPDATE boundedbeat_queue AS q
        SET claimed_by = :claimer, claimed_until = :until, attempts = q.attempts + 1
        FROM picked WHERE q.id = picked.id
        RETURNING q.id, q.run_id, q.task_id, q.task, q.args, q.kwargs, q.options, q.due_at
    )
    SELECT json_agg(
        json_build_array(id, run_id, task_id, task, args, kwargs, options, due_at)
        ORDER BY due_at, id
    )::text
    FROM claimed
    """
)


@dataclass(kw_only=True, slots=True)
class Claimed:
    """A queue row claimed for publishing.

    Not frozen: the dispatcher builds a thousand of these per batch in its helper thread, and a
    frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field) took the GIL from the
    publishing thread twice as long. Nothing mutates one after the claim.
    """

    id: int
    run_id: str | None
    task_id: str
    task: str
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    due_at: datetime


def claim(
    conn: Connection, claimer: str, now: datetime, limit: int, claim_timeout: float, *, postgres: bool
) -> list[Claimed]:
    """Claim up to ``limit`` unclaimed (or abandoned) rows for ``claim_timeout`` s, oldest due first."""
    until = now + timedelta(seconds=claim_timeout)
    if postgres:
        return _claim_postgres(conn, claimer, now, until, limit)
    q = cast(Table, QueueRow.__table__)
    claimable = (
        select(q.c.id)
        .where(or_(q.c.claimed_until.is_(None), q.c.claimed_until < now))
        .order_by(q.c.due_at, q.c.id)
        .limit(limit)
    )
    stmt = (
        update(q)
        .where(q.c.id.in_(claimable.scalar_subquery()))
        .values(claimed_by=claimer, claimed_until=until, attempts=q.c.attempts + 1)
        .returning(
            q.c.id,
            q.c.run_id,
            q.c.task_id,
            q.c.task,
            q.c.args,
            q.c.kwargs,
            q.c.options,
            q.c.due_at,
        )
    )
    claimed = [
        Claimed(
            id=r.id,
            run_id=r.run_id,
            task_id=r.task_id,
            task=r.task,
            args=list(r.args or []),
            kwargs=dict(r.kwargs or {}),
            options=dict(r.options or {}),
            due_at=r.due_at,
        )
        for r in conn.execute(stmt)
    ]
    claimed.sort(key=lambda c: (c.due_at, c.id))
    return claimed


def _claim_postgres(
    conn: Connection, claimer: str, now: datetime, until: datetime, limit: int
) -> list[Claimed]:
    """The claim as one JSON document, decoded by a single ``json.loads``.

    The dispatcher publishes while this runs in its helper thread; decoding a thousand
    rows column by column in Python took the GIL from the publisher long enough to cost
    a fifth of the throughput. Ordering happens in SQL too.
    """
    payload = conn.execute(
        _PG_CLAIM, {"claimer": claimer, "now": now, "until": until, "limit": limit}
    ).scalar_one()
    if not payload:
        return []
    parse = datetime.fromisoformat
    return [
        Claimed(
            id=row[0],
            run_id=row[1],
            task_id=row[2],
            task=row[3],
            args=row[4] or [],  # json.loads made fresh objects: no copies
            kwargs=row[5] or {},
            options=row[6] or {},
            due_at=parse(row[7]).astimezone(UTC),
        )
        for row in json.loads(payload)
    ]


def mark(conn: Connection, claimer: str, rows: Sequence[Claimed], now: datetime, *, postgres: bool) -> None:
    """Runs by id, then queue rows: the lock order of :mod:`.store`, so a worker starting or
    settling runs of this batch while it is marked can never deadlock with us."""
    q = cast(Table, QueueRow.__table__)
    r = cast(Table, RunRow.__table__)
    ids = [row.id for row in rows]
    run_ids = sorted(row.run_id for row in rows if row.run_id)
    if postgres:
        # One array parameter instead of a thousand: less to build, bind and parse.
        run_match = r.c.id == any_(literal(run_ids, ARRAY(String())))
        queue_match = q.c.id == any_(literal(ids, ARRAY(BigInteger())))
    else:
        run_match = r.c.id.in_(run_ids)
        queue_match = q.c.id.in_(ids)
    if run_ids:
        if postgres:
            # Locked in id order by a subquery (same round trip): an UPDATE alone locks rows in
            # whatever order its plan reads them.
            in_order = (
                select(r.c.id)
                .where(run_match, r.c.published_at.is_(None))
                .order_by(r.c.id)
                .with_for_update()
                .subquery()
            )
            run_match = r.c.id == in_order.c.id
        conn.execute(
            update(r)
            .where(run_match, r.c.published_at.is_(None))
            .values(
                # Stamped after the broker took the message: a fast worker may have started
                # or even finished the run by then, and a run is never published after that.
                published_at=case(
                    (r.c.started_at < now, r.c.started_at),
                    (r.c.finished_at < now, r.c.finished_at),
                    else_=literal(now, r.c.published_at.type),
                ),
                state=case((r.c.state == RunState.QUEUED.value, RunState.PUBLISHED.value), else_=r.c.state),
            )
        )
    conn.execute(delete(q).where(queue_match, q.c.claimed_by == claimer))


def unclaimed(now: datetime) -> Any:
    """Queue rows no live claim holds at ``now``."""
    return or_(QueueRow.claimed_until.is_(None), QueueRow.claimed_until < now)

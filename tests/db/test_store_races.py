"""State changes raced by another process on real PostgreSQL: each is guarded by the state it expects."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from helpers.clock import T0
from sqlalchemy import Engine, create_engine, event, insert
from sqlalchemy.pool import NullPool

from celery_boundedbeat.core.messages import message_options
from celery_boundedbeat.core.policy import Policy
from celery_boundedbeat.db.store import Store
from celery_boundedbeat.db.tables import QueueRow, RunRow

pytestmark = pytest.mark.postgres


@pytest.fixture
def engine(migrated_postgres_url: str) -> Iterator[Engine]:
    engine = create_engine(migrated_postgres_url, poolclass=NullPool)
    yield engine
    engine.dispose()


def queue_stale_run(engine: Engine) -> str:
    """A run queued an hour before T0 (past any publish timeout below)."""
    run_id = str(uuid.uuid4())
    enqueued = T0 - timedelta(hours=1)
    with engine.begin() as conn:
        conn.execute(
            insert(RunRow),
            [{"id": run_id, "schedule": "s", "task": "t", "state": "queued", "scheduled_for": enqueued,
              "enqueued_at": enqueued, "drift_ms": 0}],
        )  # fmt: skip
        conn.execute(
            insert(QueueRow),
            [{"run_id": run_id, "task_id": run_id, "task": "t", "args": [], "kwargs": {},
              "options": message_options({}, Policy(), run_id, "s"), "due_at": enqueued,
              "enqueued_at": enqueued, "attempts": 0}],
        )  # fmt: skip
    return run_id


def test_a_run_another_dispatcher_publishes_after_the_pick_is_not_rejected(engine: Engine) -> None:
    """reject_unpublished leaves alone a run another dispatcher claimed and published after the pick."""
    run_id = queue_stale_run(engine)
    picker = Store(engine)
    other = Store(create_engine(engine.url, poolclass=NullPool))
    raced = {"done": False}

    def publish_meanwhile(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # Right after the stale rows are picked, a second dispatcher claims and publishes them.
        if not raced["done"] and "FROM boundedbeat_queue" in statement and "enqueued_at <" in statement:
            raced["done"] = True
            claimed = other.claim_batch("other", T0, 10, claim_timeout=60)
            other.mark_published("other", claimed, T0)

    event.listen(engine, "after_cursor_execute", publish_meanwhile)
    try:
        rejected = picker.reject_unpublished(T0, publish_timeout=60, rng=random.Random(1))
    finally:
        event.remove(engine, "after_cursor_execute", publish_meanwhile)
        other.engine.dispose()
    assert raced["done"]
    assert rejected == []
    run = picker.run(run_id)
    assert run is not None and run.state == "published"


def test_a_row_claimed_after_the_pick_is_not_rejected_or_removed(engine: Engine) -> None:
    """A stale row another dispatcher claims after the pick keeps its queue row and its queued run."""
    run_id = queue_stale_run(engine)
    picker = Store(engine)
    other = Store(create_engine(engine.url, poolclass=NullPool))
    raced = {"claimed": 0}

    def claim_meanwhile(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not raced["claimed"] and "FROM boundedbeat_queue" in statement and "enqueued_at <" in statement:
            raced["claimed"] = len(other.claim_batch("other", T0, 10, claim_timeout=60))

    event.listen(engine, "after_cursor_execute", claim_meanwhile)
    try:
        rejected = picker.reject_unpublished(T0, publish_timeout=60, rng=random.Random(1))
    finally:
        event.remove(engine, "after_cursor_execute", claim_meanwhile)
    assert raced["claimed"] == 1
    assert rejected == []
    run = picker.run(run_id)
    assert run is not None and run.state == "queued"
    # The claimer can still publish and record it.
    claimed_again = other.claim_batch("other", T0 + timedelta(seconds=61), 10, claim_timeout=60)
    other.engine.dispose()
    assert [c.run_id for c in claimed_again] == [run_id]

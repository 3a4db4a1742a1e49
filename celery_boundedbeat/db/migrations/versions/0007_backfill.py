"""schedules: backfilled grid times waiting for a slot

Revision ID: 0007_backfill
Revises: 0006_policy_counters
Create Date: 2026-12-01 17:00:00

``backfill NAME --start T --end T`` queues the schedule's grid times in the range that have
no run yet; they wait in ``backfill`` (a JSON list of ISO 8601 times, oldest first, empty for
existing rows) until the beat starts them as slots free. A downgrade drops the column: the
grid times still waiting are not emitted then (nothing else is lost: runs already emitted
stay in ``boundedbeat_runs``).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007_backfill"
down_revision = "0006_policy_counters"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The server default fills the existing rows; the models have none, so it goes again.
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.add_column(sa.Column("backfill", sa.JSON(), nullable=False, server_default=sa.text("'[]'")))
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.alter_column("backfill", existing_type=sa.JSON(), server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.drop_column("backfill")

"""policy counters: busy-slot skips, catch-up-window drops, buffer drops, replaced runs

Revision ID: 0006_policy_counters
Revises: 0005
Create Date: 2026-12-01 17:00:00

``skips`` stays the total of dropped ticks; these columns say what dropped them, as Temporal's
schedule info does (``overlap_skipped``, ``missed_catchup_window``, ``buffer_dropped``), and
``replaced`` counts the active runs ``missed_ticks: "replace"`` revoked. Rows that existed
before start them at 0: their earlier drops stay in ``skips`` alone.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006_policy_counters"
down_revision = "0005"
branch_labels = None
depends_on = None

COLUMNS = ("busy_skips", "window_drops", "buffer_drops", "replaced")


def upgrade() -> None:
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        for name in COLUMNS:
            batch_op.add_column(sa.Column(name, sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        for name in reversed(COLUMNS):
            batch_op.drop_column(name)

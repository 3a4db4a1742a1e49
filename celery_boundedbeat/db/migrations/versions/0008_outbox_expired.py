"""outbox: enqueue() messages not published within publish_timeout are kept, not dropped

Revision ID: 0008_outbox_expired
Revises: 0007_backfill
Create Date: 2026-12-06 07:00:00

An ``enqueue()`` row still unpublished after ``boundedbeat_publish_timeout`` used to be
deleted without a trace. It now moves, whole, to ``boundedbeat_outbox_expired`` (and is
logged with its task name and id), where an operator can read it and queue it again. A
downgrade drops the table and the messages kept in it.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008_outbox_expired"
down_revision = "0007_backfill"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "boundedbeat_outbox_expired",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("task_id", sa.String(length=36), nullable=False),
        sa.Column("task", sa.String(length=255), nullable=False),
        sa.Column("args", sa.JSON(), nullable=False),
        sa.Column("kwargs", sa.JSON(), nullable=False),
        sa.Column("options", sa.JSON(), nullable=False),
        sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_boundedbeat_outbox_expired")),
    )
    op.create_index(
        op.f("ix_boundedbeat_outbox_expired_task_id"), "boundedbeat_outbox_expired", ["task_id"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_boundedbeat_outbox_expired_task_id"), table_name="boundedbeat_outbox_expired")
    op.drop_table("boundedbeat_outbox_expired")

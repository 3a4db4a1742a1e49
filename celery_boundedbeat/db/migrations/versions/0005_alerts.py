"""alerts: signals to send, and when a schedule was announced failing

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 10:00:00

A settle or tick that makes a transition an application may alert on (a schedule failing or
recovered, ticks dropped, a run lost or timed out) writes a ``boundedbeat_alerts`` row in the
same transaction; the beat holding the lease sends the signal and deletes the row.
``boundedbeat_schedules.failing_since`` remembers that ``schedule_failing`` was sent, so that
``schedule_recovered`` follows once even after a ``resume`` reset the failure streak.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.add_column(sa.Column("failing_since", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "boundedbeat_alerts",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False
        ),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("schedule", sa.String(length=200), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("run_id", sa.String(length=36), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=True),
        sa.Column("count", sa.BigInteger(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("since", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_boundedbeat_alerts")),
    )


def downgrade() -> None:
    op.drop_table("boundedbeat_alerts")
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.drop_column("failing_since")

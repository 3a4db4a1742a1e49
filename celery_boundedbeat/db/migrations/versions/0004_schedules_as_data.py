"""schedules: the whole definition as data, its version, and how a schedule ends

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 11:30:00

Runtime schedules (``add_schedule``) have no ``beat_schedule`` entry a beat could rebuild them
from, so a schedule row now carries its grid as data (``timing``) and a ``version`` that every
change bumps. ``grid_runs`` counts the runs ``max_runs`` bounds; ``stop_reason`` and
``pause_reason`` say why a schedule stopped or paused; ``consecutive_failures`` is the streak
``pause_on_failure`` pauses at. Existing rows are config schedules: the
beat holding the lease writes their ``timing`` when it next reconciles ``beat_schedule``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.add_column(sa.Column("timing", sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column("version", sa.BigInteger(), nullable=False, server_default="1"))
        batch_op.add_column(sa.Column("grid_runs", sa.BigInteger(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("stop_reason", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("pause_reason", sa.Text(), nullable=True))
        batch_op.add_column(
            sa.Column("consecutive_failures", sa.Integer(), nullable=False, server_default="0")
        )
    # A schedule stopped by stop_schedule() before this revision says so.
    op.execute(
        "UPDATE boundedbeat_schedules SET stop_reason = 'stop_schedule' WHERE stopped = "
        + ("true" if op.get_bind().dialect.name == "postgresql" else "1")
    )
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.alter_column("version", existing_type=sa.BigInteger(), server_default=None)
        batch_op.alter_column("grid_runs", existing_type=sa.BigInteger(), server_default=None)
        batch_op.alter_column("consecutive_failures", existing_type=sa.Integer(), server_default=None)


def downgrade() -> None:
    # Runtime schedules cannot be rebuilt by an older beat: they go (their runs stay).
    op.execute("DELETE FROM boundedbeat_schedules WHERE origin = 'runtime'")
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.drop_column("consecutive_failures")
        batch_op.drop_column("pause_reason")
        batch_op.drop_column("stop_reason")
        batch_op.drop_column("grid_runs")
        batch_op.drop_column("version")
        batch_op.drop_column("timing")

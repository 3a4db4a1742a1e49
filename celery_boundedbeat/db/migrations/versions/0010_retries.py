"""runs: attempts of the ``retry`` policy key

Revision ID: 0010_retries
Revises: 0009_incarnation
Create Date: 2026-12-06 14:00:00

A run settled in a state ``retry.on`` names is emitted again for the same grid time, as the
next attempt. ``boundedbeat_runs.attempt`` (1 for every existing run) and ``retry_of`` (the
run it retries) record this, and the run key becomes ``(schedule, scheduled_for, attempt)``:
each attempt of a grid time is emitted once. ``boundedbeat_schedules.retries`` holds the
attempts waiting for their backoff or a slot, and ``retried`` counts the attempts emitted. A
downgrade first deletes the runs of later attempts (the old key allows one run per grid
time), then drops the columns.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010_retries"
down_revision = "0009_incarnation"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.add_column(sa.Column("retries", sa.JSON(), nullable=False, server_default=sa.text("'[]'")))
        batch_op.add_column(sa.Column("retried", sa.BigInteger(), nullable=False, server_default="0"))
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.alter_column("retries", existing_type=sa.JSON(), server_default=None)
        batch_op.alter_column("retried", existing_type=sa.BigInteger(), server_default=None)
    with op.batch_alter_table("boundedbeat_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("attempt", sa.Integer(), nullable=False, server_default="1"))
        batch_op.add_column(sa.Column("retry_of", sa.String(length=36), nullable=True))
        batch_op.drop_constraint("uq_boundedbeat_runs_schedule_scheduled_for", type_="unique")
        batch_op.create_unique_constraint(
            "uq_boundedbeat_runs_schedule_scheduled_for_attempt", ["schedule", "scheduled_for", "attempt"]
        )


def downgrade() -> None:
    op.execute(
        "DELETE FROM boundedbeat_queue WHERE run_id IN (SELECT id FROM boundedbeat_runs WHERE attempt > 1)"
    )
    op.execute("DELETE FROM boundedbeat_runs WHERE attempt > 1")
    with op.batch_alter_table("boundedbeat_runs", schema=None) as batch_op:
        batch_op.drop_constraint("uq_boundedbeat_runs_schedule_scheduled_for_attempt", type_="unique")
        batch_op.create_unique_constraint(
            "uq_boundedbeat_runs_schedule_scheduled_for", ["schedule", "scheduled_for"]
        )
        batch_op.drop_column("retry_of")
        batch_op.drop_column("attempt")
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.drop_column("retried")
        batch_op.drop_column("retries")

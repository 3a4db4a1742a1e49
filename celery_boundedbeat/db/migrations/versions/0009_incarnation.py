"""schedule incarnations: a schedule removed and added again is another schedule

Revision ID: 0009_incarnation
Revises: 0008_outbox_expired
Create Date: 2026-12-06 07:00:00

``boundedbeat_schedules.incarnation`` names each incarnation of a schedule: a random UUID set
when the row is created (an add, or a config entry's first reconcile), never reused, unique.
``boundedbeat_runs.incarnation`` is the incarnation that emitted the run; a run settles only
onto it, so the runs of a removed schedule never free the slots of, or count on, a new
schedule of the same name.

Existing schedules get a new incarnation each. Existing runs are given their schedule's
when they were enqueued at or after the schedule's ``created_at`` (the current row was
created before them); older runs belonged to an earlier schedule of the name, or to a name
no longer present, and keep ``NULL`` (such a run, if still active, settles by name as before).
A downgrade drops both columns; the runs stay.
"""

from __future__ import annotations

import uuid

import sqlalchemy as sa
from alembic import op

revision = "0009_incarnation"
down_revision = "0008_outbox_expired"
branch_labels = None
depends_on = None

_FILL_RUNS = sa.text(
    "UPDATE boundedbeat_runs SET incarnation = ("
    " SELECT s.incarnation FROM boundedbeat_schedules s"
    " WHERE s.name = boundedbeat_runs.schedule AND s.created_at <= boundedbeat_runs.enqueued_at)"
    " WHERE EXISTS (SELECT 1 FROM boundedbeat_schedules s"
    " WHERE s.name = boundedbeat_runs.schedule AND s.created_at <= boundedbeat_runs.enqueued_at)"
)


def upgrade() -> None:
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.add_column(sa.Column("incarnation", sa.String(length=36), nullable=True))
    with op.batch_alter_table("boundedbeat_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("incarnation", sa.String(length=36), nullable=True))
    bind = op.get_bind()
    names = bind.execute(sa.text("SELECT name FROM boundedbeat_schedules")).scalars().all()
    if names:
        bind.execute(
            sa.text("UPDATE boundedbeat_schedules SET incarnation = :incarnation WHERE name = :name"),
            [{"incarnation": str(uuid.uuid4()), "name": name} for name in names],
        )
    bind.execute(_FILL_RUNS)
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.alter_column("incarnation", existing_type=sa.String(length=36), nullable=False)
        batch_op.create_unique_constraint("uq_boundedbeat_schedules_incarnation", ["incarnation"])


def downgrade() -> None:
    with op.batch_alter_table("boundedbeat_runs", schema=None) as batch_op:
        batch_op.drop_column("incarnation")
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.drop_constraint("uq_boundedbeat_schedules_incarnation", type_="unique")
        batch_op.drop_column("incarnation")

"""schedules: queued triggers in their own column, apart from pending grid ticks

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 09:00:00

A triggered run used to wait in ``pending`` beside the grid ticks that found every slot busy,
so a ``coalesce_latest`` tick could replace it uncounted and ``max_pending`` did not bound it.
Triggers now wait in ``triggers`` (a JSON list of ISO 8601 times, empty for existing rows).
Runs already waiting in ``pending`` stay there and start as before. A downgrade puts the
queued triggers back into ``pending``, where the older code keeps them, so none is lost.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

_schedules = sa.table(
    "boundedbeat_schedules",
    sa.column("name", sa.String()),
    sa.column("pending", sa.JSON()),
    sa.column("triggers", sa.JSON()),
)


def upgrade() -> None:
    # The server default fills the existing rows; the models have none, so it goes again.
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.add_column(sa.Column("triggers", sa.JSON(), nullable=False, server_default=sa.text("'[]'")))
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.alter_column("triggers", existing_type=sa.JSON(), server_default=None)


def downgrade() -> None:
    bind = op.get_bind()
    rows = bind.execute(sa.select(_schedules.c.name, _schedules.c.pending, _schedules.c.triggers))
    for name, pending, triggers in list(rows):
        if triggers:
            merged: list[Any] = sorted([*(pending or []), *triggers])
            bind.execute(_schedules.update().where(_schedules.c.name == name).values(pending=merged))
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.drop_column("triggers")

"""schedules: a hash slot each, for partitioned beats

Revision ID: 0011_partitions
Revises: 0010_retries
Create Date: 2026-12-06 15:00:00

``boundedbeat_schedules.slot`` is the schedule's hash slot (a CRC-32 of its name modulo
1024, :func:`celery_boundedbeat.core.partitions.slot_of`). With ``boundedbeat_partitions = P``
the beat that owns partition ``slot % P`` ticks the schedule, so a change of ``P`` rewrites no
row. Existing rows get theirs here; a downgrade drops the column.
"""

from __future__ import annotations

import zlib

import sqlalchemy as sa
from alembic import op

revision = "0011_partitions"
down_revision = "0010_retries"
branch_labels = None
depends_on = None

#: Frozen here (as the migration must stay what it was): ``core.partitions.SLOTS``.
_SLOTS = 1024


def upgrade() -> None:
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.add_column(sa.Column("slot", sa.Integer(), nullable=False, server_default="0"))
    bind = op.get_bind()
    names = bind.execute(sa.text("SELECT name FROM boundedbeat_schedules")).scalars().all()
    for start in range(0, len(names), 5000):
        bind.execute(
            sa.text("UPDATE boundedbeat_schedules SET slot = :slot WHERE name = :name"),
            [
                {"slot": zlib.crc32(n.encode("utf-8")) % _SLOTS, "name": n}
                for n in names[start : start + 5000]
            ],
        )
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.alter_column("slot", existing_type=sa.Integer(), server_default=None)


def downgrade() -> None:
    with op.batch_alter_table("boundedbeat_schedules", schema=None) as batch_op:
        batch_op.drop_column("slot")

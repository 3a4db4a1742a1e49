"""schedules: an index of beat_schedule's rows alone

Revision ID: 0012_config_index
Revises: 0011_partitions
Create Date: 2026-12-06 17:00:00

The lease holder reconciles ``beat_schedule`` with the rows of ``origin = 'config'`` at every
start. Among a million runtime schedules, reading every row for that took longer than a
transaction may stay open; this partial index lets it read the config rows alone.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012_config_index"
down_revision = "0011_partitions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_boundedbeat_schedules_config",
        "boundedbeat_schedules",
        ["name"],
        postgresql_where=sa.text("origin = 'config'"),
        sqlite_where=sa.text("origin = 'config'"),
    )


def downgrade() -> None:
    op.drop_index("ix_boundedbeat_schedules_config", table_name="boundedbeat_schedules")

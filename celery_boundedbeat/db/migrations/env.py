"""Alembic environment for celery_boundedbeat (run through ``boundedbeat migrate``)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, engine_from_config, pool

from celery_boundedbeat.db.tables import VERSION_TABLE, metadata

config = context.config


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        render_as_batch=True,
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is not None:
    _run(connection)
else:
    engine = engine_from_config(
        config.get_section(config.config_ini_section) or {},
        prefix="sqlalchemy.",
        poolclass=pool.NullPool,
    )
    with engine.connect() as conn:
        _run(conn)

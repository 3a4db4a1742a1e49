"""The tests that open a database (SQLite or PostgreSQL) but start no celery processes.

Their fixtures (``db_url``, ``sqlite_url``, ``postgres_url``, ``engine``, ``migrated``) are
shared with the other suites in ``tests/conftest.py``; ``tests/unit`` opens no database.
"""

from collections.abc import Iterator

import pytest

from celery_boundedbeat.db.engine import dispose_all, get_engine
from celery_boundedbeat.db.store import Store


@pytest.fixture
def pg_store(migrated_postgres_url: str) -> Iterator[Store]:
    """A migrated store on a fresh PostgreSQL database (for PostgreSQL-only behaviour)."""
    engine = get_engine(migrated_postgres_url)
    try:
        yield Store(engine)
    finally:
        dispose_all()

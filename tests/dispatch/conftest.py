"""Fixtures for dispatcher tests: a fresh PostgreSQL database and a unique queue per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from pgtools import throwaway_database
from sqlalchemy import Engine, create_engine

from celery_boundedbeat.db.migrate import upgrade


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A migrated PostgreSQL database that exists only for this test."""
    with throwaway_database("bb_dispatch") as database:
        engine = create_engine(database.url)
        upgrade(engine)
        engine.dispose()
        yield database.url


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    engine = create_engine(pg_url)
    yield engine
    engine.dispose()


@pytest.fixture
def queue_name() -> str:
    return f"bb_q_{uuid.uuid4().hex[:10]}"

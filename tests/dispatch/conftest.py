"""Fixtures for dispatcher tests: a fresh PostgreSQL database and a unique queue per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, create_engine


@pytest.fixture
def pg_url(migrated_postgres_url: str) -> str:
    """A migrated PostgreSQL database that exists only for this test (a copy of the template)."""
    return migrated_postgres_url


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    engine = create_engine(pg_url)
    yield engine
    engine.dispose()


@pytest.fixture
def queue_name() -> str:
    return f"bb_q_{uuid.uuid4().hex[:10]}"

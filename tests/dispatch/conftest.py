"""Fixtures for dispatcher tests: a fresh PostgreSQL database and a unique queue per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy import Engine, create_engine

from celery_boundedbeat.migrate import upgrade

ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A migrated PostgreSQL database that exists only for this test."""
    name = f"bb_dispatch_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    engine = create_engine(url)
    upgrade(engine)
    engine.dispose()
    yield url
    with psycopg.connect(ADMIN, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_engine(pg_url: str) -> Iterator[Engine]:
    engine = create_engine(pg_url)
    yield engine
    engine.dispose()


@pytest.fixture
def queue_name() -> str:
    return f"bb_q_{uuid.uuid4().hex[:10]}"

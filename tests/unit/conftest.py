"""Unit-suite fixtures: one migrated database per test, on SQLite and on PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine

from celery_boundedbeat.engine import dispose_all, get_engine


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """An empty database URL: a SQLite file, then a fresh PostgreSQL database."""
    fixture = "sqlite_url" if request.param == "sqlite" else "postgres_url"
    return str(request.getfixturevalue(fixture))


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """The package's own engine for ``db_url`` (SQLite in WAL mode with BEGIN IMMEDIATE)."""
    engine = get_engine(db_url)
    try:
        yield engine
    finally:
        dispose_all()

"""Fixtures for the integration suite: one isolated app, queue and database per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import BACKENDS, Backend, Harness, new_uid


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """A fresh database and broker namespace: PostgreSQL + RabbitMQ, or SQLite + filesystem."""
    uid = new_uid()
    created = Backend.create(request.param, tmp_path, uid)
    try:
        yield created
    finally:
        created.drop(f"bbq_{uid}")


@pytest.fixture
def bb(backend: Backend, tmp_path: Path) -> Iterator[Harness]:
    """The harness; every process it started is killed at teardown."""
    harness = Harness(backend, tmp_path)
    try:
        yield harness
    finally:
        harness.close()

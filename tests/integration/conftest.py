"""Fixtures for the integration suite: one isolated app, queue and database per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .backends import BACKENDS, Backend, fresh_backend
from .harness import Harness, running_harness


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    """A fresh database and broker namespace: PostgreSQL + RabbitMQ, or SQLite + filesystem."""
    with fresh_backend(request.param, tmp_path) as created:
        yield created


@pytest.fixture
def bb(backend: Backend, tmp_path: Path) -> Iterator[Harness]:
    """The harness; every process it started is killed at teardown."""
    with running_harness(backend, tmp_path) as harness:
        yield harness

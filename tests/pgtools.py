"""Throwaway PostgreSQL databases for every test suite, from one place.

The unit, dispatch, Django, integration and fault suites each need a database that exists
for one test (or one session) and is gone afterwards; ``throwaway_database`` creates one with
a unique name and drops it ``WITH (FORCE)``, so connections a killed beat or worker left
behind never keep it alive. ``execute`` runs administrative statements (roles, databases) on
the server, and fails the test, never skips it, when PostgreSQL is not reachable. Import it
as ``pgtools``: ``tests/`` is on ``sys.path`` because ``tests/conftest.py`` is a rootless
conftest (as ``integration.harness`` is importable from ``tests/faults``).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

#: Server-level connection used to create and drop per-test databases.
ADMIN_DSN = os.environ.get(
    "BOUNDEDBEAT_TEST_POSTGRES", "host=127.0.0.1 port=5432 user=postgres dbname=postgres"
)
#: The SQLAlchemy URL of a database on that server; ``{db}`` is its name.
URL_TEMPLATE = os.environ.get(
    "BOUNDEDBEAT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/{db}"
)


@dataclass(frozen=True, slots=True)
class Database:
    """A database created for a test: its name and its SQLAlchemy URL."""

    name: str
    url: str


def connect(dsn: str = ADMIN_DSN) -> psycopg.Connection[Any]:
    """An autocommit connection to the server; the suite never skips a missing backend."""
    try:
        return psycopg.connect(dsn, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"PostgreSQL is not reachable ({dsn}): {exc}")


def execute(*statements: str, params: tuple[Any, ...] = (), dsn: str = ADMIN_DSN) -> None:
    """Run statements one by one outside a transaction (CREATE/DROP DATABASE, roles)."""
    with connect(dsn) as conn:
        for statement in statements:
            conn.execute(statement, params)  # type: ignore[arg-type]


def create_database(name: str, *, dsn: str = ADMIN_DSN, template: str | None = None) -> None:
    """Create ``name``: empty, or a copy of ``template`` (which no session may be connected to)."""
    copy = f' TEMPLATE "{template}"' if template else ""
    execute(f'CREATE DATABASE "{name}"{copy}', dsn=dsn)


def drop_database(name: str, *, dsn: str = ADMIN_DSN) -> None:
    """Drop the database, ending any session still connected to it."""
    execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', dsn=dsn)


def unique_name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def throwaway_database(prefix: str, *, template: str | None = None) -> Iterator[Database]:
    """A fresh database named ``<prefix>_<random>``, dropped when the block ends: empty, or a
    copy of the database ``template``."""
    name = unique_name(prefix)
    create_database(name, template=template)
    try:
        yield Database(name=name, url=URL_TEMPLATE.format(db=name))
    finally:
        drop_database(name)

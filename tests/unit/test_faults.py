"""Errors psycopg raises itself count as outages exactly when SQLAlchemy's wrapped ones do."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import errors

from celery_boundedbeat.db.faults import is_outage


@pytest.mark.parametrize(
    "exc",
    [
        psycopg.OperationalError("server closed the connection unexpectedly"),
        psycopg.InterfaceError("the connection is closed"),
        errors.AdminShutdown("terminating connection due to administrator command"),
        errors.LockNotAvailable("could not obtain lock"),
        errors.DeadlockDetected("deadlock detected"),
    ],
)
def test_a_driver_error_about_the_connection_or_server_is_an_outage(exc: Exception) -> None:
    """Raised by statements sent to psycopg directly: retried, never taken for a data error."""
    assert is_outage(exc)


@pytest.mark.parametrize(
    "exc",
    [
        errors.InvalidTextRepresentation("invalid input syntax for type json"),
        errors.UniqueViolation("duplicate key value"),
        psycopg.DataError("value too long"),
        ValueError("not a database error"),
    ],
)
def test_a_driver_error_about_the_data_is_not_an_outage(exc: Exception) -> None:
    """A value the server refuses would be refused again: not retried forever."""
    assert not is_outage(exc)

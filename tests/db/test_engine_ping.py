"""PostgreSQL connections are pinged before use only after sitting idle (``PING_WHEN_IDLE_FOR``).

A ping at every checkout was two round trips before each tick and each schedule change. A
connection idle longer than the window is still pinged, so one the server dropped meanwhile
(a restart, an idle timeout) is replaced before any statement sees it.
"""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from celery_boundedbeat.db import engine as engines

pytestmark = pytest.mark.postgres


@pytest.fixture
def db_url(postgres_url: str) -> str:
    """PostgreSQL only (for the shared ``engine`` fixture): the idle ping is psycopg's."""
    return postgres_url


def backend_pid(engine: Engine) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(text("SELECT pg_backend_pid()")) or 0)


def terminate(engine: Engine, pid: int) -> None:
    url = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])


def test_an_idle_connection_the_server_dropped_is_replaced_before_use(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = backend_pid(engine)
    terminate(engine, first)
    monkeypatch.setattr(engines, "PING_WHEN_IDLE_FOR", 0.0)  # as if it sat idle a while
    assert backend_pid(engine) not in (0, first), "the dead connection was pinged and replaced"


def test_a_connection_used_a_moment_ago_is_handed_out_without_a_ping(engine: Engine) -> None:
    """The trade made: a connection dropped within the window fails its next transaction (as a
    server lost mid-transaction does), and the pool reconnects for the one after."""
    first = backend_pid(engine)
    terminate(engine, first)
    with pytest.raises(OperationalError):
        backend_pid(engine)
    assert backend_pid(engine) not in (0, first)


def test_the_ping_opens_no_transaction(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLAlchemy's ``pool_pre_ping`` left a ``BEGIN`` behind its ``SELECT 1``; this ping is one
    round trip outside any transaction, so the transaction that follows starts clean."""
    backend_pid(engine)
    monkeypatch.setattr(engines, "PING_WHEN_IDLE_FOR", 0.0)
    with engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert raw is not None
        assert raw.pgconn.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert conn.scalar(text("SELECT 1")) == 1


def test_pooled_connections_carry_libpqs_bounds_for_a_dropped_flow(engine: Engine) -> None:
    """Keepalives and ``tcp_user_timeout`` are set on every pooled connection: a dropped flow
    fails a waiting statement within seconds, not after the kernel's minutes or hours. (The
    drop itself needs a network that stops acknowledging, which a local proxy cannot be: its
    kernel acknowledges for it; this checks what libpq was told.)"""
    with engine.connect() as conn:
        info = conn.connection.dbapi_connection.info  # type: ignore[union-attr]
        parameters = info.get_parameters()
    assert {key: parameters.get(key) for key in engines.KEEPALIVES} == {
        key: str(value) for key, value in engines.KEEPALIVES.items()
    }

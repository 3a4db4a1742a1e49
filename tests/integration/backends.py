"""Where an end-to-end test's state lives: a database and a broker namespace per test.

A backend is PostgreSQL + RabbitMQ (a throwaway database from ``pgtools`` and a unique queue)
or SQLite + the filesystem transport (files in the test's ``tmp_path``). ``fresh_backend``
creates one for a test and removes its database and queue afterwards; like the rest of the
suite it fails, never skips, when a server is missing.
"""

from __future__ import annotations

import contextlib
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pgtools
import pytest

PG_HOST, PG_PORT = "127.0.0.1", 5432
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672//"
BACKENDS = ("pg-rabbitmq", "sqlite-filesystem")


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def new_uid() -> str:
    return uuid.uuid4().hex[:10]


@dataclass(kw_only=True)
class Backend:
    name: str
    tmp: Path
    uid: str
    database_url: str = ""
    broker_url: str = ""
    transport_options: dict[str, Any] = field(default_factory=dict)
    folders: list[str] = field(default_factory=list)
    pg_database: str | None = None

    #: Administrative statements on the shared PostgreSQL server (roles, in the fault tests).
    _pg_admin = staticmethod(pgtools.execute)

    @property
    def is_postgres(self) -> bool:
        return self.pg_database is not None


def pg_rabbitmq(tmp: Path, uid: str, database: pgtools.Database) -> Backend:
    """The PostgreSQL + RabbitMQ backend on ``database``."""
    return Backend(
        name="pg-rabbitmq",
        tmp=tmp,
        uid=uid,
        database_url=database.url,
        broker_url=AMQP_URL,
        pg_database=database.name,
    )


def sqlite_filesystem(tmp: Path, uid: str) -> Backend:
    """The SQLite + filesystem-transport backend, all of it under ``tmp``."""
    broker = tmp / "broker"
    folders = {"out": broker / "out", "processed": broker / "processed", "control": broker / "control"}
    return Backend(
        name="sqlite-filesystem",
        tmp=tmp,
        uid=uid,
        database_url=f"sqlite:///{tmp / 'state.sqlite3'}",
        broker_url="filesystem://",
        folders=[str(p) for p in folders.values()],
        transport_options={
            "data_folder_in": str(folders["out"]),
            "data_folder_out": str(folders["out"]),
            "processed_folder": str(folders["processed"]),
            "control_folder": str(folders["control"]),
            "store_processed": False,
            "polling_interval": 0.1,
        },
    )


def require_servers() -> None:
    # Like tests/conftest.py, never skip a backend: a missing server fails the run.
    if not port_open(PG_HOST, PG_PORT):
        pytest.fail(f"PostgreSQL is not reachable on {PG_HOST}:{PG_PORT}")
    if not port_open("127.0.0.1", 5672):
        pytest.fail("RabbitMQ is not reachable on 127.0.0.1:5672 (start it: rabbitmq-server -detached)")


def delete_queue(broker_url: str, queue: str) -> None:
    """Remove a test's queue and exchange from RabbitMQ (nothing to do for other brokers)."""
    if not broker_url.startswith("amqp"):
        return
    try:
        from kombu import Connection

        with Connection(broker_url, connect_timeout=5) as conn:
            channel = conn.channel()
            channel.queue_delete(queue)
            channel.exchange_delete(queue)
    except Exception:
        pass


@contextlib.contextmanager
def fresh_backend(name: str, tmp: Path) -> Iterator[Backend]:
    """A backend that exists for one test: its database and queue are dropped afterwards."""
    uid = new_uid()
    with contextlib.ExitStack() as cleanup:
        if name == "pg-rabbitmq":
            require_servers()
            backend = pg_rabbitmq(tmp, uid, cleanup.enter_context(pgtools.throwaway_database("bbit")))
        elif name == "sqlite-filesystem":
            backend = sqlite_filesystem(tmp, uid)
        else:  # pragma: no cover - a typo in a parametrization
            raise ValueError(name)
        cleanup.callback(delete_queue, backend.broker_url, f"bbq_{uid}")
        yield backend

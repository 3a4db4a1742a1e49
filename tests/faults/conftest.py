"""Fixtures for the fault tests: PostgreSQL + RabbitMQ per test, a private cluster, measurements."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from integration.backends import AMQP_URL, PG_HOST, PG_PORT, Backend, fresh_backend, new_uid, port_open
from integration.harness import Harness, running_harness

from .support import PrivatePostgres, private_postgres

#: (test, line) pairs printed at the end of the run and, with BOUNDEDBEAT_FAULTS_REPORT set,
#: appended to that file as JSON lines.
_MEASURED: list[tuple[str, str, float | int | str, str]] = []

Measure = Callable[..., None]


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[Backend]:
    """A fresh PostgreSQL database and RabbitMQ queue name (the fault tests need both servers)."""
    with fresh_backend("pg-rabbitmq", tmp_path) as created:
        yield created


@pytest.fixture
def bb(backend: Backend, tmp_path: Path) -> Iterator[Harness]:
    """The integration harness; every process it started is killed at teardown."""
    with running_harness(backend, tmp_path) as harness:
        yield harness


@pytest.fixture
def cluster() -> Iterator[PrivatePostgres]:
    """A private PostgreSQL cluster on a spare port, stopped and deleted at teardown."""
    created = private_postgres()
    try:
        yield created
    finally:
        created.destroy()


@pytest.fixture
def outage_bb(cluster: PrivatePostgres, tmp_path: Path) -> Iterator[Harness]:
    """The harness on a database of the private cluster (RabbitMQ as the broker): it may be restarted."""
    if not port_open(PG_HOST, PG_PORT) or not port_open("127.0.0.1", 5672):
        pytest.skip("needs RabbitMQ on 5672")
    uid = new_uid()
    database = f"bbout_{uid}"
    cluster.create_database(database)
    backend = Backend(
        name="pg-rabbitmq",
        tmp=tmp_path,
        uid=uid,
        database_url=cluster.url(database),
        broker_url=AMQP_URL,
        pg_database=database,
    )
    harness = Harness(backend, tmp_path)
    try:
        yield harness
    finally:
        harness.close()
        try:
            from kombu import Connection

            with Connection(AMQP_URL, connect_timeout=5) as conn:
                channel = conn.channel()
                channel.queue_delete(harness.queue)
                channel.exchange_delete(harness.queue)
        except Exception:
            pass


@pytest.fixture
def measure(request: pytest.FixtureRequest) -> Measure:
    """Record a measured figure for the end-of-run summary."""

    def add(what: str, value: float | int | str, unit: str = "") -> None:
        if isinstance(value, float):
            value = round(value, 2)
        _MEASURED.append((request.node.name, what, value, unit))

    return add


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _MEASURED:
        return
    terminalreporter.section("fault measurements")
    for test, what, value, unit in _MEASURED:
        terminalreporter.write_line(f"{test}: {what} = {value}{unit}")
    path = os.environ.get("BOUNDEDBEAT_FAULTS_REPORT")
    if path:
        with open(path, "a") as fh:
            for test, what, value, unit in _MEASURED:
                fh.write(json.dumps({"test": test, "what": what, "value": value, "unit": unit}) + "\n")

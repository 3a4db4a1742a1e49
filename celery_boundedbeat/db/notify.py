"""PostgreSQL LISTEN in a background thread: completions wake beat, new rows wake the dispatcher.

A LISTEN connection is only worth something while it is known to work: a connection a NAT
gateway or load balancer dropped silently stays "open" on this side for hours (the kernel's
TCP keepalive defaults) while every notification is lost. So the listener probes it: after
``probe_every`` seconds without a byte from the server it sends an empty query, and a
connection that does not answer within ``probe_timeout`` counts as dead. The probe is an empty
query, which the server answers without starting a transaction. While the listener is not
known to be listening (``listening`` false), its users poll; each change of that state wakes
them (``on_notify`` on every channel with an empty payload) so they switch at once.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from ..core.redact import mask_url
from .engine import KEEPALIVES, normalize_url

logger = logging.getLogger("celery_boundedbeat")


#: Seconds without a byte from the server after which the listener probes its connection.
#: Between probes an idle listener sleeps; ``stop()`` wakes it through a pipe, so beat exits at
#: once on SIGTERM.
PROBE_EVERY = 3.0
#: Seconds the server has to answer a probe (or a ``LISTEN``) before the connection counts as
#: dead and is replaced: a dead connection is noticed at most ``PROBE_EVERY + PROBE_TIMEOUT``
#: after the last byte the server sent.
PROBE_TIMEOUT = 3.0
#: The name the listener's session shows in ``pg_stat_activity``.
APPLICATION_NAME = "boundedbeat-listen"


class ConnectionDead(Exception):
    """The server did not answer in time: the connection is half-open (or the server hangs)."""


class Refused(Exception):
    """The server answered a query of the listener's with an error."""


class Listener:
    """Listens on channels and calls ``on_notify(channel, payload)``; reconnects after errors."""

    def __init__(
        self,
        url: str,
        channels: list[str],
        on_notify: Callable[[str, str], None],
        *,
        probe_every: float = PROBE_EVERY,
        probe_timeout: float = PROBE_TIMEOUT,
    ) -> None:
        self._url = url
        self._channels = channels
        self._on_notify = on_notify
        self._probe_every = probe_every
        self._probe_timeout = probe_timeout
        self._stop = threading.Event()
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._run, name="boundedbeat-listen", daemon=True)
        #: Whether notifications arrive now (LISTEN is set up and the connection answers its
        #: probes); while not, callers poll.
        self.listening = False
        #: Failed connections in a row (the first is logged, then the reconnect).
        self._failures = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, grace: float = 2.0) -> bool:
        """Ask the thread to end; returns whether it did within ``grace`` seconds."""
        if self._wake_write < 0:
            return True  # stopped already
        self._stop.set()
        os.write(self._wake_write, b"x")
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join(grace)
        if self._thread.is_alive():
            return False
        os.close(self._wake_read)
        os.close(self._wake_write)
        self._wake_read = self._wake_write = -1
        return True

    def _everyone_looks(self) -> None:
        """Wake every channel's user: notifications may have been missed, or polling starts."""
        for channel in self._channels:
            self._on_notify(channel, "")

    def _wait_readable(self, fileno: int, timeout: float) -> bool | None:
        """Wait for the connection; ``None`` when ``stop()`` woke the thread."""
        readable, _, _ = select.select([fileno, self._wake_read], [], [], max(0.0, timeout))
        if self._wake_read in readable:
            return None
        return fileno in readable

    def _read(self, pg: Any) -> bool:
        """Take in what arrived, hand on its notifications; whether a query's answer is complete.

        ``consume_input`` raises when the connection broke (the server closed it, or ended
        the backend with ``pg_terminate_backend``).
        """
        pg.consume_input()
        while (note := pg.notifies()) is not None:
            self._on_notify(note.relname.decode(), note.extra.decode())
        if pg.is_busy():
            return False
        while (result := pg.get_result()) is not None:
            if result.error_message:
                raise Refused(result.error_message.decode(errors="replace").strip())
        return True

    def _query(self, pg: Any, sql: bytes) -> bool:
        """Send ``sql`` and wait up to ``probe_timeout`` for its answer; False if ``stop()`` came first.

        Raises :class:`ConnectionDead` when no answer came in time: a half-open connection
        never fails on its own, it only stays silent.
        """
        pg.send_query(sql)
        deadline = time.monotonic() + self._probe_timeout
        while pg.flush():  # a nonblocking connection: the query may leave in several writes
            if not select.select([], [pg.socket], [], max(0.0, deadline - time.monotonic()))[1]:
                raise ConnectionDead("the query could not be sent")
        while True:
            ready = self._wait_readable(pg.socket, deadline - time.monotonic())
            if ready is None:
                return False
            if ready and self._read(pg):
                return True
            if not ready:
                raise ConnectionDead(f"no answer within {self._probe_timeout:g} s")

    def _deliver(self, pg: Any) -> None:
        """Hand on notifications as they arrive and probe a silent connection, until ``stop()``.

        Raises when the connection breaks or stops answering.
        """
        heard_at = time.monotonic()
        while not self._stop.is_set():
            ready = self._wait_readable(pg.socket, heard_at + self._probe_every - time.monotonic())
            if ready is None:
                return
            if ready:
                self._read(pg)
            elif not self._query(pg, b""):  # silent for probe_every: does the server still answer?
                return
            heard_at = time.monotonic()

    def _listen(self, pg: Any) -> None:
        """LISTEN on every channel, then deliver until ``stop()``; raises when the connection fails."""
        listen = "; ".join(f'LISTEN "{channel}"' for channel in self._channels)
        if not self._query(pg, listen.encode()):
            return
        if self._failures:
            logger.warning("celery_boundedbeat: LISTEN reconnected to %s", mask_url(self._url))
        self._failures = 0
        self.listening = True
        # A reconnect may have missed notifications: let everyone look once.
        self._everyone_looks()
        self._deliver(pg)

    def _conninfo(self) -> str:
        """The URL as libpq reads it, with the listener's name, connect timeout and keepalives."""
        from psycopg.conninfo import make_conninfo

        url = normalize_url(self._url).set(drivername="postgresql").render_as_string(hide_password=False)
        # The engine's keepalives: a backstop for the probe, and they keep a NAT entry alive.
        return make_conninfo(url, connect_timeout=5, application_name=APPLICATION_NAME, **KEEPALIVES)

    def _run(self) -> None:
        import psycopg

        while not self._stop.is_set():
            try:
                # Not ``with``: its exit would roll back, and a rollback on a connection that
                # stopped answering fails or waits; closing only sends Terminate.
                conn = psycopg.connect(self._conninfo(), autocommit=True)
                try:
                    self._listen(conn.pgconn)
                finally:
                    conn.close()
            except Exception as exc:
                was_listening, self.listening = self.listening, False
                self._failures += 1
                if was_listening:
                    self._everyone_looks()  # they poll from now on: the next look must not wait
                if self._failures == 1:
                    logger.warning(
                        "celery_boundedbeat: LISTEN on %s failed (%s); polling until it returns",
                        mask_url(self._url),
                        type(exc).__name__,
                    )
                self._stop.wait(min(5.0, self._failures * 1.0))
        self.listening = False

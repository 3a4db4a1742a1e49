"""PostgreSQL LISTEN in a background thread: completions wake beat, new rows wake the dispatcher."""

from __future__ import annotations

import logging
import os
import select
import threading
from collections.abc import Callable
from typing import Any

from .engine import normalize_url
from .redact import mask_url

logger = logging.getLogger("celery_boundedbeat")


#: Longest wait for a notification before the thread looks at its connection again. ``stop()``
#: does not wait for it: it wakes the thread through a pipe, so beat exits at once on SIGTERM
#: while an idle listener wakes up once a minute instead of five times a second.
IDLE_WAIT = 60.0


class Listener:
    """Listens on channels and calls ``on_notify(channel, payload)``; reconnects after errors."""

    def __init__(self, url: str, channels: list[str], on_notify: Callable[[str, str], None]) -> None:
        self._url = url
        self._channels = channels
        self._on_notify = on_notify
        self._stop = threading.Event()
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._run, name="boundedbeat-listen", daemon=True)
        #: Whether notifications arrive now (LISTEN is set up); while not, callers poll.
        self.listening = False

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

    def _deliver(self, conn: Any) -> None:
        """Hand on notifications as they arrive, until ``stop()``; raises when the connection breaks."""
        while not self._stop.is_set():
            readable, _, _ = select.select([conn.fileno(), self._wake_read], [], [], IDLE_WAIT)
            if self._wake_read in readable:
                return
            # Something came in (or the connection broke: notifies() then raises).
            for note in conn.notifies(timeout=0):
                self._on_notify(note.channel, note.payload)

    def _conninfo(self) -> str:
        return normalize_url(self._url).set(drivername="postgresql").render_as_string(hide_password=False)

    def _run(self) -> None:
        import psycopg

        failures = 0
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._conninfo(), autocommit=True, connect_timeout=5) as conn:
                    for channel in self._channels:
                        conn.execute(f'LISTEN "{channel}"')
                    if failures:
                        logger.warning("celery_boundedbeat: LISTEN reconnected to %s", mask_url(self._url))
                    failures = 0
                    self.listening = True
                    # A reconnect may have missed notifications: let everyone look once.
                    for channel in self._channels:
                        self._on_notify(channel, "")
                    self._deliver(conn)
            except Exception as exc:
                self.listening = False
                failures += 1
                if failures == 1:
                    logger.warning(
                        "celery_boundedbeat: LISTEN on %s failed (%s); polling until it returns",
                        mask_url(self._url),
                        type(exc).__name__,
                    )
                self._stop.wait(min(5.0, failures * 1.0))

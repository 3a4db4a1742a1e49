"""PostgreSQL LISTEN in a background thread: completions wake beat, new rows wake the dispatcher."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from .engine import normalize_url
from .redact import mask_url

logger = logging.getLogger("celery_boundedbeat")


#: How often the listening thread looks at its stop flag: it bounds how long ``stop()`` (and
#: so beat's exit on SIGTERM) waits; an idle wakeup costs one poll() call.
STOP_CHECK_EVERY = 0.2


class Listener:
    """Listens on channels and calls ``on_notify(channel, payload)``; reconnects after errors."""

    def __init__(self, url: str, channels: list[str], on_notify: Callable[[str, str], None]) -> None:
        self._url = url
        self._channels = channels
        self._on_notify = on_notify
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="boundedbeat-listen", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, grace: float = 2.0) -> bool:
        """Ask the thread to end; returns whether it did within ``grace`` seconds."""
        self._stop.set()
        self._thread.join(grace)
        return not self._thread.is_alive()

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
                    # A reconnect may have missed notifications: let everyone look once.
                    for channel in self._channels:
                        self._on_notify(channel, "")
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=STOP_CHECK_EVERY):
                            self._on_notify(note.channel, note.payload)
            except Exception as exc:
                failures += 1
                if failures == 1:
                    logger.warning(
                        "celery_boundedbeat: LISTEN on %s failed (%s); polling until it returns",
                        mask_url(self._url),
                        type(exc).__name__,
                    )
                self._stop.wait(min(5.0, failures * 1.0))

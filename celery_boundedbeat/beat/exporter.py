"""Beat's ``/metrics`` endpoint: a snapshot refreshed on a daemon thread, served by prometheus_client.

The refresher reads one :class:`~.metrics.MetricsSnapshot` every ``metrics_refresh_interval``
seconds (the first at once); prometheus_client's HTTP server answers each scrape from the
latest one, so neither a scrape nor a slow database ever holds up the tick. A failed read
keeps the previous snapshot (``boundedbeat_metrics_snapshot_timestamp_seconds`` shows its
age) and is logged like every other recurring database access, once per streak.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from sqlalchemy import Engine

from ..core.loops import BackgroundLoop, OutageLog
from ..core.unstarted import DEFAULT_UNSTARTED_WARNING
from ..db.store import utcnow
from ..ops.metrics import MetricsSnapshot, SnapshotCollector, read_snapshot

logger = logging.getLogger("celery_boundedbeat.beat")

#: Seconds ``stop`` waits for a refresh in progress.
STOP_GRACE = 2.0


class MetricsExporter:
    """The refresher thread and the HTTP server of one beat; :meth:`stop` ends both."""

    def __init__(
        self,
        engine: Engine,
        *,
        refresh_interval: float,
        leader: Callable[[], bool],
        now: Callable[[], datetime] = utcnow,
        unstarted_after: float | None = DEFAULT_UNSTARTED_WARNING,
    ) -> None:
        self.refresh_interval = refresh_interval
        self._unstarted_after = unstarted_after
        self._engine = engine
        self._now = now
        self._snapshot: MetricsSnapshot | None = None
        self._lock = threading.Lock()
        self._reads = OutageLog(logger, "reading the metrics snapshot")
        self._loop = BackgroundLoop("boundedbeat-metrics", self._run)
        self._server: WSGIServer | None = None
        #: The port the endpoint listens on (the system's pick for port 0), once started.
        self.bound_port = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(self.snapshot, leader=leader))

    def snapshot(self) -> MetricsSnapshot | None:
        """The latest snapshot (``None`` until the first read succeeded)."""
        with self._lock:
            return self._snapshot

    def refresh(self) -> bool:
        """Read a new snapshot; on failure keep the old one and log the streak."""
        try:
            snapshot = read_snapshot(self._engine, self._now(), self._unstarted_after)
        except Exception as exc:
            self._reads.failed(exc)
            return False
        self._reads.succeeded()
        with self._lock:
            self._snapshot = snapshot
        return True

    def _run(self, shutdown: threading.Event, _wakeup: threading.Event) -> None:
        while not shutdown.is_set():
            self.refresh()
            shutdown.wait(self.refresh_interval)

    def start(self, host: str, port: int) -> tuple[str, int]:
        """Bind the endpoint (``OSError`` if it cannot) and start refreshing; the bound address."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        self._loop.start()
        bound = server.server_address
        self.bound_port = int(bound[1])
        return str(bound[0]), self.bound_port

    def stop(self) -> None:
        """Close the endpoint and stop the refresher (a read in progress gets ``STOP_GRACE``)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._loop.stop(STOP_GRACE)


def serve_metrics(
    engine: Engine,
    *,
    host: str,
    port: int,
    refresh_interval: float,
    leader: Callable[[], bool],
    unstarted_after: float | None = DEFAULT_UNSTARTED_WARNING,
) -> MetricsExporter | None:
    """Start beat's endpoint, or log why not and return ``None``.

    An endpoint that cannot bind (the port is taken, say by a second beat on the host) costs
    the metrics, not the scheduling: beat goes on without them, after one error line.
    """
    exporter = MetricsExporter(
        engine, refresh_interval=refresh_interval, leader=leader, unstarted_after=unstarted_after
    )
    try:
        bound_host, bound_port = exporter.start(host, port)
    except OSError as exc:
        logger.error(
            "celery_boundedbeat: cannot serve Prometheus metrics on %s:%d: %s; beat goes on without them",
            host,
            port,
            exc,
        )
        return None
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    logger.info("celery_boundedbeat: serving Prometheus metrics on http://%s:%d/metrics", shown, bound_port)
    return exporter

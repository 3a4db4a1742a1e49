"""A TCP proxy on 127.0.0.1 that can go half-open: stop forwarding without closing anything.

A NAT gateway or load balancer that drops an idle flow leaves both ends "connected": neither
side is told, every byte sent is lost, and each end waits for the other. ``stall`` does that to
the PostgreSQL connections whose startup message names ``application_name`` (the listener's,
``boundedbeat-listen``), including any opened while stalled; every other connection through the
proxy (the engine's pool) goes on. ``resume`` forwards again. Import it as ``tcpproxy``
(``tests/`` is on ``sys.path``, see ``pgtools``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from sqlalchemy.engine import make_url


class Pair:
    """One client connection and its upstream connection."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.marked = False

    def close(self) -> None:
        """Close both ends so each peer sees it: a plain ``close()`` while the other pump
        thread waits in ``recv`` on that socket sends no FIN, and its peer waits forever."""
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class StallingProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``; ``stall()`` silences the marked connections."""

    def __init__(self, target: tuple[str, int], marker: bytes) -> None:
        self.target = target
        self.marker = marker
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = False
        self._pairs: list[Pair] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="tcpproxy-accept", daemon=True).start()

    def stall(self) -> None:
        """Stop forwarding on the marked connections (open ones and new ones), closing nothing."""
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    def marked(self) -> int:
        """How many marked connections the proxy has seen (a reconnect adds one)."""
        with self._lock:
            return sum(1 for p in self._pairs if p.marked)

    def close(self) -> None:
        self._closed = True
        self._flowing.set()
        with contextlib.suppress(OSError):
            self._server.close()
        with self._lock:
            for pair in self._pairs:
                pair.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                if self._closed:
                    return
                continue
            pair = Pair(client, upstream)
            with self._lock:
                self._pairs.append(pair)
            threading.Thread(target=self._pump, args=(pair, client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(pair, upstream, client, False), daemon=True).start()

    def _pump(self, pair: Pair, source: socket.socket, sink: socket.socket, outbound: bool) -> None:
        seen = b""
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if outbound and not pair.marked and len(seen) < 4096:
                    seen += data  # the startup message carries application_name
                    pair.marked = self.marker in seen
                while pair.marked and not self._flowing.wait(0.2):
                    pass  # stalled: the bytes are held, the sockets stay open
                if self._closed:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            pair.close()


@contextlib.contextmanager
def stalling_proxy(database_url: str, marker: bytes) -> Iterator[tuple[StallingProxy, str]]:
    """A proxy in front of ``database_url``'s server and the same URL through it."""
    url = make_url(database_url)
    proxy = StallingProxy((url.host or "127.0.0.1", url.port or 5432), marker)
    try:
        yield proxy, url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    finally:
        proxy.close()

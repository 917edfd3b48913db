"""The buffering proxy of the streaming lesson: bytes held and let go as it says, and closing it
with connections open ends them quietly (no asyncio traceback on the notebook's stderr)."""
from __future__ import annotations

import logging
import socket
import threading

from workbench.serving.proxy import BufferingProxy


class _Upstream:
    """A loopback TCP server that answers each connection's first bytes with one HTTP response
    of `body`, then keeps the connection open until the test ends."""

    def __init__(self, body: bytes):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.body = body
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            c.recv(65536)
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(self.body) + self.body)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)     # wakes the blocked accept()
        self.sock.close()
        for c in self.conns:
            c.close()
        self.thread.join(5)
        assert not self.thread.is_alive()


def test_proxy_relays_a_whole_response_and_closes_quietly_with_connections_open(caplog):
    up = _Upstream(b"x" * 10_000)
    proxy = BufferingProxy(up.url, buffer_bytes=1 << 20)
    clients = []
    try:
        with caplog.at_level(logging.DEBUG, logger="asyncio"):
            host, port = proxy.url[len("http://"):].split(":")
            for _ in range(3):
                c = socket.create_connection((host, int(port)), timeout=10)
                clients.append(c)
                c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                got = b""
                while not got.endswith(b"x" * 10_000):
                    chunk = c.recv(65536)
                    assert chunk, got[:200]
                    got += chunk
                # Held until the response was whole (more than the buffer asks), then one write.
                assert got.startswith(b"HTTP/1.1 200 OK")
            assert proxy.flushes == 3
            proxy.close()                    # three connections still open on both sides
            assert not proxy._thread.is_alive()
            for c in clients:                # each ended by the proxy
                c.settimeout(10)
                assert c.recv(1) == b""
    finally:
        for c in clients:
            c.close()
        proxy.close()
        up.close()
    noise = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert noise == [], noise

"""A small reverse proxy that can buffer: what a token stream looks like to a client when
something between it and the server holds bytes back (nginx's `proxy_buffering`, on by
default, a corporate proxy, a CDN), and when nothing does. For the streaming lesson and for
trying a client against a misconfigured path; not for production traffic.

    with BufferingProxy("http://127.0.0.1:8000", buffer_bytes=4096) as proxy:
        RemoteEngine(proxy.url).stream(...)      # tokens arrive 4 KiB at a time

It relays TCP, so HTTP/1.1 passes through untouched (keep-alive, chunked bodies, SSE). Bytes
from the client go up at once; bytes from the server are held until `buffer_bytes` have
gathered or the server ends the connection (`buffer_bytes=0`: passed on as they come). A
client that hangs up closes the upstream connection too, as a proxy does, so the server sees
the disconnect and aborts the request.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from urllib.parse import urlsplit


class BufferingProxy:
    """A proxy on a free loopback port (`url`) in front of `upstream` (an http:// root),
    running on a thread of its own until `close()`."""

    def __init__(self, upstream: str, buffer_bytes: int = 4096):
        if buffer_bytes < 0:
            raise ValueError(f"buffer_bytes: must be >= 0 (got {buffer_bytes})")
        u = urlsplit(upstream)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"upstream: an http:// root is needed (got {upstream!r})")
        self.upstream = (u.hostname, u.port or 80)
        self.buffer_bytes = buffer_bytes
        self.flushes = 0
        """Writes to clients so far (each one a burst the client sees at once)."""
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), daemon=True,
                                        name="buffering-proxy")
        self._thread.start()
        started.wait(30)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._accept, "127.0.0.1", 0))
        started.set()
        self._loop.run_forever()
        self._loop.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # asyncio's own callback on this task asks it for its exception, and a cancelled task
        # answers with a logged traceback (Python 3.11): closing ends a connection quietly.
        with contextlib.suppress(asyncio.CancelledError):
            await self._relay(reader, writer)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        up = asyncio.ensure_future(self._pipe(reader, up_writer, 0))
        down = asyncio.ensure_future(self._pipe(up_reader, writer, self.buffer_bytes,
                                                count=True))
        try:
            # Either side closing ends the pair: a client's hang-up reaches the server.
            await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (up, down):
                t.cancel()
            for w in (writer, up_writer):
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    hold: int, count: bool = False) -> None:
        held = bytearray()
        ends = _ResponseEnds() if count else None
        with contextlib.suppress(ConnectionError):
            while True:
                data = await reader.read(65536)
                if data:
                    held += data
                done = ends is not None and ends.feed(data)      # a response is complete
                if held and (not data or done or len(held) >= hold):
                    if count:                 # counted before the client can see the bytes
                        self.flushes += 1
                    writer.write(bytes(held))
                    held.clear()
                    await writer.drain()
                if not data:
                    return

    def close(self) -> None:
        """Stop listening and drop every open connection."""
        if not self._thread.is_alive():
            return

        async def shut() -> None:
            self._server.close()
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(shut(), self._loop)
        self._thread.join(10)

    def __enter__(self) -> "BufferingProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ResponseEnds:
    """Where HTTP/1.1 responses end in a server's byte stream (keep-alive connections carry
    several), so held bytes go out when a response is whole: its Content-Length reached, or
    a chunked body's last chunk seen. Just enough HTTP for that."""

    def __init__(self):
        self._buf = bytearray()

    def feed(self, data: bytes) -> bool:
        """Whether a response ended within what has come so far (then it is forgotten)."""
        self._buf += data
        ended = False
        while True:
            head_end = self._buf.find(b"\r\n\r\n")
            if head_end < 0:
                return ended
            head = bytes(self._buf[:head_end]).decode("latin-1").lower()
            body = head_end + 4
            length = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                           if line.startswith("content-length:")), None)
            if length is not None:
                end = body + length
            elif "transfer-encoding: chunked" in head:
                last = self._buf.find(b"\r\n0\r\n\r\n", body - 2)
                end = -1 if last < 0 else last + 7
            else:                              # no framing: it ends when the server closes
                return ended
            if end < 0 or end > len(self._buf):
                return ended
            del self._buf[:end]
            ended = True

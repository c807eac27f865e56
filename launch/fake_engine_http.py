"""Minimal HTTP/1.1 server on asyncio.Protocol + httptools, for the fake engine.

Keep-alive, pipelined requests answered in order, chunked streaming, TCP_NODELAY, a large listen
backlog, write back-pressure (``Conn.drain``), and disconnect detection: when the client closes,
the task answering it is cancelled and ``Conn.lost`` is set. No FastAPI: the fake must cost far
less CPU per token than the router it measures.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus

import httptools

try:
    import orjson

    dumps = orjson.dumps
    loads = orjson.loads
except ImportError:  # pragma: no cover - orjson is a dependency, but keep the fake usable
    def dumps(obj: object) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    loads = json.loads

Handler = Callable[["Conn", str, str, dict[str, str], bytes], Awaitable[None]]

_ERROR_TYPES = {400: "BadRequestError", 401: "UnauthorizedError", 404: "NotFoundError",
                405: "MethodNotAllowed", 429: "RateLimitError", 500: "InternalServerError",
                501: "NotImplementedError", 503: "ServiceUnavailableError"}


def error_body(message: str, status: int, param: str | None = None) -> bytes:
    """vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}}."""
    etype = _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")
    return dumps({"error": {"message": message, "type": etype, "param": param, "code": status}})


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return f"HTTP/1.1 {status} {phrase}\r\n".encode()


class Conn(asyncio.Protocol):
    """One client connection. Requests are handled one at a time, in arrival order."""

    def __init__(self, server: HttpServer):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.pending: deque = deque()
        self.task: asyncio.Task | None = None
        self.lost = False
        self.paused = False
        self.keep_alive = True
        self._lost_waiter: asyncio.Future | None = None
        self._drain_waiter: asyncio.Future | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        self.server.conns.add(self)
        self.server.connections_accepted += 1

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(_status_line(400) + b"content-length: 0\r\nconnection: close\r\n\r\n")
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.server.conns.discard(self)
        for fut in (self._lost_waiter, self._drain_waiter):
            if fut is not None and not fut.done():
                fut.set_result(None)
        if self.task is not None:
            self.task.cancel()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    # -- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body = b"", {}, []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode("ascii")
        self.pending.append((method, self._url.decode("latin-1"), self._headers,
                             b"".join(self._body), self.parser.should_keep_alive()))
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while self.pending and not self.lost:
                method, url, headers, body, keep_alive = self.pending.popleft()
                self.keep_alive = keep_alive
                await self.server.handler(self, method, url, headers, body)
                if not self.keep_alive and not self.lost:
                    self.close()
        finally:
            self.task = None

    # -- responses -------------------------------------------------------------------------
    def _conn_header(self) -> bytes:
        return b"" if self.keep_alive else b"connection: close\r\n"

    def send(self, status: int, body: bytes, content_type: str | None = "application/json") -> None:
        if self.lost:
            return
        ct = f"content-type: {content_type}\r\n".encode() if content_type else b""
        self.transport.write(b"%s%scontent-length: %d\r\n%s\r\n%s" % (
            _status_line(status), ct, len(body), self._conn_header(), body))

    def send_partial_and_abort(self, status: int, body: bytes, n: int) -> None:
        """Headers promising the whole body, then only ``n`` bytes of it, then a reset."""
        if self.lost:
            return
        self.transport.write(b"%scontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (_status_line(status), len(body), body[:n]))
        self.abort()

    def start_stream(self) -> None:
        if self.lost:
            return
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8"
                             b"\r\ntransfer-encoding: chunked\r\n%s\r\n" % self._conn_header())

    def chunk(self, data: bytes) -> None:
        if not self.lost:
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_stream(self) -> None:
        if not self.lost:
            self.transport.write(b"0\r\n\r\n")

    async def drain(self) -> None:
        if self.paused and not self.lost:
            self._drain_waiter = asyncio.get_running_loop().create_future()
            await self._drain_waiter

    async def wait_lost(self) -> None:
        if not self.lost:
            self._lost_waiter = asyncio.get_running_loop().create_future()
            await self._lost_waiter

    def close(self) -> None:
        """Graceful close (FIN) after what was written is flushed."""
        self.keep_alive = False
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        """Abrupt close: drops unsent data, the peer sees a reset."""
        self.keep_alive = False
        if self.transport is not None:
            self.transport.abort()


class HttpServer:
    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0,
                 backlog: int = 4096):
        self.handler, self.host, self._port, self.backlog = handler, host, port, backlog
        self.conns: set[Conn] = set()
        self.connections_accepted = 0
        self._server: asyncio.base_events.Server | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("server not started")
        return self._server.sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: Conn(self), self.host, self._port,
                                                backlog=self.backlog, reuse_address=True)

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        tasks = [c.task for c in self.conns if c.task is not None]
        for c in list(self.conns):
            c.abort()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None

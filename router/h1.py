"""The router's HTTP/1.1 client for engine answers (streamed and whole), driven by protocol callbacks.

The decode leg of a streamed request is the router's per-token path. With aiohttp every
token chunk crossed its `StreamReader` and woke the relaying task (a future, a task step,
a few Python layers). Here the engine's socket feeds `httptools` (C) straight from
`data_received`, and each body chunk goes to whoever is attached to the stream:

- before the stream is handed to the client, chunks are buffered (`first()`, `chunks()`);
- once `attach(on_chunk, on_end, on_error)` is called, `on_chunk` runs inside the
  engine connection's `data_received`, so a token costs no task wake-up at all
  (`relay.splice` writes it to the client's transport from there);
- with `start_fast(relay, on_flags)` (the C `router._splice.Relay`), a read that is a run of
  whole chunks, taken while the parser sits between two chunks, is relayed by one C call
  without reaching httptools or any Python callback; the relay declines (SLOW) every other
  read, which then takes the path above. Declined reads leave no trace, and the fast ones
  ended on a chunk boundary, so the parser's state stays right.

Connections are HTTP/1.1 keep-alive, pooled per engine (host, port, TLS); one is reused only
after its answer was read to the end. A stream closed early closes its connection, which
is how the engine learns that the request is gone (vLLM then aborts it).

Timeouts are one timer per stream, re-armed at most once per idle period: the header
deadline, then the first-byte deadline, then the idle gap and the whole-request deadline.
Every failure is an `UpstreamError` (or `UpstreamTimeout`), as from `router.upstream`.

`fetch` reads a whole answer (prefill legs, non-streamed decode, health probes) on the same pools.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl as _ssl
from typing import AsyncIterator, Callable

import httptools

from router.errors import BadRequest, UpstreamError, UpstreamTimeout

log = logging.getLogger("pd_router.h1")
FAST_SLOW = 1  # router._splice.SLOW: the relay declined the read
HOLD_BODY, HOLD_END = 1, 2  # Stream.hold_head
STATUS_WAIT_S = 10.0  # how long the body of an error status is read before giving up on it


class Conn(asyncio.Protocol):
    """One keep-alive connection to an engine; answers one `Stream` at a time."""

    __slots__ = ("pool", "key", "transport", "parser", "stream", "idle_since", "lost", "got_bytes", "parts",
                 "at_boundary")

    def __init__(self, pool: "Pool", key: tuple[str, int, bool]):
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.stream: Stream | None = None
        self.idle_since = 0.0
        self.lost = False
        self.got_bytes = False
        self.parts: list[bytes] = []  # body pieces of the read being parsed
        self.at_boundary = False  # the parser is inside a chunked body, between two chunks

    # -- asyncio.Protocol -------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except (OSError, AttributeError):
                pass

    def data_received(self, data: bytes) -> None:
        """Feed the parser; the body bytes of one read reach the stream as ONE piece, after
        the parse (several HTTP chunks that arrived together are joined), so a read costs
        one relay call and one write to the client however the engine's chunks coalesced."""
        self.got_bytes = True
        stream = self.stream
        if stream is None:  # bytes on an idle connection: it cannot be reused
            self.transport.close()
            return
        fast = stream.fast
        if fast is not None and self.at_boundary:
            try:
                flags = fast.feed(data)
                if flags != FAST_SLOW:
                    if flags:
                        stream.on_fast_flags(flags)
                    return
            except Exception as exc:  # noqa: BLE001 - a bug of ours: fail this stream, keep serving
                log.error("stream handler failed: %r", exc, exc_info=exc)
                stream.fail(UpstreamError(f"router failed relaying the {stream.stage} stream", stage=stream.stage,
                                          code="relay_error"))
                return
        parts = self.parts
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:  # our own code failed inside a callback
            self.parts.clear()
            log.error("stream handler failed: %r", exc.__context__ or exc, exc_info=exc.__context__ or exc)
            stream.fail(UpstreamError(f"router failed relaying the {stream.stage} stream", stage=stream.stage,
                                      code="relay_error"))
        except httptools.HttpParserUpgrade:
            self._flush()
            stream.fail(UpstreamError(f"{stream.stage} instance tried to upgrade the connection",
                                      stage=stream.stage, code="bad_response"))
        except httptools.HttpParserError as exc:
            self._flush()
            stream.fail(UpstreamError(f"{stream.stage} instance sent a malformed response: {exc}",
                                      stage=stream.stage, code="bad_response"))
        else:
            if parts:
                stream.on_body(parts[0] if len(parts) == 1 else b"".join(parts))
                parts.clear()

    def _flush(self) -> None:
        parts = self.parts
        if parts:
            body = parts[0] if len(parts) == 1 else b"".join(parts)
            parts.clear()
            if self.stream is not None:
                self.stream.on_body(body)

    def eof_received(self):
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc) -> None:
        self.lost = True
        self.pool.forget(self)
        stream = self.stream
        if stream is not None:
            self._flush()
            if stream.until_eof and exc is None and stream.status:
                stream.on_end(False)  # a body delimited by the connection's end (no length, not chunked)
            else:
                stream.lost(exc)

    # -- httptools callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.stream.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.at_boundary = self.stream.on_head(self.parser.get_status_code())

    def on_chunk_header(self) -> None:
        self.at_boundary = False

    def on_chunk_complete(self) -> None:
        self.at_boundary = True

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)

    def on_message_complete(self) -> None:
        self._flush()
        self.stream.on_end(self.parser.should_keep_alive())


class Stream:
    """An engine's answer to one POST, read as it arrives. Always `aclose()` it."""

    __slots__ = ("conn", "stage", "status", "raw_headers", "_loop", "_head", "_buf", "_waiter", "_sink",
                 "_end_cb", "_err_cb", "done", "error", "_timer", "_idle", "deadline", "_last", "_paused",
                 "closed", "until_eof", "fast", "_fast_cb", "hold_head", "_on_answer")

    def __init__(self, conn: Conn, stage: str, loop: asyncio.AbstractEventLoop):
        self.conn = conn
        self.stage = stage
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._loop = loop
        self._head = loop.create_future()
        self._buf: list[bytes] = []  # body chunks not yet taken (nothing attached)
        self._waiter: asyncio.Future | None = None
        self._sink: Callable[[bytes], None] | None = None
        self._end_cb: Callable[[], None] | None = None
        self._err_cb: Callable[[UpstreamError], None] | None = None
        self.done = False  # the answer ended (complete or failed)
        self.error: UpstreamError | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._idle: float | None = None
        self.deadline: float | None = None  # loop time by which the whole stream must end
        self._last = 0.0
        self._paused = False
        self.closed = False
        self.until_eof = False
        self.fast = None  # a router._splice.Relay taking whole-chunk reads (start_fast)
        self._fast_cb: Callable[[int], None] | None = None
        # head() waits longer: HOLD_BODY, a 200 answer's first body bytes too; HOLD_END, the
        # whole answer (any status). One wake-up where the engine writes head and body apart.
        self.hold_head = 0
        self._on_answer: Callable[[Stream], None] | None = None  # see set_on_answer

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self.raw_headers}

    # -- events from the connection ----------------------------------------------------------

    def on_head(self, status: int) -> bool:
        """The status line and headers are in; returns whether the body is chunked."""
        self.status = status
        chunked = False
        if status >= 200 and status not in (204, 304):
            te = None
            length = False
            for k, v in self.raw_headers:
                k = k.lower()
                if k == b"transfer-encoding":
                    te = v
                elif k == b"content-length":
                    length = True
            self.until_eof = te is None and not length
            chunked = te is not None and te.strip().lower().endswith(b"chunked")
        hold = self.hold_head
        if not self._head.done() and not (hold == HOLD_END or (hold and status == 200)):
            self._head.set_result(status)
        return chunked

    def on_body(self, body: bytes) -> None:
        self._last = self._loop.time()
        sink = self._sink
        if sink is not None:
            sink(body)
            return
        self._buf.append(body)
        if not self._head.done() and self.hold_head != HOLD_END:  # HOLD_BODY: one wake-up for both
            self._head.set_result(self.status)
        self._wake()

    def on_fast_flags(self, flags: int) -> None:
        self._fast_cb(flags)

    def on_end(self, keep_alive: bool) -> None:
        if self.done:
            return
        self.done = True
        self.fast = None
        self._cancel_timer()
        conn = self.conn
        conn.stream = None
        if keep_alive and not self.closed and not conn.lost:
            if self._paused:  # the consumer paused us in this very read: the pool gets a reading connection
                self._paused = False
                conn.transport.resume_reading()
            conn.pool.release(conn)
        else:
            conn.transport.close()
        if not self._head.done():  # held (HOLD_BODY and an empty body, or HOLD_END)
            self._head.set_result(self.status)
        hook = self._on_answer
        if hook is not None:
            self._on_answer = None
            self._answered(hook)
        if self._end_cb is not None:
            self._end_cb()
        else:
            self._wake()

    def set_on_answer(self, hook: Callable[[Stream], None] | None) -> None:
        """Call `hook(self)` from the connection's read callback as soon as the whole answer is
        in (now, if it is), before the reader wakes up; not on failure, nor once closed. The
        hook must not raise (a bug in it is logged, the answer is unaffected)."""
        if self.done:
            if hook is not None and self.error is None and not self.closed:
                self._answered(hook)
        else:
            self._on_answer = hook

    def _answered(self, hook: Callable[[Stream], None]) -> None:
        try:
            hook(self)
        except Exception:  # noqa: BLE001 - the reader still gets the answer
            log.exception("answer hook of a %s stream failed", self.stage)

    def lost(self, exc) -> None:
        detail = f": {exc}" if exc else ""
        self.fail(UpstreamError(f"{self.stage} instance closed the connection{detail}", stage=self.stage,
                                code="connection_lost"))

    def fail(self, err: UpstreamError) -> None:
        """End the stream with `err` (closes the connection)."""
        if self.done:
            return
        self.error = err
        self._drop()
        if not self._head.done():
            self._head.set_exception(err)
            self._head.exception()  # retrieved by whoever awaits it; never "never retrieved"
        if self._err_cb is not None:
            self._err_cb(err)
        else:
            self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- timers -------------------------------------------------------------------------------

    def expire_at(self, when: float | None, message: str) -> None:
        """Fail the stream with UpstreamTimeout(`message`) at loop time `when` (None: no limit)."""
        self._cancel_timer()
        if when is not None and not self.done:
            self._timer = self._loop.call_at(when, self._expired, message)

    def _expired(self, message: str) -> None:
        self._timer = None
        self.fail(UpstreamTimeout(message, stage=self.stage))

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _last_read(self) -> float:
        fast = self.fast
        if fast is not None and fast.last_read > self._last:
            return fast.last_read  # the same clock (CLOCK_MONOTONIC) as the loop's
        return self._last

    def _arm(self) -> None:
        """Idle gap and whole-request deadline: one timer, re-armed when it fires early."""
        when = None if self._idle is None else self._last_read() + self._idle
        if self.deadline is not None and (when is None or self.deadline < when):
            when = self.deadline
        if when is not None and not self.done:
            self._timer = self._loop.call_at(when, self._check)

    def _check(self) -> None:
        self._timer = None
        now = self._loop.time()
        if self.deadline is not None and now >= self.deadline:
            self.fail(UpstreamTimeout("request timeout reached while streaming", stage=self.stage))
        elif self._idle is not None and now - self._last_read() >= self._idle:
            self.fail(UpstreamTimeout(f"{self.stage} stream idle for more than {self._idle:g}s", stage=self.stage))
        else:
            self._arm()

    # -- reading ------------------------------------------------------------------------------

    async def head(self, timeout: float | None) -> int:
        """Wait for the status line and headers (within `timeout`)."""
        if timeout is not None:
            self.expire_at(self._loop.time() + timeout, f"{self.stage} instance did not answer within {timeout:g}s")
        try:
            return await self._head
        finally:
            self._cancel_timer()

    async def _next(self) -> bytes | None:
        """The next buffered chunk, waiting if needed; None at the end (raises on failure)."""
        while not self._buf:
            if self.done:
                if self.error is not None:
                    raise self.error
                return None
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._buf.pop(0)

    async def first(self, timeout: float | None) -> bytes:
        """The first body chunk within `timeout` (b"" when the answer has no body)."""
        if self._buf:
            return self._buf.pop(0)
        if timeout is not None:
            self.expire_at(self._loop.time() + timeout, f"{self.stage} instance sent no data within {timeout:g}s")
        try:
            chunk = await self._next()
        finally:
            self._cancel_timer()
        return chunk or b""

    async def read_all(self, timeout: float) -> bytes:
        """The rest of the body (used for error statuses); b"" if it does not come in time."""
        parts = []
        self.expire_at(self._loop.time() + timeout, "error body not read in time")
        try:
            while (chunk := await self._next()) is not None:
                parts.append(chunk)
        except UpstreamError:
            pass
        finally:
            self._cancel_timer()
        return b"".join(parts)

    def set_limits(self, idle_timeout: float | None, deadline: float | None) -> None:
        self._idle = idle_timeout
        self.deadline = deadline

    def attach(self, on_chunk: Callable[[bytes], None], on_end: Callable[[], None],
               on_error: Callable[[UpstreamError], None]) -> None:
        """From now on deliver chunks by callback, from the connection's `data_received`.
        Buffered chunks (and an end already seen) are delivered first, before this returns."""
        self._last = self._loop.time()
        buffered, self._buf = self._buf, []
        for chunk in buffered:
            on_chunk(chunk)
        if self.done:
            if self.error is not None:
                on_error(self.error)
            else:
                on_end()
            return
        self._sink, self._end_cb, self._err_cb = on_chunk, on_end, on_error
        self._arm()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body chunks not yet taken, as an async iterator (for the ASGI relay)."""
        self._last = self._loop.time()
        self._arm()
        try:
            while (chunk := await self._next()) is not None:
                yield chunk
        finally:
            self._cancel_timer()

    def start_fast(self, relay, on_flags: Callable[[int], None]) -> None:
        """Let `relay.feed` take whole-chunk reads from now on (see the module's doc);
        `on_flags(flags)` gets its non-zero answers (PAUSED, FLUSH)."""
        if not self.done:
            self.fast, self._fast_cb = relay, on_flags

    def stop_fast(self) -> None:
        fast = self.fast
        if fast is not None:
            self._last = self._last_read()  # the idle timer keeps what the C relay saw
            self.fast = None

    def pause_reading(self) -> None:
        if not self._paused and not self.done:
            self._paused = True
            self.conn.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._paused:
            self._paused = False
            if not self.done:
                self.conn.transport.resume_reading()

    def body(self) -> bytes:
        """The body bytes buffered so far (not taken by a reader), joined; they stay buffered."""
        buf = self._buf
        return buf[0] if len(buf) == 1 else b"".join(buf)

    async def aclose(self) -> None:
        """Done with the stream (see `close`)."""
        self.close()

    def close(self) -> None:
        """Done with the stream. If its answer was not read to the end, the connection is
        closed (the engine sees the disconnect and aborts the request)."""
        if self.closed:
            return
        self.closed = True
        self._sink = self._end_cb = self._err_cb = self._fast_cb = self._on_answer = None
        self.fast = None
        if not self.done:
            self._drop()

    def _drop(self) -> None:
        """End the stream before its answer was read to the end: the connection is closed,
        never pooled (the engine sees the disconnect)."""
        self.done = True
        self.fast = None
        self._cancel_timer()
        conn = self.conn
        conn.stream = None
        if not conn.lost:
            conn.transport.close()


class Pool:
    """Keep-alive connections per (host, port)."""

    def __init__(self, *, connect_timeout: float = 5.0, idle_s: float = 30.0, max_idle_per_host: int = 2048):
        self.connect_timeout = connect_timeout
        self.idle_s = idle_s
        self.max_idle = max_idle_per_host
        self._idle: dict[tuple[str, int, bool], list[Conn]] = {}
        self.opened = 0  # connections made (for tests and metrics)
        self._tls: _ssl.SSLContext | None = None

    def _tls_context(self) -> _ssl.SSLContext:
        if self._tls is None:
            self._tls = _ssl.create_default_context()
        return self._tls

    def take_idle(self, host: str, port: int, tls: bool = False) -> Conn | None:
        """An idle pooled connection that is still usable, or None."""
        idle = self._idle.get((host, port, tls))
        if idle:
            now = asyncio.get_running_loop().time()
            while idle:
                conn = idle.pop()
                if conn.lost or conn.transport.is_closing() or now - conn.idle_since > self.idle_s:
                    conn.transport.close()
                    continue
                return conn
        return None

    async def acquire(self, host: str, port: int, stage: str, tls: bool = False) -> tuple[Conn, bool]:
        """(connection, reused): an idle pooled one if any is usable, else a new one."""
        conn = self.take_idle(host, port, tls)
        if conn is not None:
            return conn, True
        key = (host, port, tls)
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: Conn(self, key), host, port,
                                                       ssl=self._tls_context() if tls else None)
        except TimeoutError:
            raise UpstreamTimeout(f"cannot connect to {stage} instance within {self.connect_timeout:g}s",
                                  stage=stage) from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {stage} instance at {host}:{port}: {exc}", stage=stage,
                                code="connect_error") from None
        self.opened += 1
        return conn, False

    def release(self, conn: Conn) -> None:
        idle = self._idle.setdefault(conn.key, [])
        if len(idle) >= self.max_idle:
            conn.transport.close()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        idle.append(conn)

    def forget(self, conn: Conn) -> None:
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()


def request_head(method: str, path: str, hostport: str, headers: dict[str, str], length: int | None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1\r\nhost: {hostport}\r\n"]
    if length is not None:
        lines.append(f"content-length: {length}\r\n")
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise BadRequest(f"header {name!r} cannot be forwarded (line break in it)")
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


def _prepare(method: str, host: str, port: int, path: str, body: bytes | None,
             headers: dict[str, str]) -> tuple[bytes, bytes | None]:
    """The request's head (with a small body appended) and the body left to write, if any."""
    head = request_head(method, path, f"{host}:{port}" if ":" not in host else f"[{host}]:{port}", headers,
                        None if body is None else len(body))
    if body:
        if len(body) < 65536:
            return head + body, None
        return head, body
    return head, None


def _send(conn: Conn, head: bytes, body: bytes | None, stage: str, loop: asyncio.AbstractEventLoop) -> Stream:
    stream = Stream(conn, stage, loop)
    conn.stream = stream
    conn.got_bytes = False
    conn.at_boundary = False
    conn.transport.write(head)
    if body is not None:
        conn.transport.write(body)
    return stream


def start(pool: Pool, method: str, host: str, port: int, path: str, body: bytes | None,
          headers: dict[str, str], *, stage: str, tls: bool = False, hold: int = 0) -> Stream | None:
    """Send a request now, without yielding to the loop, on an idle pooled connection (None when
    there is none: then `open_stream` connects). Hand the stream to `open_stream(started=...)`
    (or `aclose()` it) with the `until_*` that `hold` (HOLD_BODY, HOLD_END) says: set now, it
    holds an answer that comes in before then."""
    conn = pool.take_idle(host, port, tls)
    if conn is None:
        return None
    head, rest = _prepare(method, host, port, path, body, headers)
    stream = _send(conn, head, rest, stage, asyncio.get_running_loop())
    stream.hold_head = hold
    return stream


async def open_stream(pool: Pool, method: str, host: str, port: int, path: str, body: bytes | None,
                      headers: dict[str, str], *, timeout: float | None, stage: str, tls: bool = False,
                      started: Stream | None = None, until_body: bool = False, until_end: bool = False,
                      on_answer: Callable[[Stream], None] | None = None) -> Stream:
    """Send a request and wait for the answer's status line and headers (within `timeout`).
    `started`: the same request already sent by `start` (then it is not sent again).
    `until_body`: a 200 answer is waited for until its first body bytes (or its end) are in
    too, so that an engine that sends its head long before its first token (vLLM streams do)
    wakes the caller once, not twice; other statuses return at their head. `until_end`: any
    answer is waited for until its end (for `fetch`, which reads it whole: an engine that
    writes the head and the body apart, as uvicorn does, wakes the caller once). `on_answer`:
    see `Stream.set_on_answer`.

    A pooled connection that the engine closed before answering (its keep-alive timer and
    our reuse crossed) is retried once on a new connection: the engine produced nothing.
    """
    loop = asyncio.get_running_loop()
    for attempt in range(2):
        if started is not None:
            stream, started = started, None
            conn, reused = stream.conn, True
        else:
            head, rest = _prepare(method, host, port, path, body, headers)
            conn, reused = await pool.acquire(host, port, stage, tls)
            stream = _send(conn, head, rest, stage, loop)
        stream.hold_head = HOLD_END if until_end else HOLD_BODY if until_body else 0
        if on_answer is not None:
            stream.set_on_answer(on_answer)
        try:
            await stream.head(timeout)
        except UpstreamError as exc:
            if reused and attempt == 0 and not conn.got_bytes and getattr(exc, "code", "") == "connection_lost":
                continue
            raise
        except BaseException:
            await stream.aclose()
            raise
        return stream
    raise AssertionError("unreachable")


async def fetch(pool: Pool, method: str, host: str, port: int, path: str, body: bytes | None,
                headers: dict[str, str], *, timeout: float | None, stage: str,
                tls: bool = False, started: Stream | None = None,
                on_answer: Callable[[Stream], None] | None = None) -> tuple[int, bytes, Stream]:
    """A whole exchange within `timeout`: (status, body, the finished stream for its headers).
    `on_answer(stream)` runs as soon as the answer is in, before the caller wakes."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + timeout
    stream = await open_stream(pool, method, host, port, path, body, headers, timeout=timeout, stage=stage, tls=tls,
                               started=started, until_end=True, on_answer=on_answer)
    try:
        if deadline is not None:
            stream.expire_at(deadline, f"{stage} instance did not answer within {timeout:g}s")
        parts = []
        while (chunk := await stream._next()) is not None:
            parts.append(chunk)
    finally:
        await stream.aclose()
    return stream.status, b"".join(parts), stream

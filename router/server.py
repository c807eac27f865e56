"""The router's HTTP/1.1 server: uvicorn's httptools protocol, with the two hot endpoints
served below ASGI.

uvicorn keeps what it does well: parsing (httptools), keep-alive and its timeout, pipelined
requests (queued, one response at a time), 100-continue, the lifespan, signals and the
graceful drain. Every request that is not `POST /v1/completions` or
`POST /v1/chat/completions` goes to the FastAPI app as before. The hot requests run
`api.handle` directly and write their answer straight to the connection's transport:

- a streamed answer is chunk-framed and written by `relay.splice` from the engine
  connection's `data_received` (router/h1.py): no task wake-up, no async-generator layers,
  no ASGI message dict, no `send` coroutine per chunk;
- backpressure: while the client's socket buffer is above the high-water mark the engine's
  socket is paused until `flow.drain()` returns; a large request body pauses reading from
  the client (uvicorn's flow control);
- the client closing its connection cancels the request's task at once (from
  `connection_lost`), which closes both upstream legs so the engines abort the request;
- body size limit, bad JSON and every other error: the same OpenAI-shaped answers as the
  ASGI path (`api.handle` builds them).

Measured reason (docs/performance.md): at 64 streams uvicorn's ASGI `send` and the
generator layers were the largest Python costs per streamed chunk.
"""

from __future__ import annotations

import asyncio
import logging

import orjson
import uvicorn
from starlette.requests import Request
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from router.errors import error_body
from router.fastpath import HOT_PATHS, RelayResponse
from router.relay import splice

log = logging.getLogger("pd_router")
_INTERNAL = orjson.dumps(error_body("internal router error", "internal_error"))
_CHUNKED = b"transfer-encoding: chunked\r\n"
_CLOSE = b"connection: close\r\n"
_LAST_CHUNK = b"0\r\n\r\n"


class RouterHttpProtocol(HttpToolsProtocol):
    """uvicorn's `HttpToolsProtocol`; hot POSTs are served by `_serve_hot` instead of ASGI.

    Give it to uvicorn as `http=RouterHttpProtocol` with the app `router.app.create_app`
    returns (a `RouterASGI`: its `.app` is FastAPI, its `_handle` is `api.handle`).
    """

    _hot_task: asyncio.Task | None = None
    _hot_gone = False

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.router_app = _router_app(self.app)

    def _start_asgi_task(self, cycle, app) -> None:
        scope = cycle.scope
        kind = HOT_PATHS.get(scope["path"]) if scope["method"] == "POST" else None
        if kind is None or app is not self.app or self.router_app is None:
            super()._start_asgi_task(cycle, app)  # everything else (and 503s for limit_concurrency)
            return
        task = self.loop.create_task(self._serve_hot(cycle, self.router_app, kind))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def connection_lost(self, exc: Exception | None) -> None:
        task = self._hot_task  # set while api.handle runs and while a stream is relayed
        super().connection_lost(exc)
        if task is not None and not task.done():
            self._hot_gone = True
            task.cancel()  # the client left mid-stream: close the upstream legs now

    def _gone(self) -> bool:
        return self._hot_gone

    # -- the hot request ---------------------------------------------------------------------

    async def _serve_hot(self, cycle, app, kind: str) -> None:
        scope = cycle.scope
        started = False
        try:
            # While `api.handle` runs, the client leaving cancels this task (connection_lost);
            # `handle` then counts the request as cancelled and closes the legs it opened.
            self._hot_gone = False
            self._hot_task = asyncio.current_task()
            body = None
            if not cycle.more_body:  # the whole body is in (the usual case): no receive() round
                body, cycle.body = bytes(cycle.body), bytearray()
            try:
                response = await app._handle(app.app.state.pdr, Request(scope, cycle.receive), kind, scope["path"],
                                             self._gone, body)
            finally:
                self._hot_task = None
            if cycle.disconnected:
                if isinstance(response, RelayResponse):
                    await self._abandon(response)
                return
            started = True
            if isinstance(response, RelayResponse):
                await self._stream(cycle, response)
            else:
                self._whole(cycle, response.status_code, response.raw_headers, response.body)
        except asyncio.CancelledError:
            if not self._hot_gone:
                raise
            asyncio.current_task().uncancel()  # the client left: not an error of ours
        except Exception:  # noqa: BLE001 - never let a bug surface as a dropped connection
            log.exception("internal error handling %s", scope["path"])
            if not started and not cycle.disconnected:
                self._whole(cycle, 500, [(b"content-type", b"application/json"),
                                         (b"content-length", str(len(_INTERNAL)).encode())], _INTERNAL)
            elif not self.transport.is_closing():
                self.transport.close()  # a stream broke half-way: the client sees a cut stream
        finally:
            cycle.on_response = lambda: None  # as uvicorn's run_asgi: a late call starts nothing

    def _head(self, cycle, status: int, headers) -> list[bytes]:
        out = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            out += (name, b": ", value, b"\r\n")
        for name, value in headers:
            out += (name, b": ", value, b"\r\n")
        if not cycle.keep_alive:
            out.append(_CLOSE)
        return out

    def _whole(self, cycle, status: int, headers, body: bytes) -> None:
        head = self._head(cycle, status, headers)
        head += (b"\r\n", body)
        cycle.response_started = True
        if not self.transport.is_closing():  # uvloop raises on a write after the client left
            self.transport.write(b"".join(head))
        self._complete(cycle)

    def _complete(self, cycle) -> None:
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        on_response = cycle.on_response
        cycle.on_response = lambda: None
        on_response()  # next pipelined request, or the keep-alive timer

    async def _stream(self, cycle, response: RelayResponse) -> None:
        head = self._head(cycle, 200, response.raw_headers)
        head += (_CHUNKED, b"\r\n")
        cycle.response_started = True
        writer = _ChunkWriter(self.transport, b"".join(head))
        self._hot_gone = False
        self._hot_task = asyncio.current_task()
        try:
            await splice(*response.args, writer, self.flow, self.transport)
        finally:
            self._hot_task = None
        writer.end()
        self._complete(cycle)

    @staticmethod
    async def _abandon(response: RelayResponse) -> None:
        """The client left after the decode leg answered and before the stream started:
        close the legs and count the request as cancelled (what the stream would do)."""
        outcome, _job, tally, _itl, finish = response.args
        tally.outcome = "cancelled"
        try:
            await outcome.close()
        finally:
            finish(tally)


_HOOKS_PRESENT = all(hasattr(HttpToolsProtocol, name) for name in ("_start_asgi_task", "connection_lost"))


class _ChunkWriter:
    """Chunk-frames a streamed answer onto the client's transport (`relay.splice` calls it with
    each read's worth of events). Two writes per request are saved: the response head goes out
    with the first chunk (`flush_head` sends it alone before anything else may write, e.g. the
    C relay), and `last` sends the final events (the one with [DONE]) together with the end of
    the body when both are in hand at once, as they usually are."""

    __slots__ = ("transport", "head", "ended")

    def __init__(self, transport, head: bytes) -> None:
        self.transport, self.head, self.ended = transport, head, False

    def __call__(self, chunk: bytes) -> None:
        # Runs inside the engine connection's data_received: the client may have left since
        # (its connection_lost has cancelled the task, which has not run yet). uvloop raises
        # on a write to a closed transport, so check first; the chunk has nowhere to go.
        if not self.transport.is_closing():
            frame = b"%x\r\n%b\r\n" % (len(chunk), chunk)
            if self.head:
                frame, self.head = self.head + frame, b""
            self.transport.write(frame)

    def flush_head(self) -> None:
        if self.head and not self.transport.is_closing():
            self.transport.write(self.head)
        self.head = b""

    def last(self, chunk: bytes) -> None:
        """The final chunk and the end of the body, in one write."""
        if not self.transport.is_closing():
            self.transport.write(b"%b%x\r\n%b\r\n%b" % (self.head, len(chunk), chunk, _LAST_CHUNK))
        self.head, self.ended = b"", True

    def end(self) -> None:
        if not self.ended and not self.transport.is_closing():
            self.transport.write(self.head + _LAST_CHUNK)
        self.head, self.ended = b"", True


class RouterServer(uvicorn.Server):
    """uvicorn's Server, woken once a second instead of ten times.

    uvicorn's main loop sleeps 0.1 s between ticks, to refresh the Date header (once a second)
    and to notice `should_exit`. Those ten wake-ups a second were most of an idle router's CPU
    (docs/performance.md: 1.6 ms per second against vllm-router's 0.1), and a low-load request,
    which lasts as long as its tokens, paid for the ones that fell inside it. Here the loop
    ticks once a second (the Date header keeps its one-second resolution), and setting
    `should_exit`, as the signal handler and the tests do, wakes it at once from any thread.
    """

    TICK_S = 1.0

    def __init__(self, config) -> None:
        self._exit = False
        self._waiter: asyncio.Future | None = None
        self._waiter_loop: asyncio.AbstractEventLoop | None = None
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._exit = value
        waiter, loop = self._waiter, self._waiter_loop
        if value and waiter is not None and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_wake, waiter)

    async def main_loop(self) -> None:
        loop = asyncio.get_running_loop()
        self._waiter_loop = loop
        counter = 0  # on_tick refreshes the Date header when counter % 10 == 0: every tick here
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(self.TICK_S, _wake, waiter)
            if not self._exit:  # set between on_tick and the new waiter: no wake-up was sent
                await waiter
            timer.cancel()
            self._waiter = None
            should_exit = await self.on_tick(counter)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _router_app(app):
    """The `RouterASGI` inside uvicorn's wrappers (ProxyHeadersMiddleware, ...), or None."""
    for _ in range(8):
        if app is None or hasattr(app, "_handle"):
            return app
        app = getattr(app, "app", None)
    return None


def uvicorn_config(app, settings, **kw):
    """uvicorn settings the router runs with (the CLI and the tests share them)."""
    import uvicorn

    # RouterHttpProtocol overrides uvicorn internals (pinned in pyproject.toml); should a
    # different uvicorn lack them, serve everything through ASGI rather than fail.
    http = RouterHttpProtocol if _HOOKS_PRESENT else "httptools"
    if not _HOOKS_PRESENT:
        log.warning("uvicorn %s lacks the protocol hooks router/server.py needs; hot endpoints go "
                    "through ASGI (slower)", uvicorn.__version__)
    opts = dict(host=settings.host, port=settings.port, log_config=None, access_log=False, loop="auto",
                http=http, backlog=4096, timeout_keep_alive=75,
                timeout_graceful_shutdown=int(settings.shutdown_grace))
    opts.update(kw)
    return uvicorn.Config(app, **opts)

"""The hot endpoints, served below the framework.

`POST /v1/completions` and `POST /v1/chat/completions` are handled as raw ASGI: no
middleware wrappers around every streamed chunk, no task group per stream. Everything else
(and the OpenAPI description of these two) stays with FastAPI.

Streams: the relay runs in the request's own task; one small watcher task waits for the
client's disconnect and cancels it, which closes both upstream legs (vLLM then aborts them).

`pd-router serve` (and the tests) go one step further: router/server.py answers these two
endpoints inside uvicorn's HTTP protocol, below ASGI, writing each streamed chunk straight
to the socket from the engine connection's callback (`relay.splice`). This ASGI path stays for hosting the app in any ASGI server.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

import orjson
from starlette.requests import Request

from router.errors import error_body
from router.relay import stream_body

log = logging.getLogger("pd_router")
HOT_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_INTERNAL = orjson.dumps(error_body("internal router error", "internal_error"))


class RelayResponse:
    """A streamed 200 whose body is relayed chunk by chunk.

    `args` are (outcome, job, tally, itl_hist, finish): served as ASGI through the
    `relay.stream_body` generator, or by the router's own server (router/server.py) through
    `relay.splice`, which writes each chunk straight to the client's transport.
    """

    __slots__ = ("args", "raw_headers")

    def __init__(self, args: tuple, headers: dict[str, str]):
        self.args = args
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")] + [
            (k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]

    @property
    def body(self) -> AsyncIterator[bytes]:
        return stream_body(*self.args)

    async def __call__(self, scope, receive, send) -> None:
        task = asyncio.current_task()
        gone = False

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.ensure_future(watch())
        body = self.body
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for chunk in body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()  # the client left: not an error of ours
        finally:
            watcher.cancel()
            await body.aclose()


class RouterASGI:
    """Wraps the FastAPI app; the two hot POST endpoints go straight to `api.handle`."""

    def __init__(self, app, handle):
        self.app = app
        self._handle = handle

    @property
    def state(self):
        return self.app.state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            kind = HOT_PATHS.get(scope["path"])
            if kind is not None:
                await self._hot(scope, receive, send, kind)
                return
        await self.app(scope, receive, send)

    async def _hot(self, scope, receive, send, kind: str) -> None:
        try:
            response = await self._handle(self.app.state.pdr, Request(scope, receive), kind, scope["path"])
        except Exception:  # noqa: BLE001 - never let a bug surface as a dropped connection
            log.exception("internal error handling %s", scope["path"])
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(_INTERNAL)).encode())]})
            await send({"type": "http.response.body", "body": _INTERNAL, "more_body": False})
            return
        await response(scope, receive, send)

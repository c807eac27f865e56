"""All HTTP to engines goes through one pooled client (injectable for tests).

Transport-level failures are translated here, once, into `router.errors`:
connection refused/reset -> UpstreamError, timeouts -> UpstreamTimeout, error
statuses -> UpstreamStatus (the engine's body passed through).
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import AsyncIterator

import httpx

from router.errors import UpstreamError, UpstreamStatus, UpstreamTimeout

JSON = {"content-type": "application/json"}


@dataclass
class Reply:
    status: int
    body: bytes
    headers: httpx.Headers


class Stream:
    """An open streaming response whose status was 200. Iterate raw bytes; always aclose()."""

    def __init__(self, resp: httpx.Response, stage: str, idle_timeout: float | None, deadline: float | None = None):
        self._resp = resp
        self.stage = stage
        self.headers = resp.headers
        self._idle = idle_timeout
        self.deadline = deadline  # loop time by which the whole stream must end (request timeout)
        self._it = resp.aiter_raw()
        self.closed = False

    async def first(self, timeout: float | None) -> bytes:
        """The first body chunk, within `timeout` (time to first byte)."""
        try:
            async with asyncio.timeout(timeout):
                return await self._next()
        except TimeoutError:
            await self.aclose()
            raise UpstreamTimeout(f"{self.stage} instance sent no data within {timeout:g}s", stage=self.stage) from None

    async def chunks(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        idle = self._idle
        hard = self.deadline
        try:
            async with asyncio.timeout(hard) as timer:
                while True:
                    if idle is not None:
                        when = loop.time() + idle
                        timer.reschedule(when if hard is None or when < hard else hard)
                    chunk = await self._next()
                    if not chunk:
                        return
                    yield chunk
        except TimeoutError:
            if hard is not None and loop.time() >= hard:
                raise UpstreamTimeout("request timeout reached while streaming", stage=self.stage) from None
            raise UpstreamTimeout(f"{self.stage} stream idle for more than {idle:g}s", stage=self.stage) from None

    async def _next(self) -> bytes:
        try:
            return await self._it.__anext__()
        except StopAsyncIteration:
            return b""
        except httpx.HTTPError as exc:
            raise _translate(exc, self.stage) from None

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            await self._resp.aclose()


class Upstream:
    def __init__(self, *, max_connections: int = 2048, connect_timeout: float = 5.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                              keepalive_expiry=60.0)
        timeout = httpx.Timeout(connect=connect_timeout, read=None, write=60.0, pool=connect_timeout)
        if transport is None:
            transport = httpx.AsyncHTTPTransport(
                limits=limits, retries=0,
                socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
            )
        self._client = httpx.AsyncClient(transport=transport, timeout=timeout, limits=limits)

    async def request(self, method: str, url: str, *, body: bytes | None = None, headers: dict | None = None,
                      timeout: float | None = None, stage: str = "decode") -> Reply:
        """A whole (non-streaming) exchange. Returns any status; raises on transport failure."""
        try:
            async with asyncio.timeout(timeout):
                r = await self._client.request(method, url, content=body, headers=headers)
        except TimeoutError:
            raise UpstreamTimeout(f"{stage} instance did not answer within {timeout:g}s", stage=stage) from None
        except httpx.HTTPError as exc:
            raise _translate(exc, stage) from None
        return Reply(r.status_code, r.content, r.headers)

    async def post(self, url: str, body: bytes, headers: dict, *, timeout: float | None, stage: str) -> Reply:
        """POST JSON; an error status raises UpstreamStatus."""
        reply = await self.request("POST", url, body=body, headers=headers, timeout=timeout, stage=stage)
        if reply.status != 200:
            raise UpstreamStatus(reply.status, reply.body, stage=stage)
        return reply

    async def open_stream(self, url: str, body: bytes, headers: dict, *, timeout: float | None,
                          idle_timeout: float | None, stage: str, deadline: float | None = None) -> Stream:
        """POST and wait for response headers (within `timeout`); an error status raises UpstreamStatus."""
        req = self._client.build_request("POST", url, content=body, headers=headers)
        try:
            async with asyncio.timeout(timeout):
                resp = await self._client.send(req, stream=True)
        except TimeoutError:
            raise UpstreamTimeout(f"{stage} instance did not answer within {timeout:g}s", stage=stage) from None
        except httpx.HTTPError as exc:
            raise _translate(exc, stage) from None
        if resp.status_code != 200:
            try:
                async with asyncio.timeout(10):
                    raw = await resp.aread()
            except (TimeoutError, httpx.HTTPError):
                raw = b""
            finally:
                await resp.aclose()
            raise UpstreamStatus(resp.status_code, raw, stage=stage)
        return Stream(resp, stage, idle_timeout, deadline)

    async def aclose(self) -> None:
        await self._client.aclose()


def _translate(exc: httpx.HTTPError, stage: str) -> UpstreamError:
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"{stage} instance timed out: {type(exc).__name__}", stage=stage)
    if isinstance(exc, httpx.ConnectError):
        return UpstreamError(f"cannot connect to {stage} instance: {exc}", stage=stage, code="connect_error")
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError)):
        return UpstreamError(f"{stage} instance closed the connection: {exc or type(exc).__name__}",
                             stage=stage, code="connection_lost")
    return UpstreamError(f"{stage} instance failed: {type(exc).__name__}: {exc}", stage=stage, code="transport_error")

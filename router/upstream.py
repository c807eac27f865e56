"""All HTTP to engines goes through one pooled client (injectable for tests).

The client is aiohttp, not httpx: httpcore's pool scans every connection (with a
readability syscall each) on every request, which put about 60% of the router's CPU in
pool bookkeeping at 64 concurrent streams (docs/performance.md has the profile and the
numbers). aiohttp's pool is O(1) per request, sets TCP_NODELAY, and hands streamed bytes
over as they arrive.

Transport-level failures are translated here, once, into `router.errors`:
connection refused/reset -> UpstreamError, timeouts -> UpstreamTimeout, error
statuses -> UpstreamStatus (the engine's body passed through).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator, Mapping

import aiohttp

from router.errors import UpstreamError, UpstreamStatus, UpstreamTimeout


@dataclass
class Reply:
    status: int
    body: bytes
    headers: Mapping[str, str]


class Stream:
    """An open streaming response whose status was 200. Iterate raw bytes; always aclose().

    Idle gaps and the whole-request deadline are enforced by one timer per stream that
    re-arms itself (about once per idle period), not by a timer per chunk: the per-chunk
    path only stores a timestamp.
    """

    __slots__ = ("_resp", "stage", "headers", "_idle", "deadline", "closed", "_content", "_last", "_expired",
                 "_timer", "_loop")

    def __init__(self, resp: aiohttp.ClientResponse, stage: str, idle_timeout: float | None,
                 deadline: float | None = None):
        self._resp = resp
        self._content = resp.content
        self.stage = stage
        self.headers = resp.headers
        self._idle = idle_timeout
        self.deadline = deadline  # loop time by which the whole stream must end (request timeout)
        self.closed = False
        self._last = 0.0
        self._expired: str | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def first(self, timeout: float | None) -> bytes:
        """The first body chunk, within `timeout` (time to first byte)."""
        try:
            async with asyncio.timeout(timeout):
                return await self._next()
        except TimeoutError:
            await self.aclose()
            raise UpstreamTimeout(f"{self.stage} instance sent no data within {timeout:g}s", stage=self.stage) from None

    def start(self):
        """Arm the stream's timer and return its reader: `await read()` is the next chunk
        (b"" at the end). For a caller's own loop; `chunks()` is the iterator form."""
        loop = self._loop = asyncio.get_running_loop()
        self._last = loop.time()
        self._arm()
        return self._read

    async def _read(self) -> bytes:
        try:
            chunk = await self._content.readany()
        except (aiohttp.ClientError, OSError) as exc:
            if self._expired:
                raise UpstreamTimeout(self._expired, stage=self.stage) from None
            raise _translate(exc, self.stage) from None
        self._last = self._loop.time()
        return chunk

    async def chunks(self) -> AsyncIterator[bytes]:
        read = self.start()
        try:
            while True:
                chunk = await read()
                if not chunk:
                    return
                yield chunk
        finally:
            if self._timer is not None:
                self._timer.cancel()

    def _arm(self) -> None:
        when = None if self._idle is None else self._last + self._idle
        if self.deadline is not None and (when is None or self.deadline < when):
            when = self.deadline
        if when is not None:
            self._timer = self._loop.call_at(when, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        if self.deadline is not None and now >= self.deadline:
            self._expired = "request timeout reached while streaming"
        elif self._idle is not None and now - self._last >= self._idle:
            self._expired = f"{self.stage} stream idle for more than {self._idle:g}s"
        else:
            self._arm()
            return
        self._resp.close()  # wakes the pending read with an error, reported as the timeout

    async def _next(self) -> bytes:
        try:
            return await self._content.readany()
        except (aiohttp.ClientError, OSError) as exc:
            if self._expired:
                raise UpstreamTimeout(self._expired, stage=self.stage) from None
            raise _translate(exc, self.stage) from None

    async def aclose(self) -> None:
        """Return the connection to the pool if the body was read to the end; else close it
        (the engine then sees the disconnect and aborts the request)."""
        if not self.closed:
            self.closed = True
            if self._timer is not None:
                self._timer.cancel()
            if self._content.at_eof():
                self._resp.release()
            else:
                self._resp.close()


class Upstream:
    def __init__(self, *, max_connections: int = 2048, connect_timeout: float = 5.0,
                 connector: aiohttp.BaseConnector | None = None):
        self._limit = max_connections
        self._connect_timeout = connect_timeout
        self._connector = connector
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # built lazily, inside the running loop
            connector = self._connector or aiohttp.TCPConnector(
                limit=self._limit, limit_per_host=0, keepalive_timeout=60, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector, auto_decompress=False, raise_for_status=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout,
                                              connect=self._connect_timeout),
                skip_auto_headers=("User-Agent", "Accept-Encoding"))
        return self._session

    async def request(self, method: str, url: str, *, body: bytes | None = None, headers: dict | None = None,
                      timeout: float | None = None, stage: str = "decode") -> Reply:
        """A whole (non-streaming) exchange. Returns any status; raises on transport failure."""
        resp = None
        try:
            async with asyncio.timeout(timeout):
                resp = await self.session.request(method, url, data=body, headers=headers)
                data = await resp.read()
        except TimeoutError:
            if resp is not None:
                resp.close()
            raise UpstreamTimeout(f"{stage} instance did not answer within {timeout:g}s", stage=stage) from None
        except (aiohttp.ClientError, OSError) as exc:
            if resp is not None:
                resp.close()
            raise _translate(exc, stage) from None
        except BaseException:
            if resp is not None:
                resp.close()
            raise
        resp.release()
        return Reply(resp.status, data, resp.headers)

    async def post(self, url: str, body: bytes, headers: dict, *, timeout: float | None, stage: str) -> Reply:
        """POST JSON; an error status raises UpstreamStatus."""
        reply = await self.request("POST", url, body=body, headers=headers, timeout=timeout, stage=stage)
        if reply.status != 200:
            raise UpstreamStatus(reply.status, reply.body, stage=stage)
        return reply

    async def open_stream(self, url: str, body: bytes, headers: dict, *, timeout: float | None,
                          idle_timeout: float | None, stage: str, deadline: float | None = None) -> Stream:
        """POST and wait for response headers (within `timeout`); an error status raises UpstreamStatus."""
        try:
            async with asyncio.timeout(timeout):
                resp = await self.session.request("POST", url, data=body, headers=headers)
        except TimeoutError:
            raise UpstreamTimeout(f"{stage} instance did not answer within {timeout:g}s", stage=stage) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise _translate(exc, stage) from None
        if resp.status != 200:
            try:
                async with asyncio.timeout(10):
                    raw = await resp.read()
            except (TimeoutError, aiohttp.ClientError, OSError):
                raw = b""
            finally:
                resp.close()
            raise UpstreamStatus(resp.status, raw, stage=stage)
        return Stream(resp, stage, idle_timeout, deadline)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _translate(exc: BaseException, stage: str) -> UpstreamError:
    if isinstance(exc, aiohttp.ServerTimeoutError):
        return UpstreamTimeout(f"{stage} instance timed out: {exc}", stage=stage)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamError(f"cannot connect to {stage} instance: {exc}", stage=stage, code="connect_error")
    if isinstance(exc, (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError, aiohttp.ClientOSError,
                        ConnectionError)):
        return UpstreamError(f"{stage} instance closed the connection: {exc or type(exc).__name__}",
                             stage=stage, code="connection_lost")
    if isinstance(exc, aiohttp.ClientResponseError):
        return UpstreamError(f"{stage} instance sent a malformed response: {exc.message}", stage=stage,
                             code="bad_response")
    return UpstreamError(f"{stage} instance failed: {type(exc).__name__}: {exc}", stage=stage, code="transport_error")

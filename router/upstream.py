"""All HTTP to engines goes through one pooled client (injectable for tests).

The client is the router's own (`router.h1`: asyncio protocols, httptools, keep-alive pools
per engine), for every leg: prefill answers, decode streams and whole answers, health probes.
History, measured on the bench_router load (docs/performance.md):
- httpx was first: httpcore's pool scans every connection (with a readability syscall each)
  on every request, about 60% of the router's CPU at 64 concurrent streams;
- aiohttp replaced it (O(1) pool), but each streamed token still crossed its StreamReader
  and woke the relaying task, and each request built a ClientRequest, a ClientResponse, a
  timer context and the connector's bookkeeping;
- `router.h1` hands each token chunk to the relay from `data_received` (no task wake-up)
  and sends a request as one prepared write.

Failures come out as `router.errors`: connection refused/reset -> UpstreamError,
timeouts -> UpstreamTimeout; `post` and `open_stream` turn an error status into
UpstreamStatus (the engine's body passed through).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping
from urllib.parse import urlsplit

from router import h1
from router.errors import UpstreamStatus
from router.h1 import Stream


@dataclass
class Reply:
    status: int
    body: bytes
    stream: Stream  # the finished exchange; its headers are decoded only if asked for

    @property
    def headers(self) -> Mapping[str, str]:
        return self.stream.headers


class Upstream:
    def __init__(self, *, max_connections: int = 2048, connect_timeout: float = 5.0):
        # max_connections bounds the idle keep-alive connections kept per engine
        self.pool = h1.Pool(connect_timeout=connect_timeout, max_idle_per_host=max_connections)
        self._targets: dict[str, tuple[bool, str, int, str]] = {}

    def _target(self, url: str) -> tuple[bool, str, int, str]:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) > 4096:  # instances come and go: keep the parse cache bounded
                self._targets.clear()
            target = self._targets[url] = _split(url)
        return target

    def start(self, url: str, body: bytes, headers: dict, *, stage: str, hold: int = 0) -> Stream | None:
        """POST now, before this task yields, if an idle keep-alive connection to `url` is at hand
        (else None). Pass the result as `started=` to `post` or `open_stream` with the same
        arguments, which then wait for its answer instead of sending the request (`hold`: see
        `h1.start`)."""
        tls, host, port, path = self._target(url)
        return h1.start(self.pool, "POST", host, port, path, body, headers, stage=stage, tls=tls, hold=hold)

    async def request(self, method: str, url: str, *, body: bytes | None = None, headers: dict | None = None,
                      timeout: float | None = None, stage: str = "decode", started: Stream | None = None,
                      on_answer: Callable[[Stream], None] | None = None) -> Reply:
        """A whole (non-streaming) exchange within `timeout`. Returns any status; raises on
        transport failure or timeout. `on_answer`: see `h1.Stream.set_on_answer`."""
        tls, host, port, path = self._target(url)
        status, data, stream = await h1.fetch(self.pool, method, host, port, path, body, headers or {},
                                              timeout=timeout, stage=stage, tls=tls, started=started,
                                              on_answer=on_answer)
        return Reply(status, data, stream)

    async def post(self, url: str, body: bytes, headers: dict, *, timeout: float | None, stage: str,
                   started: Stream | None = None, on_answer: Callable[[Stream], None] | None = None) -> Reply:
        """POST JSON; an error status raises UpstreamStatus."""
        reply = await self.request("POST", url, body=body, headers=headers, timeout=timeout, stage=stage,
                                   started=started, on_answer=on_answer)
        if reply.status != 200:
            raise UpstreamStatus(reply.status, reply.body, stage=stage)
        return reply

    async def open_stream(self, url: str, body: bytes, headers: dict, *, timeout: float | None,
                          idle_timeout: float | None, stage: str, deadline: float | None = None,
                          until_body: bool = False, started: Stream | None = None) -> Stream:
        """POST and wait for response headers (within `timeout`; `until_body`: a 200 answer's
        first body bytes too, see `h1.open_stream`); an error status raises UpstreamStatus.
        `started`: the same request already sent by `start`."""
        tls, host, port, path = self._target(url)
        stream = await h1.open_stream(self.pool, "POST", host, port, path, body, headers, timeout=timeout,
                                      stage=stage, tls=tls, until_body=until_body, started=started)
        if stream.status != 200:
            try:
                raw = await stream.read_all(h1.STATUS_WAIT_S)
            finally:
                await stream.aclose()
            raise UpstreamStatus(stream.status, raw, stage=stage)
        stream.set_limits(idle_timeout, deadline)
        return stream

    async def aclose(self) -> None:
        self.pool.close()


def _split(url: str) -> tuple[bool, str, int, str]:
    """(tls, host, port, path with query) of an engine URL, parsed once per distinct URL."""
    u = urlsplit(url)
    tls = u.scheme == "https"
    path = u.path or "/"
    if u.query:
        path += "?" + u.query
    return tls, u.hostname or "127.0.0.1", u.port or (443 if tls else 80), path

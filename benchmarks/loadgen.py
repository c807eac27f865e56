"""Streaming load generator: closed loop at a fixed concurrency or open loop at a fixed rate.

A raw HTTP/1.1 client on asyncio.Protocol + httptools (keep-alive, TCP_NODELAY), so the client
costs little CPU per token and is never what a benchmark measures. Each request is a streaming
``/v1/completions`` (or chat) call; the client timestamps the first token event (TTFT), every
later one (ITL), the end (e2e), and counts an error for a non-200 status, a dropped connection,
an SSE error event, a missing ``[DONE]`` or a short stream.

Run in its own process (the harness pins it to a core) and read the JSON it prints:
``python -m benchmarks.loadgen --url http://127.0.0.1:8000 --concurrency 64 --duration 5``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import socket
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools


@dataclass
class Result:
    t_start: float  # intended start (open loop: the scheduled arrival)
    status: int = 0
    t_first: float | None = None
    t_end: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)
    done: bool = False  # saw data: [DONE]
    error: str | None = None


class _Conn(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.res: Result | None = None
        self.fut: asyncio.Future | None = None
        self.buf = b""
        self.last = 0.0
        self.closed = False
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._finish(f"connection lost: {exc!r}" if exc else "connection closed")

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._finish(f"bad HTTP: {e}")
            self.transport.abort()

    def on_headers_complete(self) -> None:
        self.res.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        now = time.perf_counter()
        res = self.res
        if res.status != 200:
            self.buf += body
            return
        data = self.buf + body
        events = data.split(b"\n\n")
        self.buf = events.pop()
        for ev in events:
            self._event(ev, now)

    def _event(self, ev: bytes, now: float) -> None:
        """One complete SSE event (without its blank line) received at `now`."""
        res = self.res
        if ev.startswith(b"data: [DONE]"):
            res.done = True
        elif (b'"text"' in ev or b'"content"' in ev) and b'"role"' not in ev:
            if res.t_first is None:
                res.t_first = now
            else:
                res.gaps.append(now - self.last)
            self.last = now
            res.tokens += 1
        elif b'"error"' in ev:
            res.error = "error event: " + ev[:200].decode(errors="replace")

    def on_message_complete(self) -> None:
        res = self.res
        if res.status != 200 and res.error is None:
            res.error = f"status {res.status}: {self.buf[:200].decode(errors='replace')}"
        self._finish(None)

    def _finish(self, error: str | None) -> None:
        if self.fut is None or self.fut.done():
            return
        res = self.res
        res.t_end = time.perf_counter()
        if res.error is None:
            res.error = error
        self.buf = b""
        self.fut.set_result(res)

    def send(self, req: bytes, res: Result) -> asyncio.Future:
        self.res, self.buf = res, b""
        self.fut = asyncio.get_running_loop().create_future()
        if self.closed:
            self._finish("connection closed before the request was sent")
        else:
            self.transport.write(req)
        return self.fut


class LoadGen:
    conn_class: type = _Conn  # the connection protocol (benchmarks.vllm_loadgen sets a subclass)

    def __init__(self, url: str, *, prompt_chars: int = 1000, max_tokens: int = 64,
                 model: str = "tiny", chat: bool = False, n_bodies: int = 512, seed: int = 0,
                 timeout: float = 60.0, unique: bool = False):
        u = urlsplit(url)
        self.host, self.port = u.hostname, u.port or 80
        self.max_tokens, self.timeout = max_tokens, timeout
        path = "/v1/chat/completions" if chat else "/v1/completions"
        rng = random.Random(seed)
        filler = "".join(rng.choice("abcdefghij klmnopqrstuvwxyz") for _ in range(prompt_chars))
        self._filler, self._model, self._chat, self._path = filler, model, chat, path
        self._prompt_chars = prompt_chars
        # unique: every request gets a prompt never sent before (a tokenizer cache cannot hit)
        self.unique = unique
        self._salt = os.urandom(4).hex()  # differs per load-generator process, so runs never repeat
        self.requests = [self._request(f"{i:06d} ") for i in range(n_bodies)]
        self._next = 0
        self.idle: list[_Conn] = []

    def _request(self, prefix: str) -> bytes:
        # distinct prompts: real engines would prefix-cache repeats
        text = (prefix + self._filler)[:self._prompt_chars]
        body = {"model": self._model, "max_tokens": self.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        body.update({"messages": [{"role": "user", "content": text}]} if self._chat else {"prompt": text})
        return self.frame(body)

    def frame(self, body: dict) -> bytes:
        """The whole HTTP request for a JSON body (sent as is by `one(req=...)`)."""
        raw = json.dumps(body).encode()
        return (b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json"
                b"\r\ncontent-length: %d\r\n\r\n%s" % (
                    self._path.encode(), self.host.encode(), self.port, len(raw), raw))

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(self.conn_class, self.host, self.port)
        return conn

    async def one(self, t_start: float | None = None, req: bytes | None = None,
                  timeout: float | None = None) -> Result:
        """One request: `req` (from `frame`) or the next of this generator's own prompts; an
        answer not complete within `timeout` s (default: the generator's) is an error and its
        connection is closed."""
        timeout = self.timeout if timeout is None else timeout
        res = Result(time.perf_counter() if t_start is None else t_start)
        if req is None:
            req = (self._request(f"{self._salt}-{self._next:09d} ") if self.unique
                   else self.requests[self._next % len(self.requests)])
        self._next += 1
        try:
            while self.idle and self.idle[-1].closed:
                self.idle.pop()
            conn = self.idle.pop() if self.idle else await self._connect()
        except OSError as e:
            res.error, res.t_end = f"connect: {e!r}", time.perf_counter()
            return res
        try:
            await asyncio.wait_for(conn.send(req, res), timeout)
        except TimeoutError:
            res.error, res.t_end = f"no complete answer in {timeout:g} s", time.perf_counter()
            conn.transport.abort()
            return res
        if res.error is None:
            if not res.done:
                res.error = "stream ended without [DONE]"
            elif res.tokens != self.max_tokens:
                res.error = f"got {res.tokens} tokens, wanted {self.max_tokens}"
        if not conn.closed and conn.keep_alive and res.error is None:
            self.idle.append(conn)
        elif not conn.closed:
            conn.transport.close()
        return res

    async def closed_loop(self, concurrency: int, duration: float) -> list[Result]:
        deadline = time.perf_counter() + duration
        results: list[Result] = []

        async def worker() -> None:
            while time.perf_counter() < deadline:
                results.append(await self.one())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results

    async def open_loop(self, rate: float, duration: float, poisson: bool = False,
                        seed: int = 0) -> list[Result]:
        rng = random.Random(seed)
        t0 = time.perf_counter()
        tasks, t, i = [], 0.0, 0
        while t < duration:
            delay = t0 + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(self.one(t0 + t)))
            i += 1
            t = t + rng.expovariate(rate) if poisson else i / rate
        return list(await asyncio.gather(*tasks))

    def close(self) -> None:
        for c in self.idle:
            c.transport.close()
        self.idle.clear()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * (len(v) - 1))))]


def summarize(results: list[Result], t_begin: float, warmup: float, duration: float) -> dict:
    """Statistics over requests that started after the warm-up; throughput over the window."""
    window_start, window_end = t_begin + warmup, t_begin + duration
    measured = [r for r in results if r.t_start >= window_start]
    ok = [r for r in measured if r.error is None]
    ms = 1000.0
    ttft = [(r.t_first - r.t_start) * ms for r in ok]
    e2e = [(r.t_end - r.t_start) * ms for r in ok]
    gaps = [g * ms for r in ok for g in r.gaps]
    errors: dict[str, int] = {}
    for r in measured:
        if r.error is not None:
            key = r.error[:80]
            errors[key] = errors.get(key, 0) + 1
    tokens_in_window = sum(r.tokens for r in results if r.t_end is not None
                           and window_start <= r.t_end <= window_end)
    span = max(1e-9, window_end - window_start)
    return {
        "requests_total": len(results),
        "requests_measured": len(measured),
        "ok": len(ok),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "tokens_total": sum(r.tokens for r in results),
        "tok_per_s": tokens_in_window / span,
        "req_per_s": len([r for r in results if r.t_end and window_start <= r.t_end <= window_end]) / span,
        **{f"ttft_p{q}_ms": percentile(ttft, q) for q in (50, 90, 99)},
        **{f"itl_p{q}_ms": percentile(gaps, q) for q in (50, 99)},
        **{f"e2e_p{q}_ms": percentile(e2e, q) for q in (50, 99)},
    }


async def run(args: argparse.Namespace) -> dict:
    gen = LoadGen(args.url, prompt_chars=args.prompt_chars, max_tokens=args.max_tokens,
                  model=args.model, chat=args.chat, timeout=args.request_timeout, unique=args.unique_prompts)
    cpu0, t_begin = time.process_time(), time.perf_counter()
    if args.rate:
        results = await gen.open_loop(args.rate, args.duration, poisson=args.poisson)
    else:
        results = await gen.closed_loop(args.concurrency, args.duration)
    wall = time.perf_counter() - t_begin
    gen.close()
    out = summarize(results, t_begin, min(args.warmup, args.duration / 2), args.duration)
    out.update(wall_s=wall, loadgen_cpu_s=time.process_time() - cpu0,
               concurrency=None if args.rate else args.concurrency, rate=args.rate or None)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadgen", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--concurrency", type=int, default=1, help="closed loop: streams in flight")
    g.add_argument("--rate", type=float, default=0.0, help="open loop: requests per second")
    p.add_argument("--poisson", action="store_true", help="open loop: exponential gaps")
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--prompt-chars", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--model", default="tiny")
    p.add_argument("--chat", action="store_true")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--unique-prompts", action="store_true",
                   help="a new prompt for every request (the router's tokenizer cache never hits)")
    args = p.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        import uvloop
        out = uvloop.run(run(args))
    except ImportError:
        out = asyncio.run(run(args))
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

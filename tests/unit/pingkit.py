"""Helpers for registration tests: payloads in each format, a real DEALER sender, waiting."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time

import msgpack
import zmq
import zmq.asyncio

from launch.fake_engine import FakeEngine

FORMATS = ("pd-router", "moriio", "moriio-legacy", "p2p-nccl")


def payload(fmt: str, role: str, e: FakeEngine, **extra) -> dict:
    """A registration for fake engine ``e`` in format ``fmt`` (PROTOCOLS.md section 5)."""
    hp = f"127.0.0.1:{e.port}"
    short = "P" if role == "prefill" else "D"
    if fmt == "pd-router":
        body = {"type": "pd-router/v1", "role": role, "http_address": hp, "model": e.model, "tp_size": 1,
                "pp_size": 1, "dp_size": 1}
        if role == "prefill":
            body.update(engine_id=e.engine_id, kv_host="127.0.0.1", kv_port=e.kv_port)
    elif fmt == "moriio":
        body = {"type": short, "http_address": hp, "zmq_address": "host:127.0.0.1,handshake:6301,notify:61005",
                "dp_size": 1, "tp_size": 1, "transfer_mode": "READ"}
    elif fmt == "moriio-legacy":
        body = {"type": "register", "role": short, "request_address": f"http://{hp}/v1/completions",
                "handshake_port": 6301, "notify_port": 61005, "dp_size": 1, "tp_size": 1, "transfer_mode": "READ",
                "index": 0}
    elif fmt == "p2p-nccl":
        body = {"type": short, "http_address": hp, "zmq_address": "127.0.0.1:21001"}
    else:
        raise ValueError(fmt)
    body.update(extra)
    return body


def pack(body) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


@contextlib.asynccontextmanager
async def dealer(endpoint: str):
    """A connected DEALER (what vLLM's senders use); closed with its context on exit."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(0)
        ctx.term()


class Heart:
    """Sends ``body`` every ``interval`` seconds from its own DEALER, in its own thread (like a
    real sender, it keeps its rhythm when the router's event loop is busy), until stopped."""

    def __init__(self, endpoint: str, body, interval: float = 0.1):
        self.endpoint, self.body, self.interval = endpoint, body, interval
        self.sent = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    async def __aenter__(self) -> "Heart":
        self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="test-heart", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            await asyncio.to_thread(self._thread.join, 10)
            self._thread = None

    def _run(self) -> None:
        data = self.body if isinstance(self.body, bytes) else pack(self.body)
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.endpoint)
            while not self._stop.is_set():
                sock.send(data)
                self.sent += 1
                self._stop.wait(self.interval)


async def until(predicate, timeout: float = 5.0, what: str = "condition"):
    """Wait until ``await predicate()`` (or ``predicate()``) is truthy; returns its value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def ping_endpoint(app) -> str:
    from router.discovery import Discovery

    [d] = [c for c in app.state.pdr.components if isinstance(c, Discovery)]
    return d.endpoint


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text output (0.0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = ",".join(sorted((m.group(2) or "{}")[1:-1].split(","))) if m.group(2) else ""
        if got == want:
            return float(m.group(3))
    return 0.0

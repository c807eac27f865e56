"""What every dispatch mode shares: the job, the outcome, leases and the decode leg."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

import orjson

from router.errors import NoInstance, RouterError, UpstreamError
from router.metrics import Metrics
from router.policies import Policy
from router.registry import Instance, Registry
from router.settings import Settings
from router.h1 import HOLD_BODY, HOLD_END, Stream
from router.upstream import Upstream

# The six fields pull and push prefill legs carry (PROTOCOLS.md sections 2 and 3).
PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class Job:
    """One client request, parsed and validated."""

    kind: str  # "completions" | "chat"
    path: str  # "/v1/completions" | "/v1/chat/completions"
    body: dict
    stream: bool
    request_id: str
    prompt_tokens: int
    model: str | None
    t0: float = field(default_factory=time.perf_counter)
    route: str = "direct"
    auth: str | None = None  # client's Authorization, forwarded only if configured
    strip_usage: bool = False  # the router asked D for stream usage; drop the usage event for the client
    counted: bool = True  # prompt_tokens is the router's count (False: tokenizing was skipped, see api)


@dataclass
class Outcome:
    """A decode leg that answered 200. `stream` is open (first chunk read) or None (whole body)."""

    decode: Instance
    body: bytes  # first chunk of a stream, or the whole JSON body
    stream: Stream | None = None
    prefill: Instance | None = None
    prefill_reply: Awaitable[dict | None] | None = None  # P's JSON answer (usage), when disaggregated
    t_handoff: float | None = None  # P answered (pull) / legs launched (push)
    cleanups: list[Callable[[], Any]] = field(default_factory=list)

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()
        for fn in reversed(self.cleanups):
            res = fn()
            if asyncio.iscoroutine(res):
                await res
        self.cleanups.clear()


@dataclass
class Env:
    settings: Settings
    registry: Registry
    upstream: Upstream
    metrics: Metrics
    prefill_policy: Policy
    decode_policy: Policy

    def pick(self, role: str, job: Job, exclude: set | None = None) -> Instance:
        cands = self.registry.candidates(role, job.model)
        if exclude:
            cands = [c for c in cands if c.key not in exclude] or cands
        if not cands:
            raise NoInstance(f"no healthy {role} instance" + (f" serves model {job.model!r}" if job.model else ""))
        inst = (self.prefill_policy if role == "prefill" else self.decode_policy).pick(cands, job.request_id)
        if inst.breaker is not None:
            inst.breaker.on_pick(self.registry.now())
        return inst

    def headers(self, role: str, job: Job) -> dict[str, str]:
        h = {"content-type": "application/json", "x-request-id": job.request_id}
        s = self.settings
        key = s.prefill_api_key if role == "prefill" else s.decode_api_key
        if key:
            h["authorization"] = f"Bearer {key}"
        elif s.forward_authorization and job.auth:
            h["authorization"] = job.auth
        return h

    def lease(self, inst: Instance) -> Callable[[], None]:
        """Count `inst` as busy until the returned function is called (idempotent).

        The gauge child is dropped when an instance leaves the registry, so a late
        release only touches a detached child: labels stay bounded to live instances.
        """
        inst.in_flight += 1
        gauge = self.metrics.in_flight.labels(inst.role, inst.url)
        gauge.inc()
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                inst.in_flight -= 1
                gauge.dec()

        return release

    def record_result(self, inst: Instance, exc: BaseException | None = None) -> None:
        """Feed the instance's breaker: success, or a failure that is the instance's fault."""
        if exc is not None and not instance_fault(exc):
            return
        ok = exc is None
        if inst.breaker is not None:
            inst.breaker.record(ok, self.registry.now())
        inst.failures = 0 if ok else inst.failures + 1
        if ok:
            inst.served += 1


class Dispatcher(Protocol):
    async def run(self, job: Job) -> Outcome: ...


def prefill_body(body: dict, kv_params: dict | None) -> bytes:
    """Step 1 of pull and push: max_tokens=1, no streaming, no min_tokens, the KV params."""
    p = dict(body)
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["stream"] = False
    for k in ("stream_options", "min_tokens", "min_completion_tokens"):
        p.pop(k, None)
    if kv_params is None:
        p.pop("kv_transfer_params", None)
    else:
        p["kv_transfer_params"] = kv_params
    return orjson.dumps(p)


def decode_body(body: dict, kv_params: dict | None) -> bytes:
    if kv_params is None:
        if "kv_transfer_params" not in body:
            return orjson.dumps(body)
        body = {k: v for k, v in body.items() if k != "kv_transfer_params"}
        return orjson.dumps(body)
    return orjson.dumps({**body, "kv_transfer_params": kv_params})


def start_decode(env: Env, job: Job, inst: Instance, body: bytes,
                 headers: dict[str, str] | None = None) -> Stream | None:
    """Send a decode leg now (None when no idle connection to D is at hand); give the result to
    `decode_leg(..., started=)` with the same arguments."""
    return env.upstream.start(inst.url + job.path, body, {**env.headers("decode", job), **(headers or {})},
                              stage="decode", hold=HOLD_BODY if job.stream else HOLD_END)


async def decode_leg(env: Env, job: Job, inst: Instance, body: bytes,
                     headers: dict[str, str] | None = None, started: Stream | None = None) -> tuple[Stream | None, bytes]:
    """Send the decode leg (unless `started` by `start_decode`); for streams, wait for the first
    chunk (time to first decode byte).

    `headers` override the standard ones (MoRIIO: its own X-Request-Id)."""
    s = env.settings
    url = inst.url + job.path
    headers = {**env.headers("decode", job), **(headers or {})}
    if job.stream:
        deadline = None
        if s.request_timeout:
            deadline = asyncio.get_running_loop().time() + s.request_timeout - (time.perf_counter() - job.t0)
        stream = await env.upstream.open_stream(url, body, headers, timeout=s.first_byte_timeout,
                                                idle_timeout=s.idle_timeout, stage="decode", deadline=deadline,
                                                until_body=True, started=started)  # one wake-up for head and first token
        try:
            first = await stream.first(s.first_byte_timeout)
        except BaseException:
            await stream.aclose()
            raise
        problem = check_first_event(first)
        if problem:
            await stream.aclose()
            raise UpstreamError(f"decode instance sent a bad stream: {problem}", stage="decode", code="bad_stream")
        return stream, first
    timeout = s.request_timeout - (time.perf_counter() - job.t0) if s.request_timeout else None
    reply = await env.upstream.post(url, body, headers, timeout=timeout, stage="decode", started=started)
    return None, reply.body


def check_first_event(first: bytes) -> str | None:
    """Validate the first SSE event once per request (later events pass through unparsed)."""
    if not first:
        return "no data"
    if not first.startswith(b"data: "):
        return "not server-sent events"
    end = first.find(b"\n\n")
    event = first[6:end] if end >= 0 else None
    if event is not None and event != b"[DONE]":
        try:
            doc = orjson.loads(event)
        except orjson.JSONDecodeError:
            return "first event is not JSON"
        if not isinstance(doc, dict):
            return "first event is not a JSON object"
    return None


def start_prefill(env: Env, job: Job, inst: Instance, body: bytes,
                  headers: dict[str, str] | None = None) -> Stream | None:
    """Send a prefill leg now, before the caller yields (None when no idle connection to P is at
    hand); give the result to `prefill_leg(..., started=)` with the same arguments."""
    return env.upstream.start(inst.url + job.path, body, {**env.headers("prefill", job), **(headers or {})},
                              stage="prefill", hold=HOLD_END)


async def prefill_leg(env: Env, job: Job, inst: Instance, body: bytes,
                      headers: dict[str, str] | None = None, started: Stream | None = None,
                      t_sent: float | None = None, on_answer: Callable[[dict], None] | None = None) -> dict:
    """Send a prefill leg (unless `started` by `start_prefill` at `t_sent`) and return P's JSON
    answer. `headers` override the standard ones. `on_answer(doc)` gets a 200 answer's JSON
    object as soon as it is read, from the connection's read callback, before this returns
    (see `h1.Stream.set_on_answer`); the answer is parsed once, there."""
    t = time.perf_counter() if t_sent is None else t_sent
    parsed = None

    def hook(stream: Stream) -> None:
        nonlocal parsed
        if stream.status == 200:
            try:
                parsed = orjson.loads(stream.body())
            except orjson.JSONDecodeError:
                return  # parsed again below, where it becomes the error
            if isinstance(parsed, dict):
                on_answer(parsed)

    reply = await env.upstream.post(inst.url + job.path, body, {**env.headers("prefill", job), **(headers or {})},
                                    timeout=env.settings.prefill_timeout, stage="prefill", started=started,
                                    on_answer=hook if on_answer is not None else None)
    env.metrics.prefill_leg.labels(env.settings.mode).observe(time.perf_counter() - t)
    doc = parsed
    if doc is None:
        try:
            doc = orjson.loads(reply.body)
        except orjson.JSONDecodeError:
            raise UpstreamError("prefill instance answered with invalid JSON", stage="prefill",
                                code="bad_json") from None
    if not isinstance(doc, dict):
        raise UpstreamError("prefill instance answered with a non-object", stage="prefill", code="bad_json")
    return doc


def instance_fault(exc: BaseException) -> bool:
    """Did the instance fail (as opposed to the request being bad)?"""
    return isinstance(exc, UpstreamError) and getattr(exc, "engine_status", 502) >= 500


def is_retryable(exc: BaseException) -> bool:
    """Failures of the instance (not of the request) may be retried elsewhere."""
    if isinstance(exc, UpstreamError):
        engine_status = getattr(exc, "engine_status", 502)
        return engine_status >= 500
    return False


def count_error(env: Env, exc: RouterError, stage: str) -> None:
    """Count a failed leg (retried ones too); the api counts whatever reaches it uncounted."""
    env.metrics.errors.labels(stage, exc.kind).inc()
    exc.counted = True

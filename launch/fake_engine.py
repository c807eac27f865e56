"""A fast fake vLLM OpenAI server for the router's tests and benchmarks.

It speaks the slice of vLLM's HTTP API the router relays (docs: PROTOCOLS.md sections 2, 3, 6):
``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``POST /v1/completions`` and
``POST /v1/chat/completions``, streaming or not, in vLLM's exact JSON shapes, plus the NIXL
``kv_transfer_params`` of a prefill leg (pull) and the decode leg's checks (pull and push).

It must never be the bottleneck of a benchmark, so HTTP/1.1 (keep-alive, chunked streams) is
spoken directly on ``asyncio.Protocol`` with the ``httptools`` parser, TCP_NODELAY is set on every
socket, and the bytes of a streamed token are two pre-encoded halves around the token text.

Generation is deterministic: ``max_tokens`` (or ``max_completion_tokens``, default 16) tokens
" t0", " t1", ... each one token, finish_reason "length"; a prompt counts ceil(chars / 4) tokens
(chat: over the concatenated message contents; a token-id prompt counts its ids).
Timing: a plain or prefill leg waits ``prefill_s_per_char * chars + ttft_extra_s`` before the
first token; a pull decode leg (``kv_transfer_params.do_remote_prefill`` with block ids) waits
``kv_transfer_s`` instead; a push decode leg (no block ids yet: P prefills concurrently) waits
both, as if P were configured like this fake; then one token every ``itl_s``. A non-streamed answer takes as long as the stream would.
A streamed answer's head (status and headers) goes out at once, before that wait, as vLLM's
``StreamingResponse`` sends it before the engine has produced anything.

Every request is recorded (``FakeEngine.requests``) and ``FakeEngine.fault`` injects failures.
The HTTP layer lives in ``launch/fake_engine_http.py``; this module holds the engine logic.

CLI (benchmarks run it as a subprocess): ``python -m launch.fake_engine --port 8100`` or
``--ports 8100,8200`` for several engines in one process; prints ``READY <url> [<url>...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from launch.fake_engine_http import Conn, HttpServer, dumps, error_body, loads
from launch.fake_engine_wire import (
    BLOCK_SIZE,
    COMPLETION_PATHS,
    MAX_MODEL_LEN,
    BadRequest,
    Encoder,
    check_decode_leg,
    check_prefill_leg,
    kv_answer,
    leg_of,
    prompt_chars,
)

__all__ = ["COMPLETION_PATHS", "Fault", "FakeEngine", "RecordedRequest", "main"]

@dataclass
class Fault:
    """A failure to inject. Applies to requests whose path and leg match, ``count`` times
    (``None``: until replaced). ``paths=None`` means the two completion endpoints; put ``"*"``
    in ``paths`` to match every path (health and metrics too). ``legs``: subset of
    {"prefill", "decode", "plain"}, ``None`` for all. Effects apply in this order:
    delay_s, drop_before_headers, hang, status, garbage, drop_after_chunks."""

    status: int | None = None
    delay_s: float = 0.0
    hang: bool = False
    drop_before_headers: bool = False
    drop_after_chunks: int | None = None
    garbage: bool = False
    legs: Collection[str] | None = None
    paths: Collection[str] | None = None
    count: int | None = None
    message: str = "injected fault"

    def matches(self, path: str, leg: str) -> bool:
        if self.count is not None and self.count <= 0:
            return False
        paths = COMPLETION_PATHS if self.paths is None else self.paths
        if "*" not in paths and path not in paths:
            return False
        return self.legs is None or leg in self.legs


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: Any  # parsed JSON, or the raw bytes when the body is not JSON
    leg: str  # "prefill" | "decode" | "plain"
    t_start: float  # time.monotonic()
    t_end: float | None = None
    disconnected: bool = False  # the client closed before we finished answering
    status: int | None = None
    response_id: str | None = None
    fault: Fault | None = None


class FakeEngine:
    def __init__(self, *, model: str = "tiny", model_root: str | None = None, role: str = "both",
                 engine_id: str = "fake-0", prefill_s_per_char: float = 0.0, itl_s: float = 0.0,
                 ttft_extra_s: float = 0.0, kv_transfer_s: float = 0.0,
                 kv_host: str = "127.0.0.1", kv_port: int = 5600, host: str = "127.0.0.1",
                 port: int = 0, strict: bool = False, prefill_cached_tokens: int = 0,
                 max_model_len: int = MAX_MODEL_LEN, record: bool = True,
                 ledger: dict | None = None):
        """No I/O here: ``start()`` binds (``port=0``: an ephemeral port, see ``url``).

        role: "prefill" / "decode" engines reject the other leg in strict mode.
        strict: reject (400, OpenAI-shaped, ``param`` naming the field) P legs that are not
            exactly pull step 1 and D legs lacking the pull or push fields.
        ledger: a dict shared by the fakes of one test: P engines store the kv_transfer_params
            they issue by remote_request_id, strict D engines then require them verbatim.
        prefill_cached_tokens: cached_tokens a plain or P leg reports (D legs: the prompt).
        record: keep every request in ``requests`` (turn off for long benchmarks).
        """
        if role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, not {role!r}")
        self.model, self.model_root, self.role, self.engine_id = model, model_root, role, engine_id
        self.prefill_s_per_char, self.itl_s, self.ttft_extra_s = prefill_s_per_char, itl_s, ttft_extra_s
        self.kv_transfer_s, self.kv_host, self.kv_port = kv_transfer_s, kv_host, kv_port
        self.strict, self.prefill_cached_tokens = strict, prefill_cached_tokens
        self.max_model_len, self.record, self.ledger = max_model_len, record, ledger
        self.fault: Fault | None = None
        self.requests: list[RecordedRequest] = []
        self.tokens_by_source = {"local_compute": 0, "local_cache_hit": 0, "external_kv_transfer": 0}
        self.generation_tokens = 0
        self.num_running = 0
        self._changed: asyncio.Event | None = None  # made in start(), on the running loop
        self._tok = [f" t{i}".encode() for i in range(256)]
        self._block_seq = 0
        self._models_body = dumps({"object": "list", "data": [{
            "id": model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": model_root or model, "parent": None, "max_model_len": max_model_len,
            "permission": []}]})
        self._http = HttpServer(self._handle, host, port)

    @property
    def url(self) -> str:
        return self._http.url

    @property
    def port(self) -> int:
        return self._http.port

    @property
    def connections_accepted(self) -> int:
        return self._http.connections_accepted

    async def start(self) -> None:
        self._changed = asyncio.Event()
        await self._http.start()

    async def close(self) -> None:
        await self._http.close()

    async def __aenter__(self) -> FakeEngine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_for(self, predicate: Callable[[RecordedRequest], bool],
                       timeout: float = 5.0) -> RecordedRequest:
        """Wait until a recorded request satisfies ``predicate`` (re-checked whenever a request
        arrives or finishes); raises TimeoutError."""
        async with asyncio.timeout(timeout):
            while True:
                for r in self.requests:
                    if predicate(r):
                        return r
                self._changed.clear()
                await self._changed.wait()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    def _token(self, i: int) -> bytes:
        while i >= len(self._tok):
            self._tok.append(f" t{len(self._tok)}".encode())
        return self._tok[i]

    # -- request handling ------------------------------------------------------------------

    async def _handle(self, conn: Conn, method: str, path: str, headers: dict[str, str],
                      raw: bytes) -> None:
        path = path.split("?", 1)[0]
        body: Any = raw
        if raw:
            try:
                body = loads(raw)
            except ValueError:
                pass
        rec = RecordedRequest(method, path, headers, body, leg_of(body), time.monotonic())
        if self.record:
            self.requests.append(rec)
        self._notify()
        try:
            fault = self.fault
            if fault is not None and fault.matches(path, rec.leg):
                if fault.count is not None:
                    fault.count -= 1
                    if fault.count <= 0 and self.fault is fault:
                        self.fault = None
                rec.fault = fault
                if await self._apply_fault(conn, rec, fault):
                    return
            await self._route(conn, rec)
        except asyncio.CancelledError:
            rec.disconnected = conn.lost
            raise
        finally:
            rec.t_end = time.monotonic()
            self._notify()

    async def _apply_fault(self, conn: Conn, rec: RecordedRequest, f: Fault) -> bool:
        """Returns True when the fault answered (or dropped) the request itself."""
        if f.delay_s:
            await asyncio.sleep(f.delay_s)
        if f.drop_before_headers:
            conn.close()
            return True
        if f.hang:
            await conn.wait_lost()
            rec.disconnected = True
            return True
        if f.status is not None:
            rec.status = f.status
            conn.send(f.status, error_body(f.message, f.status))
            return True
        if f.garbage:
            rec.status = 200
            stream = isinstance(rec.body, dict) and rec.body.get("stream")
            if stream:
                conn.start_stream()
                conn.chunk(b'data: {"id": "cmpl-garbage", "choices": [{"text": \n\n')
                conn.chunk(b"event: nonsense\nthis is not sse\n\n")
                conn.chunk(b"data: [DONE]\n\n")
                conn.end_stream()
            else:
                conn.send(200, b"<html>this is not json", "text/html")
            return True
        return False

    async def _route(self, conn: Conn, rec: RecordedRequest) -> None:
        path, method = rec.path, rec.method
        if path in COMPLETION_PATHS:
            if method != "POST":
                return self._send_error(conn, rec, "Method Not Allowed", 405)
            try:
                await self._generate(conn, rec)
            except BadRequest as e:
                self._send_error(conn, rec, str(e), e.status, e.param)
            return
        if method != "GET":
            return self._send_error(conn, rec, "Method Not Allowed", 405)
        rec.status = 200
        if path == "/v1/models":
            conn.send(200, self._models_body)
        elif path == "/health":
            conn.send(200, b"", None)
        elif path == "/metrics":
            conn.send(200, self._metrics(), "text/plain; version=0.0.4; charset=utf-8")
        else:
            rec.status = 404
            conn.send(404, b'{"detail":"Not Found"}')

    def _send_error(self, conn: Conn, rec: RecordedRequest, msg: str, status: int,
                    param: str | None = None) -> None:
        rec.status = status
        conn.send(status, error_body(msg, status, param))

    def _metrics(self) -> bytes:
        lab = f'model_name="{self.model}",engine="0"'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lab}}} {float(self.num_running)}",
            "# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.",
            "# TYPE vllm:prompt_tokens_by_source_total counter",
        ]
        for source, n in self.tokens_by_source.items():
            lines.append(f'vllm:prompt_tokens_by_source_total{{{lab},source="{source}"}} {float(n)}')
        total = sum(self.tokens_by_source.values())
        lines += [
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{lab}}} {float(total)}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{lab}}} {float(self.generation_tokens)}",
        ]
        return ("\n".join(lines) + "\n").encode()

    # -- generation ------------------------------------------------------------------------

    def _check(self, rec: RecordedRequest, body: dict, chat: bool) -> int:
        """Validates the body like vLLM would (strictly for P/D legs in strict mode);
        returns max_tokens."""
        model = body.get("model")
        if model is not None and model not in (self.model, self.model_root):
            raise BadRequest(f"The model `{model}` does not exist.", "model", 404)
        max_tokens = body.get("max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is None:
            max_tokens = 16
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise BadRequest("max_tokens must be a positive integer", "max_tokens")
        if body.get("stream_options") is not None and not body.get("stream"):
            raise BadRequest("Stream options can only be defined when `stream=True`.",
                             "stream_options")
        if self.strict:
            if rec.leg == "prefill":
                check_prefill_leg(body, self.role)
            elif rec.leg == "decode":
                check_decode_leg(body, self.role, self.ledger)
        return max_tokens

    async def _generate(self, conn: Conn, rec: RecordedRequest) -> None:
        body = rec.body
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object")
        chat = rec.path == "/v1/chat/completions"
        max_tokens = self._check(rec, body, chat)
        chars, n_prompt = prompt_chars(rec.path, body)
        if n_prompt + max_tokens > self.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n_prompt + max_tokens} tokens ({n_prompt} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or "
                "completion.", "max_tokens")
        base = rec.headers.get("x-request-id") or uuid.uuid4().hex
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{base}"
        internal_id = f"{rid}{'' if chat else '-0'}-{uuid.uuid4().hex[:8]}"
        rec.response_id = rid
        loop = asyncio.get_running_loop()
        self.num_running += 1
        try:
            if rec.leg == "decode":
                wait = self.kv_transfer_s
                if body["kv_transfer_params"].get("remote_block_ids") is None:
                    # push: P prefills concurrently and D cannot decode before P has written
                    # the KV; P and D fakes are configured alike, so wait P's prefill time.
                    wait += self.prefill_s_per_char * chars + self.ttft_extra_s
                self.tokens_by_source["external_kv_transfer"] += n_prompt
                cached = n_prompt
            else:
                wait = self.prefill_s_per_char * chars + self.ttft_extra_s
                self.tokens_by_source["local_compute"] += n_prompt
                cached = min(self.prefill_cached_tokens, n_prompt)
            kv_out = self._kv_answer(internal_id, n_prompt) if rec.leg == "prefill" else None
            usage = {"prompt_tokens": n_prompt, "total_tokens": n_prompt + max_tokens,
                     "completion_tokens": max_tokens,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            gen = Encoder(rid, self.model if body.get("model") is None else body["model"],
                       chat, max_tokens, usage, kv_out)
            if body.get("stream"):
                so = body.get("stream_options") or {}
                await self._stream(conn, rec, gen, wait, bool(so.get("include_usage")), loop)
            else:
                if wait or self.itl_s:
                    await asyncio.sleep(wait + self.itl_s * (max_tokens - 1))
                self.generation_tokens += max_tokens
                data = gen.full_body(b"".join(self._token(i) for i in range(max_tokens)))
                rec.status = 200
                f = rec.fault
                if f is not None and f.drop_after_chunks is not None:
                    conn.send_partial_and_abort(200, data, len(data) // 2)
                    return
                conn.send(200, data)
        finally:
            self.num_running -= 1

    def _kv_answer(self, internal_id: str, n_prompt: int) -> dict:
        first = self._block_seq
        self._block_seq += -(-n_prompt // BLOCK_SIZE)
        kv = kv_answer(internal_id=internal_id, n_prompt=n_prompt, first_block=first,
                       engine_id=self.engine_id, kv_host=self.kv_host, kv_port=self.kv_port)
        if self.ledger is not None:
            self.ledger[internal_id] = kv
        return kv

    async def _stream(self, conn: Conn, rec: RecordedRequest, gen: Encoder, wait: float,
                      include_usage: bool, loop: asyncio.AbstractEventLoop) -> None:
        f = rec.fault
        drop_after = f.drop_after_chunks if f is not None else None
        rec.status = 200
        conn.start_stream()  # as vLLM's StreamingResponse: the head at once, the first token after prefill
        if wait:
            await asyncio.sleep(wait)
        sent = 0
        if gen.chat:
            conn.chunk(gen.role_chunk())
            sent += 1
        t0, itl, n = loop.time(), self.itl_s, gen.max_tokens
        for i in range(n):
            if drop_after is not None and sent >= drop_after:
                conn.abort()
                return
            if i and itl:
                delay = t0 + i * itl - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
            if conn.lost:
                rec.disconnected = True
                return
            conn.chunk(gen.token_chunk(self._token(i), last=i == n - 1))
            sent += 1
            self.generation_tokens += 1
            if conn.paused:
                await conn.drain()
        if drop_after is not None and sent >= drop_after:
            conn.abort()
            return
        if include_usage:
            conn.chunk(gen.usage_chunk())
        conn.chunk(b"data: [DONE]\n\n")
        conn.end_stream()


def _csv(value: str, kind: type) -> list:
    return [kind(v) for v in str(value).split(",") if v != ""]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m launch.fake_engine", description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--port", type=int)
    g.add_argument("--ports", help="comma-separated: several engines in one process")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--model", default="tiny")
    p.add_argument("--model-root", default=None)
    p.add_argument("--role", default="both", choices=("both", "prefill", "decode"))
    p.add_argument("--engine-id", default=None,
                   help="comma-separated, one per port (default fake-<port>)")
    p.add_argument("--kv-host", default="127.0.0.1")
    p.add_argument("--kv-port", default="5600", help="comma-separated, one per port")
    p.add_argument("--prefill-us-per-char", type=float, default=0.0)
    p.add_argument("--ttft-extra-ms", type=float, default=0.0)
    p.add_argument("--kv-transfer-ms", type=float, default=0.0)
    p.add_argument("--itl-ms", type=float, default=0.0)
    p.add_argument("--strict", action="store_true")
    p.add_argument("--no-record", action="store_true",
                   help="do not keep requests in memory (long benchmarks)")
    a = p.parse_args(argv)
    ports = [a.port] if a.port is not None else _csv(a.ports, int)
    ids = _csv(a.engine_id, str) if a.engine_id else [f"fake-{port}" for port in ports]
    kv_ports = _csv(a.kv_port, int)
    if len(kv_ports) == 1:
        kv_ports = [kv_ports[0] + i for i in range(len(ports))]
    if len(ids) != len(ports) or len(kv_ports) != len(ports):
        p.error("--engine-id and --kv-port need one value per port")
    try:
        import uvloop
    except ImportError:
        uvloop = None

    async def run() -> None:
        engines = [FakeEngine(
            model=a.model, model_root=a.model_root, role=a.role, engine_id=eid,
            prefill_s_per_char=a.prefill_us_per_char * 1e-6, itl_s=a.itl_ms * 1e-3,
            ttft_extra_s=a.ttft_extra_ms * 1e-3, kv_transfer_s=a.kv_transfer_ms * 1e-3,
            kv_host=a.kv_host, kv_port=kp, host=a.host, port=port, strict=a.strict,
            record=not a.no_record) for port, eid, kp in zip(ports, ids, kv_ports)]
        for e in engines:
            await e.start()
        print("READY " + " ".join(e.url for e in engines), flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            for e in engines:
                await e.close()

    try:
        if uvloop is not None and not os.environ.get("PD_FAKE_NO_UVLOOP"):
            uvloop.run(run())
        else:
            asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

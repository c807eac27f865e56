"""The router's own serving of the hot endpoints (router/server.py) and its relay loop
(`relay.splice`), on raw sockets: keep-alive, pipelining, chunked framing, disconnects,
backpressure, request-size limits and error shapes."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import orjson
import pytest

from router.dispatch.base import Job, Outcome
from router.fastpath import RouterASGI
from router.metrics import Metrics
from router.relay import Tally, splice
from tests.unit.routerkit import LONG, SHORT, completion_legs, sse_events, topology


async def _open(url: str):
    u = urlsplit(url)
    return await asyncio.open_connection(u.hostname, u.port)


def _post(path: str, body: dict | bytes, extra: bytes = b"") -> bytes:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(raw)).encode() + b"\r\n" + extra + b"\r\n" + raw)


async def _response(reader: asyncio.StreamReader) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response: (status, headers, body), the body de-chunked."""
    status_line = await asyncio.wait_for(reader.readline(), 10)
    assert status_line.startswith(b"HTTP/1.1 "), status_line
    status = int(status_line.split()[1])
    headers = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        k, v = line.decode().split(":", 1)
        headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            data = await reader.readexactly(size + 2)
            assert data.endswith(b"\r\n")
            if size == 0:
                break
            body += data[:-2]
    else:
        body = await reader.readexactly(int(headers.get("content-length", 0)))
    return status, headers, body


async def _until_idle(app) -> None:
    """Wait (up to 2 s) for the router to have no request in flight, then assert it."""
    for _ in range(100):
        if app.state.pdr.in_flight == 0:
            break
        await asyncio.sleep(0.02)
    assert app.state.pdr.in_flight == 0


def _openai_error(body: bytes) -> dict:
    doc = orjson.loads(body)
    assert set(doc) == {"error"} and {"message", "type", "param", "code"} <= set(doc["error"]), doc
    return doc["error"]


async def test_keep_alive_stream_then_whole_then_get(tiny_model_path, monkeypatch):
    async def not_asgi(*a, **kw):
        raise AssertionError("a hot POST went through the ASGI app")

    monkeypatch.setattr(RouterASGI, "_hot", not_asgi)  # the server must answer these itself
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        reader, writer = await _open(url)
        writer.write(_post("/v1/completions", {"model": "tiny", "prompt": SHORT, "max_tokens": 3, "stream": True}))
        status, headers, body = await _response(reader)
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert headers["content-type"].startswith("text/event-stream") and headers["x-request-id"]
        events = sse_events(body.decode())
        assert events[-1] == "[DONE]" and len(events) == 4
        # same connection, a non-streamed answer, then a request for the FastAPI app
        writer.write(_post("/v1/completions", {"model": "tiny", "prompt": SHORT, "max_tokens": 2}))
        status, headers, body = await _response(reader)
        assert status == 200 and int(headers["content-length"]) == len(body)
        assert orjson.loads(body)["usage"]["completion_tokens"] == 2
        writer.write(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        status, _, body = await _response(reader)
        assert status == 200 and orjson.loads(body)["status"] == "ok"
        writer.close()


async def test_pipelined_requests_answer_in_order(tiny_model_path):
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        reader, writer = await _open(url)
        writer.write(_post("/v1/completions", {"model": "tiny", "prompt": LONG, "max_tokens": 4, "stream": True})
                     + _post("/v1/chat/completions", {"model": "tiny", "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "hi"}]})
                     + _post("/v1/completions", b"{not json"))
        s1, _, b1 = await _response(reader)
        s2, _, b2 = await _response(reader)
        s3, _, b3 = await _response(reader)
        assert s1 == 200 and sse_events(b1.decode())[-1] == "[DONE]"
        assert s2 == 200 and orjson.loads(b2)["object"] == "chat.completion"
        assert s3 == 400 and _openai_error(b3)["code"] == "invalid_json"
        writer.close()


async def test_connection_close_is_honoured(tiny_model_path):
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        reader, writer = await _open(url)
        writer.write(_post("/v1/completions", {"model": "tiny", "prompt": SHORT, "max_tokens": 2, "stream": True},
                           b"connection: close\r\n"))
        status, headers, body = await _response(reader)
        assert status == 200 and headers.get("connection") == "close"
        assert await asyncio.wait_for(reader.read(), 5) == b""  # the router closed the connection
        writer.close()


async def test_error_shapes_and_bad_requests(tiny_model_path):
    async with topology(tiny_model_path, max_body_bytes=2000) as (c, url, ps, ds, app):
        reader, writer = await _open(url)
        cases = [
            (_post("/v1/completions", b"[1, 2]"), 400, "invalid_json"),
            (_post("/v1/completions", {"model": "nope", "prompt": SHORT}), 404, None),
            (_post("/v1/completions", {"model": "tiny", "prompt": "x" * 5000}), 413, "payload_too_large"),
        ]
        for raw, want, code in cases:
            writer.write(raw)
            status, headers, body = await _response(reader)
            assert status == want, body
            assert headers["content-type"] == "application/json"
            err = _openai_error(body)
            if code:
                assert err["code"] == code
        writer.close()
        # a body declared larger than the limit is refused before it is read
        reader, writer = await _open(url)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 999999\r\n\r\n{")
        status, _, body = await _response(reader)
        assert status == 413 and _openai_error(body)["code"] == "payload_too_large"
        writer.close()
        # malformed HTTP: a 400 and the connection closed
        reader, writer = await _open(url)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nbad header line\r\n\r\n")
        status_line = await asyncio.wait_for(reader.readline(), 5)
        assert status_line.startswith(b"HTTP/1.1 400")
        writer.close()
        # a GET on a hot path is the framework's 405, not the fast path
        r = await c.get("/v1/completions")
        assert r.status_code == 405 and "error" in r.json()
        await asyncio.sleep(0.05)
        assert app.state.pdr.in_flight == 0


async def test_disconnect_mid_stream_closes_decode_leg_raw(tiny_model_path):
    async with topology(tiny_model_path, engine_kw={"itl_s": 0.05}) as (c, url, ps, ds, app):
        reader, writer = await _open(url)
        writer.write(_post("/v1/completions", {"model": "tiny", "prompt": LONG, "max_tokens": 500, "stream": True}))
        await asyncio.wait_for(reader.readuntil(b"data: "), 10)  # the stream has started
        writer.transport.abort()  # hang up mid-stream
        leg = await ds[0].wait_for(lambda q: q.method == "POST" and q.t_end is not None, timeout=5)
        assert leg.disconnected
        await _until_idle(app)
        assert all(i.in_flight == 0 for i in app.state.pdr.registry)
        m = (await c.get("/metrics")).text
        assert 'pd_router_requests_total{mode="pull",outcome="cancelled",route="disaggregated"} 1.0' in m
        assert len(completion_legs(ds[0])) == 1


# -- relay.splice on its own -----------------------------------------------------------------


class _FakeStream:
    """Stands in for h1.Stream: delivers queued chunks by callback, one per loop turn, while
    not paused; records pauses and close."""

    def __init__(self, chunks: list[bytes], end: bool = True, end_with_last: bool = False, error=None,
                 burst: bool = False):
        self.burst = burst  # all chunks in one loop turn (as a held-back backlog is replayed)
        self.chunks = list(chunks)
        self.end = end
        self.end_with_last = end_with_last  # the last read holds the end of the body too
        self.error = error  # delivered instead of the end
        self.reads = 0
        self.closed = False
        self.paused = False
        self.cbs = None

    def attach(self, on_chunk, on_end, on_error) -> None:
        self.cbs = (on_chunk, on_end, on_error)
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        if self.closed or self.paused:
            return
        on_chunk, on_end, _ = self.cbs
        if self.chunks:
            self.reads += 1
            on_chunk(self.chunks.pop(0))
            while self.burst and self.chunks:
                on_chunk(self.chunks.pop(0))
            if self.chunks or not self.end_with_last:
                asyncio.get_running_loop().call_soon(self._tick)
                return
        if self.error is not None:
            self.cbs[2](self.error)
        elif self.end:
            on_end()

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False
        asyncio.get_running_loop().call_soon(self._tick)

    async def aclose(self) -> None:
        self.closed = True


class _Flow:
    def __init__(self) -> None:
        self.write_paused = False
        self.ready = asyncio.Event()

    async def drain(self) -> None:
        await self.ready.wait()


def _event(i: int, usage: dict | None = None, choices: bool = True) -> bytes:
    doc = {"choices": [{"index": 0, "text": f" t{i}"}] if choices else []}
    if usage is not None:
        doc["usage"] = usage
    return b"data: " + orjson.dumps(doc) + b"\n\n"


def _job(strip: bool = False) -> Job:
    return Job(kind="completions", path="/v1/completions", body={}, stream=True, request_id="r", prompt_tokens=1,
               model="tiny", strip_usage=strip)


async def test_splice_backpressure_stops_reading_until_drained():
    stream = _FakeStream([_event(1), _event(2), b"data: [DONE]\n\n"])
    outcome = Outcome(decode=None, body=_event(0), stream=stream)
    flow, written, done = _Flow(), [], []
    hist = Metrics().itl.labels("direct", "none")

    def write(chunk: bytes) -> None:
        written.append(chunk)
        flow.write_paused = True  # the client's socket buffer is full after every write

    task = asyncio.create_task(splice(outcome, _job(), Tally(), hist, done.append, write, flow))
    for _ in range(20):
        await asyncio.sleep(0)
    assert written == [_event(0)] and stream.reads == 0  # waiting for the client, not reading D
    flow.write_paused = False
    flow.ready.set()
    await asyncio.wait_for(task, 5)
    assert b"".join(written).endswith(b"data: [DONE]\n\n") and len(written) == 4
    assert stream.closed and len(done) == 1 and done[0].outcome == "ok"
    assert done[0].chunks == 3  # three token events, [DONE] is not one


async def test_splice_usage_rewrite_strip_itl_batch_and_truncation():
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 5}}
    split = _event(9, usage, choices=False)
    stream = _FakeStream([_event(1), split[:-15], split[-15:] + b"data: [DONE]\n\n"])
    outcome = Outcome(decode=None, body=_event(0), stream=stream)
    flow, written, done = _Flow(), [], []
    metrics = Metrics()
    hist = metrics.itl.labels("direct", "none")
    await splice(outcome, _job(strip=True), Tally(), hist, done.append, written.append, flow)
    text = b"".join(written)
    assert b"usage" not in text and text.endswith(b"data: [DONE]\n\n")  # the client did not ask for usage
    t = done[0]
    assert t.output_tokens == 2 and t.outcome == "ok" and t.chunks == 2
    assert metrics.registry.get_sample_value("pd_router_inter_token_latency_seconds_count",
                                             {"route": "direct", "mode": "none"}) == 1.0  # flushed at the end

    # a stream that ends without [DONE]: the error event, then finish
    stream = _FakeStream([_event(1)])
    done.clear()
    written.clear()
    await splice(Outcome(decode=None, body=_event(0), stream=stream), _job(), Tally(), hist, done.append,
               written.append, flow)
    assert b'"truncated_stream"' in written[-1] and written[-1].endswith(b"data: [DONE]\n\n")
    assert done[0].outcome == "upstream_error" and stream.closed


class _Transport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return False


def _frame(b: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(b), b)


HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
DONE = b"data: [DONE]\n\n"


@pytest.mark.parametrize("same_read", [True, False])
async def test_splice_writes_head_with_first_chunk_and_done_with_the_end(same_read):
    """The server's writer saves two writes per stream: the head goes with the first chunk, and
    the [DONE] events with the end of the body when that is in the same read (else they go
    out on the next loop turn and the end after them). The bytes are the same either way."""
    from router.server import _LAST_CHUNK, _ChunkWriter

    t = _Transport()
    writer = _ChunkWriter(t, HEAD)
    stream = _FakeStream([_event(1), _event(2) + DONE], end_with_last=same_read)
    done: list = []
    await splice(Outcome(decode=None, body=_event(0), stream=stream), _job(), Tally(),
                 Metrics().itl.labels("direct", "none"), done.append, writer, _Flow())
    writer.end()
    body = [_frame(_event(0)), _frame(_event(1)), _frame(_event(2) + DONE)]
    if same_read:
        assert t.writes == [HEAD + body[0], body[1], body[2] + _LAST_CHUNK]
    else:
        assert t.writes == [HEAD + body[0], body[1], body[2], _LAST_CHUNK]
    assert done[0].outcome == "ok" and done[0].chunks == 3
    writer.end()
    assert len(t.writes) == (3 if same_read else 4)  # the end is written once


async def test_splice_writer_order_with_empty_first_body_late_events_and_errors():
    from router.errors import UpstreamError
    from router.server import _LAST_CHUNK, _ChunkWriter

    hist = Metrics().itl.labels("direct", "none")
    # nothing in the first read: the head goes alone, before anything else
    t = _Transport()
    writer = _ChunkWriter(t, HEAD)
    await splice(Outcome(decode=None, body=b"", stream=_FakeStream([_event(1) + DONE], end_with_last=True)),
                 _job(), Tally(), hist, [].append, writer, _Flow())
    writer.end()
    assert t.writes == [HEAD, _frame(_event(1) + DONE) + _LAST_CHUNK]

    # an event after [DONE] (a misbehaving engine) still comes after it, in the next loop turn or
    # in the same one
    for burst in (False, True):
        t = _Transport()
        writer = _ChunkWriter(t, HEAD)
        stream = _FakeStream([DONE, _event(7)], end_with_last=True, burst=burst)
        await splice(Outcome(decode=None, body=_event(0), stream=stream), _job(), Tally(), hist, [].append,
                     writer, _Flow())
        writer.end()
        assert b"".join(t.writes) == HEAD + _frame(_event(0)) + _frame(DONE) + _frame(_event(7)) + _LAST_CHUNK

    # the engine's connection breaks after [DONE], before the end of the body: [DONE], then the error event
    t = _Transport()
    writer = _ChunkWriter(t, HEAD)
    err = UpstreamError("decode instance closed the connection", stage="decode", code="connection_lost")
    done: list = []
    await splice(Outcome(decode=None, body=_event(0), stream=_FakeStream([DONE], end_with_last=True, error=err)),
                 _job(), Tally(), hist, done.append, writer, _Flow())
    writer.end()
    text = b"".join(t.writes)
    assert text.index(_frame(DONE)) < text.index(b"connection_lost") and text.endswith(_LAST_CHUNK)
    assert done[0].outcome == "upstream_error"


async def test_splice_cancelled_closes_stream_and_finishes():
    stream = _FakeStream([], end=False)  # the engine goes quiet
    done: list = []
    task = asyncio.create_task(splice(Outcome(decode=None, body=_event(0), stream=stream), _job(), Tally(),
                                    Metrics().itl.labels("direct", "none"), done.append, lambda b: None, _Flow()))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stream.closed and done[0].outcome == "cancelled"


async def test_a_bug_is_an_openai_shaped_500_and_the_connection_survives(tiny_model_path, monkeypatch):
    import router.api

    def broken(*a, **kw):
        raise RuntimeError("boom")

    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        monkeypatch.setattr(router.api, "plan", broken)
        reader, writer = await _open(url)
        writer.write(_post("/v1/completions", {"model": "tiny", "prompt": SHORT, "max_tokens": 2, "stream": True}))
        status, headers, body = await _response(reader)
        assert status == 500 and _openai_error(body)["type"] == "internal_error"
        monkeypatch.undo()
        writer.write(_post("/v1/completions", {"model": "tiny", "prompt": SHORT, "max_tokens": 2}))
        status, _, body = await _response(reader)  # same keep-alive connection
        assert status == 200
        writer.close()


async def test_without_uvicorns_hooks_the_asgi_path_serves_the_same_answers(tiny_model_path, monkeypatch):
    """Another uvicorn (no protocol hooks): `uvicorn_config` falls back to plain ASGI serving,
    and RouterASGI + `relay.stream_body` answer as the server's own path does."""
    import router.server

    monkeypatch.setattr(router.server, "_HOOKS_PRESENT", False)
    hot_calls = []
    real_hot = RouterASGI._hot

    async def counting_hot(self, *a, **kw):
        hot_calls.append(a[-1])
        return await real_hot(self, *a, **kw)

    monkeypatch.setattr(RouterASGI, "_hot", counting_hot)
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        reader, writer = await _open(url)
        for prompt in (SHORT, LONG):  # direct route and disaggregated (usage rewritten)
            writer.write(_post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 3,
                                                   "stream": True,
                                                   "stream_options": {"include_usage": True}}))
            status, headers, body = await _response(reader)
            assert status == 200 and headers["transfer-encoding"] == "chunked"
            events = sse_events(body.decode())
            assert events[-1] == "[DONE]" and len(events) == 5  # 3 tokens, usage, [DONE]
            assert events[-2]["usage"]["completion_tokens"] == 3 and not events[-2]["choices"]
        writer.write(_post("/v1/completions", {"model": "tiny", "prompt": SHORT, "max_tokens": 2}))
        status, headers, body = await _response(reader)
        assert status == 200 and orjson.loads(body)["usage"]["completion_tokens"] == 2
        writer.close()
    assert hot_calls == ["completions"] * 3


async def test_splice_holds_the_stream_until_the_prefill_usage_is_in():
    """Push: D can reach its usage event before P's answer is in. The stream is paused and
    nothing after that event is written until P's details can be put into it; order kept."""
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "prompt_tokens_details": None}
    loop = asyncio.get_running_loop()
    p_reply = loop.create_future()
    stream = _FakeStream([_event(1, usage), _event(2), b"data: [DONE]\n\n"])
    outcome = Outcome(decode=None, body=_event(0), stream=stream, prefill_reply=p_reply)
    written, done = [], []
    task = asyncio.create_task(splice(outcome, _job(), Tally(), Metrics().itl.labels("direct", "none"), done.append,
                                      written.append, _Flow()))
    for _ in range(20):
        await asyncio.sleep(0)
    assert written == [_event(0)] and stream.paused and not task.done()
    p_reply.set_result({"usage": {"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 3}}})
    await asyncio.wait_for(task, 5)
    text = b"".join(written)
    assert text.index(b'"cached_tokens":3') < text.index(b" t2") < text.index(b"[DONE]")
    assert done[0].outcome == "ok" and done[0].output_tokens == 2 and stream.closed


def test_a_chunk_arriving_after_the_client_left_is_dropped_quietly(tiny_model_path, monkeypatch, caplog):
    """The engine's data_received can deliver a chunk after the client's connection closed and
    before the request's task is cancelled: the write is skipped (uvloop, which `pd-router serve`
    runs on, raises on a closed transport), the stream is torn down as a client disconnect, and
    nothing is logged as an error. Run on uvloop: asyncio's own transports ignore such writes."""
    import uvloop

    import router.server

    real = router.server.splice

    async def racing(outcome, job, tally, itl, finish, write, flow, transport=None):
        def w(chunk: bytes) -> None:
            write(chunk)
            if not flow._transport.is_closing():
                flow._transport.close()  # the client is gone (connection_lost is queued) ...
                # ... and the next engine chunk is written after connection_lost ran, before the
                # task it cancelled runs again (as an engine read in that same loop turn would be)
                asyncio.get_running_loop().call_soon(write, b"data: late\n\n")

        await real(outcome, job, tally, itl, finish, w, flow, transport)  # later reads: the C relay's check

    async def scenario() -> None:
        async with topology(tiny_model_path, engine_kw={"itl_s": 0.01}) as (c, url, ps, ds, app):
            reader, writer = await _open(url)
            writer.write(_post("/v1/completions", {"model": "tiny", "prompt": SHORT, "max_tokens": 50,
                                                   "stream": True}))
            leg = await ds[0].wait_for(lambda q: q.method == "POST" and q.t_end is not None, timeout=10)
            assert leg.disconnected
            await _until_idle(app)
            writer.close()

    monkeypatch.setattr(router.server, "splice", racing)
    uvloop.run(scenario())
    assert not [r for r in caplog.records if r.levelno >= 40], [r.getMessage() for r in caplog.records]


async def test_streams_through_the_server_use_the_c_relay(tiny_model_path, monkeypatch):
    """Over real sockets, direct and disaggregated streams: the engine's reads after the first
    are relayed by router._splice (when built), and the client gets the same answer shape."""
    import router.relay

    if router.relay._splice is None:
        pytest.skip("router._splice (C extension) not built")
    relays = []
    real = router.relay._fast_relay

    def spy(*a):
        relays.append(real(*a))
        return relays[-1]

    monkeypatch.setattr(router.relay, "_fast_relay", spy)
    async with topology(tiny_model_path, engine_kw={"itl_s": 0.005}) as (c, url, ps, ds, app):
        reader, writer = await _open(url)
        for prompt in (SHORT, LONG):
            writer.write(_post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 20,
                                                   "stream": True}))
            status, headers, body = await _response(reader)
            events = sse_events(body.decode())
            assert status == 200 and events[-1] == "[DONE]" and len(events) == 21
            assert not any("usage" in e for e in events[:-1])  # the router's own usage request is stripped
        writer.close()
        await _until_idle(app)
        m = (await c.get("/metrics")).text
    assert len(relays) == 2 and all(r.fast_reads >= 10 for r in relays), [r.fast_reads for r in relays]
    assert 'pd_router_output_tokens_total{route="direct"} 20.0' in m


async def _plain_app(scope, receive, send):
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


async def _start(server) -> asyncio.Task:
    task = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started:
            return task
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    raise RuntimeError("server did not start")


def _server(tick_s: float | None = None):
    import uvicorn

    from launch.local import free_port
    from router.server import RouterServer

    server = RouterServer(uvicorn.Config(_plain_app, host="127.0.0.1", port=free_port(), log_config=None,
                                         lifespan="off", timeout_graceful_shutdown=2))
    if tick_s is not None:
        server.TICK_S = tick_s
    return server


async def test_router_server_wakes_once_a_second_and_keeps_the_date_header():
    """uvicorn's own main loop ticks every 0.1 s; the router's once a second, each tick
    refreshing the Date header (on_tick does when counter % 10 == 0). A loaded machine can
    only make the ticks fewer, so the upper bound cannot flake."""
    server = _server()
    ticks: list[int] = []
    on_tick = server.on_tick

    async def counting(counter: int) -> bool:
        ticks.append(counter)
        return await on_tick(counter)

    server.on_tick = counting
    task = await _start(server)
    try:
        await asyncio.sleep(1.5)
        n = len(ticks)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.config.port)
        writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        status, headers, body = await _response(reader)
        writer.close()
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
    assert 1 <= n <= 3, ticks  # uvicorn.Server: ~15
    assert all(c % 10 == 0 for c in ticks), ticks
    assert status == 200 and body == b"ok" and headers["date"].endswith(" GMT"), headers


@pytest.mark.parametrize("how", ["signal", "other thread"])
async def test_router_server_exits_at_once_when_told(how):
    """Its loop sleeps a whole tick between checks; setting should_exit (uvicorn's signal
    handler, or the tests' run_router from wherever) must wake it, not wait the tick out: here
    a tick is an hour, so a missed wake-up fails on the 10 s bound below."""
    import signal
    import threading

    server = _server(tick_s=3600.0)
    task = await _start(server)
    await asyncio.sleep(0.2)  # main_loop is waiting on its tick
    if how == "signal":
        server.handle_exit(signal.SIGTERM, None)
        server._captured_signals.clear()  # serve() re-raises captured signals when it returns
    else:
        t = threading.Thread(target=setattr, args=(server, "should_exit", True))
        t.start()
        t.join()
    await asyncio.wait_for(task, 10)
    assert server.should_exit

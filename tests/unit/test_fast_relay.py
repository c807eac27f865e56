"""router._splice (the per-read relay in C) and its place in h1.Conn and relay.splice.

The property test drives a real `h1.Conn` (httptools parser and all) with an engine's chunked
SSE answer cut into arbitrary reads, once through the Python path and once with the C relay,
and requires the same client bytes, token counts, usage and outcome.
"""

from __future__ import annotations

import asyncio
import os
import random

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router import h1, relay
from router.dispatch.base import Job, Outcome
from router.metrics import Metrics
from router.relay import Tally, splice

try:
    from router import _splice
except ImportError as exc:  # pragma: no cover - only where the extension was not built
    if os.environ.get("PDR_REQUIRE_C_EXT") == "1":
        raise AssertionError(f"router._splice required (PDR_REQUIRE_C_EXT=1) but not importable: {exc}") from exc
    pytest.skip("router._splice (C extension) not built", allow_module_level=True)

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def dechunk(framed: bytes) -> list[bytes]:
    """The chunks of a chunked body (strict: a framing error fails the test)."""
    out, pos = [], 0
    while pos < len(framed):
        eol = framed.index(b"\r\n", pos)
        size = int(framed[pos:eol], 16)
        assert size > 0, "an empty chunk would end the client's body"
        data = framed[eol + 2: eol + 2 + size]
        assert len(data) == size and framed[eol + 2 + size: eol + 4 + size] == b"\r\n"
        out.append(data)
        pos = eol + 4 + size
    return out


def event(i: int, text: str = "", usage: dict | None = None, choices: bool = True) -> bytes:
    doc: dict = {"id": "cmpl-1", "choices": [{"index": 0, "text": f"{text}{i}"}] if choices else []}
    if usage is not None:
        doc["usage"] = usage
    return b"data: " + orjson.dumps(doc) + b"\n\n"


class Transport:
    """A transport that records writes (client side or engine side)."""

    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closing = False
        self.paused = 0

    def write(self, data: bytes) -> None:
        assert not self.closing
        self.written.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        self.paused += 1

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name, default=None):
        return default


class Flow:
    def __init__(self) -> None:
        self.write_paused = False

    async def drain(self) -> None:
        self.write_paused = False


def job() -> Job:
    return Job(kind="completions", path="/v1/completions", body={}, stream=True, request_id="r", prompt_tokens=1,
               model="tiny", strip_usage=False)


def relay_for(transport=None, flow=None, bounds=(0.01, 0.1, float("inf")), t0=0.0):
    return _splice.Relay(transport or Transport(), flow or Flow(), list(bounds), t0)


# -- Relay.feed on its own ---------------------------------------------------------------------


def test_h1_reads_the_decline_flag_the_module_defines():
    assert (h1.FAST_SLOW, relay._PAUSED, relay._FLUSH) == (_splice.SLOW, _splice.PAUSED, _splice.FLUSH)


def test_one_chunk_passes_through_as_it_came_and_is_counted():
    client = Transport()
    r = relay_for(client)
    data = chunk(event(1))
    assert r.feed(data) == 0
    assert client.written == [data] and r.chunks == 1 and r.ttft is not None and r.fast_reads == 1
    assert r.last_read > 0 and not r.seen_done


def test_several_chunks_of_one_read_become_one_chunk():
    client = Transport()
    r = relay_for(client)
    payload = event(1) + event(2) + event(3) + b"data: [DONE]\n\n"
    assert r.feed(chunk(event(1)) + chunk(event(2)) + b"%X\r\n%b\r\n" % (len(event(3)), event(3))
                  + chunk(b"data: [DONE]\n\n")) == 0
    assert client.written == [chunk(payload)]
    assert r.chunks == 3 and r.seen_done  # [DONE] is not a token


@pytest.mark.parametrize("data", [
    pytest.param(b"", id="empty"),
    pytest.param(chunk(event(1))[:-3], id="partial chunk"),
    pytest.param(chunk(event(1))[:3], id="partial size line"),
    pytest.param(chunk(event(1)) + b"0\r\n\r\n", id="last chunk"),
    pytest.param(b"0\r\n\r\n", id="only the last chunk"),
    pytest.param(b"%x;ext=1\r\n%b\r\n" % (len(event(1)), event(1)), id="chunk extension"),
    pytest.param(chunk(event(1, usage={"prompt_tokens": 1})), id="usage"),
    pytest.param(chunk(event(1))[:-2] + b"XX", id="no CRLF after the data"),
    pytest.param(b" " + chunk(event(1)), id="space before the size"),
    pytest.param(b"123456789\r\n", id="size too long"),
    pytest.param(chunk(event(1)) + chunk(event(2))[:-1], id="second chunk partial"),
])
def test_other_reads_are_declined_without_side_effects(data):
    client, flow = Transport(), Flow()
    flow.write_paused = True
    r = relay_for(client, flow)
    assert r.feed(data) == _splice.SLOW
    assert client.written == [] and r.chunks == 0 and r.ttft is None and r.fast_reads == 0 and r.last_read == 0


def test_backpressure_closing_client_and_close():
    client, flow = Transport(), Flow()
    r = relay_for(client, flow)
    flow.write_paused = True
    assert r.feed(chunk(event(1))) == _splice.PAUSED and len(client.written) == 1
    client.closing = True  # the client left: nothing is written, the read still counts
    flow.write_paused = False
    assert r.feed(chunk(event(2))) == 0 and len(client.written) == 1 and r.chunks == 2
    r.close()
    assert r.feed(chunk(event(3))) == 0 and len(client.written) == 1  # closed: nowhere to write
    with pytest.raises(TypeError):
        r.feed(bytearray(chunk(event(4))))


def test_a_transport_that_raises_surfaces_the_error():
    class Broken(Transport):
        def write(self, data):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        relay_for(Broken()).feed(chunk(event(1)))


@given(st.lists(st.tuples(st.floats(0.0, 0.5), st.integers(0, 5)), min_size=1, max_size=60))
@settings(max_examples=200, deadline=None)
def test_tick_keeps_the_same_numbers_as_the_python_tally(steps):
    """Relay.tick and Tally.tick agree: TTFT, gaps, max gap, events, and every ITL bucket."""
    metrics_py, metrics_c = Metrics(), Metrics()
    hist_py = metrics_py.itl.labels("direct", "none")
    hist_c = metrics_c.itl.labels("direct", "none")
    tally = Tally()
    r = relay_for(bounds=hist_c._upper_bounds, t0=1.0)
    now = 1.0
    c_counts = [0] * len(hist_c._upper_bounds)
    c_sum = 0.0

    def take():
        nonlocal c_sum
        counts, total = r.take()
        for i, c in enumerate(counts):
            c_counts[i] += c
        c_sum += total
        return counts

    for dt, events in steps:
        now += dt
        tally.tick(now, 1.0, hist_py, events)
        if r.tick(events, now) & _splice.FLUSH:
            assert sum(take()) >= _splice.ITL_FLUSH
    assert r.pending == sum(take())
    tally.flush_itl()
    assert (r.ttft, r.chunks) == (tally.ttft, tally.chunks if tally.ttft is not None else 0)
    assert r.gaps == pytest.approx(tally.gaps) and r.max_gap == pytest.approx(tally.max_gap)
    assert c_counts == [b.get() for b in hist_py._buckets]
    assert c_sum == pytest.approx(hist_py._sum.get())


# -- through h1.Conn and relay.splice ----------------------------------------------------------


def engine_answer(texts: list[str], usage: str, done: bool) -> tuple[bytes, list[int]]:
    """An engine's chunked SSE answer, one HTTP chunk per event as vLLM (uvicorn) sends, and
    the offsets where its chunks end."""
    events = [event(i, t) for i, t in enumerate(texts)]
    if usage != "none":
        u = {"prompt_tokens": 7, "completion_tokens": len(texts), "prompt_tokens_details": None}
        events.append(event(len(texts), usage=u, choices=usage == "with-choices"))
    if done:
        events.append(b"data: [DONE]\n\n")
    ends, pos = [], len(HEAD)
    for e in events:
        pos += len(chunk(e))
        ends.append(pos)
    return HEAD + b"".join(chunk(e) for e in events) + b"0\r\n\r\n", ends


async def run_through_conn(answer: bytes, cuts: list[int], fast: bool):
    """Feed `answer` to a real h1.Conn in reads cut at `cuts`, relayed by splice; returns
    (client bytes, tally, ITL count in the histogram, the engine conn's paused count)."""
    loop = asyncio.get_running_loop()
    pool = h1.Pool()
    conn = h1.Conn(pool, ("127.0.0.1", 1, False))
    engine = Transport()
    conn.connection_made(engine)
    stream = h1.Stream(conn, "decode", loop)
    conn.stream = stream
    bounds = sorted({0, *cuts, len(answer)})
    reads = [answer[a:b] for a, b in zip(bounds, bounds[1:])]
    while reads and not stream._buf and not stream.done:
        conn.data_received(reads.pop(0))
    first = await stream.first(None)
    client, flow, metrics, done = Transport(), Flow(), Metrics(), []
    hist = metrics.itl.labels("direct", "none")
    tally = Tally()

    def write(data: bytes) -> None:
        client.write(b"%x\r\n%b\r\n" % (len(data), data))

    relays = []
    fast_relay = relay._fast_relay

    def spy(*a):
        relays.append(fast_relay(*a))
        return relays[-1]

    relay._fast_relay = spy
    try:
        task = asyncio.create_task(splice(Outcome(decode=None, body=first, stream=stream), job(), tally, hist,
                                          done.append, write, flow, client if fast else None))
        await asyncio.sleep(0)
    finally:
        relay._fast_relay = fast_relay
    for data in reads:
        if stream.done:
            break
        conn.data_received(data)
        await asyncio.sleep(0)
    if not stream.done:
        conn.connection_lost(None)  # the engine went away without ending the answer
    await asyncio.wait_for(task, 5)
    assert len(done) == 1
    if fast:
        FAST_READS.append(relays[0].fast_reads if relays else 0)
    itl_count = metrics.registry.get_sample_value("pd_router_inter_token_latency_seconds_count",
                                                  {"route": "direct", "mode": "none"}) or 0
    return b"".join(client.written), tally, itl_count, engine.paused


FAST_READS: list[int] = []


def test_the_c_relay_answers_exactly_as_the_python_path():
    FAST_READS.clear()
    same_answers()
    assert sum(FAST_READS) > 0  # the examples did go through the C relay


@given(texts=st.lists(st.text(min_size=0, max_size=40), min_size=1, max_size=25),
       usage=st.sampled_from(["none", "usage-only", "with-choices"]),
       done=st.booleans(), seed=st.integers(0, 2**32 - 1), n_cuts=st.integers(0, 40),
       at_chunk_ends=st.floats(0.0, 1.0))
@settings(max_examples=150, deadline=None)
def same_answers(texts, usage, done, seed, n_cuts, at_chunk_ends):
    """Reads end at some chunk ends (the C relay's reads) and anywhere else (its declines)."""
    answer, ends = engine_answer(texts, usage, done)
    rnd = random.Random(seed)
    cuts = [rnd.randrange(1, len(answer)) for _ in range(n_cuts)]
    cuts += [e for e in ends if rnd.random() < at_chunk_ends]

    async def both():
        return (await run_through_conn(answer, cuts, fast=False), await run_through_conn(answer, cuts, fast=True))

    (py_bytes, py_tally, py_itl, _), (c_bytes, c_tally, c_itl, _) = asyncio.run(both())
    assert b"".join(dechunk(c_bytes)) == b"".join(dechunk(py_bytes))
    assert (c_tally.chunks, c_tally.output_tokens, c_tally.outcome) == (py_tally.chunks, py_tally.output_tokens,
                                                                       py_tally.outcome)
    assert c_itl == py_itl == max(py_tally.chunks - 1, 0)
    assert py_tally.outcome == ("ok" if done else "upstream_error")
    assert py_tally.chunks == len(texts) + (usage == "with-choices")


async def test_the_fast_path_takes_whole_chunk_reads_and_pauses_the_engine_on_backpressure():
    """One read per event (the usual case): every read after the first is relayed by C, and a
    full client buffer pauses the engine's socket until the client drains."""
    texts = [f"w{i}" for i in range(100)]
    loop = asyncio.get_running_loop()
    conn = h1.Conn(h1.Pool(), ("127.0.0.1", 1, False))
    engine = Transport()
    conn.connection_made(engine)
    stream = h1.Stream(conn, "decode", loop)
    conn.stream = stream
    conn.data_received(HEAD + chunk(event(0, "w")))
    first = await stream.first(None)
    client, flow, metrics, done = Transport(), Flow(), Metrics(), []
    relays = []
    real = relay._fast_relay

    def spy(*a):
        relays.append(real(*a))
        return relays[-1]

    relay._fast_relay, saved = spy, relay._fast_relay
    try:
        task = asyncio.create_task(splice(Outcome(decode=None, body=first, stream=stream), job(), Tally(),
                                          metrics.itl.labels("direct", "none"), done.append, client.write, flow,
                                          client))
        await asyncio.sleep(0)
        for i, t in enumerate(texts[1:], 1):
            flow.write_paused = i == 50  # the client's buffer fills once
            conn.data_received(chunk(event(i, t)))
            if i == 50:
                assert engine.paused == 1
                await asyncio.sleep(0)  # the drain helper runs
                await asyncio.sleep(0)
        conn.data_received(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await asyncio.wait_for(task, 5)
    finally:
        relay._fast_relay = saved
    assert relays and relays[0].fast_reads == len(texts) - 1
    assert done[0].outcome == "ok" and done[0].chunks == len(texts)
    assert metrics.registry.get_sample_value("pd_router_inter_token_latency_seconds_count",
                                             {"route": "direct", "mode": "none"}) == len(texts) - 1
    assert stream.fast is None  # detached at the end


async def test_idle_timeout_sees_fast_reads():
    """Reads taken by C keep the stream's idle timer fed (no false idle timeout)."""
    loop = asyncio.get_running_loop()
    conn = h1.Conn(h1.Pool(), ("127.0.0.1", 1, False))
    conn.connection_made(Transport())
    stream = h1.Stream(conn, "decode", loop)
    conn.stream = stream
    conn.data_received(HEAD + chunk(event(0)))
    first = await stream.first(None)
    stream.set_limits(0.2, None)
    done = []
    task = asyncio.create_task(splice(Outcome(decode=None, body=first, stream=stream), job(), Tally(),
                                      Metrics().itl.labels("direct", "none"), done.append, lambda b: None, Flow(),
                                      Transport()))
    for i in range(8):  # 0.4 s of reads, 0.05 s apart: never idle for 0.2 s
        await asyncio.sleep(0.05)
        conn.data_received(chunk(event(i + 1)))
    conn.data_received(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await asyncio.wait_for(task, 5)
    assert done[0].outcome == "ok"

"""The fake vLLM engine over real sockets: shapes, streams, P/D legs, strict mode, faults,
recording, keep-alive and the CLI. Timing is only ever checked as a lower bound."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from launch.fake_engine import FakeEngine, Fault

REPO = Path(__file__).resolve().parents[2]
P_LEG = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}
PROMPT = "x" * 100  # 25 prompt tokens


@pytest.fixture
async def engine():
    async with FakeEngine(model="tiny", model_root="/models/tiny", engine_id="fake-p0",
                          kv_port=5601) as e:
        yield e


@pytest.fixture
async def client(engine):
    async with httpx.AsyncClient(base_url=engine.url, timeout=10) as c:
        yield c


def sse_events(text: str) -> list[str]:
    assert text.endswith("\n\n")
    events = text[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events), events
    return [e[len("data: "):] for e in events]


async def stream_text(client: httpx.AsyncClient, path: str, body: dict, **kw) -> str:
    async with client.stream("POST", path, json=body, **kw) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["transfer-encoding"] == "chunked"
        return (await r.aread()).decode()


async def test_models_health_metrics(client):
    r = await client.get("/v1/models")
    assert r.status_code == 200
    m = r.json()["data"][0]
    assert r.json()["object"] == "list"
    assert (m["id"], m["object"], m["root"], m["owned_by"], m["max_model_len"]) == (
        "tiny", "model", "/models/tiny", "vllm", 1024)
    r = await client.get("/health")
    assert (r.status_code, r.content) == (200, b"")
    r = await client.get("/metrics")
    assert 'vllm:prompt_tokens_by_source_total{model_name="tiny",engine="0",source="local_compute"} 0.0' in r.text
    assert "vllm:num_requests_running{" in r.text
    assert (await client.get("/nope")).status_code == 404


async def test_completion_shape(client):
    r = await client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3},
                          headers={"X-Request-Id": "req-1"})
    assert r.status_code == 200
    d = r.json()
    assert d["id"] == "cmpl-req-1" and d["object"] == "text_completion" and d["model"] == "tiny"
    (c,) = d["choices"]
    assert (c["index"], c["text"], c["finish_reason"], c["stop_reason"], c["logprobs"]) == (
        0, " t0 t1 t2", "length", None, None)
    assert d["usage"]["prompt_tokens"] == 25 and d["usage"]["completion_tokens"] == 3
    assert d["usage"]["total_tokens"] == 28
    assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert d["kv_transfer_params"] is None


async def test_chat_shape_and_max_completion_tokens(client):
    body = {"messages": [{"role": "system", "content": "abcd"}, {"role": "user", "content": "efgh"}],
            "max_completion_tokens": 2}
    d = (await client.post("/v1/chat/completions", json=body)).json()
    assert d["id"].startswith("chatcmpl-") and d["object"] == "chat.completion"
    (c,) = d["choices"]
    assert c["message"]["role"] == "assistant" and c["message"]["content"] == " t0 t1"
    assert c["finish_reason"] == "length"
    assert d["usage"]["prompt_tokens"] == 2 and d["usage"]["completion_tokens"] == 2


async def test_default_max_tokens_and_errors(client):
    d = (await client.post("/v1/completions", json={"prompt": "hi"})).json()
    assert d["usage"]["completion_tokens"] == 16
    r = await client.post("/v1/completions", json={"model": "other", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = await client.post("/v1/completions", content=b"{not json")
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = await client.post("/v1/completions", json={"prompt": "hi", "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    r = await client.post("/v1/completions", json={"prompt": "x" * 4000, "max_tokens": 100})
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]


async def test_completion_stream_format(client):
    text = await stream_text(client, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
        headers={"X-Request-Id": "s1"})
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["id"] == "cmpl-s1" and c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["text"] for c in chunks[:4]] == [" t0", " t1", " t2", " t3"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:4]] == [None, None, None, "length"]
    assert chunks[4]["choices"] == [] and chunks[4]["usage"]["completion_tokens"] == 4
    assert chunks[4]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert len(chunks) == 5


async def test_chat_stream_format_without_usage(client):
    text = await stream_text(client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, "stream": True})
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"] for c in chunks[1:]] == [{"content": " t0"}, {"content": " t1"}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c for c in chunks)


async def test_pull_prefill_then_decode(engine, client):
    r = await client.post("/v1/completions", headers={"X-Request-Id": "pd-1"}, json={
        "prompt": PROMPT, "max_tokens": 1, "stream": False, "kv_transfer_params": P_LEG})
    d = r.json()
    kv = d["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_engine_id"] == "fake-p0" and kv["remote_port"] == 5601
    assert kv["remote_request_id"].startswith("cmpl-pd-1-0-") and len(kv["remote_request_id"]) == len("cmpl-pd-1-0-") + 8
    assert kv["remote_block_ids"] == [[0, 1]] and kv["remote_num_tokens"] == 25
    assert kv["transfer_mode"] == "pull" and kv["tp_size"] == kv["pp_size"] == kv["dcp_size"] == 1
    assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    r = await client.post("/v1/completions", headers={"X-Request-Id": "pd-1"}, json={
        "prompt": PROMPT, "max_tokens": 5, "kv_transfer_params": kv})
    d = r.json()
    assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == 25
    assert d["usage"]["completion_tokens"] == 5
    assert [q.leg for q in engine.requests] == ["prefill", "decode"]
    m = (await client.get("/metrics")).text
    assert 'source="local_compute"} 25.0' in m and 'source="external_kv_transfer"} 25.0' in m


async def test_strict_accepts_correct_legs():
    ledger: dict = {}
    async with FakeEngine(role="prefill", strict=True, ledger=ledger) as p, \
            FakeEngine(role="decode", strict=True, ledger=ledger) as d, httpx.AsyncClient() as c:
        r = await c.post(p.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1, "stream": False,
            "kv_transfer_params": P_LEG})
        assert r.status_code == 200, r.text
        kv = r.json()["kv_transfer_params"]
        assert kv["remote_request_id"].startswith("chatcmpl-")
        r = await c.post(d.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3, "kv_transfer_params": kv})
        assert r.status_code == 200, r.text
        push = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0",
                "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1, "pp_size": 1,
                "remote_request_id": "anything"}
        r = await c.post(d.url + "/v1/completions", json={"prompt": PROMPT, "kv_transfer_params": push})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("change, param", [
    ({"kv_transfer_params": {**P_LEG, "remote_host": "x"}}, "kv_transfer_params"),
    ({"kv_transfer_params": {k: v for k, v in P_LEG.items() if k != "remote_port"}}, "kv_transfer_params"),
    ({"stream": True}, "stream"),
    ({"max_tokens": 2}, "max_tokens"),
    ({"min_tokens": 1}, "min_tokens"),
])
async def test_strict_rejects_bad_prefill_leg(change, param):
    body = {"prompt": PROMPT, "max_tokens": 1, "stream": False, "kv_transfer_params": P_LEG, **change}
    async with FakeEngine(strict=True) as e, httpx.AsyncClient() as c:
        r = await c.post(e.url + "/v1/completions", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == 400


async def test_strict_rejects_bad_decode_legs():
    ledger: dict = {}
    async with FakeEngine(strict=True, ledger=ledger) as e, httpx.AsyncClient() as c:
        kv = (await c.post(e.url + "/v1/completions", json={
            "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": P_LEG})).json()["kv_transfer_params"]
        bad = {k: v for k, v in kv.items() if k != "remote_num_tokens"}
        r = await c.post(e.url + "/v1/completions", json={"prompt": PROMPT, "kv_transfer_params": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params.remote_num_tokens"
        rewritten = {**kv, "remote_host": "10.9.9.9"}
        r = await c.post(e.url + "/v1/completions", json={"prompt": PROMPT, "kv_transfer_params": rewritten})
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
        push = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_host": "h",
                "remote_port": 1, "tp_size": 1, "pp_size": 1}
        r = await c.post(e.url + "/v1/completions", json={"prompt": PROMPT, "kv_transfer_params": push})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "kv_transfer_params.remote_request_id"


async def test_timing_lower_bounds():
    async with FakeEngine(prefill_s_per_char=1e-4, itl_s=0.02) as e, httpx.AsyncClient() as c:
        t0 = time.monotonic()
        async with c.stream("POST", e.url + "/v1/completions",
                            json={"prompt": "x" * 1000, "max_tokens": 5, "stream": True}) as r:
            it = r.aiter_lines()
            first = await anext(it)
            ttft = time.monotonic() - t0
            assert first.startswith("data: ")
            async for _ in it:
                pass
        total = time.monotonic() - t0
        assert ttft >= 0.1  # 1000 chars * 100 us
        assert total >= 0.1 + 4 * 0.02
        t0 = time.monotonic()
        await c.post(e.url + "/v1/completions", json={"prompt": "x" * 1000, "max_tokens": 5})
        assert time.monotonic() - t0 >= 0.1 + 4 * 0.02
        # a push decode leg (no block ids) cannot start before P's prefill would be done
        t0 = time.monotonic()
        r = await c.post(e.url + "/v1/completions", json={"prompt": "x" * 1000, "max_tokens": 1,
                         "kv_transfer_params": {"do_remote_prefill": True}})
        assert r.status_code == 200 and time.monotonic() - t0 >= 0.1


async def test_fault_status_count_and_legs(engine, client):
    engine.fault = Fault(status=503, count=1)
    r = await client.post("/v1/completions", json={"prompt": "a"})
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    assert engine.fault is None
    assert (await client.post("/v1/completions", json={"prompt": "a"})).status_code == 200
    engine.fault = Fault(status=500, legs={"decode"})
    assert (await client.post("/v1/completions", json={"prompt": "a"})).status_code == 200
    r = await client.post("/v1/completions", json={"prompt": "a", "kv_transfer_params": {"do_remote_prefill": True}})
    assert r.status_code == 500
    assert (await client.get("/health")).status_code == 200  # default paths: completions only
    engine.fault = Fault(status=503, paths={"*"})
    assert (await client.get("/health")).status_code == 503
    assert [q.status for q in engine.requests] == [503, 200, 200, 500, 200, 503]


async def test_fault_delay(engine, client):
    engine.fault = Fault(delay_s=0.2)
    t0 = time.monotonic()
    assert (await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1})).status_code == 200
    assert time.monotonic() - t0 >= 0.2


async def test_fault_hang_records_disconnect(engine):
    engine.fault = Fault(hang=True)
    async with httpx.AsyncClient(timeout=0.3) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post(engine.url + "/v1/completions", json={"prompt": "a"})
    rec = await engine.wait_for(lambda r: r.t_end is not None, timeout=5)
    assert rec.disconnected and rec.status is None


async def test_fault_drop_before_headers(engine, client):
    engine.fault = Fault(drop_before_headers=True, count=1)
    with pytest.raises(httpx.RemoteProtocolError):
        await client.post("/v1/completions", json={"prompt": "a"})
    assert (await client.post("/v1/completions", json={"prompt": "a"})).status_code == 200


async def test_fault_drop_after_chunks(engine, client):
    engine.fault = Fault(drop_after_chunks=2)
    got = []
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        async with client.stream("POST", "/v1/completions",
                                 json={"prompt": "a", "max_tokens": 10, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line:
                    got.append(line)
    assert len(got) == 2 and "[DONE]" not in "".join(got)
    with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
        await client.post("/v1/completions", json={"prompt": "a"})


async def test_fault_garbage(engine, client):
    engine.fault = Fault(garbage=True)
    r = await client.post("/v1/completions", json={"prompt": "a"})
    assert r.status_code == 200
    with pytest.raises(ValueError):
        r.json()
    text = await stream_text(client, "/v1/completions", {"prompt": "a", "stream": True})
    bad = [e for e in text.split("\n\n") if e.startswith("data: ") and e != "data: [DONE]"]
    assert bad
    for e in bad:
        with pytest.raises(ValueError):
            json.loads(e[len("data: "):])


async def test_recording_and_client_disconnect(engine):
    engine.itl_s = 0.05
    async with httpx.AsyncClient(base_url=engine.url) as c:
        r = await c.post("/v1/completions", content=b"raw!", headers={"X-Custom": "Yes"})
        assert r.status_code == 400
        async with c.stream("POST", "/v1/completions", json={"prompt": "a", "max_tokens": 100, "stream": True}) as r:
            async for _ in r.aiter_lines():
                break  # close the stream after the first event
    rec0 = engine.requests[0]
    assert rec0.method == "POST" and rec0.path == "/v1/completions"
    assert rec0.headers["x-custom"] == "Yes" and rec0.body == b"raw!" and rec0.status == 400
    rec1 = await engine.wait_for(lambda r: r.body != b"raw!" and r.t_end is not None, timeout=5)
    assert rec1.disconnected and rec1.body == {"prompt": "a", "max_tokens": 100, "stream": True}
    assert rec1.t_end >= rec1.t_start
    with pytest.raises(TimeoutError):
        await engine.wait_for(lambda r: r.path == "/never", timeout=0.05)


async def test_keep_alive_and_pipelining(engine):
    reader, writer = await asyncio.open_connection("127.0.0.1", engine.port)
    body = b'{"prompt":"abcd","max_tokens":2}'
    req = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           b"content-length: %d\r\n\r\n%s" % (len(body), body))
    async def read_response() -> dict:
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        return json.loads(await reader.readexactly(length))
    for _ in range(30):
        writer.write(req)
        assert (await read_response())["choices"][0]["text"] == " t0 t1"
    writer.write(req * 3)  # pipelined: answered in order on the same connection
    for _ in range(3):
        assert (await read_response())["usage"]["completion_tokens"] == 2
    writer.close()
    await writer.wait_closed()
    async with httpx.AsyncClient(base_url=engine.url) as c:
        for _ in range(20):
            async with c.stream("POST", "/v1/completions", json={"prompt": "a", "max_tokens": 3, "stream": True}) as r:
                await r.aread()
    assert engine.connections_accepted == 2
    assert len(engine.requests) == 53


def test_cli_two_engines_one_process():
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.fake_engine", "--ports", "0,0", "--engine-id", "a,b",
         "--itl-ms", "1"], cwd=REPO, stdout=subprocess.PIPE, text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY "), line
        urls = line.split()[1:]
        assert len(urls) == 2
        for url, eid in zip(urls, ("a", "b")):
            r = httpx.post(url + "/v1/completions", json={
                "prompt": "hello", "max_tokens": 1, "kv_transfer_params": P_LEG})
            assert r.json()["kv_transfer_params"]["remote_engine_id"] == eid
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


async def test_a_stream_head_goes_out_before_the_prefill_wait():
    """Like vLLM's StreamingResponse: status and headers at once, the first token after prefill."""
    async with FakeEngine(model="tiny", ttft_extra_s=30.0) as e:
        async with httpx.AsyncClient(base_url=e.url, timeout=10) as c:
            async with c.stream("POST", "/v1/completions",
                                json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "stream": True}) as r:
                assert r.status_code == 200  # returned within 10 s although the first token is 30 s away
                assert r.headers["content-type"].startswith("text/event-stream")

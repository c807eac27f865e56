"""Faults, overload, disconnects and security: every request ends, with the right outcome."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from launch.fake_engine import Fault
from tests.unit.routerkit import LONG, SHORT, completion_legs, sse_events, topology


def quiet(app) -> None:
    st = app.state.pdr
    assert st.in_flight == 0
    assert all(i.in_flight == 0 for i in st.registry), [(i.url, i.in_flight) for i in st.registry]


async def _leg(engine, timeout=5.0):
    return await engine.wait_for(lambda q: q.method == "POST" and q.t_end is not None, timeout=timeout)


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("stream", [False, True])
async def test_client_disconnect_during_prefill_closes_legs(tiny_model_path, mode, stream):
    async with topology(tiny_model_path, mode=mode, p_kw={"ttft_extra_s": 5.0},
                        d_kw={"kv_transfer_s": 5.0}) as (c, url, ps, ds, app):
        req = asyncio.create_task(c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 3,
                                                                  "stream": stream}))
        await ps[0].wait_for(lambda q: q.method == "POST", timeout=5)
        await asyncio.sleep(0.1)
        req.cancel()  # the client goes away
        with pytest.raises(asyncio.CancelledError):
            await req
        p_leg = await _leg(ps[0])
        assert p_leg.disconnected
        if mode == "push":
            assert (await _leg(ds[0])).disconnected
        else:
            assert completion_legs(ds[0]) == []  # never sent...
            m = (await c.get("/metrics")).text
            assert "pd_router_requests_total" in m
        await asyncio.sleep(0.05)
        quiet(app)


async def test_client_disconnect_mid_stream_closes_decode(tiny_model_path):
    async with topology(tiny_model_path, engine_kw={"itl_s": 0.05}) as (c, url, ps, ds, app):
        async with c.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 200,
                                                             "stream": True}) as r:
            async for _ in r.aiter_bytes():
                break  # read one chunk, then hang up
        d_leg = await _leg(ds[0])
        assert d_leg.disconnected
        await asyncio.sleep(0.05)
        quiet(app)


async def test_breaker_opens_and_traffic_moves(tiny_model_path):
    async with topology(tiny_model_path, n_decode=2, breaker_failures=2, breaker_cooldown=0.5,
                        decode_retries=0) as (c, url, ps, ds, app):
        ds[0].fault = Fault(status=500)
        statuses = [(await c.post("/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 1})).status_code
                    for _ in range(8)]
        assert statuses.count(502) == 2  # two failures open the circuit; the rest go to the healthy one
        view = {i["url"]: i for i in (await c.get("/instances")).json()}
        assert view[ds[0].url]["circuit"] == "open"
        assert view[ds[1].url]["circuit"] == "closed"
        m = (await c.get("/metrics")).text
        assert f'pd_router_circuit_open{{engine="{ds[0].url}",role="decode"}} 1.0' in m
        ds[0].fault = None
        await asyncio.sleep(0.6)  # cool-down: half-open, one probe closes it again
        for _ in range(4):
            assert (await c.post("/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 1})).status_code == 200
        view = {i["url"]: i for i in (await c.get("/instances")).json()}
        assert view[ds[0].url]["circuit"] == "closed"


async def test_decode_retry_before_first_byte(tiny_model_path):
    async with topology(tiny_model_path, n_decode=2, decode_retries=1) as (c, url, ps, ds, app):
        ds[0].fault = Fault(drop_before_headers=True)
        for prompt in (SHORT, LONG, SHORT, LONG):
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": True})
            assert r.status_code == 200 and sse_events(r.text)[-1] == "[DONE]"
        # disaggregated retries re-ran the prefill: P saw one leg per attempt
        assert len(completion_legs(ps[0])) >= 2


async def test_max_inflight_sheds_with_retry_after(tiny_model_path):
    async with topology(tiny_model_path, max_inflight=2, engine_kw={"ttft_extra_s": 0.5}) as (c, url, ps, ds, app):
        reqs = [c.post("/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 1}) for _ in range(6)]
        rs = await asyncio.gather(*reqs)
        codes = sorted(r.status_code for r in rs)
        assert codes.count(200) >= 2 and 429 in codes
        shed = next(r for r in rs if r.status_code == 429)
        assert shed.headers["retry-after"].isdigit()
        assert shed.json()["error"]["type"] == "rate_limit_error"
        quiet(app)


async def test_body_limit(tiny_model_path):
    async with topology(tiny_model_path, max_body_bytes=1000) as (c, url, ps, ds, app):
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 2000})
        assert r.status_code == 413 and r.json()["error"]["message"]


async def test_api_key_and_authorization_not_forwarded(tiny_model_path):
    async with topology(tiny_model_path, api_key="sekret", decode_api_key="engine-d") as (c, url, ps, ds, app):
        body = {"model": "tiny", "prompt": LONG, "max_tokens": 1}
        assert (await c.post("/v1/completions", json=body)).status_code == 401
        assert (await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})).status_code == 401
        r = await c.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200
        [p_leg] = completion_legs(ps[0])
        [d_leg] = completion_legs(ds[0])
        assert "authorization" not in p_leg.headers  # the client's key never reaches engines
        assert d_leg.headers["authorization"] == "Bearer engine-d"


@pytest.mark.parametrize("where", ["prefill", "decode_first_byte", "decode_idle", "whole"])
async def test_timeouts_end_requests(tiny_model_path, where):
    kw = {"prefill": {"prefill_timeout": 0.5}, "decode_first_byte": {"first_byte_timeout": 0.5},
          "decode_idle": {"idle_timeout": 0.3}, "whole": {"request_timeout": 0.8}}[where]
    async with topology(tiny_model_path, engine_kw={"itl_s": 0.05}, **kw) as (c, url, ps, ds, app):
        if where == "prefill":
            ps[0].fault = Fault(hang=True)
        elif where == "decode_first_byte":
            ds[0].fault = Fault(hang=True)
        elif where == "decode_idle":
            ds[0].fault = Fault(delay_s=0.0, drop_after_chunks=None)
            ds[0].itl_s = 1.0  # chunks 1 s apart > idle timeout
        t = time.monotonic()
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 100, "stream": True})
        assert time.monotonic() - t < 10
        if where in ("prefill", "decode_first_byte"):
            assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        else:
            assert r.status_code == 200
            events = sse_events(r.text)
            assert "error" in events[-2] and events[-1] == "[DONE]"
        await asyncio.sleep(0.1)
        quiet(app)


async def test_no_task_or_connection_leaks(tiny_model_path):
    async with topology(tiny_model_path, n_decode=2, engine_kw={"itl_s": 0.001}) as (c, url, ps, ds, app):
        ds[1].fault = Fault(drop_after_chunks=2)
        base = len(asyncio.all_tasks())
        for round_ in range(3):
            await asyncio.gather(*(c.post("/v1/completions", json={"model": "tiny", "prompt": LONG if i % 2 else SHORT,
                                                                    "max_tokens": 5, "stream": bool(i % 3)})
                                   for i in range(30)), return_exceptions=True)
        await asyncio.sleep(0.2)
        assert len(asyncio.all_tasks()) <= base + 2
        quiet(app)
        # keep-alive pooling: far fewer upstream connections than requests
        assert ds[0].connections_accepted + ds[1].connections_accepted < 90


async def test_graceful_shutdown_drains_in_flight(tiny_model_path, tmp_path):
    """SIGTERM: the listener closes, a stream in flight still finishes, then the process exits."""
    import os
    import signal
    import subprocess
    import sys

    from launch.fake_engine import FakeEngine
    from tests.conftest import free_port

    async with FakeEngine(itl_s=0.05) as d:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--port", str(port), "--decode", d.url,
                                 "--tokenizer", str(tiny_model_path), "--shutdown-grace", "20"],
                                stdout=open(tmp_path / "router.log", "wb"), stderr=subprocess.STDOUT,
                                start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                for _ in range(300):
                    try:
                        if (await c.get("/health")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await asyncio.sleep(0.1)
                async with c.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 40,
                                                                     "stream": True}) as r:
                    it = r.aiter_text()
                    first = await it.__anext__()
                    os.kill(proc.pid, signal.SIGTERM)  # mid-stream
                    rest = "".join([t async for t in it])
                events = sse_events(first + rest)
                assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1] if isinstance(e, dict))
                assert "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices")).count(" t") == 40
            # uvicorn re-raises the SIGTERM after a clean drain: exit status -15 (143 in a shell), as k8s expects
            assert await asyncio.get_running_loop().run_in_executor(None, proc.wait, 20) in (0, -signal.SIGTERM)
            with pytest.raises(httpx.ConnectError):
                async with httpx.AsyncClient() as c2:
                    await c2.get(url + "/health")
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

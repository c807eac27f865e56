"""Push mode (PROTOCOLS.md section 3): concurrent legs, many prefills, failure coupling."""

from __future__ import annotations

import asyncio
import time

import pytest

from launch.fake_engine import Fault
from router.settings import InstanceSpec, Settings
from tests.unit.routerkit import LONG, SHORT, completion_legs, sse_events, topology

SLOW_P = {"prefill_s_per_char": 0.0008}  # ~0.4 s of "prefill" for LONG


async def test_push_legs_are_concurrent_and_name_the_chosen_prefill(tiny_model_path):
    async with topology(tiny_model_path, n_prefill=2, mode="push", p_kw=SLOW_P) as (c, url, ps, ds, app):
        for i in range(4):
            stream = bool(i % 2)
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 3,
                                                      "stream": stream}, headers={"X-Request-Id": f"push-{i}"})
            assert r.status_code == 200, r.text
        d_legs = completion_legs(ds[0])
        assert len(d_legs) == 4
        for p in ps:  # both prefill instances used
            assert len(completion_legs(p)) == 2
        for d_leg in d_legs:
            rid = d_leg.headers["x-request-id"]
            [p_leg] = [leg for p in ps for leg in completion_legs(p) if leg.headers["x-request-id"] == rid]
            p_engine = next(p for p in ps if p_leg in p.requests)
            kv = d_leg.body["kv_transfer_params"]
            assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
            assert kv["remote_engine_id"] == p_engine.engine_id
            assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == p_engine.kv_port
            assert kv["tp_size"] == 1 and kv["pp_size"] == 1
            assert kv["remote_request_id"] == rid
            assert "remote_block_ids" not in kv
            assert kv["transfer_id"] == p_leg.body["kv_transfer_params"]["transfer_id"]
            assert kv["transfer_id"].startswith("xfer-")
            assert p_leg.body["max_tokens"] == 1 and p_leg.body["stream"] is False
            assert p_leg.path == d_leg.path
            # concurrency: the decode leg reached D before the prefill leg finished
            assert d_leg.t_start < p_leg.t_end


async def test_push_chat_stream_tokens(tiny_model_path):
    async with topology(tiny_model_path, mode="push") as (c, url, ps, ds, app):
        r = await c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": LONG}],
                                                       "max_tokens": 4, "stream": True})
        events = sse_events(r.text)
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]) == " t0 t1 t2 t3"


@pytest.mark.parametrize("fault", [Fault(status=500, message="prefill crashed"), Fault(drop_before_headers=True)])
@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_failure_closes_decode_leg(tiny_model_path, fault, stream):
    p_kw = {"prefill_s_per_char": 0.0}
    async with topology(tiny_model_path, mode="push", p_kw=p_kw, d_kw={"kv_transfer_s": 30.0}) as (c, url, ps, ds, app):
        ps[0].fault = Fault(**{**fault.__dict__, "delay_s": 0.3})  # fail after D has started waiting
        t = time.monotonic()
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 3, "stream": stream})
        elapsed = time.monotonic() - t
        assert r.status_code == 502, r.text
        assert r.json()["error"]["message"]
        assert elapsed < 10  # never D's push watchdog
        d_leg = await ds[0].wait_for(lambda q: q.path == "/v1/completions" and q.t_end is not None, timeout=5)
        assert d_leg.disconnected, "the decode leg must be closed so vLLM aborts it"
        assert app.state.pdr.in_flight == 0
        assert all(i.in_flight == 0 for i in app.state.pdr.registry)


async def test_decode_failure_cancels_prefill(tiny_model_path):
    async with topology(tiny_model_path, mode="push", p_kw={"prefill_s_per_char": 0.01}) as (c, url, ps, ds, app):
        ds[0].fault = Fault(status=500, message="decode crashed", delay_s=0.2)
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 3})
        assert r.status_code == 502
        assert "decode crashed" in r.json()["error"]["message"]
        p_leg = await ps[0].wait_for(lambda q: q.path == "/v1/completions" and q.t_end is not None, timeout=5)
        assert p_leg.disconnected, "the prefill leg must not be left running unobserved"


async def test_decode_silent_after_prefill_is_bounded(tiny_model_path):
    """Identical-prompt hang seen upstream: P answers, D never starts. The router gives up in bounded time."""
    async with topology(tiny_model_path, mode="push", push_decode_grace=1.0) as (c, url, ps, ds, app):
        ds[0].fault = Fault(hang=True)
        t = time.monotonic()
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 3, "stream": True})
        assert r.status_code == 504
        assert time.monotonic() - t < 10
        d_leg = await ds[0].wait_for(lambda q: q.t_end is not None and q.path == "/v1/completions", timeout=5)
        assert d_leg.disconnected


async def test_prefill_retry_on_another_instance(tiny_model_path):
    async with topology(tiny_model_path, n_prefill=2, mode="push", on_prefill_failure="retry") as (c, url, ps, ds, app):
        ps[0].fault = Fault(status=503)
        for _ in range(3):
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 2})
            assert r.status_code == 200, r.text
        assert len(completion_legs(ps[1])) >= 3


async def test_prefill_fallback_runs_decode_only(tiny_model_path):
    for mode in ("pull", "push"):
        async with topology(tiny_model_path, mode=mode, on_prefill_failure="fallback") as (c, url, ps, ds, app):
            ps[0].fault = Fault(status=500)
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 2})
            assert r.status_code == 200, r.text
            last = completion_legs(ds[0])[-1]
            assert "kv_transfer_params" not in last.body  # D computed the prompt itself
            m = (await c.get("/metrics")).text
            assert "pd_router_prefill_fallbacks_total 1.0" in m


def test_push_requires_prefill_coordinates():
    with pytest.raises(ValueError, match="engine_id"):
        Settings(mode="push", prefill=(InstanceSpec.parse("http://127.0.0.1:8100"),))
    spec = InstanceSpec.parse("http://10.0.0.1:8100?engine_id=prefill-0&kv_host=10.0.0.1&kv_port=5600&tp=2&pp=1")
    assert (spec.url, spec.engine_id, spec.kv_host, spec.kv_port, spec.tp, spec.pp) == (
        "http://10.0.0.1:8100", "prefill-0", "10.0.0.1", 5600, 2, 1)
    Settings(mode="push", prefill=(spec,))
    with pytest.raises(ValueError, match="unknown instance option"):
        InstanceSpec.parse("http://10.0.0.1:8100?engine=prefill-0")


async def test_short_prompts_in_push_mode_go_direct(tiny_model_path):
    async with topology(tiny_model_path, mode="push") as (c, url, ps, ds, app):
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 2})
        assert r.status_code == 200
        assert completion_legs(ps[0]) == []
        await asyncio.sleep(0)


async def test_a_prefill_leg_cancelled_before_its_task_ran_has_its_connection_closed():
    """push sends P in the caller's step (`start_prefill`); if the pair is abandoned before the
    prefill task's first step, nothing else would close that connection: `_stop` does."""
    from router.dispatch.push import _stop
    from router.upstream import Upstream

    served = asyncio.Event()
    closed = asyncio.Event()

    async def serve(reader, writer):
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            n = int(next(v for k, v in (ln.split(b":", 1) for ln in head.split(b"\r\n")[1:] if b":" in ln)
                         if k.strip().lower() == b"content-length"))
            await reader.readexactly(n)
            if served.is_set():  # the started request: never answered; wait for the router to hang up
                if not await reader.read():
                    closed.set()
                return
            served.set()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions"
    up = Upstream()
    try:
        await up.post(url, b"{}", {}, timeout=5, stage="prefill")  # leaves an idle connection
        started = up.start(url, b"{}", {}, stage="prefill")
        assert started is not None
        task = asyncio.create_task(asyncio.sleep(30))  # stands for the prefill task: never ran
        await _stop(task, started)
        assert task.cancelled()
        await asyncio.wait_for(closed.wait(), 5)
    finally:
        await up.aclose()
        server.close()

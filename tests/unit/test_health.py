"""Health probes (router/health.py): static instances leave rotation while down and come back;
a registered instance that still pings but fails /health stays out of rotation."""

from __future__ import annotations

import contextlib

import httpx

from launch.fake_engine import FakeEngine, Fault
from router.settings import InstanceSpec, Settings
from tests.conftest import free_port, run_router
from tests.unit.pingkit import Heart, payload, ping_endpoint, until
from tests.unit.routerkit import LONG, completion_legs
from tests.unit.test_discovery import complete, instances


async def _healthy(c, url) -> bool | None:
    for i in await instances(c):
        if i["url"] == url:
            return i["healthy"]
    return None


async def _is(coro, value) -> bool:
    return (await coro) is value


async def test_static_instance_leaves_rotation_while_down_and_comes_back(tiny_model_path):
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(FakeEngine(role="prefill"))
        d0 = await stack.enter_async_context(FakeEngine(role="decode"))
        d1 = await stack.enter_async_context(FakeEngine(role="decode"))
        s = Settings(tokenizer=str(tiny_model_path), threshold=16, health_interval=0.1,
                     prefill=(InstanceSpec.parse(p.url),), decode=(InstanceSpec.parse(d0.url), InstanceSpec.parse(d1.url)))
        url, app = await stack.enter_async_context(run_router(s))
        c = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=120))
        insts = await instances(c)
        assert {i["model"] for i in insts} == {"tiny"}  # learnt from /v1/models at startup
        d0.fault = Fault(status=503, paths={"/health"})
        await until(lambda: _is(_healthy(c, d0.url), False), what="d0 out of rotation")
        n0 = len(completion_legs(d0))
        for _ in range(4):
            assert (await complete(c)).status_code == 200
        assert len(completion_legs(d0)) == n0 and len(completion_legs(d1)) >= 4
        d0.fault = None
        await until(lambda: _is(_healthy(c, d0.url), True), what="d0 back")
        for _ in range(4):
            assert (await complete(c)).status_code == 200
        assert len(completion_legs(d0)) > n0


async def test_static_instance_that_is_gone_is_unhealthy_not_removed(tiny_model_path):
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(FakeEngine(role="prefill"))
        d = FakeEngine(role="decode")
        await d.start()
        d_url = d.url
        s = Settings(tokenizer=str(tiny_model_path), threshold=16, health_interval=0.1,
                     prefill=(InstanceSpec.parse(p.url),), decode=(InstanceSpec.parse(d_url),))
        url, app = await stack.enter_async_context(run_router(s))
        c = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=120))
        await d.close()
        await until(lambda: _is(_healthy(c, d_url), False), what="closed engine marked down")
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 503


async def test_registered_instance_failing_health_stays_out_while_it_pings(tiny_model_path):
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(FakeEngine(role="prefill"))
        d = await stack.enter_async_context(FakeEngine(role="decode"))
        s = Settings(tokenizer=str(tiny_model_path), threshold=16, health_interval=0.1, ping_port=free_port(),
                     heartbeat_timeout=5.0)
        url, app = await stack.enter_async_context(run_router(s))
        c = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=120))
        ep = ping_endpoint(app)
        hp = await stack.enter_async_context(Heart(ep, payload("pd-router", "prefill", p)))
        hd = await stack.enter_async_context(Heart(ep, payload("pd-router", "decode", d)))
        await until(lambda: _is(_healthy(c, d.url), True))
        d.fault = Fault(status=500, paths={"/health"})
        await until(lambda: _is(_healthy(c, d.url), False), what="d marked down")
        sent = hd.sent
        await until(lambda: hd.sent >= sent + 5, what="five more heartbeats")
        assert await _healthy(c, d.url) is False  # pings do not override the probe
        assert (await complete(c)).status_code == 503
        d.fault = None
        await until(lambda: _is(_healthy(c, d.url), True), what="d back")
        assert (await complete(c)).status_code == 200
        assert hp.sent > 0

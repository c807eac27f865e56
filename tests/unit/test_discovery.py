"""Registration over a real ZMQ ping port: every payload format registers and gets traffic,
silent instances expire, bad pings are dropped and counted (PROTOCOLS.md section 5)."""

from __future__ import annotations

import contextlib
import logging

import httpx
import pytest

from launch.fake_engine import FakeEngine, Fault
from router.settings import InstanceSpec, Settings
from tests.conftest import free_port, run_router
from tests.unit.pingkit import FORMATS, Heart, dealer, metric, pack, payload, ping_endpoint, until
from tests.unit.routerkit import LONG, completion_legs, sse_events


@contextlib.asynccontextmanager
async def registered_router(tokenizer=None, n_prefill=1, n_decode=1, engine_kw=None, **settings):
    """Strict fake P/D engines and a router that knows them only through its ping port.
    Yields (client, app, prefills, decodes); nothing is registered yet."""
    ledger: dict = {}
    kw = engine_kw or {}
    ps = [FakeEngine(role="prefill", engine_id=f"prefill-{i}", kv_port=5600 + i, strict=True, ledger=ledger, **kw)
          for i in range(n_prefill)]
    ds = [FakeEngine(role="decode", engine_id=f"decode-{i}", strict=True, ledger=ledger, **kw)
          for i in range(n_decode)]
    async with contextlib.AsyncExitStack() as stack:
        for e in (*ps, *ds):
            await stack.enter_async_context(e)
        s = Settings(tokenizer=str(tokenizer) if tokenizer else None,
                     **{"threshold": 16, "health_interval": 30.0, "ping_port": free_port(), **settings})
        url, app = await stack.enter_async_context(run_router(s))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=120))
        yield client, app, ps, ds


async def instances(c: httpx.AsyncClient) -> list[dict]:
    r = await c.get("/instances")
    assert r.status_code == 200
    return r.json()


async def urls(c, role=None) -> set[str]:
    return {i["url"] for i in await instances(c) if role is None or i["role"] == role}


async def rejected(c, reason: str) -> float:
    return metric((await c.get("/metrics")).text, "pd_router_rejected_pings_total", reason=reason)


async def complete(c, **kw):
    body = {"model": "tiny", "prompt": LONG, "max_tokens": 3, **kw}
    return await c.post("/v1/completions", json=body)


@pytest.mark.parametrize("fmt", FORMATS)
async def test_each_format_registers_and_gets_traffic(tiny_model_path, fmt):
    async with registered_router(tiny_model_path) as (c, app, [p], [d]):
        assert await instances(c) == []
        r = await complete(c)
        assert r.status_code == 503, r.text  # nothing registered yet: a clean error, not a crash
        ep = ping_endpoint(app)
        async with Heart(ep, payload(fmt, "prefill", p)), Heart(ep, payload(fmt, "decode", d)):
            await until(lambda: urls(c), what="both registered")
            await until(lambda: _roles(c), what="both roles")
            insts = {i["role"]: i for i in await instances(c)}
            assert insts["prefill"]["url"] == p.url and insts["decode"]["url"] == d.url
            for i in insts.values():
                assert i["source"] == "registered" and i["healthy"] is True and i["in_flight"] == 0
                assert isinstance(i["last_seen"], float) and i["model"] in (None, "tiny")
            if fmt.startswith("moriio"):
                assert insts["prefill"]["zmq_address"] == "host:127.0.0.1,handshake:6301,notify:61005"
                assert insts["prefill"]["transfer_mode"] == "pull"
            r = await complete(c)
            assert r.status_code == 200, r.text
            assert len(completion_legs(p)) == 1 and len(completion_legs(d)) == 1
            text = (await c.get("/metrics")).text
            assert metric(text, "pd_router_registrations_total", role="prefill", format=fmt) == 1.0
            assert metric(text, "pd_router_registrations_total", role="decode", format=fmt) == 1.0


async def _roles(c) -> bool:
    return {i["role"] for i in await instances(c)} == {"prefill", "decode"}


async def test_push_mode_gets_prefill_coordinates_from_registration(tiny_model_path):
    async with registered_router(tiny_model_path, mode="push") as (c, app, [p], [d]):
        ep = ping_endpoint(app)
        async with Heart(ep, payload("pd-router", "prefill", p, transfer_mode="push", connector="NixlPushConnector")), \
                Heart(ep, payload("pd-router", "decode", d, transfer_mode="push")):
            await until(lambda: _roles(c), what="both registered")
            r = await complete(c, stream=True, max_tokens=4)
            assert r.status_code == 200, r.text
            assert sse_events(r.text)[-1] == "[DONE]"
            [d_leg] = completion_legs(d)
            kv = d_leg.body["kv_transfer_params"]  # the strict fake D already checked the push fields
            assert (kv["remote_engine_id"], kv["remote_host"], kv["remote_port"]) == ("prefill-0", "127.0.0.1", p.kv_port)
            assert (kv["tp_size"], kv["pp_size"]) == (1, 1)


async def test_push_mode_refuses_a_prefill_without_kv_coordinates(tiny_model_path):
    async with registered_router(tiny_model_path, mode="push") as (c, app, [p], [d]):
        async with dealer(ping_endpoint(app)) as sock:
            await sock.send(pack(payload("p2p-nccl", "prefill", p)))
            await until(lambda: rejected(c, "missing_coordinates"), what="refusal counted")
        assert await instances(c) == []


async def test_silent_instance_expires_in_flight_finishes_and_reregistration_brings_it_back(tiny_model_path):
    async with registered_router(tiny_model_path, n_decode=2, heartbeat_timeout=1.0,
                                 engine_kw={"itl_s": 0.05}) as (c, app, [p], [d0, d1]):
        ep = ping_endpoint(app)
        async with Heart(ep, payload("pd-router", "prefill", p)), Heart(ep, payload("pd-router", "decode", d1)):
            h0 = Heart(ep, payload("pd-router", "decode", d0))
            h0.start()
            await until(lambda: _has(c, d0.url, d1.url, p.url), what="all three registered")
            # a long stream that lands on d0 (retry until the policy picks it)
            for _ in range(4):
                async with c.stream("POST", "/v1/completions",
                                    json={"model": "tiny", "prompt": LONG, "max_tokens": 100, "stream": True}) as r:
                    assert r.status_code == 200
                    if not completion_legs(d0):
                        await r.aread()
                        continue
                    chunks = r.aiter_text()
                    first = await anext(chunks)
                    await h0.stop()  # d0 goes silent mid-stream
                    await until(lambda: _gone(c, d0.url), timeout=10, what="d0 expired")
                    rest = first + "".join([t async for t in chunks])
                    break
            else:
                pytest.fail("d0 never picked")
            events = sse_events(rest)  # the request in flight on d0 finished normally
            assert events[-1] == "[DONE]"
            assert "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices")).count(" t") == 100
            text = (await c.get("/metrics")).text
            assert metric(text, "pd_router_instance_expiries_total", role="decode") == 1.0
            assert d0.url not in text  # its per-instance label children went with it
            n0 = len(completion_legs(d0))
            for _ in range(4):
                assert (await complete(c)).status_code == 200
            assert len(completion_legs(d0)) == n0  # no new request went to the silent instance
            h0.start()  # re-registration brings it back
            await until(lambda: _has(c, d0.url), what="d0 back")
            for _ in range(4):
                assert (await complete(c)).status_code == 200
            assert len(completion_legs(d0)) > n0
            await h0.stop()


async def _has(c, *want) -> bool:
    return set(want) <= await urls(c)


async def _gone(c, url) -> bool:
    return url not in await urls(c)


async def test_only_decode_left_after_expiry_is_a_clean_503(tiny_model_path):
    async with registered_router(tiny_model_path, heartbeat_timeout=1.0) as (c, app, [p], [d]):
        ep = ping_endpoint(app)
        async with Heart(ep, payload("moriio", "prefill", p)):
            async with Heart(ep, payload("moriio", "decode", d)):
                await until(lambda: _roles(c))
            await until(lambda: _gone(c, d.url), timeout=10, what="decode expired")
            r = await complete(c)
            assert r.status_code == 503 and r.json()["error"]["message"]
            assert completion_legs(d) == []


async def test_registered_only_router_learns_model_and_tokenizer(tiny_model_path):
    """No --tokenizer, no static instances: the router comes up, and serves once instances register."""
    async with registered_router(None, engine_kw={"model_root": str(tiny_model_path)}) as (c, app, [p], [d]):
        ep = ping_endpoint(app)
        async with Heart(ep, payload("moriio", "prefill", p)), Heart(ep, payload("moriio", "decode", d)):
            await until(lambda: _models_learnt(c), what="models learnt by the health checker")
            insts = await instances(c)
            assert {i["model"] for i in insts} == {"tiny"}
            r = await complete(c)
            assert r.status_code == 200, r.text
            assert len(completion_legs(p)) == 1  # counted as long: the tokenizer came from the engines
            assert (await c.get("/v1/models")).json()["data"][0]["id"] == "tiny"


async def _models_learnt(c) -> bool:
    insts = await instances(c)
    return len(insts) == 2 and all(i["model"] == "tiny" for i in insts)


async def test_token_is_checked_on_every_ping(tiny_model_path):
    async with registered_router(tiny_model_path, registration_token="s3cret") as (c, app, [p], [d]):
        async with dealer(ping_endpoint(app)) as sock:
            await sock.send(pack(payload("pd-router", "decode", d)))
            await sock.send(pack(payload("moriio", "decode", d, token="wrong")))
            await until(lambda: _eq(rejected(c, "bad_token"), 2.0), what="two refusals")
            assert await instances(c) == []
            await sock.send(pack(payload("pd-router", "decode", d, token="s3cret")))
            await until(lambda: _has(c, d.url))
            await sock.send(pack(payload("pd-router", "decode", d, token="s3cre")))  # a refresh needs it too
            await until(lambda: _eq(rejected(c, "bad_token"), 3.0))


async def _eq(coro, value) -> bool:
    return (await coro) == value


async def test_allowed_networks(tiny_model_path):
    async with registered_router(tiny_model_path, allowed_networks=("127.0.0.0/8", "::1/128")) as (c, app, [p], [d]):
        async with dealer(ping_endpoint(app)) as sock:
            await sock.send(pack(payload("pd-router", "decode", d, http_address="10.1.2.3:8000")))
            await sock.send(pack(payload("pd-router", "prefill", p, kv_host="192.168.0.9")))
            await sock.send(pack(payload("moriio", "prefill", p, zmq_address="host:10.0.0.1,handshake:1,notify:2")))
            await sock.send(pack(payload("pd-router", "decode", d, http_address="some.host.example:8000")))
            await until(lambda: _eq(rejected(c, "address_not_allowed"), 4.0), what="four refusals")
            assert await instances(c) == []
            await sock.send(pack(payload("pd-router", "prefill", p)))
            await until(lambda: _has(c, p.url))


async def test_transfer_mode_mismatch_is_refused_with_a_log_line(tiny_model_path, caplog):
    caplog.set_level(logging.WARNING, logger="pd_router.discovery")
    async with registered_router(tiny_model_path) as (c, app, [p], [d]):  # --mode pull
        d_url = d.url
        async with dealer(ping_endpoint(app)) as sock:
            for _ in range(3):
                await sock.send(pack(payload("moriio", "decode", d, transfer_mode="WRITE")))
            await sock.send(pack(payload("pd-router", "prefill", p, connector="MoRIIOConnector")))
            await until(lambda: _eq(rejected(c, "transfer_mode_mismatch"), 3.0))
            await until(lambda: _eq(rejected(c, "connector_mismatch"), 1.0))
        assert await instances(c) == []
    lines = [r.getMessage() for r in caplog.records if "transfer_mode_mismatch" in r.getMessage()]
    assert len(lines) == 1 and d_url in lines[0] and "push" in lines[0]  # logged once, not per heartbeat
    assert any("connector_mismatch" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("frames,reason", [
    ([b"\xc1"], "bad_msgpack"),
    ([b""], "bad_msgpack"),
    ([pack([1, 2, 3])], "not_a_map"),
    ([pack({"type": "Q", "http_address": "127.0.0.1:1"})], "unknown_type"),
    ([pack({"type": "register", "role": "X", "request_address": "127.0.0.1:1"})], "bad_role"),
    ([pack({"type": "pd-router/v1", "role": "decode", "http_address": 8000})], "bad_field"),
    ([pack({"type": "pd-router/v1", "role": "decode", "http_address": "127.0.0.1:99999"})], "bad_field"),
    ([pack({"type": "P", "http_address": "127.0.0.1:1", "zmq_address": "host:1.2.3.4,notify:x"})], "bad_field"),
    ([pack({"type": "pd-router/v1", "role": "D", "http_address": "127.0.0.1:1", "dp_size": True})], "bad_field"),
    ([pack({"type": "D", "http_address": "127.0.0.1:1", "zmq_address": "host:1.2.3.4,handshake:1,notify:2",
            "transfer_mode": "SIDEWAYS"})], "bad_field"),
    ([pack({f"k{i}": i for i in range(100)})], "bad_msgpack"),
    ([pack({"type": "HELLO"}), b"extra"], "bad_frames"),
    ([b"x" * 100_000], "too_large"),
])
async def test_bad_pings_are_dropped_and_counted(tiny_model_path, frames, reason):
    async with registered_router(tiny_model_path) as (c, app, [p], [d]):
        async with dealer(ping_endpoint(app)) as sock:
            await sock.send_multipart(frames)
            await sock.send_multipart([b"x" * 2_000_000])  # over the hard limit: libzmq drops the peer
            await until(lambda: _eq(rejected(c, reason), 1.0), what=f"{reason} counted")
        async with dealer(ping_endpoint(app)) as sock:  # the listener is still alive
            await sock.send(pack(payload("p2p-nccl", "decode", d)))
            await until(lambda: _has(c, d.url))
        assert len(await instances(c)) == 1


async def test_hello_is_ignored(tiny_model_path):
    async with registered_router(tiny_model_path) as (c, app, [p], [d]):
        async with dealer(ping_endpoint(app)) as sock:
            await sock.send(pack({"type": "HELLO"}))
            await sock.send(pack(payload("moriio-legacy", "decode", d)))
            await until(lambda: _has(c, d.url))
        assert "pd_router_rejected_pings_total{" not in (await c.get("/metrics")).text


async def test_a_flood_of_distinct_instances_is_bounded(tiny_model_path):
    async with registered_router(tiny_model_path, max_instances=4) as (c, app, [p], [d]):
        async with dealer(ping_endpoint(app)) as sock:
            for port in range(20000, 20050):
                await sock.send(pack(payload("p2p-nccl", "decode", d, http_address=f"127.0.0.1:{port}")))
            await until(lambda: _eq(rejected(c, "registry_full"), 46.0), what="46 refusals")
        assert len(await instances(c)) == 4


async def test_static_and_registered_share_one_registry(tiny_model_path):
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(FakeEngine(role="prefill"))
        d0 = await stack.enter_async_context(FakeEngine(role="decode"))
        d1 = await stack.enter_async_context(FakeEngine(role="decode"))
        s = Settings(tokenizer=str(tiny_model_path), threshold=16, health_interval=30.0, ping_port=free_port(),
                     heartbeat_timeout=1.5, prefill=(InstanceSpec.parse(p.url),), decode=(InstanceSpec.parse(d0.url),))
        url, app = await stack.enter_async_context(run_router(s))
        c = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=120))
        async with Heart(ping_endpoint(app), payload("pd-router", "decode", d1)):
            await until(lambda: _has(c, d1.url))
            by_url = {i["url"]: i for i in await instances(c)}
            assert by_url[d0.url]["source"] == "static" and by_url[d1.url]["source"] == "registered"
            for _ in range(4):
                assert (await complete(c)).status_code == 200
            assert completion_legs(d0) and completion_legs(d1)
            async with dealer(ping_endpoint(app)) as sock:  # a ping for a static instance changes nothing
                await sock.send(pack(payload("moriio", "decode", d0)))
                # one DEALER delivers in order: once the marker is registered, d0's ping was handled
                await sock.send(pack(payload("p2p-nccl", "decode", d0, http_address="127.0.0.1:9")))
                await until(lambda: _has(c, "http://127.0.0.1:9"), what="the marker registered")
            by_url = {i["url"]: i for i in await instances(c)}
            assert by_url[d0.url]["source"] == "static" and by_url[d0.url]["zmq_address"] is None
        await until(lambda: _gone(c, d1.url), timeout=10, what="registered one expired")
        assert d0.url in await urls(c)  # static instances never expire



def test_pdr_connector_is_in_the_nixl_family():
    """pd-router's own connector reads the NIXL push fields: a router with --kv-connector nixl
    must accept its registrations (pd-router up --connector pdr relies on it)."""
    from router.discovery import connector_family

    assert connector_family("PdrPushConnector") == "nixl"
    assert connector_family("NixlPushConnector") == "nixl"
    assert connector_family("MoRIIOConnector") == "moriio"

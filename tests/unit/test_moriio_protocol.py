"""MoRIIO READ (--mode pull) and WRITE (--mode push), PROTOCOLS.md section 4.

MoRIIOConnector needs ROCm hardware (the `mori` library), which CI does not have: these are
protocol conformance tests against strict fake engines (tests/unit/moriio_fake.py) that reject any
missing, extra or wrong field, header or request id on either leg. They do not prove a real
MoRIIO transfer works; docs/moriio.md says what was checked against vLLM's connector source.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from router.moriio_ids import parse_request_id
from router.settings import InstanceSpec, Settings
from tests.conftest import run_router
from tests.unit.moriio_fake import MoriioEngine, MoriioNet
from tests.unit.routerkit import LONG, completion_legs, sse_events


def zmq(i: int, role: str) -> str:
    return f"host:127.0.0.{1 if role == 'prefill' else 2},handshake:{6301 + i},notify:{61005 + 100 * i}"


@contextlib.asynccontextmanager
async def moriio_topology(tokenizer, *, read: bool, n_prefill=1, n_decode=1, p_dp=1, p_tp=1, d_dp=1, d_tp=1,
                          p_kw=None, d_kw=None, **settings):
    """Strict MoRIIO fakes behind a router configured from `?zmq=...&dp=..&tp=..` flags."""
    net = MoriioNet(read=read)
    ps = [MoriioEngine(net, role="prefill", engine_id=f"prefill-{i}", zmq_address=zmq(i, "prefill"), dp=p_dp,
                       tp=p_tp, **(p_kw or {})) for i in range(n_prefill)]
    ds = [MoriioEngine(net, role="decode", engine_id=f"decode-{i}", zmq_address=zmq(i, "decode"), dp=d_dp, tp=d_tp,
                       **(d_kw or {})) for i in range(n_decode)]
    async with contextlib.AsyncExitStack() as stack:
        for e in (*ps, *ds):
            await stack.enter_async_context(e)

        def spec(e: MoriioEngine) -> InstanceSpec:
            return InstanceSpec.parse(f"{e.url}?zmq={e.zmq_address}&dp={e.dp}&tp={e.tp}")

        s = Settings(mode="pull" if read else "push", kv_connector="moriio", prefill=tuple(map(spec, ps)),
                     decode=tuple(map(spec, ds)), tokenizer=str(tokenizer),
                     **{"threshold": 16, "health_interval": 30.0, **settings})
        url, app = await stack.enter_async_context(run_router(s))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=60))
        for _ in range(600):  # the tokenizer preloads; a loaded CI machine can take a while
            if (await client.get("/health")).status_code == 200:
                break
            await asyncio.sleep(0.1)
        yield client, ps, ds, app


def legs_by_id(engines) -> dict:
    out: dict = {}
    for e in engines:
        for leg in completion_legs(e):
            out.setdefault(leg.headers["x-request-id"], []).append((e, leg))
    return out


def text_of(path: str, r: httpx.Response, stream: bool) -> str:
    if not stream:
        choice = r.json()["choices"][0]
        return choice["message"]["content"] if path.endswith("chat/completions") else choice["text"]
    events = [e for e in sse_events(r.text)[:-1] if e["choices"]]
    if path.endswith("chat/completions"):
        return "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    return "".join(e["choices"][0]["text"] for e in events)


@pytest.mark.parametrize("read", [True, False], ids=["READ", "WRITE"])
async def test_legs_conform_on_both_endpoints_stream_or_not(tiny_model_path, read):
    # WRITE: P answers only after D's leg reached D, so a serial router would fail here.
    async with moriio_topology(tiny_model_path, read=read, n_prefill=2, n_decode=2, d_tp=2,
                               p_kw={"hold_until_decode": not read}) as (c, ps, ds, app):
        sent = []
        for i, (path, stream) in enumerate([(p, s) for p in ("/v1/completions", "/v1/chat/completions")
                                            for s in (False, True)]):
            body = {"model": "tiny", "max_tokens": 5, "stream": stream, "min_tokens": 2}
            body |= {"prompt": LONG} if path == "/v1/completions" else {"messages": [{"role": "user", "content": LONG}]}
            if stream:
                body["stream_options"] = {"include_usage": True}
            r = await c.post(path, json=body, headers={"X-Request-Id": f"client-{i}"})
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == f"client-{i}"  # the client's id is echoed
            assert text_of(path, r, stream) == " t0 t1 t2 t3 t4"  # max_tokens tokens, all from D
            sent.append((path, body))
        pairs = legs_by_id(ps + ds)
        assert len(pairs) == 4 and all(len(v) == 2 for v in pairs.values())
        assert not any(k.startswith("client-") for k in pairs)  # engines see only pair ids
        used_p, used_d, tids = set(), set(), set()
        for rid, legs in pairs.items():
            (pe, p_leg), (de, d_leg) = sorted(legs, key=lambda x: x[0].role != "prefill")
            assert (pe.role, de.role) == ("prefill", "decode")
            assert parse_request_id(rid)[:2] == (pe.zmq_address, de.zmq_address)
            assert p_leg.path == d_leg.path
            path, body = next((p, b) for p, b in sent if p == d_leg.path and b["stream"] == d_leg.body["stream"])
            d_kv = d_leg.body["kv_transfer_params"]
            assert {k: v for k, v in d_leg.body.items() if k != "kv_transfer_params"} == body  # untouched
            assert d_leg.body["max_tokens"] == 5  # not decremented (docs/moriio.md)
            p_kv = p_leg.body["kv_transfer_params"]
            assert p_kv["transfer_id"] == d_kv["transfer_id"] and p_kv["remote_tp_size"] == 2
            assert p_leg.body["max_tokens"] == 1 and "min_tokens" not in p_leg.body
            if read:
                assert d_kv["remote_block_ids"] and d_kv["remote_engine_id"] == pe.engine_id
            else:
                assert d_kv["remote_block_ids"] is None and d_kv["remote_engine_id"] is None
            used_p.add(pe.engine_id)
            used_d.add(de.engine_id)
            tids.add(d_kv["transfer_id"])
        assert len(used_p) == 2 and len(used_d) == 2 and len(tids) == 4
        assert all(leg.status == 200 for e in ps + ds for leg in completion_legs(e))


@pytest.mark.parametrize("read", [True, False], ids=["READ", "WRITE"])
async def test_prefill_with_dp_gets_rank_header_and_decode_the_rank(tiny_model_path, read):
    async with moriio_topology(tiny_model_path, read=read, p_dp=2, p_tp=2, d_dp=3) as (c, ps, ds, app):
        for _ in range(4):
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 2})
            assert r.status_code == 200, r.text
        p_legs = completion_legs(ps[0])
        assert [leg.headers["x-data-parallel-rank"] for leg in p_legs] == ["0", "1", "0", "1"]
        by_rid = {leg.headers["x-request-id"]: leg for leg in p_legs}
        for d_leg in completion_legs(ds[0]):
            kv = d_leg.body["kv_transfer_params"]
            assert (kv["remote_dp_size"], kv["remote_tp_size"]) == (2, 2)
            p_leg = by_rid[d_leg.headers["x-request-id"]]
            assert kv["remote_dp_rank"] == int(p_leg.headers["x-data-parallel-rank"])
            assert p_leg.body["kv_transfer_params"]["remote_dp_size"] == 3
            assert "x-data-parallel-rank" not in d_leg.headers


async def test_write_prefill_failure_closes_decode(tiny_model_path):
    p_kw = {"hold_until_decode": True, "fail_status": 500}
    async with moriio_topology(tiny_model_path, read=False, p_kw=p_kw, d_kw={"kv_transfer_s": 60.0}) as (c, ps, ds, app):
        for stream in (False, True):
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 3,
                                                      "stream": stream})
            assert r.status_code == 502, r.text
            assert "injected prefill failure" in r.json()["error"]["message"]
        for d_leg in completion_legs(ds[0]):  # D would wait 60 s for the KV; the router closed it
            done = await ds[0].wait_for(lambda q, leg=d_leg: q is leg and q.t_end is not None, timeout=5)
            assert done.disconnected
        assert len(completion_legs(ds[0])) == 2
        assert app.state.pdr.in_flight == 0 and all(i.in_flight == 0 for i in app.state.pdr.registry)


async def test_read_prefill_failure_never_sends_decode(tiny_model_path):
    async with moriio_topology(tiny_model_path, read=True, p_kw={"fail_status": 503}) as (c, ps, ds, app):
        r = await c.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3,
                                                       "messages": [{"role": "user", "content": LONG}]})
        assert r.status_code == 502, r.text
        assert len(completion_legs(ps[0])) == 1 and completion_legs(ds[0]) == []


async def test_read_needs_block_ids_in_prefill_answer(tiny_model_path):
    async with moriio_topology(tiny_model_path, read=True) as (c, ps, ds, app):
        ps[0]._moriio_answer = lambda *a: {"do_remote_prefill": True, "remote_block_ids": None}
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 3})
        assert r.status_code == 502 and r.json()["error"]["code"] == "no_kv_params"
        assert completion_legs(ds[0]) == []
        assert 'pd_router_orphaned_prefills_total{reason="no_kv_params"} 1.0' in (await c.get("/metrics")).text


@pytest.mark.parametrize("rid", ["a___prefill_addr_x", "___decode_addr_host:1,handshake:2,notify:3_" + "0" * 32,
                                 "x___y"])
async def test_client_ids_with_markers_rejected(tiny_model_path, rid):
    async with moriio_topology(tiny_model_path, read=True) as (c, ps, ds, app):
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 3},
                         headers={"X-Request-Id": rid})
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id"
        assert completion_legs(ps[0]) == [] and completion_legs(ds[0]) == []


async def test_retry_on_another_decode_gets_a_fresh_pair(tiny_model_path):
    from launch.fake_engine import Fault

    async with moriio_topology(tiny_model_path, read=True, n_decode=2, decode_retries=2) as (c, ps, ds, app):
        ds[0].fault = Fault(status=500, count=1)
        ds[1].fault = Fault(status=500, count=1)
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 200, r.text
        p_legs = completion_legs(ps[0])
        assert len(p_legs) == 3  # a fresh prefill for every D tried
        ids = [leg.headers["x-request-id"] for leg in p_legs]
        tids = [leg.body["kv_transfer_params"]["transfer_id"] for leg in p_legs]
        assert len(set(ids)) == 3 and len(set(tids)) == 3
        assert {parse_request_id(i)[1] for i in ids} == {ds[0].zmq_address, ds[1].zmq_address}

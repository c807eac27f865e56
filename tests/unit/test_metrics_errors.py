"""Errors by stage and kind (each failure counted once), orphaned prefills in every pull
path, client disconnects, and the one-line access log (JSON and text)."""

from __future__ import annotations

import asyncio
import logging
import shlex

import httpx
import orjson

from launch.fake_engine import Fault
from router.logs import JsonFormatter
from tests.unit.metricskit import scrape
from tests.unit.routerkit import LONG, SHORT, completion_legs, topology


async def until(client, predicate, timeout: float = 10.0):
    """Scrape until `predicate(scrape)` holds (the router finishes a request after the client left)."""
    async with asyncio.timeout(timeout):
        while True:
            m = await scrape(client)
            if predicate(m):
                return m
            await asyncio.sleep(0.02)


async def test_errors_by_stage_counted_once(tiny_model_path):
    async with topology(tiny_model_path, engine_kw={"itl_s": 0.01}) as (c, url, ps, ds, app):
        await app.state.pdr.tokens.ensure_loaded()
        post = lambda body: c.post("/v1/completions", json={"model": "tiny", "max_tokens": 5, **body})  # noqa: E731
        ps[0].fault = Fault(status=500, count=1)
        assert (await post({"prompt": LONG})).status_code == 502
        ds[0].fault = Fault(status=400, count=1)  # an engine 4xx: the decode stage's, not counted twice
        assert (await post({"prompt": SHORT})).status_code == 400
        ds[0].fault = Fault(status=503, count=1)
        assert (await post({"prompt": SHORT})).status_code == 502
        ds[0].fault = Fault(drop_after_chunks=2, count=1)  # fails after the client got a 200
        r = await post({"prompt": SHORT, "stream": True})
        assert r.status_code == 200 and '"error"' in r.text
        assert (await post({"prompt": SHORT, "max_tokens": -1})).status_code == 400
        m = await scrape(c)
        [mid_stream] = [lab["kind"] for lab in m.series("pd_router_errors_total")
                        if lab["stage"] == "decode" and not lab["kind"].startswith("http_")]
        assert mid_stream in ("connection_lost", "truncated_stream")
        assert m.nonzero("pd_router_errors_total") == {
            (("kind", "http_500"), ("stage", "prefill")): 1,
            (("kind", "http_400"), ("stage", "decode")): 1,
            (("kind", "http_503"), ("stage", "decode")): 1,
            (("kind", mid_stream), ("stage", "decode")): 1,
            (("kind", "invalid_request_error"), ("stage", "client")): 1}
        assert m.nonzero("pd_router_requests_total") == {
            (("mode", "pull"), ("outcome", "upstream_error"), ("route", "disaggregated")): 1,
            (("mode", "none"), ("outcome", "client_error"), ("route", "direct")): 2,
            (("mode", "none"), ("outcome", "upstream_error"), ("route", "direct")): 2}
        assert m.total("pd_router_orphaned_prefills_total") == 0  # P failed: nothing to orphan


async def test_orphans_when_prefill_answered_but_no_decode_leg(tiny_model_path, monkeypatch):
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        await app.state.pdr.tokens.ensure_loaded()
        body = {"model": "tiny", "prompt": LONG, "max_tokens": 2}
        with monkeypatch.context() as mp:
            mp.setattr(ps[0], "_kv_answer", lambda *a, **k: None)  # P without a KV connector
            assert (await c.post("/v1/completions", json=body)).status_code == 502
        st = app.state.pdr
        for inst in st.registry.of_role("decode"):
            st.registry.set_health(inst, False)
        assert (await c.post("/v1/completions", json=body)).status_code == 503
        assert len(completion_legs(ps[0])) == 2 and completion_legs(ds[0]) == []
        m = await scrape(c)
        assert m.nonzero("pd_router_orphaned_prefills_total") == {
            (("reason", "no_kv_params"),): 1, (("reason", "no_decode_instance"),): 1}
        assert m.nonzero("pd_router_errors_total") == {
            (("kind", "no_kv_params"), ("stage", "prefill")): 1, (("kind", "no_instance"), ("stage", "router")): 1}


async def test_client_gone_after_prefill_answered_is_an_orphan(tiny_model_path):
    """Pull: P answered, D has not answered yet (a slow KV read), the client leaves."""
    async with topology(tiny_model_path, d_kw={"kv_transfer_s": 5.0}) as (c, url, ps, ds, app):
        await app.state.pdr.tokens.ensure_loaded()
        async with httpx.AsyncClient(base_url=url, timeout=20) as leaving:
            task = asyncio.create_task(leaving.post("/v1/completions", json={
                "model": "tiny", "prompt": LONG, "max_tokens": 2, "stream": True}))
            await ps[0].wait_for(lambda r: r.t_end is not None and r.status == 200)
            await ds[0].wait_for(lambda r: r.leg == "decode")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        cancelled = {"route": "disaggregated", "mode": "pull", "outcome": "cancelled"}
        m = await until(c, lambda m: m.get("pd_router_requests_total", **cancelled) == 1)
        assert m.nonzero("pd_router_orphaned_prefills_total") == {(("reason", "cancelled"),): 1}
        assert m.nonzero("pd_router_errors_total") == {(("kind", "disconnected"), ("stage", "client")): 1}
        assert m.get("pd_router_requests_in_flight") == 0
        assert m.total("pd_router_in_flight_requests") == 0
        await ds[0].wait_for(lambda r: r.leg == "decode" and r.disconnected)


async def test_client_gone_mid_stream(tiny_model_path):
    async with topology(tiny_model_path, engine_kw={"itl_s": 0.2}) as (c, url, ps, ds, app):
        await app.state.pdr.tokens.ensure_loaded()
        async with c.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 50,
                                                              "stream": True}) as r:
            assert r.status_code == 200
            async for _ in r.aiter_raw():
                break
        cancelled = {"route": "direct", "mode": "none", "outcome": "cancelled"}
        m = await until(c, lambda m: m.get("pd_router_requests_total", **cancelled) == 1)
        assert m.nonzero("pd_router_errors_total") == {(("kind", "disconnected"), ("stage", "client")): 1}
        assert m.total("pd_router_orphaned_prefills_total") == 0
        assert m.get("pd_router_slo_requests_total", route="direct") == 0  # only finished requests


def access_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "pd_router.access"]


async def test_access_log_json_one_line_per_request(tiny_model_path, caplog):
    caplog.set_level(logging.INFO, logger="pd_router.access")
    async with topology(tiny_model_path, log_format="json", engine_kw={"itl_s": 0.01}) as (c, url, ps, ds, app):
        await app.state.pdr.tokens.ensure_loaded()
        n_long = await app.state.pdr.tokens.count("completions", {"model": "tiny", "prompt": LONG})
        r1 = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 3, "stream": True},
                          headers={"x-request-id": "log-1"})
        r2 = await c.post("/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 2},
                          headers={"x-request-id": "log-2"})
        r3 = await c.post("/v1/completions", json={"model": "nope", "prompt": SHORT}, headers={"x-request-id": "log-3"})
        assert (r1.status_code, r2.status_code, r3.status_code) == (200, 200, 404)
        p_url, d_url = ps[0].url, ds[0].url
    records = access_records(caplog)
    assert len(records) == 3
    docs = {}
    for rec in records:
        line = JsonFormatter().format(rec)
        assert "\n" not in line
        doc = orjson.loads(line)
        assert doc["level"] == "info" and doc["ts"] > 0
        docs[doc["request_id"]] = doc
    required = {"request_id", "route", "prefill", "decode", "prompt_tokens", "output_tokens", "ttft_ms", "e2e_ms",
                "status", "outcome"}
    assert all(required <= set(d) for d in docs.values())
    one, two, three = docs["log-1"], docs["log-2"], docs["log-3"]
    assert (one["route"], one["prefill"], one["decode"]) == ("disaggregated", p_url, d_url)
    assert (one["prompt_tokens"], one["output_tokens"], one["status"], one["outcome"]) == (n_long, 3, 200, "ok")
    assert one["ttft_ms"] > 0 and one["e2e_ms"] >= one["ttft_ms"]
    assert (two["route"], two["prefill"], two["decode"], two["output_tokens"]) == ("direct", None, d_url, 2)
    assert (three["status"], three["outcome"], three["ttft_ms"]) == (404, "client_error", None)
    assert "nope" in three["error"]


async def test_access_log_text_splits_into_fields(tiny_model_path, caplog):
    caplog.set_level(logging.INFO, logger="pd_router.access")
    async with topology(tiny_model_path, log_format="text") as (c, url, ps, ds, app):
        await app.state.pdr.tokens.ensure_loaded()
        r = await c.post("/v1/completions", json={"model": "nope", "prompt": SHORT}, headers={"x-request-id": "t-1"})
        assert r.status_code == 404
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 1},
                         headers={"x-request-id": "t-2"})
        assert r.status_code == 200
        d_url = ds[0].url
    lines = [rec.getMessage() for rec in access_records(caplog)]
    fields = [dict(kv.split("=", 1) for kv in shlex.split(line)) for line in lines]
    assert [f["request_id"] for f in fields] == ["t-1", "t-2"]
    assert fields[0]["status"] == "404" and "does not exist" in fields[0]["error"]
    assert (fields[1]["route"], fields[1]["decode"], fields[1]["prefill"], fields[1]["outcome"]) == \
        ("direct", d_url, "-", "ok")

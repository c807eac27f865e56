"""Known traffic through a real router and fake engines with fixed delays; /metrics parsed
with prometheus_client. Counts must equal the traffic exactly; latency sums must be at
least the injected delays (the delays are lower bounds by construction, so these cannot
flake; upper bounds are only sanity limits)."""

from __future__ import annotations

import asyncio

import pytest

from launch.fake_engine import FakeEngine
from router.metrics import ORPHAN_REASONS, OUTCOMES
from router.settings import InstanceSpec
from tests.unit.metricskit import scrape
from tests.unit.routerkit import LONG, SHORT, completion_legs, sse_events, topology

P_WAIT, KV_WAIT, D_WAIT, ITL = 0.1, 0.15, 0.05, 0.02
SANE = 30.0  # seconds: a loose upper bound per observation


def has_usage_event(text: str) -> bool:
    return any(e != "[DONE]" and isinstance(e.get("usage"), dict) for e in sse_events(text))


async def test_known_traffic_counts_and_latency_sums(tiny_model_path):
    async with topology(tiny_model_path, p_kw={"ttft_extra_s": P_WAIT},
                        d_kw={"ttft_extra_s": D_WAIT, "kv_transfer_s": KV_WAIT, "itl_s": ITL}) as (c, url, ps, ds, app):
        await app.state.pdr.tokens.ensure_loaded()  # a first transformers import can be slow
        def post(prompt, n, stream):
            return c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": n, "stream": stream})

        rs = await asyncio.gather(*[post(LONG, 5, True) for _ in range(3)], *[post(LONG, 4, False) for _ in range(2)],
                                  *[post(SHORT, 3, True) for _ in range(2)], post(SHORT, 2, False),
                                  c.post("/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 0}))
        assert [r.status_code for r in rs] == [200] * 8 + [400]
        # streams asked D for usage (output tokens); the client, who did not ask, gets no usage event
        assert not any(has_usage_event(r.text) for r in rs[:3] + rs[5:7])
        d_streams = [leg for leg in completion_legs(ds[0]) if leg.body.get("stream")]
        assert len(d_streams) == 5 and all(leg.body["stream_options"] == {"include_usage": True} for leg in d_streams)

        m = await scrape(c)
        n_long = await app.state.pdr.tokens.count("completions", {"model": "tiny", "prompt": LONG})
        n_short = await app.state.pdr.tokens.count("completions", {"model": "tiny", "prompt": SHORT})
        assert m.nonzero("pd_router_requests_total") == {
            (("mode", "pull"), ("outcome", "ok"), ("route", "disaggregated")): 5,
            (("mode", "none"), ("outcome", "ok"), ("route", "direct")): 3,
            (("mode", "none"), ("outcome", "client_error"), ("route", "direct")): 1}
        assert m.nonzero("pd_router_routing_decisions_total") == {
            (("reason", "above_threshold"), ("route", "disaggregated")): 5,
            (("reason", "below_threshold"), ("route", "direct")): 3}
        assert m.get("pd_router_prompt_tokens_total", route="disaggregated") == 5 * n_long
        assert m.get("pd_router_prompt_tokens_total", route="direct") == 3 * n_short
        assert m.get("pd_router_prompt_length_tokens_sum", route="disaggregated") == 5 * n_long
        assert m.get("pd_router_output_tokens_total", route="disaggregated") == 3 * 5 + 2 * 4
        assert m.get("pd_router_output_tokens_total", route="direct") == 2 * 3 + 2
        assert m.nonzero("pd_router_errors_total") == {(("kind", "invalid_request_error"), ("stage", "client")): 1}

        def hist(name, n, at_least, **labels):
            count, total = m.get(name + "_count", **labels), m.get(name + "_sum", **labels)
            assert count == n, (name, labels, count)
            assert at_least <= total <= n * SANE, (name, labels, total, at_least)
            assert m.get(name + "_bucket", le="+Inf", **labels) == n
            return total

        dis, direct = {"route": "disaggregated", "mode": "pull"}, {"route": "direct", "mode": "none"}
        ttft = "pd_router_time_to_first_token_seconds"
        ttft_dis = hist(ttft, 5, 5 * (P_WAIT + KV_WAIT), **dis)
        hist(ttft, 3, 3 * D_WAIT, **direct)
        hist("pd_router_prefill_leg_seconds", 5, 5 * P_WAIT, mode="pull")
        hist("pd_router_handoff_seconds", 5, 5 * KV_WAIT, mode="pull")  # P answered -> D's first token
        hist("pd_router_request_duration_seconds", 5, 3 * (P_WAIT + KV_WAIT + 4 * ITL) + 2 * (P_WAIT + KV_WAIT + 3 * ITL),
             outcome="ok", **dis)
        # rejected before a job existed (validation): counted, but no duration observed
        assert m.get("pd_router_request_duration_seconds_count", outcome="client_error", **direct) == 0
        # ITL: one observation per token after the first, per stream (chunks - 1)
        itl = "pd_router_inter_token_latency_seconds"
        itl_dis = hist(itl, 3 * (5 - 1), 0.0, **dis)
        hist(itl, 2 * (3 - 1), 0.0, **direct)
        # per stream, TTFT + its ITL sum = last token - request start >= every injected delay
        assert ttft_dis + itl_dis >= 3 * (P_WAIT + KV_WAIT + 4 * ITL) + 2 * (P_WAIT + KV_WAIT + 3 * ITL)
        assert m.get("pd_router_tokenize_seconds_count") == 8
        assert m.get("pd_router_requests_in_flight") == 0
        for e, role in ((ps[0], "prefill"), (ds[0], "decode")):
            assert m.get("pd_router_in_flight_requests", role=role, engine=e.url) == 0
        assert m.get("pd_router_slo_requests_total", route="disaggregated") == 5


@pytest.mark.parametrize("slo_ttft, slo_itl, itl_s, passing", [
    (0.05, 5.0, 0.02, 0),  # TTFT target well below the injected 300 ms
    (5.0, 5.0, 0.02, 4),  # both targets well above
    (5.0, 0.001, 0.05, 0),  # ITL target well below the injected 50 ms
])
async def test_goodput_and_itl_counts(tiny_model_path, slo_ttft, slo_itl, itl_s, passing):
    wait = 0.3
    async with topology(tiny_model_path, d_kw={"ttft_extra_s": wait, "itl_s": itl_s}, threshold=1_000_000,
                        slo_ttft=slo_ttft, slo_itl=slo_itl) as (c, url, ps, ds, app):
        await app.state.pdr.tokens.ensure_loaded()  # a first transformers import can be slow
        body = {"model": "tiny", "prompt": SHORT, "max_tokens": 5, "stream": True}
        chat = {"model": "tiny", "messages": [{"role": "user", "content": SHORT}], "max_tokens": 5, "stream": True}
        rs = await asyncio.gather(
            c.post("/v1/completions", json=body), c.post("/v1/completions", json=body),
            c.post("/v1/completions", json={**body, "stream_options": {"include_usage": True}}),
            c.post("/v1/chat/completions", json=chat))
        assert [r.status_code for r in rs] == [200] * 4
        assert [has_usage_event(r.text) for r in rs] == [False, False, True, False]
        m = await scrape(c)
        labels = {"route": "direct", "mode": "none"}
        # completions: 5 token events -> 4 gaps; chat: a role event then 5 tokens -> 5 gaps;
        # the usage-only event and [DONE] are not tokens
        assert m.get("pd_router_inter_token_latency_seconds_count", **labels) == 3 * 4 + 5
        assert m.get("pd_router_time_to_first_token_seconds_count", **labels) == 4
        assert m.get("pd_router_time_to_first_token_seconds_sum", **labels) >= 4 * wait
        assert m.get("pd_router_slo_requests_total", route="direct") == 4
        assert m.get("pd_router_slo_goodput_requests_total", route="direct") == passing
        assert m.get("pd_router_output_tokens_total", route="direct") == 20


async def test_push_mode_labels_and_handoff(tiny_model_path):
    async with topology(tiny_model_path, mode="push", engine_kw={"ttft_extra_s": P_WAIT, "itl_s": ITL}) as (c, url, ps, ds, app):
        await app.state.pdr.tokens.ensure_loaded()  # a first transformers import can be slow
        rs = await asyncio.gather(*[c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 3,
                                                                      "stream": True}) for _ in range(2)])
        assert [r.status_code for r in rs] == [200, 200]
        m = await scrape(c)
        assert m.nonzero("pd_router_requests_total") == {
            (("mode", "push"), ("outcome", "ok"), ("route", "disaggregated")): 2}
        assert m.get("pd_router_prefill_leg_seconds_count", mode="push") == 2
        assert m.get("pd_router_prefill_leg_seconds_sum", mode="push") >= 2 * P_WAIT
        assert m.get("pd_router_handoff_seconds_count", mode="push") == 2  # legs launched -> D's first token
        assert m.get("pd_router_handoff_seconds_sum", mode="push") >= 2 * P_WAIT  # push D waits P's prefill
        assert m.get("pd_router_inter_token_latency_seconds_count", route="disaggregated", mode="push") == 2 * 2
        assert m.get("pd_router_output_tokens_total", route="disaggregated") == 6
        assert m.total("pd_router_orphaned_prefills_total") == 0


ALLOWED = {
    "route": {"direct", "disaggregated"}, "mode": {"pull", "push", "none"}, "outcome": set(OUTCOMES),
    "stage": {"prefill", "decode", "client", "router"}, "role": {"prefill", "decode"}, "healthy": {"true", "false"},
    "reason": {"above_threshold", "below_threshold", "batch", "n_gt_1", *ORPHAN_REASONS},
}


async def test_labels_bounded_under_flood(tiny_model_path):
    """500 unknown models (404) and 500 request ids create no label values; a second
    flood adds no series at all."""
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        await app.state.pdr.tokens.ensure_loaded()  # a first transformers import can be slow
        async def flood(tag: str) -> None:
            for batch in range(10):
                rs = await asyncio.gather(*[
                    c.post("/v1/completions", json={"model": f"flood-model-{tag}-{i}", "prompt": SHORT, "max_tokens": 1},
                           headers={"x-request-id": f"flood-rid-{tag}-{i}"}) for i in range(batch * 50, batch * 50 + 50)])
                assert {r.status_code for r in rs} == {404}
            rs = await asyncio.gather(*[
                c.post("/v1/completions", json={"model": "tiny", "prompt": LONG if i % 2 else SHORT, "max_tokens": 1},
                       headers={"x-request-id": f"flood-ok-{tag}-{i}"}) for i in range(20)])
            assert {r.status_code for r in rs} == {200}

        await flood("a")
        first = await scrape(c)
        await flood("b")
        m = await scrape(c)
        assert sorted((n, sorted(lab.items())) for n, lab, _ in m.samples) == \
            sorted((n, sorted(lab.items())) for n, lab, _ in first.samples)
        urls = {ps[0].url, ds[0].url}
        for name, lab, _ in m.samples:
            for key, value in lab.items():
                assert "flood" not in value, (name, lab)
                if key in ALLOWED:
                    assert value in ALLOWED[key], (name, lab)
                elif key == "engine":
                    assert value in urls, (name, lab)
                else:
                    assert key in ("le", "kind"), (name, lab)
        assert len({lab["kind"] for lab in m.series("pd_router_errors_total")}) == 1
        assert m.get("pd_router_requests_total", route="direct", mode="none", outcome="client_error") == 1000
        assert m.get("pd_router_errors_total", stage="client", kind="model_not_found") == 1000
        assert m.get("pd_router_requests_total", route="disaggregated", mode="pull", outcome="ok") == 20
        assert m.get("pd_router_requests_total", route="direct", mode="none", outcome="ok") == 20


async def test_instance_labels_follow_the_registry(tiny_model_path):
    """A registered instance gets in-flight series while known; expiry counts and removes them."""
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        await app.state.pdr.tokens.ensure_loaded()  # a first transformers import can be slow
        async with FakeEngine(role="decode", engine_id="decode-extra") as extra:
            reg = app.state.pdr.registry
            inst, created = reg.upsert("decode", InstanceSpec.parse(extra.url), model="tiny")
            assert created
            for _ in range(4):
                r = await c.post("/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 1})
                assert r.status_code == 200
            assert len(completion_legs(extra)) == 2  # round robin over both decode instances
            m = await scrape(c)
            # series appear on an instance's first lease (P got none: all traffic was direct)
            assert {lab["engine"] for lab in m.series("pd_router_in_flight_requests")} == {ds[0].url, extra.url}
            assert m.get("pd_router_instances", role="decode", healthy="true") == 2
            assert [i.url for i in reg.expire(-1.0)] == [extra.url]  # only registered instances expire
            m = await scrape(c)
            assert m.get("pd_router_instance_expiries_total", role="decode") == 1
            assert extra.url not in {lab.get("engine") for _, lab, _ in m.samples}
            assert m.get("pd_router_instances", role="decode", healthy="true") == 1


def test_lock_free_metric_classes_expose_what_prometheus_client_would():
    """router.metrics' Counter/Gauge/Histogram (no per-value lock, bisected buckets) must give the
    exposition prometheus_client's own classes give for the same updates: bounds, the +Inf
    bucket, values on a bound, negatives, NaN, labels (this also pins the private hooks used)."""
    import math

    import prometheus_client as pc
    from prometheus_client.parser import text_string_to_metric_families

    from router import metrics as rm

    def build(mod, registry):
        return (mod.Histogram("h_seconds", "h", ["route"], buckets=rm.LATENCY_BUCKETS, registry=registry),
                mod.Histogram("t_tokens", "t", buckets=rm.TOKEN_BUCKETS, registry=registry),
                mod.Counter("c_total", "c", ["kind"], registry=registry),
                mod.Gauge("g", "g", registry=registry))

    ours_reg, stock_reg = pc.CollectorRegistry(), pc.CollectorRegistry()
    ours, stock = build(rm, ours_reg), build(pc, stock_reg)
    values = [0.0, 0.001, 0.0010001, 0.0025, 0.003, 1.0, 300.0, 300.5, 1e9, -1.0, 16, 17, 131072, 131073, math.nan]
    for i, v in enumerate(values * 3):
        for h, t, c, g in (ours, stock):
            h.labels("direct" if i % 2 else "disaggregated").observe(v)
            if v == v:
                t.observe(abs(v))
                c.labels("x").inc(abs(v))
            g.inc(1)
            g.dec(0.25)
            if i == 7:
                g.set(3)

    def samples(reg):
        text = pc.generate_latest(reg).decode()
        return sorted((s.name, tuple(sorted(s.labels.items())), repr(s.value))
                      for fam in text_string_to_metric_families(text) for s in fam.samples
                      if not s.name.endswith("_created"))

    assert samples(ours_reg) == samples(stock_reg)
    assert type(ours[0].labels("direct")._sum) is rm._Value  # the lock-free value is in use
    with pytest.raises(ValueError):
        ours[0].observe(1.0)  # a labelled parent is not observable, as upstream

"""/metrics is real Prometheus text: parsed with prometheus_client, counts equal the traffic."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tests.unit.routerkit import LONG, SHORT, topology


def samples(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_counts_and_ttft_histogram(tiny_model_path):
    async with topology(tiny_model_path, engine_kw={"itl_s": 0.002}) as (c, url, ps, ds, app):
        for i in range(3):
            assert (await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 3})).status_code == 200
        for i in range(2):
            assert (await c.post("/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 3,
                                                           "stream": True})).status_code == 200
        assert (await c.post("/v1/completions", json={"model": "tiny", "prompt": 5})).status_code == 400
        m = samples((await c.get("/metrics")).text)
        req = lambda route, mode, outcome: m.get(("pd_router_requests_total", (("mode", mode), ("outcome", outcome), ("route", route)))) # noqa
        assert req("disaggregated", "pull", "ok") == 3
        assert req("direct", "none", "ok") == 2
        assert req("direct", "none", "client_error") == 1
        assert m[("pd_router_time_to_first_token_seconds_count", (("mode", "pull"), ("route", "disaggregated")))] == 3
        assert m[("pd_router_time_to_first_token_seconds_count", (("mode", "none"), ("route", "direct")))] == 2
        assert m[("pd_router_routing_decisions_total", (("reason", "above_threshold"), ("route", "disaggregated")))] == 3
        assert m[("pd_router_prefill_leg_seconds_count", (("mode", "pull"),))] == 3
        assert m[("pd_router_output_tokens_total", (("route", "disaggregated"),))] == 9
        assert m[("pd_router_requests_in_flight", ())] == 0
        assert m[("pd_router_in_flight_requests", (("engine", ds[0].url), ("role", "decode")))] == 0

"""Shared-storage connector (vLLM ExampleConnector), `--kv-connector storage --mode pull`.

Serial P then D and no kv_transfer_params at all: P writes the prompt's KV to shared storage,
D finds it there by prompt hash. P's leg is pull step 1 without the params; D's leg is the
client's body byte for byte (as parsed).
"""

from __future__ import annotations

import asyncio

from tests.unit.routerkit import LONG, completion_legs, sse_events, topology


async def _healthy(c) -> None:
    for _ in range(600):  # the tokenizer preloads; a loaded machine can take a while
        if (await c.get("/health")).status_code == 200:
            return
        await asyncio.sleep(0.1)


async def test_storage_legs_serial_and_without_kv_params(tiny_model_path):
    async with topology(tiny_model_path, kv_connector="storage") as (c, url, ps, ds, app):
        await _healthy(c)
        sent = []
        for i, (path, stream) in enumerate([(p, s) for p in ("/v1/completions", "/v1/chat/completions")
                                            for s in (False, True)]):
            body = {"model": "tiny", "max_tokens": 4, "min_tokens": 1, "stream": stream, "temperature": 0}
            body |= {"prompt": LONG} if path == "/v1/completions" else {"messages": [{"role": "user", "content": LONG}]}
            if stream:
                body["stream_options"] = {"include_usage": True}
            r = await c.post(path, json=body, headers={"X-Request-Id": f"st-{i}"})
            assert r.status_code == 200, r.text
            if stream:
                assert sse_events(r.text)[-1] == "[DONE]"
            sent.append(body)
        p_legs, d_legs = completion_legs(ps[0]), completion_legs(ds[0])
        assert len(p_legs) == len(d_legs) == 4
        for body, p_leg, d_leg in zip(sent, p_legs, d_legs):
            assert d_leg.body == body  # the original body, untouched
            want_p = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
            assert p_leg.body == {**want_p, "max_tokens": 1, "stream": False}  # no kv_transfer_params
            assert p_leg.headers["x-request-id"] == d_leg.headers["x-request-id"]
            assert p_leg.path == d_leg.path
            assert p_leg.t_end is not None and p_leg.t_end <= d_leg.t_start  # serial: D only after P answered
            assert p_leg.status == d_leg.status == 200


async def test_storage_prefill_failure_is_an_error_and_skips_decode(tiny_model_path):
    from launch.fake_engine import Fault

    async with topology(tiny_model_path, kv_connector="storage") as (c, url, ps, ds, app):
        await _healthy(c)
        ps[0].fault = Fault(status=500, message="storage prefill crashed")
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 3})
        assert r.status_code == 502 and "storage prefill crashed" in r.json()["error"]["message"]
        assert completion_legs(ds[0]) == []

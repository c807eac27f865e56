"""Pull mode wire protocol (PROTOCOLS.md section 2), pinned against strict fake engines."""

from __future__ import annotations

import pytest

from tests.unit.routerkit import LONG, SHORT, completion_legs, sse_events, topology

SIX = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
       "remote_host": None, "remote_port": None}


async def test_pull_legs_fields_and_request_id(tiny_model_path):
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        body = {"model": "tiny", "prompt": LONG, "max_tokens": 7, "stream": True, "min_tokens": 2,
                "stream_options": {"include_usage": True}, "temperature": 0}
        r = await c.post("/v1/completions", json=body, headers={"X-Request-Id": "client-id-1"})
        assert r.status_code == 200
        assert r.headers["x-request-id"] == "client-id-1"
        [p_leg] = completion_legs(ps[0])
        [d_leg] = completion_legs(ds[0])
        # P leg: max_tokens=1, stream=false, stream_options/min_tokens removed, six-field kv params
        assert p_leg.body["max_tokens"] == 1 and p_leg.body["stream"] is False
        assert "stream_options" not in p_leg.body and "min_tokens" not in p_leg.body
        assert p_leg.body["kv_transfer_params"] == SIX
        assert p_leg.body["prompt"] == LONG and p_leg.body["temperature"] == 0
        # D leg: the original body + P's kv_transfer_params verbatim (strict D checks the ledger)
        kv = d_leg.body.pop("kv_transfer_params")
        assert d_leg.body == body
        assert kv["remote_engine_id"] == "prefill-0" and kv["do_remote_prefill"] is True
        assert kv == ps[0].ledger[kv["remote_request_id"]]
        # one X-Request-Id for both legs, same endpoint
        assert p_leg.headers["x-request-id"] == d_leg.headers["x-request-id"] == "client-id-1"
        assert p_leg.path == d_leg.path == "/v1/completions"
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices")) == " t0 t1 t2 t3 t4 t5 t6"


async def test_chat_max_completion_tokens_and_generated_id(tiny_model_path):
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        body = {"model": "tiny", "messages": [{"role": "user", "content": LONG}], "max_completion_tokens": 3}
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        rid = r.headers["x-request-id"]
        assert len(rid) == 32
        [p_leg] = completion_legs(ps[0])
        [d_leg] = completion_legs(ds[0])
        assert p_leg.body["max_tokens"] == 1 and p_leg.body["max_completion_tokens"] == 1
        assert d_leg.body["max_completion_tokens"] == 3 and "max_tokens" not in d_leg.body
        assert p_leg.headers["x-request-id"] == d_leg.headers["x-request-id"] == rid
        assert p_leg.path == d_leg.path == "/v1/chat/completions"
        assert r.json()["choices"][0]["message"]["content"] == " t0 t1 t2"


async def test_below_threshold_never_touches_prefill(tiny_model_path):
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        for stream in (False, True):
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 2, "stream": stream})
            assert r.status_code == 200
        assert completion_legs(ps[0]) == []
        legs = completion_legs(ds[0])
        assert len(legs) == 2 and all("kv_transfer_params" not in leg.body for leg in legs)


async def test_round_robin_over_several_instances(tiny_model_path):
    async with topology(tiny_model_path, n_prefill=2, n_decode=2) as (c, url, ps, ds, app):
        for _ in range(4):
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 2})
            assert r.status_code == 200
        assert [len(completion_legs(e)) for e in (*ps, *ds)] == [2, 2, 2, 2]


async def test_usage_reports_prefill_view(tiny_model_path):
    """D counts the transferred prompt as cached; the client sees P's view (stream and not)."""
    async with topology(tiny_model_path, p_kw={"prefill_cached_tokens": 3}) as (c, url, ps, ds, app):
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 2})
        usage = r.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 3
        assert usage["prompt_tokens"] > 3 and usage["completion_tokens"] == 2
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 2, "stream": True,
                                                  "stream_options": {"include_usage": True}})
        usage = [e for e in sse_events(r.text) if e != "[DONE]" and e.get("usage")][-1]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 3
        assert usage["completion_tokens"] == 2
        # the decode engine itself reports the whole prompt as cached: the router rewrote it
        direct = await c.post(ds[0].url + "/v1/completions", json={
            "model": "tiny", "prompt": LONG, "max_tokens": 1,
            "kv_transfer_params": ps[0].ledger[next(iter(ps[0].ledger))]})
        assert direct.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_openai_client_unchanged(tiny_model_path, mode):
    openai = pytest.importorskip("openai")
    async with topology(tiny_model_path, mode=mode) as (c, url, ps, ds, app):
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused")
        out = await client.completions.create(model="tiny", prompt=LONG, max_tokens=4)
        assert out.choices[0].text == " t0 t1 t2 t3"
        chunks = [ch async for ch in await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": LONG}], max_tokens=3, stream=True)]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == " t0 t1 t2"
        chat = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": SHORT}],
                                                    max_tokens=2)
        assert chat.choices[0].message.content == " t0 t1"
        await client.close()
        assert completion_legs(ps[0])  # disaggregated requests did reach prefill


async def test_decode_leg_leaves_from_the_prefill_answer_callback(tiny_model_path, monkeypatch):
    """D's request is sent from the read callback that completes P's answer (no task is running
    there), before the request's task resumes; the task continues with that stream: one D leg."""
    import asyncio

    import router.dispatch.pull as pull

    seen = []
    real = pull.start_decode

    def spy(*a, **k):
        stream = real(*a, **k)
        seen.append((asyncio.current_task(), stream is not None))
        return stream

    monkeypatch.setattr(pull, "start_decode", spy)
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        for stream in (True, True, False):  # the second and third find an idle pooled connection to D
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 3,
                                                      "stream": stream})
            assert r.status_code == 200
            if stream:
                assert sse_events(r.text)[-1] == "[DONE]"
            else:
                assert r.json()["choices"][0]["text"] == " t0 t1 t2"
        assert [task for task, _ in seen] == [None, None, None]
        assert seen[1][1] and seen[2][1]  # sent then and there
        assert len(completion_legs(ds[0])) == 3 and len(completion_legs(ps[0])) == 3
        assert all(i.in_flight == 0 for i in app.state.pdr.registry)


async def test_cancelled_between_prefill_answer_and_task_closes_the_started_decode_leg(tiny_model_path, monkeypatch):
    """The client leaves after P answered and D's request left from P's read callback, before the
    request's task resumed: D's connection is closed (D aborts), its lease released, and the
    prefill counted as orphaned (cancelled)."""
    import asyncio

    import router.dispatch.pull as pull
    from router.dispatch import Job
    from tests.unit.metricskit import Scrape

    real, work = pull.start_decode, []

    def cancel_after_start(*a, **k):
        stream = real(*a, **k)
        work[0].cancel()  # the task has not resumed yet: it meets the cancellation at its await
        return stream

    async with topology(tiny_model_path, engine_kw={"itl_s": 0.5}) as (c, url, ps, ds, app):
        st = app.state.pdr
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 2, "stream": True})
        assert r.status_code == 200  # a pooled connection to D now waits idle
        monkeypatch.setattr(pull, "start_decode", cancel_after_start)
        body = {"model": "tiny", "prompt": LONG, "max_tokens": 2, "stream": True}
        job = Job(kind="completions", path="/v1/completions", body=body, stream=True, request_id="cancel-1",
                  prompt_tokens=100, model="tiny", route="disaggregated")
        work.append(asyncio.ensure_future(st.dispatcher.run(job)))
        with pytest.raises(asyncio.CancelledError):
            await work[0]
        d_leg = await ds[0].wait_for(lambda q: q.method == "POST" and q.headers.get("x-request-id") == "cancel-1"
                                     and q.t_end is not None, timeout=5)
        assert d_leg.disconnected
        assert all(i.in_flight == 0 for i in st.registry)
        m = Scrape((await c.get("/metrics")).text)
        assert m.get("pd_router_orphaned_prefills_total", reason="cancelled") == 1


async def test_prefill_answer_that_is_not_json_is_a_502_and_no_decode_leg(tiny_model_path):
    """P answers 200 with something that is not JSON: the answer callback leaves it to the leg,
    which turns it into the client's 502; no decode leg, nothing orphaned, nothing leased."""
    from launch.fake_engine import Fault
    from tests.unit.metricskit import Scrape

    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        ps[0].fault = Fault(garbage=True, legs={"prefill"})
        for stream in (True, False):
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 2,
                                                      "stream": stream})
            assert r.status_code == 502, r.text
            assert r.json()["error"]["message"] == "prefill instance answered with invalid JSON"
        assert completion_legs(ds[0]) == []
        assert all(i.in_flight == 0 for i in app.state.pdr.registry)
        m = Scrape((await c.get("/metrics")).text)
        assert m.total("pd_router_orphaned_prefills_total") == 0

"""Errors: bad input -> 4xx from the router; engine failures -> the right status, never a silent 200."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from launch.fake_engine import Fault
from tests.unit.routerkit import LONG, SHORT, completion_legs, sse_events, topology


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert set(err) >= {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize("raw,param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (b'{"model": "tiny"}', "prompt"),
    (b'{"model": "tiny", "prompt": ""}', None),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 0}', "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": -5}', "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": "ten"}', "max_tokens"),
    (b'{"model": "tiny", "prompt": "x", "n": 100000}', "n"),
    (b'{"model": "tiny", "prompt": "x", "stream": "yes"}', "stream"),
    (b'{"model": 5, "prompt": "x"}', "model"),
    (b'{"model": "tiny", "prompt": [1, "a"]}', "prompt"),
    (b'{"model": "tiny", "prompt": "x", "kv_transfer_params": {"do_remote_prefill": true}}', "kv_transfer_params"),
])
async def test_bad_completion_bodies(tiny_model_path, raw, param):
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        r = await c.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        if raw == b'{"model": "tiny", "prompt": ""}':
            # an empty string prompt is the engine's call, but never a router crash
            assert r.status_code in (200, 400)
            return
        assert_openai_error(r, 400, param)
        assert completion_legs(ps[0]) == [] and completion_legs(ds[0]) == []


@pytest.mark.parametrize("raw,param", [
    (b'{"model": "tiny", "messages": []}', "messages"),
    (b'{"model": "tiny", "messages": [{"content": "x"}]}', "messages"),
    (b'{"model": "tiny", "messages": "hello"}', "messages"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": 7}]}', "messages"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}',
     "max_completion_tokens"),
])
async def test_bad_chat_bodies(tiny_model_path, raw, param):
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        r = await c.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert_openai_error(r, 400, param)


async def test_unknown_model_and_bad_request_id(tiny_model_path):
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        r = await c.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        err = assert_openai_error(r, 404, "model")
        assert err["code"] == "model_not_found"
        for bad in ("a b", "___prefill_addr_10.0.0.1:5___decode_addr_x", "x" * 300):
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "x"}, headers={"X-Request-Id": bad})
            assert_openai_error(r, 400, "X-Request-Id")
        assert completion_legs(ds[0]) == []


async def test_context_length_checked_by_router(tiny_model_path):
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 5000})
        err = assert_openai_error(r, 400)
        assert "maximum context length is 1024" in err["message"]


@pytest.mark.parametrize("status,expect", [(500, 502), (503, 502), (400, 400), (422, 422)])
async def test_prefill_error_status(tiny_model_path, status, expect):
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        ps[0].fault = Fault(status=status, message="boom from prefill")
        for stream in (False, True):
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 2, "stream": stream})
            err = assert_openai_error(r, expect)
            assert "boom from prefill" in err["message"]
        assert completion_legs(ds[0]) == []  # D never saw a request whose prefill failed


async def test_prefill_connection_refused(tiny_model_path):
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        await ps[0].close()
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 2})
        assert_openai_error(r, 502)


async def test_decode_error_before_first_byte(tiny_model_path):
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        ds[0].fault = Fault(status=500, message="decode exploded")
        for stream in (False, True):
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 2, "stream": stream})
            err = assert_openai_error(r, 502)
            assert "decode exploded" in err["message"]


@pytest.mark.parametrize("prompt", [SHORT, LONG])
async def test_decode_dies_mid_stream_gives_sse_error(tiny_model_path, prompt):
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        ds[0].fault = Fault(drop_after_chunks=2)
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 8, "stream": True})
        assert r.status_code == 200
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert "error" in events[-2] and events[-2]["error"]["message"]
        m = await c.get("/metrics")
        assert 'outcome="upstream_error"' in m.text


async def test_garbage_from_decode_is_an_error(tiny_model_path):
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        ds[0].fault = Fault(garbage=True)
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 2})
        assert_openai_error(r, 502)
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 2, "stream": True})
        err = assert_openai_error(r, 502)  # the first event is checked before the client gets a 200
        assert err["code"] == "bad_stream"


async def test_prefill_without_kv_params_is_an_error(tiny_model_path, monkeypatch):
    """A prefill engine without a KV connector answers normally: that must not look like success."""
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        monkeypatch.setattr(ps[0], "_kv_answer", lambda *a, **k: None)  # an engine with no KV connector
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 2})
        err = assert_openai_error(r, 502)
        assert "kv_transfer_params" in err["message"]
        assert completion_legs(ds[0]) == []
        m = await c.get("/metrics")
        assert 'pd_router_orphaned_prefills_total{reason="no_kv_params"} 1.0' in m.text


async def test_no_decode_instance_is_503(tiny_model_path):
    async with topology(tiny_model_path, n_decode=1) as (c, url, ps, ds, app):
        st = app.state.pdr
        for inst in st.registry.of_role("decode"):
            st.registry.set_health(inst, False)
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 2})
        assert_openai_error(r, 503)
        h = await c.get("/health")
        assert h.status_code == 503


async def test_in_flight_returns_to_zero(tiny_model_path):
    async with topology(tiny_model_path, n_prefill=2, n_decode=2, engine_kw={"itl_s": 0.005}) as (c, url, ps, ds, app):
        ds[1].fault = Fault(drop_after_chunks=1)
        reqs = [c.post("/v1/completions", json={"model": "tiny", "prompt": LONG if i % 2 else SHORT, "max_tokens": 4,
                                                 "stream": bool(i % 3)}) for i in range(24)]
        await asyncio.gather(*reqs)
        st = app.state.pdr
        assert st.in_flight == 0
        assert all(i.in_flight == 0 for i in st.registry)


async def test_prefill_stopping_at_first_token_runs_decode_only(tiny_model_path, monkeypatch):
    """P's only token was EOS: it keeps no KV and returns no params. Not an orphan, not an
    error: the decode instance computes the prompt itself (and stops the same way)."""
    async with topology(tiny_model_path) as (c, url, ps, ds, app):
        import router.dispatch.pull as pull

        monkeypatch.setattr(ps[0], "_kv_answer", lambda *a, **k: None)  # P kept no KV ...
        monkeypatch.setattr(pull, "finished_at_first_token", lambda doc: True)  # ... because it stopped
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 2})
        assert r.status_code == 200, r.text
        [d_leg] = completion_legs(ds[0])
        assert "kv_transfer_params" not in d_leg.body
        assert 'pd_router_orphaned_prefills_total{' not in (await c.get("/metrics")).text


def test_finished_at_first_token():
    from router.dispatch.pull import finished_at_first_token
    assert finished_at_first_token({"choices": [{"finish_reason": "stop", "text": ""}]})
    assert not finished_at_first_token({"choices": [{"finish_reason": "length", "text": "x"}]})
    assert not finished_at_first_token({"choices": []})


async def test_a_tokenizer_that_cannot_load_is_a_503_that_names_it(tmp_path):
    """A tokenizer path that does not exist: every request that needs a count gets a 503
    service_unavailable naming the path and the reason (not a 500 "internal router error"),
    nothing reaches an engine, /health shows the same reason, and the next request tries again."""
    missing = tmp_path / "no-such-model"
    async with topology(missing) as (c, url, ps, ds, app):
        for path, body in (("/v1/completions", {"prompt": LONG}),
                           ("/v1/completions", {"prompt": SHORT, "stream": True}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]})):
            r = await c.post(path, json={"model": "tiny", "max_tokens": 5, **body})
            assert_openai_error(r, 503)
            err = r.json()["error"]
            assert (err["type"], err["code"]) == ("service_unavailable", "tokenizer_unavailable")
            assert str(missing) in err["message"] and "no such file or directory" in err["message"]
        assert not completion_legs(ps[0]) and not completion_legs(ds[0])
        health = (await c.get("/health")).json()
        assert "no such file or directory" in health["tokenizer"]["error"]
        missing.mkdir()  # still not a tokenizer: the next request loads again and says why
        r = await c.post("/v1/completions", json={"model": "tiny", "max_tokens": 5, "prompt": LONG})
        assert_openai_error(r, 503)
        assert "no such file or directory" not in r.json()["error"]["message"]
        assert str(missing) in r.json()["error"]["message"]

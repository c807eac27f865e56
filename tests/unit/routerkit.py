"""Helpers for router tests with fake engines: start engines + router, post, read SSE."""

from __future__ import annotations

import contextlib

import httpx
import orjson

from launch.fake_engine import FakeEngine
from router.settings import InstanceSpec, Settings
from tests.conftest import run_router


def pspec(e: FakeEngine) -> InstanceSpec:
    return InstanceSpec.parse(f"{e.url}?engine_id={e.engine_id}&kv_host=127.0.0.1&kv_port={e.kv_port}&tp=1&pp=1")


@contextlib.asynccontextmanager
async def topology(tokenizer, n_prefill=1, n_decode=1, engine_kw=None, p_kw=None, d_kw=None, **settings):
    """Fake P and D engines (strict) behind a router. Yields (client, url, prefills, decodes, app)."""
    ledger: dict = {}
    engine_kw = engine_kw or {}
    ps = [FakeEngine(**{"role": "prefill", "engine_id": f"prefill-{i}", "kv_port": 5600 + i, "strict": True,
                        "ledger": ledger, **engine_kw, **(p_kw or {})}) for i in range(n_prefill)]
    ds = [FakeEngine(**{"role": "decode", "engine_id": f"decode-{i}", "strict": True, "ledger": ledger,
                        **engine_kw, **(d_kw or {})}) for i in range(n_decode)]
    async with contextlib.AsyncExitStack() as stack:
        for e in (*ps, *ds):
            await stack.enter_async_context(e)
        s = Settings(prefill=tuple(pspec(p) for p in ps), decode=tuple(InstanceSpec.parse(d.url) for d in ds),
                     tokenizer=str(tokenizer), **{"threshold": 16, "health_interval": 30.0, **settings})
        url, app = await stack.enter_async_context(run_router(s))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=20))
        yield client, url, ps, ds, app


def completion_legs(engine: FakeEngine) -> list:
    return [r for r in engine.requests if r.path.startswith("/v1/") and r.method == "POST"]


def sse_events(text: str) -> list:
    out = []
    for block in text.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[6:]
        out.append(data if data == "[DONE]" else orjson.loads(data))
    return out


LONG = "The quick brown fox jumps over the lazy dog. " * 12  # well above a threshold of 16 tokens
SHORT = "hi"

"""--count-tokens when-needed: byte-length bounds of the prompt's token count, and a router that
skips tokenizing only when the bounds settle the route and the context check."""

from __future__ import annotations

import asyncio
import random

from launch.fake_engine_wire import prompt_chars
from router.tokenizer import TokenCounter, _load, byte_bounds
from tests.unit.metricskit import scrape
from tests.unit.routerkit import LONG, SHORT, completion_legs, topology

SAMPLES = ["", "a", "hi", " ", "  leading and trailing  ", "a" * 1000, "hello world " * 80, "déjà vu ☃ 💥 日本語",
           "\n\n\t\r", "0123456789" * 20, "\u0301\u0301x", "def f(x):\n    return x * 2\n" * 10]


def test_bounds_hold_for_the_tiny_tokenizer(tiny_model_path):
    tok = _load(str(tiny_model_path))
    b = byte_bounds(tok)
    assert b is not None  # byte-level BPE, no normalizer: bounded
    counter = TokenCounter(str(tiny_model_path))
    counter._tok = tok
    rnd = random.Random(7)
    alphabet = "ab cd\n\té☃💥日0.,"
    texts = SAMPLES + ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 400))) for _ in range(200)]
    for text in texts:
        lower, upper = counter.bounds("completions", {"prompt": text})
        exact = len(tok.encode(text, add_special_tokens=True))
        assert lower <= exact <= upper, (text[:40], lower, exact, upper)
    assert counter.bounds("chat", {"messages": []}) is None
    assert counter.bounds("completions", {"prompt": [1, 2, 3]}) is None
    counter.close()


def test_unbounded_tokenizers_return_none():
    class Fake:
        def __init__(self, spec: str):
            self.backend_tokenizer = type("B", (), {"to_str": lambda _self: spec})()

        def encode(self, text, add_special_tokens=True):
            return [1]

        def get_vocab(self):
            return {"a": 0, "bb": 1}

    bert = '{"normalizer": {"type": "BertNormalizer"}, "pre_tokenizer": null, "model": {"type": "WordPiece"}}'
    nfkc = '{"normalizer": {"type": "NFKC"}, "pre_tokenizer": null, "model": {"type": "BPE"}}'
    ws = '{"normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "model": {"type": "BPE"}}'
    for spec in (bert, nfkc, ws):
        assert byte_bounds(Fake(spec)) is None, spec
    sp = ('{"normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\\u2581"}, '
          '{"type": "Replace", "pattern": {"String": " "}, "content": "\\u2581"}]}, "pre_tokenizer": null, '
          '"model": {"type": "BPE", "byte_fallback": true}}')
    expand, extra, max_bytes, specials = byte_bounds(Fake(sp))
    assert expand == 3 and extra >= 3 and max_bytes == 2 and specials == 1
    no_fallback = '{"normalizer": null, "pre_tokenizer": null, "model": {"type": "Unigram"}}'
    assert byte_bounds(Fake(no_fallback))[2] == 0  # no lower bound: an unknown token may cover anything


async def test_when_needed_skips_tokenizing_only_when_settled(tiny_model_path):
    # threshold 16: SHORT ("hi", <= 10 tokens by the bound) is certainly direct; LONG (540 bytes,
    # >= 7 tokens by the bound) is not settled, so it is tokenized as always
    async with topology(tiny_model_path, count_tokens="when-needed") as (c, url, ps, ds, app):
        for prompt, stream in ((SHORT, True), (SHORT, False), (LONG, True)):
            r = await c.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3,
                                                      "stream": stream})
            assert r.status_code == 200
        m = await scrape(c)
        assert m.get("pd_router_tokenize_seconds_count") == 1  # LONG only
        assert m.nonzero("pd_router_routing_decisions_total") == {
            (("reason", "below_threshold"), ("route", "direct")): 2,
            (("reason", "above_threshold"), ("route", "disaggregated")): 1}
        # skipped prompts are counted with the engine's usage.prompt_tokens (the fake: chars / 4)
        engine_count = prompt_chars("/v1/completions", {"prompt": SHORT})[1]
        assert m.get("pd_router_prompt_tokens_total", route="direct") == 2 * engine_count
        n_long = await app.state.pdr.tokens.count("completions", {"model": "tiny", "prompt": LONG})
        assert m.get("pd_router_prompt_tokens_total", route="disaggregated") == n_long
        assert len(completion_legs(ps[0])) == 1 and len(completion_legs(ds[0])) == 3


async def test_when_needed_keeps_the_context_check(tiny_model_path):
    # a max_model_len that the upper bound does not clear: the prompt is tokenized and checked
    async with topology(tiny_model_path, count_tokens="when-needed", threshold=100_000,
                        engine_kw={"max_model_len": 64}) as (c, url, ps, ds, app):
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 3})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": SHORT, "max_tokens": 3})
        assert r.status_code == 200
        m = await scrape(c)
        assert m.get("pd_router_tokenize_seconds_count") == 1  # LONG was counted, SHORT was settled


def test_fast_count_equals_transformers_encode_and_is_refused_when_it_disagrees(tiny_model_path):
    """The count path (`encode_batch_fast`, no offsets) must give transformers' count exactly;
    a tokenizer whose fast path disagrees on the probes counts through `tok.encode`."""
    from router.tokenizer import _count, _encode_len, _fast_counter

    tok = _load(str(tiny_model_path))
    count = _fast_counter(tok)
    assert count is not None
    rnd = random.Random(11)
    alphabet = "ab cd\n\té☃💥日0.,<>/[]"
    texts = SAMPLES + ["".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 600))) for _ in range(200)]
    for text in texts:
        for special in (True, False):
            assert count(text, special) == len(tok.encode(text, add_special_tokens=special)), text[:40]
    chat = {"messages": [{"role": "user", "content": "déjà vu, " * 30}]}
    rendered = tok.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=False)
    assert _count(tok, "chat", chat) == len(tok.encode(rendered, add_special_tokens=False))

    class Disagrees:
        class backend_tokenizer:  # noqa: N801 - stands in for tokenizers.Tokenizer
            @staticmethod
            def encode_batch_fast(texts, add_special_tokens=True):
                return [type("E", (), {"ids": [0] * (len(t) + 1)})() for t in texts]

        @staticmethod
        def encode(text, add_special_tokens=True):
            return list(text)

    assert _fast_counter(Disagrees()) is None
    assert _encode_len(Disagrees(), "abc", True) == 3  # the reference path


async def test_short_prompts_are_counted_inline_long_ones_in_the_pool(tiny_model_path, monkeypatch):
    """The thread hop costs about what encoding a short prompt does: short prompts are counted
    on the loop, long ones (and large chats) in the pool; the counts are the same either way."""
    from router import tokenizer

    counter = TokenCounter(str(tiny_model_path), inline_chars=100)
    await counter.ensure_loaded()
    hops = []
    loop = asyncio.get_running_loop()
    real = loop.run_in_executor

    def spy(pool, fn, *args):
        hops.append(args[1])
        assert args[-1] is False  # no piece counting in the threads: the tokenizer releases the GIL
        return real(pool, fn, *args)

    monkeypatch.setattr(loop, "run_in_executor", spy)
    short, long_ = "word " * 20, "word " * 400
    assert await counter.count("completions", {"prompt": short}) == tokenizer._count(counter._tok, "completions",
                                                                                      {"prompt": short})
    assert hops == []
    n_long = await counter.count("completions", {"prompt": long_})
    assert hops == ["completions"] and n_long == tokenizer._count(counter._tok, "completions", {"prompt": long_})
    await counter.count("chat", {"messages": [{"role": "user", "content": "hi"}]})
    await counter.count("chat", {"messages": [{"role": "user", "content": long_}]})
    await counter.count("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]})
    assert hops == ["completions", "chat", "chat"]  # long content, and content parts, go to the pool
    await counter.count("completions", {"prompt": [1, 2, 3]})
    assert len(hops) == 3
    counter.close()

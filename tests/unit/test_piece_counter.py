"""PieceCounter: token counts of plain text from the tokenizer's pre-tokenizer pieces, cached per
piece, must equal the tokenizer's own count exactly, for GPT-2-style (ByteLevel regex) and for
Llama 3 / Qwen 2-style (Split regex + ByteLevel) tokenizers; anything it does not take (non-ASCII
or control characters, other tokenizer shapes) is left to the tokenizer."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from router import tokenizer as T
from router.tokenizer import PieceCounter, _load

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Pieces of text that exercise the patterns' corners: contractions in both cases, digit runs,
# whitespace runs before words and at the end, CRLF, punctuation runs, the added tokens.
ATOMS = ["a", "Z", "word", "Hello", " ", "  ", "   ", "\t", "\n", "\r\n", "\r", "'s", "'LL", "'", "'ve",
         "0", "12", "12345", "3.14", ",", "!!", "...", "-->", "{}", "#", "_", "x_y", "<", ">", "|",
         "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_end", "def f(x):", "    return"]
OTHER = ["é", "日本", "💥", "\x0b", "\x0c", "\x1c", "\x00", "\u00a0", "\u2028"]


def _variant(path, pre_tokenizer: dict, normalizer: dict | None = None, added: list | None = None):
    """The tiny tokenizer with another pre-tokenizer / normalizer (same vocabulary and merges)."""
    spec = json.loads((path / "tokenizer.json").read_text())
    spec["pre_tokenizer"], spec["normalizer"] = pre_tokenizer, normalizer
    if added is not None:
        spec["added_tokens"] = added
    backend = Tokenizer.from_str(json.dumps(spec))
    return type("Tok", (), {"backend_tokenizer": backend})()


def _split_bytelevel(pattern: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


@pytest.fixture(scope="module")
def tokenizers(tiny_model_path):
    tiny = _load(str(tiny_model_path))
    return {
        "gpt2": tiny,
        "llama3": _variant(tiny_model_path, _split_bytelevel(LLAMA3)),
        "qwen2": _variant(tiny_model_path, _split_bytelevel(QWEN2), {"type": "NFC"}),
    }


def _exact(tok, text: str, special: bool) -> int:
    return len(tok.backend_tokenizer.encode(text, add_special_tokens=special).ids)


texts = st.lists(st.one_of(st.sampled_from(ATOMS), st.text(alphabet=st.characters(
    min_codepoint=0x20, max_codepoint=0x7e), max_size=12)), max_size=60).map("".join)
mixed = st.lists(st.one_of(st.sampled_from(ATOMS), st.sampled_from(OTHER)), min_size=1,
                 max_size=30).map("".join)


@pytest.mark.parametrize("name", ["gpt2", "llama3", "qwen2"])
def test_piece_counts_equal_the_tokenizer(tokenizers, name):
    tok = tokenizers[name]
    counter = PieceCounter.from_tokenizer(tok)
    assert counter is not None

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(texts, st.booleans())
    def check(text, special):
        assert counter.count(text, special) == _exact(tok, text, special), repr(text)

    check()
    # the cache is filled by now: counts from cached pieces are still exact
    long = "The quick brown fox's 12345 jumps\r\n  over <|im_end|> the lazy dog... " * 200
    assert counter.count(long, True) == _exact(tok, long, True)
    assert counter.count(long, True) == _exact(tok, long, True)


@pytest.mark.parametrize("name", ["gpt2", "llama3"])
def test_texts_it_does_not_take_are_left_to_the_tokenizer(tokenizers, name):
    tok = tokenizers[name]
    counter = PieceCounter.from_tokenizer(tok)

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(mixed)
    def check(text):
        plain = all(c in "\t\n\r" or 0x20 <= ord(c) <= 0x7e for c in text)
        got = counter.count(text, True)
        assert (got is not None) == plain, repr(text)
        if plain:
            assert got == _exact(tok, text, True)

    check()


def test_encode_len_uses_pieces_and_falls_back(tiny_model_path, monkeypatch):
    """`_encode_len` (what `_count` uses) counts plain text by pieces and everything else with
    the tokenizer, with the same result as transformers' encode either way."""
    tok = _load(str(tiny_model_path))
    T._COUNTERS.pop(id(tok), None)
    calls = []
    real = PieceCounter._pieces

    def spy(self, text):
        calls.append(text)
        return real(self, text)

    monkeypatch.setattr(PieceCounter, "_pieces", spy)
    for text in ("plain ascii text, 42 of it", "déjà vu ☃", "ctrl\x0bchar", "<|im_start|>user\nhi<|im_end|>"):
        for special in (True, False):
            assert T._encode_len(tok, text, special) == len(tok.encode(text, add_special_tokens=special))
    assert "plain ascii text, 42 of it" in calls and "user\nhi" in calls
    assert not any("déjà" in c or "\x0b" in c for c in calls)
    chat = {"messages": [{"role": "user", "content": "what's 2+2? " * 20}]}
    rendered = tok.apply_chat_template(chat["messages"], add_generation_prompt=True, tokenize=False)
    assert T._count(tok, "chat", chat) == len(tok.encode(rendered, add_special_tokens=False))


def test_normalized_added_tokens_count_exactly(tiny_model_path):
    """GPT-2's own tokenizer marks its special token `normalized`: all of one kind is fine."""
    spec = json.loads((tiny_model_path / "tokenizer.json").read_text())
    added = [{**a, "normalized": True} for a in spec["added_tokens"]]
    bytelevel = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tok = _variant(tiny_model_path, bytelevel, added=added)
    counter = PieceCounter.from_tokenizer(tok)
    assert counter is not None
    for text in ("a<|endoftext|>b", "<|im_start|>user\nhi<|im_end|>\n", "x <|im_end|><|im_end|> y"):
        for special in (True, False):
            assert counter.count(text, special) == _exact(tok, text, special), text


def test_other_tokenizer_shapes_get_no_piece_counter(tiny_model_path):
    path = tiny_model_path
    bytelevel = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    refused = {
        "lowercase": _variant(path, bytelevel, {"type": "Lowercase"}),
        "prefix space": _variant(path, {**bytelevel, "add_prefix_space": True}),
        "whitespace": _variant(path, {"type": "Whitespace"}),
        "split merged": _variant(path, {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"\s+"}, "behavior": "MergedWithNext", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}),
        "capture groups": _variant(path, _split_bytelevel(r"(\p{L}+)|\s+|\p{N}+|[^\s\p{L}\p{N}]+")),
        "lstrip added token": _variant(path, bytelevel, added=[
            {"id": 0, "content": "<|endoftext|>", "single_word": False, "lstrip": True, "rstrip": False,
             "normalized": False, "special": True}]),
        # added tokens of both kinds: tokenizers matches them in two passes
        "mixed added tokens": _variant(path, bytelevel, added=[
            {"id": 0, "content": "<|endoftext|>", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True},
            {"id": 1, "content": "<|im_start|>", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": True, "special": True}]),
        # a regex that leaves gaps (digits): the probes disagree, so it is not used
        "gaps": _variant(path, _split_bytelevel(r" ?\p{L}+|\s+|[^\s\p{L}\p{N}]+")),
    }
    for name, tok in refused.items():
        assert PieceCounter.from_tokenizer(tok) is None, name
    assert PieceCounter.from_tokenizer(object()) is None


@pytest.mark.parametrize("pattern", [T.GPT2_PATTERN, LLAMA3, QWEN2])
def test_ascii_pattern_splits_plain_text_as_the_unicode_one(pattern):
    """The counter runs the piece regex with `re`, \\p{L} and \\p{N} made ASCII (texts with anything
    else never reach it): on plain texts it must cut exactly the pieces `regex` cuts."""
    import regex

    ascii_ = T._ascii_pattern(pattern)
    assert ascii_ is not None and r"\p" not in ascii_
    fast, ref = __import__("re").compile(ascii_), regex.compile(pattern)

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(texts)
    def check(text):
        assert fast.findall(text) == ref.findall(text), repr(text)

    check()


def test_ascii_pattern_declines_what_it_cannot_translate():
    assert T._ascii_pattern(r"\p{Lu}+|\s+") is None
    assert T._ascii_pattern(r"\P{L}+") is None
    assert T._ascii_pattern(r"[[a-z]&&[^aeiou]]") is None
    assert T._ascii_pattern(r"[^\r\n\p{L}\p{N}]?\p{L}+") == r"[^\r\nA-Za-z0-9]?[A-Za-z]+"
    assert T._ascii_pattern(r"[]\p{N}]+") == r"[]0-9]+"


@pytest.mark.parametrize("name", ["gpt2", "llama3", "qwen2"])
def test_counter_splits_with_re(tokenizers, name):
    import re
    counter = PieceCounter.from_tokenizer(tokenizers[name])
    assert counter._split.__self__.__class__ is re.Pattern

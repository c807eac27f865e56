"""Prompt token counting, cached by prompt hash; off the event loop unless the prompt is short.

Short prompts (up to `INLINE_CHARS` characters, ~0.3 ms of encoding) are counted on the
event loop: handing them to a worker thread cost the loop about as much CPU as the encoding
itself (a future, a queue, two wake-ups; docs/performance.md), and on the router's one core
the thread runs in the same CPU time anyway. Longer prompts (a 16k-token one takes ~20 ms)
go to the thread pool, so they never stall other requests' streams.

Short plain-ASCII prompts through a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen 2 shapes) are
counted by `PieceCounter`: the tokenizer's own pre-tokenizer pieces, each piece's count cached,
checked equal to the tokenizer on probe texts; ~4.5x cheaper than encoding. Everything else is
encoded by the tokenizer (long prompts too: in the threads, where it releases the GIL).

Counts follow vLLM's own rules so the threshold sees what the engine sees:
completions encode the prompt with special tokens; chat renders the chat template
to text (generation prompt on, as vLLM does by default) and encodes it without
special tokens. The tokenizer loads lazily, from `--tokenizer` or from the model
root the backends report in `/v1/models`, always offline (local files only).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import sys
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import orjson

from router.errors import BadRequest, TokenizerUnavailable

log = logging.getLogger("pd_router.tokenizer")
INLINE_CHARS = 2048  # prompts up to this many characters are counted on the event loop


def _inline_size(kind: str, body: dict) -> int:
    """Characters to encode for `_count` (what decides inline or thread); chat counts its
    message contents, and anything unusual counts as large."""
    if kind == "chat":
        total = 0
        messages = body.get("messages")
        if not isinstance(messages, list) or body.get("tools"):
            return sys.maxsize
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                total += len(content)
            elif content is not None:
                return sys.maxsize
        return total
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return len(prompt[0])
    return 0  # token ids: nothing to encode


class TokenCounter:
    def __init__(self, source: str | None = None, *, threads: int = 2, cache_size: int = 4096,
                 inline_chars: int = INLINE_CHARS):
        self._source = source
        self.inline_chars = inline_chars
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="pdr-tok")
        self._cache: OrderedDict[bytes, int] = OrderedDict()
        self._cache_size = cache_size
        self._tok = None
        self._bounds = None  # byte_bounds(tokenizer), once loaded (False: none known)
        self._load_error: str | None = None
        self._loading: asyncio.Future | None = None
        self.hits = 0
        self.misses = 0

    @property
    def source(self) -> str | None:
        return self._source

    @property
    def loaded(self) -> bool:
        return self._tok is not None

    @property
    def load_error(self) -> str | None:
        return self._load_error

    def offer_source(self, source: str | None) -> None:
        """A backend reported where its model lives; use it if nothing was configured."""
        if source and self._source is None and self._tok is None:
            self._source = source
            self._load_error = None
            self.preload()

    def preload(self) -> None:
        """Start loading in the background (call from a running loop); errors surface on first use."""
        if self._tok is None and self._loading is None and self._source is not None:
            self._loading = asyncio.get_running_loop().run_in_executor(self._pool, _load, self._source)
            self._loading.add_done_callback(self._loaded)

    @property
    def loading(self) -> asyncio.Future | None:
        """The background load started by `preload` (None if none is running or needed)."""
        return self._loading if self._tok is None else None

    def _loaded(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self._tok = fut.result()

    async def ensure_loaded(self) -> None:
        if self._tok is not None:
            return
        if self._source is None:
            raise BadRequest("no tokenizer: pass --tokenizer or start a backend that reports its model path",
                             code="no_tokenizer")
        self.preload()
        try:
            self._tok = await asyncio.shield(self._loading)
        except Exception as exc:  # noqa: BLE001 - reported to the caller, retried on the next request
            self._loading = None
            self._load_error = f"{type(exc).__name__}: {exc}"
            log.error("cannot load tokenizer %r: %s", self._source, self._load_error)
            raise TokenizerUnavailable(f"the router cannot load its tokenizer {self._source!r} "
                                       f"({self._load_error})") from exc

    def bounds(self, kind: str, body: dict[str, Any]) -> tuple[int, int] | None:
        """(lower, upper) bounds of `count(kind, body)` from the prompt's UTF-8 length alone,
        without tokenizing; None when no safe bound is known (chat, token-id or batched
        prompts, an unloaded tokenizer, or a normalizer/pre-tokenizer outside `byte_bounds`).
        Cheap: no encoding, no thread hop."""
        if kind != "completions" or self._tok is None:
            return None
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return None
        b = self._bounds
        if b is None:
            b = self._bounds = byte_bounds(self._tok) or False
        if b is False:
            return None
        n = len(prompt) if prompt.isascii() else len(prompt.encode("utf-8", "surrogatepass"))
        expand, extra, max_bytes, specials = b
        lower = specials + (-(-n // max_bytes) if max_bytes else 0)
        return lower, specials + expand * n + extra

    async def count(self, kind: str, body: dict[str, Any]) -> int:
        """Number of prompt tokens of one request (the first prompt of a batch)."""
        key = _cache_key(kind, body)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return hit
        self.misses += 1
        await self.ensure_loaded()
        if _inline_size(kind, body) <= self.inline_chars:
            n = _count(self._tok, kind, body)
        else:
            # the tokenizer releases the GIL while it encodes; the piece counter would not
            n = await asyncio.get_running_loop().run_in_executor(self._pool, _count, self._tok, kind, body, False)
        self._cache[key] = n
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return n

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def block_torch() -> None:
    """The router never needs torch: make transformers see it as absent (fast import, small RSS).

    Call before transformers is imported, in the router's own process only.
    """
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # `import torch` now raises ImportError; find_spec returns None
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" banner


_LOAD_LOCK = threading.Lock()
_LOADED: dict[str, object] = {}


def _load(source: str):
    """Load (once per process and source) a fast tokenizer; serialised because a concurrent
    first `import transformers` in two threads sees a half-initialised module."""
    with _LOAD_LOCK:
        tok = _LOADED.get(source)
        if tok is None:
            tok = _LOADED[source] = _load_uncached(source)
        return tok


def local_path_problem(source: str | None) -> str | None:
    """Why `source`, written as a local path (absolute, ./, ../ or ~), cannot be a tokenizer
    directory; None for a path that exists and for anything else (a hub name, resolved from
    the local cache when loaded)."""
    if not source or not (os.path.isabs(source) or source.startswith((".", "~"))):
        return None
    path = os.path.expanduser(source)
    if not os.path.exists(path):
        return f"{source}: no such file or directory"
    if not os.path.isdir(path):
        return f"{source}: not a directory (a tokenizer is a model directory with tokenizer files)"
    return None


def _load_uncached(source: str):
    problem = local_path_problem(source)
    if problem:
        raise FileNotFoundError(problem)
    source = os.path.expanduser(source)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer  # heavy import, done in a worker thread

    tok = AutoTokenizer.from_pretrained(source, local_files_only=True, use_fast=True)
    if not getattr(tok, "is_fast", False):
        raise RuntimeError(f"{source}: no fast tokenizer")
    tok.model_max_length = sys.maxsize  # we only count; the context check is the router's own
    log.info("tokenizer loaded from %s", source)
    return tok


def _cache_key(kind: str, body: dict) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(kind.encode())
    if kind == "chat":
        h.update(orjson.dumps([body.get("messages"), body.get("tools"), body.get("chat_template_kwargs"),
                               body.get("add_generation_prompt", True), body.get("continue_final_message", False)],
                              option=orjson.OPT_SORT_KEYS))
    else:
        p = body.get("prompt")
        h.update(p.encode("utf-8", "surrogatepass") if isinstance(p, str) else orjson.dumps(p))
    return h.digest()


_PROBES = ("", "Hello, world!", " leading space", "tabs\tand\nnewlines  ", "naïve café 東京 🙂", "<s>[INST] x [/INST]",
           "0123456789 " * 20)


def _fast_counter(tok):
    """`count(text, add_special_tokens) -> int` through the Rust tokenizer's `encode_batch_fast`
    (no offsets; the GIL is released while it runs): about 2.4x cheaper than `tok.encode` for a
    1,000-character prompt (158 vs 386 us, docs/performance.md). Used only when it agrees with
    `tok.encode` on a set of probe strings; None otherwise (then `tok.encode` counts)."""
    backend = getattr(tok, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is None:
        return None

    def count(text: str, add_special_tokens: bool) -> int:
        return len(fast([text], add_special_tokens=add_special_tokens)[0].ids)

    try:
        for text in _PROBES:
            for special in (True, False):
                if count(text, special) != len(tok.encode(text, add_special_tokens=special)):
                    return None
    except Exception:  # noqa: BLE001 - any surprise: keep the reference path
        return None
    return count


# GPT-2's pre-tokenizer pattern (ByteLevel with use_regex), as in the tokenizers library.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Texts the piece counter takes: printable ASCII, tab, newline, carriage return. Anything else
# (other control characters, any non-ASCII character) goes to the tokenizer, so the regex
# engines' Unicode tables (Oniguruma in tokenizers, `regex` here) never have to agree.
_NOT_PLAIN = re.compile(r"[^\t\n\r\x20-\x7e]")
_IDENTITY_ON_ASCII = {"NFC", "NFD", "NFKC", "NFKD"}


def _byte_chars() -> dict[int, str]:
    """The byte -> character table of byte-level BPE (GPT-2): printable Latin-1 bytes map to
    themselves, the other bytes to U+0100 onwards in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(0x100 + extra)
            extra += 1
    return out


class PieceCounter:
    """Exact token counts of plain text from the tokenizer's own pieces, with a count cache per
    piece: ~5x cheaper than encoding a 1,000-character prompt (docs/performance.md).

    A byte-level BPE tokenizer (GPT-2, Llama 3, Qwen 2 and their kin) first splits the text at
    its added tokens (each one token), then cuts every other stretch into pieces with one regex,
    maps each piece's bytes to characters and runs the model on each piece alone: no token
    crosses a piece. So a text's count is its added tokens, plus the sum of its pieces' counts,
    plus what the post-processor adds. The pieces come from the same regex run by the `regex`
    module on plain ASCII text (`_NOT_PLAIN`), a piece's count from the tokenizer's own model,
    and a cache keeps the counts of pieces seen (words recur; a prompt's pieces mostly hit).

    `from_tokenizer` returns None unless the tokenizer has exactly that shape: no normalizer (or
    a Unicode normal form, the identity on ASCII), a `ByteLevel` pre-tokenizer with its regex or
    a `Split` regex (isolated) followed by `ByteLevel` without one, no prefix space, a model
    without dropout, added tokens without strip or single-word rules, no truncation or padding;
    and only if it agrees with the tokenizer on probe texts. `count` returns None for texts it
    does not take (the caller encodes them)."""

    MAX_PIECES = 1 << 16  # cache entries; cleared when full

    def __init__(self, model, pattern: str, added: list[str], specials: int):
        import regex  # the tokenizers' \p{L}/\p{N} patterns; installed with transformers

        self._model = model
        compiled = regex.compile(pattern)
        if compiled.groups:  # findall would return groups, not pieces
            raise ValueError("piece pattern has capture groups")
        self._split = compiled.findall
        ascii_ = _ascii_pattern(pattern)
        if ascii_ is not None:  # ~3x faster on a 1,000-char prompt; checked against `regex` below
            fast = re.compile(ascii_)
            if not fast.groups and all(fast.findall(t) == self._split(t) for t in _PIECE_PROBES + _SPLIT_PROBES):
                self._split = fast.findall
        self._added = (re.compile("|".join(re.escape(a) for a in sorted(added, key=len, reverse=True)))
                       if added else None)
        self._added_first = tuple(sorted({a[0] for a in added}))
        self._specials = specials
        self._map = {b: c for b, c in _byte_chars().items() if b < 0x80}
        self._cache: dict[str, int] = {}

    @classmethod
    def from_tokenizer(cls, tok) -> PieceCounter | None:
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None:
            return None
        try:
            spec = orjson.loads(backend.to_str())
            if spec.get("truncation") or spec.get("padding"):
                return None
            norm = spec.get("normalizer")
            if norm is not None and norm.get("type") not in _IDENTITY_ON_ASCII:
                return None
            pattern = _piece_pattern(spec.get("pre_tokenizer"))
            model = spec.get("model") or {}
            if pattern is None or model.get("dropout") not in (None, 0, 0.0):
                return None
            added = []
            for a in spec.get("added_tokens") or []:
                if a.get("single_word") or a.get("lstrip") or a.get("rstrip") or not a.get("content"):
                    return None
                added.append(a["content"])
            if len({bool(a.get("normalized")) for a in spec.get("added_tokens") or []}) > 1:
                return None  # tokenizers splits at the two kinds in two passes; one pass is exact for one kind
            one = len(backend.encode_batch_fast(["a"], add_special_tokens=False)[0].ids)
            specials = len(backend.encode_batch_fast(["a"], add_special_tokens=True)[0].ids) - one
            counter = cls(backend.model, pattern, added, specials)
            for text in _PIECE_PROBES + tuple(added):
                for special in (True, False):
                    want = len(backend.encode_batch_fast([text], add_special_tokens=special)[0].ids)
                    if counter.count(text, special) != want:
                        log.info("token counts by piece disagree with the tokenizer on %r; not used", text)
                        return None
            counter._cache.clear()
            return counter
        except Exception:  # noqa: BLE001 - any surprise: the tokenizer counts
            log.debug("no piece counter for this tokenizer", exc_info=True)
            return None

    def count(self, text: str, add_special_tokens: bool) -> int | None:
        if _NOT_PLAIN.search(text) is not None:
            return None
        if self._added is None or not any(c in text for c in self._added_first):
            stretches, n = [text], 0
        else:  # the added tokens in it: one token each, the stretches between them by pieces
            stretches, pos = [], 0
            for m in self._added.finditer(text):
                stretches.append(text[pos:m.start()])
                pos = m.end()
            stretches.append(text[pos:])
            n = len(stretches) - 1
        for stretch in stretches:
            c = self._pieces(stretch)
            if c is None:
                return None
            n += c
        return n + (self._specials if add_special_tokens else 0)

    def _pieces(self, text: str) -> int | None:
        """Tokens of a stretch without added tokens; None if the regex leaves a gap (the
        tokenizer keeps gaps as pieces of their own; this counter does not take them)."""
        pieces = self._split(text)
        if sum(map(len, pieces)) != len(text):
            return None
        cache = self._cache
        counts = list(map(cache.get, pieces))  # no Python-level loop over the pieces seen before
        try:
            i = counts.index(None)  # C-level scans; usually only a few pieces are new
        except ValueError:
            return sum(counts)
        while True:
            piece = pieces[i]
            c = cache.get(piece)  # a repeat within this text
            if c is None:
                c = len(self._model.tokenize(piece.translate(self._map)))
                if len(cache) >= self.MAX_PIECES:
                    cache.clear()
                cache[piece] = c
            counts[i] = c
            try:
                i = counts.index(None, i + 1)
            except ValueError:
                return sum(counts)


def _piece_pattern(pre: dict | None) -> str | None:
    """The piece regex of a byte-level pre-tokenizer, or None for any other shape."""
    if pre is None:
        return None
    if pre.get("type") == "ByteLevel":
        return GPT2_PATTERN if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
    if pre.get("type") != "Sequence":
        return None
    steps = pre.get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, level = steps
    if (split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert")
            or level.get("type") != "ByteLevel" or level.get("use_regex", True)
            or level.get("add_prefix_space")):
        return None
    pat = split.get("pattern") or {}
    return pat.get("Regex")


# \p{L} and \p{N} on the texts the piece counter takes (`_NOT_PLAIN`): ASCII letters and digits.
# There, the other escapes of these patterns (\s, \S, \d, \w) mean the same to `re` and `regex`.
_ASCII_CLASSES = ((r"\p{L}", "A-Za-z"), (r"\p{N}", "0-9"))


def _ascii_pattern(pattern: str) -> str | None:
    """The piece pattern for the standard `re` module, valid on plain ASCII texts only: \p{L}
    and \p{N} become ASCII classes. None for any construct outside that simple translation
    (other Unicode properties, nested classes)."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            for prop, chars in _ASCII_CLASSES:
                if pattern.startswith(prop, i):
                    out.append(chars if in_class else f"[{chars}]")
                    i += len(prop)
                    break
            else:
                esc = pattern[i:i + 2]
                if len(esc) < 2 or esc[1] in "pPXN":
                    return None
                out.append(esc)
                i += 2
            continue
        if c == "[":
            if in_class:
                return None  # a nested set: `re` and `regex` may read it differently
            in_class = True
            out.append(c)
            i += 1
            for lead in ("^", "]"):  # "[^" and a "]" first in a class are not its end
                if pattern.startswith(lead, i):
                    out.append(lead)
                    i += 1
            continue
        if c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    try:
        re.compile("".join(out))
    except re.error:
        return None
    return "".join(out)


_SPLIT_PROBES = ("I'm 'S 'LL 'd x'VE", "abc123def 4567890 ,.;:!? ({[<>]}) \\ / | ~ ` @ # $ % ^ & * - + =",
                 "  \t\r\n  a\r\n\r\nb  \n", "___ x_y z-9 '' '")

_PIECE_PROBES = ("", "a", "Hello, world!", " leading space", "tabs\tand\nnewlines  \r\n", "x   y\n\n\nz",
                 "don't you'll I'M we've 'd", "0123456789 " * 20, "a1b2c3 !!?? ...;; --> <<>> {}[]",
                 "    def f(x):\n        return x  # done\n", "trailing   ")

_COUNTERS: dict[int, object] = {}


def _encode_len(tok, text: str, add_special_tokens: bool, by_pieces: bool = True) -> int:
    """`by_pieces`: may use the PieceCounter (Python, holds the GIL: for prompts counted on the
    event loop); else the tokenizer itself (GIL released: for the tokenizer threads)."""
    counters = _COUNTERS.get(id(tok))
    if counters is None:
        counters = _COUNTERS[id(tok)] = (PieceCounter.from_tokenizer(tok), _fast_counter(tok))
    pieces, fast = counters
    if by_pieces and pieces is not None and fast is not None:  # both agree with the reference
        n = pieces.count(text, add_special_tokens)
        if n is not None:
            return n
    if fast is None:
        return len(tok.encode(text, add_special_tokens=add_special_tokens))
    return fast(text, add_special_tokens)


def _count(tok, kind: str, body: dict, by_pieces: bool = True) -> int:
    if kind == "chat":
        return _render_chat(tok, body, by_pieces)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return _encode_len(tok, prompt, True, by_pieces)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return len(prompt)
        if isinstance(first, str):
            return _encode_len(tok, first, True, by_pieces)
        if isinstance(first, list):
            return len(first)
    raise BadRequest("prompt must be a string, a list of strings or a list of token ids", param="prompt")


def _render_chat(tok, body: dict, by_pieces: bool = True) -> int:
    """Token count of the chat template applied to the messages."""
    messages = [_normalise_message(m) for m in body["messages"]]
    kwargs = dict(body.get("chat_template_kwargs") or {})
    try:
        text = tok.apply_chat_template(
            messages,
            tools=body.get("tools"),
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
            tokenize=False,
            **kwargs,
        )
    except Exception as exc:  # template errors are the request's fault
        raise BadRequest(f"chat template failed for these messages: {exc}", param="messages") from None
    return _encode_len(tok, text, False, by_pieces)


def _normalise_message(m: dict) -> dict:
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        text = "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
        m = {**m, "content": text}
    return m


# Normalizers and pre-tokenizers whose effect on the text's UTF-8 length is bounded. For each:
# how many bytes one input byte can become (a multiplier), and whether bytes can disappear.
_NORMALIZERS_GROW = {"NFC": 3}  # NFC may recompose (shrink) or decompose singletons (<= 3x)
_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"}


def byte_bounds(tok) -> tuple[int, int, int, int] | None:
    """(expand, extra, max_token_bytes, specials) so that for a prompt of n UTF-8 bytes

        specials + ceil(n / max_token_bytes) <= tokens <= specials + expand * n + extra

    (max_token_bytes 0: no lower bound beyond specials). Every token of a BPE/Unigram/WordPiece
    model stands for at least one byte of the normalized, pre-tokenized text (byte fallback or
    byte-level: never less), and for at most max_token_bytes of it. Only tokenizers whose
    normalizer and pre-tokenizer are in the small known set above are bounded; anything else
    (NFKC, lowercasing, Whitespace splitting that drops spaces, ...) returns None and the
    router tokenizes as always.
    """
    try:
        spec = orjson.loads(tok.backend_tokenizer.to_str())
        specials = len(tok.encode("", add_special_tokens=True))
        vocab = tok.get_vocab()
    except Exception:  # noqa: BLE001 - no bounds is always safe
        return None
    expand, extra, shrinks = 1, 0, False

    def walk(node, kind: str) -> bool:
        nonlocal expand, extra, shrinks
        if node is None:
            return True
        t = node.get("type")
        if t == "Sequence":
            return all(walk(n, kind) for n in node.get("normalizers" if kind == "norm" else "pretokenizers") or [])
        if kind == "norm":
            if t in _NORMALIZERS_GROW:
                expand *= _NORMALIZERS_GROW[t]
                shrinks = True
                return True
            if t == "Prepend":
                extra += len(node.get("prepend", "").encode())
                return True
            if t == "Replace":
                pat = (node.get("pattern") or {}).get("String")
                if pat is None or not pat:
                    return False
                grow = len(node.get("content", "").encode())
                expand *= max(1, -(-grow // len(pat.encode())))
                shrinks = shrinks or grow < len(pat.encode())
                return True
            return False
        if t not in _PRE_TOKENIZERS:
            return False
        if t == "Split" and node.get("behavior") == "Removed":
            return False
        if t == "Metaspace":  # ' ' (1 byte) -> U+2581 (3 bytes), maybe one more in front
            expand *= 3
            extra += 3
        if t == "ByteLevel" and node.get("add_prefix_space"):
            extra += 1
        return True

    if not walk(spec.get("normalizer"), "norm") or not walk(spec.get("pre_tokenizer"), "pre"):
        return None
    model = spec.get("model") or {}
    if model.get("type") not in ("BPE", "Unigram", "WordPiece", "WordLevel"):
        return None
    extra = expand * extra + 8  # slack: a template may add a token or two
    # A lower bound needs every byte to be covered by some vocabulary token: byte-level BPE or
    # byte fallback. Otherwise an unknown-word token may stand for any number of bytes.
    byte_level = "ByteLevel" in orjson.dumps(spec.get("pre_tokenizer")).decode()
    covered = model.get("byte_fallback") or (model.get("type") == "BPE" and byte_level)
    max_bytes = 0 if shrinks or not covered or not vocab else max(len(t.encode("utf-8")) for t in vocab)
    return expand, extra, max_bytes, specials

"""Relaying the decode leg to the client: bytes pass through, metrics on the side.

Streams are passed through chunk by chunk without re-encoding; the only rewrite is the
usage of disaggregated requests (the decode instance counts the transferred prompt as
cached; the client must see the prefill instance's view, as a single instance reports),
which touches only the event that carries `usage`.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from typing import AsyncIterator

import orjson

from router.dispatch.base import Job, Outcome
from router.errors import RouterError, UpstreamError, sse_error_event

log = logging.getLogger("pd_router.relay")
DONE = b"data: [DONE]"
ITL_FLUSH = 64  # batched ITL observations are flushed into the histogram this often (and at the end)


class Tally:
    """Per-request numbers the relay collects for metrics and the access log.

    ITL observations are batched: each read adds its events to per-bucket counts kept here,
    and `flush_itl` moves them into the histogram (every `ITL_FLUSH` events and at the end
    of the stream), instead of one locked `Histogram.observe` per event.
    """

    __slots__ = ("ttft", "gaps", "max_gap", "output_tokens", "prompt_tokens", "outcome", "error", "chunks", "_last", "_itl",
                 "_counts", "_sum", "_pending")

    def __init__(self) -> None:
        self.ttft: float | None = None
        self.gaps = 0.0
        self.max_gap = 0.0
        self.output_tokens: int | None = None
        self.prompt_tokens: int | None = None  # the engine's usage.prompt_tokens, when it reported one
        self.outcome = "ok"
        self.error: RouterError | None = None
        self.chunks = 0
        self._last = 0.0
        self._itl = None  # the histogram (child) the batched observations belong to
        self._counts: list[int] | None = None
        self._sum = 0.0
        self._pending = 0

    def tick(self, now: float, t0: float, itl_hist, events: int = 1) -> None:
        """`events` SSE events (tokens) reached the client in one read at `now`.

        The first event sets TTFT; every later one is one ITL observation, the events of
        one read sharing its gap evenly (so the count is events - 1 per stream however
        TCP coalesced them, and the sum is the time from the first to the last event).
        """
        if events <= 0:
            return
        if self.ttft is None:
            self.ttft = now - t0
            self.chunks = 1
            events -= 1
            share = 0.0
        else:
            share = (now - self._last) / events
        if events:
            self._observe(itl_hist, share, events)
            self.gaps += share * events
            if share > self.max_gap:
                self.max_gap = share
            self.chunks += events
        self._last = now

    def _observe(self, hist, value: float, n: int) -> None:
        if self._itl is not hist:
            self.flush_itl()
            self._itl = hist
            bounds = getattr(hist, "_upper_bounds", None)
            self._counts = [0] * len(bounds) if bounds is not None and hasattr(hist, "_buckets") else None
        counts = self._counts
        if counts is None:  # not a prometheus_client histogram: observe one by one
            for _ in range(n):
                hist.observe(value)
            return
        counts[bisect_left(hist._upper_bounds, value)] += n  # observe(): first bucket with value <= bound
        self._sum += value * n
        self._pending += n
        if self._pending >= ITL_FLUSH:
            self.flush_itl()

    def flush_itl(self) -> None:
        """Move the batched ITL observations into the histogram."""
        if not self._pending:
            return
        hist, counts = self._itl, self._counts
        hist._sum.inc(self._sum)
        buckets = hist._buckets
        for i, c in enumerate(counts):
            if c:
                buckets[i].inc(c)
                counts[i] = 0
        self._sum = 0.0
        self._pending = 0

    @property
    def mean_itl(self) -> float | None:
        return self.gaps / (self.chunks - 1) if self.chunks > 1 else None


def ask_usage(body: dict) -> tuple[dict, bool]:
    """Streams always ask the decode leg for usage, so output tokens are counted for every
    stream. Returns (body to send, strip): strip means the client did not ask, so the
    usage-only event is dropped again on the way back (continuous_usage_stats, which needs
    include_usage anyway, is dropped with it)."""
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        return body, False
    if so and so.get("include_usage"):
        return body, False
    so = {k: v for k, v in (so or {}).items() if k != "continuous_usage_stats"}
    so["include_usage"] = True
    return {**body, "stream_options": so}, True


async def prefill_details(outcome: Outcome) -> tuple[bool, object]:
    """(known, P's usage.prompt_tokens_details) for disaggregated requests."""
    if outcome.prefill_reply is None:
        return False, None
    try:
        doc = await outcome.prefill_reply
    except BaseException:  # noqa: BLE001 - P failing after D streamed does not break the answer
        return False, None
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if not isinstance(usage, dict):
        return False, None
    return True, usage.get("prompt_tokens_details")


def fix_usage_doc(doc: dict, details: object) -> bool:
    usage = doc.get("usage")
    if isinstance(usage, dict) and usage.get("prompt_tokens_details") != details:
        usage["prompt_tokens_details"] = details
        return True
    return False


async def whole_body(outcome: Outcome, job: Job, tally: Tally) -> bytes:
    """A non-streaming answer: usage fixed if disaggregated, output tokens counted."""
    body = outcome.body
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise UpstreamError("decode instance answered with invalid JSON", stage="decode", code="bad_json") from None
    if not isinstance(doc, dict):
        raise UpstreamError("decode instance answered with a non-object", stage="decode", code="bad_json")
    usage = doc.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        tally.output_tokens = usage["completion_tokens"]
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        tally.prompt_tokens = usage["prompt_tokens"]
    known, details = await prefill_details(outcome)
    if known and fix_usage_doc(doc, details):
        body = orjson.dumps(doc)
    return body


def token_events(chunk: bytes, quiet: int) -> tuple[int, bool]:
    """(token events in `chunk`, whether it ends with [DONE]); `quiet` usage-only events
    in it are not tokens either. An SSE event starts a line and JSON escapes newlines, so
    the pattern cannot match inside an event."""
    events = chunk.count(b"\ndata: ") + chunk.startswith(b"data: ") - quiet
    done = DONE in chunk[-16:]
    return events - done, done


async def stream_body(outcome: Outcome, job: Job, tally: Tally, itl_hist, finish) -> AsyncIterator[bytes]:
    """Yield the decode stream to the client. `finish(tally)` runs exactly once at the end."""
    stream = outcome.stream
    assert stream is not None
    fix = outcome.prefill_reply is not None
    pending = b""  # only used while an event carrying usage is split across reads
    seen_done = False
    t0 = job.t0
    try:
        chunk = outcome.body
        chunks = stream.chunks()
        strip = job.strip_usage
        while True:
            quiet = 0  # events that are not tokens: a usage-only event, [DONE]
            if b"usage" in chunk or pending:
                chunk, pending, quiet = await _rewrite_usage(pending + chunk, outcome, tally, fix, strip)
            if chunk:
                events, done = token_events(chunk, quiet)
                seen_done = seen_done or done
                tally.tick(time.perf_counter(), t0, itl_hist, events)
                yield chunk
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
        if pending:
            yield pending
        if not seen_done:
            raise UpstreamError("decode instance ended the stream early (no [DONE])", stage="decode",
                                code="truncated_stream")
    except RouterError as exc:
        tally.outcome = "timeout" if exc.status == 504 else "upstream_error"
        tally.error = exc
        yield sse_error_event(exc)
    except BaseException:
        tally.outcome = "cancelled"
        raise
    finally:
        await outcome.close()
        tally.flush_itl()
        finish(tally)


async def pump(outcome: Outcome, job: Job, tally: Tally, itl_hist, finish, write, flow) -> None:
    """`stream_body` as one flat loop for the router's own HTTP server (router/server.py).

    Each decode chunk is awaited straight from aiohttp's reader and handed to `write` (a plain
    function: the server frames it and writes it to the client's transport), so a chunk costs
    one task wake-up instead of three async-generator hops and an ASGI send. `flow` is the
    connection's flow control: while the client's socket buffer is full (`write_paused`) the
    loop waits in `flow.drain()` and stops reading, so aiohttp pauses the engine's socket.
    Same semantics as `stream_body`: usage rewrite, Tally, the error event, `finish` once.
    """
    stream = outcome.stream
    assert stream is not None
    fix = outcome.prefill_reply is not None
    strip = job.strip_usage
    pending = b""
    seen_done = False
    t0 = job.t0
    clock = time.perf_counter
    read = stream.start()
    try:
        chunk = outcome.body
        while True:
            quiet = 0
            if pending or b"usage" in chunk:
                chunk, pending, quiet = await _rewrite_usage(pending + chunk, outcome, tally, fix, strip)
            if chunk:
                events, done = token_events(chunk, quiet)
                seen_done = seen_done or done
                tally.tick(clock(), t0, itl_hist, events)
                write(chunk)
                if flow.write_paused:
                    await flow.drain()
            chunk = await read()
            if not chunk:
                break
        if pending:
            write(pending)
        if not seen_done:
            raise UpstreamError("decode instance ended the stream early (no [DONE])", stage="decode",
                                code="truncated_stream")
    except RouterError as exc:
        tally.outcome = "timeout" if exc.status == 504 else "upstream_error"
        tally.error = exc
        write(sse_error_event(exc))
    except BaseException:
        tally.outcome = "cancelled"
        raise
    finally:
        await outcome.close()
        tally.flush_itl()
        finish(tally)


async def _rewrite_usage(data: bytes, outcome: Outcome, tally: Tally, fix: bool,
                         strip: bool) -> tuple[bytes, bytes, int]:
    """Rewrite complete SSE events that carry usage; keep an incomplete tail pending.

    Returns (bytes to send, pending tail, usage-only events kept in the bytes sent).
    `strip`: drop usage-only events (the router asked for them, the client did not).
    """
    cut = data.rfind(b"\n\n")
    if cut < 0:
        return b"", data, 0
    complete, rest = data[: cut + 2], data[cut + 2:]
    if b'"usage":{' not in complete and b'"usage": {' not in complete:
        return complete, rest, 0
    out = []
    quiet = 0
    for event in complete.split(b"\n\n"):
        if event.startswith(b"data: {") and b'"usage"' in event:
            try:
                doc = orjson.loads(event[6:])
            except orjson.JSONDecodeError:
                out.append(event)
                continue
            usage = doc.get("usage")
            if isinstance(usage, dict):
                if isinstance(usage.get("completion_tokens"), int):
                    tally.output_tokens = usage["completion_tokens"]
                if isinstance(usage.get("prompt_tokens"), int):
                    tally.prompt_tokens = usage["prompt_tokens"]
                if not doc.get("choices"):
                    if strip:
                        continue
                    quiet += 1
                if fix:
                    known, details = await prefill_details(outcome)
                    if known and fix_usage_doc(doc, details):
                        event = b"data: " + orjson.dumps(doc)
        out.append(event)
    return b"\n\n".join(out), rest, quiet

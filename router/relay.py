"""Relaying the decode leg to the client: bytes pass through, metrics on the side.

Streams are passed through chunk by chunk without re-encoding; the only rewrite is the
usage of disaggregated requests (the decode instance counts the transferred prompt as
cached; the client must see the prefill instance's view, as a single instance reports),
which touches only the event that carries `usage`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_left
from typing import AsyncIterator

import orjson

from router.dispatch.base import Job, Outcome
from router.errors import RouterError, UpstreamError, sse_error_event

try:  # the per-read relay in C (setup.py builds it; optional: every read goes through Python without it)
    from router import _splice
except ImportError:  # pragma: no cover - exercised where the extension was not built
    _splice = None

log = logging.getLogger("pd_router.relay")
DONE_EVENT = b"data: [DONE]\n\n"
ITL_FLUSH = 64  # batched ITL observations are flushed into the histogram this often (and at the end)
MAX_PENDING = 1 << 20  # bytes of one unfinished SSE event held back before they are passed on as they are
_PAUSED, _FLUSH = (_splice.PAUSED, _splice.FLUSH) if _splice is not None else (2, 4)


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
            if not events:
                self._last = now
                return
        else:
            share = (now - self._last) / events
        self._last = now
        self.gaps += share * events
        if share > self.max_gap:
            self.max_gap = share
        self.chunks += events
        counts = self._counts
        if self._itl is itl_hist and counts is not None:  # the batched histogram, inlined
            counts[bisect_left(itl_hist._upper_bounds, share)] += events
            self._sum += share * events
            self._pending += events
            if self._pending >= ITL_FLUSH:
                self.flush_itl()
        else:
            self._observe(itl_hist, share, events)

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
        counts = self._counts
        observe_batch(self._itl, counts, self._sum)
        counts[:] = [0] * len(counts)
        self._sum = 0.0
        self._pending = 0

    @property
    def mean_itl(self) -> float | None:
        return self.gaps / (self.chunks - 1) if self.chunks > 1 else None


def observe_batch(hist, counts: list[int], total: float) -> None:
    """Add batched observations to a prometheus_client histogram: `counts` per bucket (the
    bucket `observe` would pick), `total` their sum."""
    hist._sum.inc(total)
    buckets = hist._buckets
    for i, c in enumerate(counts):
        if c:
            buckets[i].inc(c)


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


def _details_of(doc) -> tuple[bool, object]:
    usage = doc.get("usage") if isinstance(doc, dict) else None
    if not isinstance(usage, dict):
        return False, None
    return True, usage.get("prompt_tokens_details")


async def prefill_details(outcome: Outcome) -> tuple[bool, object]:
    """(known, P's usage.prompt_tokens_details) for disaggregated requests."""
    if outcome.prefill_reply is None:
        return False, None
    try:
        doc = await outcome.prefill_reply
    except BaseException:  # noqa: BLE001 - P failing after D streamed does not break the answer
        return False, None
    return _details_of(doc)


def prefill_details_now(outcome: Outcome) -> tuple[bool, bool, object]:
    """(ready, known, details): `prefill_details` without waiting; ready is False while P's
    answer is still outstanding (push: D can finish a short answer before P's reply lands)."""
    fut = outcome.prefill_reply
    if fut is None:
        return True, False, None
    if not fut.done():
        return False, False, None
    if fut.cancelled() or fut.exception() is not None:
        return True, False, None
    return (True, *_details_of(fut.result()))


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


def token_events(events: bytes, quiet: int) -> tuple[int, bool]:
    """(token events in `events`, whether they end with [DONE]). `events` is whole SSE events
    (`split_events`); each ends with a blank line, and JSON escapes newlines, so "\\n\\n" only
    ends events. `quiet` usage-only events among them are not tokens; [DONE] is not one."""
    done = events[-14:] == DONE_EVENT
    return events.count(b"\n\n") - quiet - done, done


def split_events(pending: bytes, chunk: bytes) -> tuple[bytes, bytes]:
    """(whole events, the rest): a read can end inside an event (TCP cuts anywhere); the cut
    event waits for its end, so usage is seen whole and every event is counted once.
    An engine that never ends an event gets its bytes through unparsed past MAX_PENDING."""
    if not pending and chunk[-2:] == b"\n\n":
        return chunk, b""
    data = pending + chunk
    cut = data.rfind(b"\n\n")
    if cut < 0:
        return (data, b"") if len(data) > MAX_PENDING else (b"", data)
    return data[:cut + 2], data[cut + 2:]


async def stream_body(outcome: Outcome, job: Job, tally: Tally, itl_hist, finish) -> AsyncIterator[bytes]:
    """Yield the decode stream to the client. `finish(tally)` runs exactly once at the end."""
    stream = outcome.stream
    assert stream is not None
    fix = outcome.prefill_reply is not None
    pending = b""  # the start of an event cut by a read
    seen_done = False
    t0 = job.t0
    try:
        chunk = outcome.body
        chunks = stream.chunks()
        strip = job.strip_usage
        while True:
            quiet = 0  # events that are not tokens: a usage-only event, [DONE]
            chunk, pending = split_events(pending, chunk)
            if b"usage" in chunk:
                known, details = await prefill_details(outcome) if fix else (False, None)
                chunk, quiet = rewrite_usage(chunk, tally, known, details, strip)
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


class _Splice:
    """The per-stream state of `splice`; its `on_chunk` runs inside the engine connection's
    `data_received` (router/h1.py), so a token chunk costs no task wake-up."""

    __slots__ = ("outcome", "stream", "tally", "itl", "write", "flow", "t0", "fix", "strip", "pending",
                 "seen_done", "backlog", "details", "holds", "ended", "helpers", "clock", "fast", "slowed",
                 "last", "held")

    def __init__(self, outcome: Outcome, job: Job, tally: Tally, itl_hist, write, flow, ended: asyncio.Future,
                 fast=None):
        self.outcome = outcome
        self.stream = outcome.stream
        self.tally = tally
        self.itl = itl_hist
        self.write = write
        self.flow = flow
        self.t0 = job.t0
        self.fix = outcome.prefill_reply is not None
        self.strip = job.strip_usage
        self.pending = b""  # the start of an event cut by a read (split_events)
        self.seen_done = False
        self.backlog: list | None = None  # events held while waiting for P's usage details
        self.details: tuple[bool, object] | None = None
        self.holds = 0  # reasons the engine's socket is paused (client backpressure, P's usage)
        self.ended = ended
        self.helpers: list[asyncio.Task] = []
        self.clock = time.perf_counter
        self.fast = fast  # a router._splice.Relay: it keeps the TTFT/ITL numbers (fast reads and ours)
        self.slowed = False  # a usage event was seen: every later read goes through `_slow`
        # `write.last(chunk)`, where the writer has one (router/server.py): the events with
        # [DONE] wait in `held` for the end of the body, to go out with it in one write; if the
        # end is not in the same read they go out on the loop's next turn (`flush_held`).
        self.last = getattr(write, "last", None)
        self.held: bytes | None = None

    def on_chunk(self, chunk: bytes) -> None:
        """One read's worth of the engine's body (router/h1.py joins the HTTP chunks of a read)."""
        if self.backlog is not None:
            self.backlog.append(chunk)
            return
        if self.pending or chunk[-2:] != b"\n\n":
            chunk, self.pending = split_events(self.pending, chunk)
            if self.fast is not None and not self.slowed:  # the C relay starts on an event boundary
                if self.pending:
                    self.stream.stop_fast()
                else:
                    self.stream.start_fast(self.fast, self.on_fast_flags)
            if not chunk:
                return
        if b"usage" in chunk or self.slowed:
            self._slow(chunk)
        else:
            self._send(chunk, 0)

    def _send(self, chunk: bytes, quiet: int) -> None:
        events, done = token_events(chunk, quiet)
        fast = self.fast
        if fast is not None:
            if fast.tick(events):
                self._take_itl()
        else:
            self.tally.tick(self.clock(), self.t0, self.itl, events)
        if self.held is not None:
            self.flush_held()
        if done:
            self.seen_done = True
            if self.last is not None:
                self.held = chunk
                if fast is not None:
                    self.stream.stop_fast()  # anything after [DONE] comes after it, through here
                asyncio.get_running_loop().call_soon(self.flush_held)
                return
        self.write(chunk)
        if self.flow.write_paused:
            self._paused()

    def flush_held(self) -> None:
        chunk = self.held
        if chunk is not None:
            self.held = None
            self.write(chunk)
            if self.flow.write_paused:
                self._paused()

    def _paused(self) -> None:
        self._hold()
        self.helpers.append(asyncio.ensure_future(self._drain()))

    def on_fast_flags(self, flags: int) -> None:
        """The C relay's answer for a read it relayed: batched ITL to flush, client backpressure."""
        if flags & _FLUSH:
            self._take_itl()
        if flags & _PAUSED:
            self._paused()

    def _take_itl(self) -> None:
        """Move the C relay's batched ITL observations into the histogram."""
        observe_batch(self.itl, *self.fast.take())

    def sync_fast(self) -> None:
        """At the end: the C relay's numbers into the Tally, its batched ITL into the histogram."""
        fast, tally = self.fast, self.tally
        self.stream.stop_fast()
        if fast.pending:
            self._take_itl()
        tally.ttft, tally.gaps, tally.max_gap, tally.chunks = fast.ttft, fast.gaps, fast.max_gap, fast.chunks
        fast.close()

    def _slow(self, chunk: bytes) -> None:
        """Whole events with usage in them (or after such): rewrite them, waiting for P's details
        if needed. The C relay stays off from here on: nothing may overtake what is held here."""
        if not self.slowed:
            self.slowed = True
            if self.fast is not None:
                self.stream.stop_fast()
        details = self.details
        if details is None and self.fix:
            ready, known, det = prefill_details_now(self.outcome)
            if not ready:  # rare: hold the stream until P's answer is in
                self.backlog = [chunk]
                if self.pending:  # the cut event after these comes after them again
                    self.backlog.append(self.pending)
                    self.pending = b""
                self._hold()
                self.helpers.append(asyncio.ensure_future(self._await_details()))
                return
            details = self.details = (known, det)
        known, det = details or (False, None)
        chunk, quiet = rewrite_usage(chunk, self.tally, known, det, self.strip)
        if chunk:
            self._send(chunk, quiet)

    def on_end(self) -> None:
        if self.backlog is not None:
            self.backlog.append(None)
            return
        if self.ended.done():
            return
        if self.pending:
            self.flush_held()
            self.write(self.pending)
            self.pending = b""
        if self.seen_done or (self.fast is not None and self.fast.seen_done):
            if self.held is not None:
                chunk, self.held = self.held, None
                self.last(chunk)
            self.ended.set_result(None)
        else:
            self.ended.set_exception(UpstreamError("decode instance ended the stream early (no [DONE])",
                                                   stage="decode", code="truncated_stream"))

    def on_error(self, err: UpstreamError) -> None:
        if self.backlog is not None:
            self.backlog.append(err)
        elif not self.ended.done():
            self.ended.set_exception(err)

    def _hold(self) -> None:
        if self.holds == 0:
            self.stream.pause_reading()
        self.holds += 1

    def _release(self) -> None:
        self.holds -= 1
        if self.holds == 0:
            self.stream.resume_reading()

    async def _drain(self) -> None:
        await self.flow.drain()
        self._release()

    async def _await_details(self) -> None:
        self.details = await prefill_details(self.outcome)
        items, self.backlog = self.backlog, None
        for item in items:
            if item is None:
                self.on_end()
            elif isinstance(item, UpstreamError):
                self.on_error(item)
            else:
                self.on_chunk(item)
        self._release()


def _fast_relay(outcome: Outcome, job: Job, itl_hist, flow, transport):
    """A C relay for this stream, when the extension, the stream and the histogram allow one."""
    if _splice is None or transport is None or not hasattr(outcome.stream, "start_fast"):
        return None
    bounds = getattr(itl_hist, "_upper_bounds", None)
    if bounds is None or not hasattr(itl_hist, "_buckets") or not hasattr(itl_hist, "_sum"):
        return None
    return _splice.Relay(transport, flow, bounds, job.t0)


async def splice(outcome: Outcome, job: Job, tally: Tally, itl_hist, finish, write, flow, transport=None) -> None:
    """Relay the decode stream for the router's own HTTP server (router/server.py).

    Each decode chunk is handed to `write` (the server frames it and writes it to the
    client's transport) from the engine connection's `data_received` callback: no task
    wakes up per token. This coroutine only waits for the end. `flow` is the client
    connection's flow control: while the client's socket buffer is full (`write_paused`)
    the engine's socket is paused until `flow.drain()` returns.
    `transport`: the client's transport, which `write` frames chunks onto. Given, and with the
    C extension built, reads that are whole chunks without usage are relayed by
    `router._splice.Relay` (one C call per read: framing checked, events counted, TTFT/ITL
    kept, one write, backpressure reported); all other reads take the Python path.
    Same semantics as `stream_body`: usage rewrite, Tally, the error event, `finish` once.
    """
    ended = asyncio.get_running_loop().create_future()
    sp = _Splice(outcome, job, tally, itl_hist, write, flow, ended, _fast_relay(outcome, job, itl_hist, flow, transport))
    try:
        sp.on_chunk(outcome.body)
        flush_head = getattr(write, "flush_head", None)
        if flush_head is not None:
            flush_head()  # the head went with the first chunk, or goes now: before any C write
        stream = outcome.stream
        stream.attach(sp.on_chunk, sp.on_end, sp.on_error)
        if sp.fast is not None and not (sp.slowed or sp.pending or sp.backlog is not None or sp.held):
            stream.start_fast(sp.fast, sp.on_fast_flags)  # on an event boundary: C takes whole-chunk reads
        await ended
        sp.flush_held()
    except RouterError as exc:
        tally.outcome = "timeout" if exc.status == 504 else "upstream_error"
        tally.error = exc
        sp.flush_held()
        write(sse_error_event(exc))
    except BaseException:
        tally.outcome = "cancelled"
        raise
    finally:
        for task in sp.helpers:
            task.cancel()
        if sp.fast is not None:
            sp.sync_fast()
        await outcome.close()
        tally.flush_itl()
        finish(tally)


def rewrite_usage(complete: bytes, tally: Tally, known: bool, details: object,
                  strip: bool) -> tuple[bytes, int]:
    """Rewrite the SSE events that carry usage in `complete` (whole events: `split_events`).

    Returns (bytes to send, usage-only events kept in them).
    `known`/`details`: P's prompt_tokens_details, put into D's usage when known.
    `strip`: drop usage-only events (the router asked for them, the client did not).
    """
    if b'"usage":{' not in complete and b'"usage": {' not in complete:
        return complete, 0
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
                if known and fix_usage_doc(doc, details):
                    event = b"data: " + orjson.dumps(doc)
        out.append(event)
    return b"\n\n".join(out), quiet

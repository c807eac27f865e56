"""The OpenAI-compatible front door: /v1/completions, /v1/chat/completions, /v1/models,
/health, /instances, /metrics.

Per request: parse and check the body -> request id -> count prompt tokens (thread
pool, cached) -> threshold plan -> dispatch (pull/push/direct) -> relay. Errors raised
anywhere become one OpenAI-shaped body via `error_response`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from random import getrandbits

import orjson
from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.responses import Response

from router.dispatch import DirectDispatch, Job
from router.fastpath import RelayResponse
from router.errors import BadRequest, ModelNotFound, NoInstance, Overloaded, PayloadTooLarge, RouterError, Unauthorized
from router.planning import DISAGGREGATED, plan
from router.relay import Tally, ask_usage, whole_body
from router.state import AppState
from router.validation import check_body, check_context, check_request_id, is_batch

log = logging.getLogger("pd_router.access")
JSON_TYPE = "application/json"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}

api = APIRouter()


def error_response(err: RouterError, request_id: str | None = None) -> Response:
    headers = err.headers()
    if request_id:
        headers["x-request-id"] = request_id
    return Response(err.to_bytes(), status_code=err.status, media_type=JSON_TYPE, headers=headers)


class ClientGone(Exception):
    pass


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _watched(request: Request, coro):
    """Run `coro`, cancelling it if the client disconnects first (closes the upstream legs)."""
    work = asyncio.ensure_future(coro)
    watch = asyncio.ensure_future(_until_disconnect(request))
    try:
        done, _ = await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        raise
    finally:
        watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    try:
        await work
    except BaseException:  # noqa: BLE001 - cancelled on purpose
        pass
    raise ClientGone()


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body larger than {limit} bytes")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise PayloadTooLarge(f"request body larger than {limit} bytes")
        parts.append(part)
    return b"".join(parts)


@api.post("/v1/completions")
async def completions(request: Request) -> Response:
    """OpenAI completions (served by the fast path in `router.fastpath`; declared here for OpenAPI)."""
    return await handle(request.app.state.pdr, request, "completions", "/v1/completions")


@api.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions (served by the fast path in `router.fastpath`; declared here for OpenAPI)."""
    return await handle(request.app.state.pdr, request, "chat", "/v1/chat/completions")


async def handle(st: AppState, request: Request, kind: str, path: str, gone=None, body: bytes | None = None):
    """One hot request. `gone`: None under ASGI (a watcher task notices the client leaving
    during dispatch); the router's own server passes a function that says whether the
    client left, and cancels this task itself when it does (no watcher task per request).
    `body`: the whole request body when the server already has it (else it is read here)."""
    s = st.settings
    m = st.metrics
    rid = None
    job = None
    route = "direct"
    t0 = time.perf_counter()
    admitted = False
    try:
        if s.api_key is not None and request.headers.get("authorization") != f"Bearer {s.api_key}":
            raise Unauthorized("missing or wrong API key (Authorization: Bearer ...)")
        client_rid = request.headers.get("x-request-id")
        rid = check_request_id(client_rid) if client_rid else f"{getrandbits(128):032x}"
        if s.max_inflight and st.in_flight >= s.max_inflight:
            raise Overloaded(f"router at its limit of {s.max_inflight} requests in flight; retry shortly")
        st.in_flight += 1
        m.in_flight_total.inc()
        admitted = True
        if body is None:
            raw = await _read_body(request, s.max_body_bytes)
        elif len(body) > s.max_body_bytes:
            raise PayloadTooLarge(f"request body larger than {s.max_body_bytes} bytes")
        else:
            raw = body
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise BadRequest("request body must be a JSON object", code="invalid_json")
        check_body(kind, body, max_tokens_limit=s.max_tokens_limit, max_n=s.max_n)
        model = body.get("model")
        known = st.registry.models()
        if model is not None and known and model not in known:
            raise ModelNotFound(f"The model `{model}` does not exist.", param="model")
        stream = bool(body.get("stream"))
        strip_usage = False
        if stream:
            body, strip_usage = ask_usage(body)
        job = Job(kind=kind, path=path, body=body, stream=stream, request_id=rid, prompt_tokens=0,
                  model=model, t0=t0, auth=request.headers.get("authorization"), strip_usage=strip_usage)
        batch, n = is_batch(kind, body), body.get("n") or 1
        settled = _settled(st, kind, body, model, batch, n) if s.count_tokens == "when-needed" else None
        if settled is None:
            tt = time.perf_counter()
            job.prompt_tokens = await st.tokens.count(kind, body)
            m.tokenize.observe(time.perf_counter() - tt)
            check_context(job.prompt_tokens, body, st.max_model_len(model))
            route, reason = plan(job.prompt_tokens, s.threshold, batch=batch, n=n)
        else:
            job.counted = False  # prompt_tokens from the engine's usage at the end, when it reports it
            route, reason = plan(settled, s.threshold, batch=batch, n=n)
        job.route = route
        m.routing.labels(route, reason).inc()
        dispatcher = st.dispatcher if route == DISAGGREGATED else st.direct
        outcome = await (dispatcher.run(job) if gone is not None else _watched(request, dispatcher.run(job)))
    except asyncio.CancelledError:
        if gone is None or not gone():
            if admitted:
                st.in_flight -= 1
                m.in_flight_total.dec()
            raise
        _finish(st, job, route, Tally(), "cancelled", None, admitted)
        raise
    except ClientGone:
        _finish(st, job, route, Tally(), "cancelled", None, admitted)
        return Response(status_code=499)
    except RouterError as err:
        tally = Tally()
        tally.error = err
        _finish(st, job, route, tally, _outcome_of(err), err, admitted, rid=rid)
        return error_response(err, rid)
    except BaseException:
        if admitted:
            st.in_flight -= 1
            m.in_flight_total.dec()
        raise

    tally = Tally()
    headers = {"x-request-id": rid}
    if outcome.stream is None:
        try:
            payload = await whole_body(outcome, job, tally)
        except RouterError as err:
            tally.error = err
            _finish(st, job, route, tally, _outcome_of(err), err, admitted, outcome)
            await outcome.close()
            return error_response(err, rid)
        tally.ttft = time.perf_counter() - t0
        await outcome.close()
        _finish(st, job, route, tally, "ok", None, admitted, outcome)
        return Response(payload, media_type=JSON_TYPE, headers=headers)

    def finish(t: Tally) -> None:
        _finish(st, job, route, t, t.outcome, t.error, admitted, outcome)

    headers.update(SSE_HEADERS)
    itl = m.itl.labels(route, s.mode if route == DISAGGREGATED else "none")
    return RelayResponse((outcome, job, tally, itl, finish), headers)


def _settled(st: AppState, kind: str, body: dict, model, batch: bool, n: int) -> int | None:
    """--count-tokens when-needed: a token count that plans the same route as the exact one
    and certainly passes the context check, from byte-length bounds alone; None when the
    bounds do not settle both (then the prompt is tokenized as always)."""
    b = st.tokens.bounds(kind, body)
    if b is None:
        return None
    lower, upper = b
    mml = st.max_model_len(model)
    if mml:
        want = body.get("max_completion_tokens") or body.get("max_tokens") or 0
        if not isinstance(want, int) or upper + want > mml:
            return None
    if batch or n > 1:
        return upper  # direct whatever the count
    threshold = st.settings.threshold
    if upper < threshold:
        return upper
    if lower >= threshold:
        return lower
    return None


def _outcome_of(err: RouterError) -> str:
    if isinstance(err, Overloaded):
        return "overloaded"
    if err.status == 504:
        return "timeout"
    if err.status >= 500:
        return "upstream_error"
    return "client_error"


def _stage_of(err: RouterError) -> str:
    stage = getattr(err, "stage", None)  # UpstreamError: prefill | decode
    if stage:
        return stage
    return "router" if isinstance(err, (Overloaded, NoInstance)) or err.status >= 500 else "client"


def _finish(st: AppState, job, route: str, tally: Tally, outcome: str, err, admitted: bool, out=None,
            rid: str | None = None) -> None:
    m = st.metrics
    s = st.settings
    now = time.perf_counter()
    mode = s.mode if route == DISAGGREGATED else "none"
    if admitted:
        st.in_flight -= 1
        m.in_flight_total.dec()
    m.requests.labels(route, mode, outcome).inc()
    if err is not None:
        if not err.counted:  # a failed leg was counted by dispatch; everything else once, here
            err.counted = True
            m.errors.labels(_stage_of(err), err.kind).inc()
    elif outcome == "cancelled":
        m.errors.labels("client", "disconnected").inc()
    if job is None:
        if err is not None and log.isEnabledFor(logging.INFO):
            st.access_log(rid, route, None, None, 0, None, None, err.status, outcome, err)
        return
    e2e = now - job.t0
    m.e2e.labels(route, mode, outcome).observe(e2e)
    if not job.counted:
        job.prompt_tokens = tally.prompt_tokens  # the engine's count (None if it sent no usage)
    if outcome == "ok":
        if tally.ttft is not None:
            m.ttft.labels(route, mode).observe(tally.ttft)
            if out is not None and out.t_handoff is not None:
                m.handoff.labels(mode).observe(job.t0 + tally.ttft - out.t_handoff)
        if job.prompt_tokens is not None:
            m.prompt_tokens.labels(route).inc(job.prompt_tokens)
            m.prompt_tokens_hist.labels(route).observe(job.prompt_tokens)
        if tally.output_tokens:
            m.output_tokens.labels(route).inc(tally.output_tokens)
        m.slo_requests.labels(route).inc()
        itl = tally.mean_itl
        if tally.ttft is not None and tally.ttft <= s.slo_ttft and (itl is None or itl <= s.slo_itl):
            m.goodput.labels(route).inc()
    if log.isEnabledFor(logging.INFO):
        st.access_log(job.request_id, route, out.prefill.url if out is not None and out.prefill else None,
                      out.decode.url if out is not None else None, job.prompt_tokens, tally.output_tokens,
                      tally.ttft, 200 if err is None else err.status, outcome, err, e2e)


@api.get("/v1/models")
async def models(request: Request) -> Response:
    st: AppState = request.app.state.pdr
    seen: dict[str, dict] = {}
    for inst in st.registry:
        if inst.healthy:
            for entry in inst.meta.get("models") or ([{"id": inst.model, "object": "model"}] if inst.model else []):
                seen.setdefault(entry.get("id"), entry)
    return Response(orjson.dumps({"object": "list", "data": list(seen.values())}), media_type=JSON_TYPE)


@api.get("/health")
async def health(request: Request) -> Response:
    st: AppState = request.app.state.pdr
    view = {"prefill": [], "decode": []}
    for inst in st.registry:
        view.setdefault(inst.role, []).append({"url": inst.url, "healthy": inst.available(st.registry.now()),
                                               "model": inst.model})
    tok = {"loaded": st.tokens.loaded, "source": st.tokens.source, "error": st.tokens.load_error}
    ok = any(i["healthy"] for i in view["decode"]) and st.tokens.loaded and not st.draining
    body = {"status": "ok" if ok else "unavailable", "mode": st.settings.mode, "tokenizer": tok, **view}
    return Response(orjson.dumps(body), status_code=200 if ok else 503, media_type=JSON_TYPE)


@api.get("/instances")
async def instances(request: Request) -> Response:
    st: AppState = request.app.state.pdr
    return Response(orjson.dumps(st.registry.snapshot()), media_type=JSON_TYPE)


@api.get("/metrics")
async def metrics(request: Request) -> Response:
    st: AppState = request.app.state.pdr
    st.refresh_gauges()
    return Response(st.metrics.render(), media_type=CONTENT_TYPE_LATEST)


__all__ = ["api", "error_response", "DirectDispatch"]

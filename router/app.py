"""create_app(settings, **overrides): the lifespan builds the components, hands typed
state to handlers and closes them in reverse order. No import-time app, no globals."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from router.api import api, error_response, handle
from router.discovery import Discovery
from router.fastpath import RouterASGI
from router.dispatch import DirectDispatch, Env, make_dispatcher
from router.errors import BadRequest, RouterError, error_body
from router.breaker import Breaker
from router.health import HealthChecker
from router.metrics import Metrics
from router.policies import make_policy
from router.registry import Registry
from router.settings import Settings
from router.state import AppState
from router.tokenizer import TokenCounter
from router.upstream import Upstream

log = logging.getLogger("pd_router")


def create_app(settings: Settings, *, upstream: Upstream | None = None, registry: Registry | None = None,
               metrics: Metrics | None = None, tokens: TokenCounter | None = None,
               start_background: bool = True, freeze_gc: bool = False) -> RouterASGI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        m = metrics or Metrics()
        reg = registry or Registry(max_instances=settings.max_instances,
                                   on_change=lambda ev, inst: _on_registry_change(m, settings, ev, inst))
        for spec in settings.prefill:
            reg.add_static("prefill", spec)
        for spec in settings.decode:
            reg.add_static("decode", spec)
        up = upstream or Upstream(max_connections=settings.max_connections, connect_timeout=settings.connect_timeout)
        tok = tokens or TokenCounter(settings.tokenizer, threads=settings.tokenizer_threads,
                                     cache_size=settings.tokenize_cache_size)
        env = Env(settings=settings, registry=reg, upstream=up, metrics=m,
                  prefill_policy=make_policy(settings.policy), decode_policy=make_policy(settings.policy))
        st = AppState(settings=settings, registry=reg, upstream=up, metrics=m, tokens=tok,
                      dispatcher=make_dispatcher(settings.mode, settings.kv_connector, env),
                      direct=DirectDispatch(env))
        checker = HealthChecker(reg, up, interval=settings.health_interval,
                                on_model=lambda inst: tok.offer_source(inst.model_root or inst.model))
        app.state.pdr = st
        tok.preload()
        if freeze_gc:  # the process's own server (pd-router serve), not an app inside tests
            if tok.loading is not None:
                tok.loading.add_done_callback(_freeze_heap)
            else:
                _freeze_heap()
        if start_background:
            await asyncio.wait_for(checker.probe_all(), timeout=10) if len(reg) else None
            checker.start()
        st.components.append(checker)
        try:
            if settings.ping_port:  # inside the try: a failed bind still closes what was started
                discovery = Discovery(settings, reg, m, on_new=lambda inst: checker.poke())
                await discovery.start()
                st.components.append(discovery)
            log.info("pd-router ready: mode=%s connector=%s threshold=%d prefill=%d decode=%d", settings.mode,
                     settings.kv_connector, settings.threshold, len(reg.of_role("prefill")), len(reg.of_role("decode")))
            yield
        finally:
            st.draining = True
            for comp in reversed(st.components):
                await comp.close()
            tok.close()
            if upstream is None:
                await up.aclose()

    app = FastAPI(title="pd-router", version="0.1.0", lifespan=lifespan, openapi_url="/openapi.json",
                  docs_url=None, redoc_url=None)
    app.include_router(api)

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError):
        return error_response(exc, request.headers.get("x-request-id"))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        err = RouterError(str(exc.detail))
        err.status, err.type = exc.status_code, "invalid_request_error" if exc.status_code < 500 else "internal_error"
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(BadRequest(orjson.dumps(exc.errors(), default=str).decode()))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error")
        from starlette.responses import Response
        return Response(orjson.dumps(error_body("internal router error", "internal_error")), status_code=500,
                        media_type="application/json")

    return RouterASGI(app, handle)


def _on_registry_change(m: Metrics, settings: Settings, event: str, inst) -> None:
    if event == "added" and settings.breaker_failures > 0:
        inst.breaker = Breaker(settings.breaker_failures, settings.breaker_cooldown)
    elif event == "removed":
        m.forget_instance(inst.role, inst.url)
    elif event == "expired":
        m.expiries.labels(inst.role).inc()


GC_YOUNG_THRESHOLD = 10_000


def _freeze_heap(_done=None) -> None:
    """Take what is alive once the tokenizer is loaded (modules, the tokenizer, the app: ~10^5
    objects) out of the cyclic GC's reach (`gc.freeze`), so a full collection under load scans
    only what requests created. A full collection of that start-up heap took 45-57 ms on these
    machines (docs/performance.md), a pause that every open stream would see.

    Then the youngest generation is collected every 10,000 net allocations of container
    objects instead of 700: a request allocates a few hundred that its end frees by reference
    counting, so at 700 the collector ran about every other request and scanned what the
    requests in flight held (docs/performance.md, round 6)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


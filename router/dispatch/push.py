"""Push (WRITE) dispatch, concurrent (PROTOCOLS.md section 3, NixlPushConnector).

1. pick a prefill instance P (its KV coordinates come from registration or config)
   and a decode instance D
2. launch both legs AT ONCE with the same X-Request-Id and endpoint:
   P: the body with max_tokens=1, stream=false and the six-field kv_transfer_params
   (+ transfer_id); D: the original body + {do_remote_prefill, remote_engine_id,
   remote_host, remote_port, tp_size, pp_size, remote_request_id, transfer_id} naming P
3. D allocates blocks and registers them with P; P writes the KV into them
4. failure coupling: P fails -> D's connection is closed at once (vLLM aborts it) and the
   pair is retried/fallen back/failed by --on-prefill-failure; D fails -> P is cancelled;
   P answered but a streaming D sends nothing within --push-decode-grace seconds -> D is
   closed and the request fails or is retried (never vLLM's 480 s push watchdog)
5. relay D's answer; P's answer (its usage) is awaited in the background
"""

from __future__ import annotations

import asyncio
import time
import uuid

from router.dispatch.base import (PREFILL_KV_PARAMS, Env, Job, Outcome, count_error, decode_body, decode_leg,
                                  is_retryable, prefill_body, prefill_leg)
from router.dispatch.direct import run_decode_only
from router.errors import RouterError, UpstreamError, UpstreamTimeout
from router.registry import Instance


def push_decode_params(p: Instance, job: Job, transfer_id: str) -> dict:
    s = p.spec
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": s.engine_id,
        "remote_host": s.kv_host,
        "remote_port": s.kv_port,
        "tp_size": s.tp,
        "pp_size": s.pp,
        "remote_request_id": job.request_id,
        "transfer_id": transfer_id,
    }


class PushDispatch:
    def __init__(self, env: Env, connector: str = "nixl"):
        self.env = env

    async def run(self, job: Job) -> Outcome:
        env = self.env
        policy = env.settings.on_prefill_failure
        attempts = 1 + max(0, env.settings.prefill_retries if policy == "retry" else 0) + max(0, env.settings.decode_retries)
        tried_p: set = set()
        tried_d: set = set()
        last: RouterError | None = None
        for attempt in range(attempts):
            try:
                p = env.pick("prefill", job, tried_p)
            except RouterError:
                if policy == "fallback":
                    env.metrics.fallbacks.inc()
                    return await run_decode_only(env, job)
                raise
            p = self._ensure_coordinates(p)
            d = env.pick("decode", job, tried_d)
            try:
                return await self._pair(job, p, d)
            except RouterError as exc:
                last = exc
                stage = getattr(exc, "stage", "decode")
                (tried_p if stage == "prefill" else tried_d).add((p if stage == "prefill" else d).key)
                if not is_retryable(exc) and not isinstance(exc, UpstreamTimeout):
                    raise
                if stage == "prefill" and policy == "fallback":
                    env.metrics.fallbacks.inc()
                    return await run_decode_only(env, job)
                if stage == "prefill" and policy == "error":
                    raise
                if attempt + 1 < attempts:
                    env.metrics.retries.labels(stage).inc()
                    continue
                raise
        assert last is not None
        raise last

    def _ensure_coordinates(self, p: Instance) -> Instance:
        s = p.spec
        if not (s.engine_id and s.kv_host and s.kv_port is not None):
            raise UpstreamError(f"prefill instance {p.url} has no KV coordinates (engine_id, kv_host, kv_port); "
                                "push mode cannot name it to a decode instance", stage="prefill", code="no_coordinates")
        return p

    def _legs(self, job: Job, p: Instance, d: Instance) -> tuple[bytes, dict | None, bytes, dict | None]:
        """(P body, P extra headers, D body, D extra headers) of one pair; MoRIIO WRITE overrides it."""
        transfer_id = f"xfer-{uuid.uuid4()}"
        p_body = prefill_body(job.body, {**PREFILL_KV_PARAMS, "transfer_id": transfer_id})
        return p_body, None, decode_body(job.body, push_decode_params(p, job, transfer_id)), None

    async def _pair(self, job: Job, p: Instance, d: Instance) -> Outcome:
        env = self.env
        p_body, p_headers, d_body, d_headers = self._legs(job, p, d)
        release_p = env.lease(p)
        release_d = env.lease(d)
        t_launch = time.perf_counter()
        p_task = asyncio.create_task(prefill_leg(env, job, p, p_body, p_headers), name=f"push-prefill-{job.request_id}")
        d_task = asyncio.create_task(decode_leg(env, job, d, d_body, d_headers), name=f"push-decode-{job.request_id}")
        try:
            done, _ = await asyncio.wait((p_task, d_task), return_when=asyncio.FIRST_COMPLETED)
            if p_task in done and p_task.exception() is not None:
                exc = p_task.exception()
                await _cancel(d_task)
                self._fail(p, exc, "prefill")
                raise exc
            if d_task in done and d_task.exception() is not None:
                exc = d_task.exception()
                await _cancel(p_task)
                self._fail(d, exc, "decode")
                raise exc
            if d_task not in done:
                # P answered first: D must now produce its first byte within a bounded time.
                env.record_result(p)
                grace = env.settings.push_decode_grace if job.stream else env.settings.request_timeout
                try:
                    async with asyncio.timeout(grace):
                        await asyncio.shield(d_task)
                except TimeoutError:
                    await _cancel(d_task)
                    err = UpstreamTimeout(f"decode instance did not start within {grace:g}s after the prefill "
                                          "answered (push never completed?)", stage="decode")
                    count_error(env, err, "decode")
                    raise err from None
                except RouterError as exc:
                    self._fail(d, exc, "decode")
                    raise
            stream, first = d_task.result()
        except BaseException:
            await _cancel(d_task)
            await _cancel(p_task)
            release_p()
            release_d()
            raise
        env.record_result(d)
        p_task.add_done_callback(lambda t: self._prefill_done(t, p, release_p))
        return Outcome(decode=d, body=first, stream=stream, prefill=p, prefill_reply=p_task, t_handoff=t_launch,
                       cleanups=[release_d, lambda: _cancel(p_task)])

    def _prefill_done(self, task: asyncio.Task, p: Instance, release) -> None:
        release()
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            self.env.record_result(p)
        elif isinstance(exc, RouterError):
            self._fail(p, exc, "prefill")

    def _fail(self, inst: Instance, exc: BaseException, stage: str) -> None:
        self.env.record_result(inst, exc)
        if isinstance(exc, RouterError):
            count_error(self.env, exc, stage)


async def _cancel(task: asyncio.Task) -> None:
    if not task.done():
        task.cancel()
        try:
            await task
        except BaseException:  # noqa: BLE001 - we only wait for it to finish
            pass
        return
    if not task.cancelled() and task.exception() is not None:
        _ = task.exception()  # mark retrieved
    elif task.done() and not task.cancelled():
        res = task.result()
        if isinstance(res, tuple) and res and res[0] is not None:  # an open decode stream we will not use
            await res[0].aclose()

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
                                  is_retryable, prefill_body, prefill_leg, start_prefill)
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
        """Both legs at once. The decode leg runs in this task (its first token is relayed with no
        task hand-off in between); the prefill leg is a task watched by `_Watch`, which
        interrupts the decode leg when P fails, or when P answered and D stays silent too long."""
        env = self.env
        p_body, p_headers, d_body, d_headers = self._legs(job, p, d)
        release_p = env.lease(p)
        release_d = env.lease(d)
        t_launch = time.perf_counter()
        p_started = start_prefill(env, job, p, p_body, p_headers)  # P first, now (the task runs next turn)
        p_task = asyncio.create_task(prefill_leg(env, job, p, p_body, p_headers, p_started, t_launch),
                                     name=f"push-prefill-{job.request_id}")
        p_task.add_done_callback(lambda t: self._prefill_done(t, p, release_p))  # P's accounting, always
        grace = env.settings.push_decode_grace if job.stream else env.settings.request_timeout
        watch = _Watch(asyncio.current_task(), grace)
        p_task.add_done_callback(watch.prefill_done)
        try:
            try:
                stream, first = await decode_leg(env, job, d, d_body, d_headers)
            finally:
                fired = watch.disarm()
        except asyncio.CancelledError:
            await _stop(p_task, p_started)
            release_d()
            if fired is None or asyncio.current_task().uncancel() > 0:
                raise  # the client left (or the router stops): not ours to turn into an error
            raise self._fired(fired, p_task, grace) from None
        except BaseException as exc:
            if fired is not None:
                asyncio.current_task().uncancel()
            await _stop(p_task, p_started)
            release_d()
            if isinstance(exc, RouterError):
                self._fail(d, exc, "decode")
            raise
        # The watch cannot have fired here: its cancellation interrupts the decode leg. But P may
        # have failed in the very turn D answered, before the watch heard of it: P's failure wins.
        if p_task.done() and not p_task.cancelled() and p_task.exception() is not None:
            if stream is not None:
                await stream.aclose()
            await _stop(p_task, p_started)
            release_d()
            raise self._fired(_PREFILL_FAILED, p_task, grace)
        env.record_result(d)
        return Outcome(decode=d, body=first, stream=stream, prefill=p, prefill_reply=p_task, t_handoff=t_launch,
                       cleanups=[release_d, lambda: _stop(p_task, p_started)])

    def _fired(self, fired: str, p_task: asyncio.Task, grace: float | None) -> RouterError:
        if fired == _PREFILL_FAILED:
            return p_task.exception()  # counted by _prefill_done; D's leg is closed
        err = UpstreamTimeout(f"decode instance did not start within {grace:g}s after the prefill "
                              "answered (push never completed?)", stage="decode")
        count_error(self.env, err, "decode")
        return err

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


_PREFILL_FAILED, _DECODE_SILENT = "prefill_failed", "decode_silent"


class _Watch:
    """Interrupts a push pair's decode leg (by cancelling the task running it) when the prefill
    leg fails, or when it answered and the decode leg has not answered `grace` seconds later.
    `disarm()` (always, once the decode leg is over) returns what fired, if anything."""

    __slots__ = ("task", "grace", "fired", "timer", "armed")

    def __init__(self, task: asyncio.Task, grace: float | None):
        self.task = task
        self.grace = grace
        self.fired: str | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.armed = True

    def prefill_done(self, p_task: asyncio.Task) -> None:
        if not self.armed or p_task.cancelled():
            return
        if p_task.exception() is not None:
            self._fire(_PREFILL_FAILED)
        elif self.grace:
            self.timer = asyncio.get_running_loop().call_later(self.grace, self._fire, _DECODE_SILENT)

    def _fire(self, what: str) -> None:
        self.timer = None
        if self.armed and self.fired is None:
            self.fired = what
            self.task.cancel()

    def disarm(self) -> str | None:
        self.armed = False
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        return self.fired


async def _stop(p_task: asyncio.Task, started) -> None:
    """Cancel the prefill leg and wait for it; close its connection too when the task was
    cancelled before it ever ran (a request sent by `start_prefill` that nothing else would
    close). A finished leg's failure was already taken by `_prefill_done`."""
    if not p_task.done():
        p_task.cancel()
        try:
            await p_task
        except BaseException:  # noqa: BLE001 - we only wait for it to finish
            pass
    if started is not None:
        await started.aclose()

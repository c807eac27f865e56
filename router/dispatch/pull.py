"""Pull (READ) dispatch, serial (PROTOCOLS.md section 2); also the storage connector.

1. pick a prefill instance P; send it the body with max_tokens=1, stream=false,
   stream_options/min_tokens removed and the six-field kv_transfer_params
   (storage connector: no kv_transfer_params at all)
2. on failure: --on-prefill-failure error (fail), retry (another P), fallback (decode-only)
3. take P's kv_transfer_params from its answer (an error if missing)
4. pick a decode instance D; send the ORIGINAL body plus P's kv_transfer_params verbatim
5. relay D's answer; if D fails before its first byte, try another D with a fresh prefill
   (P's blocks were handed to the failed D). Once P answered, the decode leg is always sent
   or counted in pd_router_orphaned_prefills_total{reason}; so is a request cancelled
   (client gone) after P answered and before D answered.

Steps 3-4 run from the read callback that completes P's answer (`_Handoff`), not after the
request's task is next scheduled: under load a loop turn is long (a c=256 benchmark measured
5 ms p50 between P's answer and the task's resumption), and D's request leaves that much
earlier. The task then waits for D's first chunk as before.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

from router.dispatch.base import (PREFILL_KV_PARAMS, Env, Job, Outcome, count_error, decode_body, decode_leg,
                                  is_retryable, prefill_body, prefill_leg, start_decode)
from router.dispatch.direct import run_decode_only
from router.errors import RouterError, UpstreamError
from router.h1 import Stream
from router.registry import Instance

log = logging.getLogger("pd_router")


def finished_at_first_token(p_doc: dict) -> bool:
    choices = p_doc.get("choices")
    return bool(choices) and isinstance(choices[0], dict) and choices[0].get("finish_reason") == "stop"


class _Handoff:
    """The decode leg's first steps, run from the read callback that completes P's answer (with
    P's parsed answer, `prefill_leg(on_answer=)`): build D's request, pick D, lease it and send
    the request on an idle connection (the task sends it if none is at hand). Anything unusual
    (no KV params, no D, a failure of ours) leaves every step to the task, which meets the same
    case itself. `taken` holds what the task continues with; `answered`: P answered."""

    __slots__ = ("dispatch", "job", "tried_d", "plan", "answered", "taken")

    def __init__(self, dispatch: "PullDispatch", job: Job, tried_d: set, plan: Any):
        self.dispatch, self.job, self.tried_d, self.plan = dispatch, job, tried_d, plan
        self.answered = False
        self.taken: tuple[float, bytes, dict | None, Instance, Callable[[], None], Stream | None] | None = None

    def __call__(self, doc: dict) -> None:
        self.answered = True
        if self.taken is not None:
            return
        t = time.perf_counter()
        d = self.dispatch
        try:
            d_body, d_headers = d._decode_request(self.job, doc, self.plan)
            d_inst = d._pick_decode(self.job, self.tried_d, self.plan)
        except RouterError:
            return
        release = d.env.lease(d_inst)
        try:
            started = start_decode(d.env, self.job, d_inst, d_body, d_headers)
        except Exception:  # noqa: BLE001 - the task's decode_leg sends it and meets the error itself
            log.debug("decode leg not started from the prefill answer", exc_info=True)
            started = None
        self.taken = (t, d_body, d_headers, d_inst, release, started)

    def undo(self) -> None:
        """The task will not continue: close the started decode leg (D aborts it), free D."""
        taken, self.taken = self.taken, None
        if taken is not None:
            taken[4]()
            if taken[5] is not None:
                taken[5].close()


class PullDispatch:
    def __init__(self, env: Env, connector: str = "nixl"):
        self.env = env
        self.connector = connector
        self._kv = PREFILL_KV_PARAMS if connector == "nixl" else None

    async def run(self, job: Job) -> Outcome:
        env = self.env
        tried_d: set = set()
        attempts = 1 + max(0, env.settings.decode_retries)
        for attempt in range(attempts):
            plan = self._plan(job, tried_d)
            handoff = _Handoff(self, job, tried_d, plan)
            try:
                p_inst, p_doc = await self._prefill(job, plan, handoff)
            except BaseException as exc:
                handoff.undo()
                if handoff.answered and isinstance(exc, asyncio.CancelledError):
                    env.metrics.orphans.labels("cancelled").inc()  # P answered; the task never saw it
                raise
            if p_inst is None:  # fallback: decode-only
                handoff.undo()
                return await run_decode_only(env, job)
            started = None
            if handoff.taken is not None:  # D's request was sent (or prepared) when P's answer came in
                t_handoff, d_body, d_headers, d_inst, release, started = handoff.taken
                handoff.taken = None
            else:
                t_handoff = time.perf_counter()
                try:
                    d_body, d_headers = self._decode_request(job, p_doc, plan)
                    d_inst = self._pick_decode(job, tried_d, plan)
                except RouterError as exc:
                    if exc.code == "no_kv_params" and finished_at_first_token(p_doc):
                        # P's only token ended the sequence (EOS/stop): no KV was kept, nothing to hand
                        # over. The decode instance computes the prompt itself and gives the same answer.
                        return await run_decode_only(env, job)
                    env.metrics.orphans.labels("no_kv_params" if exc.code == "no_kv_params"
                                               else "no_decode_instance").inc()
                    raise
                release = env.lease(d_inst)
            try:
                stream, first = await decode_leg(env, job, d_inst, d_body, d_headers, started=started)
            except RouterError as exc:
                release()
                env.record_result(d_inst, exc)
                count_error(env, exc, "decode")
                tried_d.add(d_inst.key)
                if attempt + 1 < attempts and is_retryable(exc) and len(env.registry.candidates("decode", job.model)) > 1:
                    env.metrics.retries.labels("decode").inc()
                    continue
                raise
            except BaseException:  # cancelled (client gone) after P answered, before D did
                release()
                env.metrics.orphans.labels("cancelled").inc()
                raise
            env.record_result(d_inst)
            done = asyncio.get_running_loop().create_future()
            done.set_result(p_doc)
            return Outcome(decode=d_inst, body=first, stream=stream, prefill=p_inst, prefill_reply=done,
                           t_handoff=t_handoff, cleanups=[release])
        raise AssertionError("unreachable")

    # Hooks: one pair attempt = _plan, then _prefill_request per P tried, then _decode_request and
    # _pick_decode. MoRIIO READ (router/dispatch/moriio.py) overrides them: its D is chosen
    # before the prefill leg, because both legs' X-Request-Id name it.
    def _plan(self, job: Job, tried_d: set) -> Any:
        return None

    def _prefill_request(self, job: Job, p: Instance, plan: Any) -> tuple[bytes, dict | None]:
        return prefill_body(job.body, self._kv), None

    def _pick_decode(self, job: Job, tried_d: set, plan: Any) -> Instance:
        return self.env.pick("decode", job, tried_d)

    def _decode_request(self, job: Job, p_doc: dict, plan: Any) -> tuple[bytes, dict | None]:
        if self._kv is None:
            return decode_body(job.body, None), None
        kv = p_doc.get("kv_transfer_params")
        if not isinstance(kv, dict):
            raise UpstreamError("prefill instance returned no kv_transfer_params (is it running a KV connector "
                                "with kv_role kv_producer?)", stage="prefill", code="no_kv_params")
        return decode_body(job.body, kv), None

    async def _prefill(self, job: Job, plan: Any = None, on_answer: Callable[[dict], None] | None = None):
        """Run the prefill leg under the failure policy. Returns (P, answer) or (None, None) for
        fallback. `on_answer`: given to each prefill leg (see `prefill_leg`)."""
        env = self.env
        policy = env.settings.on_prefill_failure
        attempts = 1 + (max(0, env.settings.prefill_retries) if policy == "retry" else 0)
        tried: set = set()
        for attempt in range(attempts):
            try:
                p_inst = env.pick("prefill", job, tried)
            except RouterError:
                if policy == "fallback":
                    env.metrics.fallbacks.inc()
                    return None, None
                raise
            body, headers = self._prefill_request(job, p_inst, plan)
            release = env.lease(p_inst)
            try:
                doc = await prefill_leg(env, job, p_inst, body, headers, on_answer=on_answer)
            except RouterError as exc:
                env.record_result(p_inst, exc)
                count_error(env, exc, "prefill")
                tried.add(p_inst.key)
                if not is_retryable(exc):
                    raise
                if attempt + 1 < attempts:
                    env.metrics.retries.labels("prefill").inc()
                    continue
                if policy == "fallback":
                    env.metrics.fallbacks.inc()
                    return None, None
                raise
            finally:
                release()
            env.record_result(p_inst)
            return p_inst, doc
        raise AssertionError("unreachable")

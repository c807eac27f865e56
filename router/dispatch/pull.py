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
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from router.dispatch.base import (PREFILL_KV_PARAMS, Env, Job, Outcome, count_error, decode_body, decode_leg,
                                  is_retryable, prefill_body, prefill_leg)
from router.dispatch.direct import run_decode_only
from router.errors import RouterError, UpstreamError
from router.registry import Instance


def finished_at_first_token(p_doc: dict) -> bool:
    choices = p_doc.get("choices")
    return bool(choices) and isinstance(choices[0], dict) and choices[0].get("finish_reason") == "stop"


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
            p_inst, p_doc = await self._prefill(job, plan)
            if p_inst is None:  # fallback: decode-only
                return await run_decode_only(env, job)
            t_handoff = time.perf_counter()
            try:
                d_body, d_headers = self._decode_request(job, p_doc, plan)
                d_inst = self._pick_decode(job, tried_d, plan)
            except RouterError as exc:
                if exc.code == "no_kv_params" and finished_at_first_token(p_doc):
                    # P's only token ended the sequence (EOS/stop): no KV was kept, nothing to hand
                    # over. The decode instance computes the prompt itself and gives the same answer.
                    return await run_decode_only(env, job)
                env.metrics.orphans.labels("no_kv_params" if exc.code == "no_kv_params" else "no_decode_instance").inc()
                raise
            release = env.lease(d_inst)
            try:
                stream, first = await decode_leg(env, job, d_inst, d_body, d_headers)
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

    async def _prefill(self, job: Job, plan: Any = None):
        """Run the prefill leg under the failure policy. Returns (P, answer) or (None, None) for fallback."""
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
                doc = await prefill_leg(env, job, p_inst, body, headers)
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

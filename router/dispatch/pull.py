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

from router.dispatch.base import (PREFILL_KV_PARAMS, Env, Job, Outcome, count_error, decode_body, decode_leg,
                                  is_retryable, prefill_body, prefill_leg)
from router.dispatch.direct import run_decode_only
from router.errors import RouterError, UpstreamError


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
            p_inst, p_doc = await self._prefill(job)
            if p_inst is None:  # fallback: decode-only
                return await run_decode_only(env, job)
            kv = p_doc.get("kv_transfer_params") if self._kv is not None else None
            if self._kv is not None and not isinstance(kv, dict):
                env.metrics.orphans.labels("no_kv_params").inc()
                raise UpstreamError("prefill instance returned no kv_transfer_params (is it running a KV connector "
                                    "with kv_role kv_producer?)", stage="prefill", code="no_kv_params")
            t_handoff = time.perf_counter()
            try:
                d_inst = env.pick("decode", job, tried_d)
            except RouterError:
                env.metrics.orphans.labels("no_decode_instance").inc()
                raise
            release = env.lease(d_inst)
            try:
                stream, first = await decode_leg(env, job, d_inst, decode_body(job.body, kv))
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

    async def _prefill(self, job: Job):
        """Run the prefill leg under the failure policy. Returns (P, answer) or (None, None) for fallback."""
        env = self.env
        policy = env.settings.on_prefill_failure
        attempts = 1 + (max(0, env.settings.prefill_retries) if policy == "retry" else 0)
        body = prefill_body(job.body, self._kv)
        tried: set = set()
        for attempt in range(attempts):
            try:
                p_inst = env.pick("prefill", job, tried)
            except RouterError:
                if policy == "fallback":
                    env.metrics.fallbacks.inc()
                    return None, None
                raise
            release = env.lease(p_inst)
            try:
                doc = await prefill_leg(env, job, p_inst, body)
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

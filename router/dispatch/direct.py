"""Direct route: prompts below the threshold go to one decode instance as-is.

1. pick a decode instance
2. send the client's body (minus any client-supplied kv_transfer_params)
3. relay the answer (retry on another decode instance if it fails before the first byte)
"""

from __future__ import annotations

from router.dispatch.base import Env, Job, Outcome, count_error, decode_body, decode_leg, is_retryable
from router.errors import RouterError


class DirectDispatch:
    def __init__(self, env: Env, connector: str = "nixl"):
        self.env = env

    async def run(self, job: Job) -> Outcome:
        return await run_decode_only(self.env, job)


async def run_decode_only(env: Env, job: Job, exclude: set | None = None) -> Outcome:
    body = decode_body(job.body, None)
    tried: set = set(exclude or ())
    attempts = 1 + max(0, env.settings.decode_retries)
    for attempt in range(attempts):
        inst = env.pick("decode", job, tried)
        release = env.lease(inst)
        try:
            stream, first = await decode_leg(env, job, inst, body)
        except RouterError as exc:
            release()
            env.record_result(inst, exc)
            count_error(env, exc, "decode")
            tried.add(inst.key)
            if attempt + 1 < attempts and is_retryable(exc) and len(env.registry.candidates("decode", job.model)) > 1:
                env.metrics.retries.labels("decode").inc()
                continue
            raise
        except BaseException:
            release()
            raise
        env.record_result(inst)
        return Outcome(decode=inst, body=first, stream=stream, cleanups=[release])
    raise AssertionError("unreachable")

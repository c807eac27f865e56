"""MoRIIO dispatch (PROTOCOLS.md section 4): READ = serial (pull), WRITE = concurrent (push).

MoRIIOConnector needs ROCm hardware (the `mori` library); this module is tested for protocol
conformance against strict fake engines only. docs/moriio.md has the details and the facts
checked in vLLM's own connector.

READ (`--mode pull --kv-connector moriio`), the pull flow of router/dispatch/pull.py:
1. pick a decode instance D first: both legs' X-Request-Id name it
2. pick a prefill instance P; per (P, D) pair make the X-Request-Id
   ``___prefill_addr_<P zmq>___decode_addr_<D zmq>_<32 hex>`` and ``transfer_id = tx-<uuid4>``
   (a retry on another P or D gets a fresh pair id and transfer id)
3. P leg: the body with max_tokens=1, stream=false, stream_options/min_tokens removed and
   kv_transfer_params = the six pull fields + transfer_id + remote_dp_size/remote_tp_size of D;
   header X-data-parallel-rank when P has DP > 1 (round-robin per P)
4. P's answer must carry kv_transfer_params with remote_engine_id and remote_block_ids
   (else an error, counted as an orphaned prefill)
5. D leg: the ORIGINAL body (max_tokens untouched: D samples every output token itself)
   + {do_remote_prefill: true, do_remote_decode: false, transfer_id, remote_engine_id and
   remote_block_ids from P's answer, remote_dp_size/remote_tp_size of P, remote_dp_rank when
   P has DP > 1}; same X-Request-Id
6. relay D's answer; failures as in pull (retry D with a fresh prefill, orphan metric)

WRITE (`--mode push --kv-connector moriio`), the push flow of router/dispatch/push.py:
1. pick P and D, make the pair's X-Request-Id and transfer_id as in READ step 2
2. launch both legs AT ONCE: P as READ step 3; D as READ step 5 with remote_engine_id and
   remote_block_ids null (D tells P its blocks over zmq, P writes into them)
3. failure coupling as in push: P fails -> D is closed at once; D fails -> P is cancelled;
   a streaming D silent for --push-decode-grace after P answered -> closed
4. relay D's answer; P's answer is awaited in the background

The client's X-Request-Id (which can never contain '___') is echoed to the client; engines
see only the pair id. The pair id is logged at debug level with the client's id.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from router.dispatch.base import PREFILL_KV_PARAMS, Env, Job, decode_body, prefill_body
from router.dispatch.pull import PullDispatch
from router.dispatch.push import PushDispatch
from router.errors import UpstreamError
from router.moriio_ids import parse_zmq_address, request_id
from router.registry import Instance

log = logging.getLogger("pd_router.dispatch")
DP_RANK_HEADER = "x-data-parallel-rank"


@dataclass
class Pair:
    """One (P, D) attempt: what both legs share."""

    prefill: Instance
    decode: Instance
    request_id: str
    transfer_id: str
    dp_rank: int | None  # P's DP rank, when P has DP > 1


class MoriioLegs:
    """Builds both legs of a MoRIIO pair; owns the per-P DP round-robin."""

    def __init__(self, read: bool):
        self.read = read
        self._next_rank: dict[str, int] = {}

    def pair(self, job: Job, p: Instance, d: Instance) -> Pair:
        for inst, stage in ((p, "prefill"), (d, "decode")):
            try:
                parse_zmq_address(inst.spec.zmq_address)
            except ValueError as exc:
                raise UpstreamError(f"{stage} instance {inst.url} has no usable MoRIIO zmq address ({exc})",
                                    stage=stage, code="no_coordinates") from None
        rank = None
        if p.spec.dp > 1:
            n = self._next_rank.get(p.url, 0)
            self._next_rank[p.url] = n + 1
            rank = n % p.spec.dp
        pair = Pair(p, d, request_id(p.spec.zmq_address, d.spec.zmq_address), f"tx-{uuid.uuid4()}", rank)
        log.debug("moriio %s pair: client id %s -> %s (P %s, D %s, transfer %s, P dp rank %s)",
                  "READ" if self.read else "WRITE", job.request_id, pair.request_id, p.url, d.url,
                  pair.transfer_id, rank)
        return pair

    def prefill(self, job: Job, pair: Pair) -> tuple[bytes, dict[str, str]]:
        d = pair.decode.spec
        kv = {**PREFILL_KV_PARAMS, "transfer_id": pair.transfer_id, "remote_dp_size": d.dp, "remote_tp_size": d.tp}
        headers = {"x-request-id": pair.request_id}
        if pair.dp_rank is not None:
            headers[DP_RANK_HEADER] = str(pair.dp_rank)
        return prefill_body(job.body, kv), headers

    def decode(self, job: Job, pair: Pair, p_doc: dict | None = None) -> tuple[bytes, dict[str, str]]:
        p = pair.prefill.spec
        kv = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": pair.transfer_id,
              "remote_engine_id": None, "remote_block_ids": None,
              "remote_dp_size": p.dp, "remote_tp_size": p.tp}
        if pair.dp_rank is not None:
            kv["remote_dp_rank"] = pair.dp_rank
        if self.read:
            answer = p_doc.get("kv_transfer_params") if isinstance(p_doc, dict) else None
            if not isinstance(answer, dict) or not answer.get("remote_engine_id") or \
                    not isinstance(answer.get("remote_block_ids"), list):
                raise UpstreamError("prefill instance returned no kv_transfer_params with remote_engine_id and "
                                    "remote_block_ids (is it a MoRIIO kv_producer in READ mode?)",
                                    stage="prefill", code="no_kv_params")
            kv["remote_engine_id"] = answer["remote_engine_id"]
            kv["remote_block_ids"] = answer["remote_block_ids"]
        return decode_body(job.body, kv), {"x-request-id": pair.request_id}


@dataclass
class _ReadPlan:
    decode: Instance
    pair: Pair | None = None


class MoriioReadDispatch(PullDispatch):
    """READ: pull's serial flow with D chosen before P (see the module docstring)."""

    def __init__(self, env: Env, connector: str = "moriio"):
        super().__init__(env, connector)
        self.legs = MoriioLegs(read=True)

    def _plan(self, job: Job, tried_d: set) -> _ReadPlan:
        return _ReadPlan(decode=self.env.pick("decode", job, tried_d))

    def _prefill_request(self, job: Job, p: Instance, plan: _ReadPlan) -> tuple[bytes, dict]:
        plan.pair = self.legs.pair(job, p, plan.decode)
        return self.legs.prefill(job, plan.pair)

    def _pick_decode(self, job: Job, tried_d: set, plan: _ReadPlan) -> Instance:
        return plan.decode

    def _decode_request(self, job: Job, p_doc: dict, plan: _ReadPlan) -> tuple[bytes, dict]:
        assert plan.pair is not None
        return self.legs.decode(job, plan.pair, p_doc)


class MoriioWriteDispatch(PushDispatch):
    """WRITE: push's concurrent flow and failure coupling (see the module docstring)."""

    def __init__(self, env: Env, connector: str = "moriio"):
        super().__init__(env, connector)
        self.legs = MoriioLegs(read=False)

    def _ensure_coordinates(self, p: Instance) -> Instance:
        return p  # MoRIIO names P by its zmq address, checked per pair in _legs

    def _legs(self, job: Job, p: Instance, d: Instance) -> tuple[bytes, dict, bytes, dict]:
        pair = self.legs.pair(job, p, d)
        return (*self.legs.prefill(job, pair), *self.legs.decode(job, pair))

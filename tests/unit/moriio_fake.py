"""A strict fake MoRIIO engine: launch/fake_engine.py's FakeEngine plus the checks of
PROTOCOLS.md section 4, rejecting (400, ``param`` naming the field) any missing, extra or wrong
field of either leg. MoRIIO needs ROCm hardware; these fakes are what the router is tested against.

The fakes of one test share a ``MoriioNet``: every engine's zmq address, role, DP and TP (so a leg
can be checked against the peer its X-Request-Id names) and a ledger of what each prefill leg
asked and answered, keyed by transfer_id (so a READ decode leg can be checked against P's answer).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from launch.fake_engine import FakeEngine
from launch.fake_engine_wire import BLOCK_SIZE, PREFILL_KV_PARAMS, BadRequest, check_prefill_leg, prompt_chars
from router.moriio_ids import parse_request_id

TRANSFER_ID_RE = re.compile(r"^tx-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
DECODE_FIELDS = {"do_remote_prefill", "do_remote_decode", "transfer_id", "remote_engine_id", "remote_block_ids",
                 "remote_dp_size", "remote_tp_size"}


@dataclass
class MoriioNet:
    read: bool
    peers: dict = field(default_factory=dict)  # zmq address -> MoriioEngine
    ledger: dict = field(default_factory=dict)  # transfer_id -> {"request_id", "path", "dp_rank", "answer"}


class MoriioEngine(FakeEngine):
    def __init__(self, net: MoriioNet, *, role: str, zmq_address: str, dp: int = 1, tp: int = 1,
                 hold_until_decode: bool = False, fail_status: int | None = None, **kw):
        """hold_until_decode (prefill): answer only once the decode leg of the same request reached
        its D (proves WRITE's concurrency without timing; a serial router times out instead).
        fail_status (prefill): then answer with this error status."""
        super().__init__(role=role, strict=False, **kw)  # the generic NIXL strict checks do not apply
        self.net, self.zmq_address, self.dp, self.tp = net, zmq_address, dp, tp
        self.hold_until_decode, self.fail_status = hold_until_decode, fail_status
        net.peers[zmq_address] = self
        self._answer: dict | None = None

    async def _generate(self, conn, rec) -> None:
        if rec.leg == "prefill" and (self.hold_until_decode or self.fail_status):
            rid = rec.headers.get("x-request-id")
            parsed = parse_request_id(rid or "")
            if self.hold_until_decode and parsed and parsed[1] in self.net.peers:
                try:
                    await self.net.peers[parsed[1]].wait_for(lambda q: q.headers.get("x-request-id") == rid, timeout=5)
                except TimeoutError:
                    raise BadRequest("the decode leg never reached D while P held its answer (serial WRITE?)",
                                     None, 500) from None
            if self.fail_status:
                raise BadRequest("injected prefill failure", None, self.fail_status)
        await super()._generate(conn, rec)

    def _check(self, rec, body: dict, chat: bool) -> int:
        max_tokens = super()._check(rec, body, chat)
        self._answer = None
        if rec.leg == "plain":  # direct route or decode-only fallback: vLLM just computes
            return max_tokens
        rid = rec.headers.get("x-request-id", "")
        parsed = parse_request_id(rid)
        if parsed is None:
            raise BadRequest(f"X-Request-Id {rid!r} is not ___prefill_addr_<zmq>___decode_addr_<zmq>_<32 hex>",
                             "X-Request-Id")
        p_zmq, d_zmq, _ = parsed
        if rec.leg == "prefill":
            self._check_prefill(rec, body, p_zmq, d_zmq, rid)
        else:
            self._check_decode(rec, body, p_zmq, d_zmq, rid)
        return max_tokens

    def _peer(self, zmq: str, role: str) -> "MoriioEngine":
        peer = self.net.peers.get(zmq)
        if peer is None or peer.role != role:
            raise BadRequest(f"X-Request-Id names {zmq!r}, which is no {role} instance", "X-Request-Id")
        return peer

    def _check_prefill(self, rec, body: dict, p_zmq: str, d_zmq: str, rid: str) -> None:
        if self.role != "prefill" or p_zmq != self.zmq_address:
            raise BadRequest(f"prefill leg's X-Request-Id must name this prefill instance {self.zmq_address}",
                             "X-Request-Id")
        d = self._peer(d_zmq, "decode")
        kv = dict(body["kv_transfer_params"])
        tid = kv.pop("transfer_id", None)
        _check_transfer_id(tid)
        for name, want in (("remote_dp_size", d.dp), ("remote_tp_size", d.tp)):
            got = kv.pop(name, None)
            if got != want or isinstance(got, bool):
                raise BadRequest(f"prefill leg needs {name}={want} (the decode instance's), got {got!r}",
                                 f"kv_transfer_params.{name}")
        if kv != PREFILL_KV_PARAMS:
            raise BadRequest(f"prefill kv_transfer_params must be the six pull fields + transfer_id, "
                             f"remote_dp_size, remote_tp_size; got {body['kv_transfer_params']}", "kv_transfer_params")
        check_prefill_leg({**body, "kv_transfer_params": PREFILL_KV_PARAMS}, self.role)
        rank = rec.headers.get("x-data-parallel-rank")
        if self.dp > 1:
            if rank is None or not rank.isdigit() or int(rank) >= self.dp:
                raise BadRequest(f"P has DP {self.dp}: X-data-parallel-rank 0..{self.dp - 1} needed, got {rank!r}",
                                 "X-data-parallel-rank")
            rank = int(rank)
        elif rank is not None:
            raise BadRequest("P has DP 1: no X-data-parallel-rank expected", "X-data-parallel-rank")
        if tid in self.net.ledger:
            raise BadRequest(f"transfer_id {tid} reused", "kv_transfer_params.transfer_id")
        self._answer = self._moriio_answer(rec, body, tid, rank or 0)
        self.net.ledger[tid] = {"request_id": rid, "path": rec.path, "dp_rank": rank, "answer": self._answer,
                                "rec": rec}

    def _moriio_answer(self, rec, body: dict, tid: str, rank: int) -> dict:
        """What MoRIIO's request_finished returns (vLLM moriio_connector.py), READ or WRITE."""
        n_blocks = math.ceil(prompt_chars(rec.path, body)[1] / BLOCK_SIZE)
        first = self._block_seq
        self._block_seq += n_blocks
        host, handshake, notify = (v.split(":", 1)[1] for v in self.zmq_address.split(","))
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": [list(range(first, first + n_blocks))], "remote_engine_id": self.engine_id,
                "remote_host": host, "remote_handshake_port": int(handshake), "remote_notify_port": int(notify),
                "remote_dp_rank": rank, "remote_dp_rank_override": True, "remote_dp_size": self.dp,
                "remote_dp_size_local": self.dp, "tp_size": self.tp, "transfer_id": tid}

    def _kv_answer(self, internal_id: str, n_prompt: int) -> dict:
        assert self._answer is not None
        return self._answer

    def _check_decode(self, rec, body: dict, p_zmq: str, d_zmq: str, rid: str) -> None:
        if self.role != "decode" or d_zmq != self.zmq_address:
            raise BadRequest(f"decode leg's X-Request-Id must name this decode instance {self.zmq_address}",
                             "X-Request-Id")
        p = self._peer(p_zmq, "prefill")
        kv = body["kv_transfer_params"]
        want_fields = DECODE_FIELDS | ({"remote_dp_rank"} if p.dp > 1 else set())
        if set(kv) != want_fields:
            raise BadRequest(f"decode kv_transfer_params must have exactly {sorted(want_fields)}, got {sorted(kv)}",
                             "kv_transfer_params")
        if kv["do_remote_prefill"] is not True or kv["do_remote_decode"] is not False:
            raise BadRequest("decode leg needs do_remote_prefill true, do_remote_decode false", "kv_transfer_params")
        _check_transfer_id(kv["transfer_id"])
        for name, want in (("remote_dp_size", p.dp), ("remote_tp_size", p.tp)):
            if kv[name] != want or isinstance(kv[name], bool):
                raise BadRequest(f"decode leg needs {name}={want} (the prefill instance's), got {kv[name]!r}",
                                 f"kv_transfer_params.{name}")
        if p.dp > 1 and (not isinstance(kv["remote_dp_rank"], int) or not 0 <= kv["remote_dp_rank"] < p.dp):
            raise BadRequest(f"remote_dp_rank must be 0..{p.dp - 1}", "kv_transfer_params.remote_dp_rank")
        if not self.net.read:
            for name in ("remote_engine_id", "remote_block_ids"):
                if kv[name] is not None:
                    raise BadRequest(f"WRITE decode leg needs {name} null", f"kv_transfer_params.{name}")
            return
        issued = self.net.ledger.get(kv["transfer_id"])  # READ is serial: P has answered
        if issued is None or issued["request_id"] != rid or issued["path"] != rec.path:
            raise BadRequest("READ decode leg: no prefill leg with this transfer_id, X-Request-Id and endpoint",
                             "kv_transfer_params.transfer_id")
        if issued["rec"].t_end is None or issued["rec"].status != 200:
            raise BadRequest("READ decode leg sent before P answered", "kv_transfer_params.transfer_id")
        ans = issued["answer"]
        for name in ("remote_engine_id", "remote_block_ids"):
            if kv[name] != ans[name]:
                raise BadRequest(f"READ decode leg's {name} must be P's {ans[name]!r}", f"kv_transfer_params.{name}")
        if p.dp > 1 and kv["remote_dp_rank"] != issued["dp_rank"]:
            raise BadRequest("remote_dp_rank must be the rank P's leg was pinned to", "kv_transfer_params.remote_dp_rank")


def _check_transfer_id(tid) -> None:
    if not isinstance(tid, str) or not TRANSFER_ID_RE.match(tid):
        raise BadRequest(f"transfer_id must be tx-<uuid4>, got {tid!r}", "kv_transfer_params.transfer_id")

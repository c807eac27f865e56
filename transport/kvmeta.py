"""vLLM-free data for the pd-router push connector (``transport.connector``).

What the scheduler side hands the worker side each step (``StepMeta``), what a decode worker
sends a prefill worker to register its blocks (``Registration``, JSON on the side channel), how
request ids are matched across the two instances (``base_request_id``), and how a worker's KV
cache tensors are described as transport planes (``plane_of``/``KVLayout``).

Nothing here imports vLLM or torch, so it is unit-tested without them.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import asdict, dataclass, field

_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def base_request_id(req_id: str) -> str:
    """The engine request id without vLLM's random ``-<8 hex>`` suffix.

    vLLM makes ``cmpl-<X-Request-Id>-<i>-<8hex>`` (completions) or ``chatcmpl-<X-Request-Id>-<8hex>``
    (chat); the router sends the same X-Request-Id and endpoint to both legs, so the prefill and the
    decode instance agree on this prefix (docs/vllm-facts.md).
    """
    return _SUFFIX.sub("", req_id)


@dataclass
class SendReq:
    """Prefill side: a finished prefill whose blocks may be written to a decode instance."""

    req_id: str
    base_id: str
    block_ids: list[int]
    num_tokens: int  # prompt tokens whose KV the blocks hold


@dataclass
class RecvReq:
    """Decode side: blocks allocated for a request whose KV the prefill instance will push."""

    req_id: str
    base_id: str
    block_ids: list[int]  # decode-side blocks to fill, in token order
    first_block: int  # index of block_ids[0] in the request's block list (local prefix hit)
    num_tokens: int  # prompt tokens
    remote_host: str
    remote_port: int


@dataclass
class RemoteCancel:
    """Decode side: a request that finished (aborted) before it was scheduled, so it never
    registered; the prefill side is still told, so it frees the prefill's blocks at once."""

    base_id: str
    remote_host: str
    remote_port: int


@dataclass
class StepMeta:
    """Scheduler -> worker, once per step."""

    sends: list[SendReq] = field(default_factory=list)
    recvs: list[RecvReq] = field(default_factory=list)
    # prefill side: base ids of prefills that ended without KV to push (aborted, error)
    cancel_sends: list[str] = field(default_factory=list)
    # decode side: request ids aborted while waiting for their push
    cancel_recvs: list[str] = field(default_factory=list)
    # decode side: requests that finished before they were scheduled (no blocks, no registration)
    cancel_unscheduled: list[RemoteCancel] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.sends or self.recvs or self.cancel_sends or self.cancel_recvs
                    or self.cancel_unscheduled)


@dataclass
class KVLayout:
    """A worker's KV cache as transport planes: block ``b`` of plane ``i`` is at
    ``bases[i] + b*stride`` and is ``block_bytes`` long. Same model and block size on both sides
    give the same plane count and block size."""

    bases: list[int]
    block_bytes: int
    stride: int
    block_size: int  # tokens per block

    def compatible(self, other: "KVLayout") -> str | None:
        """None when blocks can be copied plane by plane, else why not (``self`` is the prefill
        side, ``other`` the decode side), naming the setting to align."""
        if len(self.bases) != len(other.bases):
            return (f"plane count differs ({len(self.bases)} vs {len(other.bases)}): "
                    "prefill and decode must serve the same model (same layers)")
        if self.block_size != other.block_size:
            return (f"block shape differs ({self.block_bytes} B/{self.block_size} tokens vs "
                    f"{other.block_bytes} B/{other.block_size} tokens): --block-size differs "
                    f"(prefill {self.block_size}, decode {other.block_size}); start both "
                    "instances with the same --block-size")
        if self.block_bytes != other.block_bytes:
            return (f"block shape differs ({self.block_bytes} B/{self.block_size} tokens vs "
                    f"{other.block_bytes} B/{other.block_size} tokens): same block size but "
                    "different bytes per block (model, --dtype / --kv-cache-dtype or "
                    "tensor-parallel size differ)")
        return None


def plane_of(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int, data_ptr: int,
             num_blocks: int) -> list[tuple[int, int, int]]:
    """Split one KV cache tensor into planes ``(base, block_bytes, stride)`` (bytes).

    Accepts ``(num_blocks, ...)`` (one plane; K and V inside each block) and
    ``(2, num_blocks, ...)`` (a K plane and a V plane). Each block's elements must be one dense
    span of memory (any order inside: both sides share the layout), else ValueError.
    """
    shape, strides = tuple(shape), tuple(strides)
    if shape and shape[0] == num_blocks and not (len(shape) > 1 and shape[0] == 2 and shape[1] == num_blocks):
        planes = [(data_ptr, shape[1:], strides[1:], strides[0])]
    elif len(shape) > 1 and shape[0] == 2 and shape[1] == num_blocks:
        planes = [(data_ptr + k * strides[0] * itemsize, shape[2:], strides[2:], strides[1]) for k in (0, 1)]
    else:
        raise ValueError(f"KV cache tensor of shape {shape} has no block dimension of size {num_blocks}")
    out = []
    for base, inner, inner_strides, block_stride in planes:
        numel = 1
        for s in inner:
            numel *= s
        span = 1 + sum((s - 1) * st for s, st in zip(inner, inner_strides) if s > 0)
        if span != numel or block_stride < numel:
            raise ValueError(f"KV cache block of shape {inner} strides {inner_strides} is not dense")
        out.append((base, numel * itemsize, block_stride * itemsize))
    return out


def layout_from_planes(planes: list[tuple[int, int, int]], block_size: int) -> KVLayout:
    if not planes:
        raise ValueError("no KV cache planes")
    sizes = {(b, s) for _, b, s in planes}
    if len(sizes) != 1:
        raise ValueError(f"KV cache planes differ in block size/stride: {sorted(sizes)}")
    (block_bytes, stride), = sizes
    seen, bases = set(), []
    for base, _, _ in planes:
        if base not in seen:  # layers sharing one cache tensor are copied once
            seen.add(base)
            bases.append(base)
    return KVLayout(bases, block_bytes, stride, block_size)


@dataclass
class Registration:
    """Decode worker -> prefill worker: where to write one request's KV (side channel, JSON)."""

    base_id: str  # match key
    dst_req_id: str  # decode's engine request id: the notification message
    endpoint: bytes  # decode transport's endpoint blob
    backend: str  # decode transport's backend name
    block_ids: list[int]
    first_block: int
    num_tokens: int
    layout: KVLayout
    valid_for: float  # seconds the decode side will keep these blocks waiting

    def encode(self) -> bytes:
        d = asdict(self)
        d["endpoint"] = base64.b64encode(self.endpoint).decode()
        d["kind"] = "register"
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes | dict) -> "Registration":
        d = json.loads(raw) if isinstance(raw, (bytes, str)) else dict(raw)
        d.pop("kind", None)
        d["endpoint"] = base64.b64decode(d["endpoint"])
        d["layout"] = KVLayout(**d["layout"])
        d["block_ids"] = [int(b) for b in d["block_ids"]]
        return cls(**d)


def pair_blocks(src_ids: list[int], reg: Registration, block_size: int) -> tuple[list[int], list[int]]:
    """The (prefill, decode) block lists to copy for one request.

    The decode side sends only the blocks it allocated for the pushed tokens, starting at block
    ``first_block`` of the request (earlier blocks were a local prefix hit on decode). Whole
    blocks are copied up to the one holding the last prompt token.
    """
    needed = -(-reg.num_tokens // block_size) - reg.first_block
    src = list(src_ids[reg.first_block:reg.first_block + needed])
    dst = list(reg.block_ids[:needed])
    if needed <= 0:
        return [], []
    if len(src) < needed or len(dst) < needed:
        raise ValueError(f"request {reg.base_id}: need {needed} blocks from block {reg.first_block}, "
                         f"prefill has {len(src_ids)}, decode registered {len(reg.block_ids)}")
    return src, dst

"""pd-router's push KV connector for vLLM (the only module of the repository that imports vLLM).

Load it with::

    --kv-transfer-config '{"kv_connector": "PdrPushConnector",
                           "kv_connector_module_path": "transport.connector",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                           "kv_connector_extra_config": {...}}'

(the repository root must be on the workers' PYTHONPATH). Push semantics as NixlPushConnector
(PROTOCOLS.md section 3), over ``transport`` (cma / tcp / shm-less backends / nixl):

- decode (request with ``kv_transfer_params.do_remote_prefill``): returns all uncomputed prompt
  tokens as an async external hit; after allocation the worker registers the new block ids and
  its transport endpoint with the prefill side channel ``remote_host:remote_port``; the request
  stays in WAITING_FOR_REMOTE_KVS until the prefill side's notification arrives (then it decodes)
  or ``push_timeout_s`` passes / the prefill side reports a failure (then the request fails).
- prefill (``do_remote_decode``): when the request finishes, its blocks are held and handed to the
  worker, which pairs them with the decode registration (either order, by the X-Request-Id based
  id) and WRITEs them into decode's blocks from a background thread; the blocks are freed when
  the write is acknowledged, fails, or no registration came within ``lease_s``.

Extra config (all optional): ``transport`` (``auto`` | ``cma`` | ``tcp`` | ``nixl`` | ``shm``
is refused: it needs its own allocation), ``transport_options`` (constructor kwargs),
``side_channel_host`` / ``side_channel_port`` (default ``$VLLM_NIXL_SIDE_CHANNEL_HOST`` /
``$VLLM_NIXL_SIDE_CHANNEL_PORT``, what ``launch`` sets; the router's ``kv_host``/``kv_port``),
``lease_s`` (30), ``push_timeout_s`` (60), ``transfer_timeout_s`` (20).
The vLLM-free logic lives in ``transport.kvmeta`` and ``transport.push_state``.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                KVConnectorRole, KVConnectorTransferResults)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from transport import timeline
from transport.base import Region
from transport.connector_stats import PdrKVConnectorStats, PdrPromMetrics
from transport.kvmeta import (RecvReq, RemoteCancel, SendReq, StepMeta, base_request_id, layout_from_planes,
                              plane_of)
from transport.push_state import PushReceiver, PushSender
from transport.select import create
from transport.timeline import tl

if TYPE_CHECKING:
    import torch

    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.pdr_connector")
# transport.push_state logs to "pdr.push" (vLLM-free); inside vLLM show it like vLLM's own lines.
_push_log = logging.getLogger("pdr.push")
if not _push_log.handlers:
    for _h in logging.getLogger("vllm").handlers:
        _push_log.addHandler(_h)
    _push_log.setLevel(logging.INFO)


def check_supported(vllm_config: Any, kv_cache_config: Any = None) -> None:
    """Raise ValueError at start-up (connector construction, KV cache registration) for settings
    this connector cannot serve, naming them: it runs one worker per instance (one side channel,
    one registration per request) and copies one KV cache group."""
    par = getattr(vllm_config, "parallel_config", None)
    bad = [f"{flag} {getattr(par, attr, 1)}" for attr, flag in (
        ("tensor_parallel_size", "--tensor-parallel-size"),
        ("pipeline_parallel_size", "--pipeline-parallel-size"),
        ("data_parallel_size", "--data-parallel-size"),
        ("prefill_context_parallel_size", "--prefill-context-parallel-size"),
        ("decode_context_parallel_size", "--decode-context-parallel-size"),
    ) if par is not None and int(getattr(par, attr, 1) or 1) > 1]
    if bad:
        raise ValueError(f"PdrPushConnector supports only one worker per instance: {', '.join(bad)} "
                         "is not supported (use 1, or NixlConnector / NixlPushConnector)")
    groups = getattr(kv_cache_config, "kv_cache_groups", None)
    if groups is not None and len(groups) > 1:
        raise ValueError(f"PdrPushConnector supports one KV cache group, this model has {len(groups)} "
                         "(hybrid KV cache, e.g. sliding-window or mamba layers): not supported")


class PdrConnectorMetadata(KVConnectorMetadata):
    def __init__(self, step: StepMeta) -> None:
        self.step = step


class PdrPushConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        check_supported(vllm_config, kv_cache_config)
        cfg = self._kv_transfer_config
        self._extra: dict[str, Any] = dict(cfg.kv_connector_extra_config or {})
        self._engine_id = cfg.engine_id
        self._block_size = vllm_config.cache_config.block_size
        self._producer = cfg.kv_role in ("kv_producer", "kv_both")
        self._consumer = cfg.kv_role in ("kv_consumer", "kv_both")
        # scheduler side
        self._sends: list[SendReq] = []
        self._recvs: list[RecvReq] = []
        self._inflight_sends: set[str] = set()
        self._cancel_sends: list[str] = []
        self._cancel_recvs: list[str] = []
        self._cancel_unscheduled: list[RemoteCancel] = []
        self._waiting_recvs: set[str] = set()  # decode requests registered, push not yet in
        self._tl_loaded: set[str] = set()  # PDR_TIMELINE only: loaded, not yet scheduled
        # worker side
        self.sender: PushSender | None = None
        self.receiver: PushReceiver | None = None

    def _opt(self, key: str, default: float) -> float:
        return float(self._extra.get(key, default))

    # ---- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True
        return 0, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # handled: a second call (after the load) is a no-op
        if num_external_tokens <= 0:
            return
        tl("D_alloc", request.request_id)
        all_ids = list(blocks.get_block_ids()[0])
        new_ids = list(blocks.get_unhashed_block_ids())
        port = params.get("remote_port")
        self._waiting_recvs.add(request.request_id)
        self._recvs.append(RecvReq(
            req_id=request.request_id, base_id=base_request_id(request.request_id),
            block_ids=new_ids, first_block=len(all_ids) - len(new_ids),
            num_tokens=len(request.prompt_token_ids or ()),
            remote_host=str(params.get("remote_host") or ""),
            remote_port=int(port) if port is not None else -1,
        ))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        for rid in [r for r in self._tl_loaded if r in scheduler_output.num_scheduled_tokens]:
            tl("D_scheduled_after_load", rid)
            self._tl_loaded.discard(rid)
        meta = PdrConnectorMetadata(StepMeta(sends=self._sends, recvs=self._recvs,
                                             cancel_sends=self._cancel_sends,
                                             cancel_recvs=self._cancel_recvs,
                                             cancel_unscheduled=self._cancel_unscheduled))
        self._sends, self._recvs, self._cancel_sends, self._cancel_recvs = [], [], [], []
        self._cancel_unscheduled = []
        return meta

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        tl("P_request_finished" if self._producer else "D_request_finished", request.request_id)
        if request.request_id in self._waiting_recvs:
            # Decode request finished (aborted) while its push is outstanding. vLLM keeps its
            # blocks until we report it in finished_recving; the worker asks prefill to drop it.
            self._cancel_recvs.append(request.request_id)
            return False, None
        if params and params.get("do_remote_prefill"):
            # Decode request finished (aborted) before it was scheduled: it has no blocks and
            # never registered, but the prefill side may hold (or be computing) its KV; tell it.
            params["do_remote_prefill"] = False
            port = params.get("remote_port")
            log.info("pdr connector: decode request %s ended (%s) before it was scheduled: "
                     "cancelling its push at %s:%s", request.request_id, request.status.name,
                     params.get("remote_host"), port)
            if params.get("remote_host") and port is not None:
                self._cancel_unscheduled.append(RemoteCancel(
                    base_request_id(request.request_id), str(params["remote_host"]), int(port)))
            return False, None
        if not params or not params.get("do_remote_decode"):
            return False, None
        if block_ids and isinstance(block_ids[0], (list, tuple)):
            block_ids = list(block_ids[0])
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED) \
                or not block_ids:
            self._cancel_sends.append(base_request_id(request.request_id))
            return False, None
        num_tokens = len(request.prompt_token_ids or ())
        self._sends.append(SendReq(request.request_id, base_request_id(request.request_id),
                                   [int(b) for b in block_ids], num_tokens))
        self._inflight_sends.add(request.request_id)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self._engine_id, "remote_request_id": request.request_id,
            "remote_num_tokens": num_tokens, "transfer_mode": "push",
        }

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        for rid in connector_output.finished_sending or ():
            tl("P_finished_sending", rid)
            self._inflight_sends.discard(rid)
        for rid in connector_output.finished_recving or ():
            tl("D_finished_recving", rid)
            if timeline.ENABLED:
                self._tl_loaded.add(rid)
            self._waiting_recvs.discard(rid)

    def has_pending_push_work(self) -> bool:
        return bool(self._inflight_sends or self._sends or self._recvs or self._cancel_sends
                    or self._cancel_recvs or self._cancel_unscheduled)

    # ---- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        check_supported(self._vllm_config, self._kv_cache_config)
        num_blocks = self._kv_cache_config.num_blocks
        planes: list[tuple[int, int, int]] = []
        regions: dict[int, int] = {}
        for name in sorted(kv_caches):
            t = kv_caches[name]
            planes += plane_of(tuple(t.shape), tuple(t.stride()), t.element_size(), t.data_ptr(), num_blocks)
            st = t.untyped_storage()
            regions[st.data_ptr()] = max(regions.get(st.data_ptr(), 0), st.nbytes())
        layout = layout_from_planes(planes, self._block_size)
        region_list = [Region(a, n) for a, n in sorted(regions.items())]
        backend = self._extra.get("transport") or None
        opts = dict(self._extra.get("transport_options") or {})
        log.info("pdr connector: %d planes, %d B blocks (stride %d), %d regions, transport %s",
                 len(layout.bases), layout.block_bytes, layout.stride, len(region_list), backend or "auto")
        if self._producer:
            host = self._extra.get("side_channel_host") or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
            port = int(self._extra.get("side_channel_port") or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", 0))
            self.sender = PushSender(create(backend, **opts), layout, region_list, host=host, port=port,
                                     lease_s=self._opt("lease_s", 30), 
                                     transfer_timeout=self._opt("transfer_timeout_s", 20))
            self.sender.start()
            log.info("pdr connector: prefill side channel on %s:%d (%s)", host, self.sender.port,
                     self.sender.transport.name)
        if self._consumer:
            self.receiver = PushReceiver(create(backend, **opts), layout, region_list,
                                         timeout_s=self._opt("push_timeout_s", 60))
            self.receiver.start()
            log.info("pdr connector: decode receiver on %s", self.receiver.transport.name)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdrConnectorMetadata)
        for s in meta.step.sends:
            if self.sender is None:
                log.error("pdr connector: %s needs a producer (kv_role) to push", s.req_id)
                continue
            self.sender.add_finished(s)
        for r in meta.step.recvs:
            if self.receiver is None:
                log.error("pdr connector: %s needs a consumer (kv_role) to receive", r.req_id)
                continue
            self.receiver.expect(r)
        for base in meta.step.cancel_sends:
            if self.sender is not None:
                self.sender.cancel_prefill(base)
        for rid in meta.step.cancel_recvs:
            if self.receiver is not None:
                self.receiver.abort(rid)
        for c in meta.step.cancel_unscheduled:
            if self.receiver is not None:
                self.receiver.cancel_unscheduled(c.base_id, c.remote_host, c.remote_port)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending = self.sender.poll_done() if self.sender else set()
        recving, failed = self.receiver.poll() if self.receiver else (set(), set())
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    # ---- stats (transport.connector_stats) ----------------------------------------------------

    def get_kv_connector_stats(self) -> PdrKVConnectorStats | None:
        """Worker side, every step: the transfers recorded since the last call, or None."""
        data: dict[str, list] = {}
        for side in (self.sender, self.receiver):
            got = side.xfer.take() if side is not None else None
            for k, v in (got or {}).items():
                data.setdefault(k, []).extend(v)
        return PdrKVConnectorStats(data=data) if any(data.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdrKVConnectorStats:
        return PdrKVConnectorStats(data=data) if data is not None else PdrKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> PdrPromMetrics:
        return PdrPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for side in (self.sender, self.receiver):
            if side is not None:
                try:
                    side.close()
                except Exception:  # noqa: BLE001
                    pass

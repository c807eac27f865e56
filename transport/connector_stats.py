"""vLLM's stats hooks for ``PdrPushConnector`` (imports vLLM, like ``transport.connector``).

The worker side records transfers in ``transport.xfer_stats.XferRecorder``; every engine step
``PdrPushConnector.get_kv_connector_stats`` wraps what was recorded since the last step in a
``PdrKVConnectorStats`` and returns it in the step's ``KVConnectorOutput``. vLLM's scheduler
puts its ``to_dict()`` in ``SchedulerStats.kv_connector_stats``, the front end rebuilds it with
``PdrPushConnector.build_kv_connector_stats`` for the periodic "KV Transfer metrics:" log line
(``reduce``), and feeds the same dict to ``PdrPromMetrics.observe`` for ``/metrics``:

=====================================  =========  ==================================================
name                                   type       meaning
=====================================  =========  ==================================================
vllm:pdr_kv_sent_bytes_total           counter    KV bytes written to decode (prefill side)
vllm:pdr_kv_sent_transfers_total       counter    successful writes (one per request)
vllm:pdr_kv_descriptors_total          counter    descriptors of those writes
vllm:pdr_kv_xfer_time_seconds          histogram  write start to decode's acknowledgement
vllm:pdr_kv_transfer_bytes             histogram  bytes per write
vllm:pdr_kv_failed_sends_total         counter    writes that failed
vllm:pdr_kv_expired_sends_total        counter    prefills released after lease_s, no registration
vllm:pdr_kv_received_bytes_total       counter    KV bytes received (decode side)
vllm:pdr_kv_received_transfers_total   counter    requests whose KV arrived
vllm:pdr_kv_recv_wait_seconds          histogram  registration to notification (includes prefill)
vllm:pdr_kv_failed_recvs_total         counter    decode requests that did not get their KV
=====================================  =========  ==================================================

Labels are vLLM's (``model_name``, ``engine``). A ``kv_both`` instance reports both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics, KVConnectorStats,
                                                                   PromMetric, PromMetricT)
from vllm.v1.metrics.utils import create_metric_per_engine

from transport.xfer_stats import KEYS, empty

_MB = 2**20


@dataclass
class PdrKVConnectorStats(KVConnectorStats):
    """One interval's transfer observations: ``data`` as ``transport.xfer_stats`` describes."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        else:  # from another version / partial payload: every key present, as lists
            self.data = {k: list(self.data.get(k) or ()) for k in KEYS}

    def reset(self) -> None:
        self.data = empty()

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for k in KEYS:
                self.data.setdefault(k, []).extend(other.data.get(k) or ())
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        sent, recv = len(d["bytes_sent"]), len(d["bytes_received"])
        out: dict[str, int | float] = {"Num sends": sent}
        if sent:
            mb = float(np.sum(d["bytes_sent"])) / _MB
            t = np.asarray(d["transfer_duration"], dtype=float)
            out.update({
                "MB sent": round(mb, 3),
                "Avg xfer time (ms)": round(float(t.mean()) * 1e3, 3),
                "P90 xfer time (ms)": round(float(np.percentile(t, 90)) * 1e3, 3),
                "Throughput (MB/s)": round(mb / float(t.sum()), 3) if t.sum() > 0 else 0,
                "Avg descriptors": round(float(np.mean(d["descriptors"])), 1),
            })
        out["Num recvs"] = recv
        if recv:
            w = np.asarray(d["recv_wait"], dtype=float)
            out.update({
                "MB received": round(float(np.sum(d["bytes_received"])) / _MB, 3),
                "Avg recv wait (ms)": round(float(w.mean()) * 1e3, 3),
            })
        out.update({"Failed sends": len(d["failed_sends"]), "Expired sends": len(d["expired_sends"]),
                    "Failed recvs": len(d["failed_recvs"])})
        return out


class PdrPromMetrics(KVConnectorPromMetrics):
    """The connector's Prometheus metrics (module docstring), one child per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str) -> dict[int, PromMetric]:
            return create_metric_per_engine(self._counter_cls(name=name, documentation=doc, labelnames=labelnames),
                                            per_engine_labelvalues)

        def histogram(name: str, doc: str, buckets: list[float]) -> dict[int, PromMetric]:
            return create_metric_per_engine(
                self._histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames),
                per_engine_labelvalues)

        self.sent_bytes = counter("vllm:pdr_kv_sent_bytes", "KV cache bytes written to decode instances "
                                  "by pd-router's push connector (prefill side).")
        self.sent_transfers = counter("vllm:pdr_kv_sent_transfers", "Successful KV writes (one per request) "
                                      "by pd-router's push connector (prefill side).")
        self.descriptors = counter("vllm:pdr_kv_descriptors", "Descriptors of the successful KV writes "
                                   "of pd-router's push connector.")
        self.failed_sends = counter("vllm:pdr_kv_failed_sends", "KV writes of pd-router's push connector "
                                    "that failed (decode was told).")
        self.expired_sends = counter("vllm:pdr_kv_expired_sends", "Prefilled requests whose KV was released "
                                     "after lease_s with no decode registration.")
        self.received_bytes = counter("vllm:pdr_kv_received_bytes", "KV cache bytes received from prefill "
                                      "instances by pd-router's push connector (decode side).")
        self.received_transfers = counter("vllm:pdr_kv_received_transfers", "Requests whose KV arrived "
                                          "through pd-router's push connector (decode side).")
        self.failed_recvs = counter("vllm:pdr_kv_failed_recvs", "Decode requests that did not get their KV "
                                    "(failure notification, refused registration, deadline, cancel).")
        self.xfer_time = histogram("vllm:pdr_kv_xfer_time_seconds", "Seconds from the start of a KV write "
                                   "to decode's acknowledgement (prefill side).",
                                   [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0])
        self.transfer_bytes = histogram("vllm:pdr_kv_transfer_bytes", "Bytes per KV write (prefill side).",
                                        [float(2 ** (10 + i)) for i in range(1, 25, 2)])
        self.recv_wait = histogram("vllm:pdr_kv_recv_wait_seconds", "Seconds a decode request waited for "
                                   "its KV, from its registration (includes the prefill).",
                                   [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        for metric, key in ((self.sent_bytes, "bytes_sent"), (self.descriptors, "descriptors"),
                            (self.received_bytes, "bytes_received"), (self.failed_sends, "failed_sends"),
                            (self.expired_sends, "expired_sends"), (self.failed_recvs, "failed_recvs")):
            total = sum(d.get(key) or ())
            if total:
                metric[engine_idx].inc(total)
        if d.get("bytes_sent"):
            self.sent_transfers[engine_idx].inc(len(d["bytes_sent"]))
        if d.get("bytes_received"):
            self.received_transfers[engine_idx].inc(len(d["bytes_received"]))
        for metric, key in ((self.xfer_time, "transfer_duration"), (self.transfer_bytes, "bytes_sent"),
                            (self.recv_wait, "recv_wait")):
            for v in d.get(key) or ():
                metric[engine_idx].observe(v)

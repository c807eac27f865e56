"""The push connector's transfer stats: the vLLM-free recorder fed by PushSender/PushReceiver,
the KVConnectorStats subclass (aggregate / reduce / is_empty / reset, and its payload through
vLLM's serializer), the Prometheus metrics, and the connector's worker-side stats hook."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.transport.test_push_state import _pair, _wait
from transport.kvmeta import RecvReq, SendReq
from transport.xfer_stats import KEYS, XferRecorder

pytest.importorskip("vllm")

from transport.connector import PdrPushConnector  # noqa: E402
from transport.connector_stats import PdrKVConnectorStats, PdrPromMetrics  # noqa: E402


def _data(**kw) -> dict:
    d = {k: [] for k in KEYS}
    d.update(kw)
    return d


def test_recorder_take_returns_the_interval_and_starts_afresh():
    r = XferRecorder()
    assert r.take() is None
    r.sent(4096, 3, 0.002)
    r.received(4096, 0.5)
    r.failed_send()
    r.expired_send()
    r.failed_recv()
    got = r.take()
    assert got == _data(bytes_sent=[4096], descriptors=[3], transfer_duration=[0.002], bytes_received=[4096],
                        recv_wait=[0.5], failed_sends=[1], expired_sends=[1], failed_recvs=[1])
    assert all(type(v) in (int, float) for vs in got.values() for v in vs)
    assert r.take() is None


def test_stats_empty_reset_and_partial_payload():
    s = PdrKVConnectorStats()
    assert s.is_empty() and s.data == _data()
    s = PdrKVConnectorStats(data={"bytes_sent": [10], "descriptors": [1], "transfer_duration": [0.1]})
    assert not s.is_empty() and set(s.data) == set(KEYS) and s.data["failed_recvs"] == []
    assert not PdrKVConnectorStats(data=_data(expired_sends=[1])).is_empty()  # failures alone count
    s.reset()
    assert s.is_empty()


def test_stats_aggregate_and_reduce():
    a = PdrKVConnectorStats(data=_data(bytes_sent=[2**20], descriptors=[4], transfer_duration=[0.010],
                                       failed_sends=[1]))
    b = PdrKVConnectorStats(data=_data(bytes_sent=[3 * 2**20], descriptors=[8], transfer_duration=[0.030],
                                       bytes_received=[2**20], recv_wait=[0.2], failed_recvs=[1, 1],
                                       expired_sends=[1]))
    out = a.aggregate(b)
    assert out is a
    assert a.aggregate(PdrKVConnectorStats()) is a  # empty: no change
    assert a.data["bytes_sent"] == [2**20, 3 * 2**20] and a.data["failed_recvs"] == [1, 1]
    r = a.reduce()
    assert r["Num sends"] == 2 and r["MB sent"] == 4.0
    assert r["Avg xfer time (ms)"] == 20.0 and r["Throughput (MB/s)"] == 100.0
    assert r["Avg descriptors"] == 6.0
    assert r["Num recvs"] == 1 and r["MB received"] == 1.0 and r["Avg recv wait (ms)"] == 200.0
    assert (r["Failed sends"], r["Expired sends"], r["Failed recvs"]) == (1, 1, 2)
    only_failures = PdrKVConnectorStats(data=_data(failed_recvs=[1])).reduce()
    assert only_failures["Num sends"] == 0 and only_failures["Failed recvs"] == 1 and "MB sent" not in only_failures


def test_payload_survives_vllms_serializer():
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    s = PdrKVConnectorStats(data=_data(bytes_sent=[123], descriptors=[2], transfer_duration=[0.5]))
    raw = MsgpackEncoder().encode(s.to_dict())
    back = PdrPushConnector.build_kv_connector_stats(MsgpackDecoder().decode(raw))
    assert isinstance(back, PdrKVConnectorStats) and back.data == s.data
    assert PdrPushConnector.build_kv_connector_stats().is_empty()


def _prom(registry):
    def bound(cls):
        def init(self, *a, **k):
            cls.__init__(self, *a, registry=registry, **k)

        return type(cls.__name__, (cls,), {"__init__": init})

    types = {Counter: bound(Counter), Gauge: bound(Gauge), Histogram: bound(Histogram)}
    return PdrPushConnector.build_prom_metrics(SimpleNamespace(kv_transfer_config=None), types,
                                               ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})


def _samples(registry) -> dict[tuple[str, str], float]:
    text = generate_latest(registry).decode()
    return {(s.name, s.labels.get("engine", "")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_prom_metrics_count_what_was_observed_per_engine():
    reg = CollectorRegistry()
    prom = _prom(reg)
    assert isinstance(prom, PdrPromMetrics)
    prom.observe(_data(bytes_sent=[1000, 500], descriptors=[4, 2], transfer_duration=[0.003, 0.02],
                       failed_sends=[1]), engine_idx=0)
    prom.observe(_data(bytes_received=[1500], recv_wait=[0.4], failed_recvs=[1], expired_sends=[1]), engine_idx=1)
    prom.observe(_data(bytes_sent=[100], descriptors=[1], transfer_duration=[0.001]), engine_idx=0)
    s = _samples(reg)
    assert s[("vllm:pdr_kv_sent_bytes_total", "0")] == 1600
    assert s[("vllm:pdr_kv_sent_transfers_total", "0")] == 3
    assert s[("vllm:pdr_kv_descriptors_total", "0")] == 7
    assert s[("vllm:pdr_kv_failed_sends_total", "0")] == 1
    assert s[("vllm:pdr_kv_received_bytes_total", "0")] == 0
    assert s[("vllm:pdr_kv_received_bytes_total", "1")] == 1500
    assert s[("vllm:pdr_kv_received_transfers_total", "1")] == 1
    assert s[("vllm:pdr_kv_failed_recvs_total", "1")] == 1
    assert s[("vllm:pdr_kv_expired_sends_total", "1")] == 1
    assert s[("vllm:pdr_kv_xfer_time_seconds_count", "0")] == 3
    assert s[("vllm:pdr_kv_transfer_bytes_sum", "0")] == 1600
    assert s[("vllm:pdr_kv_recv_wait_seconds_count", "1")] == 1


@pytest.mark.parametrize("backend", ["cma", "tcp"])
def test_sender_and_receiver_record_the_same_bytes(backend):
    p, d, sender, receiver = _pair(backend)
    try:
        send = SendReq("cmpl-s-0-11111111", "cmpl-s-0", [3, 5, 1], 40)
        recv = RecvReq("cmpl-s-0-22222222", "cmpl-s-0", [9, 2, 4], 0, 40, "127.0.0.1", sender.port)
        sender.add_finished(send)
        receiver.expect(recv)
        fin, fail = _wait(receiver, recv.req_id)
        assert fin == {recv.req_id} and not fail
        deadline = time.monotonic() + 5
        while not sender.poll_done() and time.monotonic() < deadline:
            time.sleep(0.01)
        sent, got = sender.xfer.take(), receiver.xfer.take()
        # 40 tokens in 16-token blocks: 3 blocks x 2 planes x 256 B
        assert sent["bytes_sent"] == [3 * 2 * 256] == got["bytes_received"]
        assert sent["descriptors"][0] >= 1 and len(sent["transfer_duration"]) == 1
        assert len(got["recv_wait"]) == 1 and not got["failed_recvs"] and not sent["failed_sends"]
    finally:
        sender.close()
        receiver.close()


def test_failures_and_expiry_are_recorded():
    p, d, sender, receiver = _pair("tcp", lease_s=0.3, timeout_s=0.5)
    try:
        sender.add_finished(SendReq("cmpl-a-0-11111111", "cmpl-a-0", [1], 10))  # no decode ever comes
        receiver.expect(RecvReq("cmpl-b-0-22222222", "cmpl-b-0", [1], 0, 10, "127.0.0.1", sender.port))
        time.sleep(0.7)
        sender.poll_done()
        receiver.poll()
        assert sender.xfer.take()["expired_sends"] == [1]
        assert receiver.xfer.take()["failed_recvs"] == [1]
    finally:
        sender.close()
        receiver.close()


def test_worker_hook_merges_both_sides_and_is_none_when_idle():
    conn = PdrPushConnector.__new__(PdrPushConnector)
    conn.sender = SimpleNamespace(xfer=XferRecorder())
    conn.receiver = SimpleNamespace(xfer=XferRecorder())
    assert conn.get_kv_connector_stats() is None
    conn.sender.xfer.sent(100, 1, 0.01)
    conn.receiver.xfer.received(200, 0.1)
    s = conn.get_kv_connector_stats()
    assert isinstance(s, PdrKVConnectorStats)
    assert s.data["bytes_sent"] == [100] and s.data["bytes_received"] == [200]
    assert conn.get_kv_connector_stats() is None
    conn.sender = conn.receiver = None  # scheduler side: no worker state
    assert conn.get_kv_connector_stats() is None

"""The connector's vLLM-free parts: request-id matching, KV planes, block pairing, and the
PushSender/PushReceiver pair moving real bytes over real transports (cma, tcp) in one process."""

from __future__ import annotations

import time

import numpy as np
import pytest

from transport import Region, create
from transport.kvmeta import (KVLayout, RecvReq, Registration, SendReq, base_request_id, layout_from_planes,
                              pair_blocks, plane_of)
from transport.push_state import PushReceiver, PushSender, side_request
from transport_testlib import NIXL_OK, NIXL_WHY, UCX_ENV


def test_base_request_id_strips_only_the_random_suffix():
    assert base_request_id("cmpl-req-1-0-afd841ad") == "cmpl-req-1-0"
    assert base_request_id("chatcmpl-abc-0123abcd") == "chatcmpl-abc"
    assert base_request_id("cmpl-req-1-0") == "cmpl-req-1-0"  # no 8-hex tail: unchanged
    assert base_request_id("x-ABCDEF12") == "x-ABCDEF12"  # vLLM's suffix is lower-case hex


def test_plane_of_split_and_joint_layouts():
    # (2, num_blocks, block, heads, dim) float32: two planes, 8 KiB blocks
    nb, shape = 10, (2, 10, 16, 4, 32)
    strides = (10 * 16 * 4 * 32, 16 * 4 * 32, 4 * 32, 32, 1)
    planes = plane_of(shape, strides, 4, 1000, nb)
    assert planes == [(1000, 8192, 8192), (1000 + 10 * 8192, 8192, 8192)]
    # (num_blocks, 2, block, heads, dim): one plane with K and V inside each block
    planes = plane_of((10, 2, 16, 4, 32), (2 * 16 * 4 * 32, 16 * 4 * 32, 4 * 32, 32, 1), 4, 0, nb)
    assert planes == [(0, 16384, 16384)]
    with pytest.raises(ValueError):
        plane_of((3, 16), (16, 1), 4, 0, nb)  # no block dimension
    with pytest.raises(ValueError):
        plane_of((10, 16, 4), (128, 1, 32), 4, 0, nb)  # block not dense (padding)


def test_layout_dedups_shared_planes_and_rejects_mixed_blocks():
    lay = layout_from_planes([(0, 64, 64), (640, 64, 64), (0, 64, 64)], 16)
    assert lay.bases == [0, 640]
    with pytest.raises(ValueError):
        layout_from_planes([(0, 64, 64), (640, 32, 64)], 16)
    assert lay.compatible(KVLayout([1, 2], 64, 128, 16)) is None
    assert "plane count" in lay.compatible(KVLayout([1], 64, 64, 16))
    assert "block shape" in lay.compatible(KVLayout([1, 2], 32, 64, 16))


def _reg(**kw) -> Registration:
    d = dict(base_id="b", dst_req_id="d", endpoint=b"\x00e", backend="tcp", block_ids=[7, 8, 9],
             first_block=0, num_tokens=40, layout=KVLayout([0], 64, 64, 16), valid_for=5.0)
    d.update(kw)
    return Registration(**d)


def test_registration_roundtrip_and_block_pairing():
    reg = _reg()
    assert Registration.decode(reg.encode()) == reg
    assert pair_blocks([1, 2, 3, 4], reg, 16) == ([1, 2, 3], [7, 8, 9])  # 40 tokens: 3 blocks
    # decode had the first block cached locally: only blocks 1..2 travel
    assert pair_blocks([1, 2, 3, 4], _reg(first_block=1, block_ids=[8, 9]), 16) == ([2, 3], [8, 9])
    with pytest.raises(ValueError):
        pair_blocks([1, 2], reg, 16)  # prefill has too few blocks


class _Side:
    """A fake worker KV cache: 2 planes x num_blocks blocks of 256 bytes, in one numpy array."""

    def __init__(self, num_blocks=12, block_bytes=256, fill=None):
        self.arr = np.zeros((2, num_blocks, block_bytes), dtype=np.uint8)
        if fill is not None:
            self.arr[:] = np.random.default_rng(fill).integers(0, 255, self.arr.shape, dtype=np.uint8)
        base = self.arr.ctypes.data
        self.layout = KVLayout([base, base + num_blocks * block_bytes], block_bytes, block_bytes, 16)
        self.regions = [Region(base, self.arr.nbytes)]


def _make(backend):
    return create("nixl", ucx_env=UCX_ENV) if backend == "nixl" else create(backend)


def _pair(backend, *, lease_s=30.0, timeout_s=10.0):
    p, d = _Side(fill=1), _Side()
    sender = PushSender(_make(backend), p.layout, p.regions, lease_s=lease_s, transfer_timeout=5)
    receiver = PushReceiver(_make(backend), d.layout, d.regions, timeout_s=timeout_s)
    sender.start()
    receiver.start()
    return p, d, sender, receiver


def _wait(receiver, rid, limit=10.0):
    fin, fail = set(), set()
    end = time.monotonic() + limit
    while rid not in fin and time.monotonic() < end:
        f, x = receiver.poll()
        fin |= f
        fail |= x
        time.sleep(0.01)
    return fin, fail


@pytest.mark.parametrize("backend", ["cma", "tcp", pytest.param("nixl", marks=pytest.mark.skipif(
    not NIXL_OK, reason=f"nixl not importable: {NIXL_WHY}"))])
@pytest.mark.parametrize("order", ["prefill-first", "registration-first"])
def test_push_writes_blocks_in_either_order(backend, order):
    p, d, sender, receiver = _pair(backend)
    try:
        send = SendReq("cmpl-x-0-11111111", "cmpl-x-0", [3, 5, 1], 40)
        recv = RecvReq("cmpl-x-0-22222222", "cmpl-x-0", [9, 2, 4], 0, 40, "127.0.0.1", sender.port)
        if order == "prefill-first":
            sender.add_finished(send)
            receiver.expect(recv)
        else:
            receiver.expect(recv)
            time.sleep(0.3)
            assert receiver.poll() == (set(), set())  # nothing before the prefill finished
            sender.add_finished(send)
        fin, fail = _wait(receiver, recv.req_id)
        assert fin == {recv.req_id} and not fail
        for s, t in zip([3, 5, 1], [9, 2, 4]):
            assert (d.arr[:, t] == p.arr[:, s]).all()
        untouched = [b for b in range(12) if b not in (9, 2, 4)]
        assert not d.arr[:, untouched].any()
        deadline = time.monotonic() + 5
        done = set()
        while send.req_id not in done and time.monotonic() < deadline:
            done |= sender.poll_done()
            time.sleep(0.01)
        assert done == {send.req_id}
        assert sender.stats["written"] == 1
    finally:
        sender.close()
        receiver.close()


def test_decode_times_out_and_prefill_lease_expires():
    p, d, sender, receiver = _pair("tcp", lease_s=0.3, timeout_s=0.5)
    try:
        sender.add_finished(SendReq("cmpl-a-0-11111111", "cmpl-a-0", [1], 10))  # no decode ever comes
        receiver.expect(RecvReq("cmpl-b-0-22222222", "cmpl-b-0", [1], 0, 10, "127.0.0.1", sender.port))
        time.sleep(0.7)
        assert sender.poll_done() == {"cmpl-a-0-11111111"}
        assert receiver.poll() == ({"cmpl-b-0-22222222"}, {"cmpl-b-0-22222222"})
        assert not d.arr.any()
    finally:
        sender.close()
        receiver.close()


def test_unreachable_prefill_fails_the_request_at_once():
    p, d, sender, receiver = _pair("tcp")
    try:
        port = sender.port
        sender.server.close()
        receiver.expect(RecvReq("cmpl-c-0-22222222", "cmpl-c-0", [1], 0, 10, "127.0.0.1", port))
        fin, fail = _wait(receiver, "cmpl-c-0-22222222", 5)
        assert fail == {"cmpl-c-0-22222222"}
    finally:
        sender.close()
        receiver.close()


def test_layout_mismatch_fails_decode_fast_and_frees_prefill():
    p, d, sender, receiver = _pair("tcp")
    try:
        receiver.layout = KVLayout(d.layout.bases[:1], d.layout.block_bytes, d.layout.stride, 16)
        receiver.expect(RecvReq("cmpl-e-0-22222222", "cmpl-e-0", [1], 0, 10, "127.0.0.1", sender.port))
        sender.add_finished(SendReq("cmpl-e-0-11111111", "cmpl-e-0", [1], 10))
        fin, fail = _wait(receiver, "cmpl-e-0-22222222", 5)
        assert fail == {"cmpl-e-0-22222222"}
        time.sleep(0.1)
        assert sender.poll_done() == {"cmpl-e-0-11111111"}
        assert not d.arr.any()
    finally:
        sender.close()
        receiver.close()


def test_side_channel_rejects_unknown_messages():
    p, d, sender, receiver = _pair("tcp")
    try:
        assert side_request("127.0.0.1", sender.port, b'{"kind":"nope"}')["ok"] is False
        assert side_request("127.0.0.1", sender.port, b"not json")["ok"] is False
    finally:
        sender.close()
        receiver.close()


def test_aborted_prefill_fails_a_registered_decode_at_once():
    p, d, sender, receiver = _pair("tcp")
    try:
        receiver.expect(RecvReq("cmpl-f-0-22222222", "cmpl-f-0", [1], 0, 10, "127.0.0.1", sender.port))
        time.sleep(0.3)  # registered, waiting
        sender.cancel_prefill("cmpl-f-0")
        fin, fail = _wait(receiver, "cmpl-f-0-22222222", 5)
        assert fail == {"cmpl-f-0-22222222"}
    finally:
        sender.close()
        receiver.close()


def test_aborted_prefill_refuses_a_later_registration():
    p, d, sender, receiver = _pair("tcp")
    try:
        sender.cancel_prefill("cmpl-g-0")
        receiver.expect(RecvReq("cmpl-g-0-22222222", "cmpl-g-0", [1], 0, 10, "127.0.0.1", sender.port))
        fin, fail = _wait(receiver, "cmpl-g-0-22222222", 5)
        assert fail == {"cmpl-g-0-22222222"}
    finally:
        sender.close()
        receiver.close()


def test_decode_abort_before_the_prefill_finished_frees_both_sides():
    p, d, sender, receiver = _pair("tcp")
    try:
        receiver.expect(RecvReq("cmpl-h-0-22222222", "cmpl-h-0", [1], 0, 10, "127.0.0.1", sender.port))
        time.sleep(0.3)
        receiver.abort("cmpl-h-0-22222222")
        fin, fail = _wait(receiver, "cmpl-h-0-22222222", 5)
        assert fail == {"cmpl-h-0-22222222"}  # reported at once: vLLM frees decode's blocks
        # the prefill finishing afterwards writes nothing and is released at once
        sender.add_finished(SendReq("cmpl-h-0-11111111", "cmpl-h-0", [1], 10))
        assert sender.poll_done() == {"cmpl-h-0-11111111"}
        time.sleep(0.2)
        assert not d.arr.any() and sender.stats["written"] == 0
    finally:
        sender.close()
        receiver.close()


def test_decode_abort_while_writing_waits_for_the_write():
    p, d, sender, receiver = _pair("tcp")
    try:
        sender._writing.add("cmpl-i-0")  # as if the writer thread had the pair
        receiver._where["cmpl-i-0-22222222"] = RecvReq("cmpl-i-0-22222222", "cmpl-i-0", [1], 0, 10,
                                                       "127.0.0.1", sender.port)
        receiver._pending["cmpl-i-0-22222222"] = time.monotonic() + 10
        receiver.abort("cmpl-i-0-22222222")
        time.sleep(0.5)
        assert receiver.poll() == (set(), set())  # still waiting for the notification
    finally:
        sender.close()
        receiver.close()


def _done_within(sender, req_id, limit=5.0):
    done = set()
    end = time.monotonic() + limit
    while req_id not in done and time.monotonic() < end:
        done |= sender.poll_done()
        time.sleep(0.01)
    return done


def test_unscheduled_decode_cancel_frees_a_finished_prefill_at_once():
    """The decode request was aborted before it was scheduled (no blocks, no registration): the
    cancel still reaches the prefill side, which frees its finished prefill's blocks at once
    (lease_s is 30 s here)."""
    p, d, sender, receiver = _pair("tcp")
    try:
        sender.add_finished(SendReq("cmpl-j-0-11111111", "cmpl-j-0", [1], 10))
        assert sender.poll_done() == set()  # held for the decode side
        receiver.cancel_unscheduled("cmpl-j-0", "127.0.0.1", sender.port)
        assert _done_within(sender, "cmpl-j-0-11111111") == {"cmpl-j-0-11111111"}
        assert sender.stats["written"] == 0 and sender.stats["expired"] == 0
    finally:
        sender.close()
        receiver.close()


def test_unscheduled_decode_cancel_before_the_prefill_finished():
    p, d, sender, receiver = _pair("tcp")
    try:
        receiver.cancel_unscheduled("cmpl-k-0", "127.0.0.1", sender.port)
        end = time.monotonic() + 5
        while "cmpl-k-0" not in sender._cancelled and time.monotonic() < end:
            time.sleep(0.01)
        assert "cmpl-k-0" in sender._cancelled
        sender.add_finished(SendReq("cmpl-k-0-11111111", "cmpl-k-0", [1], 10))
        assert sender.poll_done() == {"cmpl-k-0-11111111"}  # released at once, nothing written
        assert not d.arr.any()
    finally:
        sender.close()
        receiver.close()


def test_unscheduled_cancel_without_a_prefill_address_sends_nothing():
    sent = []
    r = PushReceiver(create("tcp"), KVLayout([0], 64, 64, 16), [], sender=lambda *a, **k: sent.append(a))
    r.cancel_unscheduled("cmpl-l-0", "", 5600)
    r.cancel_unscheduled("cmpl-l-0", "127.0.0.1", -1)
    r._pool.shutdown(wait=True)
    assert sent == []


@pytest.mark.parametrize("order", ["prefill-first", "registration-first"])
def test_block_size_mismatch_is_refused_at_registration(order, caplog):
    """Different --block-size on the two sides: the first registration is refused (logged at
    both sides with the setting named), decode fails the request at once, and prefill frees its
    blocks at once instead of after lease_s."""
    p, d, sender, receiver = _pair("tcp")
    caplog.set_level("INFO", logger="pdr.push")
    try:
        lay = d.layout
        receiver.layout = KVLayout(lay.bases, lay.block_bytes // 2, lay.stride, 8)  # 8-token blocks
        send = SendReq("cmpl-m-0-11111111", "cmpl-m-0", [1], 10)
        recv = RecvReq("cmpl-m-0-22222222", "cmpl-m-0", [1, 2], 0, 10, "127.0.0.1", sender.port)
        if order == "prefill-first":
            sender.add_finished(send)
        receiver.expect(recv)
        fin, fail = _wait(receiver, recv.req_id, 5)
        assert fail == {recv.req_id}
        if order == "registration-first":
            sender.add_finished(send)
        assert _done_within(sender, send.req_id) == {send.req_id}
        assert not d.arr.any() and sender.stats["written"] == 0
        msgs = [r.getMessage() for r in caplog.records]
        assert any("refusing decode registration of cmpl-m-0-22222222" in m and "--block-size" in m
                   and "prefill 16, decode 8" in m for m in msgs), msgs
        assert any("refused the registration of cmpl-m-0-22222222" in m and "--block-size" in m
                   for m in msgs), msgs
    finally:
        sender.close()
        receiver.close()


def test_transport_mismatch_is_refused_at_registration():
    p, d, sender, receiver = _pair("tcp")
    try:
        reg = Registration(base_id="cmpl-n-0", dst_req_id="cmpl-n-0-22222222", endpoint=b"x", backend="cma",
                           block_ids=[1], first_block=0, num_tokens=10, layout=d.layout, valid_for=5.0)
        answer = side_request("127.0.0.1", sender.port, reg.encode())
        assert answer["ok"] is False and "transport" in answer["error"] and "'cma'" in answer["error"]
    finally:
        sender.close()
        receiver.close()

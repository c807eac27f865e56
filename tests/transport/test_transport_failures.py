"""Peers that vanish or stall: both sides end with an error, never a hang, and a partial transfer
is never reported complete."""

from __future__ import annotations

import base64
import signal
import socket
import struct
import time

import numpy as np
import pytest
from transport_testlib import FILL, NIXL_OK, NIXL_WHY, get_core, pairs

from transport import _wire
from transport.base import PeerLost, Status, TransferTimeout, TransportError

MiB = 1 << 20


@pytest.mark.parametrize("backend,core_name", pairs())
def test_receiver_killed_sender_gets_an_error(backend, core_name, spawn, transports):
    core = get_core(core_name)
    rx = spawn(backend, core.IMPLEMENTATION, 4 * MiB)
    tx = transports(backend, core)
    src = tx.allocate(4 * MiB)
    tx.register(src.region)
    peer = tx.connect(rx.endpoint)
    rx.kill()
    rx.proc.wait()
    start = time.monotonic()
    t = tx.write(peer, np.array([[src.region.addr, rx.addr, 4 * MiB]], dtype=np.uint64), b"lost",
                 timeout=5)
    with pytest.raises(TransportError):
        t.wait()
    assert t.status() is Status.FAILED
    assert time.monotonic() - start < 8
    # Later writes to the dead peer fail too (at once, or by their deadline), never succeed.
    t2 = tx.write(peer, np.array([[src.region.addr, rx.addr, 16]], dtype=np.uint64), b"x", timeout=2)
    with pytest.raises(TransportError):
        t2.wait()


@pytest.mark.parametrize("backend,core_name", pairs(nixl=False))
def test_sender_dies_mid_transfer_receiver_gets_an_error(backend, core_name, spawn, transports):
    """The sender's data path moves half of the descriptors, then its process exits."""
    core = get_core(core_name)
    rx = transports(backend, core)
    dst = rx.allocate(8 * MiB)
    dst.array[:] = FILL
    rx.register(dst.region)
    tx = spawn(backend, core_name, 8 * MiB, die=True)
    tx.call(op="fill", seed=5)
    descs = np.array([[tx.addr + i * MiB, dst.region.addr + (7 - i) * MiB, MiB] for i in range(8)],
                     dtype=np.uint64)
    tx.send(op="send", endpoint=base64.b64encode(rx.endpoint()).decode(), descs=descs.tolist(),
            message="req-9")
    n = rx.wait_notification(b"req-9", timeout=20)
    assert n.ok is False and "incomplete" in n.error
    assert tx.proc.wait(timeout=20) == 3  # it died inside the data path, as arranged
    assert rx.notifications() == []  # and nothing claims the transfer completed


@pytest.mark.skipif(not NIXL_OK, reason=f"nixl not importable: {NIXL_WHY}")
def test_nixl_sender_killed_mid_transfer_receiver_gets_an_error(spawn, transports):
    """nixl's version of the test above: the sender posts a write and is SIGKILLed while it is
    still pending (no progress thread: nothing completes it). The receiver hears of it through
    the control stream's end, as an error notification, long before its wait would time out."""
    rx = transports("nixl")
    dst = rx.allocate(64 * MiB)
    dst.array[:] = FILL
    rx.register(dst.region)
    tx = spawn("nixl", "default", 64 * MiB)
    tx.call(op="fill", seed=5)
    descs = [[tx.addr + i * MiB, dst.region.addr + (63 - i) * MiB, MiB] for i in range(64)]
    got = tx.call(op="post", endpoint=base64.b64encode(rx.endpoint()).decode(), descs=descs,
                  message="req-k")
    assert got == {"status": "PENDING"}
    tx.kill(signal.SIGKILL)
    assert tx.proc.wait(timeout=20) == -signal.SIGKILL
    n = rx.wait_notification(b"req-k", timeout=120)  # without liveness: TransferTimeout
    assert n.ok is False and "incomplete" in n.error and "control stream" in n.error
    assert rx.notifications() == []  # and nothing claims the transfer completed


@pytest.mark.skipif(not NIXL_OK, reason=f"nixl not importable: {NIXL_WHY}")
def test_nixl_control_stream_loss_fails_pending_writes(spawn, transports):
    """Sender side of the same channel: a receiver that vanishes fails the sender's pending and
    later writes with PeerLost (not TransferTimeout)."""
    rx = spawn("nixl", "default", 64 * MiB)
    tx = transports("nixl")
    src = tx.allocate(64 * MiB)
    tx.register(src.region)
    peer = tx.connect(rx.endpoint)
    rx.kill(signal.SIGKILL)
    rx.proc.wait()
    t = tx.write(peer, np.array([[src.region.addr, rx.addr, 64 * MiB]], dtype=np.uint64), b"gone",
                 timeout=120)
    with pytest.raises(PeerLost):
        t.wait()
    t2 = tx.write(peer, np.array([[src.region.addr, rx.addr, 16]], dtype=np.uint64), b"x", timeout=120)
    with pytest.raises(PeerLost):
        t2.wait()


@pytest.mark.parametrize("backend,core_name", pairs(nixl=False))
def test_stalled_receiver_makes_the_sender_time_out(backend, core_name, spawn, transports):
    core = get_core(core_name)
    rx = spawn(backend, core.IMPLEMENTATION, 32 * MiB)
    tx = transports(backend, core)
    src = tx.allocate(32 * MiB)
    tx.register(src.region)
    peer = tx.connect(rx.endpoint)
    rx.kill(signal.SIGSTOP)
    try:
        start = time.monotonic()
        t = tx.write(peer, np.array([[src.region.addr, rx.addr, 32 * MiB]], dtype=np.uint64),
                     b"stall", timeout=1.5)
        with pytest.raises(TransferTimeout):
            t.wait()
        assert t.status() is Status.FAILED and 1.4 < time.monotonic() - start < 6
    finally:
        rx.kill(signal.SIGCONT)


@pytest.mark.parametrize("backend,core_name", pairs(backends=("cma",)))
def test_waiting_for_a_notification_times_out(backend, core_name, transports):
    rx = transports(backend, get_core(core_name))
    start = time.monotonic()
    with pytest.raises(TransferTimeout):
        rx.wait_notification(b"never", timeout=0.3)
    assert 0.29 < time.monotonic() - start < 3


@pytest.mark.parametrize("core_name", ["c", "python"])
def test_tcp_receiver_refuses_a_rogue_destination(core_name, transports):
    """A sender that skips its own checks: the receiver NACKs, writes nothing, reports an error."""
    rx = transports("tcp", get_core(core_name))
    dst = rx.allocate(MiB)
    dst.array[:] = FILL
    rx.register(dst.region)
    host, port = _wire.loads(rx.endpoint())["address"]
    with socket.create_connection((host, port), timeout=10) as s:
        _wire.send_frame(s, _wire.HELLO, 0, _wire.dumps({"agent": "rogue", "pid": 0}))
        assert _wire.recv_frame_fds(s)[0] == _wire.WELCOME
        pairs_ = np.array([[dst.region.addr, 4096], [dst.region.addr + MiB - 8, 16]], dtype=np.uint64)
        body = struct.pack("<I", 5) + b"rogue" + pairs_.tobytes()
        _wire.send_frame(s, _wire.DATA, 1, body)
        s.sendall(b"\x00" * (4096 + 16))
        kind, x, reason = _wire.recv_frame(s)
    assert (kind, x) == (_wire.NACK, 1) and b"outside" in reason
    n = rx.wait_notification(b"rogue", timeout=10)
    assert n.ok is False and n.peer == "rogue"
    assert np.array_equal(dst.array, np.full(MiB, FILL, dtype=np.uint8))

"""Every backend that runs here moves random data between two processes; every byte of the
receiver's buffer is checked after each transfer (moved bytes and untouched ones)."""

from __future__ import annotations

import numpy as np
import pytest
from transport_testlib import FILL, get_core, pairs

from transport import layout
from transport.base import Region, RegionError, Status

MiB = 1 << 20
HALF = 4 * MiB  # two planes per side, one per half of an 8 MiB buffer
KiB = 1 << 10


def cases(rng: np.random.Generator):
    """(src block bytes, dst block bytes, src ids, dst ids, nbytes or None) per transfer."""
    yield 64 * KiB, 64 * KiB, np.arange(8, 20), np.arange(40, 52), None  # contiguous: merged
    yield 4 * KiB, 4 * KiB, rng.permutation(1024)[:300], rng.permutation(1024)[:300], None
    yield 16 * KiB, 64 * KiB, rng.permutation(256)[:40], rng.permutation(64)[:10], None
    yield 64 * KiB, 4 * KiB, rng.permutation(64)[:3], rng.permutation(1024)[:50], 150 * KiB + 123
    yield 12 * KiB, 20 * KiB, rng.permutation(300)[:25], rng.permutation(200)[:15], None


@pytest.mark.parametrize("backend,core_name", pairs())
def test_random_layouts_every_byte(backend, core_name, spawn, transports, tmp_path):
    core = get_core(core_name)
    rng = np.random.default_rng(1234)
    rx = spawn(backend, core.IMPLEMENTATION, 2 * HALF)
    tx = transports(backend, core)
    src = tx.allocate(2 * HALF)
    src.array[:] = rng.integers(0, 256, 2 * HALF, dtype=np.uint8)
    tx.register(src.region)
    peer = tx.connect(rx.endpoint)

    image = np.full(2 * HALF, FILL, dtype=np.uint8)
    s0, d0 = src.region.addr, rx.addr
    for i, (sbb, dbb, sids, dids, nbytes) in enumerate(cases(rng)):
        descs = layout.build_descriptors([s0, s0 + HALF], [d0, d0 + HALF], sbb, dbb, sids, dids,
                                         nbytes, core=core)
        message = f"req-{backend}-{i}".encode()
        rx.start_expect(message)
        t = tx.write(peer, descs, message, timeout=30)
        t.wait()
        assert t.status() is Status.DONE and t.nbytes == int(descs[:, 2].sum())
        got = rx.result()
        assert got.get("ok") is True, got
        image = _apply(image, d0, src.array, s0, descs)
        received = rx.dump(tmp_path)
        assert received.shape == image.shape
        bad = np.flatnonzero(received != image)
        assert bad.size == 0, f"case {i}: {bad.size} bytes differ, first at offset {bad[:5]}"


def _apply(image, d0, src, s0, descs):
    for s, d, n in descs.tolist():
        image[d - d0:d - d0 + n] = src[s - s0:s - s0 + n]
    return image


@pytest.mark.parametrize("backend,core_name", pairs())
def test_descriptors_outside_registered_memory_are_refused(backend, core_name, spawn, transports, tmp_path):
    core = get_core(core_name)
    rx = spawn(backend, core.IMPLEMENTATION, MiB)
    tx = transports(backend, core)
    src = tx.allocate(2 * MiB)
    src.array[:] = 7
    tx.register(Region(src.region.addr, MiB))  # only the first half is registered
    peer = tx.connect(rx.endpoint)
    s0, d0 = src.region.addr, rx.addr
    for bad in ([s0, d0 + MiB - 10, 11],  # runs past the receiver's region
                [s0, d0 - 4096, 4096],  # before it
                [s0 + MiB, d0, 16]):  # source not registered
        with pytest.raises(RegionError):
            tx.write(peer, np.array([bad], dtype=np.uint64), b"bad")
    assert np.array_equal(rx.dump(tmp_path), np.full(MiB, FILL, dtype=np.uint8))
    # The connection is still good after refusals.
    rx.start_expect(b"good")
    tx.write(peer, np.array([[s0, d0, 4096]], dtype=np.uint64), b"good").wait(30)
    assert rx.result().get("ok") is True
    expect = np.full(MiB, FILL, dtype=np.uint8)
    expect[:4096] = 7
    assert np.array_equal(rx.dump(tmp_path), expect)


@pytest.mark.parametrize("backend,core_name", pairs(nixl=False))
def test_concurrent_writers_to_one_peer(backend, core_name, transports):
    """Several threads write disjoint blocks to one peer at once (a connector's worker pool)."""
    import threading

    core = get_core(core_name)
    rx, tx = transports(backend, core), transports(backend, core, threads=2)
    dst, src = rx.allocate(8 * MiB), tx.allocate(8 * MiB)
    rx.register(dst.region)
    tx.register(src.region)
    src.array[:] = np.random.default_rng(2).integers(0, 256, src.array.size, dtype=np.uint8)
    dst.array[:] = FILL
    peer = tx.connect(rx.endpoint())
    perm = np.random.default_rng(3).permutation(128)  # 64 KiB blocks, 32 per thread
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for j in range(4):
                ids = np.arange(k * 32 + j * 8, k * 32 + j * 8 + 8)
                d = layout.build_descriptors([src.region.addr], [dst.region.addr], 64 * KiB, 64 * KiB,
                                             ids, perm[ids], core=core)
                tx.write(peer, d, f"w{k}-{j}".encode()).wait(30)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    got = sorted(rx.wait_notification(timeout=10).message for _ in range(16))
    assert got == sorted(f"w{k}-{j}".encode() for k in range(4) for j in range(4))
    expect = src.array.reshape(128, -1)[np.argsort(perm)].reshape(-1)
    assert np.array_equal(dst.array, expect)


def test_shm_destination_must_come_from_allocate(transports):
    rx, tx = transports("shm"), transports("shm")
    foreign = np.zeros(MiB, dtype=np.uint8)  # ordinary memory: the sender cannot map it
    rx.register(Region(foreign.ctypes.data, MiB))
    src = tx.allocate(MiB)
    tx.register(src.region)
    peer = tx.connect(rx.endpoint())
    with pytest.raises(RegionError):
        tx.write(peer, np.array([[src.region.addr, foreign.ctypes.data, 16]], np.uint64))

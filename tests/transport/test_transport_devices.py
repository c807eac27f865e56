"""Device memory and RDMA paths: what can be checked here runs; the rest skips with its reason."""

from __future__ import annotations

import os

import numpy as np
import pytest
from transport_testlib import NIXL_OK, NIXL_WHY

from transport import layout
from transport.base import MemKind, Region, RegionError
from transport.nixl import _Side, rdma_devices

needs_nixl = pytest.mark.skipif(not NIXL_OK, reason=f"nixl not importable: {NIXL_WHY}")


def test_nixl_rows_carry_memory_kind_and_device_ids():
    side = _Side()
    side.add(Region(0x1000, 0x1000, MemKind.VRAM, 3))
    side.add(Region(0x10000, 0x1000, MemKind.VRAM, 5))
    rows, kind = side.rows(np.array([0x1000, 0x10010], np.uint64), np.array([16, 32], np.uint64), "dst")
    assert kind == "VRAM" and rows.tolist() == [[0x1000, 16, 3], [0x10010, 32, 5]]
    side.add(Region(0x20000, 0x100))  # host memory
    with pytest.raises(RegionError, match="mix"):
        side.rows(np.array([0x1000, 0x20000], np.uint64), np.array([1, 1], np.uint64), "dst")


@pytest.mark.parametrize("backend", ["cma", "shm", "tcp"])
def test_host_only_backends_refuse_device_memory(backend, transports):
    t = transports(backend)
    with pytest.raises(RegionError, match="host memory only"):
        t.register(Region(0x1000, 4096, MemKind.VRAM, 0))


def _cuda():
    if not os.path.exists("/dev/nvidiactl"):  # decide before paying for a torch import
        pytest.skip("no CUDA device")
    torch = pytest.importorskip("torch", reason="no CUDA device (torch missing)")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return torch


@pytest.mark.gpu
@needs_nixl
def test_nixl_moves_vram_blocks(transports):
    torch = _cuda()
    nbytes = 8 << 20
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    rx, tx = transports("nixl"), transports("nixl")
    rx.register(Region(dst.data_ptr(), nbytes, MemKind.VRAM, dst.device.index or 0))
    tx.register(Region(src.data_ptr(), nbytes, MemKind.VRAM, src.device.index or 0))
    peer = tx.connect(rx.endpoint())
    ids = np.random.default_rng(0).permutation(128)
    descs = layout.build_descriptors([src.data_ptr()], [dst.data_ptr()], 65536, 65536, np.arange(128), ids)
    t = tx.write(peer, descs, b"vram")
    while t.status().value == "PENDING":
        rx.notifications()
    t.wait(0)
    expect = src.view(128, 65536)[torch.from_numpy(np.argsort(ids)).cuda()].reshape(-1)
    assert torch.equal(dst, expect)


@pytest.mark.rdma
@needs_nixl
def test_nixl_over_an_rdma_device(transports):
    if not rdma_devices():
        pytest.skip("no RDMA device")
    rx, tx = transports("nixl"), transports("nixl")
    dst, src = rx.allocate(4 << 20), tx.allocate(4 << 20)
    src.array[:] = np.random.default_rng(1).integers(0, 256, src.array.size, dtype=np.uint8)
    rx.register(dst.region)
    tx.register(src.region)
    peer = tx.connect(rx.endpoint())
    t = tx.write(peer, np.array([[src.region.addr, dst.region.addr, 4 << 20]], np.uint64), b"rdma")
    while t.status().value == "PENDING":
        rx.notifications()
    t.wait(0)
    assert np.array_equal(dst.array, src.array)

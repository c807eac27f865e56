"""Backend selection, the import seam, packaging, and the core's system-call wrappers."""

from __future__ import annotations

import errno
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transport_testlib import REPO, load_core

import transport
from transport import layout, select
from transport.base import TransportUnavailable
from transport.tcp import TcpTransport


def test_explicit_name_wins_then_env_then_auto(monkeypatch):
    monkeypatch.setenv("PDR_TRANSPORT", "shm")
    assert select.resolve("tcp") == "tcp"
    assert select.resolve() == "shm"
    monkeypatch.delenv("PDR_TRANSPORT")
    assert select.resolve(same_host=False) == "tcp"
    assert select.resolve(same_host=True) == ("nixl" if select.available()["nixl"][0] and
                                               Path("/sys/class/infiniband").is_dir() else "cma")


def test_unknown_or_unavailable_forced_backend_fails_loudly(monkeypatch):
    with pytest.raises(TransportUnavailable, match="unknown transport 'rdma'"):
        select.resolve("rdma")
    monkeypatch.setenv("PDR_TRANSPORT", "cma")
    with pytest.raises(TransportUnavailable, match=r"forced by \$PDR_TRANSPORT.*seccomp says no"):
        select.resolve(probe=lambda name: (False, "seccomp says no"))


def test_forcing_nixl_without_nixl_fails(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)  # makes `import nixl` raise ImportError
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    assert select.available()["nixl"][0] is False
    with pytest.raises(TransportUnavailable, match="nixl"):
        select.resolve("nixl")


def test_auto_without_cma_on_same_host_falls_back_to_tcp():
    assert select.resolve("auto", probe=lambda name: (name == "tcp", "no")) == "tcp"


def test_create_does_no_io():
    before = len(os.listdir("/proc/self/fd"))
    t = select.create("tcp")
    assert isinstance(t, TcpTransport) and isinstance(t, transport.Transport)
    assert len(os.listdir("/proc/self/fd")) == before
    t.close()


def test_package_is_this_distribution_and_reports_its_core():
    assert Path(transport.__file__).resolve().parent == REPO / "transport"
    assert transport.IMPLEMENTATION in ("c", "python")
    env = {k: v for k, v in os.environ.items() if k != "PDR_TRANSPORT_PURE"}
    env["PYTHONPATH"] = str(REPO)
    code = "import transport; print(transport.IMPLEMENTATION)"
    pure = subprocess.run([sys.executable, "-c", code], env=dict(env, PDR_TRANSPORT_PURE="1"),
                          capture_output=True, text=True, check=True)
    assert pure.stdout.strip() == "python"
    default = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True)
    c_built = any((REPO / "transport").glob("_kvio*.so"))
    assert default.stdout.strip() == ("c" if c_built else "python")


def test_only_the_nixl_module_imports_nixl():
    pattern = re.compile(r"^\s*(import nixl|from nixl[\s.])|import_module\(f\"\{variant", re.M)
    offenders = [p.name for p in (REPO / "transport").glob("*.py")
                 if p.name != "nixl.py" and pattern.search(p.read_text())]
    assert pattern.search((REPO / "transport" / "nixl.py").read_text())
    assert offenders == []


# --- the core's system-call wrappers, on both implementations -----------------------------

def test_vm_write_and_read_move_bytes_and_raise_oserror(core):
    a = np.random.default_rng(1).integers(0, 256, 3 * 4096 + 5, dtype=np.uint8)
    b = np.zeros_like(a)
    rows = np.array([[a.ctypes.data + 4096 * i, b.ctypes.data + 4096 * (2 - i), 4096] for i in range(3)]
                    + [[a.ctypes.data + 3 * 4096, b.ctypes.data + 3 * 4096, 5]], np.uint64)
    assert core.vm_write(os.getpid(), rows) == a.size
    assert np.array_equal(b[:4096], a[8192:12288]) and np.array_equal(b[-5:], a[-5:])
    c = np.zeros_like(a)  # read: column 0 is the peer's (here our own) memory, column 1 local
    assert core.vm_read(os.getpid(), np.array([[b.ctypes.data, c.ctypes.data, b.size]], np.uint64)) == b.size
    assert np.array_equal(c, b)
    with pytest.raises(OSError) as e:
        core.vm_write(os.getpid(), np.array([[a.ctypes.data, 8, 16]], np.uint64))
    assert e.value.errno == errno.EFAULT


def test_send_and_recv_iov_scatter_gather_timeout_and_eof(core):
    left, right = socket.socketpair()
    with left, right:
        left.settimeout(5)
        right.settimeout(5)
        src = np.arange(1 << 16, dtype=np.uint8)
        dst = np.zeros(1 << 16, dtype=np.uint8)
        rows = np.array([[src.ctypes.data + i * 4096, dst.ctypes.data + (15 - i) * 4096, 4096]
                         for i in range(16)], np.uint64)
        assert core.send_iov(left.fileno(), rows, 0, 1000) == 1 << 16
        assert core.recv_iov(right.fileno(), rows, 1, 1000) == 1 << 16
        assert np.array_equal(dst.reshape(16, 4096), src.reshape(16, 4096)[::-1])
        big = np.zeros(64 << 20, dtype=np.uint8)  # more than the socket buffers hold
        with pytest.raises(OSError) as e:
            core.send_iov(left.fileno(), np.array([[big.ctypes.data, 0, big.size]], np.uint64), 0, 200)
        assert e.value.errno == errno.ETIMEDOUT and isinstance(e.value, TimeoutError)
        left.shutdown(socket.SHUT_WR)
        # EOF: recv returns what arrived (at most the buffered part of `big`), fewer than asked.
        sink = np.zeros(big.size + 1, dtype=np.uint8)
        got = core.recv_iov(right.fileno(), np.array([[0, sink.ctypes.data, sink.size]], np.uint64), 1, 2000)
        assert 0 < got < sink.size


def test_core_rejects_malformed_descriptor_buffers(core):
    with pytest.raises(ValueError):
        core.copy_batch(np.zeros(4, np.uint64))  # not a multiple of 3
    with pytest.raises(ValueError):
        core.copy_batch(b"\x00" * 12)  # not uint64-sized
    with pytest.raises(TypeError):
        core.copy_batch("nope")


def test_both_cores_have_the_same_functions():
    c, py = load_core("c"), load_core("python")
    from transport._core import NAMES

    assert all(callable(getattr(c, n)) and callable(getattr(py, n)) for n in NAMES)


@pytest.mark.parametrize("order", ["as built", "by destination"])
def test_vm_write_merges_each_side_on_its_own(core, order):
    """Rows contiguous on one side only, more rows than one system call takes (1,024), rows of
    odd sizes: every byte lands where its row says, on the C core and on the twin."""
    rng = np.random.default_rng(7)
    n, blk = 3000, 48
    a = rng.integers(0, 256, n * blk, dtype=np.uint8)
    b = np.zeros_like(a)
    perm = rng.permutation(n)
    rows = np.array([[a.ctypes.data + i * blk, b.ctypes.data + int(p) * blk, blk] for i, p in enumerate(perm)],
                    np.uint64)
    rows = np.concatenate([rows[:1000], layout.split(rows[1000:], 7)[3], rows[1000:]])  # a few repeats
    if order == "by destination":
        rows = layout.by_destination(rows)
    assert core.vm_write(os.getpid(), rows) == int(rows[:, 2].sum())
    assert np.array_equal(b.reshape(n, blk)[perm], a.reshape(n, blk))


def test_hugepage_advice_is_best_effort(monkeypatch):
    from transport._common import advise_hugepages, anon_mmap

    mm = anon_mmap(6 << 20)
    a = np.frombuffer(mm, dtype=np.uint8)
    addr = int(a.ctypes.data)
    assert advise_hugepages(addr + 1, 100) is False  # no whole 2 MiB page inside: nothing asked
    advise_hugepages(addr, 6 << 20)  # True where THP exists; never raises
    monkeypatch.setenv("PDR_KV_HUGEPAGES", "0")
    assert advise_hugepages(addr, 6 << 20) is False
    a[:] = 1
    # Private anonymous memory (counted as Anonymous in smaps): MAP_SHARED would be shmem, which
    # this kernel never backs with huge pages, whatever the advice.
    with open("/proc/self/smaps") as f:
        vmas = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", f.read())
    vma = next(v for v in vmas if int(v.split("-")[0], 16) <= addr < int(v.split("-")[1].split()[0], 16))
    assert int(vma.split("Anonymous:")[1].split()[0]) >= 6 << 10
    del a
    mm.close()

"""Same-host backend: one-sided writes into the peer's memory with ``process_vm_writev``.

Steps of one transfer: the sender checks every descriptor against its own and the peer's
registered regions, sends BEGIN over the Unix control socket, writes all bytes straight into the
receiver's address space (the receiver takes no part, like an RDMA write), then sends DONE; the
receiver posts the notification and ACKs. Works with any registered host memory (e.g. a KV cache
allocated by vLLM). Needs ptrace access to the peer (same user; Yama scope <= 1, and with scope 1
the receiver allows any tracer, see ``_allow_ptrace``).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

from transport import _core
from transport._common import _Peer
from transport._stream import StreamTransport
from transport.base import Transfer
from transport.layout import by_destination

_PR_SET_PTRACER, _PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1)


def yama_scope() -> int:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read())
    except OSError:
        return 0  # no Yama: classic same-uid rules


def available() -> tuple[bool, str]:
    """Probe process_vm_readv on ourselves (seccomp or Yama can forbid it)."""
    if yama_scope() >= 2:
        return False, f"Yama ptrace_scope={yama_scope()} forbids process_vm_writev"
    src = np.arange(16, dtype=np.uint8)
    dst = np.zeros(16, dtype=np.uint8)
    descs = np.array([[src.ctypes.data, dst.ctypes.data, 16]], dtype=np.uint64)
    try:
        _core.vm_read(os.getpid(), descs)
    except OSError as e:
        return False, f"process_vm_readv failed: {e}"
    return bool((src == dst).all()), "ok"


def _allow_ptrace() -> None:
    if yama_scope() == 1:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PTRACER)")


class CmaTransport(StreamTransport):
    name = "cma"
    same_host = True
    # One thread reaches about 0.6-0.7x of memcpy: the kernel pins each page of the peer before
    # copying it. Two threads (the C releases the GIL) recover part of that for descriptors of
    # 64 KiB or more; pass threads=1 to keep to one core.
    default_threads = min(2, os.cpu_count() or 1)

    def _listen(self):
        _allow_ptrace()
        return super()._listen()

    def _send(self, peer: _Peer, t: Transfer, descs: np.ndarray, timeout: float) -> None:
        pid = peer.extra["pid"]
        descs = by_destination(descs)  # long runs of the peer's pages per system call
        self._send_one_sided(peer, t, lambda: self._parallel(lambda d: self.core.vm_write(pid, d), descs))

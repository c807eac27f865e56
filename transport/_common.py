"""Pieces of the stream backends (cma, shm, tcp): connection records, the notification inbox,
error translation, small socket and memory helpers."""

from __future__ import annotations

import collections
import ctypes
import errno
import mmap
import os
import queue
import socket
import threading
import time

import numpy as np

from transport.base import Notification, PeerLost, Transfer, TransferFailed, TransferTimeout, TransportError
from transport.layout import RegionTable

_POLL_S = 1.0  # socket timeout: how often idle threads look at the closing flag


def host_id() -> str:
    """Same value for processes that can reach each other's memory (same boot, same pid ns)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"


def translate(exc: BaseException) -> TransportError:
    """Lower-level errors -> the transport's hierarchy (the one place this happens)."""
    if isinstance(exc, TransportError):
        return exc
    if isinstance(exc, TimeoutError) or getattr(exc, "errno", None) == errno.ETIMEDOUT:
        return TransferTimeout(str(exc))
    if isinstance(exc, ConnectionError) or getattr(exc, "errno", None) in (errno.ESRCH, errno.EPIPE):
        return PeerLost(str(exc))
    return TransferFailed(f"{type(exc).__name__}: {exc}")


class _Inbox:
    def __init__(self) -> None:
        self._items: collections.deque[Notification] = collections.deque()
        self._cond = threading.Condition()

    def post(self, n: Notification) -> None:
        with self._cond:
            self._items.append(n)
            self._cond.notify_all()

    def drain(self) -> list[Notification]:
        with self._cond:
            items, self._items = list(self._items), collections.deque()
            return items

    def wait(self, message: bytes | None, timeout: float | None) -> Notification | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                for n in self._items:
                    if message is None or n.message == message:
                        self._items.remove(n)
                        return n
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)


class _Peer:
    """Sender side of one connection."""

    def __init__(self, name: str, sock: socket.socket, regions: RegionTable) -> None:
        self.name, self.sock, self.regions = name, sock, regions
        self.pending: dict[int, Transfer] = {}
        self.lock = threading.Lock()
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.dead: TransportError | None = None
        self.threads: list[threading.Thread] = []
        self.extra: dict = {}


class _Inbound:
    """Receiver side of one connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.peer = "?"
        self.inflight: dict[int, bytes] = {}
        self.thread: threading.Thread | None = None


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


_HUGE = 2 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def hugepages_wanted() -> bool:
    return os.environ.get("PDR_KV_HUGEPAGES", "1") != "0"


def advise_hugepages(addr: int, nbytes: int) -> bool:
    """Ask for transparent huge pages on the whole 2 MiB pages inside [addr, addr+nbytes)
    (``MADV_HUGEPAGE``; this kernel's THP mode is ``madvise``). Fewer pages for the kernel to
    look up and pin per byte of ``process_vm_writev``, fewer TLB misses for any copy. Affects
    pages faulted after the call (khugepaged may collapse older ones). Best effort: False where
    refused or disabled with ``PDR_KV_HUGEPAGES=0``."""
    if not hugepages_wanted() or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    start, end = -(-addr // _HUGE) * _HUGE, (addr + nbytes) // _HUGE * _HUGE
    return end > start and _libc.madvise(start, end - start, mmap.MADV_HUGEPAGE) == 0


def anon_mmap(nbytes: int) -> mmap.mmap:
    """Private anonymous memory, huge-page advised before any page is touched. (Python's
    ``mmap.mmap(-1, n)`` alone is MAP_SHARED: shmem, which gets no huge pages here.)"""
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hugepages_wanted() and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return mm


def _addr(mm: mmap.mmap) -> int:
    a = np.frombuffer(mm, dtype=np.uint8)
    return int(a.ctypes.data)

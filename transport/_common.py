"""Pieces of the stream backends (cma, shm, tcp): connection records, the notification inbox,
error translation, small socket and memory helpers."""

from __future__ import annotations

import collections
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


def _addr(mm: mmap.mmap) -> int:
    a = np.frombuffer(mm, dtype=np.uint8)
    return int(a.ctypes.data)

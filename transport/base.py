"""The transport interface: memory regions, block layouts, transfers, notifications, errors.

Errors, translated once at each backend's boundary::

    TransportError
     ├── TransportUnavailable   the backend cannot run here (missing module, forced but absent)
     ├── RegionError            memory not registered / not reachable / unsupported kind
     ├── TransferTimeout        a transfer or a wait passed its deadline (also a TimeoutError)
     ├── PeerLost               the peer went away before the transfer was acknowledged
     └── TransferFailed         any other failure below (carries the cause)

A transfer's life, as seen by the sender: ``write()`` queues it and returns a ``Transfer`` at once;
the backend moves the bytes, then tells the receiver; the ``Transfer`` is DONE only when the
receiver has acknowledged that every byte landed. The receiver sees one ``Notification`` per
transfer: ``ok=True`` only after all bytes landed; ``ok=False`` if the sender vanished mid-way.
"""

from __future__ import annotations

import enum
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import numpy as np


class TransportError(Exception):
    """Base of every error the transport raises."""


class TransportUnavailable(TransportError):
    pass


class RegionError(TransportError, ValueError):
    pass


class TransferTimeout(TransportError, TimeoutError):
    pass


class PeerLost(TransportError, ConnectionError):
    pass


class TransferFailed(TransportError):
    pass


class MemKind(str, enum.Enum):
    DRAM = "DRAM"
    VRAM = "VRAM"  # CUDA device memory: only the nixl backend accepts it


@dataclass(frozen=True)
class Region:
    """A span of memory: host memory by address, or device memory (``kind=VRAM``, ``device``)."""

    addr: int
    nbytes: int
    kind: MemKind = MemKind.DRAM
    device: int = 0

    def __post_init__(self) -> None:
        if self.addr < 0 or self.nbytes <= 0 or self.addr + self.nbytes > 1 << 64:
            raise RegionError(f"bad region addr={self.addr:#x} nbytes={self.nbytes}")
        object.__setattr__(self, "kind", MemKind(self.kind))

    @property
    def end(self) -> int:
        return self.addr + self.nbytes


@dataclass(frozen=True)
class BlockSpec:
    """One side's KV layout: block ``b`` of plane ``i`` starts at ``bases[i] + b * stride``.

    A plane is one contiguous array of blocks (for vLLM: a layer's K or V cache, or a layer's
    combined cache where K and V share a block). ``stride`` defaults to ``block_bytes``.
    """

    bases: tuple[int, ...]
    block_bytes: int
    stride: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "bases", tuple(int(b) for b in self.bases))
        if self.block_bytes <= 0 or self.stride < 0 or (self.stride and self.stride < self.block_bytes):
            raise ValueError(f"bad BlockSpec block_bytes={self.block_bytes} stride={self.stride}")


@dataclass(frozen=True)
class Notification:
    """What the receiver learns about one transfer: the sender's message (e.g. a request id)."""

    peer: str
    message: bytes
    ok: bool = True
    error: str | None = None


class Status(str, enum.Enum):
    PENDING = "PENDING"
    DONE = "DONE"
    FAILED = "FAILED"


@dataclass(eq=False)
class Transfer:
    """The sender's handle on one write. Thread-safe; resolved once, by the backend."""

    id: int
    peer: str
    message: bytes
    nbytes: int
    deadline: float | None = None  # time.monotonic() seconds
    error: TransportError | None = None
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _poll: Callable[[], None] | None = field(default=None, repr=False)  # backends that must poll

    def _resolve(self, error: TransportError | None = None) -> bool:
        """Set the outcome once; later calls are ignored. Returns whether this call set it."""
        with self._lock:
            if self._done.is_set():
                return False
            self.error = error
            self._done.set()
            return True

    def status(self) -> Status:
        if not self._done.is_set() and self._poll is not None:
            self._poll()
        if not self._done.is_set() and self.deadline is not None and time.monotonic() > self.deadline:
            self._resolve(TransferTimeout(f"transfer {self.id} to {self.peer} passed its deadline"))
        if not self._done.is_set():
            return Status.PENDING
        return Status.FAILED if self.error else Status.DONE

    def wait(self, timeout: float | None = None) -> None:
        """Block until DONE (return) or FAILED (raise its error); TransferTimeout after ``timeout``
        (the transfer itself goes on until its own deadline)."""
        end = None if timeout is None else time.monotonic() + timeout
        if self.deadline is not None:
            end = self.deadline if end is None else min(end, self.deadline)
        if self._poll is not None:  # no thread resolves it: progress it ourselves
            while self.status() is Status.PENDING and (end is None or time.monotonic() < end):
                time.sleep(0.0002)
        else:
            self._done.wait(None if end is None else max(0.0, end - time.monotonic()))
        if self.status() is Status.PENDING:
            raise TransferTimeout(f"transfer {self.id} to {self.peer} still pending after {timeout}s")
        if self.error:
            raise self.error


@runtime_checkable
class Transport(Protocol):
    """One backend. Constructors do no I/O: ``start()`` opens sockets and threads, ``close()`` ends
    them. Typical use: the receiver allocates or registers its blocks, starts, and hands
    ``endpoint()`` to the sender (any side channel); the sender registers its own memory, calls
    ``connect(blob)``, builds descriptors with ``transport.layout`` and calls ``write``."""

    name: str  # backend name: "nixl", "cma", "shm" or "tcp"
    agent: str  # this endpoint's unique name, as peers see it in notifications

    def start(self) -> None: ...
    def close(self) -> None: ...
    def allocate(self, nbytes: int) -> "Buffer": ...
    def register(self, region: Region) -> None: ...
    def endpoint(self) -> bytes: ...
    def connect(self, endpoint: bytes) -> str: ...
    def disconnect(self, peer: str) -> None: ...
    def write(self, peer: str, descs: np.ndarray, message: bytes = b"",
              timeout: float | None = None) -> Transfer: ...
    def notifications(self) -> list[Notification]: ...
    def wait_notification(self, message: bytes | None = None,
                          timeout: float | None = None) -> Notification: ...


class Buffer:
    """Host memory owned by a transport (``allocate``): ``region``, a writable ``array`` view."""

    def __init__(self, mm, region: Region, fd: int = -1) -> None:
        self._mm = mm
        self.region = region
        self.fd = fd
        self.array = np.frombuffer(mm, dtype=np.uint8)

    def close(self) -> None:
        self.array = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a view is still exported; the map is freed with the last view
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

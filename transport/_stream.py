"""What the cma, shm and tcp backends share: a control stream per peer (framing in _wire.py),
acknowledged transfers, receiver notifications, peer-loss handling.

Threads (all started by ``start()``/``connect()``, all ended by ``close()``):
- receiver: one accept thread; one thread per inbound connection reading frames;
- sender: per peer, one thread that performs queued writes in order, one reading ACK/NACK.
A subclass provides ``_listen``/``_dial`` (the socket family), ``_send`` (the data path) and may
extend the handshake (``_welcome``/``_on_welcome``) or take DATA frames (``_on_data``).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType

import numpy as np

from transport import _core, _wire
from transport._common import (_POLL_S, _addr, _Inbound, _Inbox, _Peer, _shutdown,
                               advise_hugepages, anon_mmap, host_id, translate)
from transport.base import (Buffer, MemKind, Notification, PeerLost, Region, RegionError, Status,
                            Transfer, TransferFailed, TransferTimeout, TransportError)
from transport.layout import RegionTable, as_descs, split


_PARALLEL_MIN_BYTES = 64 << 10  # mean descriptor size from which copies use several threads


class StreamTransport:
    name = "stream"
    same_host = True

    default_threads = 1

    def __init__(self, agent: str | None = None, *, core: ModuleType | None = None,
                 timeout: float = 30.0, threads: int | None = None) -> None:
        self.agent = agent or f"{self.name}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.core = core or _core
        self.timeout = timeout
        self._local = RegionTable()
        self._buffers: list[Buffer] = []
        self._peers: dict[str, _Peer] = {}
        self._inbound: list[_Inbound] = []
        self._inbox = _Inbox()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._address: object = None
        self._closing = False
        self.threads = max(1, threads or self.default_threads)  # copy threads per transfer
        self._pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._listener is not None:
            return
        self._listener, self._address = self._listen()
        if self.threads > 1:
            self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix=f"pdr-{self.name}-copy")
        self._accept_thread = self._thread(self._accept_loop, "accept")

    def close(self) -> None:
        with self._lock:
            self._closing = True
        if self._listener is not None:
            _shutdown(self._listener)
            self._listener.close()
            self._join(self._accept_thread)
        with self._lock:
            inbound, peers = list(self._inbound), list(self._peers)
        for conn in inbound:
            _shutdown(conn.sock)
            self._join(conn.thread)
            conn.sock.close()
        for name in peers:
            self.disconnect(name)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for buf in self._buffers:
            buf.close()
        self._buffers.clear()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --------------------------------------------------------------------- memory
    def allocate(self, nbytes: int) -> Buffer:
        mm = anon_mmap(nbytes)
        buf = Buffer(mm, Region(_addr(mm), nbytes))
        self._buffers.append(buf)
        return buf

    def register(self, region: Region) -> None:
        if region.kind is not MemKind.DRAM:
            raise RegionError(f"the {self.name} backend moves host memory only, not {region.kind.value}")
        self._local.add(region)
        advise_hugepages(region.addr, region.nbytes)

    def deregister(self, region: Region) -> None:
        self._local.remove(region)

    # ----------------------------------------------------------------- endpoints
    def endpoint(self) -> bytes:
        if self._listener is None:
            raise TransportError("start() the transport before asking for its endpoint")
        return _wire.dumps({"backend": self.name, "agent": self.agent, "host": host_id(),
                            "pid": os.getpid(), "address": self._address})

    def connect(self, endpoint: bytes) -> str:
        info = _wire.loads(endpoint)
        if info.get("backend") != self.name:
            raise TransportError(f"endpoint is for backend {info.get('backend')!r}, not {self.name!r}")
        if self.same_host and info["host"] != host_id():
            raise TransportError(f"{self.name}: peer {info['agent']} is not on this host")
        if info["agent"] in self._peers:
            if self._peers[info["agent"]].dead is None:
                return info["agent"]
            self.disconnect(info["agent"])  # a dead connection: dial again
        sock = self._dial(info["address"])
        try:
            sock.settimeout(self.timeout)
            _wire.send_frame(sock, _wire.HELLO, 0, _wire.dumps({"agent": self.agent, "pid": os.getpid()}))
            kind, _x, body, fds = _wire.recv_frame_fds(sock)
            if kind != _wire.WELCOME:
                raise PeerLost(f"unexpected handshake frame {kind}")
            welcome = _wire.loads(body)
            regions = RegionTable(Region(a, n) for a, n in welcome["regions"])
            peer = _Peer(info["agent"], sock, regions)
            peer.extra.update(pid=info["pid"])
            self._on_welcome(peer, welcome, fds)
        except BaseException as e:
            sock.close()
            raise translate(e) from e
        sock.settimeout(_POLL_S)
        with self._lock:
            self._peers[peer.name] = peer
        peer.threads = [self._thread(self._send_loop, f"send-{peer.name}", peer),
                        self._thread(self._ack_loop, f"ack-{peer.name}", peer)]
        return peer.name

    def disconnect(self, name: str) -> None:
        with self._lock:
            peer = self._peers.pop(name, None)
        if peer is None:
            return
        self._fail_peer(peer, PeerLost(f"disconnected from {name}"))
        peer.queue.put(None)
        for t in peer.threads:
            self._join(t)
        peer.sock.close()
        if not any(t.is_alive() for t in peer.threads):  # never unmap under a running copy
            self._on_peer_closed(peer)

    # ------------------------------------------------------------------ transfers
    def write(self, peer: str, descs, message: bytes = b"", timeout: float | None = None) -> Transfer:
        p = self._peers.get(peer)
        if p is None:
            raise TransportError(f"not connected to {peer!r}")
        d = as_descs(descs)
        self._local.check(d, 0, "source")
        p.regions.check(d, 1, "destination")
        t = Transfer(next(self._ids), peer, bytes(message), int(d[:, 2].sum()),
                     time.monotonic() + (self.timeout if timeout is None else timeout))
        with p.lock:
            if p.dead is not None:
                t._resolve(PeerLost(f"peer {peer} is gone: {p.dead}"))
                return t
            p.pending[t.id] = t
        p.queue.put((t, d))
        return t

    def notifications(self) -> list[Notification]:
        return self._inbox.drain()

    def wait_notification(self, message: bytes | None = None, timeout: float | None = None) -> Notification:
        n = self._inbox.wait(message, timeout)
        if n is None:
            raise TransferTimeout(f"no notification {message!r} within {timeout}s")
        return n

    # ------------------------------------------------------------- sender threads
    def _send_loop(self, peer: _Peer) -> None:
        while (item := peer.queue.get()) is not None:
            t, d = item
            if t.status() is not Status.PENDING:  # timed out while queued
                continue
            if peer.dead is not None:
                t._resolve(PeerLost(f"peer {peer.name} is gone: {peer.dead}"))
                continue
            try:
                self._send(peer, t, d, max(0.0, t.deadline - time.monotonic()))
            except BaseException as e:  # the stream may be mid-frame: drop the connection
                err = translate(e)
                t._resolve(err)
                self._fail_peer(peer, err)

    def _ack_loop(self, peer: _Peer) -> None:
        try:
            while True:
                try:
                    kind, x, body = _wire.recv_frame(peer.sock)
                except TimeoutError:
                    if self._closing or peer.dead is not None:
                        return
                    continue
                with peer.lock:
                    t = peer.pending.pop(x, None)
                if kind not in (_wire.ACK, _wire.NACK):
                    raise PeerLost(f"unexpected frame {kind} from {peer.name}")
                if t is not None:
                    t._resolve(None if kind == _wire.ACK else TransferFailed(body.decode()))
        except BaseException as e:
            self._fail_peer(peer, PeerLost(f"peer {peer.name} lost: {translate(e)}"))

    def _fail_peer(self, peer: _Peer, err: TransportError) -> None:
        with peer.lock:
            if peer.dead is None:
                peer.dead = err
            pending, peer.pending = list(peer.pending.values()), {}
        for t in pending:
            t._resolve(err if isinstance(err, PeerLost) else PeerLost(str(err)))
        _shutdown(peer.sock)

    # ----------------------------------------------------------- receiver threads
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closing:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            conn = _Inbound(sock)
            with self._lock:
                if self._closing:
                    sock.close()
                    return
                self._inbound.append(conn)
            conn.thread = self._thread(self._serve, "serve", conn)

    def _serve(self, conn: _Inbound) -> None:
        sock, reason = conn.sock, "closed"
        try:
            sock.settimeout(self.timeout)
            kind, _x, body = _wire.recv_frame(sock)
            if kind != _wire.HELLO:
                raise PeerLost(f"unexpected handshake frame {kind}")
            conn.peer = _wire.loads(body)["agent"]
            extra, fds = self._welcome(conn)
            regions = [[r.addr, r.nbytes] for r in self._exported_regions()]
            _wire.send_frame(sock, _wire.WELCOME, 0, _wire.dumps({"regions": regions, **extra}), fds)
            sock.settimeout(_POLL_S)
            while True:
                try:
                    kind, x, body = _wire.recv_frame(sock)
                except TimeoutError:
                    if self._closing:
                        return
                    continue
                if kind == _wire.BEGIN:
                    conn.inflight[x] = body
                elif kind == _wire.DONE and x in conn.inflight:
                    self._inbox.post(Notification(conn.peer, conn.inflight.pop(x)))
                    _wire.send_frame(sock, _wire.ACK, x)
                elif kind == _wire.DATA:
                    self._on_data(conn, x, body)
                else:
                    raise PeerLost(f"unexpected frame {kind} (transfer {x}) from {conn.peer}")
        except BaseException as e:
            reason = str(translate(e))
        finally:
            for x, message in conn.inflight.items():
                self._inbox.post(Notification(conn.peer, message, ok=False,
                                              error=f"transfer {x} incomplete: {reason}"))
            conn.inflight.clear()
            _shutdown(sock)
            with self._lock:  # after close() began, close() owns the socket
                owned = not self._closing
                if owned:
                    self._inbound.remove(conn)
            if owned:
                sock.close()

    # ------------------------------------------------------------ backend hooks
    def _listen(self) -> tuple[socket.socket, object]:
        """Default: an abstract Unix socket (same host, same network namespace)."""
        address = f"\0pdr-{self.name}-{self.agent}"
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(address)
        sock.listen(64)
        return sock, address

    def _dial(self, address) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(address)
        return sock

    def _send(self, peer: _Peer, t: Transfer, descs: np.ndarray, timeout: float) -> None:
        raise NotImplementedError

    def _exported_regions(self) -> list[Region]:
        return list(self._local)

    def _welcome(self, conn: _Inbound) -> tuple[dict, list[int]]:
        return {}, []

    def _on_welcome(self, peer: _Peer, welcome: dict, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)

    def _on_peer_closed(self, peer: _Peer) -> None:
        pass

    def _on_data(self, conn: _Inbound, x: int, body: bytes) -> None:
        raise PeerLost(f"{self.name} does not take DATA frames")

    # --------------------------------------------------------------------- helpers
    def _send_one_sided(self, peer: _Peer, t: Transfer, move) -> None:
        """BEGIN, move the bytes (callable), DONE: the receiver can tell a sender that died."""
        _wire.send_frame(peer.sock, _wire.BEGIN, t.id, t.message)
        move()
        _wire.send_frame(peer.sock, _wire.DONE, t.id)

    def _parallel(self, fn, descs: np.ndarray) -> None:
        """fn(part) over ``self.threads`` parts of about equal bytes (the C releases the GIL)."""
        # Small pieces stay on one thread: two threads pinning pages of one peer contend (the
        # benchmark showed 4 KiB blocks slower on two threads, 64 KiB+ faster).
        big = len(descs) and int(descs[:, 2].sum()) >= _PARALLEL_MIN_BYTES * len(descs)
        parts = split(descs, self.threads) if self._pool is not None and big else [descs]
        futures = [self._pool.submit(fn, p) for p in parts[1:]] if len(parts) > 1 else []
        try:
            fn(parts[0])
        finally:
            errors = [f.exception() for f in futures]
        for e in errors:
            if e is not None:
                raise e

    def _thread(self, target, name: str, *args) -> threading.Thread:
        th = threading.Thread(target=target, args=args, name=f"pdr-{self.name}-{name}", daemon=True)
        th.start()
        return th

    @staticmethod
    def _join(th: threading.Thread | None) -> None:
        if th is not None and th is not threading.current_thread():
            th.join(timeout=10)

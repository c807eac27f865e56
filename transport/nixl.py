"""RDMA backend through NIXL agents (UCX; LIBFABRIC too where its plugin loads and a NIC exists).
The only module that imports ``nixl``, and only in ``start()``/``available()``.

Steps of one transfer: check descriptors against local and remote registrations, turn them into
NIXL (addr, len, device) lists for each side, ``initialize_xfer("WRITE", ..., notif_msg)`` and
post it. NIXL delivers the notification to the receiver after the data; the sender's
``Transfer`` polls ``check_xfer_state`` (there is no progress thread: it busy-polls a core, so
both sides progress UCX when they poll their transfers or notifications).

Host memory (``DRAM``) works here over UCX (cma/tcp); device memory (``MemKind.VRAM`` with a CUDA
device id) is passed through as NIXL ``VRAM`` and only runs where CUDA exists.

Liveness: next to NIXL, each connection has a small TCP control stream (framing of ``_wire``),
sender -> receiver: ``HELLO {agent}`` / ``WELCOME {agent}`` at ``connect``, then ``BEGIN(id,
message)`` before a write is posted and ``DONE(id)`` once the sender has seen it complete. The
receiver keeps the begun transfers per connection; when the stream ends (EOF or reset: the
sender's process died or closed) it drains NIXL's notifications once more and posts
``Notification(ok=False)`` for every begun transfer that neither got ``DONE`` nor delivered its
NIXL notification. The sender watches the same stream: if it ends, pending transfers to that
peer fail with ``PeerLost`` at their next poll instead of at their deadline.
"""

from __future__ import annotations

import base64
import collections
import importlib
import importlib.util
import itertools
import os
import select
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from transport import _wire
from transport._common import _shutdown, anon_mmap, host_id
from transport.base import (Buffer, MemKind, Notification, PeerLost, Region, RegionError,
                            Transfer, TransferFailed, TransferTimeout, TransportError,
                            TransportUnavailable)
from transport.layout import RegionTable, as_descs

_POLL_S = 0.0002
_CTL_POLL_S = 1.0  # control threads look at the closing flag this often
_CTL_DRAIN = 3  # NIXL notification drains when a control stream ends, before failing transfers


def _api():
    """NIXL's Python API module. ``import nixl`` picks its CUDA variant by asking torch, and with a
    CPU-only torch installed that imports torch (seconds, per process). Where torch is not loaded
    yet, import an installed variant directly; otherwise (e.g. inside vLLM) use ``nixl._api``."""
    if "torch" not in sys.modules and "nixl" not in sys.modules:
        for variant in ("nixl_cu13", "nixl_cu12", "nixl_rocm"):
            if importlib.util.find_spec(variant) is not None:
                return importlib.import_module(f"{variant}._api")
    import nixl._api

    return nixl._api


def available() -> tuple[bool, str]:
    if sys.modules.get("nixl", False) is None:  # import blocked (tests, or a site policy)
        return False, "nixl is not importable: import of nixl is blocked"
    try:
        _api()
    except Exception as e:  # ImportError, or a broken native library
        return False, f"nixl is not importable: {e}"
    return True, "ok"


def rdma_devices() -> list[str]:
    p = Path("/sys/class/infiniband")
    return sorted(d.name for d in p.iterdir()) if p.is_dir() else []


class _Side:
    """Registered regions of one agent, with their kinds, for descriptor checks."""

    def __init__(self) -> None:
        self.table = RegionTable()
        self.kinds: dict[int, tuple[str, int]] = {}  # region addr -> (mem type, device)

    def add(self, r: Region) -> None:
        self.table.add(r)
        self.kinds[r.addr] = (r.kind.value, r.device)

    def rows(self, addrs: np.ndarray, lens: np.ndarray, what: str) -> tuple[np.ndarray, str]:
        """NIXL's (addr, len, device) rows and the one memory type they share."""
        idx = self.table.index(addrs, lens, what)
        regions = list(self.table)
        kinds = {self.kinds[regions[i].addr] for i in np.unique(idx)} if len(idx) else {("DRAM", 0)}
        types = {k for k, _ in kinds}
        if len(types) > 1:
            raise RegionError(f"{what}: one write cannot mix memory kinds {sorted(types)}")
        dev = np.array([self.kinds[r.addr][1] for r in regions], dtype=np.uint64)
        rows = np.stack([addrs, lens, dev[idx] if len(idx) else lens * 0], axis=1)
        return np.ascontiguousarray(rows, dtype=np.uint64), types.pop()


class _CtlIn:
    """Receiver side of one control stream."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.peer = "?"
        self.begun: dict[int, bytes] = {}  # transfer id -> message: BEGIN seen, DONE not yet
        # per message: NIXL notifications seen minus DONE frames (each finished transfer brings
        # one of each, in either order); > 0 at the end means "landed, DONE never came"
        self.seen: collections.Counter = collections.Counter()
        self.thread: threading.Thread | None = None


class _CtlOut:
    """Sender side of one control stream."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.dead: str | None = None
        self.thread: threading.Thread | None = None


class NixlTransport:
    name = "nixl"

    def __init__(self, agent: str | None = None, *, timeout: float = 30.0,
                 backends: tuple[str, ...] | None = None, ucx_env: dict[str, str] | None = None,
                 error_handling: str | None = None, control_host: str = "0.0.0.0",
                 control_advertise: str | None = None) -> None:
        self.agent = agent or f"nixl-{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.timeout = timeout
        self._backends = backends
        self._ucx_env = dict(ucx_env or {})
        self._error_handling = error_handling
        self._nixl = None
        self._local = _Side()
        self._reg: list = []
        self._peers: dict[str, _Side] = {}
        self._buffers: list[Buffer] = []
        self._handles: dict[int, object] = {}
        self._inbox: list[Notification] = []
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._control_host = control_host
        self._control_advertise = control_advertise or os.environ.get("PDR_NIXL_CONTROL_HOST")
        self._listener: socket.socket | None = None
        self._control: list = []  # [advertised host, port]
        self._accept_thread: threading.Thread | None = None
        self._ctl_in: list[_CtlIn] = []
        self._ctl_out: dict[str, _CtlOut] = {}
        self._closing = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._nixl is not None:
            return
        for k, v in self._ucx_env.items():
            os.environ.setdefault(k, v)
        ok, why = available()
        if not ok:
            raise TransportUnavailable(why)
        api = _api()
        nixl_agent, nixl_agent_config, nixl_thread_sync_t = (
            api.nixl_agent, api.nixl_agent_config, api.nixl_thread_sync_t)
        conf = nixl_agent_config(enable_prog_thread=False, backends=[],
                                 sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:
            agent = nixl_agent(self.agent, conf)
            plugins = agent.get_plugin_list()
            wanted = self._backends or (("UCX", "LIBFABRIC") if rdma_devices() else ("UCX",))
            made = []
            for b in wanted:
                if b not in plugins:
                    continue
                params = {"ucx_error_handling_mode": self._error_handling} if b == "UCX" and \
                    self._error_handling else {}
                agent.create_backend(b, params)
                made.append(b)
        except Exception as e:
            raise TransportError(f"nixl agent creation failed: {e}") from e
        if not made:
            raise TransportUnavailable(f"none of the NIXL backends {wanted} loads; plugins: {plugins}")
        self._nixl = agent
        self.backends = made
        self._closing = False
        self._listener = socket.create_server((self._control_host, 0), backlog=64)
        host = self._control_advertise
        if not host:
            host = self._control_host if self._control_host not in ("", "0.0.0.0", "::") else None
        if not host:
            try:
                host = socket.gethostbyname(socket.gethostname())
            except OSError:
                host = "127.0.0.1"
        self._control = [host, self._listener.getsockname()[1]]
        self._accept_thread = self._thread(self._ctl_accept, "accept")

    def close(self) -> None:
        if self._nixl is None:
            return
        self._closing = True
        if self._listener is not None:
            _shutdown(self._listener)
            self._listener.close()
            self._join(self._accept_thread)
            self._listener = None
        with self._lock:
            ins, outs = list(self._ctl_in), list(self._ctl_out.values())
            self._ctl_out.clear()
        for c in ins:
            _shutdown(c.sock)
            self._join(c.thread)
        for o in outs:
            _shutdown(o.sock)
            self._join(o.thread)
            o.sock.close()
        with self._lock:
            for h in self._handles.values():
                try:
                    self._nixl.release_xfer_handle(h)
                except Exception:
                    pass  # e.g. still in flight towards a dead peer; NIXL frees it with the agent
            self._handles.clear()
            for peer in list(self._peers):
                try:
                    self._nixl.remove_remote_agent(peer)
                except Exception:
                    pass
            self._peers.clear()
            for reg in self._reg:
                self._nixl.deregister_memory(reg)
            self._reg.clear()
            self._nixl = None
        for b in self._buffers:
            b.close()
        self._buffers.clear()

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _agent(self):
        if self._nixl is None:
            raise TransportError("start() the nixl transport first")
        return self._nixl

    # --------------------------------------------------------------------- memory
    def allocate(self, nbytes: int) -> Buffer:
        mm = anon_mmap(nbytes)
        a = np.frombuffer(mm, dtype=np.uint8)
        buf = Buffer(mm, Region(int(a.ctypes.data), nbytes))
        del a
        self._buffers.append(buf)
        return buf

    def register(self, region: Region) -> None:
        agent = self._agent()
        with self._lock:
            try:
                reg = agent.register_memory([(region.addr, region.nbytes, region.device, "")],
                                            mem_type=region.kind.value)
            except Exception as e:
                raise RegionError(f"nixl cannot register {region}: {e}") from e
            self._local.add(region)
            self._reg.append(reg)

    # ----------------------------------------------------------------- endpoints
    def endpoint(self) -> bytes:
        agent = self._agent()
        regions = [[r.addr, r.nbytes, r.kind.value, r.device] for r in self._local.table]
        return _wire.dumps({"backend": self.name, "agent": self.agent, "regions": regions,
                            "meta": base64.b64encode(agent.get_agent_metadata()).decode(),
                            "control": self._control, "host": host_id()})

    def connect(self, endpoint: bytes) -> str:
        info = _wire.loads(endpoint)
        if info.get("backend") != self.name:
            raise TransportError(f"endpoint is for backend {info.get('backend')!r}, not 'nixl'")
        with self._lock:
            try:
                name = self._agent().add_remote_agent(base64.b64decode(info["meta"]))
            except Exception as e:
                raise TransportError(f"nixl could not load {info['agent']}'s metadata: {e}") from e
            side = _Side()
            for addr, nbytes, kind, dev in info["regions"]:
                side.add(Region(addr, nbytes, MemKind(kind), dev))
        try:
            out = self._dial(info) if info.get("control") else None
        except BaseException:
            with self._lock:
                self._nixl.remove_remote_agent(name)
            raise
        with self._lock:
            self._peers[name] = side
            old = self._ctl_out.pop(name, None)
            if out is not None:
                self._ctl_out[name] = out
        if old is not None:
            _shutdown(old.sock)
            self._join(old.thread)
            old.sock.close()
        if out is not None:
            out.thread = self._thread(self._ctl_watch, f"watch-{name}", out)
        return name

    def disconnect(self, name: str) -> None:
        with self._lock:
            out = self._ctl_out.pop(name, None)
            if self._peers.pop(name, None) is not None and self._nixl is not None:
                self._nixl.remove_remote_agent(name)
        if out is not None:
            _shutdown(out.sock)
            self._join(out.thread)
            out.sock.close()

    # ------------------------------------------------------------------ transfers
    def write(self, peer: str, descs, message: bytes = b"", timeout: float | None = None) -> Transfer:
        agent = self._agent()
        side = self._peers.get(peer)
        if side is None:
            raise TransportError(f"not connected to {peer!r}")
        d = as_descs(descs)
        local, ltype = self._local.rows(d[:, 0], d[:, 2], "source")
        remote, rtype = side.rows(d[:, 1], d[:, 2], "destination")
        t = Transfer(next(self._ids), peer, bytes(message), int(d[:, 2].sum()),
                     time.monotonic() + (self.timeout if timeout is None else timeout))
        out = self._ctl_out.get(peer)
        if out is not None and out.dead is not None:
            t._resolve(PeerLost(f"peer {peer} is gone: {out.dead}"))
            return t
        if not len(d):  # a notification alone: DONE once handed to NIXL, which sends it as the
            # sender's agent progresses (any later poll of a transfer or of notifications)
            with self._lock:
                if not self._ctl_send(peer, _wire.BEGIN, t.id, t.message):
                    t._resolve(PeerLost(f"peer {peer} is gone: {out.dead if out else '?'}"))
                    return t
                try:
                    agent.send_notif(peer, t.message)
                    t._resolve(None)
                except Exception as e:
                    t._resolve(TransferFailed(f"nixl could not send the notification: {e}"))
                    self._ctl_send(peer, _wire.NACK, t.id)  # nothing will arrive: forget the BEGIN
                    return t
                self._ctl_send(peer, _wire.DONE, t.id)
            return t
        with self._lock:
            if not self._ctl_send(peer, _wire.BEGIN, t.id, t.message):
                t._resolve(PeerLost(f"peer {peer} is gone: {out.dead if out else '?'}"))
                return t
            try:
                h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, ltype),
                                          agent.get_xfer_descs(remote, rtype), peer, t.message)
                state = agent.transfer(h)
            except Exception as e:
                gone = "REMOTE_DISCONNECT" in str(e) or (out is not None and out.dead is not None)
                t._resolve((PeerLost if gone else TransferFailed)(f"nixl could not post the transfer: {e}"))
                self._ctl_send(peer, _wire.NACK, t.id)  # nothing will arrive: forget the BEGIN
                return t
            self._handles[t.id] = h
        if state == "ERR":
            self._poll(t)
        t._poll = lambda: self._poll(t)
        return t

    def _poll(self, t: Transfer) -> None:
        with self._lock:
            h = self._handles.get(t.id)
            if h is None or self._nixl is None:
                return
            state = self._nixl.check_xfer_state(h)
            out = self._ctl_out.get(t.peer)
            lost = out is not None and out.dead is not None
            if state == "PROC" and not lost and not (t.deadline is not None and time.monotonic() > t.deadline):
                return
            self._handles.pop(t.id)
            if state == "DONE":
                t._resolve(None)
                self._ctl_send(t.peer, _wire.DONE, t.id)
            elif state == "ERR":
                t._resolve(PeerLost(f"nixl transfer {t.id} to {t.peer} failed (peer gone?)"))
            elif lost:
                t._resolve(PeerLost(f"nixl transfer {t.id} to {t.peer}: control stream lost ({out.dead})"))
            else:
                t._resolve(TransferTimeout(f"nixl transfer {t.id} to {t.peer} passed its deadline"))
            try:
                self._nixl.release_xfer_handle(h)
            except Exception:  # in flight towards a dead peer; the agent frees it at close
                pass

    def notifications(self) -> list[Notification]:
        with self._lock:
            self._drain()
            items, self._inbox = self._inbox, []
        return items

    def _drain(self) -> None:
        """NIXL's new notifications into the inbox, counted against their control stream."""
        if self._nixl is None:
            return
        for peer, msgs in self._nixl.get_new_notifs().items():
            conn = next((c for c in self._ctl_in if c.peer == peer), None)
            for m in msgs:
                m = bytes(m)
                self._inbox.append(Notification(peer, m))
                if conn is not None:
                    self._count(conn, m, 1)

    @staticmethod
    def _count(conn: _CtlIn, message: bytes, n: int) -> None:
        conn.seen[message] += n
        if conn.seen[message] == 0:
            del conn.seen[message]

    def wait_notification(self, message: bytes | None = None, timeout: float | None = None) -> Notification:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            got = self.notifications()
            hit = next((n for n in got if message is None or n.message == message), None)
            with self._lock:
                self._inbox[:0] = [n for n in got if n is not hit]
            if hit is not None:
                return hit
            if deadline is not None and time.monotonic() > deadline:
                raise TransferTimeout(f"no notification {message!r} within {timeout}s")
            time.sleep(_POLL_S)

    # ------------------------------------------------------------ control stream
    def _dial(self, info: dict) -> _CtlOut:
        """Open the control stream to a peer's listener (its advertised host, then loopback when
        the peer is on this host); the WELCOME must name the agent we meant."""
        host, port = info["control"]
        hosts = [host] + (["127.0.0.1"] if info.get("host") == host_id() and host != "127.0.0.1" else [])
        errors = []
        for h in hosts:
            sock = None
            try:
                sock = socket.create_connection((h, int(port)), timeout=self.timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _wire.send_frame(sock, _wire.HELLO, 0, _wire.dumps({"agent": self.agent}))
                kind, _x, body = _wire.recv_frame(sock)
                if kind != _wire.WELCOME or _wire.loads(body).get("agent") != info["agent"]:
                    raise PeerLost(f"{h}:{port} is not {info['agent']}'s control listener")
                return _CtlOut(sock)
            except Exception as e:
                errors.append(f"{h}:{port}: {e}")
                if sock is not None:
                    sock.close()
        raise PeerLost(f"nixl control stream to {info['agent']} failed: {'; '.join(errors)}")

    def _ctl_send(self, peer: str, kind: int, x: int, body: bytes = b"") -> bool:
        """One frame to a peer's control stream (caller holds the lock). False if the stream is
        dead (and marks it so); True also for peers without one (older endpoints)."""
        out = self._ctl_out.get(peer)
        if out is None:
            return True
        if out.dead is not None:
            return False
        try:
            _wire.send_frame(out.sock, kind, x, body)
            return True
        except OSError as e:
            out.dead = f"control stream: {e}"
            _shutdown(out.sock)
            return False

    def _ctl_watch(self, out: _CtlOut) -> None:
        """Sender: the receiver never writes after WELCOME, so readable means EOF or reset."""
        poller = select.poll()
        poller.register(out.sock.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
        while not self._closing and out.dead is None:
            if not poller.poll(int(_CTL_POLL_S * 1000)):
                continue
            try:
                data = out.sock.recv(1, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except OSError as e:
                data, why = b"", str(e)
            else:
                why = "closed by peer"
            if data:  # the receiver sends nothing after WELCOME; ignore stray bytes
                continue
            out.dead = out.dead or f"control stream {why}"
            return

    def _ctl_accept(self) -> None:
        assert self._listener is not None
        while not self._closing:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            conn = _CtlIn(sock)
            with self._lock:
                if self._closing:
                    sock.close()
                    return
                self._ctl_in.append(conn)
            conn.thread = self._thread(self._ctl_serve, "control", conn)

    def _ctl_serve(self, conn: _CtlIn) -> None:
        sock, reason = conn.sock, "closed by peer"
        try:
            sock.settimeout(self.timeout)
            kind, _x, body = _wire.recv_frame(sock)
            if kind != _wire.HELLO:
                raise PeerLost(f"unexpected control frame {kind}")
            peer = _wire.loads(body)["agent"]
            with self._lock:
                conn.peer = peer
            _wire.send_frame(sock, _wire.WELCOME, 0, _wire.dumps({"agent": self.agent}))
            sock.settimeout(_CTL_POLL_S)
            while True:
                try:
                    kind, x, body = _wire.recv_frame(sock)
                except TimeoutError:
                    if self._closing:
                        return
                    continue
                with self._lock:
                    if kind == _wire.BEGIN:
                        conn.begun[x] = body
                    elif kind == _wire.DONE:
                        message = conn.begun.pop(x, None)
                        if message is not None:
                            self._count(conn, message, -1)
                    elif kind == _wire.NACK:  # the sender could not post it: nothing will come
                        conn.begun.pop(x, None)
                    else:
                        raise PeerLost(f"unexpected control frame {kind} (transfer {x}) from {peer}")
        except BaseException as e:
            reason = str(e) or type(e).__name__
        finally:
            self._ctl_lost(conn, reason)

    def _ctl_lost(self, conn: _CtlIn, reason: str) -> None:
        """A control stream ended: transfers it began that neither finished (DONE) nor delivered
        their notification get an error notification, after NIXL's queue is drained once more
        (a notification may have arrived just before the sender went away)."""
        _shutdown(conn.sock)
        for i in range(_CTL_DRAIN):
            if conn.begun:
                with self._lock:
                    if self._closing or self._nixl is None:
                        break
                    self._drain()
                if i + 1 < _CTL_DRAIN:
                    time.sleep(0.002)
        with self._lock:
            for x, message in sorted(conn.begun.items()):
                if conn.seen[message] > 0:  # its notification came: the bytes landed
                    self._count(conn, message, -1)
                    continue
                self._inbox.append(Notification(conn.peer, message, ok=False,
                                                error=f"transfer {x} incomplete: control stream "
                                                      f"from {conn.peer} ended ({reason})"))
            conn.begun.clear()
            if conn in self._ctl_in:
                self._ctl_in.remove(conn)
        conn.sock.close()

    def _thread(self, target, name: str, *args) -> threading.Thread:
        th = threading.Thread(target=target, args=args, name=f"pdr-nixl-{name}", daemon=True)
        th.start()
        return th

    @staticmethod
    def _join(th: threading.Thread | None) -> None:
        if th is not None and th is not threading.current_thread():
            th.join(timeout=10)

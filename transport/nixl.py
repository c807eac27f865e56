"""RDMA backend through NIXL agents (UCX; LIBFABRIC too where its plugin loads and a NIC exists).
The only module that imports ``nixl``, and only in ``start()``/``available()``.

Steps of one transfer: check descriptors against local and remote registrations, turn them into
NIXL (addr, len, device) lists for each side, ``initialize_xfer("WRITE", ..., notif_msg)`` and
post it. NIXL delivers the notification to the receiver after the data; the sender's
``Transfer`` polls ``check_xfer_state`` (there is no progress thread: it busy-polls a core, so
both sides progress UCX when they poll their transfers or notifications).

Host memory (``DRAM``) works here over UCX (cma/tcp); device memory (``MemKind.VRAM`` with a CUDA
device id) is passed through as NIXL ``VRAM`` and only runs where CUDA exists.
Weak spot: a receiver learns of a sender that died mid-transfer only through its wait timeout.
"""

from __future__ import annotations

import base64
import importlib
import importlib.util
import itertools
import os
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

from transport import _wire
from transport._common import anon_mmap
from transport.base import (Buffer, MemKind, Notification, PeerLost, Region, RegionError,
                            Transfer, TransferFailed, TransferTimeout, TransportError,
                            TransportUnavailable)
from transport.layout import RegionTable, as_descs

_POLL_S = 0.0002


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


class NixlTransport:
    name = "nixl"

    def __init__(self, agent: str | None = None, *, timeout: float = 30.0,
                 backends: tuple[str, ...] | None = None, ucx_env: dict[str, str] | None = None,
                 error_handling: str | None = None) -> None:
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

    def close(self) -> None:
        if self._nixl is None:
            return
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
                            "meta": base64.b64encode(agent.get_agent_metadata()).decode()})

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
            self._peers[name] = side
        return name

    def disconnect(self, name: str) -> None:
        with self._lock:
            if self._peers.pop(name, None) is not None and self._nixl is not None:
                self._nixl.remove_remote_agent(name)

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
        if not len(d):  # a notification alone: DONE once handed to NIXL, which sends it as the
            # sender's agent progresses (any later poll of a transfer or of notifications)
            try:
                with self._lock:
                    agent.send_notif(peer, t.message)
                t._resolve(None)
            except Exception as e:
                t._resolve(TransferFailed(f"nixl could not send the notification: {e}"))
            return t
        with self._lock:
            try:
                h = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, ltype),
                                          agent.get_xfer_descs(remote, rtype), peer, t.message)
                state = agent.transfer(h)
            except Exception as e:
                t._resolve(TransferFailed(f"nixl could not post the transfer: {e}"))
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
            if state == "PROC" and not (t.deadline is not None and time.monotonic() > t.deadline):
                return
            self._handles.pop(t.id)
            if state == "DONE":
                t._resolve(None)
            elif state == "ERR":
                t._resolve(PeerLost(f"nixl transfer {t.id} to {t.peer} failed (peer gone?)"))
            else:
                t._resolve(TransferTimeout(f"nixl transfer {t.id} to {t.peer} passed its deadline"))
            try:
                self._nixl.release_xfer_handle(h)
            except Exception:  # in flight towards a dead peer; the agent frees it at close
                pass

    def notifications(self) -> list[Notification]:
        with self._lock:
            if self._nixl is not None:
                for peer, msgs in self._nixl.get_new_notifs().items():
                    self._inbox.extend(Notification(peer, bytes(m)) for m in msgs)
            items, self._inbox = self._inbox, []
        return items

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

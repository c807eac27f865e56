"""vLLM-free push pairing for the pd-router connector: the prefill worker's ``PushSender`` and
the decode worker's ``PushReceiver``, plus the small TCP side channel between them.

Flow of one request (router sends both legs at once, same X-Request-Id):

1. Decode worker: ``PushReceiver.expect(RecvReq)``; a background thread sends a ``Registration``
   (decode's block ids, its transport endpoint, its layout) to the prefill side channel
   ``remote_host:remote_port`` and gets ``{"ok": true}`` back.
2. Prefill worker: ``PushSender.add_finished(SendReq)`` when the prefill has finished (its blocks
   are held by vLLM until ``poll_done`` reports the request) and ``on_registration`` from the side
   channel, in either order, matched by ``base_id``. The pair goes to one writer thread: build
   descriptors (``transport.layout``), ``write`` with decode's request id as the message, wait for
   the ACK. Success or failure, the prefill request is then reported done (blocks freed). A
   failure also sends a notification alone, ``"!" + request id``, so decode fails at once.
3. Decode worker: ``poll()`` each step turns notifications into finished / failed request ids;
   a request with no notification by its deadline fails.

Lifetimes: prefill blocks with no registration are released after ``lease_s``; a registration
with no prefill is dropped after its ``valid_for``; a write is never started later than
``valid_for - transfer_timeout`` after its registration arrived, so decode (which waits
``valid_for``) never frees blocks that a late write could still touch.

Cancellation (side-channel ``{"kind": "cancel", "base_id"}`` from decode, ``cancel_prefill`` on
the prefill worker): a prefill that ends without KV (aborted) fails a registered decode at once
(a ``"!"`` notification) or refuses its registration when it comes; a decode request aborted
while waiting asks the prefill side to drop the pairing, and frees its blocks at once only when
the answer is ``dropped`` (nothing was or will be written); ``writing`` means it must wait for
the notification (or its deadline) first.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from transport.base import Region, Transport
from transport.kvmeta import KVLayout, RecvReq, Registration, SendReq, pair_blocks
from transport.layout import build_descriptors
from transport.timeline import tl
from transport.xfer_stats import XferRecorder

log = logging.getLogger("pdr.push")
_LEN = struct.Struct("<I")
FAIL_PREFIX = "!"
MAX_FRAME = 16 << 20


# --- side channel: length-prefixed JSON, one request and one answer per connection -------------


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("side channel closed early")
        buf += chunk
    return bytes(buf)


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_LEN.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, 4))
    if n > MAX_FRAME:
        raise ValueError(f"side-channel frame of {n} bytes")
    return _recv_exact(sock, n)


def side_request(host: str, port: int, payload: bytes, timeout: float = 10.0) -> dict:
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        send_frame(s, payload)
        return json.loads(recv_frame(s))


class SideChannelServer:
    """Accepts side-channel frames and hands each decoded JSON object to ``handler``."""

    def __init__(self, host: str, port: int, handler) -> None:
        self._sock = socket.create_server((host, port), backlog=128, reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._handler = handler
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="pdr-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(10)
                msg = json.loads(recv_frame(conn))
                answer = self._handler(msg) or {"ok": True}
            except Exception as e:  # noqa: BLE001 - answer the peer, keep serving
                log.warning("side channel: bad message: %s", e)
                answer = {"ok": False, "error": str(e)}
            try:
                send_frame(conn, json.dumps(answer).encode())
            except OSError:
                pass

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


# --- prefill side ---------------------------------------------------------------------------------


class PushSender:
    """Prefill worker: pairs finished prefills with decode registrations and writes the KV."""

    def __init__(self, transport: Transport, layout: KVLayout, regions: list[Region], *,
                 host: str = "127.0.0.1", port: int = 0, lease_s: float = 30.0,
                 transfer_timeout: float = 20.0, clock=time.monotonic) -> None:
        self.transport = transport
        self.layout = layout
        self._regions = regions
        self._host, self._port = host, port
        self.lease_s = lease_s
        self.transfer_timeout = transfer_timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._ready: dict[str, tuple[SendReq, float]] = {}  # base_id -> finished prefill
        self._regs: dict[str, tuple[Registration, float]] = {}  # base_id -> registration
        self._done: set[str] = set()  # prefill request ids whose blocks may be freed
        self._cancelled: dict[str, float] = {}  # base_id -> when: refuse its registration
        self._writing: set[str] = set()  # base ids paired and handed to the writer
        self._peers: dict[bytes, str] = {}
        self._jobs: queue.Queue = queue.Queue()
        self.stats = {"written": 0, "failed": 0, "expired": 0, "bytes": 0}
        self.xfer = XferRecorder()  # per-interval observations for vLLM's stats (transport.xfer_stats)
        self.server: SideChannelServer | None = None
        self._writer: threading.Thread | None = None

    def start(self) -> None:
        self.transport.start()  # before register(): nixl registers memory with its started agent
        for r in self._regions:
            self.transport.register(r)
        self.server = SideChannelServer(self._host, self._port, self.on_message)
        self._writer = threading.Thread(target=self._write_loop, name="pdr-push-writer", daemon=True)
        self._writer.start()

    @property
    def port(self) -> int:
        return self.server.port if self.server else self._port

    def on_message(self, msg: dict) -> dict:
        kind = msg.get("kind")
        if kind == "register":
            return self.on_registration(Registration.decode(msg))
        if kind == "cancel":
            return {"ok": True, "state": self.on_decode_cancel(str(msg["base_id"]))}
        return {"ok": False, "error": f"unknown kind {kind!r}"}

    def add_finished(self, send: SendReq) -> None:
        tl("P_worker_sees_finished", send.base_id)
        with self._lock:
            if self._cancelled.pop(send.base_id, None) is not None:  # decode gave up already
                self._done.add(send.req_id)
                return
            hit = self._regs.pop(send.base_id, None)
            if hit is None:
                self._ready[send.base_id] = (send, self._clock())
                return
            self._writing.add(send.base_id)
        self._jobs.put((send, *hit))

    def incompatible(self, reg: Registration) -> str | None:
        """Why this decode's blocks cannot receive our blocks (transport or KV layout), or None."""
        if reg.backend != self.transport.name:
            return (f"decode uses transport {reg.backend!r}, prefill {self.transport.name!r}: set "
                    "the same kv_connector_extra_config.transport on both instances")
        why = self.layout.compatible(reg.layout)
        return f"KV layouts differ: {why}" if why else None

    def on_registration(self, reg: Registration) -> dict:
        tl("P_register_in", reg.base_id)
        now = self._clock()
        why = self.incompatible(reg)
        if why:
            # First contact of a mismatched pair: refuse it (decode fails the request at once and
            # logs the reason) and release our side of the request now, not after lease_s.
            with self._lock:
                self._regs.pop(reg.base_id, None)
                hit = self._ready.pop(reg.base_id, None)
                if hit is not None:
                    self._done.add(hit[0].req_id)
                else:
                    self._cancelled[reg.base_id] = now
                self.stats["failed"] += 1
            log.error("push: refusing decode registration of %s: %s", reg.dst_req_id, why)
            return {"ok": False, "error": f"prefill refused the registration: {why}"}
        with self._lock:
            if self._cancelled.pop(reg.base_id, None) is not None:
                return {"ok": False, "error": "the prefill of this request was cancelled"}
            hit = self._ready.pop(reg.base_id, None)
            if hit is None:
                self._regs[reg.base_id] = (reg, now)
                return {"ok": True}
            self._writing.add(reg.base_id)
        self._jobs.put((hit[0], reg, now))
        return {"ok": True}

    def cancel_prefill(self, base_id: str) -> None:
        """The prefill ended without KV (aborted): fail a waiting decode at once, or refuse its
        registration when it comes."""
        with self._lock:
            hit = self._regs.pop(base_id, None)
            if hit is None:
                self._cancelled[base_id] = self._clock()
                return
        self._jobs.put(("fail", hit[0]))  # off the caller's (engine) thread

    def on_decode_cancel(self, base_id: str) -> str:
        """Decode aborted its request. ``dropped``: nothing was or will be written (decode may free
        its blocks now; our blocks are released). ``writing``: a write is under way, decode must
        wait for its notification."""
        with self._lock:
            if base_id in self._writing:
                return "writing"
            self._regs.pop(base_id, None)
            hit = self._ready.pop(base_id, None)
            if hit is not None:
                self._done.add(hit[0].req_id)
            else:
                self._cancelled[base_id] = self._clock()  # the prefill may still finish later
        return "dropped"

    def poll_done(self) -> set[str]:
        """Prefill request ids whose blocks can be freed now (written, failed or lease expired)."""
        now = self._clock()
        with self._lock:
            for base, (send, t) in list(self._ready.items()):
                if now - t > self.lease_s:
                    del self._ready[base]
                    self._done.add(send.req_id)
                    self.stats["expired"] += 1
                    self.xfer.expired_send()
                    log.warning("push: lease of %s expired after %.0fs with no decode registration",
                                send.req_id, self.lease_s)
            for base, (reg, t) in list(self._regs.items()):
                if now - t > reg.valid_for:
                    del self._regs[base]
            for base, t in list(self._cancelled.items()):
                if now - t > self.lease_s:
                    del self._cancelled[base]
            done, self._done = self._done, set()
        return done

    def pending(self) -> int:
        with self._lock:
            return len(self._ready) + self._jobs.qsize()

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job[0] == "fail":
                self._notify_failure(job[1])
                continue
            send, reg, t_reg = job
            try:
                self._write(send, reg, t_reg)
                self.stats["written"] += 1
            except Exception as e:  # noqa: BLE001 - report to decode, free our blocks
                self.stats["failed"] += 1
                self.xfer.failed_send()
                log.warning("push: write of %s to decode %s failed: %s", send.req_id, reg.dst_req_id, e)
                self._notify_failure(reg)
            finally:
                with self._lock:
                    self._done.add(send.req_id)
                    self._writing.discard(send.base_id)

    def _peer(self, reg: Registration) -> str:
        peer = self._peers.get(reg.endpoint)
        if peer is None:
            peer = self._peers[reg.endpoint] = self.transport.connect(reg.endpoint)
        return peer

    def _write(self, send: SendReq, reg: Registration, t_reg: float) -> None:
        why = self.incompatible(reg)  # checked at registration already; kept as a guard
        if why:
            raise ValueError(why)
        margin = min(self.transfer_timeout, reg.valid_for / 2)
        if self._clock() > t_reg + reg.valid_for - margin:
            raise TimeoutError("registration too old: decode may already have given up")
        src, dst = pair_blocks(send.block_ids, reg, self.layout.block_size)
        descs = build_descriptors(self.layout.bases, reg.layout.bases, self.layout.block_bytes,
                                  reg.layout.block_bytes, src, dst, src_stride=self.layout.stride,
                                  dst_stride=reg.layout.stride)
        try:
            peer = self._peer(reg)
            t0 = time.perf_counter()
            tl("P_write_start", send.base_id)
            t = self.transport.write(peer, descs, reg.dst_req_id.encode(), timeout=self.transfer_timeout)
            t.wait()
            took = time.perf_counter() - t0
            tl("P_write_acked", send.base_id)
        except Exception:
            self._peers.pop(reg.endpoint, None)  # reconnect next time (decode restarted?)
            raise
        nbytes = int(descs[:, 2].sum()) if len(descs) else 0
        self.stats["bytes"] += nbytes
        self.xfer.sent(nbytes, len(descs), took)

    def _notify_failure(self, reg: Registration) -> None:
        import numpy as np

        try:
            peer = self._peer(reg)
            self.transport.write(peer, np.empty((0, 3), dtype=np.uint64),
                                 (FAIL_PREFIX + reg.dst_req_id).encode(), timeout=5)
        except Exception as e:  # noqa: BLE001 - decode will time out instead
            log.warning("push: could not tell decode that %s failed: %s", reg.dst_req_id, e)

    def close(self) -> None:
        self._jobs.put(None)
        if self.server:
            self.server.close()
        self.transport.close()


# --- decode side ----------------------------------------------------------------------------------


class PushReceiver:
    """Decode worker: registers blocks with the prefill side and turns notifications into
    finished / failed request ids."""

    def __init__(self, transport: Transport, layout: KVLayout, regions: list[Region], *,
                 timeout_s: float = 60.0, clock=time.monotonic, sender=side_request) -> None:
        self.transport = transport
        self.layout = layout
        self._regions = regions
        self.timeout_s = timeout_s
        self._clock = clock
        self._send = sender
        self._lock = threading.Lock()
        self._pending: dict[str, float] = {}  # decode request id -> deadline
        self._where: dict[str, RecvReq] = {}  # decode request id -> its prefill side channel
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdr-push-reg")
        self._endpoint = b""
        self.xfer = XferRecorder()  # per-interval observations for vLLM's stats (transport.xfer_stats)

    def start(self) -> None:
        self.transport.start()  # before register(): nixl registers memory with its started agent
        for r in self._regions:
            self.transport.register(r)
        self._endpoint = self.transport.endpoint()

    def expect(self, recv: RecvReq) -> None:
        reg = Registration(base_id=recv.base_id, dst_req_id=recv.req_id, endpoint=self._endpoint,
                           backend=self.transport.name, block_ids=list(recv.block_ids),
                           first_block=recv.first_block, num_tokens=recv.num_tokens,
                           layout=self.layout, valid_for=self.timeout_s)
        with self._lock:
            self._pending[recv.req_id] = self._clock() + self.timeout_s
            self._where[recv.req_id] = recv
        self._pool.submit(self._register, recv, reg)

    def abort(self, req_id: str) -> None:
        """The request was aborted while waiting: ask the prefill side to drop the pairing. If it
        says nothing will be written, report the request at once (vLLM then frees its blocks);
        otherwise keep waiting for the notification or the deadline, so that no write can land
        in blocks already given to another request."""
        with self._lock:
            recv = self._where.get(req_id)
        if recv is not None:
            self._pool.submit(self._abort, recv)

    def cancel_unscheduled(self, base_id: str, host: str, port: int) -> None:
        """A request that finished before it was scheduled (so it has no blocks and never
        registered): tell the prefill side, which then frees its blocks for it at once (or drops
        the prefill when it finishes later) instead of holding them for ``lease_s``."""
        if host and port > 0:
            self._pool.submit(self._cancel_unscheduled, base_id, host, port)

    def _cancel_unscheduled(self, base_id: str, host: str, port: int) -> None:
        try:
            answer = self._send(host, port, json.dumps({"kind": "cancel", "base_id": base_id}).encode())
            log.info("push: told %s:%s that unscheduled %s was cancelled: %s", host, port, base_id,
                     answer.get("state"))
        except Exception as e:  # noqa: BLE001 - prefill keeps its blocks until its lease ends
            log.warning("push: cancelling unscheduled %s at %s:%s failed: %s", base_id, host, port, e)

    def _abort(self, recv: RecvReq) -> None:
        try:
            answer = self._send(recv.remote_host, recv.remote_port,
                                json.dumps({"kind": "cancel", "base_id": recv.base_id}).encode())
        except Exception as e:  # noqa: BLE001 - unknown: wait for the deadline
            log.warning("push: cancelling %s at %s:%s failed: %s", recv.req_id, recv.remote_host,
                        recv.remote_port, e)
            return
        if answer.get("state") == "dropped":
            self._fail(recv.req_id)

    def _register(self, recv: RecvReq, reg: Registration) -> None:
        tl("D_register_send", recv.base_id)
        try:
            answer = self._send(recv.remote_host, recv.remote_port, reg.encode())
            tl("D_register_answered", recv.base_id)
        except Exception as e:  # noqa: BLE001 - fail the request, free the blocks
            log.warning("push: registering %s with %s:%s failed: %s", recv.req_id, recv.remote_host,
                        recv.remote_port, e)
            self._fail(recv.req_id)
            return
        if not answer.get("ok"):
            log.error("push: %s:%s refused the registration of %s: %s", recv.remote_host,
                      recv.remote_port, recv.req_id, answer.get("error") or "refused")
            self._fail(recv.req_id)

    def _fail(self, req_id: str) -> None:
        with self._lock:
            self._where.pop(req_id, None)
            if self._pending.pop(req_id, None) is not None:
                self._failed.add(req_id)
                self.xfer.failed_recv()

    def expected_bytes(self, recv: RecvReq) -> int:
        """The bytes the prefill side writes for ``recv`` (``pair_blocks``: whole blocks from
        ``first_block`` up to the one holding the last prompt token, on every plane)."""
        needed = -(-recv.num_tokens // self.layout.block_size) - recv.first_block
        return max(0, needed) * self.layout.block_bytes * len(self.layout.bases)

    def poll(self) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids since the last call; failed ones are in both sets,
        as vLLM wants (KVConnectorTransferResults)."""
        for n in self.transport.notifications():
            msg = n.message.decode(errors="replace")
            if msg.startswith(FAIL_PREFIX):
                self._fail(msg[len(FAIL_PREFIX):])
            elif not n.ok:
                log.warning("push: incomplete KV for %s: %s", msg, n.error)
                self._fail(msg)
            else:
                with self._lock:
                    recv = self._where.pop(msg, None)
                    deadline = self._pending.pop(msg, None)
                    if deadline is not None:
                        tl("D_notification", msg)
                        self._finished.add(msg)
                        waited = self._clock() - (deadline - self.timeout_s)
                        self.xfer.received(self.expected_bytes(recv) if recv else 0, waited)
        now = self._clock()
        with self._lock:
            for rid, deadline in list(self._pending.items()):
                if now > deadline:
                    log.warning("push: no KV for %s within %.0fs", rid, self.timeout_s)
                    del self._pending[rid]
                    self._where.pop(rid, None)
                    self._failed.add(rid)
                    self.xfer.failed_recv()
            failed, self._failed = self._failed, set()
            finished, self._finished = self._finished | failed, set()
        return finished, failed

    def waiting(self) -> int:
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()

"""Cross-host fallback: the payload goes over the TCP control stream itself.

Steps of one transfer: the sender checks descriptors, sends a DATA frame (message, then the
(dst, len) list), then the payload gathered from its source addresses with ``sendmsg`` (C, GIL
released, deadline-bound). The receiver checks every destination against its registered regions
(NACK and drop the connection if one is outside), scatters the payload straight into place with
``readv``, posts the notification and ACKs. EOF before the last byte: an error notification.
"""

from __future__ import annotations

import socket
import struct

import numpy as np

from transport import _wire
from transport._common import _Inbound, _Peer
from transport._stream import StreamTransport
from transport.base import Notification, PeerLost, RegionError, Transfer

_MLEN = struct.Struct("<I")


class TcpTransport(StreamTransport):
    name = "tcp"
    same_host = False

    def __init__(self, agent: str | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 advertise: str | None = None, **kw) -> None:
        super().__init__(agent, **kw)
        self._host, self._port, self._advertise = host, port, advertise

    def _listen(self):
        sock = socket.create_server((self._host, self._port), backlog=64)
        return sock, [self._advertise or self._host, sock.getsockname()[1]]

    def _dial(self, address) -> socket.socket:
        sock = socket.create_connection((address[0], int(address[1])), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _send(self, peer: _Peer, t: Transfer, descs: np.ndarray, timeout: float) -> None:
        body = _MLEN.pack(len(t.message)) + t.message + np.ascontiguousarray(descs[:, 1:]).tobytes()
        _wire.send_frame(peer.sock, _wire.DATA, t.id, body)
        self.core.send_iov(peer.sock.fileno(), descs, 0, int(timeout * 1000))

    def _on_data(self, conn: _Inbound, x: int, body: bytes) -> None:
        (mlen,) = _MLEN.unpack_from(body)
        conn.inflight[x] = body[4:4 + mlen]
        pairs = np.frombuffer(body, dtype=np.uint64, offset=4 + mlen).reshape(-1, 2)
        descs = np.zeros((len(pairs), 3), dtype=np.uint64)
        descs[:, 1:] = pairs
        try:
            self._local.check(descs, 1, "destination")
        except RegionError as e:
            _wire.send_frame(conn.sock, _wire.NACK, x, str(e).encode())
            raise PeerLost(f"rejected transfer {x}: {e}") from e
        want = int(descs[:, 2].sum())
        conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        got = self.core.recv_iov(conn.sock.fileno(), descs, 1, int(self.timeout * 1000))
        if got != want:
            raise PeerLost(f"connection closed after {got} of {want} bytes")
        self._inbox.post(Notification(conn.peer, conn.inflight.pop(x)))
        _wire.send_frame(conn.sock, _wire.ACK, x)

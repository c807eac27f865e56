"""Framing of the control stream shared by the cma, shm and tcp backends (and of nixl's liveness
stream: HELLO/WELCOME {agent}, then BEGIN, DONE, or NACK when a write could not be posted).

Every frame is a 16-byte header ``<B 3x I Q`` (kind, body length, transfer id) and a body.

    sender                          receiver
    HELLO {agent, pid}        ->
                              <-    WELCOME {regions} (+ memfds for shm, SCM_RIGHTS)
    BEGIN id, message         ->                         one-sided backends (cma, shm):
    ... bytes written directly into the receiver's memory ...
    DONE id                   ->                         receiver posts Notification(ok)
    DATA id, message, (dst, len)*n, then the payload ->  tcp: receiver scatters, posts it
                              <-    ACK id | NACK id, reason
"""

from __future__ import annotations

import json
import socket
import struct

from transport.base import PeerLost

HEADER = struct.Struct("<B3xIQ")
HELLO, WELCOME, BEGIN, DONE, DATA, ACK, NACK = range(1, 8)
MAX_BODY = 1 << 30


def send_frame(sock: socket.socket, kind: int, xfer: int = 0, body: bytes = b"",
               fds: list[int] | None = None) -> None:
    data = HEADER.pack(kind, len(body), xfer) + body
    if fds:
        n = socket.send_fds(sock, [data], fds)
        data = data[n:]
    if data:
        sock.sendall(data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly n bytes; PeerLost on EOF. Socket timeouts (TimeoutError) pass through only
    before the first byte; once a frame has started we keep reading."""
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            if not buf:
                raise
            continue
        if not chunk:
            raise PeerLost("connection closed by peer")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[int, int, bytes]:
    kind, length, xfer = HEADER.unpack(recv_exact(sock, HEADER.size))
    if length > MAX_BODY:
        raise PeerLost(f"frame body of {length} bytes: stream out of sync")
    body = recv_exact(sock, length) if length else b""
    return kind, xfer, body


def recv_frame_fds(sock: socket.socket, maxfds: int = 256) -> tuple[int, int, bytes, list[int]]:
    """Like recv_frame, but also collects file descriptors sent along with the first bytes."""
    data, fds, _flags, _addr = socket.recv_fds(sock, HEADER.size, maxfds)
    if not data:
        raise PeerLost("connection closed by peer")
    data += recv_exact(sock, HEADER.size - len(data)) if len(data) < HEADER.size else b""
    kind, length, xfer = HEADER.unpack(data)
    body = recv_exact(sock, length) if length else b""
    return kind, xfer, body, list(fds)


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(data: bytes):
    return json.loads(data.decode())

"""Same-host backend through shared memory: the receiver's blocks live in memfds, which the
sender maps once per peer (fds passed over the Unix control socket with SCM_RIGHTS).

Steps: ``allocate()`` creates a memfd-backed buffer (only such memory can be a destination); on
``connect`` the receiver sends its memfds with the WELCOME frame and the sender maps them
(MAP_POPULATE: the one-time page-table cost is paid at connect, not per request). Per transfer:
check descriptors, translate destination addresses into the local mapping, send BEGIN, copy with
one C memcpy batch (GIL released), send DONE; the receiver notifies and ACKs.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from transport._common import _addr, _Inbound, _Peer
from transport._stream import StreamTransport
from transport.base import Buffer, Region, Transfer
from transport.layout import RegionTable


class ShmTransport(StreamTransport):
    name = "shm"
    same_host = True

    def allocate(self, nbytes: int) -> Buffer:
        fd = os.memfd_create(f"pdr-kv-{self.agent}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        buf = Buffer(mm, Region(_addr(mm), nbytes), fd)
        self._buffers.append(buf)
        return buf

    def _shared(self) -> list[Buffer]:
        return [b for b in self._buffers if b.fd >= 0]

    def _exported_regions(self) -> list[Region]:
        """Registered regions inside a memfd buffer: the only ones a peer can write."""
        spans = RegionTable(b.region for b in self._shared())
        out = []
        for r in self._local:
            try:
                spans.index(np.array([r.addr], np.uint64), np.array([r.nbytes], np.uint64), "")
                out.append(r)
            except ValueError:
                continue
        return out

    def _welcome(self, conn: _Inbound) -> tuple[dict, list[int]]:
        bufs = self._shared()
        return {"maps": [[b.region.addr, b.region.nbytes] for b in bufs]}, [b.fd for b in bufs]

    def _on_welcome(self, peer: _Peer, welcome: dict, fds: list[int]) -> None:
        maps = []
        try:
            for (addr, nbytes), fd in zip(welcome["maps"], fds, strict=True):
                mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
                maps.append((addr, nbytes, _addr(mm), mm))
        except BaseException:
            for m in maps:
                m[3].close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        peer.extra["maps"] = maps
        peer.extra["map_table"] = RegionTable(Region(a, n) for a, n, _, _ in maps)
        order = sorted(maps, key=lambda m: m[0])
        peer.extra["delta"] = np.array([(la - a) % (1 << 64) for a, _, la, _ in order], np.uint64)

    def _on_peer_closed(self, peer: _Peer) -> None:
        for m in peer.extra.pop("maps", []):
            m[3].close()

    def _send(self, peer: _Peer, t: Transfer, descs: np.ndarray, timeout: float) -> None:
        idx = peer.extra["map_table"].check(descs, 1, "destination")
        local = descs.copy()
        local[:, 1] += peer.extra["delta"][idx]  # wraps mod 2**64, as intended
        self._send_one_sided(peer, t, lambda: self._parallel(self.core.copy_batch, local))

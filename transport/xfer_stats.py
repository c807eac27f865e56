"""vLLM-free per-interval transfer statistics of the push connector's worker side.

``PushSender`` and ``PushReceiver`` record into an ``XferRecorder`` from their own threads
(writer thread, side channel, engine thread); the connector's ``get_kv_connector_stats`` calls
``take()`` once per engine step and hands the observations to vLLM
(``transport.connector_stats.PdrKVConnectorStats``), which carries them to the front end's
logged stats and ``/metrics``.

The payload is a dict of lists of plain ``int`` / ``float`` (it crosses processes through
vLLM's serializers; numpy scalars would not), one list entry per observation:

- ``bytes_sent`` / ``descriptors`` / ``transfer_duration``: one entry per successful write on
  the prefill side (bytes of KV written, descriptors in it, seconds from the start of the write
  to the receiver's acknowledgement);
- ``bytes_received`` / ``recv_wait``: one entry per request whose KV arrived on the decode side
  (its bytes, computed from the registration as the prefill side computes them; seconds from
  the registration to the notification, so including the prefill itself);
- ``failed_sends``, ``expired_sends``, ``failed_recvs``: one ``1`` per event (a write that
  failed; prefill blocks released after ``lease_s`` with no registration; a decode request that
  did not get its KV: failure notification, refused registration, incomplete transfer, deadline,
  or a cancel answered ``dropped``).
"""

from __future__ import annotations

import threading
from typing import Any

KEYS = ("bytes_sent", "descriptors", "transfer_duration", "bytes_received", "recv_wait",
        "failed_sends", "expired_sends", "failed_recvs")


def empty() -> dict[str, list]:
    return {k: [] for k in KEYS}


class XferRecorder:
    """Thread-safe accumulator; ``take`` returns what was recorded since the last call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = empty()

    def _add(self, **values: Any) -> None:
        with self._lock:
            for k, v in values.items():
                self._data[k].append(v)

    def sent(self, nbytes: int, descriptors: int, seconds: float) -> None:
        self._add(bytes_sent=int(nbytes), descriptors=int(descriptors), transfer_duration=float(seconds))

    def received(self, nbytes: int, waited_s: float) -> None:
        self._add(bytes_received=int(nbytes), recv_wait=float(waited_s))

    def failed_send(self) -> None:
        self._add(failed_sends=1)

    def expired_send(self) -> None:
        self._add(expired_sends=1)

    def failed_recv(self) -> None:
        self._add(failed_recvs=1)

    def take(self) -> dict[str, list] | None:
        """The observations since the last call (None when there were none), and start afresh."""
        with self._lock:
            if not any(self._data.values()):
                return None
            data, self._data = self._data, empty()
        return data

"""pd-router KV transport: move KV-cache blocks between prefill and decode workers.

    from transport import create, build_descriptors
    rx = create("auto")          # or "nixl" | "cma" | "shm" | "tcp"; env PDR_TRANSPORT overrides
    ...

``IMPLEMENTATION`` says which core was loaded: "c" (the extension) or "python" (its twin).
See docs/transport.md.
"""

from transport._core import IMPLEMENTATION
from transport.base import (BlockSpec, Buffer, MemKind, Notification, PeerLost, Region, RegionError,
                            Status, Transfer, TransferFailed, TransferTimeout, Transport,
                            TransportError, TransportUnavailable)
from transport.layout import build_descriptors, descriptors_for
from transport.select import BACKENDS, available, create, resolve

__all__ = [
    "BACKENDS", "IMPLEMENTATION", "BlockSpec", "Buffer", "MemKind", "Notification", "PeerLost",
    "Region", "RegionError", "Status", "Transfer", "TransferFailed", "TransferTimeout", "Transport",
    "TransportError", "TransportUnavailable", "available", "build_descriptors", "create",
    "descriptors_for", "resolve",
]

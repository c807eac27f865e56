"""Choosing a backend: one name -> implementation table, ``auto``, and the ``PDR_TRANSPORT`` override.

``resolve(name)``: an explicit name, else ``$PDR_TRANSPORT``, else ``auto``. A forced backend that
cannot run here raises TransportUnavailable with the reason (never a silent fallback). ``auto``:
``nixl`` when an RDMA device exists and nixl imports; otherwise, for a peer on the same host,
``cma`` (one-sided, works on any registered memory, e.g. a KV cache vLLM allocated); otherwise
``tcp``. ``shm`` is never picked automatically: it needs destination memory from ``allocate()``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

from transport.base import Transport, TransportUnavailable

ENV = "PDR_TRANSPORT"

# name -> (module, class): imported only when chosen
BACKENDS: dict[str, tuple[str, str]] = {
    "nixl": ("transport.nixl", "NixlTransport"),
    "cma": ("transport.cma", "CmaTransport"),
    "shm": ("transport.shm", "ShmTransport"),
    "tcp": ("transport.tcp", "TcpTransport"),
}
CHOICES = ("auto", *BACKENDS)


def _probe(name: str) -> tuple[bool, str]:
    if name == "nixl":
        from transport import nixl

        return nixl.available()
    if name == "cma":
        from transport import cma

        return cma.available()
    if name == "shm":
        return (hasattr(os, "memfd_create"), "ok" if hasattr(os, "memfd_create") else "no memfd_create")
    return True, "ok"


def available() -> dict[str, tuple[bool, str]]:
    """Every backend -> (can it run here, why not)."""
    return {name: _probe(name) for name in BACKENDS}


def resolve(name: str | None = None, *, same_host: bool = True,
            probe: Callable[[str], tuple[bool, str]] = _probe) -> str:
    """The backend to use. ``same_host``: whether the peer shares this host (auto only)."""
    chosen = name or os.environ.get(ENV) or "auto"
    if chosen not in CHOICES:
        raise TransportUnavailable(f"unknown transport {chosen!r}; choose one of {', '.join(CHOICES)}")
    if chosen != "auto":
        ok, why = probe(chosen)
        if not ok:
            src = "argument" if name else f"${ENV}"
            raise TransportUnavailable(f"transport {chosen!r} forced by {src} cannot run here: {why}")
        return chosen
    from transport.nixl import rdma_devices

    if rdma_devices() and probe("nixl")[0]:
        return "nixl"
    if same_host and probe("cma")[0]:
        return "cma"
    return "tcp"


def create(name: str | None = None, *, same_host: bool = True, **kwargs) -> Transport:
    """Construct (not start) the resolved backend; ``kwargs`` go to its constructor."""
    module, cls = BACKENDS[resolve(name, same_host=same_host)]
    return getattr(importlib.import_module(module), cls)(**kwargs)

"""The single import seam between the C core and its pure-Python twin.

``transport._core`` exposes the functions of whichever implementation was loaded and names it in
``IMPLEMENTATION`` ("c" or "python"). The C extension is used unless ``PDR_TRANSPORT_PURE=1`` or it
is not built; ``PDR_REQUIRE_C_EXT=1`` turns a missing extension into an ImportError (CI).
``load(name)`` returns either implementation explicitly (the test suite runs against both).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

NAMES = ("build_descriptors", "copy_batch", "vm_write", "vm_read", "send_iov", "recv_iov")
_MODULES = {"c": "transport._kvio", "python": "transport._kvio_py"}


def load(name: str) -> ModuleType:
    """Import one implementation ("c" or "python") and check it has the full API."""
    try:
        mod = importlib.import_module(_MODULES[name])
    except KeyError:
        raise ValueError(f"unknown core {name!r}; expected one of {sorted(_MODULES)}") from None
    missing = [n for n in NAMES if not hasattr(mod, n)]
    if missing:
        raise ImportError(f"{mod.__name__} lacks {missing}")
    mod.IMPLEMENTATION = name  # type: ignore[attr-defined]
    return mod


def _default() -> ModuleType:
    if os.environ.get("PDR_TRANSPORT_PURE", "") == "1":
        return load("python")
    try:
        return load("c")
    except ImportError:
        if os.environ.get("PDR_REQUIRE_C_EXT", "") == "1":
            raise
        return load("python")


_impl = _default()
IMPLEMENTATION: str = _impl.IMPLEMENTATION
build_descriptors = _impl.build_descriptors
copy_batch = _impl.copy_batch
vm_write = _impl.vm_write
vm_read = _impl.vm_read
send_iov = _impl.send_iov
recv_iov = _impl.recv_iov

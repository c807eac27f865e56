"""MoRIIO zmq addresses and the request id that carries them (PROTOCOLS.md sections 4 and 5).

Import-light (stdlib only) so settings, dispatch and tests can share it.

- A zmq address is ``host:<ip>,handshake:<port>,notify:<port>``; each item is split on its
  FIRST colon, so ``host:::1`` is the IPv6 host ``::1`` (as vLLM's
  ``parse_moriio_zmq_address`` does).
- The request id is ``___prefill_addr_<P zmq>___decode_addr_<D zmq>_<32 lowercase hex>``.
  vLLM's connector finds the peer's address with ``___prefill_addr_(.+?)___decode_addr_`` and
  ``___decode_addr_(.+)_[0-9a-f]{32}(?:-.*)?$`` (moriio_common.py), so an address must not
  contain ``___`` and the tail must be exactly 32 lowercase hex digits.
"""

from __future__ import annotations

import re
import uuid

PREFILL_MARK = "___prefill_addr_"
DECODE_MARK = "___decode_addr_"
_ID_RE = re.compile(r"^___prefill_addr_(?P<p>.+?)___decode_addr_(?P<d>.+)_(?P<hex>[0-9a-f]{32})$")
_BAD_CHARS = re.compile(r"[\s\x00-\x1f\x7f,]")
ZMQ_KEYS = ("host", "handshake", "notify")


def parse_zmq_address(text: str) -> tuple[str, int, int]:
    """``"host:IP,handshake:PORT,notify:PORT"`` -> (host, handshake_port, notify_port).

    Stricter than vLLM's parser, because the address travels in an HTTP header and inside
    a pattern: exactly the three keys once each, ports 1..65535, a host without blanks,
    control characters or ``___``.
    """
    if not isinstance(text, str) or not text:
        raise ValueError("zmq address is empty")
    parts: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition(":")
        key = key.strip()
        if not sep or key not in ZMQ_KEYS or key in parts:
            raise ValueError(f"zmq address {text!r} must be host:<ip>,handshake:<port>,notify:<port>")
        parts[key] = value.strip()
    if set(parts) != set(ZMQ_KEYS):
        raise ValueError(f"zmq address {text!r} needs host, handshake and notify")
    host = parts["host"]
    if not host or _BAD_CHARS.search(host) or "___" in host:
        raise ValueError(f"zmq address {text!r} has a bad host")
    ports = []
    for key in ("handshake", "notify"):
        v = parts[key]
        if not v.isdigit() or not 0 < int(v) <= 65535:
            raise ValueError(f"zmq address {text!r}: {key} must be a port 1..65535")
        ports.append(int(v))
    return host, ports[0], ports[1]


def request_id(prefill_zmq: str, decode_zmq: str, hex32: str | None = None) -> str:
    """The X-Request-Id both legs of one MoRIIO request carry."""
    parse_zmq_address(prefill_zmq)
    parse_zmq_address(decode_zmq)
    tail = uuid.uuid4().hex if hex32 is None else hex32
    if not re.fullmatch(r"[0-9a-f]{32}", tail):
        raise ValueError("the id tail must be 32 lowercase hex digits")
    return f"{PREFILL_MARK}{prefill_zmq}{DECODE_MARK}{decode_zmq}_{tail}"


def parse_request_id(rid: str) -> tuple[str, str, str] | None:
    """(prefill zmq, decode zmq, 32 hex) of a MoRIIO request id, or None if it is not one."""
    m = _ID_RE.match(rid)
    return (m["p"], m["d"], m["hex"]) if m else None

"""The registration ping schema, shared by the listener (router/discovery.py) and the
sender (router/register.py). Import-light on purpose: msgpack and the stdlib only.

Four payload formats arrive on the ping port (PROTOCOLS.md section 5), one msgpack map each:

- ``pd-router``      ``{"type": "pd-router/v1", "role": "prefill"|"decode"|"P"|"D",
  "http_address": "host:port" or URL, "model", "engine_id", "kv_host", "kv_port", "tp_size",
  "pp_size", "dp_size", "zmq_address", "connector", "transfer_mode", "token"}`` (ours; only
  ``type``, ``role`` and ``http_address`` are required)
- ``moriio``         ``{"type": "P"|"D", "http_address": "ip:port", "zmq_address":
  "host:<ip>,handshake:<port>,notify:<port>", "dp_size", "tp_size", "transfer_mode": "READ"|"WRITE"}``
- ``moriio-legacy``  ``{"type": "register", "role": "P"|"D", "request_address": URL or "ip:port",
  "handshake_port", "notify_port", "dp_size", "tp_size", "transfer_mode", "index"}``;
  ``{"type": "HELLO"}`` is a no-op (``parse_ping`` returns None)
- ``p2p-nccl``       ``{"type": "P"|"D", "http_address": "ip:port", "zmq_address": "ip:port"}``

Every field is untrusted: anything malformed raises ``PingRejected(reason)`` with a reason
from ``REASONS`` (a bounded metric label). Any format may carry ``token``.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

import msgpack

from router.moriio_ids import parse_zmq_address
from router.settings import InstanceSpec

PD_ROUTER_TYPE = "pd-router/v1"
FORMATS = ("pd-router", "moriio", "moriio-legacy", "p2p-nccl")
MAX_PING_BYTES = 16 * 1024
MAX_KEYS = 64
MAX_STR = 512
# Bounded label values of pd_router_rejected_pings_total{reason}.
REASONS = (
    "too_large", "bad_frames", "bad_msgpack", "not_a_map", "unknown_type", "bad_role", "bad_field",
    "bad_token", "address_not_allowed", "transfer_mode_mismatch", "connector_mismatch",
    "missing_coordinates", "registry_full",
)

_ROLES = {"P": "prefill", "D": "decode", "prefill": "prefill", "decode": "decode"}
_MODES = {"READ": "pull", "WRITE": "push", "pull": "pull", "push": "push", "read": "pull", "write": "push"}
_HOST_RE = re.compile(r"^[A-Za-z0-9._\-:%]+$")  # a DNS name, IPv4 or IPv6 (zone ids included)


class PingRejected(ValueError):
    """A ping that must be dropped; ``reason`` is one of REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Registration:
    """What one ping says about one instance, normalised across the formats."""

    role: str  # "prefill" | "decode"
    url: str  # http://host:port
    format: str  # one of FORMATS
    model: str | None = None
    engine_id: str | None = None
    kv_host: str | None = None
    kv_port: int | None = None
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zmq_address: str | None = None
    connector: str | None = None  # as the sender named it, lower-case
    transfer_mode: str | None = None  # "pull" | "push" (MoRIIO READ | WRITE)
    token: str | None = None

    def spec(self) -> InstanceSpec:
        return InstanceSpec(url=self.url, engine_id=self.engine_id, kv_host=self.kv_host, kv_port=self.kv_port,
                            tp=self.tp, pp=self.pp, dp=self.dp, zmq_address=self.zmq_address, model=self.model)

    def hosts(self) -> list[str]:
        """Every address this registration would make the router (or a peer) contact."""
        out = [host_of_url(self.url)]
        if self.kv_host:
            out.append(self.kv_host)
        if self.zmq_address:
            out.append(zmq_host(self.zmq_address))
        return out


def encode_ping(reg: Registration) -> bytes:
    """pd-router's own payload for ``reg`` (the sender's side)."""
    body = {"type": PD_ROUTER_TYPE, "role": reg.role, "http_address": reg.url, "tp_size": reg.tp,
            "pp_size": reg.pp, "dp_size": reg.dp}
    for key, value in (("model", reg.model), ("engine_id", reg.engine_id), ("kv_host", reg.kv_host),
                       ("kv_port", reg.kv_port), ("zmq_address", reg.zmq_address), ("connector", reg.connector),
                       ("transfer_mode", reg.transfer_mode), ("token", reg.token)):
        if value is not None:
            body[key] = value
    return msgpack.packb(body, use_bin_type=True)


def parse_ping(payload: bytes, *, max_bytes: int = MAX_PING_BYTES) -> Registration | None:
    """Decode and validate one ping. None for a no-op (``HELLO``); raises PingRejected."""
    if len(payload) > max_bytes:
        raise PingRejected("too_large", f"{len(payload)} bytes > {max_bytes}")
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_map_len=MAX_KEYS,
                               max_array_len=MAX_KEYS, max_str_len=max_bytes, max_bin_len=max_bytes,
                               max_ext_len=max_bytes)
    except Exception as exc:  # noqa: BLE001 - msgpack raises many types (ValueError, ExtraData, ...)
        raise PingRejected("bad_msgpack", type(exc).__name__) from None
    if not isinstance(data, dict):
        raise PingRejected("not_a_map", type(data).__name__)
    if len(data) > MAX_KEYS:
        raise PingRejected("bad_field", "too many keys")
    kind = data.get("type")
    token = _opt_str(data, "token")
    if kind == PD_ROUTER_TYPE:
        return _pd_router(data, token)
    if kind == "HELLO":
        return None
    if kind == "register":
        return _moriio_legacy(data, token)
    if kind in ("P", "D"):
        zmq = _opt_str(data, "zmq_address")
        if zmq is not None and ("handshake:" in zmq or zmq.startswith("host:")):
            return _moriio(data, token)
        return _p2p_nccl(data, token)
    raise PingRejected("unknown_type", repr(kind)[:40])


# -- the formats ------------------------------------------------------------------------------

def _pd_router(d: dict, token: str | None) -> Registration:
    zmq = _opt_str(d, "zmq_address")
    if zmq is not None:
        zmq_host(zmq)  # MoRIIO's "host:..,handshake:..,notify:.." or P2P's "ip:port"
    connector = _opt_str(d, "connector")
    kv_host = _opt_str(d, "kv_host")
    if kv_host is not None:
        _check_host(kv_host, "kv_host")
    return Registration(
        role=_role(d.get("role")), url=normalize_http_address(_str(d, "http_address")), format="pd-router",
        model=_opt_str(d, "model"), engine_id=_opt_str(d, "engine_id"), kv_host=kv_host,
        kv_port=_opt_int(d, "kv_port", 0, 65535), tp=_size(d, "tp_size"), pp=_size(d, "pp_size"),
        dp=_size(d, "dp_size"), zmq_address=zmq, connector=connector.lower() if connector else None,
        transfer_mode=_mode(d), token=token)


def _moriio(d: dict, token: str | None) -> Registration:
    zmq = _str(d, "zmq_address")
    parse_moriio_zmq(zmq)
    return Registration(role=_role(d.get("type")), url=normalize_http_address(_str(d, "http_address")),
                        format="moriio", tp=_size(d, "tp_size"), dp=_size(d, "dp_size"), zmq_address=zmq,
                        connector="moriio", transfer_mode=_mode(d), token=token)


def _moriio_legacy(d: dict, token: str | None) -> Registration:
    url = normalize_http_address(_str(d, "request_address"))
    handshake = _opt_int(d, "handshake_port", 1, 65535)
    notify = _opt_int(d, "notify_port", 1, 65535)
    zmq = None
    if handshake is not None and notify is not None:
        zmq = f"host:{host_of_url(url)},handshake:{handshake},notify:{notify}"
    return Registration(role=_role(d.get("role")), url=url, format="moriio-legacy", tp=_size(d, "tp_size"),
                        dp=_size(d, "dp_size"), zmq_address=zmq, connector="moriio", transfer_mode=_mode(d),
                        token=token)


def _p2p_nccl(d: dict, token: str | None) -> Registration:
    zmq = _opt_str(d, "zmq_address")
    if zmq is not None:
        split_host_port(zmq)
    return Registration(role=_role(d.get("type")), url=normalize_http_address(_str(d, "http_address")),
                        format="p2p-nccl", zmq_address=zmq, connector="p2p-nccl", token=token)


# -- addresses -------------------------------------------------------------------------------

def split_host_port(text: str) -> tuple[str, int]:
    """``ip:port``, ``[v6]:port`` or a bare ``v6:port`` (the port is after the LAST colon)."""
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise PingRejected("bad_field", f"bad address {text[:80]!r}")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise PingRejected("bad_field", f"address without a port {text[:80]!r}")
    if not port_text.isdigit() or not 0 < int(port_text) <= 65535:
        raise PingRejected("bad_field", f"bad port in {text[:80]!r}")
    _check_host(host, "address")
    return host, int(port_text)


def normalize_http_address(text: str) -> str:
    """``ip:port`` or ``http(s)://host:port[/anything]`` -> ``http(s)://host:port``."""
    scheme = "http"
    if "://" in text:
        scheme, _, text = text.partition("://")
        if scheme not in ("http", "https"):
            raise PingRejected("bad_field", f"scheme {scheme[:10]!r}")
        text = text.split("/", 1)[0]
    host, port = split_host_port(text)
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def host_of_url(url: str) -> str:
    netloc = url.partition("://")[2].split("/", 1)[0]
    host = netloc.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") else host


def parse_moriio_zmq(text: str) -> tuple[str, int, int]:
    """``host:<ip>,handshake:<port>,notify:<port>``; each item split on its FIRST colon (IPv6).
    The MoRIIO dispatcher's own parser (it puts the address in request ids), plus our host check."""
    try:
        host, handshake, notify = parse_zmq_address(text)
    except ValueError:
        raise PingRejected("bad_field", f"zmq_address {text[:80]!r}") from None
    _check_host(host, "zmq_address host")
    return host, handshake, notify


def zmq_host(text: str) -> str:
    if text.startswith("host:") or "handshake:" in text:
        return parse_moriio_zmq(text)[0]
    return split_host_port(text)[0]


def host_in_networks(host: str, networks) -> bool:
    """Is ``host`` (an IP literal; ``localhost`` counts as loopback) inside one of ``networks``?
    Host names are not resolved: with allowed networks set, register IP addresses."""
    if host == "localhost":
        candidates = [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    else:
        try:
            candidates = [ipaddress.ip_address(host.split("%", 1)[0])]
        except ValueError:
            return False
    return any(ip in net for ip in candidates for net in networks if ip.version == net.version)


# -- typed field access ----------------------------------------------------------------------

def _check_host(host: str, what: str) -> None:
    if not host or len(host) > 255 or not _HOST_RE.match(host):
        raise PingRejected("bad_field", f"bad {what} host {host[:80]!r}")
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise PingRejected("bad_field", f"bad {what} IPv6 host {host[:80]!r}") from None


def _str(d: dict, key: str) -> str:
    value = d.get(key)
    if not isinstance(value, str) or not value or len(value) > MAX_STR or not value.isprintable():
        raise PingRejected("bad_field", f"{key} must be a non-empty printable string")
    return value


def _opt_str(d: dict, key: str) -> str | None:
    return None if d.get(key) is None else _str(d, key)


def _opt_int(d: dict, key: str, lo: int, hi: int) -> int | None:
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, str) and value.isdigit():  # some senders stringify ports
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise PingRejected("bad_field", f"{key} must be an integer in {lo}..{hi}")
    return value


def _size(d: dict, key: str) -> int:
    value = _opt_int(d, key, 1, 4096)
    return 1 if value is None else value


def _role(value) -> str:
    role = _ROLES.get(value) if isinstance(value, str) else None
    if role is None:
        raise PingRejected("bad_role", repr(value)[:40])
    return role


def _mode(d: dict) -> str | None:
    value = d.get("transfer_mode")
    if value is None:
        return None
    mode = _MODES.get(value) if isinstance(value, str) else None
    if mode is None:
        raise PingRejected("bad_field", f"transfer_mode {repr(value)[:40]}")
    return mode

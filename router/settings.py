"""One frozen settings object. The CLI only maps flags and PD_ROUTER_* variables onto it."""

from __future__ import annotations

import dataclasses
import ipaddress
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from router.moriio_ids import parse_zmq_address

MODES = ("pull", "push")
COUNT_TOKENS = ("always", "when-needed")
KV_CONNECTORS = ("nixl", "moriio", "storage")
POLICIES = ("round_robin", "least_loaded")
PREFILL_FAILURE_POLICIES = ("error", "retry", "fallback")


@dataclass(frozen=True)
class InstanceSpec:
    """Where an engine is and, for push modes, its KV side-channel coordinates.

    Written on the command line as a URL with optional query parameters:
    ``http://10.0.0.1:8100?engine_id=prefill-0&kv_host=10.0.0.1&kv_port=5600&tp=1&pp=1``
    (MoRIIO adds ``zmq=host:10.0.0.1,handshake:6301,notify:61005`` and ``dp``).
    """

    url: str
    engine_id: str | None = None
    kv_host: str | None = None
    kv_port: int | None = None
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zmq_address: str | None = None
    model: str | None = None

    @classmethod
    def parse(cls, text: str) -> "InstanceSpec":
        text = text.strip()
        if "://" not in text:
            text = "http://" + text
        parts = urlsplit(text)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError(f"instance URL needs scheme, host and port: {text!r}")
        params = dict(parse_qsl(parts.query, keep_blank_values=False, strict_parsing=False))
        known = {"engine_id", "kv_host", "kv_port", "tp", "pp", "dp", "zmq", "model"}
        unknown = set(params) - known
        if unknown:
            raise ValueError(f"unknown instance option(s) {sorted(unknown)} in {text!r}; known: {sorted(known)}")
        url = urlunsplit((parts.scheme, parts.netloc, parts.path.rstrip("/"), "", ""))

        def _int(name: str, default: int | None) -> int | None:
            if name not in params:
                return default
            try:
                value = int(params[name])
            except ValueError:
                raise ValueError(f"{name} must be an integer in {text!r}") from None
            if value < (0 if name == "kv_port" else 1) or value > 65535:
                raise ValueError(f"{name} out of range in {text!r}")
            return value

        return cls(
            url=url,
            engine_id=params.get("engine_id"),
            kv_host=params.get("kv_host"),
            kv_port=_int("kv_port", None),
            tp=_int("tp", 1),
            pp=_int("pp", 1),
            dp=_int("dp", 1),
            zmq_address=params.get("zmq"),
            model=params.get("model"),
        )


@dataclass(frozen=True)
class Settings:
    mode: str = "pull"
    kv_connector: str = "nixl"
    threshold: int = 512
    prefill: tuple[InstanceSpec, ...] = ()
    decode: tuple[InstanceSpec, ...] = ()
    tokenizer: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "round_robin"
    # discovery
    ping_port: int = 0
    heartbeat_timeout: float = 9.0
    registration_token: str | None = None
    allowed_networks: tuple[str, ...] = ()
    max_instances: int = 1024
    health_interval: float = 5.0
    # upstream timeouts (seconds); None = no limit
    connect_timeout: float = 5.0
    prefill_timeout: float = 900.0
    first_byte_timeout: float = 900.0
    idle_timeout: float = 300.0
    request_timeout: float | None = 3600.0  # whole request; the only bound on a non-streamed decode leg
    on_prefill_failure: str = "error"
    prefill_retries: int = 1
    decode_retries: int = 1
    breaker_failures: int = 5
    breaker_cooldown: float = 10.0
    push_decode_grace: float = 30.0
    # admission and security
    max_inflight: int = 0
    max_body_bytes: int = 32 * 1024 * 1024
    max_tokens_limit: int = 1_000_000
    max_n: int = 128
    api_key: str | None = None
    forward_authorization: bool = False
    prefill_api_key: str | None = None
    decode_api_key: str | None = None
    shutdown_grace: float = 30.0
    # observability
    log_level: str = "info"
    log_format: str = "text"
    slo_ttft: float = 1.0
    slo_itl: float = 0.05
    # performance
    max_connections: int = 2048
    tokenizer_threads: int = 2
    tokenize_cache_size: int = 4096
    # always: tokenize every prompt (exact router-side counts in metrics and the access log);
    # when-needed: skip tokenizing when byte-length bounds already settle the route and the
    # context check (prompt-token metrics then use the engine's usage count); docs/performance.md
    count_tokens: str = "always"

    def __post_init__(self) -> None:
        _choice("mode", self.mode, MODES)
        _choice("kv_connector", self.kv_connector, KV_CONNECTORS)
        _choice("policy", self.policy, POLICIES)
        _choice("on_prefill_failure", self.on_prefill_failure, PREFILL_FAILURE_POLICIES)
        _choice("log_format", self.log_format, ("text", "json"))
        _choice("count_tokens", self.count_tokens, COUNT_TOKENS)
        if self.threshold < 0:
            raise ValueError("threshold must be >= 0")
        if not 0 <= self.ping_port <= 65535:
            raise ValueError("ping_port must be 0..65535")
        if self.heartbeat_timeout <= 0:
            raise ValueError("heartbeat_timeout must be > 0")
        for net in self.allowed_networks:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"allowed network {net!r} is not a CIDR (e.g. 10.0.0.0/8)") from None
        if self.kv_connector == "storage" and self.mode == "push":
            raise ValueError("the storage connector (ExampleConnector) is serial: use --mode pull")
        if self.mode == "push" and self.kv_connector == "nixl":
            missing = [p.url for p in self.prefill if not (p.engine_id and p.kv_host and p.kv_port is not None)]
            if missing:
                raise ValueError(
                    "push mode needs each static prefill instance's KV coordinates "
                    "(?engine_id=..&kv_host=..&kv_port=..[&tp=..&pp=..]); missing for: " + ", ".join(missing)
                )
        if self.kv_connector == "moriio":
            missing = [p.url for p in (*self.prefill, *self.decode) if not p.zmq_address]
            if missing:
                raise ValueError("MoRIIO needs each static instance's zmq address (?zmq=host:..,handshake:..,notify:..): " + ", ".join(missing))
            for p in (*self.prefill, *self.decode):
                try:
                    parse_zmq_address(p.zmq_address)
                except ValueError as exc:
                    raise ValueError(f"{p.url}: {exc}") from None

    def replace(self, **changes) -> "Settings":
        return dataclasses.replace(self, **changes)


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


FIELDS = {f.name: f for f in dataclasses.fields(Settings)}
__all__ = ["Settings", "InstanceSpec", "MODES", "KV_CONNECTORS", "POLICIES", "FIELDS", "field"]

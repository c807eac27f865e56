"""Discovery: the ZMQ ping listener that feeds the registry (PROTOCOLS.md section 5).

1. bind a ROUTER socket on ``--ping-port`` (on ``--host``); instances connect a DEALER and send
   one msgpack map every few seconds; frames arrive as ``[identity, payload]``
2. ``await recv_multipart()`` (zmq.asyncio: no polling loop); each ping is parsed by
   router/ping.py, then admitted (token, allowed networks, transfer mode, connector, KV
   coordinates push needs) and upserted into the registry; anything else is dropped and
   counted in ``pd_router_rejected_pings_total{reason}``, never raised
3. a new instance pokes the health checker, which learns its model (and the tokenizer default)
4. an expiry task drops registered instances silent for ``--heartbeat-timeout`` seconds;
   requests already running on them finish, new ones are not routed there

Static instances (``--prefill/--decode``) are never expired; router/health.py probes both kinds.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import time
from typing import Callable

import zmq
import zmq.asyncio

from router.metrics import Metrics
from router.ping import PingRejected, Registration, host_in_networks, parse_ping
from router.registry import Instance, Registry
from router.settings import Settings

log = logging.getLogger("pd_router.discovery")

HARD_MAX_BYTES = 1024 * 1024  # libzmq drops (and disconnects) peers sending more; not counted
RECV_HWM = 1000


def connector_family(name: str) -> str:
    """vLLM connector class or short name -> the router's --kv-connector vocabulary.

    pd-router's own connector (transport.connector.PdrPushConnector) reads the NIXL push fields,
    so it belongs to the nixl family."""
    low = name.lower()
    for needle, family in (("nixl", "nixl"), ("pdr", "nixl"), ("moriio", "moriio"), ("example", "storage"), ("storage", "storage"),
                           ("p2p", "p2p-nccl")):
        if needle in low:
            return family
    return low


class Admission:
    """Decides whether a well-formed registration may enter the registry. Pure: no I/O."""

    def __init__(self, settings: Settings):
        self._token = settings.registration_token.encode() if settings.registration_token else None
        self._networks = [ipaddress.ip_network(n, strict=False) for n in settings.allowed_networks]
        self._mode = settings.mode
        self._connector = settings.kv_connector

    def check(self, reg: Registration) -> None:
        """Raises PingRejected when ``reg`` must be refused."""
        if self._token is not None:
            given = (reg.token or "").encode()
            if not hmac.compare_digest(given, self._token):
                raise PingRejected("bad_token", "missing" if reg.token is None else "wrong token")
        if self._networks:
            for host in reg.hosts():
                if not host_in_networks(host, self._networks):
                    raise PingRejected("address_not_allowed", f"{host} is outside --allowed-network")
        if reg.transfer_mode is not None and reg.transfer_mode != self._mode:
            raise PingRejected("transfer_mode_mismatch",
                               f"instance transfers in {reg.transfer_mode} mode, router runs --mode {self._mode}")
        # Only pd-router's payload names its connector; the other formats imply one we do not enforce
        # (their wire is reused by hand-written senders), but MoRIIO's transfer_mode is checked above.
        if reg.format == "pd-router" and reg.connector and connector_family(reg.connector) != self._connector:
            raise PingRejected("connector_mismatch",
                               f"instance uses {reg.connector}, router runs --kv-connector {self._connector}")
        if self._connector == "moriio" and not reg.zmq_address:
            raise PingRejected("missing_coordinates", "MoRIIO needs the instance's zmq_address")
        if (self._mode == "push" and self._connector == "nixl" and reg.role == "prefill"
                and not (reg.engine_id and reg.kv_host and reg.kv_port is not None)):
            raise PingRejected("missing_coordinates", "push mode needs engine_id, kv_host and kv_port of a prefill")


class Discovery:
    """The ping listener plus the expiry task. Constructing it does no I/O; start()/close()."""

    def __init__(self, settings: Settings, registry: Registry, metrics: Metrics, *,
                 on_new: Callable[[Instance], None] | None = None, expire_every: float | None = None):
        self._settings = settings
        self._registry = registry
        self._metrics = metrics
        self._admission = Admission(settings)
        self._on_new = on_new
        self._timeout = settings.heartbeat_timeout
        self._expire_every = expire_every or min(1.0, max(0.05, settings.heartbeat_timeout / 4))
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._logged: dict[tuple[str, str], float] = {}
        self.endpoint: str | None = None
        self.pings = 0  # messages received (accepted or not)

    async def start(self) -> None:
        host = self._settings.host
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, HARD_MAX_BYTES)
            sock.setsockopt(zmq.RCVHWM, RECV_HWM)
            if ":" in host:
                sock.setsockopt(zmq.IPV6, 1)
                host = f"[{host}]"
            sock.bind(f"tcp://{host}:{self._settings.ping_port}")
        except zmq.ZMQError as exc:
            sock.close(0)
            ctx.term()
            raise OSError(f"cannot bind the ping port tcp://{host}:{self._settings.ping_port}: {exc}") from None
        self._ctx, self._sock = ctx, sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks = [asyncio.create_task(self._recv_loop(), name="pdr-discovery"),
                       asyncio.create_task(self._expire_loop(), name="pdr-expiry")]
        log.info("registration listener on %s (heartbeat timeout %gs%s%s)", self.endpoint, self._timeout,
                 ", token required" if self._settings.registration_token else "",
                 f", networks {','.join(self._settings.allowed_networks)}" if self._settings.allowed_networks else "")

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # -- receiving -----------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        assert self._sock is not None
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except zmq.ZMQError as exc:
                if exc.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                log.warning("ping socket error: %s", exc)
                continue
            self.pings += 1
            try:
                self.handle(frames)
            except Exception:  # noqa: BLE001 - one bad ping must never stop the listener
                log.exception("unexpected error handling a ping")
                self._metrics.rejected_pings.labels("bad_field").inc()

    def handle(self, frames: list[bytes]) -> Instance | None:
        """Process one received message (``[identity, payload]``). Never raises PingRejected."""
        reg = None
        try:
            payload = _payload(frames)
            reg = parse_ping(payload)
            if reg is None:  # HELLO
                return None
            self._admission.check(reg)
            return self._accept(reg)
        except PingRejected as exc:
            self._metrics.rejected_pings.labels(exc.reason).inc()
            self._log_rejection(exc, reg)
            return None

    def _accept(self, reg: Registration) -> Instance:
        static = self._registry.get(reg.role, reg.url)
        if static is not None and static.source == "static":  # configuration wins over a ping
            self._metrics.heartbeats.inc()
            return static
        attrs = {"connector": reg.connector, "transfer_mode": reg.transfer_mode}
        if reg.model is not None:
            attrs["model"] = reg.model
        inst, created = self._registry.upsert(reg.role, reg.spec(), **attrs)
        if inst is None:
            raise PingRejected("registry_full", f"{len(self._registry)} instances (--max-instances)")
        self._metrics.heartbeats.inc()
        inst.meta["format"] = reg.format
        if created:
            self._metrics.registrations.labels(reg.role, reg.format).inc()
            log.info("registered %s instance %s (%s payload%s)", reg.role, reg.url, reg.format,
                     f", model {reg.model}" if reg.model else "")
            if self._on_new is not None:
                self._on_new(inst)
        return inst

    def _log_rejection(self, exc: PingRejected, reg: Registration | None) -> None:
        """Refusals of well-formed pings are logged once a minute per (reason, instance);
        garbage only at debug level, so a flood cannot flood the log too."""
        if reg is None:
            log.debug("dropped ping: %s", exc)
            return
        key = (exc.reason, reg.url)
        now = time.monotonic()
        if now - self._logged.get(key, -1e9) < 60.0:
            return
        if len(self._logged) > 256:
            self._logged.clear()
        self._logged[key] = now
        log.warning("refused %s registration from %s (%s payload): %s", reg.role, reg.url, reg.format, exc)

    # -- expiry ----------------------------------------------------------------------------------

    async def _expire_loop(self) -> None:
        deferred = 0
        while True:
            await asyncio.sleep(self._expire_every)
            # Pings still queued in the socket (the loop was starved) are heard before judging
            # silence; a flood cannot postpone expiry for more than a few rounds.
            if self._sock is not None and self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN and deferred < 3:
                deferred += 1
                continue
            deferred = 0
            for inst in self._registry.expire(self._timeout):
                log.warning("%s instance %s missed its heartbeats for %gs: removed (%d request(s) still in flight "
                            "finish there; no new ones)", inst.role, inst.url, self._timeout, inst.in_flight)


def _payload(frames: list[bytes]) -> bytes:
    """A DEALER sends ``[identity, payload]``; a REQ adds an empty delimiter frame."""
    if len(frames) == 2:
        return frames[1]
    if len(frames) == 3 and frames[1] == b"":
        return frames[2]
    raise PingRejected("bad_frames", f"{len(frames)} frames")

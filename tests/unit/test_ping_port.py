"""The ping port under fire (hypothesis fuzz over a real socket) and against vLLM's own
MoRIIO heartbeat sender."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.discovery import Discovery
from router.metrics import Metrics
from router.ping import REASONS
from router.registry import Registry
from router.settings import Settings
from tests.conftest import free_port
from tests.unit.pingkit import metric, payload, ping_endpoint, until
from tests.unit.test_discovery import _roles, complete, instances, registered_router


@contextlib.contextmanager
def listener_thread(s: Settings, registry: Registry, metrics: Metrics):
    """A Discovery running on its own event loop in a thread, so a sync hypothesis test can drive it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-discovery")
    thread.start()
    disc = Discovery(s, registry, metrics)
    try:
        asyncio.run_coroutine_threadsafe(disc.start(), loop).result(10)
        try:
            yield disc
        finally:
            asyncio.run_coroutine_threadsafe(disc.close(), loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def wait_sync(predicate, timeout=5.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=40),
                    st.binary(max_size=16))
_value = st.recursive(_scalar, lambda i: st.lists(i, max_size=4) | st.dictionaries(st.text(max_size=6), i, max_size=4),
                      max_leaves=10)
_keys = st.sampled_from(["type", "role", "http_address", "zmq_address", "request_address", "handshake_port",
                         "notify_port", "dp_size", "tp_size", "transfer_mode", "kv_host", "kv_port", "engine_id",
                         "model", "token"]) | st.text(max_size=10)
_maps = st.dictionaries(_keys, _value, max_size=20).map(lambda d: msgpack.packb(d, use_bin_type=True))
_valid = st.builds(  # distinct well-formed instances: the flood the table must stay bounded against
    lambda t, role, port: msgpack.packb({"type": t, "role": role, "http_address": f"127.0.0.1:{port}",
                                         "zmq_address": "host:127.0.0.1,handshake:6301,notify:61005"}),
    st.sampled_from(["pd-router/v1", "P", "D", "register"]), st.sampled_from(["P", "D", "prefill", "decode"]),
    st.integers(1, 65535))
_payload = st.one_of(st.binary(max_size=2048), _maps, _valid, st.just(msgpack.packb({"type": "HELLO"})))
_frames = st.one_of(_payload.map(lambda p: [p]), st.lists(_payload, min_size=2, max_size=4))


def test_fuzz_real_ping_port_listener_survives_and_table_stays_bounded():
    s = Settings(host="127.0.0.1", ping_port=free_port(), heartbeat_timeout=3600.0, max_instances=16)
    registry, metrics = Registry(max_instances=16), Metrics()
    sample = metrics.registry.get_sample_value
    with listener_thread(s, registry, metrics) as disc, zmq.Context() as ctx:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(disc.endpoint)
        try:
            @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
            @given(_frames)
            def one(frames):
                before = disc.pings
                sock.send_multipart(frames)
                wait_sync(lambda: disc.pings > before, what="the listener to receive")
                assert len(registry) <= 16

            one()
            assert not any(t.done() for t in disc._tasks)  # the listener and the expiry task still run
            rejected = {r: sample("pd_router_rejected_pings_total", {"reason": r}) or 0.0 for r in REASONS}
            assert rejected["bad_msgpack"] > 0 and rejected["bad_frames"] > 0 and rejected["registry_full"] > 0
            assert len(registry) == 16
            accepted = sample("pd_router_heartbeats_total") or 0.0
            assert accepted + sum(rejected.values()) <= disc.pings
            # still serving: a refresh of a registered instance is accepted
            inst = next(iter(registry))
            sock.send(msgpack.packb({"type": "pd-router/v1", "role": inst.role, "http_address": inst.url}))
            wait_sync(lambda: (sample("pd_router_heartbeats_total") or 0.0) == accepted + 1, what="a heartbeat")
        finally:
            sock.close(0)


def _moriio_heartbeat_script() -> str | None:
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "distributed", "kv_transfer", "kv_connector", "v1",
                        "moriio", "moriio_heartbeat.py")
    return path if os.path.exists(path) else None


@pytest.mark.skipif(_moriio_heartbeat_script() is None, reason="vLLM's moriio_heartbeat.py not installed")
async def test_vllms_own_moriio_heartbeat_sender_registers(tiny_model_path):
    """Runs the heartbeat child process MoRIIOConnector starts (it only needs msgpack and zmq),
    fed the exact payload MoRIIOConnector._start_heartbeat builds."""
    script = _moriio_heartbeat_script()
    async with registered_router(tiny_model_path, heartbeat_timeout=1.0) as (c, app, [p], [d]):
        procs = []
        try:
            for role, e in (("prefill", p), ("decode", d)):
                body = payload("moriio", role, e)
                proc = await asyncio.create_subprocess_exec(sys.executable, script, ping_endpoint(app), "0.2", "100",
                                                            stdin=subprocess.PIPE)
                procs.append(proc)
                proc.stdin.write((json.dumps(body) + "\n").encode())
                await proc.stdin.drain()
            await until(lambda: _roles(c), timeout=20, what="vLLM's sender registered both")
            text = (await c.get("/metrics")).text
            for role in ("prefill", "decode"):
                assert metric(text, "pd_router_registrations_total", role=role, format="moriio") == 1.0
            assert (await complete(c)).status_code == 200
        finally:
            for proc in procs:
                proc.stdin.close()  # EOF stops vLLM's heartbeat child
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
        assert [proc.returncode for proc in procs] == [0, 0]
        await until(lambda: _empty(c), timeout=10, what="both expired once the senders stopped")


async def _empty(c) -> bool:
    return await instances(c) == []

"""MoRIIO instances known only through their pings: the strict MoRIIO fakes check that the
zmq addresses and dp/tp sizes the dispatcher puts on both legs are the registered ones."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from router.settings import Settings
from tests.conftest import free_port, run_router
from tests.unit.moriio_fake import MoriioEngine, MoriioNet
from tests.unit.pingkit import Heart, ping_endpoint, until
from tests.unit.routerkit import LONG, completion_legs
from tests.unit.test_discovery import _roles, rejected


def moriio_ping(fmt: str, e: MoriioEngine, mode: str) -> dict:
    short = "P" if e.role == "prefill" else "D"
    host, hs, notify = e.zmq_address.split(",")
    if fmt == "moriio":  # exactly what MoRIIOConnector._start_heartbeat sends
        return {"type": short, "http_address": f"127.0.0.1:{e.port}", "zmq_address": e.zmq_address,
                "dp_size": e.dp, "tp_size": e.tp, "transfer_mode": mode}
    return {"type": "register", "role": short, "request_address": f"http://127.0.0.1:{e.port}/v1/completions",
            "handshake_port": int(hs.split(":")[1]), "notify_port": int(notify.split(":")[1]), "dp_size": e.dp,
            "tp_size": e.tp, "transfer_mode": mode, "index": 0}


@pytest.mark.parametrize("fmt", ["moriio", "moriio-legacy"])
@pytest.mark.parametrize("read", [True, False], ids=["READ", "WRITE"])
async def test_registered_moriio_pair_serves_with_its_zmq_addresses_and_sizes(tiny_model_path, fmt, read):
    net = MoriioNet(read=read)
    p = MoriioEngine(net, role="prefill", engine_id="prefill-0", zmq_address="host:127.0.0.1,handshake:6301,notify:61005",
                     dp=2, tp=2)
    d = MoriioEngine(net, role="decode", engine_id="decode-0", zmq_address="host:127.0.0.1,handshake:6302,notify:62005",
                     dp=1, tp=4)
    mode = "READ" if read else "WRITE"
    async with contextlib.AsyncExitStack() as stack:
        for e in (p, d):
            await stack.enter_async_context(e)
        s = Settings(mode="pull" if read else "push", kv_connector="moriio", tokenizer=str(tiny_model_path),
                     threshold=16, health_interval=30.0, ping_port=free_port())
        url, app = await stack.enter_async_context(run_router(s))
        c = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=120))
        ep = ping_endpoint(app)
        await stack.enter_async_context(Heart(ep, moriio_ping(fmt, p, mode)))
        await stack.enter_async_context(Heart(ep, moriio_ping(fmt, d, mode)))
        # an instance in the other transfer mode is refused, not mixed in
        other = {**moriio_ping("moriio", d, "WRITE" if read else "READ"), "http_address": "127.0.0.1:9"}
        await stack.enter_async_context(Heart(ep, other))
        await until(lambda: _roles(c), what="P and D registered")
        await until(lambda: rejected(c, "transfer_mode_mismatch"), what="the other mode refused")
        r = await c.post("/v1/completions", json={"model": "tiny", "prompt": LONG, "max_tokens": 4})
        assert r.status_code == 200, r.text  # the strict fakes checked both legs against the registered peers
        [p_leg], [d_leg] = completion_legs(p), completion_legs(d)
        rid = p_leg.headers["x-request-id"]
        assert rid == d_leg.headers["x-request-id"]
        assert rid.startswith(f"___prefill_addr_{p.zmq_address}___decode_addr_{d.zmq_address}_")
        assert (p_leg.body["kv_transfer_params"]["remote_dp_size"], p_leg.body["kv_transfer_params"]["remote_tp_size"]) == (1, 4)
        assert (d_leg.body["kv_transfer_params"]["remote_dp_size"], d_leg.body["kv_transfer_params"]["remote_tp_size"]) == (2, 2)


async def test_moriio_router_refuses_instances_without_a_zmq_address(tiny_model_path):
    async with contextlib.AsyncExitStack() as stack:
        s = Settings(mode="pull", kv_connector="moriio", tokenizer=str(tiny_model_path), ping_port=free_port())
        url, app = await stack.enter_async_context(run_router(s))
        c = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=120))
        await stack.enter_async_context(Heart(ping_endpoint(app), {"type": "pd-router/v1", "role": "decode",
                                                                    "http_address": "127.0.0.1:9"}))
        await until(lambda: rejected(c, "missing_coordinates"))
        assert (await c.get("/instances")).json() == []

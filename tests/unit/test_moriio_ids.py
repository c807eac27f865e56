"""MoRIIO zmq addresses, pair request ids, settings, the dispatch table, and the strict fake itself.

MoRIIO needs ROCm hardware; these pin the wire format against vLLM's connector source when it is
installed (its regexes are read from the file, not copied), and against fakes otherwise.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re

import httpx
import pytest

from router.dispatch import DISPATCHERS
from router.dispatch.moriio import MoriioReadDispatch, MoriioWriteDispatch
from router.moriio_ids import parse_request_id, parse_zmq_address, request_id
from router.settings import InstanceSpec, Settings
from router.validation import check_request_id
from tests.unit.moriio_fake import MoriioEngine, MoriioNet
from tests.unit.routerkit import LONG

P = "host:10.0.0.1,handshake:6301,notify:61005"
D = "host:::1,handshake:6302,notify:61105"


def test_zmq_address_parses_on_first_colon_and_is_strict():
    assert parse_zmq_address(P) == ("10.0.0.1", 6301, 61005)
    assert parse_zmq_address(D) == ("::1", 6302, 61105)
    assert parse_zmq_address("notify:2,host:h,handshake:1") == ("h", 1, 2)  # any order
    for bad in ("", "host:1.2.3.4,handshake:6301", "host:h,handshake:x,notify:1", "host:h,handshake:0,notify:1",
                "host:h,handshake:1,notify:1,extra:2", "host:h,host:g,handshake:1,notify:2",
                "host:a___b,handshake:1,notify:2", "host:a b,handshake:1,notify:2", "host:,handshake:1,notify:2"):
        with pytest.raises(ValueError):
            parse_zmq_address(bad)


def test_request_id_round_trips_and_never_passes_client_validation():
    rid = request_id(P, D)
    assert rid.startswith(f"___prefill_addr_{P}___decode_addr_{D}_")
    p, d, tail = parse_request_id(rid)
    assert (p, d) == (P, D) and re.fullmatch(r"[0-9a-f]{32}", tail)
    assert request_id(P, D) != rid  # fresh tail per pair
    with pytest.raises(Exception, match="X-Request-Id"):
        check_request_id(rid)  # a client can never send (or forge) a pair id
    with pytest.raises(ValueError):
        request_id(P, D, "A" * 32)
    assert parse_request_id("client-1") is None


def _vllm_moriio_common() -> pathlib.Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(list(spec.submodule_search_locations)[0],
                        "distributed/kv_transfer/kv_connector/v1/moriio/moriio_common.py")
    return path if path.exists() else None


@pytest.mark.skipif(_vllm_moriio_common() is None, reason="vLLM's MoRIIO connector source is not installed")
def test_vllm_connector_finds_both_addresses_in_our_id():
    """Facts from the installed vLLM: its own regexes, applied to the id vLLM derives from ours."""
    src = _vllm_moriio_common().read_text()
    pats = dict(re.findall(r'(_PREFILL_ZMQ_RE|_DECODE_ZMQ_RE) = re\.compile\(r"([^"]+)"\)', src))
    assert set(pats) == {"_PREFILL_ZMQ_RE", "_DECODE_ZMQ_RE"}
    rid = request_id(P, D)
    for engine_id in (rid, f"cmpl-{rid}-0-1a2b3c4d", f"chatcmpl-{rid}-1a2b3c4d"):
        assert re.search(pats["_PREFILL_ZMQ_RE"], engine_id).group(1) == P  # what D dials
        assert re.search(pats["_DECODE_ZMQ_RE"], engine_id).group(1) == D  # what P dials


def test_static_instance_flag_with_zmq_query():
    spec = InstanceSpec.parse(f"http://10.0.0.1:8100?zmq={P}&dp=2&tp=4")
    assert (spec.url, spec.zmq_address, spec.dp, spec.tp) == ("http://10.0.0.1:8100", P, 2, 4)
    enc = InstanceSpec.parse("http://[::1]:8100?zmq=host%3A%3A%3A1%2Chandshake%3A6302%2Cnotify%3A61105")
    assert enc.zmq_address == D
    s = Settings(mode="push", kv_connector="moriio", prefill=(spec,), decode=(InstanceSpec.parse(f"h:1?zmq={D}"),))
    assert s.kv_connector == "moriio"
    with pytest.raises(ValueError, match="zmq"):
        Settings(kv_connector="moriio", prefill=(InstanceSpec.parse("http://10.0.0.1:8100"),))
    with pytest.raises(ValueError, match="notify"):
        Settings(kv_connector="moriio", prefill=(InstanceSpec.parse("h:1?zmq=host:h,handshake:1"),))


def test_dispatch_table_has_both_moriio_modes():
    assert DISPATCHERS[("pull", "moriio")] is MoriioReadDispatch
    assert DISPATCHERS[("push", "moriio")] is MoriioWriteDispatch
    with pytest.raises(ValueError, match="serial"):
        Settings(mode="push", kv_connector="storage")


DROP = object()
BAD_P_LEGS = {  # what the strict fake must reject, and the field it names
    "no transfer_id": ({"transfer_id": DROP}, "kv_transfer_params.transfer_id"),
    "transfer_id not tx-uuid4": ({"transfer_id": "xfer-1"}, "kv_transfer_params.transfer_id"),
    "wrong remote_tp_size": ({"remote_tp_size": 2}, "kv_transfer_params.remote_tp_size"),
    "missing remote_dp_size": ({"remote_dp_size": DROP}, "kv_transfer_params.remote_dp_size"),
    "stray field": ({"remote_handshake_port": 1}, "kv_transfer_params"),
}


async def test_strict_fake_rejects_wrong_legs():
    net = MoriioNet(read=True)
    p = MoriioEngine(net, role="prefill", engine_id="p", zmq_address=P)
    d = MoriioEngine(net, role="decode", engine_id="d", zmq_address=D)
    async with p, d, httpx.AsyncClient(timeout=30) as c:
        rid = request_id(P, D)
        kv = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None,
              "transfer_id": "tx-6f1c1a52-3f0e-4b7e-9a43-2a6f2d1e0c11", "remote_dp_size": 1, "remote_tp_size": 1}
        body = {"prompt": LONG, "max_tokens": 1, "stream": False}

        async def post(url, b, h):
            return await c.post(url + "/v1/completions", json=b, headers=h)

        for name, (change, param) in BAD_P_LEGS.items():
            bad = {k: v for k, v in {**kv, **change}.items() if v is not DROP}
            r = await post(p.url, {**body, "kv_transfer_params": bad}, {"x-request-id": rid})
            assert (r.status_code, r.json()["error"]["param"]) == (400, param), name
        r = await post(p.url, {**body, "kv_transfer_params": kv}, {"x-request-id": "client-1"})
        assert r.json()["error"]["param"] == "X-Request-Id"
        r = await post(p.url, {**body, "kv_transfer_params": kv}, {"x-request-id": request_id(D, P)})
        assert r.json()["error"]["param"] == "X-Request-Id"  # names this P as the decode side
        r = await post(p.url, {**body, "max_tokens": 2, "kv_transfer_params": kv}, {"x-request-id": rid})
        assert r.json()["error"]["param"] == "max_tokens"
        r = await post(p.url, {**body, "kv_transfer_params": kv}, {"x-request-id": rid, "x-data-parallel-rank": "0"})
        assert r.json()["error"]["param"] == "X-data-parallel-rank"
        r = await post(p.url, {**body, "kv_transfer_params": kv}, {"x-request-id": rid})
        assert r.status_code == 200, r.text
        answer = r.json()["kv_transfer_params"]
        d_kv = {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": kv["transfer_id"],
                "remote_engine_id": "p", "remote_block_ids": answer["remote_block_ids"],
                "remote_dp_size": 1, "remote_tp_size": 1}
        d_body = {"prompt": LONG, "max_tokens": 4}
        for change, param in (({"remote_engine_id": "other"}, "kv_transfer_params.remote_engine_id"),
                              ({"remote_block_ids": [[0]]}, "kv_transfer_params.remote_block_ids"),
                              ({"transfer_id": "tx-7f1c1a52-3f0e-4b7e-9a43-2a6f2d1e0c11"},
                               "kv_transfer_params.transfer_id"),
                              ({"remote_dp_rank": 0}, "kv_transfer_params")):
            r = await post(d.url, {**d_body, "kv_transfer_params": {**d_kv, **change}}, {"x-request-id": rid})
            assert (r.status_code, r.json()["error"]["param"]) == (400, param), change
        r = await post(d.url, {**d_body, "kv_transfer_params": d_kv}, {"x-request-id": request_id(P, D)})
        assert r.json()["error"]["param"] == "kv_transfer_params.transfer_id"  # another pair's id
        r = await post(d.url, {**d_body, "kv_transfer_params": d_kv}, {"x-request-id": rid})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == " t0 t1 t2 t3"

"""The ping schema (router/ping.py): every format, exact fields, untrusted input."""

from __future__ import annotations

import ipaddress
import subprocess
import sys

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.ping import (REASONS, PingRejected, Registration, encode_ping, host_in_networks, normalize_http_address,
                         parse_moriio_zmq, parse_ping)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_current_moriio_payload_as_vllm_sends_it():
    # the exact map MoRIIOConnector._start_heartbeat builds (vLLM 0.32/0.33)
    reg = parse_ping(pack({"type": "P", "http_address": "10.0.0.5:8100",
                           "zmq_address": "host:10.0.0.5,handshake:6301,notify:61005",
                           "dp_size": 2, "tp_size": 4, "transfer_mode": "WRITE"}))
    assert reg == Registration(role="prefill", url="http://10.0.0.5:8100", format="moriio", tp=4, dp=2,
                               zmq_address="host:10.0.0.5,handshake:6301,notify:61005", connector="moriio",
                               transfer_mode="push")


def test_moriio_ipv6_zmq_address_splits_on_first_colon():
    reg = parse_ping(pack({"type": "D", "http_address": "fd00::7:8200", "zmq_address": "host:fd00::7,handshake:6301,notify:61005",
                           "dp_size": 1, "tp_size": 1, "transfer_mode": "READ"}))
    assert reg.role == "decode" and reg.url == "http://[fd00::7]:8200" and reg.transfer_mode == "pull"
    assert parse_moriio_zmq(reg.zmq_address) == ("fd00::7", 6301, 61005)
    assert reg.hosts() == ["fd00::7", "fd00::7"]


def test_legacy_moriio_payload():
    reg = parse_ping(pack({"type": "register", "role": "D", "request_address": "http://10.0.0.6:8200/v1/completions",
                           "handshake_port": 6301, "notify_port": 61005, "dp_size": 1, "tp_size": 2,
                           "transfer_mode": "READ", "index": 3}))
    assert reg == Registration(role="decode", url="http://10.0.0.6:8200", format="moriio-legacy", tp=2,
                               zmq_address="host:10.0.0.6,handshake:6301,notify:61005", connector="moriio",
                               transfer_mode="pull")
    assert parse_ping(pack({"type": "HELLO"})) is None


def test_p2p_nccl_payload():
    reg = parse_ping(pack({"type": "D", "http_address": "10.0.0.7:8300", "zmq_address": "10.0.0.7:21001"}))
    assert reg == Registration(role="decode", url="http://10.0.0.7:8300", format="p2p-nccl",
                               zmq_address="10.0.0.7:21001", connector="p2p-nccl")


def test_pd_router_payload_round_trips_with_push_coordinates():
    reg = Registration(role="prefill", url="http://10.0.0.8:8100", format="pd-router", model="tiny",
                       engine_id="prefill-0", kv_host="10.0.0.8", kv_port=5600, tp=2, pp=2, dp=1,
                       connector="nixlpushconnector", transfer_mode="push", token="t")
    assert parse_ping(encode_ping(reg)) == reg
    spec = reg.spec()
    assert (spec.url, spec.engine_id, spec.kv_host, spec.kv_port, spec.tp, spec.pp, spec.model) == (
        "http://10.0.0.8:8100", "prefill-0", "10.0.0.8", 5600, 2, 2, "tiny")


@pytest.mark.parametrize("role,expected", [("P", "prefill"), ("D", "decode"), ("prefill", "prefill"),
                                           ("decode", "decode")])
def test_role_names(role, expected):
    assert parse_ping(pack({"type": "pd-router/v1", "role": role, "http_address": "h:1"})).role == expected


@pytest.mark.parametrize("text,url", [
    ("10.0.0.1:8000", "http://10.0.0.1:8000"),
    ("http://10.0.0.1:8000/v1/completions", "http://10.0.0.1:8000"),
    ("https://node-3.example:443", "https://node-3.example:443"),
    ("[::1]:8000", "http://[::1]:8000"),
    ("::1:8000", "http://[::1]:8000"),
    ("http://[fe80::1%eth0]:8000/", "http://[fe80::1%eth0]:8000"),
])
def test_http_addresses(text, url):
    assert normalize_http_address(text) == url


@pytest.mark.parametrize("payload,reason", [
    (b"\xc1", "bad_msgpack"),
    (pack({"type": "P"}) + b"\x00", "bad_msgpack"),  # trailing bytes
    (pack({1: 2}), "bad_msgpack"),  # non-string keys
    (pack("hello"), "not_a_map"),
    (pack({"type": 7}), "unknown_type"),
    (pack({"type": "register", "role": "X", "request_address": "a:1"}), "bad_role"),
    (pack({"type": "pd-router/v1", "role": None, "http_address": "a:1"}), "bad_role"),
    (pack({"type": "pd-router/v1", "role": "decode"}), "bad_field"),
    (pack({"type": "pd-router/v1", "role": "decode", "http_address": "a"}), "bad_field"),
    (pack({"type": "pd-router/v1", "role": "decode", "http_address": "ftp://a:1"}), "bad_field"),
    (pack({"type": "pd-router/v1", "role": "decode", "http_address": "a b:1"}), "bad_field"),
    (pack({"type": "pd-router/v1", "role": "decode", "http_address": "fe80:::zz:1"}), "bad_field"),
    (pack({"type": "pd-router/v1", "role": "decode", "http_address": "a:1", "kv_port": 70000}), "bad_field"),
    (pack({"type": "pd-router/v1", "role": "decode", "http_address": "a:1", "tp_size": 0}), "bad_field"),
    (pack({"type": "pd-router/v1", "role": "decode", "http_address": "a:1", "model": "x" * 600}), "bad_field"),
    (pack({"type": "pd-router/v1", "role": "decode", "http_address": "a:1", "token": 5}), "bad_field"),
    (pack({"type": "pd-router/v1", "role": "decode", "http_address": "a:1", "engine_id": "a\nb"}), "bad_field"),
    (pack({"type": "P", "http_address": "a:1", "zmq_address": "host:a,handshake:0,notify:1"}), "bad_field"),
    (pack({"type": "P", "http_address": "a:1", "zmq_address": "nohost"}), "bad_field"),
    (b"\x81" + b"\xa1k" + b"\xdb\x7f\xff\xff\xff", "bad_msgpack"),  # a 2 GiB string header, no body
    (b"\xdf\xff\xff\xff\xff", "bad_msgpack"),  # a map claiming 4 billion entries
    (b"\x00" * 20000, "too_large"),
])
def test_rejections(payload, reason):
    assert reason in REASONS
    with pytest.raises(PingRejected) as info:
        parse_ping(payload)
    assert info.value.reason == reason


def test_networks():
    nets = [ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1/128")]
    assert host_in_networks("10.2.3.4", nets) and host_in_networks("::1", nets)
    assert host_in_networks("localhost", nets)  # loopback via ::1
    assert not host_in_networks("11.0.0.1", nets)
    assert not host_in_networks("node.example", nets)  # names are never resolved


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_escape_as_anything_but_rejections(data):
    try:
        parse_ping(data)
    except PingRejected as exc:
        assert exc.reason in REASONS


_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=30), st.binary(max_size=8))
_value = st.recursive(_scalar, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                      max_leaves=8)
_keys = st.sampled_from(["type", "role", "http_address", "zmq_address", "request_address", "handshake_port",
                         "notify_port", "dp_size", "tp_size", "pp_size", "transfer_mode", "kv_host", "kv_port",
                         "engine_id", "model", "token", "connector", "index"]) | st.text(max_size=8)
_type = st.sampled_from(["P", "D", "register", "HELLO", "pd-router/v1"])


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(_keys, _value, max_size=12), _type, st.sampled_from(["P", "D", "prefill", "x", None]),
       st.sampled_from(["127.0.0.1:8000", "[::1]:1", "h:0", "host:1.2.3.4,handshake:1,notify:2", "", None]))
def test_random_maps_parse_or_reject(body, kind, role, addr):
    body = {**body, "type": kind, "role": role, "http_address": addr, "zmq_address": addr}
    try:
        reg = parse_ping(pack(body))
    except PingRejected as exc:
        assert exc.reason in REASONS
        return
    if reg is not None:
        assert reg.role in ("prefill", "decode") and reg.url.startswith("http")
        assert parse_ping(encode_ping(reg)).spec() == reg.spec()


def test_import_light():
    code = ("import sys, router.ping; heavy = {'zmq', 'httpx', 'fastapi', 'starlette', 'uvicorn', 'transformers'}; "
            "print(sorted(heavy & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

"""launch.up: argument handling, the specs and the router command it renders (no vLLM)."""

from __future__ import annotations

import argparse
import json
import socket
import sys

import pytest

from launch import up
from launch.engine_args import kv_transfer_config, render_env


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    up.add_arguments(p)
    return p.parse_args(list(argv))


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_defaults():
    a = parse()
    assert (a.mode, a.router_port, a.host, a.threshold, a.model) == ("pull", 8000, "127.0.0.1", 512, None)
    assert a.cpu_patch is False and a.device == "cpu"


def test_pull_specs_and_router_command():
    a = parse("--mode", "pull", "--threshold", "64", "--router-port", "8123", "--static")
    p, d = up.build_specs(a, "/models/tiny", "tiny-llama")
    assert kv_transfer_config(p)["kv_connector"] == "NixlConnector"
    assert (p.kv_role, d.kv_role) == ("kv_producer", "kv_consumer")
    ports = {p.port, d.port, p.kv_port, d.kv_port}
    assert len(ports) == 4 and 8123 not in ports
    argv = up.router_argv(a, p, d, "/models/tiny")
    assert argv[:4] == [sys.executable, "-m", "router.cli", "serve"]
    assert flag(argv, "--mode") == "pull"
    assert flag(argv, "--threshold") == "64"
    assert flag(argv, "--prefill") == p.url
    assert flag(argv, "--decode") == d.url
    assert flag(argv, "--tokenizer") == "/models/tiny"
    assert flag(argv, "--port") == "8123"


def test_push_prefill_url_has_coordinates():
    a = parse("--mode", "push", "--static")
    p, d = up.build_specs(a, "/m", "tiny-llama")
    cfg = kv_transfer_config(p)
    assert cfg["kv_connector"] == "NixlPushConnector" and cfg["engine_id"] == "prefill-0"
    url = flag(up.router_argv(a, p, d, "/m"), "--prefill")
    assert url == (f"http://127.0.0.1:{p.port}?engine_id=prefill-0&kv_host=127.0.0.1"
                   f"&kv_port={p.kv_port}&tp=1&pp=1")  # fmt: skip


def test_cpu_patch_and_cores_reach_the_engines():
    a = parse("--cpu-patch")
    p, d = up.build_specs(a, "/m", "tiny-llama")
    assert p.cpu_patch and d.cpu_patch
    env_p, env_d = render_env(p, {}), render_env(d, {})
    assert env_p["VLLM_NIXL_SIDE_CHANNEL_PORT"] != env_d["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    if len(up.os.sched_getaffinity(0)) >= 2:
        assert env_p["VLLM_CPU_OMP_THREADS_BIND"] != env_d["VLLM_CPU_OMP_THREADS_BIND"]


def test_gpu_flavour_uses_two_gpus_and_utilization():
    a = parse("--device", "gpu", "--gpu-memory-utilization", "0.7")
    p, d = up.build_specs(a, "/m", "m")
    assert (p.gpus, d.gpus) == ("0", "1")
    assert p.kv_cache_bytes is None and p.gpu_memory_utilization == 0.7
    assert json.loads(json.dumps(kv_transfer_config(p)))["kv_buffer_device"] == "cuda"


def test_router_port_in_use_is_refused_before_starting_anything(capsys, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        a = parse("--router-port", str(s.getsockname()[1]), "--run-dir", str(tmp_path))
        assert up.run(a) == 2
    assert "in use" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("host, expected", [("0.0.0.0", "http://127.0.0.1:8000"), ("::1", "http://[::1]:8000")])
def test_router_url(host, expected):
    assert up._router_url(parse("--host", host)) == expected


def test_default_is_discovery_router_with_a_ping_port_and_no_instances():
    a = parse("--mode", "push", "--threshold", "64")
    assert a.static is False
    p, d = up.build_specs(a, "/m", "tiny-llama")
    argv = up.router_argv(a, p, d, "/m", 36367)
    assert flag(argv, "--ping-port") == "36367"
    assert "--prefill" not in argv and "--decode" not in argv
    assert flag(argv, "--mode") == "push" and flag(argv, "--tokenizer") == "/m"


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_register_sidecars_announce_what_the_router_needs(mode):
    from router.cli import build_parser
    from router.ping import parse_ping, encode_ping
    from router.register import registration_from_args

    a = parse("--mode", mode, "--host", "0.0.0.0")
    p, d = up.build_specs(a, "/m", "tiny-llama")
    regs = {}
    for spec in (p, d):
        argv = up.register_argv(a, spec, 36367)
        assert argv[:4] == [sys.executable, "-m", "router.cli", "register"]
        args = build_parser().parse_args(argv[3:])  # the sidecar's own parser accepts it
        assert args.router == "tcp://127.0.0.1:36367"
        regs[spec.role] = parse_ping(encode_ping(registration_from_args(args, "tiny-llama")))
    assert regs["prefill"].url == p.url and regs["decode"].url == d.url
    assert {r.transfer_mode for r in regs.values()} == {mode}
    assert regs["prefill"].model == "tiny-llama"
    assert (regs["prefill"].engine_id, regs["prefill"].kv_host, regs["prefill"].kv_port) == (
        "prefill-0", "127.0.0.1", p.kv_port)
    assert regs["decode"].engine_id is None
    expected = "nixlconnector" if mode == "pull" else "nixlpushconnector"
    assert {r.connector for r in regs.values()} == {expected}


def test_ping_port_in_use_is_refused_before_starting_anything(capsys, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        a = parse("--router-port", str(up.free_ports(1)[0]), "--ping-port", str(s.getsockname()[1]),
                  "--run-dir", str(tmp_path))
        assert up.run(a) == 2
    assert "ping port" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_pdr_connector_specs_and_router_command():
    a = parse("--mode", "push", "--connector", "pdr", "--static")
    p, d = up.build_specs(a, "/m", "tiny-llama")
    cfg = kv_transfer_config(p)
    assert cfg["kv_connector"] == "PdrPushConnector"
    assert cfg["kv_connector_module_path"] == "transport.connector"
    assert cfg["engine_id"] == "prefill-0" and kv_transfer_config(d)["kv_role"] == "kv_consumer"
    url = flag(up.router_argv(a, p, d, "/m"), "--prefill")
    assert f"kv_port={p.kv_port}" in url and "engine_id=prefill-0" in url
    assert parse().connector == "nixl"


def test_pdr_connector_needs_push_mode(capsys):
    a = parse("--connector", "pdr", "--router-port", "0")
    with pytest.raises(ValueError, match="push"):
        up.build_specs(a, "/m", "tiny-llama")

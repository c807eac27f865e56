"""Helpers for the transport suite (imported by its conftest and tests): cores, peers, images."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from transport import _core
from transport.nixl import available as nixl_available

REPO = Path(__file__).resolve().parents[2]
PEER = Path(__file__).with_name("peer.py")
FILL = 0xA5
NIXL_OK, NIXL_WHY = nixl_available()
# Keep UCX on loopback and off the busy-polling progress thread (see docs/transport.md).
UCX_ENV = {"UCX_NET_DEVICES": "lo"}


def load_core(name: str):
    try:
        return _core.load(name)
    except ImportError as e:
        if name == "c" and os.environ.get("PDR_REQUIRE_C_EXT") == "1":
            pytest.fail(f"C extension required (PDR_REQUIRE_C_EXT=1) but not importable: {e}")
        pytest.skip(f"C extension not built: {e}")


def load_default_core():
    return _core._impl


def pairs(*, nixl: bool = True, backends=("cma", "shm", "tcp")):
    """(backend, core name) combinations: each of our backends with both cores; nixl once (its
    data path does not use the core; descriptors come from the default one)."""
    out = [pytest.param(b, c, id=f"{b}-{c}") for b in backends for c in ("c", "python")]
    if nixl:
        out.append(pytest.param("nixl", "default", id="nixl", marks=pytest.mark.skipif(
            not NIXL_OK, reason=f"nixl not importable: {NIXL_WHY}")))
    return out


def get_core(name: str):
    return _core._impl if name == "default" else load_core(name)


class Peer:
    """A transport endpoint in a child process (tests/transport/peer.py)."""

    def __init__(self, backend: str, core: str, nbytes: int, die: bool = False) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                   **UCX_ENV)
        args = [sys.executable, str(PEER), backend, core, str(nbytes)] + (["die"] if die else [])
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     text=True, cwd=str(REPO))
        hello = self._read(60)
        self.endpoint = base64.b64decode(hello["endpoint"])
        self.addr, self.pid, self.nbytes = hello["addr"], hello["pid"], nbytes

    def _read(self, timeout: float) -> dict:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise TimeoutError("peer did not answer")
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError(f"peer exited with {self.proc.wait()}")
        return json.loads(line)

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def call(self, timeout: float = 60, **cmd) -> dict:
        self.send(**cmd)
        return self._read(timeout)

    def start_expect(self, message: bytes, timeout: float = 20) -> None:
        """Ask the peer to wait for a notification (it polls its transport meanwhile: nixl needs
        the target to progress); collect the answer with ``result``."""
        self.send(op="expect", message=message.decode(), timeout=timeout)
        self._expect_timeout = timeout + 10

    def result(self) -> dict:
        return self._read(self._expect_timeout)

    def dump(self, tmp_path: Path) -> np.ndarray:
        path = tmp_path / f"dump-{self.pid}.bin"
        self.call(op="dump", path=str(path))
        data = np.fromfile(path, dtype=np.uint8)
        path.unlink()
        return data

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


def make_transport(backend: str, core_mod, **kw):
    from transport.select import create

    if backend == "nixl":
        return create("nixl", ucx_env=UCX_ENV, **kw)
    return create(backend, core=core_mod, **kw)


def expected_image(dst_nbytes: int, dst_base: int, src: np.ndarray, src_base: int,
                   descs: np.ndarray) -> np.ndarray:
    """The destination buffer after ``descs`` copied from ``src``: computed independently."""
    img = np.full(dst_nbytes, FILL, dtype=np.uint8)
    for s, d, n in descs.tolist():
        img[d - dst_base:d - dst_base + n] = src[s - src_base:s - src_base + n]
    return img

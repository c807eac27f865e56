"""Start vLLM instances (and any other command, e.g. the router) on this host; stop them all.

- Every process runs in its own session/process group (``start_new_session``), so teardown can
  signal the whole tree vLLM spawns (API server, engine core, workers): SIGTERM to the group,
  then SIGKILL to whatever is left after a grace period. On Linux each child also gets
  ``PR_SET_PDEATHSIG`` = SIGTERM, so a launcher killed with SIGKILL does not leave its direct
  children running (vLLM's engine core exits when its API server dies). Linux sends that
  signal when the *thread* that started the child exits, so start processes from a thread
  that lives as long as they should (the main thread, as pytest fixtures and the CLI do).
- Output goes to ``<run_dir>/<name>.log``; errors quote its tail.
- ``wait_ready`` polls ``GET /v1/models`` until the expected served model name is listed (a
  stray process on a reused port answers ``/health`` too) and fails fast, with the log tail,
  when the process exits early.

``Launcher`` is a context manager usable from pytest fixtures and from the CLI::

    with Launcher(run_dir) as launcher:
        p = launcher.start_engine(prefill_spec)
        d = launcher.start_engine(decode_spec)
        launcher.wait_all_ready([p, d], timeout=300)
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from launch.engine_args import EngineSpec, render_argv, render_env

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
_PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """A process could not be started or did not become ready."""


class ProcessExited(LaunchError):
    """A managed process exited while we waited for it."""


class ReadyTimeout(LaunchError, TimeoutError):
    """A process did not become ready in time."""


class ProcessFailed(ProcessExited):
    """A managed process is still running but its log shows it can never become ready."""


# Log lines after which a starting server will never become ready.
FATAL_LOG_MARKERS = ("Address already in use", "[Errno 98]")


# --- ports -------------------------------------------------------------------------------

_handed_out: set[int] = set()
_ports_lock = threading.Lock()
_PORT_FLOOR = 20000


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands out to outgoing connections (32768 if unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now and not handed out before by this process.

    Picked at random *below* the kernel's ephemeral range: a port from ``bind(0)`` lies inside
    it, and any outgoing connection on the machine (another engine's ZMQ or HTTP client) may
    take it between our check and the server's bind -- that is how a vLLM side channel once
    failed with "Address already in use" and hung its engine.
    """
    top = _ephemeral_floor()
    with _ports_lock:
        if top - _PORT_FLOOR >= 1000:
            for _ in range(200):
                port = random.randrange(_PORT_FLOOR, top)
                if port not in _handed_out and _bindable(host, port) and _bindable("0.0.0.0", port):
                    _handed_out.add(port)
                    return port
        for _ in range(100):  # odd port range: fall back to the kernel's choice
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise LaunchError("no free port found")


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    return [free_port(host) for _ in range(n)]


# --- one process -------------------------------------------------------------------------


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except Exception:
        pass


class Process:
    """One command in its own process group, logging to a file."""

    def __init__(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None,
                 log_path: Path, cwd: str | None = None) -> None:  # fmt: skip
        self.name = name
        self.argv = list(argv)
        self.env = dict(env) if env is not None else None
        self.log_path = Path(log_path)
        self.cwd = cwd
        self.popen: subprocess.Popen | None = None
        self.started_at: float | None = None
        self._scanned = 0  # bytes of the log already searched for fatal markers

    def start(self) -> Process:
        if self.popen is not None:
            raise LaunchError(f"{self.name}: already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            header = shlex.join(self.argv).replace("\n", "\\n")  # one line per start
            log.write(f"$ {header}\n".encode())
            log.flush()
            self.popen = subprocess.Popen(
                self.argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )  # fmt: skip
        self.started_at = time.monotonic()
        return self

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    def returncode(self) -> int | None:
        return self.popen.poll() if self.popen else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        rc = self.returncode()
        if rc is not None:
            raise ProcessExited(
                f"{self.name} exited with status {rc} (log {self.log_path}):\n{self.log_tail()}"
            )

    def check_startable(self) -> None:
        """check_alive, plus: raise ProcessFailed when the log shows it can never become ready."""
        self.check_alive()
        fatal = self.fatal_in_log()
        if fatal:
            raise ProcessFailed(
                f"{self.name} is running but cannot become ready ({fatal!r} in {self.log_path}):\n"
                f"{self.log_tail()}"
            )

    def fatal_in_log(self) -> str | None:
        """A line of the log that means the process will never become ready, else None.

        vLLM runs some listeners (the NIXL side channel) in threads: when one fails to bind,
        the server stays up and simply never answers; waiting the full start timeout for it
        helps nobody.
        """
        try:
            size = self.log_path.stat().st_size
        except OSError:
            return None
        if size == self._scanned:
            return None
        with open(self.log_path, "rb") as f:
            f.seek(max(0, self._scanned - 256))
            chunk = f.read(size - f.tell()).decode(errors="replace")
        self._scanned = size
        for line in chunk.splitlines():
            if any(m in line for m in FATAL_LOG_MARKERS):
                return line.strip()
        return None

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after ``grace`` seconds. Idempotent."""
        if self.popen is None:
            return
        pgid = self.popen.pid  # session leader: pgid == pid
        _signal_group(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self.popen.poll() is not None and not _group_alive(pgid):
                break
            time.sleep(0.1)
        _signal_group(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=5)
        # Children re-parented to init may need a moment to disappear after SIGKILL.
        for _ in range(50):
            if not _group_alive(pgid):
                break
            time.sleep(0.1)


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- readiness ---------------------------------------------------------------------------


def _get_json(url: str, timeout: float) -> object:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def serves_model(url: str, model_name: str, timeout: float = 2.0) -> bool:
    """True when ``GET url/v1/models`` lists ``model_name``."""
    try:
        data = _get_json(url.rstrip("/") + "/v1/models", timeout)
    except (OSError, ValueError, urllib.error.URLError):
        return False
    models = data.get("data") if isinstance(data, dict) else None
    return any(isinstance(m, dict) and m.get("id") == model_name for m in models or ())


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """True when ``GET url`` answers 2xx."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return 200 <= r.status < 300
    except (OSError, urllib.error.URLError):
        return False


@dataclass
class Waitable:
    """Something to wait for: a readiness probe plus the process that should serve it."""

    name: str
    probe: Callable[[], bool]
    process: Process | None = None


def wait_all(
    items: Sequence[Waitable],
    timeout: float,
    interval: float = 0.5,
    on_ready: Callable[[Waitable, float], None] | None = None,
    on_tick: Callable[[float, list[str]], None] | None = None,
) -> float:
    """Wait until every probe succeeds; return the seconds taken.

    Raises ProcessExited as soon as any item's process has exited (ProcessFailed when its log
    shows a fatal start-up error such as a port already in use), ReadyTimeout after
    ``timeout`` seconds. ``on_ready(item, elapsed)`` fires once per item, ``on_tick(elapsed,
    pending_names)`` once per polling round.
    """
    start = time.monotonic()
    pending = list(items)
    while pending:
        for item in list(pending):
            if item.process is not None:
                item.process.check_startable()
            if item.probe():
                pending.remove(item)
                if on_ready:
                    on_ready(item, time.monotonic() - start)
        elapsed = time.monotonic() - start
        if not pending:
            break
        if on_tick:
            on_tick(elapsed, [i.name for i in pending])
        if elapsed > timeout:
            names = ", ".join(i.name for i in pending)
            tails = "\n".join(
                f"--- {i.name} ({i.process.log_path}) ---\n{i.process.log_tail(15)}"
                for i in pending
                if i.process is not None
            )
            raise ReadyTimeout(f"not ready after {timeout:.0f} s: {names}\n{tails}")
        time.sleep(interval)
    return time.monotonic() - start


def wait_ready(url: str, model_name: str, timeout: float, process: Process | None = None) -> float:
    """Poll ``/v1/models`` until ``model_name`` is listed; return the seconds taken."""
    item = Waitable(url, lambda: serves_model(url, model_name), process)
    return wait_all([item], timeout)


# --- a set of processes ------------------------------------------------------------------


@dataclass
class Engine:
    """A started vLLM instance."""

    spec: EngineSpec
    process: Process

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def name(self) -> str:
        return self.spec.name

    def waitable(self) -> Waitable:
        url, model = self.url, self.spec.served_model_name
        return Waitable(self.name, lambda: serves_model(url, model), self.process)


class Launcher:
    """Owns the processes it starts; ``close()`` (or leaving the ``with``) stops them all."""

    def __init__(self, run_dir: Path | str, python: str | None = None,
                 pythonpath: Sequence[str] = (REPO_ROOT,),
                 base_env: Mapping[str, str] | None = None) -> None:  # fmt: skip
        self.run_dir = Path(run_dir)
        self.python = python or sys.executable
        self.pythonpath = tuple(pythonpath)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.processes: list[Process] = []
        self._lock = threading.Lock()

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_engine(self, spec: EngineSpec) -> Engine:
        argv = render_argv(spec, self.python)
        env = render_env(spec, self.base_env, self.pythonpath)
        return Engine(spec, self.start_command(spec.name, argv, env))

    def start_command(self, name: str, argv: Sequence[str],
                      env: Mapping[str, str] | None = None) -> Process:  # fmt: skip
        if env is None:
            env = dict(self.base_env)
            env["PYTHONPATH"] = ":".join(
                [*self.pythonpath, *filter(None, [self.base_env.get("PYTHONPATH")])]
            )
        proc = Process(name, argv, env, self.run_dir / f"{name}.log")
        with self._lock:
            self.processes.append(proc)
        return proc.start()

    def wait_all_ready(self, engines: Sequence[Engine], timeout: float, **kw) -> float:
        return wait_all([e.waitable() for e in engines], timeout, **kw)

    def stop(self, proc: Process, grace: float = 10.0) -> None:
        proc.stop(grace)
        with self._lock:
            if proc in self.processes:
                self.processes.remove(proc)

    def close(self, grace: float = 10.0) -> None:
        """Stop every process, newest first; SIGTERM all groups first so they exit together."""
        with self._lock:
            procs = list(reversed(self.processes))
            self.processes.clear()
        for p in procs:
            if p.popen is not None:
                _signal_group(p.popen.pid, signal.SIGTERM)
        for p in procs:
            p.stop(grace)

"""launch.local: process groups, readiness polling, early-exit detection, teardown."""

from __future__ import annotations

import os
import signal
import socket
import sys
import textwrap
import time

import pytest

import launch.local as launch_local
from launch.local import (
    Launcher,
    ProcessExited,
    ReadyTimeout,
    Waitable,
    free_ports,
    serves_model,
    wait_all,
    wait_ready,
)

# A fake OpenAI server: lists MODEL on /v1/models after DELAY seconds.
FAKE_SERVER = textwrap.dedent(
    """
    import http.server, json, sys, time
    port, model, delay = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    time.sleep(delay)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": model}]}).encode()
            code = 200 if self.path == "/v1/models" else 404
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    print("serving", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); read its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_free_ports_are_distinct():
    ports = free_ports(20)
    assert len(set(ports)) == 20
    assert all(1024 < p < 65536 for p in ports)


def test_wait_ready_sees_the_expected_model(tmp_path):
    (port,) = free_ports(1)
    with Launcher(tmp_path) as launcher:
        proc = launcher.start_command(
            "fake", [sys.executable, "-c", FAKE_SERVER, str(port), "tiny", "0.5"]
        )
        url = f"http://127.0.0.1:{port}"
        elapsed = wait_ready(url, "tiny", timeout=20, process=proc)
        assert elapsed >= 0.4
        assert serves_model(url, "tiny")
        assert not serves_model(url, "other")
        # A server that lists another model is never "ready".
        with pytest.raises(ReadyTimeout, match="not ready"):
            wait_ready(url, "other", timeout=1, process=proc)
    assert not proc.alive()
    assert "serving" in (tmp_path / "fake.log").read_text()


def test_early_exit_raises_with_log_tail(tmp_path):
    with Launcher(tmp_path) as launcher:
        proc = launcher.start_command(
            "crash", [sys.executable, "-c", "print('boom: no model'); raise SystemExit(3)"]
        )
        t0 = time.monotonic()
        with pytest.raises(ProcessExited, match=r"(?s)status 3.*boom: no model"):
            wait_ready("http://127.0.0.1:9", "tiny", timeout=30, process=proc)
        assert time.monotonic() - t0 < 10


def test_wait_all_reports_progress_and_each_ready_item():
    ready_at = {"a": time.monotonic() + 0.3, "b": time.monotonic() + 0.8}
    items = [Waitable(n, (lambda n=n: time.monotonic() >= ready_at[n])) for n in ("a", "b")]
    seen, ticks = [], []
    wait_all(items, timeout=5, interval=0.05,
             on_ready=lambda i, t: seen.append(i.name), on_tick=lambda t, p: ticks.append(p))  # fmt: skip
    assert seen == ["a", "b"]
    assert ["b"] in ticks and ["a", "b"] in ticks


def test_close_kills_the_whole_process_group(tmp_path):
    # The child starts a grandchild that ignores SIGTERM: teardown must still remove both.
    script = textwrap.dedent(
        """
        import os, signal, subprocess, sys, time
        g = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
        print(g.pid, flush=True)
        time.sleep(600)
        """
    )
    launcher = Launcher(tmp_path)
    proc = launcher.start_command("tree", [sys.executable, "-c", script])
    log = tmp_path / "tree.log"
    for _ in range(100):
        lines = log.read_text().splitlines()
        if len(lines) >= 2:
            break
        time.sleep(0.1)
    grandchild = int(lines[1])
    assert pid_alive(grandchild)
    t0 = time.monotonic()
    launcher.close(grace=1.0)
    assert time.monotonic() - t0 < 10
    assert not proc.alive()
    assert not pid_alive(grandchild)
    assert launcher.processes == []
    launcher.close()  # idempotent


def test_sigterm_is_tried_before_sigkill(tmp_path):
    script = textwrap.dedent(
        """
        import signal, sys, time
        def bye(*a):
            print("got sigterm", flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        print("UP" + "NOW", flush=True)
        time.sleep(600)
        """
    )
    with Launcher(tmp_path) as launcher:
        proc = launcher.start_command("polite", [sys.executable, "-c", script])
        for _ in range(100):
            if "UPNOW" in (tmp_path / "polite.log").read_text():
                break
            time.sleep(0.1)
        launcher.stop(proc, grace=5)
        assert proc.returncode() == 0
        assert "got sigterm" in (tmp_path / "polite.log").read_text()
        assert proc not in launcher.processes


def test_started_process_is_its_own_group_leader(tmp_path):
    with Launcher(tmp_path) as launcher:
        proc = launcher.start_command("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
        assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
        launcher.stop(proc, grace=0.5)
        assert proc.returncode() == -signal.SIGTERM


def test_start_command_puts_repo_on_pythonpath(tmp_path):
    with Launcher(tmp_path, base_env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": "/x"}) as launcher:
        proc = launcher.start_command(
            "env", [sys.executable, "-c", "import os; print(os.environ['PYTHONPATH'])"]
        )
        proc.popen.wait(timeout=20)
    last = (tmp_path / "env.log").read_text().splitlines()[-1].split(":")
    assert last[-1] == "/x"
    assert os.path.isfile(os.path.join(last[0], "launch", "local.py"))


def test_free_ports_lie_below_the_ephemeral_range():
    # A port from the ephemeral range can be taken by any outgoing connection between the check
    # and the server's bind (it once hung a vLLM side channel in CI).
    floor = launch_local._ephemeral_floor()
    ports = free_ports(50)
    assert all(launch_local._PORT_FLOOR <= p < floor for p in ports)
    for p in ports:  # and each one really is free
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_wait_fails_fast_when_the_log_shows_a_bind_failure(tmp_path):
    # A process that stays up but logged a fatal bind error (vLLM's side-channel thread) must not
    # be waited for until the timeout.
    script = (
        "import sys, time\n"
        "print('zmq.error.ZMQError: Address already in use (addr=tcp://127.0.0.1:1)', flush=True)\n"
        "time.sleep(60)\n"
    )
    with Launcher(tmp_path) as launcher:
        proc = launcher.start_command("stuck", [sys.executable, "-c", script])
        # ProcessFailed (not ReadyTimeout) is itself the proof it did not wait the timeout out.
        with pytest.raises(launch_local.ProcessFailed, match="Address already in use"):
            wait_all([Waitable("stuck", lambda: False, proc)], timeout=50, interval=0.1)
        assert proc.alive()  # it was still running: only its log said it would never be ready

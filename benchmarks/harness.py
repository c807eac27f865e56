"""Processes of a router benchmark: fake engines, the router under test, the load generator.

Placement (as in PERFORMANCE_NOTES.md): the router alone on core 0, the fake engines and the
load generator on core 1 (``taskset``; skipped where there is no taskset or only one core).
CPU seconds come from /proc/<pid>/stat (utime + stime of the process and its descendants),
read right before and right after each load run.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from launch.local import free_port  # noqa: F401  (ports outside the ephemeral range)

REPO = Path(__file__).resolve().parents[1]
TICKS = os.sysconf("SC_CLK_TCK")


def pinned(cmd: list[str], core: int | None) -> list[str]:
    if core is None or shutil.which("taskset") is None or core >= (os.cpu_count() or 1):
        return cmd
    return ["taskset", "-c", str(core), *cmd]


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


def runtime_s(pid: int) -> float:
    """Scheduler runtime (s, from ns counters) of every thread of ``pid`` and of its child
    processes: the tokenizer pool's threads too (/proc/<pid>/schedstat alone is the main thread).
    The benchmarks' CPU figure since round 4: exact, where utime + stime are sampled at each tick
    (both are recorded; they agreed within 10% in round 4's runs)."""
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except OSError:
                pass
    return total / 1e9


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and all its live descendants, in seconds (tick-sampled)."""
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
        todo.extend(_children(p))
    return total / TICKS


def raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), e.get("PYTHONPATH")]))
    return e


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def cpu(self) -> float:
        return runtime_s(self.pid)

    def cpu_ticks(self) -> float:
        return cpu_seconds(self.pid)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def start_fakes(ports: list[int], engine_ids: list[str], *, prefill_us_per_char: float,
                itl_ms: float, model: str, model_root: str | None, core: int | None,
                logdir: Path, kv_port: int = 5600) -> Proc:
    """All fake engines in one process (one core); returns once it printed READY."""
    cmd = [sys.executable, "-m", "launch.fake_engine", "--ports", ",".join(map(str, ports)),
           "--engine-id", ",".join(engine_ids), "--prefill-us-per-char", str(prefill_us_per_char),
           "--itl-ms", str(itl_ms), "--model", model, "--kv-port", str(kv_port), "--no-record"]
    if model_root:
        cmd += ["--model-root", model_root]
    log = logdir / "fakes.log"
    popen = subprocess.Popen(pinned(cmd, core), stdout=subprocess.PIPE, stderr=log.open("w"),
                             env=env(), text=True, cwd=REPO)
    line = popen.stdout.readline()
    if not line.startswith("READY"):
        popen.kill()
        raise RuntimeError(f"fake engines did not start: {line!r}\n{log.read_text()}")
    return Proc("fakes", popen, log)


def router_argv(router_cmd: list[str], *, mode: str, threshold: int, prefill: str, decode: str,
                tokenizer: str | None, port: int) -> list[str]:
    argv = [*router_cmd, "serve", "--mode", mode, "--threshold", str(threshold),
            "--prefill", prefill, "--decode", decode, "--port", str(port), "--host", "127.0.0.1"]
    if tokenizer:
        argv += ["--tokenizer", tokenizer]
    return argv


def start_router(argv: list[str], *, core: int | None, logdir: Path, name: str,
                 timeout: float = 90.0) -> Proc:
    """Starts the router and waits until GET /health answers 200 (or it exits: RuntimeError)."""
    port = int(argv[argv.index("--port") + 1])
    log = logdir / f"router-{name}.log"
    popen = subprocess.Popen(pinned(argv, core), stdout=log.open("w"), stderr=subprocess.STDOUT,
                             env=env(), cwd=REPO)
    proc = Proc(f"router-{name}", popen, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"router exited with {popen.returncode}: {' '.join(argv)}\n"
                               f"{proc.tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    proc.stop()
    raise RuntimeError(f"router not healthy after {timeout:.0f} s\n{proc.tail()}")


def run_load(url: str, *, concurrency: int | None, rate: float | None, duration: float,
             warmup: float, prompt_chars: int, max_tokens: int, model: str, core: int | None,
             watch: dict[str, Proc], unique: bool = False) -> dict:
    """One load-generator process against ``url``; adds the CPU seconds each watched process
    spent during the run (``cpu_s``) to the load generator's JSON summary."""
    cmd = [sys.executable, "-m", "benchmarks.loadgen", "--url", url, "--duration", str(duration),
           "--warmup", str(warmup), "--prompt-chars", str(prompt_chars),
           "--max-tokens", str(max_tokens), "--model", model]
    cmd += ["--rate", str(rate)] if rate else ["--concurrency", str(concurrency)]
    if unique:
        cmd.append("--unique-prompts")
    stages0 = router_stages(url) if "router" in watch else None
    steal0 = steal_ticks()
    before = {k: p.cpu() for k, p in watch.items()}
    before_ticks = {k: p.cpu_ticks() for k, p in watch.items()}
    t0 = time.monotonic()
    try:
        out = subprocess.run(pinned(cmd, core), capture_output=True, text=True, env=env(),
                             cwd=REPO, timeout=duration + 120)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"load generator did not finish: {e}") from None
    wall = time.monotonic() - t0
    after = {k: p.cpu() for k, p in watch.items()}
    after_ticks = {k: p.cpu_ticks() for k, p in watch.items()}
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed ({out.returncode}):\n{out.stderr[-2000:]}")
    summary = json.loads(out.stdout)
    summary["cpu_s"] = {k: after[k] - before[k] for k in watch}  # scheduler runtime (runtime_s)
    summary["cpu_ticks_s"] = {k: after_ticks[k] - before_ticks[k] for k in watch}  # utime + stime
    summary["run_wall_s"] = wall
    steal1 = steal_ticks()
    # the hypervisor's share of each core during the run (0 on a quiet host; this VM's host is
    # shared, and a core stolen for milliseconds at a time shows in every latency figure)
    summary["steal_pct"] = {c: 100 * (steal1[c] - steal0.get(c, 0)) / TICKS / wall for c in steal1}
    if stages0 is not None:
        stages1 = router_stages(url)
        summary["router_stages_ms"] = {
            k: 1e3 * (s1 - stages0[k][0]) / (n1 - stages0[k][1])
            for k, (s1, n1) in stages1.items() if k in stages0 and n1 > stages0[k][1]}
    return summary


def steal_ticks() -> dict[str, int]:
    """Steal time per core (clock ticks) from /proc/stat; {} where there is none."""
    out = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("cpu") and line[3].isdigit():
                    fields = line.split()
                    if len(fields) > 8:
                        out[fields[0]] = int(fields[8])
    except OSError:
        pass
    return out


STAGES = {"pd_router_tokenize_seconds": "tokenize", "pd_router_prefill_leg_seconds": "prefill_leg",
          "pd_router_handoff_seconds": "handoff", "pd_router_time_to_first_token_seconds": "ttft"}


def router_stages(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of the router's stage histograms (all label sets together), from its
    /metrics: the run's mean per stage is the difference of two scrapes (warm-up included);
    {} when the router answers /metrics with an HTTP error."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, tuple[float, float]] = {}
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            text = r.read().decode()
    except urllib.error.HTTPError:  # a router with no /metrics here (vllm-router serves it elsewhere)
        return out
    for fam in text_string_to_metric_families(text):
        name = STAGES.get(fam.name)
        if name is None:
            continue
        total = sum(s.value for s in fam.samples if s.name.endswith("_sum"))
        count = sum(s.value for s in fam.samples if s.name.endswith("_count"))
        out[name] = (total, count)
    return out


def prime(url: str, *, model: str, prompt_chars: int, timeout: float = 120.0) -> None:
    """One complete streamed request, so lazy start-up work (tokenizer load, connection
    set-up) is not measured; RuntimeError when it does not succeed."""
    body = json.dumps({"model": model, "prompt": "p" * prompt_chars, "max_tokens": 2,
                       "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        raise RuntimeError(f"priming request to {url} failed: {e!r}") from None
    if "data: [DONE]" not in text:
        raise RuntimeError(f"priming request to {url} gave no [DONE]: {text[:300]!r}")

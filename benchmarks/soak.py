"""Soak test (issue 7): thousands of requests at high concurrency with injected faults and
random client disconnects. Nothing may hang; in-flight gauges must return to zero; the
router's memory must stay flat. Prints one summary table; exits 1 on a violation.

    PYTHONPATH=. python -m benchmarks.soak --requests 4000 --concurrency 128 --fault-rate 0.02

The router runs as a real `pd-router serve` subprocess (pull or push) in front of in-process
fake engines (2 prefill, 2 decode); faults are drawn per request: an error status, a dropped
connection, a hang (bounded by the router's timeouts), a mid-stream crash or garbage.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import aiohttp

from launch.fake_engine import FakeEngine, Fault

FAULTS = {
    "status_500": lambda: Fault(status=500, count=1),
    "status_503": lambda: Fault(status=503, count=1),
    "drop_before_headers": lambda: Fault(drop_before_headers=True, count=1),
    "crash_mid_stream": lambda: Fault(drop_after_chunks=3, count=1),
    "hang": lambda: Fault(hang=True, count=1),
    "garbage": lambda: Fault(garbage=True, count=1),
    "slow_1s": lambda: Fault(delay_s=1.0, count=1),
}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def wait_health(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError("router not healthy")


async def one(session, url, rng, args, stats: Counter, durations: list) -> None:
    stream = rng.random() < 0.7
    long = rng.random() < 0.5
    body = {"model": "tiny", "prompt": ("The quick brown fox. " * (60 if long else 1)) + str(rng.random()),
            "max_tokens": rng.choice((4, 16, 32)), "stream": stream}
    disconnect_after = rng.random() < args.disconnect_rate
    t = time.monotonic()
    try:
        async with asyncio.timeout(args.hang_limit):
            async with session.post(url + "/v1/completions", json=body) as r:
                if disconnect_after:
                    await asyncio.sleep(rng.random() * 0.05)
                    stats["client_disconnect"] += 1
                    r.close()
                    return
                data = await r.read()
                if r.status != 200:
                    stats[f"http_{r.status}"] += 1
                elif stream and (b'"error"' in data or not data.rstrip().endswith(b"data: [DONE]")):
                    stats["sse_error"] += 1 if b'"error"' in data else 0
                    stats["truncated"] += 0 if b'"error"' in data else 1
                else:
                    stats["ok"] += 1
    except TimeoutError:
        stats["HUNG"] += 1
    except aiohttp.ClientError as exc:
        stats[f"client_{type(exc).__name__}"] += 1
    finally:
        durations.append(time.monotonic() - t)


async def main(args) -> int:
    rng = random.Random(args.seed)
    engines = [FakeEngine(role="prefill", engine_id=f"p{i}", kv_port=5600 + i, itl_s=args.itl, record=False)
               for i in range(2)] + [FakeEngine(role="decode", engine_id=f"d{i}", itl_s=args.itl, record=False)
                                    for i in range(2)]
    for e in engines:
        await e.start()
    from launch.tiny_model import ensure_tiny_model
    port = 18765 + rng.randrange(1000)
    argv = [sys.executable, "-m", "router.cli", "serve", "--mode", args.mode, "--threshold", "64",
            "--port", str(port), "--tokenizer", str(ensure_tiny_model()), "--log-level", "warning",
            "--prefill-timeout", "3", "--first-byte-timeout", "3", "--idle-timeout", "3",
            "--push-decode-grace", "3", "--on-prefill-failure", "retry", "--breaker-failures", "50"]
    for e in engines[:2]:
        argv += ["--prefill", f"{e.url}?engine_id={e.engine_id}&kv_host=127.0.0.1&kv_port={e.kv_port}"]
    for e in engines[2:]:
        argv += ["--decode", e.url]
    proc = subprocess.Popen(argv, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_health(url)
        stats: Counter = Counter()
        durations: list = []
        conn = aiohttp.TCPConnector(limit=args.concurrency)
        async with aiohttp.ClientSession(connector=conn) as session:
            # warm-up, then memory baseline
            await asyncio.gather(*(one(session, url, rng, argparse.Namespace(**{**vars(args), "disconnect_rate": 0}),
                                       Counter(), []) for _ in range(200)))
            rss0, fd0 = rss_kib(proc.pid), fds(proc.pid)
            sem = asyncio.Semaphore(args.concurrency)
            faults = Counter()

            async def bounded(i):
                async with sem:
                    if rng.random() < args.fault_rate:
                        name = rng.choice(sorted(FAULTS))
                        rng.choice(engines).fault = FAULTS[name]()
                        faults[name] += 1
                    await one(session, url, rng, args, stats, durations)

            t0 = time.monotonic()
            await asyncio.gather(*(bounded(i) for i in range(args.requests)))
            wall = time.monotonic() - t0
            await asyncio.sleep(1.0)
            async with session.get(url + "/instances") as r:
                insts = await r.json()
            async with session.get(url + "/metrics") as r:
                metrics = await r.text()
        in_flight = [line for line in metrics.splitlines() if line.startswith("pd_router_requests_in_flight ")]
        rss1, fd1 = rss_kib(proc.pid), fds(proc.pid)
        hung = stats["HUNG"]
        leftover = sum(i["in_flight"] for i in insts)
        durations.sort()
        print(f"| requests | concurrency | faults injected | client disconnects | ok | errors reported | hung "
              f"| in-flight after | router RSS start -> end | fds start -> end | wall |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        errors = sum(v for k, v in stats.items() if k not in ("ok", "client_disconnect", "HUNG"))
        print(f"| {args.requests} | {args.concurrency} | {sum(faults.values())} | {stats['client_disconnect']} "
              f"| {stats['ok']} | {errors} | {hung} | {leftover} ({in_flight[0].split()[-1] if in_flight else '?'}) "
              f"| {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MiB | {fd0} -> {fd1} | {wall:.1f} s |")
        print(f"outcomes: {dict(stats)}")
        print(f"faults: {dict(faults)}")
        print(f"longest request: {durations[-1]:.2f} s (hang limit {args.hang_limit} s)")
        bad = hung or leftover or (in_flight and float(in_flight[0].split()[-1]) != 0)
        return 1 if bad else 0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
        for e in engines:
            await e.close()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--fault-rate", type=float, default=0.02)
    p.add_argument("--disconnect-rate", type=float, default=0.02)
    p.add_argument("--mode", choices=("pull", "push"), default="pull")
    p.add_argument("--itl", type=float, default=0.002)
    p.add_argument("--hang-limit", type=float, default=30.0, help="a request taking longer counts as hung")
    p.add_argument("--seed", type=int, default=1)
    sys.exit(asyncio.run(main(p.parse_args())))

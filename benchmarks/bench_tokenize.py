"""Tokenization cost (issue 8): counting a 16k-token prompt must not stall other requests.

Part 1 measures the router's own TokenCounter on cold (never-seen) prompts: p50/p99 of
counting a ~16k-token completion prompt and a chat conversation of the same size, and a
cache hit. Part 2 runs concurrent streams through a real `pd-router serve` (fake engines, 10 ms
inter-token gap) with and without a background sender of fresh 16k-token prompts, and reports
the streams' ITL p99 and TTFT p50 both ways, in one run.

    PYTHONPATH=. python -m benchmarks.bench_tokenize [--tokens 16000] [--streams 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import sysconfig
import time
import uuid
from pathlib import Path

import aiohttp


def corpus(chars: int) -> str:
    src = Path(sysconfig.get_paths()["stdlib"])
    text, files = [], sorted(src.glob("*.py"))
    total = 0
    for f in files:
        t = f.read_text(errors="replace")
        text.append(t)
        total += len(t)
        if total >= chars:
            break
    return "".join(text)[:chars]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def part1(tok_path: str, target_tokens: int, runs: int) -> dict:
    from router.tokenizer import TokenCounter

    tc = TokenCounter(tok_path, threads=2)
    await tc.ensure_loaded()
    base = corpus(target_tokens * 6)
    n = await tc.count("completions", {"prompt": base})
    chars = int(len(base) * target_tokens / n)
    out = {}
    for kind in ("completions", "chat"):
        times = []
        for i in range(runs):
            text = f"# {uuid.uuid4().hex}\n" + base[:chars]
            body = {"prompt": text} if kind == "completions" else {
                "messages": [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": text}]}
            t = time.perf_counter()
            tokens = await tc.count(kind, body)
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        await tc.count(kind, body)  # cache hit
        hit = time.perf_counter() - t
        out[kind] = {"tokens": tokens, "p50_ms": statistics.median(times) * 1e3, "p99_ms": pct(times, 0.99) * 1e3,
                     "cache_hit_ms": hit * 1e3}
    tc.close()
    return out


async def sender(url: str, text: str, rate: float, stop: asyncio.Event, sent: list) -> None:
    async with aiohttp.ClientSession() as s:
        while not stop.is_set():
            body = {"model": "tiny", "prompt": f"# {uuid.uuid4().hex}\n" + text, "max_tokens": 1}
            t = time.perf_counter()
            async with s.post(url + "/v1/completions", json=body) as r:
                await r.read()
                sent.append((r.status, time.perf_counter() - t))
            try:
                await asyncio.wait_for(stop.wait(), 1 / rate)
            except TimeoutError:
                pass


def loadgen(url: str, streams: int, duration: float) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.loadgen", "--url", url, "--concurrency", str(streams),
                          "--duration", str(duration), "--warmup", "1", "--prompt-chars", "1000", "--max-tokens", "64"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


async def part2(tok_path: str, target_tokens: int, streams: int, duration: float, rate: float) -> dict:
    from launch.fake_engine import FakeEngine

    engines = [FakeEngine(itl_s=0.01, record=False, max_model_len=10**6) for _ in range(2)]
    for e in engines:
        await e.start()
    port = 19000 + os.getpid() % 500
    argv = [sys.executable, "-m", "router.cli", "serve", "--threshold", "100000000", "--port", str(port),
            "--tokenizer", tok_path, "--decode", engines[0].url, "--prefill", engines[1].url,
            "--log-level", "warning"]
    proc = subprocess.Popen(argv, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(200):
                try:
                    async with s.get(url + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
        loop = asyncio.get_running_loop()
        quiet = await loop.run_in_executor(None, loadgen, url, streams, duration)
        base = corpus(target_tokens * 6)
        text = base[: target_tokens * 4]  # ~4 chars/token on this tokenizer; the report gives the real count
        stop, sent = asyncio.Event(), []
        task = asyncio.create_task(sender(url, text, rate, stop, sent))
        busy = await loop.run_in_executor(None, loadgen, url, streams, duration)
        stop.set()
        await task
        return {"quiet": quiet, "with_16k": busy, "big_requests": len(sent),
                "big_p50_ms": statistics.median([d for _, d in sent]) * 1e3 if sent else None}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
        for e in engines:
            await e.close()


async def main(a) -> None:
    from launch.tiny_model import ensure_tiny_model

    tok = a.tokenizer or str(ensure_tiny_model())
    p1 = await part1(tok, a.tokens, a.runs)
    p2 = await part2(tok, a.tokens, a.streams, a.duration, a.rate)
    print("| prompt | tokens | count p50 (ms) | count p99 (ms) | cache hit (ms) |")
    print("|---|---|---|---|---|")
    for kind, r in p1.items():
        print(f"| {kind} | {r['tokens']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['cache_hit_ms']:.3f} |")
    q, b = p2["quiet"], p2["with_16k"]
    print()
    print(f"| {a.streams} concurrent streams | TTFT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) | tok/s |")
    print("|---|---|---|---|---|")
    print(f"| alone | {q['ttft_p50_ms']:.1f} | {q['itl_p50_ms']:.2f} | {q['itl_p99_ms']:.2f} | {q['tok_per_s']:.0f} |")
    print(f"| + fresh ~{a.tokens}-token prompts at {a.rate}/s ({p2['big_requests']} sent, p50 {p2['big_p50_ms']:.0f} ms each) "
          f"| {b['ttft_p50_ms']:.1f} | {b['itl_p50_ms']:.2f} | {b['itl_p99_ms']:.2f} | {b['tok_per_s']:.0f} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16000)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--rate", type=float, default=2.0, help="16k-token prompts per second during the busy run")
    p.add_argument("--tokenizer", default=None)
    asyncio.run(main(p.parse_args()))

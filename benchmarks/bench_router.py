"""Router benchmark (issue 8): what the router adds to TTFT, ITL and CPU, per P/D mode.

Setup (PERFORMANCE_NOTES.md): fake engines with configurable prefill and inter-token delays
(default 20 us/char, 10 ms), 1,000-char prompts, 64 streamed output tokens; the router pinned
to core 0, the fakes and the load generator (a separate process) on core 1. For each traffic
kind the router is started fresh, then for every load point (closed loop at each concurrency,
open loop at each rate) the harness runs the load against one engine directly, then through
the router, and reports the differences. Traffic kinds:
- pull:   ``serve --mode pull --threshold 1``: P then D, KV read by D.
- push:   ``serve --mode push --threshold 1``: P and D at once, P named by its URL query.
- direct: ``serve --mode pull --threshold 100000``: every prompt is below the threshold, so
          the router sends it to one engine (direct-route traffic).
- engine: no router; both runs go straight to the engine (an A/A check of the harness noise).
- vllm-router-pull, vllm-router-direct: the same loads through the Rust router the issue
          measures pd-router against (``--peer-cmd``, default ``vllm-router``: ``pip install
          vllm-router``; a benchmark tool only, not a pd-router dependency), started as
          ``--vllm-pd-disaggregation --prefill P --decode D`` (NIXL pull: P with
          ``do_remote_decode``, then D with P's KV params) and as ``--worker-urls D`` (every
          request to the one engine). Both with ``--policy round_robin`` and pinned like
          pd-router; it does not tokenize prompts (pd-router does, for its threshold).

    PYTHONPATH=. python -m benchmarks.bench_router --quick
    PYTHONPATH=. python -m benchmarks.bench_router --modes pull,push,direct \
        --concurrency 1,64,256 --rate 50,200 --out results.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness, report

THRESHOLD = {"pull": 1, "push": 1, "direct": 100_000}
ROUTER_MODE = {"pull": "pull", "push": "push", "direct": "pull"}
PEER_MODES = ("vllm-router-pull", "vllm-router-direct")
P_ENGINE_ID, D_ENGINE_ID, P_KV_PORT = "fake-p0", "fake-d0", 5600


def _csv(value: str, kind: type) -> list:
    return [kind(v) for v in value.split(",") if v.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_router",
                                description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    p.add_argument("--modes", default="pull,push,direct",
                   help="comma-separated from pull, push, direct, engine, vllm-router-pull, "
                        "vllm-router-direct")
    p.add_argument("--concurrency", default="1,64,256", help="closed-loop points ('' for none)")
    p.add_argument("--rate", default="", help="open-loop points, requests/s")
    p.add_argument("--duration", type=float, default=None, help="seconds per run (10; quick 2)")
    p.add_argument("--warmup", type=float, default=None, help="seconds excluded (2; quick 0.5)")
    p.add_argument("--quick", action="store_true", help="short runs for a smoke check")
    p.add_argument("--prompt-chars", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prefill-us-per-char", type=float, default=20.0)
    p.add_argument("--itl-ms", type=float, default=10.0)
    p.add_argument("--model", default="tiny")
    p.add_argument("--unique-prompts", action="store_true",
                   help="a new prompt per request: the router tokenizes every one (no cache hits)")
    p.add_argument("--tokenizer", default=None,
                   help="HF tokenizer dir for the router (default: launch.tiny_model)")
    p.add_argument("--router-cmd", default=f"{shlex.quote(sys.executable)} -m router.cli",
                   help="command that accepts 'serve ...' (e.g. pd-router)")
    p.add_argument("--peer-cmd", default="vllm-router",
                   help="the Rust router's command for the vllm-router-* modes")
    p.add_argument("--router-core", type=int, default=0)
    p.add_argument("--engine-core", type=int, default=1, help="fakes and load generator")
    p.add_argument("--no-pin", action="store_true", help="do not use taskset")
    p.add_argument("--out", type=Path, default=None, help="write all results as JSON")
    p.add_argument("--logdir", type=Path, default=None, help="process logs (default: a tmp dir)")
    a = p.parse_args(argv)
    a.modes = _csv(a.modes, str)
    bad = set(a.modes) - set(report.MODE_LABELS)
    if bad:
        p.error(f"unknown modes {sorted(bad)}")
    a.concurrency, a.rate = _csv(a.concurrency, int), _csv(a.rate, float)
    if not a.concurrency and not a.rate:
        p.error("give at least one --concurrency or --rate point")
    a.duration = a.duration or (2.0 if a.quick else 10.0)
    a.warmup = a.warmup if a.warmup is not None else (0.5 if a.quick else 2.0)
    if a.no_pin:
        a.router_core = a.engine_core = None
    return a


def find_tokenizer(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    try:
        from launch.tiny_model import ensure_tiny_model
    except ImportError:
        return None
    return str(ensure_tiny_model())


def peer_argv(peer_cmd: list[str], *, mode: str, prefill: str, decode: str, port: int) -> list[str]:
    """vllm-router's command line for one of PEER_MODES."""
    argv = [*peer_cmd, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
            "--log-level", "warning", "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(harness.free_port())]
    if mode == "vllm-router-pull":
        return argv + ["--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode]
    return argv + ["--worker-urls", decode]


def run_mode(mode: str, a: argparse.Namespace, fakes: harness.Proc, p_url: str, d_url: str,
             tokenizer: str | None, logdir: Path) -> dict:
    router = None
    watch = {"fakes": fakes}
    target = d_url
    if mode != "engine":
        prefill = p_url
        if mode == "push":
            prefill += (f"?engine_id={P_ENGINE_ID}&kv_host=127.0.0.1&kv_port={P_KV_PORT}"
                        "&tp=1&pp=1")
        port = harness.free_port()
        if mode in PEER_MODES:
            argv = peer_argv(shlex.split(a.peer_cmd), mode=mode, prefill=p_url, decode=d_url,
                             port=port)
        else:
            argv = harness.router_argv(shlex.split(a.router_cmd), mode=ROUTER_MODE[mode],
                                       threshold=THRESHOLD[mode], prefill=prefill, decode=d_url,
                                       tokenizer=tokenizer, port=port)
        try:
            router = harness.start_router(argv, core=a.router_core, logdir=logdir, name=mode)
        except RuntimeError as e:
            return {"error": str(e), "argv": argv}
        watch["router"] = router
        target = f"http://127.0.0.1:{port}"
    points = []
    try:
        harness.prime(d_url, model=a.model, prompt_chars=a.prompt_chars)
        harness.prime(target, model=a.model, prompt_chars=a.prompt_chars)
    except RuntimeError as e:
        if router is not None:
            router.stop()
        return {"error": str(e), "points": points}
    loads = [("closed", c) for c in a.concurrency] + [("open", r) for r in a.rate]
    try:
        for kind, value in loads:
            common = dict(concurrency=value if kind == "closed" else None,
                          rate=value if kind == "open" else None, duration=a.duration,
                          warmup=a.warmup, prompt_chars=a.prompt_chars,
                          max_tokens=a.max_tokens, model=a.model, core=a.engine_core,
                          unique=a.unique_prompts)
            direct = harness.run_load(d_url, watch={"fakes": fakes}, **common)
            routed = harness.run_load(target, watch=watch, **common)
            point = {"kind": kind, "concurrency": common["concurrency"], "rate": common["rate"],
                     "direct": direct, "router": routed}
            points.append(point)
            print(report.details({"modes": {mode: {"points": [point]}}}), file=sys.stderr,
                  flush=True)
            if router is not None and not router.alive():
                raise RuntimeError(f"router died during the run\n{router.tail()}")
    except RuntimeError as e:
        return {"error": str(e), "points": points}
    finally:
        if router is not None:
            router.stop()
    return {"points": points}


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    harness.raise_nofile()
    logdir = a.logdir or Path(tempfile.mkdtemp(prefix="bench-router-"))
    logdir.mkdir(parents=True, exist_ok=True)
    tokenizer = None
    if any(m not in ("engine", *PEER_MODES) for m in a.modes):
        tokenizer = find_tokenizer(a.tokenizer)
        if tokenizer is None:
            print("warning: no --tokenizer and launch.tiny_model is not available; "
                  "starting the router without one", file=sys.stderr)
    p_port, d_port = harness.free_port(), harness.free_port()
    fakes = harness.start_fakes([p_port, d_port], [P_ENGINE_ID, D_ENGINE_ID],
                                prefill_us_per_char=a.prefill_us_per_char, itl_ms=a.itl_ms,
                                model=a.model, model_root=tokenizer, core=a.engine_core,
                                logdir=logdir, kv_port=P_KV_PORT)
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    results = {"config": {
        "modes": a.modes, "concurrency": a.concurrency, "rates": a.rate, "duration_s": a.duration,
        "warmup_s": a.warmup, "prompt_chars": a.prompt_chars, "max_tokens": a.max_tokens,
        "prefill_us_per_char": a.prefill_us_per_char, "itl_ms": a.itl_ms,
        "router_core": a.router_core, "engine_core": a.engine_core, "router_cmd": a.router_cmd,
        "peer_cmd": a.peer_cmd if any(m in PEER_MODES for m in a.modes) else None,
        "tokenizer": tokenizer, "unique_prompts": a.unique_prompts, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }, "modes": {}}
    try:
        for mode in a.modes:
            results["modes"][mode] = run_mode(mode, a, fakes, p_url, d_url, tokenizer, logdir)
    finally:
        fakes.stop()
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))
    print(report.table(results))
    print(f"\n{a.prompt_chars}-char prompts, {a.max_tokens} streamed tokens, "
          f"{a.prefill_us_per_char:g} us/char prefill, {a.itl_ms:g} ms ITL, {a.duration:g} s per "
          f"run ({a.warmup:g} s warm-up); each router run paired with a direct run; router CPU = "
          f"scheduler runtime of all its threads (schedstat) per request; logs in "
          f"{logdir}")
    return 1 if any(m.get("error") for m in results["modes"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())

"""A/B of two router builds on the bench_router load, interleaved (for shared, noisy hosts).

Both routers run at once (same fakes, same flags, both pinned to the router core); at every
load point the runs go direct, A, B, B, A, direct (ABBA against drift; ABCCBA with a third build), so each build's
numbers come from the same minutes. Router CPU is the scheduler runtime of all its threads
(/proc/<pid>/task/*/schedstat, ns; not tick-sampled).

    python -m benchmarks.ab_router --a "python /tmp/base/run_router.py" --b "python -m router.cli" \
        --mode direct --concurrency 1,64,256 --duration 4
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.bench_router import P_ENGINE_ID, D_ENGINE_ID, P_KV_PORT, ROUTER_MODE, THRESHOLD, find_tokenizer


runtime_s = harness.runtime_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ab_router", description=__doc__.split("\n")[0])
    p.add_argument("--a", required=True, help="router command A (accepts 'serve ...')")
    p.add_argument("--b", required=True, action="append", help="router command B (repeat: C, D, ...)")
    p.add_argument("--mode", default="direct", choices=sorted(THRESHOLD))
    p.add_argument("--concurrency", default="1,64,256")
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=1, help="ABBA blocks per point")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--router-core", type=int, default=0)
    p.add_argument("--engine-core", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--unique-prompts", action="store_true", help="a new prompt per request (no tokenizer cache hits)")
    a = p.parse_args(argv)
    harness.raise_nofile()
    logdir = Path(tempfile.mkdtemp(prefix="ab-router-"))
    tok = find_tokenizer(a.tokenizer)
    pp, dp = harness.free_port(), harness.free_port()
    fakes = harness.start_fakes([pp, dp], [P_ENGINE_ID, D_ENGINE_ID], prefill_us_per_char=20.0, itl_ms=10.0,
                                model="tiny", model_root=tok, core=a.engine_core, logdir=logdir, kv_port=P_KV_PORT)
    p_url, d_url = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
    prefill = p_url + (f"?engine_id={P_ENGINE_ID}&kv_host=127.0.0.1&kv_port={P_KV_PORT}&tp=1&pp=1"
                       if a.mode == "push" else "")
    routers, urls = {}, {}
    results: dict = {"config": vars(a) | {"out": str(a.out), "b": a.b, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
                     "points": []}
    try:
        builds = dict(zip("ABCDEF", [a.a, *a.b]))
        for name, cmd in builds.items():
            port = harness.free_port()
            argv_ = harness.router_argv(shlex.split(cmd), mode=ROUTER_MODE[a.mode], threshold=THRESHOLD[a.mode],
                                        prefill=prefill, decode=d_url, tokenizer=tok, port=port)
            routers[name] = harness.start_router(argv_, core=a.router_core, logdir=logdir, name=name)
            urls[name] = f"http://127.0.0.1:{port}"
            harness.prime(urls[name], model="tiny", prompt_chars=1000)
        harness.prime(d_url, model="tiny", prompt_chars=1000)
        for c in [int(x) for x in a.concurrency.split(",") if x]:
            runs: dict = {"direct": [], **{k: [] for k in builds}}
            common = dict(concurrency=c, rate=None, duration=a.duration, warmup=a.warmup, prompt_chars=1000,
                          max_tokens=64, model="tiny", core=a.engine_core, unique=a.unique_prompts)
            names = list(builds)
            order = ["direct"] + (names + names[::-1]) * a.repeat + ["direct"]
            for who in order:
                url = d_url if who == "direct" else urls[who]
                r0 = runtime_s(routers[who].pid) if who != "direct" else 0.0
                s = harness.run_load(url, watch={"fakes": fakes}, **common)
                if who != "direct":
                    s["router_cpu_s"] = runtime_s(routers[who].pid) - r0
                with open("/proc/loadavg") as f:
                    s["loadavg"] = float(f.read().split()[0])
                runs[who].append(s)
            results["points"].append({"concurrency": c, "runs": runs})
            print(_line(c, runs), file=sys.stderr, flush=True)
    finally:
        for r in routers.values():
            r.stop()
        fakes.stop()
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))
    print(table(results))
    return 0


def _agg(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _cpu(runs: list[dict]) -> float:
    return 1000 * sum(r["router_cpu_s"] for r in runs) / max(1, sum(r["requests_total"] for r in runs))


def _steal(runs: list[dict]) -> str:
    """Mean over the runs of the most stolen core's steal share (harness.run_load)."""
    worst = [max(r["steal_pct"].values()) for r in runs if r.get("steal_pct")]
    return f"{statistics.mean(worst):.0f}" if worst else "n/a"


def _line(c: int, runs: dict) -> str:
    d = _agg(runs["direct"], "ttft_p50_ms")
    return " | ".join([f"c={c}"] + [f"{k}: TTFT p50 {_agg(runs[k], 'ttft_p50_ms') - d:+.1f} ms, "
                                     f"CPU {_cpu(runs[k]):.2f} ms/req" for k in runs if k != "direct"])


def table(results: dict) -> str:
    head = ("| c | build | added TTFT p50 ms | added TTFT p99 ms | added ITL p99 ms | tok/s (direct) | "
            "router CPU ms/req | errors | load avg | steal % |")
    out = [head, "|" + "---|" * 10]
    for pt in results["points"]:
        runs = pt["runs"]
        d50, d99 = _agg(runs["direct"], "ttft_p50_ms"), _agg(runs["direct"], "ttft_p99_ms")
        ditl, dtok = _agg(runs["direct"], "itl_p99_ms"), _agg(runs["direct"], "tok_per_s")
        for k in [k for k in runs if k != "direct"]:
            rs = runs[k]
            out.append(f"| {pt['concurrency']} | {k} | {_agg(rs, 'ttft_p50_ms') - d50:+.1f} | "
                       f"{_agg(rs, 'ttft_p99_ms') - d99:+.1f} | {_agg(rs, 'itl_p99_ms') - ditl:+.1f} | "
                       f"{_agg(rs, 'tok_per_s'):.0f} ({dtok:.0f}) | {_cpu(rs):.2f} | "
                       f"{sum(r['errors'] for r in rs)} | {statistics.mean(r['loadavg'] for r in rs):.1f} | "
                       f"{_steal(rs)} |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())

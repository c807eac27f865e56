"""Goodput on two GPUs (issue 10): two monolithic replicas vs one prefill + one decode instance.

Setups, each behind its own `pd-router serve`, on the same model and the same load:
  mono2  two plain vLLM replicas, one per GPU, through the router's direct route (threshold
         above every prompt, `--policy least_loaded`)
  pull   P on the first GPU, D on the second, NixlConnector (D reads the KV), `--mode pull`
  push   P on the first GPU, D on the second, NixlPushConnector (P writes the KV), `--mode push`

All six engines start at once, three per GPU, each with an explicit KV cache size (concurrent
start-ups then skip memory profiling); the engines of the setups not being measured stay idle.
Every engine sees both GPUs, its own first (`CUDA_VISIBLE_DEVICES=1,0` on the second GPU): vLLM
runs on device 0 of its list, and UCX can still open the peer GPU's memory (cuda_ipc).
`--gpus 0,0` pins every engine to one device: the same logic on one GPU.

Load: open loop, Poisson arrivals at each `--rates` value for `--duration` s (the same schedule
and prompt lengths for every setup: seeded by rate), prompts of `--prompt-min`..`--prompt-max`
tokens with unique prefixes (no prefix-cache sharing), `--max-tokens` streamed output tokens
(`ignore_eos`). A request is *good* when it completes with TTFT <= `--slo-ttft` and TPOT <=
`--slo-itl`, TPOT being its mean inter-token time ((last token - first token) / (tokens - 1));
attainment = good / sent (errors and requests unfinished `--drain` s after the last arrival are
misses). A setup's sweep stops at the first rate whose attainment is below `--stop-below`.
Per setup: the highest swept rate at >= 90% attainment, the rate where attainment crosses 90%
(linear between the two rates around it), and its ratio to mono2's.

The state file (`--state`) keeps every measured point: a later device call with the engines
still up (`--keep-engines` in the first; running engines are adopted) measures only the points
not yet there. Each call rewrites results.json, results.md and goodput.png in `--out`.

    python -m benchmarks.gpu_goodput --model /tmp/model --gpus 0,1 --rates 4,8,12,16,24 \
        --setups mono2,push --keep-engines --budget 480
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
import uuid

import aiohttp

from benchmarks.gpu_bench import (Engine, Prompts, complete, compare, delta, log, nixl_summary, pct, scrape,
                                  source_tokens, start_engine, stop_all, stop_proc, tail, wait_ready)
from benchmarks.loadgen import LoadGen, Result
from benchmarks.vllm_loadgen import UsageCountingConn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUPS = ("mono2", "pull", "push")
GiB = 2 ** 30


# ------------------------------------------------------------------------------------------
# placement
# ------------------------------------------------------------------------------------------
def visible_devices(own: str, other: str) -> str:
    """CUDA_VISIBLE_DEVICES for an engine on GPU `own`: its GPU first, the peer's after it."""
    return own if own == other else f"{own},{other}"


def make_engines(gpus: tuple[str, str], a) -> dict[str, list[Engine]]:
    """mono2: a replica per GPU; pull and push: P on the first GPU, D on the second."""
    g0, g1 = gpus
    on0 = {"CUDA_VISIBLE_DEVICES": visible_devices(g0, g1)}
    on1 = {"CUDA_VISIBLE_DEVICES": visible_devices(g1, g0)}
    b = a.base_port
    mono, pre, dec = int(a.kv_mono_gib * GiB), int(a.kv_prefill_gib * GiB), int(a.kv_decode_gib * GiB)
    return {
        "mono2": [Engine("mono-a", b, "mono", None, env=dict(on0), kv_bytes=mono),
                  Engine("mono-b", b + 1, "mono", None, env=dict(on1), kv_bytes=mono)],
        "pull": [Engine("pull-p", b + 100, "prefill", "NixlConnector", 5600, "prefill-0", dict(on0), pre),
                 Engine("pull-d", b + 200, "decode", "NixlConnector", 5700, "decode-0", dict(on1), dec)],
        "push": [Engine("push-p", b + 300, "prefill", "NixlPushConnector", 5800, "prefill-push-0", dict(on0), pre),
                 Engine("push-d", b + 400, "decode", "NixlPushConnector", 5900, "decode-push-0", dict(on1), dec)],
    }


def router_argv(setup: str, engines: list[Engine], port: int, a) -> list[str]:
    cmd = [sys.executable, "-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--tokenizer", a.tokenizer or a.model, "--log-level", "warning", "--policy", "least_loaded"]
    if setup == "mono2":
        cmd += ["--mode", "pull", "--threshold", str(10 ** 9)]
        for e in engines:
            cmd += ["--decode", e.url]
        return cmd
    p, d = engines
    cmd += ["--mode", setup, "--threshold", str(a.threshold), "--decode", d.url]
    if setup == "push":
        cmd += ["--prefill", f"{p.url}?engine_id={p.engine_id}&kv_host=127.0.0.1&kv_port={p.side_port}&tp=1&pp=1"]
    else:
        cmd += ["--prefill", p.url]
    return cmd


# ------------------------------------------------------------------------------------------
# goodput
# ------------------------------------------------------------------------------------------
def judge(r: Result, slo_ttft: float, slo_itl: float) -> tuple[bool, float | None, float | None]:
    """(good, TTFT s, TPOT s) of one request; a failed request is not good."""
    if r.error is not None or r.t_first is None:
        return False, None, None
    ttft = r.t_first - r.t_start
    tpot = sum(r.gaps) / (r.tokens - 1) if r.tokens > 1 else 0.0
    return ttft <= slo_ttft and tpot <= slo_itl, ttft, tpot


def point_summary(results: list[Result], rate: float, duration: float, slo_ttft: float, slo_itl: float,
                  wall: float) -> dict:
    judged = [judge(r, slo_ttft, slo_itl) for r in results]
    good = sum(1 for g, _, _ in judged if g)
    ttft = [t for _, t, _ in judged if t is not None]
    tpot = [p for _, _, p in judged if p is not None]
    gaps = [g for r in results if r.error is None for g in r.gaps]
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[r.error[:80]] = errors.get(r.error[:80], 0) + 1
    ms = (lambda x: None if x is None else round(1000 * x, 2))
    return {
        "rate": rate, "duration_s": duration, "sent": len(results), "ok": len(ttft), "good": good,
        "attainment": round(good / len(results), 4) if results else None,
        "ttft_ok": sum(1 for t in ttft if t <= slo_ttft), "tpot_ok": sum(1 for p in tpot if p <= slo_itl),
        "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p90_ms": ms(pct(ttft, 90)), "ttft_p99_ms": ms(pct(ttft, 99)),
        "tpot_p50_ms": ms(pct(tpot, 50)), "tpot_p90_ms": ms(pct(tpot, 90)), "tpot_p99_ms": ms(pct(tpot, 99)),
        "itl_p50_ms": ms(pct(gaps, 50)), "itl_p99_ms": ms(pct(gaps, 99)),
        "out_tok_per_s": round(sum(r.tokens for r in results if r.error is None) / wall, 1) if wall else None,
        "wall_s": round(wall, 2), "errors": sum(errors.values()), "error_kinds": errors,
        # [TTFT ms, TPOT ms] per request (None: failed), so any other SLO can be judged later
        "per_request": [None if t is None else [round(1000 * t, 2), round(1000 * p, 3)] for _, t, p in judged],
    }


def rejudge(point: dict, slo_ttft: float, slo_itl: float) -> dict | None:
    """The point under other SLOs (from its per-request numbers; None if it has none)."""
    per = point.get("per_request")
    if per is None:
        return None
    good = sum(1 for x in per if x is not None and x[0] <= 1000 * slo_ttft and x[1] <= 1000 * slo_itl)
    return {"rate": point["rate"], "good": good, "sent": len(per),
            "attainment": round(good / len(per), 4) if per else None}


def max_rate(points: list[dict], target: float = 0.9) -> dict:
    """Highest swept rate at >= target attainment (every lower rate too), and the rate where
    attainment crosses the target (linear between the two swept rates around it)."""
    pts = sorted((p["rate"], p["attainment"]) for p in points if p.get("attainment") is not None)
    best, crossing, bound = None, None, "none measured"
    for i, (r, att) in enumerate(pts):
        if att >= target:
            best, bound = r, "at least (no swept rate fell below)"
            continue
        if best is None:
            bound = "below the lowest rate swept"
        else:
            r0, a0 = pts[i - 1]
            crossing = round(r0 + (r - r0) * (a0 - target) / (a0 - att), 2)
            bound = "crossing"
        break
    return {"max_swept": best, "crossing": crossing if crossing is not None else best, "bound": bound}


def schedule(rate: float, duration: float, seed: int, lo: int, hi: int) -> list[tuple[float, int]]:
    """Arrival times and prompt lengths: the same for every setup at a given rate."""
    rng = random.Random(f"{seed}-{rate:g}-{duration:g}")
    out, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append((t, rng.randint(lo, hi)))


# ------------------------------------------------------------------------------------------
# one load point
# ------------------------------------------------------------------------------------------
async def run_point(url: str, a, prompts: Prompts, rate: float, duration: float, drain: float, tag: str) -> dict:
    lg = LoadGen(url, prompt_chars=8, max_tokens=a.max_tokens, model=a.served_name, n_bodies=1)
    lg.conn_class = UsageCountingConn  # token count from the usage chunk (vLLM may merge tokens)
    plan = schedule(rate, duration, a.seed, a.prompt_min, a.prompt_max)
    reqs = [lg.frame({"model": a.served_name, "prompt": prompts.make(n, f"{tag}-{uuid.uuid4().hex[:12]}"),
                      "max_tokens": a.max_tokens, "stream": True, "stream_options": {"include_usage": True},
                      "ignore_eos": True, "temperature": 0}) for _, n in plan]
    log(f"  {tag}: {rate:g} req/s x {duration:g} s = {len(plan)} requests")
    t0 = time.perf_counter()
    end = t0 + duration + drain  # a request still running then is a miss (its connection is closed)
    tasks = []
    for (t, _), req in zip(plan, reqs):
        d = t0 + t - time.perf_counter()
        if d > 0:
            await asyncio.sleep(d)
        tasks.append(asyncio.ensure_future(lg.one(t0 + t, req=req, timeout=max(1.0, end - (t0 + t)))))
    results = list(await asyncio.gather(*tasks))
    wall = max([r.t_end for r in results if r.t_end] + [time.perf_counter()]) - t0
    lg.close()
    s = point_summary(results, rate, duration, a.slo_ttft, a.slo_itl, wall)
    log(f"  -> attainment {s['attainment']} ({s['good']}/{s['sent']}; TTFT ok {s['ttft_ok']}, TPOT ok "
        f"{s['tpot_ok']}); TTFT p50/p99 {s['ttft_p50_ms']}/{s['ttft_p99_ms']} ms; TPOT p50/p99 "
        f"{s['tpot_p50_ms']}/{s['tpot_p99_ms']} ms; {s['out_tok_per_s']} tok/s; errors {s['error_kinds']}")
    return s


async def settle(session: aiohttp.ClientSession, urls: list[str], limit: float) -> None:
    """Wait (up to `limit` s) until the engines run and queue nothing: each point starts empty."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        busy = 0.0
        for u in urls:
            try:
                async with session.get(u + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    text = await r.text()
            except Exception:  # noqa: BLE001 - a fake or dead engine: nothing to wait for
                return
            for line in text.splitlines():
                if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
                    try:
                        busy += float(line.rsplit(" ", 1)[1])
                    except ValueError:
                        pass
        if busy == 0:
            return
        await asyncio.sleep(0.5)


# ------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------
def summarize_setups(state: dict, slo_itl: float | None = None) -> dict:
    """Per setup: `max_rate` under the run's SLOs, or under TPOT <= `slo_itl` (per-request data)."""
    out = {}
    for name, S in state["setups"].items():
        pts = list(S.get("points", {}).values())
        if slo_itl is not None:
            pts = [q for q in (rejudge(p, state["args"]["slo_ttft"], slo_itl) for p in pts) if q is not None]
        out[name] = max_rate(pts)
    base = (out.get("mono2") or {}).get("crossing")
    for name, m in out.items():
        m["ratio_to_mono2"] = round(m["crossing"] / base, 2) if base and m.get("crossing") else None
    return out


def write_report(state: dict, outdir: str) -> None:
    os.makedirs(outdir, exist_ok=True)
    state["summary"] = summarize_setups(state)
    extra = [float(x) for x in str(state["args"].get("also_itl") or "").split(",") if x]
    state["summary_also"] = {f"{x:g}": summarize_setups(state, x) for x in extra}
    with open(os.path.join(outdir, "results.json"), "w") as fh:
        json.dump(state, fh, indent=1, default=str)
    a = state["args"]
    rates = sorted({p["rate"] for S in state["setups"].values() for p in S.get("points", {}).values()})
    names = [n for n in SETUPS if n in state["setups"]]
    lines = ["# pd-router goodput: two monolithic replicas vs 1P1D", "",
             f"GPUs: {state.get('gpu', '?')} (placement {a['gpus']}); model: {state.get('model_desc', '?')}; "
             f"prompts {a['prompt_min']}-{a['prompt_max']} tokens, {a['max_tokens']} output tokens; SLO TTFT <= "
             f"{a['slo_ttft']:g} s and TPOT <= {1000 * a['slo_itl']:g} ms; {a['duration']:g} s of Poisson arrivals "
             f"per rate, drain {a['drain']:g} s.", "",
             "SLO attainment (good / sent) per request rate:", "",
             "| rate req/s | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for r in rates:
        row = []
        for n in names:
            p = state["setups"][n].get("points", {}).get(f"{r:g}")
            row.append("-" if p is None or p["attainment"] is None
                       else f"{100 * p['attainment']:.0f}% ({p['good']}/{p['sent']})")
        lines.append(f"| {r:g} | " + " | ".join(row) + " |")
    lines += ["", "| setup | rate req/s | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | ITL p99 ms | "
              "out tok/s | errors |", "|---|---|---|---|---|---|---|"]
    for n in names:
        for key in sorted(state["setups"][n].get("points", {}), key=float):
            p = state["setups"][n]["points"][key]
            lines.append(f"| {n} | {p['rate']:g} | {p['ttft_p50_ms']} / {p['ttft_p90_ms']} / {p['ttft_p99_ms']} | "
                         f"{p['tpot_p50_ms']} / {p['tpot_p90_ms']} / {p['tpot_p99_ms']} | {p['itl_p99_ms']} | "
                         f"{p['out_tok_per_s']} | {p['errors']} {p['error_kinds'] or ''} |")
    lines += ["", "| setup | highest swept rate >= 90% | 90% crossing (req/s) | vs mono2 | correctness | "
              "decode prompt tokens by source (correctness) | KV transfer (sweep) | notes |",
              "|---|---|---|---|---|---|---|---|"]
    for n in names:
        S, m = state["setups"][n], state["summary"][n]
        c = S.get("correctness") or {}
        kv = S.get("nixl_sweep") or {}
        lines.append(f"| {n} | {m['max_swept']} | {m['crossing']} ({m['bound']}) | {m['ratio_to_mono2']} | "
                     f"{c.get('matched', '-')}/{c.get('total', '-')} | {S.get('decode_sources_correctness', '-')} | "
                     f"{kv.get('gb_per_s', '-')} GB/s, {kv.get('transfers', '-')} transfers | "
                     f"{'; '.join(S.get('skipped', [])) or '-'} |")
    for x in extra:  # the same requests judged under a tighter TPOT SLO
        lines += ["", f"Under TPOT <= {1000 * x:g} ms (TTFT <= {a['slo_ttft']:g} s), the same requests:", "",
                  "| rate req/s | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
        for r in rates:
            row = []
            for n in names:
                p = state["setups"][n].get("points", {}).get(f"{r:g}")
                q = rejudge(p, a["slo_ttft"], x) if p else None
                row.append("-" if q is None or q["attainment"] is None
                           else f"{100 * q['attainment']:.0f}% ({q['good']}/{q['sent']})")
            lines.append(f"| {r:g} | " + " | ".join(row) + " |")
        m = state["summary_also"][f"{x:g}"]
        lines += ["", "| setup | highest swept rate >= 90% | 90% crossing (req/s) | vs mono2 |", "|---|---|---|---|"]
        lines += [f"| {n} | {m[n]['max_swept']} | {m[n]['crossing']} ({m[n]['bound']}) | {m[n]['ratio_to_mono2']} |"
                  for n in names]
    lines += ["", "Engine start-up (s): " + json.dumps(state.get("engine_ready_s", {}))]
    with open(os.path.join(outdir, "results.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


def plot(state: dict, path: str) -> bool:
    """SLO attainment vs request rate, one line per setup (needs matplotlib)."""
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        log("matplotlib missing: no plot")
        return False
    a = state["args"]
    slos = [a["slo_itl"]] + [float(x) for x in str(a.get("also_itl") or "").split(",") if x]
    fig, axes = plt.subplots(1, len(slos), figsize=(7 * len(slos), 4.2), dpi=120, squeeze=False)
    labels = {"mono2": "2 replicas (direct route)", "pull": "1P1D pull (NixlConnector)",
              "push": "1P1D push (NixlPushConnector)"}
    for ax, slo in zip(axes[0], slos):
        for n in SETUPS:
            pts = list(state["setups"].get(n, {}).get("points", {}).values())
            if slo != a["slo_itl"]:
                pts = [q for q in (rejudge(p, a["slo_ttft"], slo) for p in pts) if q is not None]
            pts = sorted((p["rate"], p["attainment"]) for p in pts if p["attainment"] is not None)
            if pts:
                ax.plot([r for r, _ in pts], [100 * x for _, x in pts], marker="o", label=labels[n])
        ax.axhline(90, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(-3, 103)
        ax.set_title(f"{state.get('model_desc', '')}\n{a['prompt_min']}-{a['prompt_max']} prompt tok, "
                     f"{a['max_tokens']} out; TTFT<={a['slo_ttft']:g}s, TPOT<={1000 * slo:g}ms", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# ------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/goodput-out"))
    ap.add_argument("--state", default="/tmp/goodput-state.json", help="measured points, kept across calls")
    ap.add_argument("--logdir", default="/tmp/goodput-logs")
    ap.add_argument("--model", default="/tmp/model")
    ap.add_argument("--tokenizer", default=None, help="the router's tokenizer (default: --model)")
    ap.add_argument("--served-name", default="tiny")
    ap.add_argument("--gpus", default="0,1", help="FIRST,SECOND: P and replica a on FIRST, D and replica b "
                                                 "on SECOND (0,0: everything on one GPU)")
    ap.add_argument("--setups", default="mono2,push,pull")
    ap.add_argument("--rates", default="4,8,12,16,24")
    ap.add_argument("--duration", type=float, default=15)
    ap.add_argument("--drain", type=float, default=15, help="s after the last arrival before a request is a miss")
    ap.add_argument("--prompt-min", type=int, default=1800)
    ap.add_argument("--prompt-max", type=int, default=2200)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--slo-ttft", type=float, default=1.0, help="s")
    ap.add_argument("--slo-itl", type=float, default=0.05, help="s, mean inter-token time (TPOT)")
    ap.add_argument("--also-itl", default="", help="more TPOT SLOs (s, comma-separated) to judge the same "
                                                   "requests under, in the report and the plot")
    ap.add_argument("--stop-below", type=float, default=0.5, help="stop a setup's sweep below this attainment")
    ap.add_argument("--threshold", type=int, default=1024, help="pull/push router threshold (tokens)")
    ap.add_argument("--check-prompts", type=int, default=2, help="greedy correctness prompts per setup")
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--corpus-chars", type=int, default=600_000, help="text the prompts are cut from")
    ap.add_argument("--base-port", type=int, default=8000)
    ap.add_argument("--gpu-util", type=float, default=0.34)
    ap.add_argument("--kv-mono-gib", type=float, default=24)
    ap.add_argument("--kv-prefill-gib", type=float, default=12)
    ap.add_argument("--kv-decode-gib", type=float, default=24)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--engine-args", default="")
    ap.add_argument("--engine-env", default="")
    ap.add_argument("--start-timeout", type=float, default=400)
    ap.add_argument("--budget", type=float, default=480, help="seconds for this call, engines' start included")
    ap.add_argument("--keep-engines", action="store_true", help="leave the engines running (a later call adopts them)")
    ap.add_argument("--fresh", action="store_true", help="ignore the state file")
    ap.add_argument("--report-only", action="store_true", help="only rewrite the report and plot from --state")
    return ap.parse_args(argv)


# a point measured under other values of these is not comparable: the state starts over
WORKLOAD = ("model", "gpus", "prompt_min", "prompt_max", "max_tokens", "slo_ttft", "slo_itl", "duration", "drain",
            "seed", "threshold")


def load_state(a) -> dict:
    state = None
    if not a.fresh and os.path.exists(a.state):
        with open(a.state) as fh:
            state = json.load(fh)
        old = {k: state.get("args", {}).get(k) for k in WORKLOAD}
        new = {k: getattr(a, k) for k in WORKLOAD}
        if old != new:
            log(f"state {a.state} was measured with {old}, not {new}: starting over")
            state = None
    if state is None:
        state = {"setups": {}, "engine_ready_s": {}}
    state["args"] = dict(vars(a))
    return state


def save_state(state: dict, a) -> None:
    tmp = a.state + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(state, fh, default=str)
    os.replace(tmp, a.state)
    write_report(state, a.out)


async def amain(a) -> int:
    t_start = time.monotonic()
    deadline = t_start + a.budget
    os.makedirs(a.logdir, exist_ok=True)
    gpus = tuple(x.strip() for x in a.gpus.split(","))
    if len(gpus) != 2:
        raise SystemExit("--gpus takes two device ids, e.g. 0,1 or 0,0")
    setups = [s for s in a.setups.split(",") if s]
    for s in setups:
        if s not in SETUPS:
            raise SystemExit(f"unknown setup {s!r}; known: {', '.join(SETUPS)}")
    rates = sorted(float(r) for r in a.rates.split(",") if r)
    state = load_state(a)
    try:
        state["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                      capture_output=True, text=True, timeout=10).stdout.strip().replace("\n", "; ")
    except Exception:  # noqa: BLE001
        state["gpu"] = "?"
    try:
        with open(os.path.join(a.model, "config.json")) as fh:
            cfg = json.load(fh)
        state["model_desc"] = (f"{cfg.get('model_type')} {cfg.get('num_hidden_layers')}x{cfg.get('hidden_size')}, "
                               f"heads {cfg.get('num_attention_heads')}/{cfg.get('num_key_value_heads')}, "
                               f"bf16 random weights")
    except (OSError, ValueError):
        state["model_desc"] = a.model
    all_engines = make_engines(gpus, a)
    # every engine starts now (the other setups' too: a later call finds them up), unless it runs already
    started: list[Engine] = []
    routers: list[subprocess.Popen] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        try:
            want = [e for s in SETUPS for e in all_engines[s]]
            up = await asyncio.gather(*(wait_ready(session, e.url, None, time.monotonic() + 2) for e in want))
            for e, is_up in zip(want, up):
                if is_up:
                    log(f"{e.name}: already running on :{e.port} (adopted)")
                else:
                    start_engine(e, a)
                    started.append(e)
            prompts = Prompts(a.tokenizer or a.model, a.seed, a.corpus_chars)

            async def ready(e: Engine) -> None:
                t = time.monotonic()
                ok = await wait_ready(session, e.url, e.proc, min(deadline - 30, t + a.start_timeout))
                e.died = not ok
                if e.proc is not None:
                    state["engine_ready_s"][e.name] = round(time.monotonic() - t, 1) if ok else None
                log(f"{e.name}: {'ready' if ok else 'NOT READY'} after {time.monotonic() - t:.0f}s")
            await asyncio.gather(*(ready(e) for s in setups for e in all_engines[s]))
            ref_engine = all_engines["mono2"][0]
            for si, setup in enumerate(setups):
                await measure_setup(session, state, a, setup, all_engines[setup], ref_engine, prompts, rates,
                                    deadline, a.base_port + 900 + si, routers)
        finally:
            for r in routers:
                stop_proc(r, 3)
            if not a.keep_engines:
                stop_all([e.proc for e in started])
            for e in started:
                state.setdefault("engine_log_tails", {})[e.name] = tail(e.log_path, 12)
            save_state(state, a)
            plot(state, os.path.join(a.out, "goodput.png"))
    return 0


async def measure_setup(session, state, a, setup, eng, ref_engine, prompts, rates, deadline, rport, routers) -> None:
    S = state["setups"].setdefault(setup, {})
    S.setdefault("points", {})
    S["skipped"] = []
    todo = [r for r in rates if f"{r:g}" not in S["points"]]
    below = [p for p in S["points"].values() if p["attainment"] is not None and p["attainment"] < a.stop_below]
    if below:
        todo = [r for r in todo if r < min(p["rate"] for p in below)]
    if not todo and S.get("correctness"):
        log(f"{setup}: every rate already measured")
        return
    if any(e.died for e in eng):
        S["skipped"].append("engine did not start")
        S["engine_log_tails"] = {e.name: tail(e.log_path, 30) for e in eng if e.died}
        save_state(state, a)
        return
    if deadline - time.monotonic() < 60:
        S["skipped"].append("no time left in this call")
        save_state(state, a)
        return
    cmd = router_argv(setup, eng, rport, a)
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    rlog = os.path.join(a.logdir, f"router-{setup}.log")
    with open(rlog, "w") as fh:
        rproc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    routers.append(rproc)
    log(f"router {setup}: {' '.join(cmd[1:])}")
    rurl = f"http://127.0.0.1:{rport}"
    if not await wait_ready(session, rurl, rproc, time.monotonic() + 60, path="/health"):
        S["skipped"].append("router did not become healthy")
        S["router_log_tail"] = tail(rlog, 40)
        save_state(state, a)
        return
    dec, pre = eng[-1], (eng[0] if setup != "mono2" else None)
    if not S.get("correctness"):  # greedy answers vs replica a's own; also the first KV handshake
        m0, p0 = await scrape(session, dec.url), (await scrape(session, pre.url) if pre else {})
        per = []
        for i in range(a.check_prompts):
            pr = prompts.make(a.prompt_max, f"check-{setup}-{i}")
            ref = await complete(session, ref_engine.url, a.served_name, pr, a.check_tokens)
            got = await complete(session, rurl, a.served_name, pr, a.check_tokens)
            per.append(compare(ref, got))
        m1, p1 = await scrape(session, dec.url), (await scrape(session, pre.url) if pre else {})
        S["correctness"] = {"matched": sum(1 for c in per if c.get("equal")), "total": len(per), "per_prompt": per,
                            "against": f"direct greedy request to {ref_engine.name}"}
        S["decode_sources_correctness"] = source_tokens(delta(m0, m1))
        S["prefill_sources_correctness"] = source_tokens(delta(p0, p1))
        log(f"{setup}: correctness {S['correctness']['matched']}/{len(per)}; decode prompt tokens by source "
            f"{S['decode_sources_correctness']}")
        save_state(state, a)
    urls = [e.url for e in eng]
    m2, p2 = await scrape(session, dec.url), (await scrape(session, pre.url) if pre else {})
    for rate in todo:
        need = a.duration + a.drain + 10
        if deadline - time.monotonic() < need:
            S["skipped"].append(f"rate {rate:g}: no time left in this call")
            continue
        await settle(session, urls, 20)
        p = await run_point(rurl, a, prompts, rate, a.duration, a.drain, f"{setup}-r{rate:g}")
        S["points"][f"{rate:g}"] = p
        save_state(state, a)
        if p["attainment"] is not None and p["attainment"] < a.stop_below:
            S["skipped"] += [f"rate {r:g}: not run (rate {rate:g} already below {a.stop_below:g})"
                             for r in todo if r > rate]
            break
    m3, p3 = await scrape(session, dec.url), (await scrape(session, pre.url) if pre else {})
    S["nixl_sweep"] = nixl_summary(delta(m2, m3), delta(p2, p3))
    S["decode_sources_sweep"] = source_tokens(delta(m2, m3))
    S["router_log_tail"] = tail(rlog, 10)
    log(f"{setup}: decode prompt tokens by source over the sweep {S['decode_sources_sweep']}; KV {S['nixl_sweep']}")
    stop_proc(rproc, 5)
    save_state(state, a)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.report_only:
        with open(a.state) as fh:
            state = json.load(fh)
        write_report(state, a.out)
        plot(state, os.path.join(a.out, "goodput.png"))
        return 0
    try:
        import uvloop  # noqa: PLC0415
        return uvloop.run(amain(a))
    except ImportError:
        return asyncio.run(amain(a))


if __name__ == "__main__":
    sys.exit(main())

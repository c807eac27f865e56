"""Turns paired (direct, router) runs into the benchmark's one markdown table.

Every number is a difference or a ratio between a router run and the direct-to-engine run made
right before it with the same load, so slow or busy machines shift both sides alike.
"""

from __future__ import annotations

ITL_SLACK_MS = 2.0
MODE_LABELS = {
    "pull": "pull (NIXL READ)",
    "push": "push (NIXL WRITE)",
    "direct": "direct-route (below threshold)",
    "engine": "engine only (harness check)",
    "vllm-router-pull": "vllm-router (Rust) pull",
    "vllm-router-direct": "vllm-router (Rust) direct",
}


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def derive(point: dict) -> dict:
    """Differences and ratios of one paired point."""
    d, r = point["direct"], point["router"]
    router_cpu = r.get("cpu_s", {}).get("router")
    ticks = r.get("cpu_ticks_s", {}).get("router")
    return {
        "added_ttft_p50_ms": _sub(r["ttft_p50_ms"], d["ttft_p50_ms"]),
        "added_ttft_p99_ms": _sub(r["ttft_p99_ms"], d["ttft_p99_ms"]),
        "ttft_p50_ratio": (r["ttft_p50_ms"] / d["ttft_p50_ms"]
                           if r["ttft_p50_ms"] and d["ttft_p50_ms"] else None),
        "added_itl_p99_ms": _sub(r["itl_p99_ms"], d["itl_p99_ms"]),
        "added_e2e_p50_ms": _sub(r["e2e_p50_ms"], d["e2e_p50_ms"]),
        "tok_per_s_ratio": r["tok_per_s"] / d["tok_per_s"] if d["tok_per_s"] else None,
        "router_cpu_ms_per_req": (router_cpu * 1000 / r["requests_total"]
                                  if router_cpu is not None and r["requests_total"] else None),
        "router_cpu_util": router_cpu / r["run_wall_s"] if router_cpu is not None else None,
        "router_cpu_ticks_ms_per_req": (ticks * 1000 / r["requests_total"]
                                        if ticks is not None and r["requests_total"] else None),
    }


def _ms(v: float | None, signed: bool = True) -> str:
    if v is None:
        return "n/a"
    return f"{v:+.1f}" if signed else f"{v:.1f}"


def _point(points: list[dict], kind: str, value: float) -> dict | None:
    key = "concurrency" if kind == "closed" else "rate"
    return next((p for p in points if p["kind"] == kind and p[key] == value), None)


def best_throughput(points: list[dict]) -> str:
    """Highest router tok/s among closed-loop points whose p99 ITL stays within
    ITL_SLACK_MS of the paired direct run."""
    best = None
    for p in points:
        if p["kind"] != "closed":
            continue
        added = derive(p)["added_itl_p99_ms"]
        if added is not None and added <= ITL_SLACK_MS and p["router"]["errors"] == 0:
            if best is None or p["router"]["tok_per_s"] > best["router"]["tok_per_s"]:
                best = p
    if best is None:
        return "none within +2 ms"
    return (f"{best['router']['tok_per_s']:.0f} (c={best['concurrency']}; "
            f"direct {best['direct']['tok_per_s']:.0f})")


def table(results: dict) -> str:
    cfg = results["config"]
    concs, rates = cfg["concurrency"], cfg["rates"]
    top = max(concs) if concs else None
    head = ["traffic"]
    head += [f"added TTFT p50 c={c} (ms)" for c in concs]
    if top is not None:
        head.append(f"added TTFT p99 c={top} (ms)")
    head += [f"added TTFT p50 {r:g} req/s (ms)" for r in rates]
    head += ["router CPU ms/req (" + "/".join(f"c={c}" for c in concs) + ")",
             f"streamed tok/s, p99 ITL <= direct+{ITL_SLACK_MS:g} ms", "errors router/direct"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for mode, m in results["modes"].items():
        label = MODE_LABELS.get(mode, mode)
        if m.get("error"):
            msg = m["error"].strip().splitlines()[0][:120].replace("|", "/")
            lines.append(f"| {label} | " + " | ".join([f"not run: {msg}"] + [""] * (len(head) - 2))
                         + " |")
            continue
        pts = m["points"]
        row = [label]
        for c in concs:
            p = _point(pts, "closed", c)
            row.append(_ms(derive(p)["added_ttft_p50_ms"]) if p else "n/a")
        if top is not None:
            p = _point(pts, "closed", top)
            row.append(_ms(derive(p)["added_ttft_p99_ms"]) if p else "n/a")
        for r in rates:
            p = _point(pts, "open", r)
            row.append(_ms(derive(p)["added_ttft_p50_ms"]) if p else "n/a")
        cpu = []
        for c in concs:
            p = _point(pts, "closed", c)
            v = derive(p)["router_cpu_ms_per_req"] if p else None
            cpu.append("n/a" if v is None else f"{v:.2f}")
        row.append(" / ".join(cpu))
        row.append(best_throughput(pts))
        row.append(f"{sum(p['router']['errors'] for p in pts)}/"
                   f"{sum(p['direct']['errors'] for p in pts)}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def details(results: dict) -> str:
    """One line per paired point: the raw numbers behind the table."""
    out = []
    for mode, m in results["modes"].items():
        for p in m.get("points", []):
            d, r, x = p["direct"], p["router"], derive(p)
            load = f"c={p['concurrency']}" if p["kind"] == "closed" else f"{p['rate']:g} req/s"
            out.append(
                f"{mode:6} {load:>10}: TTFT p50 {_ms(d['ttft_p50_ms'], False)} -> "
                f"{_ms(r['ttft_p50_ms'], False)} ms, p99 {_ms(d['ttft_p99_ms'], False)} -> "
                f"{_ms(r['ttft_p99_ms'], False)}; ITL p99 {_ms(d['itl_p99_ms'], False)} -> "
                f"{_ms(r['itl_p99_ms'], False)}; e2e p50 {_ms(d['e2e_p50_ms'], False)} -> "
                f"{_ms(r['e2e_p50_ms'], False)}; tok/s {d['tok_per_s']:.0f} -> "
                f"{r['tok_per_s']:.0f}; router CPU {_ms(x['router_cpu_ms_per_req'], False)} "
                f"ms/req ({_pct(x['router_cpu_util'])} of a core; utime+stime "
                f"{_ms(x['router_cpu_ticks_ms_per_req'], False)}); fakes "
                f"{_pct(r['cpu_s'].get('fakes', 0) / r['run_wall_s'])}, loadgen "
                f"{_pct(r['loadgen_cpu_s'] / r['run_wall_s'])}; errors {r['errors']}/{d['errors']}"
                + _steal(d, r) + _stages(r.get("router_stages_ms")))
    return "\n".join(out)


def _steal(*runs: dict) -> str:
    """The most the hypervisor took from any core during the pair's runs: a number above a
    few % means that point's latencies measure the host, not the router."""
    worst = max((v for r in runs for v in (r.get("steal_pct") or {}).values()), default=None)
    return "" if worst is None else f"; steal {worst:.0f}%"


def _stages(stages: dict | None) -> str:
    """The router's own stage means (its /metrics), where the added TTFT goes."""
    if not stages:
        return ""
    return "; router means " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()) + " ms"


def _pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"

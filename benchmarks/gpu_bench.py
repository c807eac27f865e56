"""GPU benchmark of pd-router in front of real vLLM instances sharing one GPU (issue 11).

Setups, each behind its own `pd-router serve`:
  mono  one plain vLLM instance; router threshold above every prompt (direct route)
  pull  prefill + decode instances with NixlConnector (KV read by D), `--mode pull`
  push  prefill + decode instances with NixlPushConnector (KV written by P), `--mode push`

Per setup: a greedy correctness check (router output vs the monolithic instance's output,
token for token, first differing index), the decode instance's
`vllm:prompt_tokens_by_source_total` deltas, then an open-loop streaming load (Poisson arrivals,
mixed long/short prompts of controlled token length) at several request rates, recording TTFT,
ITL, throughput and errors, plus the engines' `vllm:nixl_*` metric deltas (bytes / transfer
time -> GB/s).

All engines are started at once (5 processes on one GPU, each with an explicit
--kv-cache-memory-bytes so that concurrent start-ups do not disturb each other's memory
profiling); idle engines of the other setups stay up while one setup is measured.

The run is time-boxed (--budget seconds): phases that would not fit are skipped and reported as
such, and results.json / results.md are rewritten after every phase, so a run cut short still
leaves its partial results.

    python -m benchmarks.gpu_bench --out $OUT --budget 540 [--setups mono,pull,push] [--rates 2,4,8]
    python -m benchmarks.gpu_bench --no-engines --mono-url ... (engines already running; testing)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field

import aiohttp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------------------------------
# engines and routers
# ------------------------------------------------------------------------------------------
@dataclass
class Engine:
    name: str
    port: int
    role: str                 # mono | prefill | decode
    connector: str | None     # NixlConnector | NixlPushConnector | None
    side_port: int | None = None
    engine_id: str | None = None
    env: dict = field(default_factory=dict)
    kv_bytes: int | None = None  # KV cache size (None: --kv-bytes)
    proc: subprocess.Popen | None = None
    log_path: str = ""
    ready_s: float | None = None
    died: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


ENGINES = {
    "mono": [Engine("mono", 8000, "mono", None)],
    "pull": [Engine("pull-p", 8100, "prefill", "NixlConnector", 5600, "prefill-0"),
             Engine("pull-d", 8200, "decode", "NixlConnector", 5700, "decode-0")],
    "push": [Engine("push-p", 8300, "prefill", "NixlPushConnector", 5800, "prefill-push-0"),
             Engine("push-d", 8400, "decode", "NixlPushConnector", 5900, "decode-push-0")],
}


def engine_cmd(e: Engine, a) -> tuple[list[str], dict]:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", a.model,
           "--served-model-name", a.served_name, "--host", "127.0.0.1", "--port", str(e.port),
           "--gpu-memory-utilization", str(a.gpu_util), "--kv-cache-memory-bytes", str(e.kv_bytes or a.kv_bytes),
           "--max-model-len", str(a.max_model_len), "--dtype", "bfloat16"]
    cmd += a.engine_args.split() if a.engine_args else []
    env = dict(os.environ)
    env.update(parse_env(a.engine_env))
    env.update(e.env)
    env["VLLM_CACHE_ROOT"] = f"/tmp/vllm-cache-{e.name}"   # no concurrent writes to one compile cache
    if e.connector:
        kv = {"kv_connector": e.connector, "kv_role": "kv_producer" if e.role == "prefill" else "kv_consumer",
              "kv_buffer_device": "cuda", "engine_id": e.engine_id,
              "kv_connector_extra_config": {"backends": ["UCX"]}}
        cmd += ["--kv-transfer-config", json.dumps(kv)]
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(e.side_port)
    return cmd, env


def parse_env(spec: str | None) -> dict:
    out = {}
    for item in (spec or "").split(";"):
        if "=" in item:
            k, v = item.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def add_variants(a) -> None:
    """--variant NAME=K=V;K=V : one more pull pair with extra environment (e.g. UCX settings)."""
    for i, spec in enumerate(a.variant or []):
        name, _, envspec = spec.partition("=")
        env = parse_env(envspec)
        ENGINES[name] = [Engine(f"{name}-p", 8500 + 20 * i, "prefill", "NixlConnector", 6000 + 20 * i, f"{name}-prefill-0", env),
                         Engine(f"{name}-d", 8510 + 20 * i, "decode", "NixlConnector", 6010 + 20 * i, f"{name}-decode-0", env)]


def start_engine(e: Engine, a) -> None:
    cmd, env = engine_cmd(e, a)
    e.log_path = os.path.join(a.logdir, f"{e.name}.log")
    fh = open(e.log_path, "w")
    e.proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    log(f"started {e.name} pid {e.proc.pid} port {e.port}")


def stop_proc(p: subprocess.Popen | None, grace: float = 10.0) -> None:
    if p is None or p.poll() is not None:
        return
    try:
        os.killpg(p.pid, signal.SIGTERM)
    except OSError:
        p.terminate()
    try:
        p.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            p.kill()


def stop_all(procs: list, grace: float = 10.0) -> None:
    procs = [p for p in procs if p is not None and p.poll() is None]
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except OSError:
            pass
    t = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.1, t - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass


async def wait_ready(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen | None,
                     deadline: float, path: str = "/v1/models") -> bool:
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            async with session.get(url + path, timeout=aiohttp.ClientTimeout(total=3)) as r:
                if r.status == 200:
                    return True
        except Exception:
            pass
        await asyncio.sleep(1.0)
    return False


def tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-n:])
    except OSError as exc:
        return f"<{exc}>"


def start_router(setup: str, engines: list[Engine], a, port: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "router.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--tokenizer", a.model, "--log-level", "warning"]
    if setup == "mono":
        cmd += ["--mode", "pull", "--threshold", str(10 ** 9), "--decode", engines[0].url]
    else:
        p, d = engines
        cmd += ["--mode", "push" if setup == "push" else "pull", "--threshold", str(a.threshold), "--decode", d.url]
        if setup == "push":
            cmd += ["--prefill", f"{p.url}?engine_id={p.engine_id}&kv_host=127.0.0.1&kv_port={p.side_port}&tp=1&pp=1"]
        else:
            cmd += ["--prefill", p.url]
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    path = os.path.join(a.logdir, f"router-{setup}.log")
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=open(path, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    log(f"router {setup}: {' '.join(cmd[1:])}")
    return proc, path


# ------------------------------------------------------------------------------------------
# prompts
# ------------------------------------------------------------------------------------------
class Prompts:
    """Prompts of a chosen token length, cut from a tokenized corpus (stdlib sources)."""

    def __init__(self, model: str, seed: int, max_chars: int | None = None):
        from transformers import AutoTokenizer  # noqa: PLC0415
        import sysconfig  # noqa: PLC0415
        self.tok = AutoTokenizer.from_pretrained(model)
        std = sysconfig.get_paths()["stdlib"]
        text = []
        for f in ("argparse.py", "typing.py", "inspect.py", "subprocess.py", "dataclasses.py", "pathlib/__init__.py",
                  "pathlib.py", "tarfile.py", "zipfile/__init__.py", "zipfile.py"):
            try:
                with open(os.path.join(std, f), errors="ignore") as fh:
                    text.append(fh.read())
            except OSError:
                pass
        if not text:
            text = [" ".join(f"word{i % 997} value{i % 61}" for i in range(200000))]
        self.ids = self.tok("\n".join(text)[:max_chars], add_special_tokens=False)["input_ids"]
        self.rng = random.Random(seed)
        log(f"prompt corpus: {len(self.ids)} tokens")

    def make(self, n_tokens: int, tag: str) -> str:
        n = max(4, n_tokens - 8)
        while len(self.ids) < n + 1:
            self.ids = self.ids + self.ids
        off = self.rng.randrange(0, len(self.ids) - n)
        return f"[{tag}]\n" + self.tok.decode(self.ids[off:off + n])

    def count(self, text: str) -> int:
        return len(self.tok(text)["input_ids"])


# ------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------
KEEP_METRICS = ("vllm:prompt_tokens_by_source", "vllm:nixl_", "vllm:num_preemptions", "vllm:prefix_cache_")
_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9eE.+\-]+|NaN|\+Inf|-Inf)")


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    try:
        async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
            text = await r.text()
    except Exception as exc:
        return {"__error__": str(exc)}  # type: ignore[dict-item]
    for line in text.splitlines():
        if not line or line[0] == "#" or "_bucket" in line or "_created" in line:
            continue
        if not line.startswith(KEEP_METRICS):
            continue
        m = _LINE.match(line)
        if m:
            labels = re.sub(r'(engine|model_name)="[^"]*",?', "", m.group(2) or "").replace(",}", "}")
            key = m.group(1) + ("" if labels in ("{}", "") else labels)
            try:
                out[key] = out.get(key, 0.0) + float(m.group(3))
            except ValueError:
                pass
    return out


def delta(before: dict, after: dict) -> dict[str, float]:
    d = {}
    for k, v in after.items():
        if isinstance(v, (int, float)):
            dv = v - before.get(k, 0.0)
            if dv:
                d[k] = round(dv, 6)
    return d


def source_tokens(d: dict[str, float]) -> dict[str, float]:
    out = {}
    for k, v in d.items():
        if k.startswith("vllm:prompt_tokens_by_source_total"):
            m = re.search(r'source="([^"]+)"', k)
            out[m.group(1) if m else k] = v
    return out


def nixl_summary(*deltas: dict[str, float]) -> dict:
    b = t = n = 0.0
    fails = 0.0
    for d in deltas:
        for k, v in d.items():
            if k.startswith("vllm:nixl_bytes_transferred_sum"):
                b += v
            elif k.startswith("vllm:nixl_xfer_time_seconds_sum"):
                t += v
            elif k.startswith("vllm:nixl_xfer_time_seconds_count"):
                n += v
            elif k.startswith("vllm:nixl_num_failed"):
                fails += v
    return {"bytes": b, "xfer_time_s": round(t, 6), "transfers": n, "failed": fails,
            "gb_per_s": round(b / t / 1e9, 3) if t > 0 else None,
            "mean_mb_per_transfer": round(b / n / 1e6, 3) if n else None,
            "mean_xfer_ms": round(1000 * t / n, 3) if n else None}


# ------------------------------------------------------------------------------------------
# correctness
# ------------------------------------------------------------------------------------------
async def complete(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    t = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=180)) as r:
        raw = await r.read()
        status = r.status
    try:
        j = json.loads(raw)
    except ValueError:
        return {"error": f"HTTP {status}: {raw[:300]!r}"}
    if status != 200 or "choices" not in j:
        return {"error": f"HTTP {status}: {json.dumps(j)[:300]}"}
    c = j["choices"][0]
    return {"text": c.get("text", ""), "token_ids": c.get("token_ids"),
            "prompt_tokens": (j.get("usage") or {}).get("prompt_tokens"), "s": round(time.perf_counter() - t, 4)}


def compare(ref: dict, got: dict) -> dict:
    if got.get("error") or ref.get("error"):
        return {"equal": False, "error": got.get("error") or ref.get("error")}
    if ref.get("token_ids") is not None and got.get("token_ids") is not None:
        a, b = ref["token_ids"], got["token_ids"]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        return {"equal": a == b, "by": "token_ids", "first_diff": first,
                "same_prefix_tokens": first if first is not None else len(a)}
    a, b = ref.get("text", ""), got.get("text", "")
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    return {"equal": a == b, "by": "text", "first_diff_char": first}


# ------------------------------------------------------------------------------------------
# load
# ------------------------------------------------------------------------------------------
@dataclass
class Rec:
    long: bool
    prompt_tokens: int
    t_send: float = 0.0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    end: float | None = None
    error: str | None = None


async def one_stream(session, url, model, prompt, max_tokens, rec: Rec, timeout: float) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    rec.t_send = time.perf_counter()
    last = None
    try:
        async with session.post(url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.read())[:200]!r}"
                return
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    for line in ev.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            continue
                        try:
                            j = json.loads(data)
                        except ValueError:
                            continue
                        if "error" in j:
                            rec.error = str(j["error"])[:200]
                            continue
                        ch = j.get("choices") or []
                        if not ch or not ch[0].get("text"):
                            continue
                        now = time.perf_counter()
                        if last is None:
                            rec.ttft = now - rec.t_send
                        else:
                            rec.itls.append(now - last)
                        last = now
                        rec.tokens += 1
        rec.end = time.perf_counter()
        if rec.error is None and rec.tokens == 0:
            rec.error = "no tokens"
    except asyncio.TimeoutError:
        rec.error = "timeout"
    except asyncio.CancelledError:
        rec.error = "cancelled (drain limit)"
        raise
    except Exception as exc:  # noqa: BLE001
        rec.error = f"{type(exc).__name__}: {exc}"[:200]


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(recs: list[Rec], wall: float) -> dict:
    ok = [r for r in recs if r.error is None]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [x for r in ok for x in r.itls]
    out_tok = sum(r.tokens for r in ok)
    in_tok = sum(r.prompt_tokens for r in ok)

    def ms(x):
        return None if x is None else round(1000 * x, 2)
    s = {"requests": len(recs), "ok": len(ok), "errors": len(recs) - len(ok),
         "error_samples": sorted({r.error for r in recs if r.error})[:5],
         "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p99_ms": ms(pct(ttft, 99)),
         "itl_p50_ms": ms(pct(itl, 50)), "itl_p99_ms": ms(pct(itl, 99)),
         "wall_s": round(wall, 2), "output_tok_per_s": round(out_tok / wall, 1) if wall else None,
         "prompt_tok_per_s": round(in_tok / wall, 1) if wall else None,
         "req_per_s_done": round(len(ok) / wall, 3) if wall else None}
    for kind, sel in (("long", True), ("short", False)):
        t = [r.ttft for r in ok if r.long == sel and r.ttft is not None]
        s[f"ttft_{kind}_p50_ms"] = ms(pct(t, 50))
        s[f"ttft_{kind}_p99_ms"] = ms(pct(t, 99))
    return s


async def run_load(session, url, a, prompts: Prompts, rate: float, duration: float, drain: float, tag: str) -> dict:
    # same arrival times and prompt lengths for every setup at a given rate (a str seed is stable
    # across processes, unlike hash())
    rng = random.Random(f"{a.seed}-{rate:g}-{duration:g}")
    plan = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            break
        long = rng.random() < a.long_fraction
        n = rng.randint(a.long_min, a.long_max) if long else rng.randint(a.short_min, a.short_max)
        plan.append((t, long, n))
    items = [(t0, Rec(long, n), prompts.make(n, f"{tag}-{uuid.uuid4().hex[:12]}")) for t0, long, n in plan]
    log(f"  load {tag}: rate {rate}/s x {duration:.0f}s = {len(items)} requests "
        f"({sum(1 for _, r, _ in items if r.long)} long)")
    start = time.perf_counter()
    tasks = []
    for t0, rec, prompt in items:
        d = start + t0 - time.perf_counter()
        if d > 0:
            await asyncio.sleep(d)
        tasks.append(asyncio.create_task(one_stream(session, url, a.served_name, prompt, a.max_tokens, rec,
                                                    timeout=duration + drain + 60)))
    if tasks:
        done, pending = await asyncio.wait(tasks, timeout=max(1.0, drain))
        for p in pending:
            p.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    wall = max([r.end for _, r, _ in items if r.end] + [time.perf_counter()]) - start
    s = summarize([r for _, r, _ in items], wall)
    s.update(rate=rate, duration_s=duration)
    log(f"  -> ok {s['ok']}/{s['requests']} TTFT p50/p99 {s['ttft_p50_ms']}/{s['ttft_p99_ms']} ms, "
        f"ITL p50/p99 {s['itl_p50_ms']}/{s['itl_p99_ms']} ms, {s['output_tok_per_s']} out tok/s")
    return s


# ------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------
def write_report(res: dict, outdir: str) -> None:
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "results.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    lines = ["# pd-router GPU benchmark", "",
             f"GPU: {res.get('gpu', '?')}; model: {res.get('model_desc', '?')}; threshold {res['args'].get('threshold')} "
             f"tokens; prompts: {int(100 * res['args']['long_fraction'])}% long "
             f"{res['args']['long_min']}-{res['args']['long_max']} tok, rest {res['args']['short_min']}-"
             f"{res['args']['short_max']} tok; {res['args']['max_tokens']} output tokens (ignore_eos).", "",
             "| setup | rate req/s | ok/sent | TTFT p50 ms | TTFT p99 ms | TTFT long p50 | TTFT short p50 | ITL p50 ms | ITL p99 ms | out tok/s | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in res["setups"].items():
        for L in s.get("load", []):
            lines.append(f"| {name} | {L['rate']} | {L['ok']}/{L['requests']} | {L['ttft_p50_ms']} | {L['ttft_p99_ms']} | "
                         f"{L['ttft_long_p50_ms']} | {L['ttft_short_p50_ms']} | {L['itl_p50_ms']} | {L['itl_p99_ms']} | "
                         f"{L['output_tok_per_s']} | {L['errors']} |")
    lines += ["", "| setup | correctness match | first diff indices | decode prompt tokens (correctness) | "
              "decode prompt tokens (load) | KV GB/s (load) | transfers | skipped |", "|---|---|---|---|---|---|---|---|"]
    for name, s in res["setups"].items():
        c = s.get("correctness", {})
        lines.append(f"| {name} | {c.get('matched', '-')}/{c.get('total', '-')} | {c.get('first_diffs', '-')} | "
                     f"{s.get('decode_sources_correctness', '-')} | {s.get('decode_sources_load', '-')} | "
                     f"{(s.get('nixl_load') or {}).get('gb_per_s', '-')} | {(s.get('nixl_load') or {}).get('transfers', '-')} | "
                     f"{'; '.join(s.get('skipped', [])) or '-'} |")
    if res.get("copy_ceiling"):
        lines += ["", f"Device-to-device copy ceiling: {res['copy_ceiling']}"]
    lines += ["", "Engine start-up (s): " + json.dumps(res.get("engine_ready_s", {})),
              "", "Notes: " + "; ".join(res.get("notes", []))]
    with open(os.path.join(outdir, "results.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


# ------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpubench-out"))
    ap.add_argument("--logdir", default="/tmp/gpubench-logs")
    ap.add_argument("--model", default="/tmp/model")
    ap.add_argument("--served-name", default="tiny")
    ap.add_argument("--budget", type=float, default=540, help="seconds for the whole run, engines' start included")
    ap.add_argument("--setups", default="mono,pull,push")
    ap.add_argument("--rates", default="2,4,8")
    ap.add_argument("--duration", type=float, default=30)
    ap.add_argument("--drain", type=float, default=20, help="max seconds to wait for in-flight requests after a load")
    ap.add_argument("--min-duration", type=float, default=10, help="shorten loads down to this before skipping")
    ap.add_argument("--threshold", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--long-fraction", type=float, default=0.5)
    ap.add_argument("--long-min", type=int, default=2000)
    ap.add_argument("--long-max", type=int, default=8000)
    ap.add_argument("--short-min", type=int, default=64)
    ap.add_argument("--short-max", type=int, default=600)
    ap.add_argument("--check-lengths", default="300,1100,2000,3500,5000,7500",
                    help="token lengths of the correctness prompts")
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--gpu-util", type=float, default=0.12)
    ap.add_argument("--kv-bytes", type=int, default=10 * 2 ** 30)
    ap.add_argument("--max-model-len", type=int, default=10240)
    ap.add_argument("--engine-args", default="", help="extra `vllm serve` arguments for every engine")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--reference", default=None, help="reference outputs (results.json of an earlier mono run)")
    ap.add_argument("--engine-env", default="", help="K=V;K=V added to every engine's environment")
    ap.add_argument("--variant", action="append", help="NAME=K=V;K=V: an extra pull pair with this environment")
    ap.add_argument("--no-engines", action="store_true", help="engines already run on the default ports (testing)")
    ap.add_argument("--copy-ceiling", default=None, help="JSON file with the copy ceiling measured earlier")
    return ap.parse_args(argv)


async def amain(a) -> int:
    deadline = T0 + a.budget
    os.makedirs(a.logdir, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    setups = [s for s in a.setups.split(",") if s]
    rates = [float(r) for r in a.rates.split(",") if r]
    res: dict = {"args": vars(a), "setups": {}, "notes": [], "engine_ready_s": {}}
    try:
        res["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                     "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        res["gpu"] = "?"
    try:
        cfg = json.load(open(os.path.join(a.model, "config.json")))
        res["model_desc"] = (f"{cfg.get('model_type')} {cfg.get('num_hidden_layers')}x{cfg.get('hidden_size')} "
                             f"heads {cfg.get('num_attention_heads')}/{cfg.get('num_key_value_heads')} bf16 random weights")
    except Exception:
        res["model_desc"] = a.model
    if a.copy_ceiling and os.path.exists(a.copy_ceiling):
        res["copy_ceiling"] = json.load(open(a.copy_ceiling))
    add_variants(a)
    engines = {s: ENGINES[s] for s in setups}
    if not a.no_engines:
        for s in setups:
            for e in engines[s]:
                start_engine(e, a)
    prompts = Prompts(a.model, a.seed)
    check_prompts = [prompts.make(n, f"check-{i}") for i, n in enumerate(int(x) for x in a.check_lengths.split(","))]
    reference = None
    if a.reference and os.path.exists(a.reference):
        reference = json.load(open(a.reference)).get("reference")
        check_prompts = [r["prompt"] for r in reference]
        res["notes"].append(f"reference outputs loaded from {a.reference}")
    routers: list[subprocess.Popen] = []
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    try:
        async with aiohttp.ClientSession(connector=conn) as session:
            # engines ready?
            async def ready(e: Engine):
                t = time.monotonic()
                ok = await wait_ready(session, e.url, e.proc, min(deadline - 30, time.monotonic() + a.start_timeout))
                e.ready_s = round(time.monotonic() - t, 1) if ok else None
                e.died = not ok
                log(f"{e.name}: {'ready after %.0fs' % (time.monotonic() - t) if ok else 'NOT READY'}")
                res["engine_ready_s"][e.name] = e.ready_s
            await asyncio.gather(*(ready(e) for s in setups for e in engines[s]))
            write_report(res, a.out)
            for si, setup in enumerate(setups):
                S: dict = {"skipped": []}
                res["setups"][setup] = S
                eng = engines[setup]
                if any(e.died for e in eng):
                    S["skipped"].append("engine did not start")
                    S["engine_log_tails"] = {e.name: tail(e.log_path, 30) for e in eng if e.died}
                    write_report(res, a.out)
                    continue
                if deadline - time.monotonic() < 40:
                    S["skipped"].append("no time left")
                    write_report(res, a.out)
                    continue
                rport = 9000 + si
                rproc, rlog = start_router(setup, eng, a, rport)
                routers.append(rproc)
                rurl = f"http://127.0.0.1:{rport}"
                if not await wait_ready(session, rurl, rproc, time.monotonic() + 60, path="/health"):
                    S["skipped"].append("router did not become healthy")
                    S["router_log_tail"] = tail(rlog, 40)
                    write_report(res, a.out)
                    stop_proc(rproc)
                    continue
                dec = eng[-1]
                pre = eng[0] if len(eng) == 2 else None
                # ---- correctness
                m0 = await scrape(session, dec.url)
                p0 = await scrape(session, pre.url) if pre else {}
                results = []
                for i, pr in enumerate(check_prompts):
                    if setup == "mono" and reference is None:
                        ref = await complete(session, dec.url, a.served_name, pr, a.check_tokens)
                    else:
                        ref = reference[i] if reference else {"error": "no reference"}
                    got = await complete(session, rurl, a.served_name, pr, a.check_tokens)
                    c = compare(ref, got)
                    c.update(prompt_tokens=got.get("prompt_tokens"), latency_s=got.get("s"))
                    results.append(c)
                    if setup == "mono" and reference is None:
                        results[-1]["ref_latency_s"] = ref.get("s")
                        res.setdefault("reference", []).append(
                            {"prompt": pr, "token_ids": ref.get("token_ids"), "text": ref.get("text"),
                             "error": ref.get("error")})
                if setup == "mono" and reference is None:
                    reference = res.get("reference")
                m1 = await scrape(session, dec.url)
                p1 = await scrape(session, pre.url) if pre else {}
                matched = sum(1 for c in results if c.get("equal"))
                S["correctness"] = {"matched": matched, "total": len(results), "per_prompt": results,
                                    "first_diffs": [c.get("first_diff", c.get("first_diff_char")) for c in results
                                                    if not c.get("equal")],
                                    "compared_against": "direct request to the mono engine" if setup == "mono"
                                    else "mono engine output recorded in setup mono"}
                S["decode_sources_correctness"] = source_tokens(delta(m0, m1))
                S["prefill_sources_correctness"] = source_tokens(delta(p0, p1))
                S["nixl_correctness"] = nixl_summary(delta(m0, m1), delta(p0, p1))
                log(f"{setup}: correctness {matched}/{len(results)} first diffs {S['correctness']['first_diffs']}; "
                    f"decode sources {S['decode_sources_correctness']}; prefill sources {S['prefill_sources_correctness']}; "
                    f"nixl {S['nixl_correctness']}")
                errs = [c.get("error") for c in results if c.get("error")]
                if errs:
                    log(f"{setup}: correctness errors: {errs[:3]}")
                write_report(res, a.out)
                # ---- load
                S["load"] = []
                m2 = await scrape(session, dec.url)
                p2 = await scrape(session, pre.url) if pre else {}
                # one load duration for all of this setup's rates, sized so that the later setups get
                # the same: per later setup ~25 s of router start + correctness, per rate ~8 s of drain
                setups_left = len(setups) - si
                left = deadline - time.monotonic() - 20 - 25 * (setups_left - 1)
                dur = min(a.duration, left / (setups_left * len(rates)) - 8)
                if dur < a.duration:
                    res["notes"].append(f"{setup}: loads shortened to {max(dur, 0):.0f}s each (time box)")
                for rate in rates:
                    if dur < a.min_duration or deadline - time.monotonic() < dur + 15:
                        S["skipped"].append(f"rate {rate:g}: no time left")
                        continue
                    drain = max(5.0, min(a.drain, deadline - time.monotonic() - dur - 10))
                    S["load"].append(await run_load(session, rurl, a, prompts, rate, dur, drain, f"{setup}-r{rate:g}"))
                    write_report(res, a.out)
                m3 = await scrape(session, dec.url)
                p3 = await scrape(session, pre.url) if pre else {}
                S["decode_sources_load"] = source_tokens(delta(m2, m3))
                S["prefill_sources_load"] = source_tokens(delta(p2, p3))
                S["nixl_load"] = nixl_summary(delta(m2, m3), delta(p2, p3))
                S["decode_metric_deltas_load"] = delta(m2, m3)
                S["prefill_metric_deltas_load"] = delta(p2, p3)
                rm = {}
                try:
                    async with session.get(rurl + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                        for line in (await r.text()).splitlines():
                            if line.startswith("pd_router_requests_total") or line.startswith("pd_router_route"):
                                k, _, v = line.rpartition(" ")
                                rm[k] = v
                except Exception:
                    pass
                S["router_metrics"] = rm
                log(f"{setup}: load done; decode sources {S['decode_sources_load']}; nixl {S['nixl_load']}")
                S["router_log_tail"] = tail(rlog, 15)
                stop_proc(rproc, 5)
                write_report(res, a.out)
    finally:
        for r in routers:
            stop_proc(r, 3)
        if not a.no_engines:
            for s in setups:
                for e in engines[s]:
                    res.setdefault("engine_log_tails", {})[e.name] = tail(e.log_path, 12)
            stop_all([e.proc for s in setups for e in engines[s]])
        write_report(res, a.out)
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)

    def _term(signum, frame):  # turn SIGTERM into KeyboardInterrupt so that `finally` stops the engines
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, _term)
    return asyncio.run(amain(a))


if __name__ == "__main__":
    sys.exit(main())

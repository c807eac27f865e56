"""`pd-router`: serve | up | register. A thin CLI: flags and PD_ROUTER_* variables map onto Settings.

Every `serve` flag `--some-flag` can also be set as `PD_ROUTER_SOME_FLAG`; repeatable
flags (`--prefill`, `--decode`, `--allowed-network`) take a comma-separated list there.
A flag on the command line wins over the environment.
"""

from __future__ import annotations

import argparse
import os
import sys

from router.settings import COUNT_TOKENS, KV_CONNECTORS, MODES, POLICIES, PREFILL_FAILURE_POLICIES, InstanceSpec, Settings

ENV_PREFIX = "PD_ROUTER_"


def _opt_float(text: str) -> float | None:
    return None if text.lower() in ("", "none", "0", "off") else float(text)


# (flag, settings field, type, help, extra argparse kwargs)
SERVE_FLAGS = [
    ("--mode", "mode", str, "pull: serial (prefill then decode); push: both legs at once", {"choices": MODES}),
    ("--kv-connector", "kv_connector", str, "field encoding of the engines' KV connector", {"choices": KV_CONNECTORS}),
    ("--threshold", "threshold", int, "prompts with at least this many tokens are disaggregated", {}),
    ("--prefill", "prefill", InstanceSpec.parse, "prefill instance URL (repeatable; push: ?engine_id=..&kv_host=..&kv_port=..)", {"action": "append"}),
    ("--decode", "decode", InstanceSpec.parse, "decode instance URL (repeatable)", {"action": "append"}),
    ("--tokenizer", "tokenizer", str, "tokenizer path or name (default: the model root the backends report)", {}),
    ("--host", "host", str, "listen address", {}),
    ("--port", "port", int, "listen port", {}),
    ("--policy", "policy", str, "load-balancing policy", {"choices": POLICIES}),
    ("--ping-port", "ping_port", int, "ZMQ registration port (0 = off)", {}),
    ("--heartbeat-timeout", "heartbeat_timeout", float, "seconds of silence before a registered instance is dropped", {}),
    ("--registration-token", "registration_token", str, "shared secret every ping must carry", {}),
    ("--allowed-network", "allowed_networks", str, "CIDR registered addresses must be in (repeatable)", {"action": "append"}),
    ("--max-instances", "max_instances", int, "upper bound of the instance table", {}),
    ("--health-interval", "health_interval", float, "seconds between health probes of instances", {}),
    ("--connect-timeout", "connect_timeout", float, "seconds to connect to an engine", {}),
    ("--prefill-timeout", "prefill_timeout", float, "seconds for a prefill leg to answer", {}),
    ("--first-byte-timeout", "first_byte_timeout", float, "seconds for the decode leg's first byte", {}),
    ("--idle-timeout", "idle_timeout", _opt_float, "max seconds between stream chunks", {}),
    ("--request-timeout", "request_timeout", _opt_float, "max seconds for a whole non-streaming request (0 = none)", {}),
    ("--push-decode-grace", "push_decode_grace", float, "push: seconds a stream may stay silent after prefill answered", {}),
    ("--on-prefill-failure", "on_prefill_failure", str, "what to do when a prefill leg fails", {"choices": PREFILL_FAILURE_POLICIES}),
    ("--prefill-retries", "prefill_retries", int, "other prefill instances to try (retry policy)", {}),
    ("--decode-retries", "decode_retries", int, "other decode instances to try before the first byte", {}),
    ("--breaker-failures", "breaker_failures", int, "consecutive failures that open an instance's circuit (0 = off)", {}),
    ("--breaker-cooldown", "breaker_cooldown", float, "seconds an open circuit waits before a probe request", {}),
    ("--max-inflight", "max_inflight", int, "requests in flight before 429 (0 = unlimited)", {}),
    ("--max-body-bytes", "max_body_bytes", int, "largest request body accepted", {}),
    ("--api-key", "api_key", str, "require 'Authorization: Bearer KEY' from clients", {}),
    ("--forward-authorization", "forward_authorization", bool, "forward the client's Authorization header to engines", {}),
    ("--prefill-api-key", "prefill_api_key", str, "API key sent to prefill engines", {}),
    ("--decode-api-key", "decode_api_key", str, "API key sent to decode engines", {}),
    ("--shutdown-grace", "shutdown_grace", float, "seconds to drain in-flight requests on shutdown", {}),
    ("--log-level", "log_level", str, "log level", {"choices": ("debug", "info", "warning", "error")}),
    ("--log-format", "log_format", str, "access/log line format", {"choices": ("text", "json")}),
    ("--slo-ttft", "slo_ttft", float, "goodput TTFT target, seconds", {}),
    ("--slo-itl", "slo_itl", float, "goodput mean inter-token latency target, seconds", {}),
    ("--max-connections", "max_connections", int, "idle keep-alive connections kept per engine", {}),
    ("--tokenizer-threads", "tokenizer_threads", int, "threads counting prompt tokens", {}),
    ("--count-tokens", "count_tokens", str, "always tokenize prompts, or only when byte-length bounds do not "
     "settle the route and context check", {"choices": COUNT_TOKENS}),
]


def _env_name(flag: str) -> str:
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def _parse_bool(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


class _Unset:
    def __repr__(self) -> str:
        return "(unset)"


UNSET = _Unset()


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    for flag, _field, typ, help_, extra in SERVE_FLAGS:
        if typ is bool:
            p.add_argument(flag, action="store_true", default=UNSET, help=help_ + f" [env {_env_name(flag)}]")
        else:
            default = None if extra.get("action") == "append" else UNSET  # append needs a list or None
            p.add_argument(flag, type=typ, default=default, help=help_ + f" [env {_env_name(flag)}]", **extra)


def settings_from_args(args: argparse.Namespace, environ: dict | None = None) -> Settings:
    env = os.environ if environ is None else environ
    values = {}
    for flag, field, typ, _help, extra in SERVE_FLAGS:
        value = getattr(args, field if field not in ("allowed_networks",) else "allowed_network", UNSET)
        if value is UNSET or (value is None and extra.get("action") == "append"):
            raw = env.get(_env_name(flag))
            if raw is not None and raw != "":
                try:
                    if extra.get("action") == "append":
                        value = [typ(x) for x in raw.split(",") if x.strip()]
                    elif typ is bool:
                        value = _parse_bool(raw)
                    else:
                        value = typ(raw)
                except ValueError as exc:
                    raise SystemExit(f"pd-router: bad {_env_name(flag)}={raw!r}: {exc}") from None
                if "choices" in extra and value not in extra["choices"]:
                    raise SystemExit(f"pd-router: {_env_name(flag)} must be one of {', '.join(extra['choices'])}")
            else:
                continue
        if extra.get("action") == "append":
            value = tuple(value)
        values[field] = value
    try:
        return Settings(**values)
    except ValueError as exc:
        raise SystemExit(f"pd-router: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pd-router", description="Prefill/decode disaggregation router for vLLM")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the router")
    add_serve_arguments(serve)
    try:
        from launch import up as launch_up
    except ImportError:  # launch/ not installed
        launch_up = None
    if launch_up is not None:
        up = sub.add_parser("up", help="start a whole P/D topology on this host (vLLM instances + router)")
        launch_up.add_arguments(up)
    try:
        from router import register as reg_cmd
    except ImportError:
        reg_cmd = None
    if reg_cmd is not None:
        r = sub.add_parser("register", help="wait for a vLLM instance, then ping a router's registration port for it")
        reg_cmd.add_arguments(r)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(settings_from_args(args))
    if args.command == "up":
        from launch import up as launch_up
        return launch_up.run(args)
    if args.command == "register":
        from router import register as reg_cmd
        return reg_cmd.run(args)
    parser.error(f"unknown command {args.command}")
    return 2


def serve(settings: Settings) -> int:
    from router.tokenizer import block_torch, local_path_problem

    problem = local_path_problem(settings.tokenizer)
    if problem:  # every request that needs a token count would fail: say so now, not per request
        print(f"pd-router serve: --tokenizer {problem}", file=sys.stderr)
        return 2
    block_torch()
    from router.app import create_app
    from router.logs import setup_logging
    from router.server import RouterServer, uvicorn_config

    setup_logging(settings.log_level, settings.log_format)
    app = create_app(settings, freeze_gc=True)
    server = RouterServer(uvicorn_config(app, settings))
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Kubernetes manifest parses and its router arguments are flags `pd-router serve` accepts."""

from pathlib import Path

import yaml

from router.cli import build_parser, settings_from_args

MANIFEST = Path(__file__).resolve().parents[2] / "launch" / "k8s" / "pd-router.yaml"


def test_manifest_args_are_valid_router_flags():
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    [deploy] = [d for d in docs if d["kind"] == "Deployment"]
    [container] = deploy["spec"]["template"]["spec"]["containers"]
    args = build_parser().parse_args(["serve", *container["args"]])
    env = {e["name"]: e.get("value", "x") for e in container["env"]}
    env["PD_ROUTER_ALLOWED_NETWORK"] = env.get("PD_ROUTER_ALLOWED_NETWORK", "10.0.0.0/8")
    s = settings_from_args(args, env)
    assert s.mode == "push" and s.ping_port == 36367 and s.api_key == "x"
    ports = {p["containerPort"] for p in container["ports"]}
    assert {s.port, s.ping_port} <= ports
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert deploy["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True

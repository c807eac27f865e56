"""launch/grafana/pd-router.json is a Grafana dashboard whose every PromQL expression names
only metrics (and labels) that router/metrics.py declares."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase

from router.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "launch" / "grafana" / "pd-router.json"
METRIC = re.compile(r"\bpd_router_[a-z0-9_]+")
BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
MATCHER = re.compile(r"(pd_router_[a-z0-9_]+)\{([^}]*)\}")


def declared() -> dict[str, tuple[str, set[str]]]:
    """Every sample name the router can expose -> (family, its label names)."""
    out: dict[str, tuple[str, set[str]]] = {}
    for metric in vars(Metrics()).values():
        if not isinstance(metric, MetricWrapperBase):
            continue
        [family] = metric.describe()
        labels = set(metric._labelnames)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}[family.type]
        for suffix in suffixes:
            out[family.name + suffix] = (family.name, labels | ({"le"} if suffix == "_bucket" else set()))
    return out


DECLARED = declared()


def check_expr(expr: str) -> set[str]:
    """Raise AssertionError unless `expr` uses only declared metrics and their labels; return the families."""
    names = METRIC.findall(expr)
    assert names, f"no pd_router_ metric in {expr!r}"
    unknown = [n for n in names if n not in DECLARED]
    assert not unknown, f"{expr!r} uses undeclared metrics {unknown}"
    labels = set().union(*(DECLARED[n][1] for n in names))
    for group in BY.findall(expr):
        used = {x.strip() for x in group.split(",") if x.strip()}
        assert used <= labels, f"{expr!r} groups by unknown labels {used - labels}"
    for name, matchers in MATCHER.findall(expr):
        used = {m.split("=")[0].rstrip("!~").strip() for m in matchers.split(",") if m.strip()}
        assert used <= DECLARED[name][1], f"{expr!r} matches unknown labels {used - DECLARED[name][1]} of {name}"
    return {DECLARED[n][0] for n in names}


def panels(doc: dict) -> list[dict]:
    out = []
    for p in doc["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows keep their panels inside
    return out


def exprs(doc: dict) -> list[str]:
    return [t["expr"] for p in panels(doc) for t in p.get("targets", [])]


@pytest.fixture(scope="module")
def doc() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_is_a_grafana_dashboard_model(doc):
    assert doc["title"] and doc["uid"] and isinstance(doc["schemaVersion"], int)
    assert {"name": "datasource", "type": "datasource"}.items() <= doc["templating"]["list"][0].items()
    ids = [p["id"] for p in panels(doc)]
    assert len(ids) == len(set(ids))
    for p in panels(doc):
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]


def test_every_expression_uses_declared_metrics_and_labels(doc):
    used = set()
    for expr in exprs(doc):
        used |= check_expr(expr)
    families = {fam for fam, _ in DECLARED.values()}
    assert used == families, f"metrics without a panel: {sorted(families - used)}"


@pytest.mark.parametrize("bad", [
    "rate(pd_router_no_such_thing_total[5m])",
    "sum by (model) (rate(pd_router_requests_total[5m]))",  # not a label of the metric
    'rate(pd_router_errors_total{instance="x"}[5m])',
    "up",
])
def test_the_checker_rejects_unknown_names(bad):
    with pytest.raises(AssertionError):
        check_expr(bad)


def test_required_panels(doc):
    all_exprs = exprs(doc)

    def has(*parts):
        return any(all(p in e for p in parts) for e in all_exprs)

    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        assert has("histogram_quantile(0.99", f"pd_router_{hist}_bucket", "by (le, route)")
    assert has("pd_router_slo_goodput_requests_total", "/", "pd_router_slo_requests_total")
    assert has("pd_router_in_flight_requests", "by (role, engine)")
    assert has("pd_router_errors_total", "by (stage, kind)")
    assert has("pd_router_routing_decisions_total", "by (route, reason)")
    assert has("pd_router_registrations_total") and has("pd_router_instance_expiries_total")

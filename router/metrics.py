"""Every pd-router metric, declared once, on a per-app registry.

Naming: `pd_router_` prefix, base units in the name (`_seconds`, `_tokens`), counters
end in `_total`. Labels are bounded: route (direct|disaggregated), mode (pull|push|none),
outcome (ok|client_error|upstream_error|timeout|cancelled|overloaded), stage
(prefill|decode|client|router), kind (a bounded error code), role and engine (the URL
of an instance in the registry, removed with it; not `instance`, which Prometheus
reserves for the scrape target and would rename to `exported_instance`).

The router runs one worker process (uvicorn workers=1); scale out with more router
replicas behind a load balancer, so no multiprocess collector is needed.
"""

from __future__ import annotations

from bisect import bisect_left

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5)
TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
OUTCOMES = ("ok", "client_error", "upstream_error", "timeout", "cancelled", "overloaded")
ORPHAN_REASONS = ("no_kv_params", "no_decode_instance", "cancelled")


class _Value:
    """prometheus_client's `MutexValue` without its lock. Every update of these metrics runs on
    the router's event-loop thread (the tokenizer threads only count tokens), and the scrape
    reads each float whole, so the lock bought nothing; with about twenty updates per request
    it was the largest cost of the metrics (docs/performance.md, round 6)."""

    __slots__ = ("_value", "_exemplar")
    _multiprocess = False

    def __init__(self) -> None:
        self._value = 0.0
        self._exemplar = None

    def inc(self, amount: float) -> None:
        self._value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def set_exemplar(self, exemplar) -> None:
        self._exemplar = exemplar

    def get(self) -> float:
        return self._value

    def get_exemplar(self):
        return self._exemplar


class Counter(prometheus_client.Counter):
    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = _Value()


class Gauge(prometheus_client.Gauge):
    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = _Value()


class Histogram(prometheus_client.Histogram):
    def _metric_init(self) -> None:
        super()._metric_init()
        self._sum = _Value()
        self._buckets = [_Value() for _ in self._upper_bounds]

    def observe(self, amount: float, exemplar=None) -> None:
        if exemplar or amount != amount or not self._is_observable():
            super().observe(amount, exemplar)  # its checks and errors (NaN: no bucket, as upstream)
            return
        self._sum._value += amount
        self._buckets[bisect_left(self._upper_bounds, amount)]._value += 1  # the first bound >= amount


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry(auto_describe=True)
        self.requests = Counter("pd_router_requests_total", "Client requests finished, by route, mode and outcome.",
                                ["route", "mode", "outcome"], registry=r)
        self.routing = Counter("pd_router_routing_decisions_total",
                               "Threshold decisions: disaggregated (>= threshold) or direct, with the reason.",
                               ["route", "reason"], registry=r)
        self.ttft = Histogram("pd_router_time_to_first_token_seconds",
                              "Client-observed time to first token (first byte of the answer).",
                              ["route", "mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pd_router_inter_token_latency_seconds",
                             "Gap between streamed events sent to the client (one observation per event after "
                             "the first; events arriving in one read share its gap).",
                             ["route", "mode"], buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pd_router_request_duration_seconds", "End-to-end request latency.",
                             ["route", "mode", "outcome"], buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_leg = Histogram("pd_router_prefill_leg_seconds", "Prefill leg: request sent to answer received.",
                                     ["mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.handoff = Histogram("pd_router_handoff_seconds",
                                 "Prefill answered (pull) or push started -> first decode token.",
                                 ["mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.tokenize = Histogram("pd_router_tokenize_seconds", "Prompt token counting (cache misses included).",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("pd_router_prompt_tokens_total", "Prompt tokens routed (router's count).",
                                     ["route"], registry=r)
        self.prompt_tokens_hist = Histogram("pd_router_prompt_length_tokens", "Prompt length distribution.",
                                            ["route"], buckets=TOKEN_BUCKETS, registry=r)
        self.output_tokens = Counter("pd_router_output_tokens_total",
                                     "Output tokens relayed (completion_tokens of the engine's usage; streams always "
                                     "ask the decode leg for usage).",
                                     ["route"], registry=r)
        self.in_flight = Gauge("pd_router_in_flight_requests", "Legs in flight per engine instance (role, engine URL).",
                               ["role", "engine"], registry=r)
        self.in_flight_total = Gauge("pd_router_requests_in_flight", "Client requests in flight.", registry=r)
        self.errors = Counter("pd_router_errors_total", "Errors by stage and kind.", ["stage", "kind"], registry=r)
        self.orphans = Counter("pd_router_orphaned_prefills_total",
                               "Pull: prefills that answered but whose decode leg was never sent or was abandoned "
                               "before D answered (P's blocks stay pinned until its lease expires).",
                               ["reason"], registry=r)
        self.retries = Counter("pd_router_retries_total", "Legs retried on another instance.", ["stage"], registry=r)
        self.fallbacks = Counter("pd_router_prefill_fallbacks_total",
                                 "Requests run decode-only after a prefill failure.", registry=r)
        self.registrations = Counter("pd_router_registrations_total", "Accepted registrations (new instances).",
                                     ["role", "format"], registry=r)
        self.heartbeats = Counter("pd_router_heartbeats_total", "Accepted pings (including refreshes).", registry=r)
        self.expiries = Counter("pd_router_instance_expiries_total", "Registered instances expired after silence.",
                                ["role"], registry=r)
        self.rejected_pings = Counter("pd_router_rejected_pings_total", "Pings dropped, by reason.", ["reason"],
                                      registry=r)
        self.instances = Gauge("pd_router_instances", "Known instances by role and health.", ["role", "healthy"],
                               registry=r)
        self.breaker_open = Gauge("pd_router_circuit_open", "1 while an instance's circuit breaker is open.",
                                  ["role", "engine"], registry=r)
        self.goodput = Counter("pd_router_slo_goodput_requests_total",
                               "Finished requests meeting both the TTFT and the ITL target.", ["route"], registry=r)
        self.slo_requests = Counter("pd_router_slo_requests_total",
                                    "Finished successful requests considered for goodput.", ["route"], registry=r)

        # Children of metrics whose labels come from small fixed sets are memoised: a request
        # looks up about a dozen of them, and prometheus_client's labels() takes a lock and
        # rebuilds the key each time. (in_flight and breaker_open are per engine and removed
        # with it: not memoised.)
        for metric in (self.requests, self.routing, self.ttft, self.itl, self.e2e, self.prefill_leg, self.handoff,
                       self.prompt_tokens, self.prompt_tokens_hist, self.output_tokens, self.errors, self.orphans,
                       self.retries, self.goodput, self.slo_requests):
            _memoise_labels(metric)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def forget_instance(self, role: str, url: str) -> None:
        for metric in (self.in_flight, self.breaker_open):
            try:
                metric.remove(role, url)
            except KeyError:
                pass


def _memoise_labels(metric) -> None:
    cache: dict = {}
    labels = metric.labels

    def memo(*values, **kw):
        if kw:
            return labels(*values, **kw)
        child = cache.get(values)
        if child is None:
            child = cache[values] = labels(*values)
        return child

    metric.labels = memo

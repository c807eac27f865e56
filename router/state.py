"""Typed application state, built by the lifespan and handed to handlers."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import orjson

from router.dispatch import DirectDispatch, Dispatcher
from router.metrics import Metrics
from router.registry import Registry
from router.settings import Settings
from router.tokenizer import TokenCounter
from router.upstream import Upstream

access = logging.getLogger("pd_router.access")


@dataclass
class AppState:
    settings: Settings
    registry: Registry
    upstream: Upstream
    metrics: Metrics
    tokens: TokenCounter
    dispatcher: Dispatcher
    direct: DirectDispatch
    in_flight: int = 0
    draining: bool = False
    components: list = field(default_factory=list)  # closed in reverse order

    def max_model_len(self, model: str | None) -> int | None:
        lens = [i.max_model_len for i in self.registry if i.max_model_len and (model is None or i.model == model)]
        return min(lens) if lens else None

    def refresh_gauges(self) -> None:
        g = self.metrics.instances
        counts = {(r, h): 0 for r in ("prefill", "decode") for h in ("true", "false")}
        for inst in self.registry:
            counts[(inst.role, "true" if inst.healthy else "false")] = counts.get((inst.role, "true" if inst.healthy else "false"), 0) + 1
            if inst.breaker is not None:
                self.metrics.breaker_open.labels(inst.role, inst.url).set(1 if inst.breaker.state(self.registry.now()) == "open" else 0)
        for (role, healthy), n in counts.items():
            g.labels(role, healthy).set(n)

    def access_log(self, rid, route, prefill, decode, prompt_tokens, output_tokens, ttft, status, outcome, err,
                   e2e=None) -> None:
        ttft_ms = round(ttft * 1000, 2) if ttft is not None else None
        e2e_ms = round(e2e * 1000, 2) if e2e is not None else None
        if self.settings.log_format == "json":
            rec = {"request_id": rid, "route": route, "prefill": prefill, "decode": decode,
                   "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, "ttft_ms": ttft_ms,
                   "e2e_ms": e2e_ms, "status": status, "outcome": outcome}
            if err is not None:
                rec["error"] = err.message[:300]
            access.info(orjson.dumps(rec).decode())
            return
        line = (f"request_id={_text(rid)} route={route} prefill={_text(prefill)} decode={_text(decode)} "
                f"prompt_tokens={_text(prompt_tokens)} output_tokens={_text(output_tokens)} ttft_ms={_text(ttft_ms)} "
                f"e2e_ms={_text(e2e_ms)} status={status} outcome={outcome}")
        if err is not None:
            line += f" error={_text(err.message[:300])}"
        access.info(line)


def _text(v) -> str:
    """key=value text: values with spaces or quotes are JSON-quoted so the line splits cleanly."""
    v = "-" if v is None else str(v)
    return orjson.dumps(v).decode() if (" " in v or '"' in v or "=" in v) else v

"""The instance table: a pure data structure with an injected clock.

Static instances (from flags) and registered ones (from the ping port) live in one
table. Discovery and health probing feed it; dispatch asks it for candidates. No I/O here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

from router.settings import InstanceSpec

ROLES = ("prefill", "decode")


@dataclass
class Instance:
    role: str
    spec: InstanceSpec
    source: str = "static"  # "static" | "registered"
    model: str | None = None
    model_root: str | None = None
    max_model_len: int | None = None
    healthy: bool = True
    last_seen: float = 0.0
    registered_at: float = 0.0
    in_flight: int = 0
    served: int = 0
    failures: int = 0  # consecutive
    connector: str | None = None
    transfer_mode: str | None = None
    breaker: object | None = None  # router.breaker.Breaker, attached by the app
    meta: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def key(self) -> tuple[str, str]:
        return (self.role, self.spec.url)

    def available(self, now: float) -> bool:
        if not self.healthy:
            return False
        return self.breaker is None or self.breaker.allows(now)

    def to_json(self, now: float, wall_offset: float) -> dict:
        s = self.spec
        out = {
            "role": self.role,
            "url": s.url,
            "model": self.model or s.model,
            "source": self.source,
            "healthy": self.healthy,
            "last_seen": round(self.last_seen + wall_offset, 3) if self.last_seen else None,
            "age_s": round(now - self.last_seen, 3) if self.last_seen else None,
            "in_flight": self.in_flight,
            "served": self.served,
            "engine_id": s.engine_id,
            "kv_host": s.kv_host,
            "kv_port": s.kv_port,
            "tp": s.tp,
            "pp": s.pp,
            "dp": s.dp,
            "zmq_address": s.zmq_address,
            "transfer_mode": self.transfer_mode,
        }
        if self.breaker is not None:
            out["circuit"] = self.breaker.state(now)
        return out


class Registry:
    """All known engines. `clock` is monotonic seconds (injectable for tests)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, max_instances: int = 1024,
                 on_change: Callable[[str, Instance], None] | None = None):
        self._clock = clock
        self._max = max_instances
        self._by_key: dict[tuple[str, str], Instance] = {}
        self._on_change = on_change
        self.version = 0  # bumped on every membership change; lets callers cache views

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self):
        return iter(list(self._by_key.values()))

    def get(self, role: str, url: str) -> Instance | None:
        return self._by_key.get((role, url))

    def add_static(self, role: str, spec: InstanceSpec) -> Instance:
        inst = Instance(role=role, spec=spec, source="static", model=spec.model, last_seen=0.0)
        self._by_key[inst.key] = inst
        self.version += 1
        self._emit("added", inst)
        return inst

    def upsert(self, role: str, spec: InstanceSpec, **attrs) -> tuple[Instance | None, bool]:
        """Register or refresh a dynamic instance. Returns (instance, created).

        Returns (None, False) when the table is full and the instance is new.
        """
        now = self._clock()
        key = (role, spec.url)
        inst = self._by_key.get(key)
        if inst is None:
            if len(self._by_key) >= self._max:
                return None, False
            inst = Instance(role=role, spec=spec, source="registered", registered_at=now, last_seen=now, **attrs)
            self._by_key[key] = inst
            self.version += 1
            self._emit("added", inst)
            return inst, True
        if inst.spec != spec:
            inst.spec = spec
            self.version += 1
        for name, value in attrs.items():
            setattr(inst, name, value)
        # A ping proves the sender is alive, not that the engine serves: health stays the
        # health checker's call (router/health.py), so a ping never puts an instance back.
        inst.last_seen = now
        return inst, False

    def remove(self, inst: Instance) -> None:
        if self._by_key.pop(inst.key, None) is not None:
            self.version += 1
            self._emit("removed", inst)

    def expire(self, timeout: float) -> list[Instance]:
        """Drop registered instances silent for longer than `timeout` seconds."""
        now = self._clock()
        dead = [i for i in self._by_key.values() if i.source == "registered" and now - i.last_seen > timeout]
        for inst in dead:
            self.remove(inst)
            self._emit("expired", inst)
        return dead

    def set_health(self, inst: Instance, healthy: bool) -> None:
        if inst.healthy != healthy:
            inst.healthy = healthy
            self.version += 1
            self._emit("healthy" if healthy else "unhealthy", inst)
        if healthy and inst.source == "static":  # a registered instance is only kept alive by its pings
            inst.last_seen = self._clock()

    def candidates(self, role: str, model: str | None = None) -> list[Instance]:
        now = self._clock()
        out = [i for i in self._by_key.values() if i.role == role and i.available(now)]
        if model is not None:
            out = [i for i in out if i.model is None or i.model == model]
        return out

    def of_role(self, role: str) -> list[Instance]:
        return [i for i in self._by_key.values() if i.role == role]

    def models(self) -> set[str]:
        return {i.model for i in self._by_key.values() if i.model and i.healthy}

    def snapshot(self) -> list[dict]:
        now = self._clock()
        offset = time.time() - time.monotonic() if self._clock is time.monotonic else 0.0
        return [i.to_json(now, offset) for i in sorted(self._by_key.values(), key=lambda i: i.key)]

    def now(self) -> float:
        return self._clock()

    def _emit(self, event: str, inst: Instance) -> None:
        if self._on_change is not None:
            self._on_change(event, inst)


def bulk_static(registry: Registry, role: str, specs: Iterable[InstanceSpec]) -> list[Instance]:
    return [registry.add_static(role, s) for s in specs]

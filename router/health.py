"""Probes static instances (`/health`, then `/v1/models`) and learns what they serve.

An instance that fails a probe leaves rotation until a probe succeeds again. The
models each instance lists are kept for `GET /v1/models` and the tokenizer default.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

import orjson

from router.errors import RouterError
from router.registry import Instance, Registry
from router.upstream import Upstream

log = logging.getLogger("pd_router.health")


class HealthChecker:
    def __init__(self, registry: Registry, upstream: Upstream, *, interval: float = 5.0, timeout: float = 5.0,
                 on_model: Callable[[Instance], None] | None = None, probe_registered: bool = True,
                 failures_to_down: int = 2):
        self._registry = registry
        self._upstream = upstream
        self._interval = interval
        self._timeout = timeout
        self._on_model = on_model
        self._probe_registered = probe_registered
        self._failures_to_down = failures_to_down
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="pdr-health")

    def poke(self) -> None:
        """Probe now (e.g. after a new registration)."""
        self._wake.set()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def probe_all(self) -> None:
        insts = [i for i in self._registry if i.source == "static" or self._probe_registered]
        if insts:
            await asyncio.gather(*(self.probe(i) for i in insts))

    async def probe(self, inst: Instance) -> bool:
        ok = False
        try:
            r = await self._upstream.request("GET", inst.url + "/health", timeout=self._timeout, stage=inst.role)
            if r.status == 200 and (inst.model is None or inst.meta.get("models") is None):
                await self._learn_models(inst)
            ok = r.status == 200
        except RouterError as exc:
            log.debug("probe %s %s failed: %s", inst.role, inst.url, exc.message)
        except Exception:  # noqa: BLE001 - a probe must never kill the loop
            log.exception("probe %s %s crashed", inst.role, inst.url)
        if self._registry.get(inst.role, inst.url) is not inst:
            return ok
        misses = 0 if ok else inst.meta.get("probe_misses", 0) + 1
        inst.meta["probe_misses"] = misses
        if ok:
            if not inst.healthy:
                log.info("%s instance %s is back", inst.role, inst.url)
            self._registry.set_health(inst, True)
        elif misses >= self._failures_to_down or inst.model is None:
            # one missed probe on a busy instance is not an outage; an instance never seen up is down
            if inst.healthy:
                log.warning("%s instance %s is down; out of rotation", inst.role, inst.url)
            self._registry.set_health(inst, False)
        return ok

    async def _learn_models(self, inst: Instance) -> None:
        r = await self._upstream.request("GET", inst.url + "/v1/models", timeout=self._timeout, stage=inst.role)
        if r.status != 200:
            return
        try:
            data = orjson.loads(r.body).get("data")
        except (orjson.JSONDecodeError, AttributeError):
            return
        if not isinstance(data, list) or not data or not isinstance(data[0], dict):
            return
        inst.meta["models"] = data
        first = data[0]
        if inst.model is None and isinstance(first.get("id"), str):
            inst.model = first["id"]
        if isinstance(first.get("root"), str):
            inst.model_root = first["root"]
        if isinstance(first.get("max_model_len"), int):
            inst.max_model_len = first["max_model_len"]
        if self._on_model is not None:
            self._on_model(inst)

    async def _loop(self) -> None:
        # Wait first: the lifespan has just probed every static instance before start().
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self._interval)
            except TimeoutError:
                pass
            self._wake.clear()  # before probing: a poke during the probes is not lost
            await self.probe_all()

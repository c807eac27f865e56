"""The transport's NIXL backend moving GPU memory between two processes (issue 11).

A receiver process registers a destination region in GPU memory (`MemKind.VRAM`) on GPU `DST`;
this process registers a source region on GPU `SRC` and WRITEs it into the receiver through
`transport.nixl` (UCX), destination blocks randomly permuted as KV blocks are, timed from
write() to the transfer's completion; the receiver checks the bytes of the last run. The ceiling
in the same run: a device-to-device copy of the same size with torch (on one GPU, or GPU SRC to
GPU DST), best of --repeat. Prints one table (GB/s and the ratio) and writes JSON with --out.

    python -m benchmarks.transport_vram --pairs 0:0,0:1 --mib 1024 --repeat 5 --out vram.json
    python -m benchmarks.transport_vram --host --pairs 0:0 --mib 64     (host memory: the flow, here)
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from transport import layout  # noqa: E402
from transport.base import MemKind, Region  # noqa: E402
from transport.select import create  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
BLOCKS = (64 * KiB, MiB, 16 * MiB)


class Mem:
    """nbytes of GPU memory on `gpu` (torch), or host memory (numpy) with `host`."""

    def __init__(self, nbytes: int, gpu: int, host: bool, fill: int | None = None):
        self.host, self.gpu, self.nbytes = host, gpu, nbytes
        if host:
            self.t = np.zeros(nbytes, np.uint8) if fill is None else np.random.default_rng(fill).integers(
                0, 256, nbytes, dtype=np.uint8)
            self.ptr = int(self.t.ctypes.data)
            self.region = Region(self.ptr, nbytes)
        else:
            import torch  # noqa: PLC0415
            dev = torch.device("cuda", gpu)
            g = torch.Generator(device=dev)
            if fill is None:
                self.t = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
            else:
                g.manual_seed(fill)
                self.t = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=dev, generator=g)
            torch.cuda.synchronize(dev)
            self.ptr = int(self.t.data_ptr())
            self.region = Region(self.ptr, nbytes, MemKind.VRAM, gpu)

    def digest(self, order: np.ndarray | None, block: int) -> str:
        """A checksum of the bytes in block order `order` (None: as laid out)."""
        if self.host:
            a = self.t if order is None else self.t.reshape(-1, block)[order].reshape(-1)
            return str(int(a.astype(np.uint64).sum()) * 1_000_003 + int(a[::4099].astype(np.uint64).sum()))
        import torch  # noqa: PLC0415
        a = self.t if order is None else self.t.view(-1, block)[torch.from_numpy(order).to(self.t.device)].reshape(-1)
        return str(int(a.to(torch.int64).sum()) * 1_000_003 + int(a[::4099].to(torch.int64).sum()))


def serve(gpu: int, nbytes: int, host: bool) -> None:
    """Receiver: register the destination, print the endpoint; on a line 'sum BLOCK' from stdin
    print the checksum of the destination; on EOF stop. Notifications are drained meanwhile."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # NIXL logs to stdout
    t = create("nixl")
    t.start()
    mem = Mem(nbytes, gpu, host)
    t.register(mem.region)
    out.write(f"{base64.b64encode(t.endpoint()).decode()} {mem.ptr}\n")
    out.flush()
    os.set_blocking(0, False)
    buf = b""
    while True:
        try:
            got = os.read(0, 256)
            if got == b"":
                break
            buf += got
        except BlockingIOError:
            pass
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.startswith(b"sum"):
                out.write(mem.digest(None, 0) + "\n")
                out.flush()
        t.notifications()
        time.sleep(0.0002)
    t.close()


def copy_ceiling(nbytes: int, src_gpu: int, dst_gpu: int, repeat: int) -> float | None:
    """GB/s of a torch device copy of nbytes from GPU src to GPU dst (best of repeat)."""
    try:
        import torch  # noqa: PLC0415
    except ImportError:
        return None
    a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{src_gpu}")
    b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{dst_gpu}")
    best = float("inf")
    for _ in range(repeat + 1):
        torch.cuda.synchronize(a.device)
        torch.cuda.synchronize(b.device)
        t0 = time.perf_counter()
        b.copy_(a, non_blocking=True)
        torch.cuda.synchronize(a.device)
        torch.cuda.synchronize(b.device)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def run_pair(src_gpu: int, dst_gpu: int, nbytes: int, repeat: int, host: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, "-m", "benchmarks.transport_vram", "--serve", str(dst_gpu), str(nbytes)]
    proc = subprocess.Popen(argv + (["--host"] if host else []), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, text=True, cwd=os.path.dirname(HERE))
    rng = np.random.default_rng(7)
    res: dict = {"src_gpu": src_gpu, "dst_gpu": dst_gpu, "nbytes": nbytes, "memory": "host" if host else "VRAM"}
    try:
        blob, addr = proc.stdout.readline().split()
        tx = create("nixl")
        tx.start()
        try:
            src = Mem(nbytes, src_gpu, host, fill=3)
            tx.register(src.region)
            peer = tx.connect(base64.b64decode(blob))
            for block in BLOCKS:
                n = nbytes // block
                ids = rng.permutation(n)
                descs = layout.build_descriptors([src.ptr], [int(addr)], block, block, np.arange(n), ids)
                times = []
                for i in range(repeat + 1):  # the first is a warm-up (registration caches, handshakes)
                    t0 = time.perf_counter()
                    tx.write(peer, descs, f"w{block}-{i}".encode(), timeout=120).wait(120)
                    times.append(time.perf_counter() - t0)
                # the destination holds source block k at position ids[k]: compare checksums
                proc.stdin.write("sum\n")
                proc.stdin.flush()
                got = proc.stdout.readline().strip()
                inv = np.empty(n, np.int64)
                inv[ids] = np.arange(n)
                want = src.digest(inv, block)
                res[f"block_{block}"] = {"descriptors": int(len(descs)), "gb_per_s": round(nbytes / min(times[1:]) / 1e9, 3),
                                         "ms": round(1000 * min(times[1:]), 3), "bytes_ok": got == want}
        finally:
            tx.close()
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    if not host:
        res["copy_ceiling_gb_per_s"] = round(copy_ceiling(nbytes, src_gpu, dst_gpu, repeat) or 0, 1)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", default="0:0", help="SRC:DST GPU pairs, comma-separated")
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--host", action="store_true", help="host memory instead of GPU memory")
    ap.add_argument("--out", default=None)
    ap.add_argument("--serve", nargs=2, type=int, metavar=("GPU", "NBYTES"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve:
        serve(a.serve[0], a.serve[1], a.host)
        return 0
    nbytes = a.mib * MiB
    rows = []
    for pair in a.pairs.split(","):
        s, d = (int(x) for x in pair.split(":"))
        rows.append(run_pair(s, d, nbytes, a.repeat, a.host))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n| GPUs | {' | '.join(f'block {b // KiB} KiB' for b in BLOCKS)} | copy ceiling | best / ceiling |")
    print("|---" * (len(BLOCKS) + 3) + "|")
    for r in rows:
        rates = [r[f"block_{b}"]["gb_per_s"] for b in BLOCKS]
        ceil = r.get("copy_ceiling_gb_per_s")
        cells = [f"{x:g} GB/s{'' if r[f'block_{b}']['bytes_ok'] else ' (BYTES WRONG)'}" for x, b in zip(rates, BLOCKS)]
        ratio = f"{max(rates) / ceil:.3f}" if ceil else "-"
        print(f"| {r['src_gpu']} -> {r['dst_gpu']} ({r['memory']}) | {' | '.join(cells)} | {ceil or '-'} GB/s | {ratio} |")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

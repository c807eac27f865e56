"""KV transport benchmark: one table per run.

    PYTHONPATH=. python benchmarks/transport_bench.py [--size-mib 1024] [--repeat 3]

1. memcpy ceiling: the C core's memcpy batch in this process, destination blocks randomly permuted
   (the same descriptors the backends get), per block size, on as many threads as the backend
   it is compared with copies on (split the same way, by bytes); the rows show the best seen.
   The ceiling copies the rows in the order the backend copies them (cma: destination order,
   layout.by_destination; the others: as built). Its destination is the same kind of memory as
   the backend's: for shm a memfd
   mapping (as shm's sender maps the receiver's memfds), for the others private anonymous memory
   huge-page advised (MADV_HUGEPAGE) before first touch, as the transports' allocate() gives the
   receiver; the source is that same anonymous kind. Every page is faulted in before any timing.
   PDR_KV_HUGEPAGES=0 turns the advice off everywhere (the receiver inherits the environment).
2. Each backend that runs here: 1 GiB from this process into a receiver process, destination
   blocks randomly permuted, timed from write() to the receiver's acknowledgement (nixl: to
   DONE). Runs alternate with ceiling runs of the same block size and thread count; best of
   --repeat each; the cell is backend / ceiling (GB/s in brackets). A second table divides the
   same runs' CPU time of this process (all its threads; best of each): for the one-sided
   backends (cma, shm) the receiver does no copying, so this is copy efficiency per CPU second,
   less exposed to other jobs taking the cores than wall time is.
3. Descriptor build for 1,000 blocks x 64 layers, permuted: C core, Python twin, plain numpy.
The machine is shared and noisy: compare ratios, not absolutes.
"""

from __future__ import annotations

import argparse
import base64
import mmap
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from transport import _core, layout  # noqa: E402
from transport._common import anon_mmap, hugepages_wanted  # noqa: E402
from transport.base import Buffer, Region  # noqa: E402
from transport.select import available, create  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
BLOCKS = (4 * KiB, 64 * KiB, MiB)
UCX_ENV = {"UCX_NET_DEVICES": "lo"}


def serve(backend: str, nbytes: int) -> None:
    """Receiver: allocate, fault in and register nbytes, print the endpoint, drain notifications."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # NIXL logs to stdout
    t = create(backend, **({"ucx_env": UCX_ENV} if backend == "nixl" else {}))
    t.start()
    buf = t.allocate(nbytes)
    buf.array[:] = 0
    t.register(buf.region)
    out.write(f"{base64.b64encode(t.endpoint()).decode()} {buf.region.addr}\n")
    out.flush()
    os.set_blocking(0, False)
    while True:  # until the parent closes our stdin
        try:
            if os.read(0, 1) == b"":
                break
        except BlockingIOError:
            pass
        if backend == "nixl":
            t.notifications()
            time.sleep(0.0002)
        else:
            try:
                t.wait_notification(timeout=0.2)
            except TimeoutError:
                pass
    t.close()


def anon(nbytes: int) -> Buffer:
    mm = anon_mmap(nbytes)  # as the transports allocate: huge-page advised before first touch
    view = np.frombuffer(mm, dtype=np.uint8)
    addr = int(view.ctypes.data)
    del view
    return Buffer(mm, Region(addr, nbytes))


def memfd(nbytes: int) -> Buffer:
    fd = os.memfd_create("bench-ceiling", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    mm = mmap.mmap(fd, nbytes)  # MAP_SHARED, as shm's sender maps the receiver's memfds
    view = np.frombuffer(mm, dtype=np.uint8)
    addr = int(view.ctypes.data)
    del view
    return Buffer(mm, Region(addr, nbytes), fd)


def permuted(src: int, dst: int, nbytes: int, block: int, rng) -> np.ndarray:
    n = nbytes // block
    return layout.build_descriptors([src], [dst], block, block, np.arange(n), rng.permutation(n))


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this whole process: every thread of it) for one call."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def bench_backend(backend: str, src, nbytes: int, repeat: int, rng, memcpy, threads: int = 1, **kw):
    """Per block size: (backend rate, memcpy rate, backend CPU s, memcpy CPU s), runs alternating
    between the two so that both see the same moments of a shared machine; best of ``repeat``
    each. ``memcpy(block, threads)`` times one ceiling run on ``threads`` threads."""
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE))
    proc = subprocess.Popen([sys.executable, __file__, "--serve", backend, str(nbytes)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        blob, addr = proc.stdout.readline().split()
        tx = create(backend, **({"ucx_env": UCX_ENV} if backend == "nixl" else {}), **kw)
        tx.start()
        try:
            tx.register(src.region)
            peer = tx.connect(base64.b64decode(blob))
            out = {}
            for block in BLOCKS:
                descs = permuted(src.region.addr, int(addr), nbytes, block, rng)
                t_mem, t_back = [], []
                for _ in range(repeat):
                    t_mem.append(memcpy(block, threads))
                    t_back.append(timed(lambda: tx.write(peer, descs, b"b", timeout=120).wait()))
                out[block] = (nbytes / min(w for w, _ in t_back), nbytes / min(w for w, _ in t_mem),
                              min(c for _, c in t_back), min(c for _, c in t_mem))
            return out
        finally:
            tx.close()
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--backends", default="shm,cma,tcp,nixl")
    ap.add_argument("--serve", nargs=2, metavar=("BACKEND", "NBYTES"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve[0], int(args.serve[1]))

    nbytes, rng = args.size_mib * MiB, np.random.default_rng(0)
    here = available()
    print(f"transport bench: {args.size_mib} MiB per transfer, best of {args.repeat}, "
          f"core={_core.IMPLEMENTATION}, {os.cpu_count()} CPUs, "
          f"huge pages {'advised' if hugepages_wanted() else 'off'}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    src = anon(nbytes)
    src.array[:] = 1
    ceiling: dict[tuple, float] = {}  # ((destination kind, ordered), threads, block) -> best
    cdst: dict = {}  # the ceiling's destination now: kind, buffer, descriptors per block size
    pool = ThreadPoolExecutor(max(1, os.cpu_count() or 1))

    def ceiling_destination(kind: str, ordered: bool) -> None:
        """The ceiling copies into the same kind of memory as the backend's destination: a
        memfd mapping for shm (shared memory; THP is off for it on this kernel), else private
        anonymous memory allocated as the transports allocate it. Faulted in before timing.
        ``ordered``: the rows in destination order, as cma copies them (layout.by_destination),
        so that both sides copy the same rows in the same order."""
        if cdst.get("kind") == (kind, ordered):
            return
        if cdst:
            cdst["buf"].close()
        buf = memfd(nbytes) if kind == "memfd" else anon(nbytes)
        buf.array[:] = 0
        descs = {b: permuted(src.region.addr, buf.region.addr, nbytes, b, rng) for b in BLOCKS}
        if ordered:
            descs = {b: layout.by_destination(d) for b, d in descs.items()}
        cdst.update(kind=(kind, ordered), buf=buf, descs=descs)
        for b in BLOCKS:  # warm up
            memcpy(b)

    def memcpy(block: int, threads: int = 1) -> float:
        """One ceiling run: the descriptors cut into ``threads`` parts of equal bytes (as the
        backends' copy threads cut them), each part copied by its own thread (GIL released)."""
        descs = cdst["descs"][block]
        parts = layout.split(descs, threads)

        def run():
            for f in [pool.submit(_core.copy_batch, p) for p in parts]:
                f.result()

        t, cpu = timed(run if threads > 1 else lambda: _core.copy_batch(descs))
        key = (cdst["kind"], threads, block)
        ceiling[key] = max(ceiling.get(key, 0.0), nbytes / t)
        return t, cpu

    results = {}
    for backend in args.backends.split(","):
        ok, why = here[backend]
        threads = getattr(create(backend), "threads", 1) if backend in ("cma", "shm") else 0
        label = f"{backend} ({threads} copy thread{'s' * (threads > 1)})" if threads else backend
        if ok:
            ceiling_destination("memfd" if backend == "shm" else "anon", ordered=backend == "cma")
        results[label] = (bench_backend(backend, src, nbytes, args.repeat, rng, memcpy,
                                        threads=max(1, threads)) if ok else why)
        if ok and threads > 1:  # also show what one thread does, against a one-thread ceiling
            results[f"{backend} (1 copy thread)"] = bench_backend(backend, src, nbytes, args.repeat,
                                                                   rng, memcpy, threads=1)
    pool.shutdown()
    if cdst:
        cdst["buf"].close()
    src.close()

    head = "| path | " + " | ".join(f"{b // KiB} KiB" if b < MiB else "1 MiB" for b in BLOCKS) + " |"
    rows = [head, "|---" * (len(BLOCKS) + 1) + "|"]
    names = {("anon", False): "into private memory", ("memfd", False): "into a memfd (shm's kind)",
             ("anon", True): "into private memory, rows in destination order (cma's)"}
    for kind, n in sorted({(k, n) for k, n, _ in ceiling}):
        rows.append(f"| memcpy ceiling {names[kind]}, {n} thread{'s' * (n > 1)} (best in run), GB/s | "
                    + " | ".join(f"{ceiling.get((kind, n, b), 0) / 1e9:.2f}" for b in BLOCKS) + " |")
    for backend, got in results.items():
        if isinstance(got, str):
            rows.append(f"| {backend} | not available here: {got} |")
        else:
            rows.append(f"| {backend}: x ceiling{' (2 threads)' if '2 copy' in backend else ''} (GB/s) | " + " | ".join(
                f"{got[b][0] / got[b][1]:.2f} ({got[b][0] / 1e9:.2f})" for b in BLOCKS) + " |")

    cpu_rows = [head.replace("| path |", "| one-sided path: ceiling CPU s / backend CPU s |"),
                "|---" * (len(BLOCKS) + 1) + "|"]
    for backend, got in results.items():
        if not isinstance(got, str) and backend.split()[0] in ("cma", "shm"):
            cpu_rows.append(f"| {backend} | " + " | ".join(
                f"{got[b][3] / got[b][2]:.2f}" for b in BLOCKS) + " |")

    planes, blocks, bb = 64, 1000, 64 * KiB
    sb = np.arange(planes, dtype=np.uint64) * np.uint64(blocks * bb) + np.uint64(1 << 30)
    db, si, di = sb + np.uint64(1 << 40), rng.permutation(blocks), rng.permutation(blocks)
    build = {}
    for name, fn in (("C", lambda: layout.build_descriptors(sb, db, bb, bb, si, di, core=_core.load("c"))),
                     ("Python twin", lambda: layout.build_descriptors(sb, db, bb, bb, si, di,
                                                                      core=_core.load("python"))),
                     ("numpy", lambda: layout.build_descriptors_numpy(sb, db, bb, bb, si, di))):
        build[name] = best(fn, 20 if name != "Python twin" else 3) * 1e3
    print()
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("\n".join(rows))
    print()
    print("CPU time of this (sending) process, best of each, same runs: a view less exposed to the "
          "other jobs' time slices (cma and shm only: their receiver does no copying):")
    print("\n".join(cpu_rows))
    print()
    print(f"descriptor build, {blocks} blocks x {planes} layers, permuted ({planes * blocks} descriptors):")
    print("| C | Python twin | numpy |\n|---|---|---|")
    print("| " + " | ".join(f"{build[k]:.3f} ms" for k in ("C", "Python twin", "numpy")) + " |")


if __name__ == "__main__":
    main()

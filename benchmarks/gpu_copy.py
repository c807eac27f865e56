"""Device-to-device copy ceiling on one GPU (torch), the reference for KV transfer GB/s.

    python -m benchmarks.gpu_copy [--gib 4] [--out copy.json]
Copies a --gib GiB buffer to another with torch (cudaMemcpy D2D), 3 warm-ups then 10 timed copies
with CUDA events; reports GB/s of data moved (bytes copied / time; read+write traffic is twice that).
"""
import argparse, json

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--gib", type=float, default=4.0)
ap.add_argument("--out", default=None)
a = ap.parse_args()
n = int(a.gib * 2 ** 30)
src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255)
dst = torch.empty_like(src)
for _ in range(3):
    dst.copy_(src)
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
times = []
for _ in range(10):
    s.record(); dst.copy_(src); e.record(); torch.cuda.synchronize()
    times.append(s.elapsed_time(e) / 1000)
t = sorted(times)[len(times) // 2]
res = {"bytes": n, "median_s": t, "copy_GB_per_s": round(n / t / 1e9, 1), "read_plus_write_GB_per_s": round(2 * n / t / 1e9, 1),
       "device": torch.cuda.get_device_name(), "torch": torch.__version__}
assert torch.equal(dst[:1 << 20], src[:1 << 20])
print("COPY_CEILING", json.dumps(res), flush=True)
if a.out:
    json.dump(res, open(a.out, "w"))

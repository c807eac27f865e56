#!/usr/bin/env bash
# GPU benchmark of pd-router on one H200 (issue 11); see docs/gpu.md.
#   bash benchmarks/gpu_bench.sh [BUDGET_S] [gpu_bench.py args ...]
# Expects the offline vLLM kit installed (/tmp/site, /tmp/gpukit: `bash .gp0/install.sh` and
# `bash .gp1/install.sh`) and /tmp/model (make_model.py, --max-pos 16384); made here if absent.
# Router wheels missing on the machine (orjson) are installed from .whl/ if it travelled.
# Writes results.json, results.md, bench.log, logs_tail.txt under $OUT (default /tmp/gpubench-out).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUDGET=${1:-540}; [ $# -gt 0 ] && shift
OUT=${OUT:-/tmp/gpubench-out}; mkdir -p "$OUT"
source /tmp/gpukit/env.sh
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v -i warning
fi
# the model may still be being made in the background by an earlier call
for i in $(seq 1 150); do [ -f /tmp/make_model.rc ] || [ ! -f /tmp/make_model.pid ] && break; sleep 1; done
if [ ! -f /tmp/model/config.json ] || [ ! -f /tmp/model/tokenizer.json ]; then
  echo "making /tmp/model"; python3 /tmp/gpukit/make_model.py /tmp/model --max-pos 16384 || exit 3
fi
python3 -c "import orjson, fastapi, uvicorn, zmq, aiohttp, httpx, msgpack, transformers, prometheus_client" || exit 3
[ -f /tmp/copy_ceiling.json ] || timeout 60 python3 benchmarks/gpu_copy.py --out /tmp/copy_ceiling.json
timeout -s INT $((${BUDGET%.*} + 25)) python3 -m benchmarks.gpu_bench --budget "$BUDGET" --out "$OUT" \
  --copy-ceiling /tmp/copy_ceiling.json "$@" 2>&1 | tee "$OUT/bench.log"
rc=${PIPESTATUS[0]}
{ for f in /tmp/gpubench-logs/*.log; do echo "===== $f"; grep -v -E "\"(GET|POST) /" "$f" | tail -n 30; grep -i -E "ucx|nixl|proto|transport|cuda_ipc" "$f" | grep -v -E "\"(GET|POST) /" | head -n 150; done; } > "$OUT/logs_tail.txt" 2>&1
nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>/dev/null | tail -n +2 | head
exit $rc

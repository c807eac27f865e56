#!/usr/bin/env bash
# Two-GPU goodput run of pd-router (issue 10) on the lent machine; see docs/gpu.md.
#   bash benchmarks/gpu_goodput.sh [gpu_goodput.py args ...]
# Expects the offline vLLM kit installed (/tmp/site, /tmp/gpukit: `bash .gp0/install.sh` and
# `bash .gp1/install.sh`) and the model in $MODEL (default /tmp/model), possibly still being made
# by an earlier call (make_model.py in the background writing /tmp/make_model.rc when done).
# Router wheels missing there (orjson) are installed from .whl/ if it travelled. Writes
# results.json, results.md, goodput.png, goodput.log and logs_tail.txt under $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/goodput-out}; mkdir -p "$OUT"
MODEL=${MODEL:-/tmp/model}
source /tmp/gpukit/env.sh
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v -i warning
fi
for i in $(seq 1 300); do [ -f /tmp/make_model.rc ] || [ ! -f /tmp/make_model.pid ] && break; sleep 1; done
[ -f /tmp/make_model.log ] && tail -n 3 /tmp/make_model.log
[ -f "$MODEL/config.json" ] && [ -f "$MODEL/tokenizer.json" ] || { echo "no model in $MODEL"; exit 3; }
python3 -c "import orjson, fastapi, uvicorn, zmq, aiohttp, httptools, msgpack, transformers, prometheus_client" || exit 3
python3 -m benchmarks.gpu_goodput --model "$MODEL" --out "$OUT" "$@" 2>&1 | tee -a "$OUT/goodput.log"
rc=${PIPESTATUS[0]}
{ for f in /tmp/goodput-logs/*.log; do echo "===== $f"; grep -v -E "\"(GET|POST) /" "$f" | tail -n 25;
    grep -i -E "error|ucx|nixl|max_num_batched|chunked" "$f" | grep -v -E "\"(GET|POST) /" | head -n 40; done; } > "$OUT/logs_tail.txt" 2>&1
nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv 2>/dev/null
exit $rc

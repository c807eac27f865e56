#!/usr/bin/env bash
# Quick start: install (first run only), then bring up a 1P1D topology (tiny model, CPU)
# behind pd-router on http://127.0.0.1:8000. Ctrl-C tears everything down.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/install.sh
exec .venv/bin/pd-router up "$@"

#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): run from the repository root on one GPU with no network.
#   python -m bench.gpu_pack          # first, where there is network: .gpu/ (carry it)
#   bash bench/gpu_check.sh           # flows, then speed (about 5 minutes on an H100)
#   bash bench/gpu_check.sh flows     # one part: flows | speed | extra
#   bash bench/gpu_check.sh --cpu     # every part reduced, on the CPU (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu/wheels
source bench/gpu_env.sh
exec "$PYTHON" -m bench.gpu_check "$@"

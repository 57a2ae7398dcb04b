#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): run from the repository root on one GPU with no network.
#   bash bench/gpu_check.sh bench    # part 1: fast-path bench, grouped GEMM, checkpoint stall
#   bash bench/gpu_check.sh train    # part 2: the real entrypoint with validation, bf16 vs fp32
#   bash bench/gpu_check.sh --cpu    # both parts, reduced, on the CPU (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" bench/gpu_check.py "$@"

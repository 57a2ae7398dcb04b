#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py): run from the repository root on one GPU with no network.
#   python -m bench.gpu_pack          # first, where there is network: .gpu/ (carry it)
#   bash bench/gpu_check.sh           # flows, then speed (about 5 minutes on an H100)
#   bash bench/gpu_check.sh flows     # one part: flows | speed | extra
#   bash bench/gpu_check.sh --cpu     # every part reduced, on the CPU (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if [ ! -x .venv/bin/python ] && [ -d .gpu/wheels ]; then
    # A machine with torch but not the toolkit's other packages: .gpu's wheels, beside it.
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu_check_site .gpu/wheels/*.whl
    export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
    export PATH=/tmp/gpu_check_site/bin:$PATH
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PYTHON" -m bench.gpu_check "$@"

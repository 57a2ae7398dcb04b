# Sourced by the GPU scripts: PYTHON, and on a machine with torch but not the toolkit's other
# packages (no .venv), the wheels in $WHEELS installed beside it (bench/gpu_pack.py packs them).
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if [ ! -x .venv/bin/python ] && [ -d "${WHEELS:-}" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu_check_site "$WHEELS"/*.whl
    export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
    export PATH=/tmp/gpu_check_site/bin:$PATH
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

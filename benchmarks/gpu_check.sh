#!/usr/bin/env bash
# The CUDA paths on a GPU machine, from the repository root, without network:
#   1. the package importable from src/ (no install), plus the wheels in .whl/ if that folder exists (fla-core for
#      the KDA kernels: `pip download fla-core==X -d .whl` on a machine with network), installed into /tmp/site;
#   2. the versions (torch, CUDA, Triton, fla) and `nvidia-smi -L`;
#   3. tests/ops/test_cuda.py (the CUDA paths against the CPU reference), under a hard timeout;
#   4. benchmarks/gpu_timing.py: k3-small training forward+backward tokens/s (bf16 autocast, fp32) and decode
#      tokens/s, under its own timeout. It runs whatever the tests did; both exit codes are reported at the end.
# Logs go to $OUT (else /tmp/gpu_check). Environment knobs, with their defaults:
#   TEST_TIMEOUT=240 TIMING_TIMEOUT=150  hard limits (s) of steps 3 and 4; PER_TEST_TIMEOUT=150 (pytest-timeout)
#   PYTEST_ARGS=""        extra pytest arguments, e.g. "-x" or "-k grouped_mm" (all tests by default: a first run
#                         on a rented GPU wants every failure at once, not the first)
#   TIMING_ARGS=""        extra gpu_timing.py arguments, e.g. "--quick" or "--dtypes bf16"
#   BUILD_CPU_KERNELS=0   0: the CPU side of the comparisons uses the torch ops (the reference; k3/ops/compiled.py
#                         builds nothing: CXX points at a failing compiler and TORCH_EXTENSIONS_DIR at an empty
#                         folder, so each kernel's `load` returns None at once instead of ≈ 40 s of g++ per
#                         kernel); 1: build the six kernels first, in parallel
set -u
cd "$(dirname "$0")/.."
LOG=${OUT:-/tmp/gpu_check}
mkdir -p "$LOG"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

if compgen -G ".whl/*.whl" >/dev/null; then
    echo "== installing $(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ')into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "gpu_check: wheel install FAILED (the fla tests will be skipped)"
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

echo "== versions"
"$PY" - <<'EOF' 2>&1 | tee "$LOG/env.log"
import importlib, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"cuda available: {torch.cuda.is_available()}"
      + (f", {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()})"
         if torch.cuda.is_available() else ""))
for name in ("triton", "fla", "einops"):
    try:
        print(f"{name} {importlib.import_module(name).__version__}")
    except Exception as err:
        print(f"{name}: not importable ({type(err).__name__}: {err})")
from k3.ops.kda.gpu import fla_kernels
print("k3 sees fla's KDA kernels:", fla_kernels() is not None)
EOF
nvidia-smi -L 2>&1 | tee -a "$LOG/env.log"

if [ "${BUILD_CPU_KERNELS:-0}" = 1 ]; then
    echo "== building the compiled CPU kernels (in parallel)"
    for k in kda matvec activation decode norm loss; do
        "$PY" -c "from k3.ops import compiled; m, why = compiled.build('$k'); print('$k', 'built' if m else why)" &
    done
    wait
else
    export CXX=/bin/false  # compiled.py's builds fail at once: the torch ops serve the CPU side
    export TORCH_EXTENSIONS_DIR=/tmp/k3_gpu_check_no_kernels  # nor load a build of another run (or wait on its lock)
fi

echo "== tests/ops/test_cuda.py (timeout ${TEST_TIMEOUT:-240} s)"
per_test=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then per_test=(--timeout "${PER_TEST_TIMEOUT:-150}"); fi
# shellcheck disable=SC2086
timeout -k 10 "${TEST_TIMEOUT:-240}" "$PY" -m pytest -q -rfEs -p no:cacheprovider --durations=12 "${per_test[@]}" \
    ${PYTEST_ARGS:-} tests/ops/test_cuda.py 2>&1 | tee "$LOG/pytest.log"
test_rc=${PIPESTATUS[0]}

echo "== benchmarks/gpu_timing.py (timeout ${TIMING_TIMEOUT:-150} s)"
# shellcheck disable=SC2086
timeout -k 10 "${TIMING_TIMEOUT:-150}" "$PY" benchmarks/gpu_timing.py ${TIMING_ARGS:-} 2>&1 | tee "$LOG/timing.log"
timing_rc=${PIPESTATUS[0]}

echo "== gpu_check: tests exit $test_rc, timing exit $timing_rc (124: timed out)" | tee -a "$LOG/timing.log"
[ "$test_rc" = 0 ] && [ "$timing_rc" = 0 ]

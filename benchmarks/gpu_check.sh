#!/usr/bin/env bash
# The CUDA paths on a GPU machine, from the repository root, without network:
#   1. the package importable from src/ (no install); the wheels in .whl/, if that folder exists (fla-core for the
#      KDA kernels: `pip download fla-core==X -d .whl` on a machine with network), installed into /tmp/site;
#   2. the versions (torch, CUDA, Triton, fla) and `nvidia-smi -L`;
#   3. tests/ops/test_cuda.py (the CUDA paths against the CPU reference) first without fla on the path (the torch
#      ops on CUDA: grouped matmul, whole model, decode, training step), then, where fla is there, again with it
#      (fla's kernels, and the model on them);
#   4. benchmarks/gpu_timing.py: k3-small training forward+backward tokens/s (bf16 autocast, fp32) and decode
#      tokens/s, with the torch ops (`--kda-impl chunk`), then with fla where it is there.
# Every step runs under its own hard timeout, whatever the earlier ones did; the exit codes are listed at the end.
# The fla steps come last: on 2026-12-04 (H200, torch 2.11, Triton 3.6, fla-core 0.6.0) the first `chunk_kda`
# call did not return within 120-210 s (Triton autotuning its kernels, or a hang: not established), so they must
# not starve the rest. Triton's autotuning is printed (TRITON_PRINT_AUTOTUNING) in the fla test log to tell.
# Logs go to $OUT (else /tmp/gpu_check). Environment knobs, with their defaults:
#   FLA=1                 0: skip the fla steps (3b, 4b) even where the wheels are there
#   TIMEOUTS="90 120 180 120"  hard limits (s) of steps 3a, 4a, 3b, 4b: ≈ 9 min at worst, ≈ 4 min with FLA=0
#   PER_TEST_TIMEOUT=150  pytest-timeout per fla test, thread method: a test stuck in a CUDA call gets its stack
#                         dumped (and the pytest run ends there)
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
BASE_PATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
WITH_FLA="$BASE_PATH:/tmp/site"
read -r T_PLAIN T_TIMING T_FLA T_FLA_TIMING <<<"${TIMEOUTS:-90 120 180 120}"
results=()

fla=0
if compgen -G ".whl/*.whl" >/dev/null; then
    echo "== installing $(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ')into /tmp/site"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl; then
        fla=${FLA:-1}
    else
        echo "gpu_check: wheel install FAILED (the fla steps are skipped)"
    fi
fi

echo "== versions"
PYTHONPATH=$WITH_FLA "$PY" - <<'EOF' 2>&1 | tee "$LOG/env.log"
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
grep -q "sees fla's KDA kernels: True" "$LOG/env.log" || fla=0  # e.g. no Triton (a CPU machine)

if [ "${BUILD_CPU_KERNELS:-0}" = 1 ]; then
    echo "== building the compiled CPU kernels (in parallel)"
    for k in kda matvec activation decode norm loss; do
        PYTHONPATH=$BASE_PATH "$PY" -c \
            "from k3.ops import compiled; m, why = compiled.build('$k'); print('$k', 'built' if m else why)" &
    done
    wait
else
    export CXX=/bin/false  # compiled.py's builds fail at once: the torch ops serve the CPU side
    export TORCH_EXTENSIONS_DIR=/tmp/k3_gpu_check_no_kernels  # nor load a build of another run (or wait on its lock)
fi

run_tests() {  # name, timeout, PYTHONPATH, extra pytest arguments...
    local name=$1 limit=$2 path=$3
    shift 3
    echo "== [$name] tests/ops/test_cuda.py (timeout $limit s)"
    # shellcheck disable=SC2086
    PYTHONPATH=$path timeout -k 10 "$limit" "$PY" -m pytest -v -rfEs -p no:cacheprovider --tb=short --durations=12 \
        "$@" ${PYTEST_ARGS:-} tests/ops/test_cuda.py 2>&1 | tee "$LOG/pytest_$name.log"
    results+=("tests $name: exit ${PIPESTATUS[0]}")
}

run_timing() {  # name, timeout, PYTHONPATH, extra gpu_timing.py arguments...
    local name=$1 limit=$2 path=$3
    shift 3
    echo "== [$name] benchmarks/gpu_timing.py (timeout $limit s)"
    # shellcheck disable=SC2086
    PYTHONPATH=$path timeout -k 10 "$limit" "$PY" benchmarks/gpu_timing.py "$@" ${TIMING_ARGS:-} 2>&1 \
        | tee "$LOG/timing_$name.log"
    results+=("timing $name: exit ${PIPESTATUS[0]}")
}

run_tests torch_ops "$T_PLAIN" "$BASE_PATH"
run_timing torch_ops "$T_TIMING" "$BASE_PATH" --kda-impl chunk
if [ "$fla" = 1 ]; then
    per_test=()
    if "$PY" -c "import pytest_timeout" 2>/dev/null; then
        per_test=(--timeout "${PER_TEST_TIMEOUT:-150}" -o timeout_method=thread)
    fi
    export TRITON_PRINT_AUTOTUNING=1
    run_tests fla "$T_FLA" "$WITH_FLA" "${per_test[@]}"
    unset TRITON_PRINT_AUTOTUNING
    run_timing fla "$T_FLA_TIMING" "$WITH_FLA" --kda-impl fla
fi

echo "== gpu_check (124: timed out)" | tee "$LOG/summary.log"
printf '%s\n' "${results[@]}" | tee -a "$LOG/summary.log"
! printf '%s\n' "${results[@]}" | grep -qv 'exit 0$'

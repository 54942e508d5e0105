#!/usr/bin/env bash
# The tests whose outcome depends on the CPU (the C++ kernels, the own GEMMs, the one-call decoder layers, the
# linears' dispatch, the fault tests that patch a Python path), once per CPU path this machine can execute
# besides its own (`make test` runs that one): each class below its own through CBP_CPU_MAX_ISA (the C++ kernels
# built without the instructions above it, every choice made as on such a CPU: an AVX-512 machine runs what an
# AVX2-only user gets), and on an AVX512-BF16 CPU without AMX, AMX's dispatch (oneDNN linears, the Python layer
# loop, float32 Q K^T) through CBP_CPU_OWN_GEMM=0 CBP_CPU_QK_DOT=0. Each forced class builds the kernels once
# (1.5-3 minutes on 2 cores; cached in a folder of its own). Usage: bash scripts/test_cpu_paths.sh [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
TESTS=(tests/test_cpu_fused_ops.py tests/test_cpu_gemm_f32.py tests/test_cpu_kernels.py tests/test_cpu_linear.py
       tests/test_kernels.py tests/test_decoder_one_call.py tests/test_faults.py tests/test_faults_engine.py
       tests/test_invariance_demo.py)
mapfile -t classes < <("$PY" -c 'from kernels.cpu_features import executable_classes as c; print(*c(), sep="\n")')
own=${classes[${#classes[@]}-1]:-}
echo "== CPU classes this machine can execute: ${classes[*]:-none} (its own: ${own:-below AVX2})"
run() {
  local what=$1
  shift
  echo "== the CPU-dependent tests $what"
  # the own bfloat16 GEMM's long-sum checks (its arithmetic: one source for every AVX-512 build, checked by
  # `make test`; about a minute each on 2 cores) are left out here
  env "$@" "$PY" -m pytest -q -k "not long_sums" "${TESTS[@]}"
}
for cap in "${classes[@]}"; do
  [ "$cap" = "$own" ] && continue
  run "as on a CPU of class $cap (CBP_CPU_MAX_ISA=$cap)" CBP_CPU_MAX_ISA="$cap"
done
if [ "$own" = avx512_bf16 ]; then
  run "with AMX's dispatch (CBP_CPU_OWN_GEMM=0 CBP_CPU_QK_DOT=0)" CBP_CPU_OWN_GEMM=0 CBP_CPU_QK_DOT=0
fi

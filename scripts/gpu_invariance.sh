#!/usr/bin/env bash
# GPU check of batch invariance and of the Triton RMSNorm (issue 20, goals 3 and 5, on CUDA): run on the
# device machine at the repository root; no model files or wheels need to travel (random-weight models).
#
#   bash scripts/gpu_invariance.sh            tests (about 4 minutes on an H200)
#   STEPS=bench bash scripts/gpu_invariance.sh   python -m bench.gpu_decode (W64: graphs, eager,
#                                               batch-invariant, transformers' continuous batching)
#   STEPS="tests bench" ...                     both
# (with carry=[".whl"] when .whl/ holds wheels to install first, see below)
# Logs go to $OUT (the device tool sets it; ./out otherwise).

set -x
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET CBP_ATTENTION_BACKEND
OUT="${OUT:-./out}"
mkdir -p "$OUT"
PY="${PY:-python3}"
STEPS="${STEPS:-tests}"
START=$SECONDS
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
pt() { timeout -k 10 "$1" "$PY" -m pytest -q -rfEs -p no:cacheprovider "${@:2}"; }

# optional wheels in .whl (git-ignored, named in the call's carry), e.g. the pinned transformers for
# bench.gpu_decode's transformers continuous batching run: installed offline into /tmp/site
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  "$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0)); print('triton', triton.__version__, 'transformers', transformers.__version__)"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

if [[ " $STEPS " == *" tests "* ]]; then
  pt 240 tests/test_batch_invariance_cuda.py 2>&1 | tee "$OUT/invariance.log"
  summary "batch invariance cuda: rc=$? ($(tail -n 1 "$OUT/invariance.log"))  t=$((SECONDS - START))s"
  pt 120 tests/test_kernels.py -k "batch_invariant or rms_norm or mixed_batch or split_kv or edge or dispatch or cuda" \
    2>&1 | tee "$OUT/kernels.log"
  summary "kernels: rc=$? ($(tail -n 1 "$OUT/kernels.log"))  t=$((SECONDS - START))s"
  pt 150 tests/test_equivalence.py tests/test_static_decode.py -k "random_weights or cuda_graph" 2>&1 | tee "$OUT/equivalence.log"
  summary "equivalence + static decode (cuda): rc=$? ($(tail -n 1 "$OUT/equivalence.log"))  t=$((SECONDS - START))s"
fi
if [[ " $STEPS " == *" bench "* ]]; then
  timeout -k 10 "${BENCH_S:-240}" "$PY" -m bench.gpu_decode --json "$OUT/gpu_decode.json" 2>&1 | grep -v Warning \
    | tee "$OUT/gpu_decode.log"
  summary "gpu_decode: rc=$?  t=$((SECONDS - START))s"
fi
summary "total: $((SECONDS - START)) s"

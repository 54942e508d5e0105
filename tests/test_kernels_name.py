"""Our folder ``kernels/`` has the name of a PyPI package that transformers probes for (``kernels``,
the Hugging Face hub kernels library). Run from the repository root, our package is the one imported;
transformers must then still see the hub library as absent (our package has no distribution metadata)
and load the default GGUF model as usual."""

from __future__ import annotations

import importlib.metadata
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_our_kernels_package_is_the_one_imported():
    import kernels

    assert pathlib.Path(kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
    assert hasattr(kernels, "paged_attention") and hasattr(kernels, "reshape_and_cache")


def test_transformers_does_not_take_our_kernels_for_the_hub_library():
    from transformers.utils.import_utils import is_kernels_available

    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("kernels")  # never install the hub library beside this checkout
    assert not is_kernels_available()


def test_transformers_still_loads_the_default_model(real_model):
    import kernels

    model, tokenizer = real_model
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert tokenizer.eos_token_id == 2
    assert pathlib.Path(kernels.__file__).resolve().parent == ROOT / "kernels"

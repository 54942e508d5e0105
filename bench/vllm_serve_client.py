"""vLLM's serving benchmark client, as a small script (runs in ``.venv-peers``).

``bench/peers.py --http`` drives both HTTP servers (ours and vLLM's OpenAI server) with this same
client: vLLM's own ``vllm.benchmarks.serve`` (``add_cli_args`` + ``main``; the CPU wheel's ``vllm``
console script fails on its package metadata, so ``vllm bench serve`` is not used). Every argument is
``vllm bench serve``'s, plus ``--out PATH``::

    .venv-peers/bin/python -P bench/vllm_serve_client.py --out R.json --base-url http://127.0.0.1:8000 \
        --model .peers/smollm2-hf --served-model-name smollm2 --dataset-name random \
        --random-input-len 256 --random-output-len 128 --num-prompts 64 --request-rate inf --ignore-eos

The summary (per-request lists dropped) goes to ``--out`` and to stdout as one line
``@@PEERS_RESULT {...}``.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]  # bench/ modules must not shadow other packages

import json  # noqa: E402

RESULT_PREFIX = "@@PEERS_RESULT "
_LISTS = ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors", "start_times", "latencies",
          "queue_times")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out = None
    if "--out" in argv:
        i = argv.index("--out")
        out = argv[i + 1]
        del argv[i:i + 2]
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # older releases
        from vllm.utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser(description="vLLM's serving benchmark client")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    res = serve_main(args) or {}
    errors = [e for e in res.get("errors", []) if e]
    summary = {k: v for k, v in res.items() if k not in _LISTS}
    summary["num_errors"] = len(errors)
    summary["first_errors"] = errors[:3]
    if out:
        with open(out, "w") as f:
            json.dump(summary, f)
    print(RESULT_PREFIX + json.dumps(summary, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

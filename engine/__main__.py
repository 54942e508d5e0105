"""Command line: ``python -m engine "prompt" ...`` prints completions and a one-line summary.

Examples::

    python -m engine "What is the capital of France?"
    python -m engine --num-prompts 32 --policy static          # built-in chats, mixed max_tokens
    python -m engine --workload bench/w64.json                    # the reference workload W64
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

from engine.llm import LLM
from engine.options import add_engine_options, add_help_switches, engine_kwargs
from engine.prompts import chat_prompts, mixed_max_tokens
from engine.request import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_help_switches(p)
    p.add_argument("prompts", nargs="*", help="chat messages (each is sent as one user turn)")
    p.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    p.add_argument("--num-prompts", type=int, default=0, help="add N built-in chat prompts with mixed max_tokens (16..256)")
    p.add_argument("--workload", help="a W64-style JSON file (requests with prompt_token_ids and max_tokens)")
    add_engine_options(p, env=os.environ)  # CBP_* variables, as the app reads them
    p.add_argument("--max-tokens", type=int, default=128,
                   help="tokens to generate per prompt given on the command line (the built-in prompts of "
                        "--num-prompts and --workload requests keep their own)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                                                           "whose probability reaches this (1: off)")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens (-1: off)")
    p.add_argument("--seed", type=int, default=None, help="per-request seed: the same seed gives the same tokens")
    p.add_argument("--ignore-eos", action="store_true", help="generate max_tokens even past the end-of-sequence token")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ValueError as e:  # a CBP_* variable that does not parse
        argparse.ArgumentParser(prog="python -m engine").error(str(e))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in ("engine", "kernels"):  # the model load and the kernel build say what they do (never silent)
        logging.getLogger(name).setLevel(logging.INFO)
    prompts: list = []
    params: list[SamplingParams] = []

    def sp(max_tokens: int, ignore_eos: bool) -> SamplingParams:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              max_tokens=max_tokens, ignore_eos=ignore_eos)

    for text in args.prompts:
        prompts.append(text if args.raw else [{"role": "user", "content": text}])
        params.append(sp(args.max_tokens, args.ignore_eos))
    if args.num_prompts:
        for msgs, mt in zip(chat_prompts(args.num_prompts), mixed_max_tokens(args.num_prompts)):
            prompts.append(msgs)
            params.append(sp(mt, True))
    if args.workload:
        with open(args.workload) as f:
            for r in json.load(f)["requests"]:
                prompts.append(r["prompt_token_ids"])
                params.append(sp(r["max_tokens"], True))
    if not prompts:
        prompts.append([{"role": "user", "content": "What is the capital of France?"}])
        params.append(sp(args.max_tokens, args.ignore_eos))

    llm = LLM(**engine_kwargs(args))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    if not args.quiet:
        for i, o in enumerate(outs):
            print(f"--- [{i}] ({len(o.token_ids)} tokens, {o.finish_reason})\n{o.text}")
    st = llm.engine.stats()
    gen = sum(len(o.token_ids) for o in outs)
    print(
        f"summary: policy={args.policy} dtype={st.dtype} requests={len(outs)} steps={st.step_count} "
        f"generated_tokens={gen} time={elapsed:.2f}s tokens/s={gen / elapsed:.1f} "
        f"peak_blocks_used={st.peak_used_blocks}/{st.num_blocks} idle_slot_steps={st.idle_batch_slot_steps} "
        f"preemptions={st.num_preemptions}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
import sys
import time

from engine.llm import LLM
from engine.prompts import chat_prompts, mixed_max_tokens
from engine.request import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompts", nargs="*", help="chat messages (each is sent as one user turn)")
    p.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    p.add_argument("--num-prompts", type=int, default=0, help="add N built-in chat prompts with mixed max_tokens (16..256)")
    p.add_argument("--workload", help="a W64-style JSON file (requests with prompt_token_ids and max_tokens)")
    p.add_argument("--model", default=None, help="model folder, .gguf file or hub id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, help="bfloat16, float32 or float16 (default: auto)")
    p.add_argument("--device", default=None)
    p.add_argument("--policy", default="continuous", choices=["continuous", "static"])
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", default=None, help="e.g. 512MiB, or 0.5 for half the free memory")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
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

    llm = LLM(model=args.model, dtype=args.dtype, device=args.device, policy=args.policy,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              block_size=args.block_size, num_blocks=args.num_blocks, kv_cache_memory=args.kv_cache_memory,
              enable_prefix_caching=not args.no_prefix_caching)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    if not args.quiet:
        for i, o in enumerate(outs):
            print(f"--- [{i}] ({len(o.token_ids)} tokens, {o.finish_reason})\n{o.text}")
    eng = llm.engine
    gen = sum(len(o.token_ids) for o in outs)
    tel = eng.telemetry
    print(
        f"summary: policy={args.policy} dtype={eng.runner.dtype} requests={len(outs)} steps={eng.step_count} "
        f"generated_tokens={gen} time={elapsed:.2f}s tokens/s={gen / elapsed:.1f} "
        f"peak_blocks_used={eng.peak_used_blocks}/{eng.kv.num_blocks} idle_slot_steps={tel.total_idle_slot_steps} "
        f"preemptions={eng.scheduler.num_preemptions}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Do running chats keep streaming while a long prompt is prefilled? (``python -m bench.latency``)

Runs, on one engine: (1) the long prompt alone (``max_tokens=1``): its prefill time; (2) ``--chats``
chats decoding ``--chat-tokens`` tokens, with the same-length long prompt arriving once every chat has
its first ``--arrive-after`` tokens. Prints, over every gap between two consecutive tokens of a chat,
the median and the 99th percentile (and their ratio), and the long prompt's time to first token
against its prefill time alone. Greedy, EOS ignored; the prompts are random token ids (no prefix-cache
hits). The engine's own options (``--prefill-chunk-tokens``, ``--max-num-batched-tokens``, ...) apply.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from bench.metrics import percentile
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.options import add_engine_options, engine_kwargs
from engine.request import SamplingParams


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 49000) for _ in range(n)]


def _run(core: EngineCore, prompts: dict[str, tuple[list[int], int]], late: tuple[str, list[int]] | None,
         arrive_after: int) -> dict[str, list[float]]:
    """Step ``core`` until every request is done; returns per request the times of its tokens (and
    ``"<id>:arrival"``, the time the late request was added)."""
    times: dict[str, list[float]] = {rid: [] for rid in prompts}
    for rid, (ids, n) in prompts.items():
        core.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    pending_late = late
    while core.has_unfinished_requests() or pending_late:
        for out in core.step():
            now = time.perf_counter()
            times.setdefault(out.request_id, [])
            times[out.request_id].extend([now] * (len(out.token_ids) - len(times[out.request_id])))
        if pending_late and all(len(times[r]) >= arrive_after for r in prompts):
            rid, ids = pending_late
            times[rid + ":arrival"] = [time.perf_counter()]
            core.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            pending_late = None
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chats", type=int, default=8, help="chats decoding (default: 8)")
    p.add_argument("--chat-tokens", type=int, default=96, help="tokens each chat generates (default: 96)")
    p.add_argument("--chat-prompt-tokens", type=int, default=40, help="prompt tokens of each chat (default: 40)")
    p.add_argument("--long-tokens", type=int, default=4000, help="tokens of the long prompt (default: 4000)")
    p.add_argument("--arrive-after", type=int, default=8,
                   help="chat tokens before the long prompt arrives (default: 8)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    add_engine_options(p)
    args = p.parse_args(argv)
    core = EngineCore(EngineConfig.from_kwargs(**engine_kwargs(args)))
    # warm-up, then the long prompt alone
    _run(core, {"warm": (_prompt(args.long_tokens, 1), 2)}, None, 0)
    t0 = time.perf_counter()
    t = _run(core, {"alone": (_prompt(args.long_tokens, 2), 1)}, None, 0)
    alone_s = t["alone"][0] - t0
    chats = {f"chat{i}": (_prompt(args.chat_prompt_tokens, 100 + i), args.chat_tokens) for i in range(args.chats)}
    t = _run(core, chats, ("long", _prompt(args.long_tokens, 4)), args.arrive_after)
    arrival, first = t["long:arrival"][0], t["long"][0]
    gaps = [b - a for rid in chats for a, b in zip(t[rid], t[rid][1:])]
    med, p99 = percentile(gaps, 50), percentile(gaps, 99)
    res = {"chats": args.chats, "long_tokens": args.long_tokens, "prefill_chunk_tokens": core.config.prefill_chunk_tokens,
           "gap_median_ms": 1000 * med, "gap_p99_ms": 1000 * p99, "gap_max_ms": 1000 * max(gaps),
           "p99_over_median": p99 / med, "long_ttft_s": first - arrival, "long_alone_s": alone_s,
           "ttft_over_alone": (first - arrival) / alone_s, "dtype": str(core.runner.dtype)}
    print(f"dtype={res['dtype']} prefill_chunk_tokens={res['prefill_chunk_tokens']} chats={args.chats} "
          f"long prompt={args.long_tokens} tokens")
    print(f"gap between two tokens of a chat: median {res['gap_median_ms']:.1f} ms, p99 {res['gap_p99_ms']:.1f} ms "
          f"(p99/median {res['p99_over_median']:.2f}), max {res['gap_max_ms']:.1f} ms")
    print(f"long prompt: TTFT {res['long_ttft_s']:.2f} s with the chats running, prefill alone "
          f"{res['long_alone_s']:.2f} s (ratio {res['ttft_over_alone']:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

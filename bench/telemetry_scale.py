"""What telemetry and the block map cost as the KV pool grows (``python -m bench.telemetry_scale``).

For each pool size an engine runs 8 greedy requests x 64 tokens at a time (new ones replace the finished)
for a full telemetry ring (512 steps) and reports, per step, the time spent recording telemetry (the KV
events' provenance, the snapshot and ``Telemetry.record``: ``Telemetry.observe``) and the step outside the forward; the ring's memory (deep
size of the kept snapshots plus the KV history's two states); and the block map of the newest step: build
time (rebuilding the per-block state from the events included) and its Plotly JSON bytes. Snapshots keep
no per-block tuples at any pool size: the block map's per-block state is rebuilt from the KV events.

The model is a random 2-layer Llama (hidden 64, 2 KV heads: 8 KiB of KV per 16-token block, float32),
so even 360,000 blocks fit in memory (2.9 GiB): the pool is real, the forward is tiny, and telemetry
does not depend on the model. A last line draws a synthetic worst case: every block of a 360,000-block
pool held, by 2,000 requests.
"""

from __future__ import annotations

import argparse
import array
import statistics
import sys
import time
from collections import deque

import numpy as np

SIZES = (384, 4_096, 32_768, 131_072, 360_000)


def deep_size(obj, seen: set[int] | None = None) -> int:
    """Bytes of ``obj`` and everything it references, each object once (tuples, lists, dicts, sets,
    dataclasses, arrays, numpy arrays)."""
    seen = set() if seen is None else seen
    stack, total = [obj], 0
    while stack:
        o = stack.pop()
        if id(o) in seen or o is None or isinstance(o, type):
            continue
        seen.add(id(o))
        if isinstance(o, np.ndarray):
            total += o.nbytes + 112
            continue
        total += sys.getsizeof(o)
        if isinstance(o, (str, bytes, bytearray, int, float, bool, array.array)):
            continue
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (tuple, list, set, frozenset, deque)):
            stack.extend(o)
        else:
            if hasattr(o, "__dict__"):
                stack.append(o.__dict__)
            for name in getattr(type(o), "__slots__", ()):
                stack.append(getattr(o, name, None))
    return total


def tiny_model(vocab_size: int):
    from engine import tiny_random_llama

    return tiny_random_llama(vocab_size)


def run(model, tokenizer, num_blocks: int, steps: int = 512, warmup: int = 40) -> dict:
    """One pool size: recording ms per step, step ms outside the forward, ring and history bytes, block map
    (build ms with the per-block state rebuilt, JSON bytes; a look-back to the middle of the ring)."""
    from bench.workloads import render_chat
    from engine.config import EngineConfig
    from engine.core import EngineCore
    from engine.prompts import chat_prompts
    from engine.request import SamplingParams
    from ui import figures

    cfg = EngineConfig(num_blocks=num_blocks, block_size=16, max_num_seqs=8, telemetry_capacity=steps, dtype="float32")
    core = EngineCore(cfg, model=model, tokenizer=tokenizer)
    prompts = [render_chat(tokenizer, m) for m in chat_prompts(64)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    rec: list[float] = []
    real = core.telemetry.observe

    def timed(view):
        t = time.perf_counter()
        real(view)
        rec.append(time.perf_counter() - t)

    core.telemetry.observe = timed  # type: ignore[method-assign]
    n = live = 0
    for _ in range(warmup + steps):
        while live < 8:
            core.add_request(f"r{n}", prompts[n % len(prompts)], params)
            n += 1
            live += 1
        live -= sum(1 for o in core.step() if o.finished)
    snaps = core.telemetry.snapshots()
    outside = [1000 * (s.duration - s.forward_time) for s in snaps]
    hist = core.telemetry.kv_history
    seen: set[int] = {id(hist)}  # the snapshots refer to the history: counted apart
    history = deep_size([hist.base, hist.head], seen)  # the two replay states
    ring = deep_size(list(snaps), seen)
    last = snaps[-1]
    colors = figures.default_colors(snaps)
    builds, size = [], 0
    for _ in range(5):
        core.telemetry.kv_history._views.clear()  # include rebuilding the per-block state from the events
        t = time.perf_counter()
        text = figures.spec_json(figures.block_map_spec(last, colors, height=280))
        builds.append(time.perf_counter() - t)
        size = len(text)
    old = snaps[len(snaps) // 2]  # a look-back: replayed from the ring's base
    core.telemetry.kv_history._views.clear()
    t = time.perf_counter()
    figures.spec_json(figures.block_map_spec(old, colors, height=280))
    look_back = time.perf_counter() - t
    return {"num_blocks": num_blocks, "record_ms": 1000 * statistics.median(rec[warmup:]),
            "record_p99_ms": 1000 * float(np.percentile(rec[warmup:], 99)),
            "outside_ms": statistics.median(outside), "ring_mib": ring / 2**20, "history_mib": history / 2**20,
            "map_ms": 1000 * statistics.median(builds), "map_kb": size / 1000, "look_back_ms": 1000 * look_back}


def worst_case_map(num_blocks: int = 360_000, requests: int = 2_000) -> dict:
    """Every block held (ids like ``chat-0123abcd``), some shared, reused and prefix hits: the map's bound."""
    from engine.kv_events import BlockTake
    from engine.telemetry import StepSnapshot
    from ui import figures

    per = num_blocks // requests
    tables = {f"chat-{i:04d}abcd": tuple(range(i * per, (i + 1) * per)) for i in range(requests)}
    ref = [1] * num_blocks
    snap = StepSnapshot(step=9, time=0.0, duration=0.0, forward_time=0.0, batch_slots=(), block_tables=tables,
                        block_refcount=tuple(ref), block_tokens=(16,) * num_blocks, block_reuses=(1,) * num_blocks,
                        cached_blocks=frozenset(), num_running=requests, num_waiting=0, num_scheduled_tokens=0,
                        num_generated_tokens=0, num_preemptions=0, cache_hit_blocks=frozenset(range(0, num_blocks, 7)),
                        block_takes=tuple(BlockTake(b, "x", 9, "new") for b in range(0, num_blocks, 97)))
    colors = figures.default_colors([snap])
    t = time.perf_counter()
    text = figures.spec_json(figures.block_map_spec(snap, colors, height=280))
    return {"map_ms": 1000 * (time.perf_counter() - t), "map_kb": len(text) / 1000}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="*", default=list(SIZES), help="pool sizes (blocks)")
    ap.add_argument("--steps", type=int, default=512, help="steps timed (the ring's length)")
    args = ap.parse_args(argv)
    import torch

    from engine.model_loader import load_tokenizer

    torch.set_num_threads(1)
    tokenizer = load_tokenizer(None)
    model = tiny_model(len(tokenizer))
    print("pool: real KV tensors of a random 2-layer Llama (8 KiB per 16-token block); 8 greedy requests x 64 tokens")
    print("record: ms per step in Telemetry.observe (provenance of the events, StepSnapshot, Telemetry.record), median and p99;")
    print("ring: the 512 kept snapshots; history: the KV history's two replay states; map: newest step's block map")
    print(f"{'blocks':>8} {'record ms':>10} {'p99 ms':>7} {'outside fwd ms':>15} {'ring MiB':>9} "
          f"{'history MiB':>12} {'map ms':>7} {'map KB':>7} {'look-back ms':>13}")
    for n in args.sizes:
        r = run(model, tokenizer, n, steps=args.steps)
        print(f"{n:>8,} {r['record_ms']:>10.3f} {r['record_p99_ms']:>7.3f} {r['outside_ms']:>15.2f} {r['ring_mib']:>9.2f} "
              f"{r['history_mib']:>12.2f} {r['map_ms']:>7.1f} {r['map_kb']:>7.1f} {r['look_back_ms']:>13.1f}", flush=True)
    w = worst_case_map()
    print(f"worst case, 360,000 blocks all held by 2,000 requests (synthetic snapshot): map {w['map_ms']:.1f} ms, "
          f"{w['map_kb']:.1f} KB")


if __name__ == "__main__":
    main()

"""Counters are counted when they happen, exact at any finish rate (tiny random model, CPU).

Before: ``request_success_total`` and every per-request histogram were read back at each scrape from a ring of
the last 2,048 finished requests, so 2,300 one-token requests between two scrapes moved ``request_success``
by 2,048 (and ``prompt_tokens`` by all of them); and a preempted request looked the prefix cache up again when
recomputed, counting its own freed blocks as hits (16 requests, 5 preemptions, no shared block: 6.2%).
"""

from __future__ import annotations

import asyncio

import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import SamplingParams
from server.metrics import EngineMetrics

torch.set_num_threads(1)

N_REQUESTS = 5000


def _sample(metrics: EngineMetrics, name: str, **labels) -> float:
    metrics.render()
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


def test_five_thousand_requests_between_two_scrapes_are_all_counted(tiny_model, tokenizer):
    engine = AsyncEngine(EngineCore(EngineConfig(num_blocks=512, block_size=16, max_num_seqs=64,
                                                 max_num_batched_tokens=2048), model=tiny_model, tokenizer=tokenizer))
    try:
        metrics = EngineMetrics(engine, "m")
        assert engine.telemetry.max_finished < N_REQUESTS  # more than the ring keeps
        before = {name: _sample(metrics, name) for name in ("cbp:prompt_tokens_total", "cbp:generation_tokens_total")}
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

        async def run_all():
            engine.max_pending = None
            sem = asyncio.Semaphore(256)

            async def one(i: int):
                async with sem:
                    return await engine.generate_text([5 + i % 100, 7, 9], params)

            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(N_REQUESTS))), 300)

        outs = asyncio.run(run_all())
        assert all(o.finish_reason == "length" for o in outs)
        success = _sample(metrics, "cbp:request_success_total", finished_reason="length")
        assert success == N_REQUESTS
        assert _sample(metrics, "cbp:e2e_request_latency_seconds_count") == N_REQUESTS
        assert _sample(metrics, "cbp:time_to_first_token_seconds_count") == N_REQUESTS
        assert _sample(metrics, "cbp:request_prompt_tokens_sum") == 3 * N_REQUESTS
        assert _sample(metrics, "cbp:prompt_tokens_total") - before["cbp:prompt_tokens_total"] == 3 * N_REQUESTS
        assert _sample(metrics, "cbp:generation_tokens_total") - before["cbp:generation_tokens_total"] == N_REQUESTS
        assert _sample(metrics, "vllm:request_success_total", finished_reason="length", engine="0") == N_REQUESTS
        assert _sample(metrics, "vllm:request_generation_tokens_count", engine="0") == N_REQUESTS
    finally:
        engine.shutdown()


def test_prefix_cache_counts_each_request_once_even_when_preempted(tiny_model, tokenizer):
    """16 requests with prompts that share no block, on a pool too small for them all: preemptions happen, and
    the recomputed requests find their own freed blocks in the cache; that is no hit: queries are each
    request's prompt once, hits zero."""
    eng = EngineCore(EngineConfig(num_blocks=24, block_size=4, max_num_seqs=8, enable_prefix_caching=True),
                     model=tiny_model, tokenizer=tokenizer)
    prompts = [[100 + 40 * i + j for j in range(9)] for i in range(16)]  # distinct from the first token on
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.scheduler.num_preemptions > 0
    assert eng.kv.prefix_queries == sum(len(p) for p in prompts)
    assert eng.kv.prefix_hits == 0
    snap = eng.telemetry.latest()
    assert (snap.prefix_cache_queries, snap.prefix_cache_hits) == (eng.kv.prefix_queries, 0)

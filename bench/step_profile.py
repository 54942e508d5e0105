"""Where one decode step of our engine spends its time (``python -m bench --profile``).

The profiler is introspective by nature: it wraps the engine's parts (the scheduler's ``schedule`` and
update, the runner's batch packing, the sampler, the output and telemetry steps, the attention kernels)
with timers for a few steps, then puts them back. A part the engine no longer has is left out (its time
then counts as "other (step glue)"), so the profile runs across engine refactors.
Times in milliseconds per step.
"""

from __future__ import annotations

import gc
import time

from bench.metrics import engine_forward_clock
from bench.workloads import render_chat
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.prompts import chat_prompts
from engine.request import SamplingParams
from kernels.cpu_linear import Linear


def profile_decode_step(model, tokenizer, num_requests: int = 64, context: int = 150, steps: int = 5,
                        torch_profile: bool = True, **engine_args) -> dict:
    """Where one decode step at ``num_requests`` running requests spends its time.

    ``num_requests`` requests (built-in prompts, EOS ignored) are prefilled and decoded until their
    contexts reach about ``context`` tokens; then ``steps`` decode steps are timed with each part of
    the step wrapped: scheduling, packing the batch (``ModelRunner.prepare``), the model forward (split
    into attention and the rest), sampling, the scheduler's update (``Scheduler.update_from_output``),
    the text step (``OutputProcessor.process_tokens``: detokenizing, stop strings), outputs and telemetry
    (``Telemetry.observe``). Where the own forward runs its layers in one C++ call, that call's own timers
    split its linears and its attention (cache writes included). With ``torch_profile`` one more step runs
    under ``torch.profiler`` and its top operators are returned as a printed table.

    Returns:
        ``{"parts_ms": {part: mean ms per step}, "step_ms": mean, "num_running": n, "context": tokens,
        "forward_ms": mean ms in the model's forward, "torch_table": str or None, "tokens_per_s": decode
        tokens/s at this batch, "forward": which forward ran, "floor": :func:`step_floor` measured in the
        same run}``.

    Raises:
        ValueError: the KV pool cannot hold every request at ``context + steps`` tokens at once (they would
            preempt each other and the warm-up would never end).
    """
    engine_args.setdefault("max_num_seqs", max(64, num_requests))
    core = EngineCore(EngineConfig.from_kwargs(**engine_args), model=model, tokenizer=tokenizer)
    _fill_to_context(core, tokenizer, num_requests, context, steps)
    acc: dict[str, float] = {}
    originals = _wrap_parts(core, acc)
    # the own forward's layers in one C++ call (engine/models/llama.py) call no Python per kernel: the call
    # times its linears and attention itself
    own = core.runner.own_forward
    one_call = own is not None and own.one_call_plan() is not None
    if one_call:
        import torch

        own.timings = torch.zeros(3, dtype=torch.float64)
    clock = engine_forward_clock(core)
    _, f0 = clock.read()
    t = time.perf_counter()
    for _ in range(steps):
        core.step()
    total = time.perf_counter() - t
    _, f1 = clock.read()
    if one_call:
        lin_s, attn_s, _rest = own.timings.tolist()
        own.timings = None
        acc["linear layers (own forward)"] = acc.get("linear layers (own forward)", 0.0) + lin_s  # + the LM head's calls
        acc["attention (paged_attention)"] = acc.get("attention (paged_attention)", 0.0) + attn_s  # cache writes included
    _unwrap_parts(originals)
    parts = _parts_ms(acc, f1 - f0, total, steps)
    table = None
    if torch_profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            core.step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
    ctx = sum(r.num_tokens for r in core.scheduler.running) / max(1, len(core.scheduler.running))
    out = {"parts_ms": parts, "step_ms": 1000 * total / steps, "num_running": len(core.scheduler.running),
           "context": ctx, "forward_ms": 1000 * (f1 - f0) / steps, "torch_table": table,
           "tokens_per_s": len(core.scheduler.running) / (total / steps),
           "forward": "own" if core.runner.own_forward is not None else "transformers",
           "floor": step_floor(model, len(core.scheduler.running), ctx, machine_rates(core.runner.dtype))}
    del core
    gc.collect()
    return out


def _fill_to_context(core: EngineCore, tokenizer, num_requests: int, context: int, steps: int) -> None:
    """Add ``num_requests`` requests and step until all of them run with at least ``context`` tokens.

    Raises:
        ValueError: the pool cannot hold them all at ``context + steps`` tokens (see :func:`profile_decode_step`).
    """
    prompts = [render_chat(tokenizer, m) for m in chat_prompts(num_requests)]
    max_tokens = context + steps + 8
    need = sum(core.kv.blocks_needed(len(ids) + max_tokens) for ids in prompts)
    have = core.kv.pool.num_blocks
    if need > have:  # the requests would preempt each other and never all reach `context` together
        raise ValueError(f"{num_requests} requests at context {context} need {need} KV blocks of "
                         f"{core.kv.block_size} tokens; the pool has {have} (raise --kv-cache-memory or "
                         f"--num-blocks, or lower --profile-context)")
    for i, ids in enumerate(prompts):
        core.add_request(f"p{i}", ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    while True:
        core.step()
        running = core.scheduler.running
        if len(running) == num_requests and min(r.num_tokens for r in running) >= context:
            return


def _wrap_parts(core: EngineCore, acc: dict[str, float]) -> list[tuple]:
    """Wrap each part of the step with a timer that adds its seconds to ``acc[part]``; returns what
    :func:`_unwrap_parts` needs to put the originals back. A part the engine does not have is left out (its
    time then counts as "other (step glue)"), so that the profile runs across engine refactors."""
    import kernels

    def wrap(obj, name, part):
        fn = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[part] = acc.get(part, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed)
        return fn

    targets = [
        (core.scheduler, "schedule", "schedule"),
        (core.runner, "prepare", "prepare (pack batch)"),
        (core.sampler, "sample", "sample"),
        (core.scheduler, "update_from_output", "update_from_output"),
        (core.output_processor, "process_tokens", "detokenize (output processor)"),
        (core, "_outputs", "outputs"),
        (core.telemetry, "observe", "telemetry"),
        (kernels, "paged_attention", "attention (paged_attention)"),
        (kernels, "reshape_and_cache", "attention (cache write)"),
        (Linear, "__call__", "linear layers (own forward)"),
    ]
    return [(obj, name, wrap(obj, name, part)) for obj, name, part in targets if hasattr(obj, name)]


def _unwrap_parts(originals: list[tuple]) -> None:
    """Put back what :func:`_wrap_parts` wrapped."""
    import kernels

    for obj, name, fn in originals:
        if obj is kernels or isinstance(obj, type):
            setattr(obj, name, fn)  # a module function or a class's method: put the original back
        elif name in vars(obj):
            delattr(obj, name)  # an instance attribute shadowing the method: remove it


def _parts_ms(acc: dict[str, float], fwd: float, total: float, steps: int) -> dict[str, float]:
    """Milliseconds per step of each part in ``acc`` (seconds over ``steps`` steps), with the forward's rest
    (``fwd`` seconds minus attention and linears) and the step's glue (``total`` minus all of it)."""
    attn = acc.get("attention (paged_attention)", 0.0) + acc.get("attention (cache write)", 0.0)
    parts = {k: 1000 * v / steps for k, v in acc.items()}
    lin = acc.get("linear layers (own forward)", 0.0)
    parts["forward: norms, RoPE, SiLU, embedding" if lin else "forward: linear layers, norms, RoPE, lm_head"] = \
        1000 * (fwd - attn - lin) / steps
    outside = sum(v for k, v in acc.items() if not k.startswith(("attention", "linear")))
    parts["other (step glue)"] = 1000 * (total - fwd - outside) / steps
    return parts


def machine_rates(dtype, seconds: float = 2.0) -> dict:
    """This machine's matmul rate and memory bandwidth, measured now (for the step's physical floor).

    The matmul rate is the best of three ways to multiply in ``dtype``, each timed best-of-many:
    ``torch.mm`` on ``[2048 x 2048] x [2048 x 2048]``, and the engine's own linear
    (:class:`kernels.cpu_linear.Linear`: oneDNN-prepacked where it packs) on ``[2048 x 576] x [576 x 3072]``
    and on the decode step's own ``[64 x 576] x [576 x 3072]`` (SmolLM2's gate/up projection at 64 rows).
    A floor must not lie above what the machine does: on some CPUs (a 2-core Xeon without AMX, bfloat16)
    ``torch.mm`` alone ran at 89-149 GFLOP/s while the prepacked linear ran at 145-171.

    Returns:
        ``{"matmul_gflops": the best GFLOP/s, "matmul_by": {way: GFLOP/s}, "bandwidth_gbs": best GB/s
        (bytes read + written) of copying a 256 MiB tensor}``.
    """
    import torch

    from kernels.cpu_linear import Linear

    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    def best(fn, budget: float) -> float:
        fn()
        ts, end = [], time.perf_counter() + budget
        while time.perf_counter() < end or len(ts) < 3:
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return min(ts)

    a, b = rnd(2048, 2048), rnd(2048, 2048)
    by = {"mm 2048x2048x2048": 2 * 2048**3 / best(lambda: torch.mm(a, b), seconds / 4) / 1e9}
    lin = Linear(rnd(3072, 576))
    for rows in (2048, 64):
        x = rnd(rows, 576)
        by[f"linear {rows}x576x3072"] = 2 * rows * 576 * 3072 / best(lambda: lin(x), seconds / 4) / 1e9  # noqa: B023
    src = torch.empty(64 * 1024 * 1024, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    cp = best(lambda: dst.copy_(src), seconds / 4)
    return {"matmul_gflops": max(by.values()), "matmul_by": by, "bandwidth_gbs": 2 * src.numel() * 4 / cp / 1e9}


def step_floor(model, num_rows: int, context: float, rates: dict) -> dict:
    """The physical floor of one decode step of ``num_rows`` sequences of mean ``context`` tokens:
    (FLOPs of the step / matmul rate) + (KV bytes read / memory bandwidth), in milliseconds.

    FLOPs: 2 x rows x the weights of the decoder's linear layers and the LM head, plus attention's
    4 x rows x context x heads x head_dim per layer. KV bytes: every row reads its context's K and V in
    every layer."""
    from engine.model_runner import kv_cache_shape, linear_parameters

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers, kvh, hd = kv_cache_shape(model.config)
    linear = linear_parameters(model)
    elem = next(model.parameters()).element_size()
    flops = 2 * num_rows * linear + 4 * num_rows * context * cfg.num_attention_heads * hd * layers
    kv_bytes = num_rows * context * layers * kvh * hd * 2 * elem
    compute_ms = 1000 * flops / (rates["matmul_gflops"] * 1e9)
    memory_ms = 1000 * kv_bytes / (rates["bandwidth_gbs"] * 1e9)
    return {"gflop": flops / 1e9, "kv_mb": kv_bytes / 1e6, "compute_ms": compute_ms, "memory_ms": memory_ms,
            "floor_ms": compute_ms + memory_ms, **rates}


def print_profile(p: dict) -> None:
    """Print :func:`profile_decode_step`'s result."""
    print(f"\n== one decode step: {p['num_running']} running requests, mean context {p['context']:.0f} tokens, "
          f"{p.get('forward', '?')} forward ==")
    print(f"step {p['step_ms']:.1f} ms ({p['tokens_per_s']:.0f} tokens/s at this batch), "
          f"model forward {p['forward_ms']:.1f} ms ({100 * p['forward_ms'] / p['step_ms']:.1f}% of the step)")
    f = p.get("floor")
    if f:
        print(f"physical floor {f['floor_ms']:.1f} ms = {f['gflop']:.1f} GFLOP at {f['matmul_gflops']:.0f} GFLOP/s "
              f"({f['compute_ms']:.1f} ms) + {f['kv_mb']:.0f} MB of KV at {f['bandwidth_gbs']:.0f} GB/s "
              f"({f['memory_ms']:.1f} ms); step / floor = {p['step_ms'] / f['floor_ms']:.2f}")
        if f.get("matmul_by"):
            print("  matmul rate, best of: " + ", ".join(f"{k} {v:.0f}" for k, v in f["matmul_by"].items()) + " GFLOP/s")
    for k, v in sorted(p["parts_ms"].items(), key=lambda kv: -kv[1]):
        print(f"  {k:<46} {v:8.2f} ms  {100 * v / p['step_ms']:5.1f}%")
    if p.get("torch_table"):
        print("\ntorch.profiler, one step, top operators by self CPU time:")
        print(p["torch_table"])


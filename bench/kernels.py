"""Benchmark the paged-attention kernels on a GPU: ``python -m bench.kernels [--engine] [--sweep]``.

What it measures (NVIDIA GPU only; on a machine without CUDA it says so and exits 0):

* the device's copy bandwidth: a large device-to-device copy (bytes read + bytes written over time),
  the practical ceiling for a memory-bound kernel;
* ``paged_attention`` (Triton) at realistic shapes: SmolLM2-135M's heads (9 query, 3 KV, dim 64) and a
  larger model's (32 query, 8 KV, dim 128), bfloat16, block size 16, shuffled block tables; batches of
  decode sequences with contexts 128..8192, prompt prefills and a mixed batch. For each case: the
  median time over many runs (CUDA events around each launch, L2 flushed before each), the bytes of
  K/V the kernel must read over that time, that bandwidth as a fraction of the copy bandwidth, the
  torch path's time on the same GPU and the speed-up, and the largest difference between the two
  outputs (a sanity check, not the test);
* ``reshape_and_cache`` for a decode step and a long prefill;
* ``--sweep``: a few tile / warp / stage / split settings per case, to tune ``_default_config``;
* ``--engine``: end-to-end generated tokens/s of ``engine.llm.LLM`` on 64 prompts (one-line plain-text
  prompts from :func:`engine.prompts.plain_prompts`; greedy, 128 new tokens each, EOS ignored), with the
  Triton attention and then with the torch attention; a failure there is printed and does not hide the
  kernel numbers.

(Inside this module ``kernels`` is the project's kernel package, not this file: imports are absolute.)
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
import traceback

import torch

import kernels
from engine.prompts import plain_prompts
from kernels import torch_ops

MODELS = {
    "smollm2-135m": dict(num_heads=9, num_kv_heads=3, head_dim=64),
    "32h-8kv-d128": dict(num_heads=32, num_kv_heads=8, head_dim=128),
}
DECODE_CASES = [(1, 8192), (8, 8192), (64, 128), (64, 512), (64, 2048), (64, 8192), (256, 1024)]
QUICK_DECODE_CASES = [(1, 8192), (64, 512), (64, 4096)]
# (name, [(context_len, q_len), ...]): prompts from scratch, a chunk after cached context, a mixed step
PREFILL_CASES = [
    ("prefill 4x2048", [(2048, 2048)] * 4),
    ("chunk 2048@6144", [(8192, 2048)]),
    ("mixed 64x1024+512", [(1024, 1)] * 64 + [(1536, 512)]),
]


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------
class Timer:
    """Median device time of a callable: CUDA events around each call, L2 flushed before each."""

    def __init__(self, device: torch.device):
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20) or (64 << 20)
        self.flush_buf = torch.empty(max(4 * l2, 256 << 20), dtype=torch.uint8, device=device)

    def __call__(self, fn, iters: int = 50, warmup: int = 5) -> float:
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            self.flush_buf.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) / 1e3  # seconds


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        dst.copy_(src)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


# ------------------------------------------------------------------------------------------------
# cases
# ------------------------------------------------------------------------------------------------
def make_case(seqs, num_heads, num_kv_heads, head_dim, block_size=16, dtype=torch.bfloat16, device="cuda", seed=0):
    """``seqs``: list of (context_len, q_len). Returns (args tuple, kwargs with host lists, kv bytes, flops)."""
    g = torch.Generator(device=device).manual_seed(seed)
    nblk = [math.ceil(c / block_size) for c, _ in seqs]
    num_blocks = sum(nblk)
    perm = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32)
    bt = torch.zeros(len(seqs), max(nblk), dtype=torch.int32, device=device)
    i = 0
    for b, n in enumerate(nblk):
        bt[b, :n] = perm[i : i + n]
        i += n
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    kc = torch.randn(shape, device=device, dtype=dtype, generator=g)
    vc = torch.randn(shape, device=device, dtype=dtype, generator=g)
    qlens = [q for _, q in seqs]
    q = torch.randn(sum(qlens), num_heads, head_dim, device=device, dtype=dtype, generator=g)
    seq_lens = torch.tensor([c for c, _ in seqs], dtype=torch.int32, device=device)
    qsl_list = [0]
    for n in qlens:
        qsl_list.append(qsl_list[-1] + n)
    qsl = torch.tensor(qsl_list, dtype=torch.int32, device=device)
    kw = {"seq_lens_list": [c for c, _ in seqs], "query_start_loc_list": qsl_list}
    elem = torch.finfo(dtype).bits // 8
    kv_bytes = sum(c for c, _ in seqs) * num_kv_heads * head_dim * elem * 2  # K and V, each read once
    # causal attention flops: 2 matmuls x 2 flops per multiply-add, per (query, visible key, head, dim)
    flops = sum(4 * head_dim * num_heads * sum(c - qn + i + 1 for i in range(qn)) for c, qn in seqs)
    return (q, kc, vc, bt, seq_lens, qsl, head_dim**-0.5), kw, kv_bytes, flops


def _fmt_t(s: float) -> str:
    return f"{s * 1e6:9.1f} us" if s < 1e-2 else f"{s * 1e3:9.2f} ms"


def bench_attention(timer, copy_bw, models, decode_cases, prefill_cases, iters, sweep, results):
    from kernels import triton_ops

    print("\n== paged_attention (bfloat16, block_size 16) ==")
    print(f"{'model':14} {'case':24} {'splits':>6} {'triton':>12} {'GB/s':>7} {'of copy':>7} {'TFLOP/s':>7} "
          f"{'torch':>12} {'speed-up':>8} {'max|diff|':>9}")
    for mname, m in models.items():
        cases = [(f"decode {b}x{c}", [(c, 1)] * b) for b, c in decode_cases] + list(prefill_cases)
        for cname, seqs in cases:
            try:
                args, kw, kv_bytes, flops = make_case(seqs, **m)
                out = torch.empty_like(args[0])
                cfg = _describe(triton_ops, args, kw)
                t_tri = timer(functools.partial(triton_ops.paged_attention, *args, out=out, **kw), iters=iters)
                ref = torch_ops.paged_attention(*args, **kw)
                tri = triton_ops.paged_attention(*args, **kw)
                diff = (tri.float() - ref.float()).abs().max().item()
                t_ref = timer(functools.partial(torch_ops.paged_attention, *args, **kw), iters=max(5, iters // 5),
                              warmup=2)
                bw = kv_bytes / t_tri
                row = dict(model=mname, case=cname, splits=cfg["num_splits"], triton_s=t_tri, torch_s=t_ref,
                           kv_bytes=kv_bytes, gbps=bw / 1e9, frac_copy=bw / copy_bw, tflops=flops / t_tri / 1e12,
                           speedup=t_ref / t_tri, max_abs_diff=diff)
                results.append(row)
                print(f"{mname:14} {cname:24} {cfg['num_splits']:>6} {_fmt_t(t_tri)} {bw / 1e9:7.0f} "
                      f"{bw / copy_bw:7.2f} {flops / t_tri / 1e12:7.1f} {_fmt_t(t_ref)} {t_ref / t_tri:8.1f} "
                      f"{diff:9.1e}", flush=True)
                if sweep:
                    _sweep(timer, triton_ops, args, kw, kv_bytes, copy_bw, iters, t_tri)
                del args, out, ref, tri
                torch.cuda.empty_cache()
            except Exception as e:  # keep going: one failing case must not hide the others
                print(f"{mname:14} {cname:24} FAILED: {type(e).__name__}: {e}", flush=True)
                traceback.print_exc()


def _describe(triton_ops, args, kw) -> dict:
    """The configuration ``paged_attention`` picks for these arguments."""
    q, kc, _, bt, seq_lens = args[:5]
    return triton_ops.plan_attention(q, kc, bt, seq_lens.shape[0], **kw)


def _sweep(timer, triton_ops, args, kw, kv_bytes, copy_bw, iters, t_default):
    head_dim = args[0].shape[2]
    qsl = kw["query_start_loc_list"]
    decode = max(qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)) == 1
    variants = []
    for tile_n in (32, 64, 128):
        for num_warps in (4, 8):
            for num_stages in (2, 3):
                if tile_n == 128 and head_dim == 128 and num_warps == 4:
                    continue
                variants.append(dict(tile_n=tile_n, num_warps=num_warps, num_stages=num_stages))
    if decode:
        variants += [dict(num_splits=s) for s in (1, 4, 16, 64)]
    else:
        variants += [dict(block_m=bm, num_warps=nw) for bm in (16, 128) for nw in (4, 8)]
    best = (t_default, "default")
    for v in variants:
        try:
            t = timer(functools.partial(triton_ops.paged_attention, *args, **kw, **v), iters=max(10, iters // 3),
                      warmup=2)
        except Exception as e:
            print(f"    sweep {v}: {type(e).__name__}: {str(e)[:100]}")
            continue
        print(f"    sweep {str(v):58} {_fmt_t(t)}  {kv_bytes / t / copy_bw:5.2f} of copy")
        if t < best[0]:
            best = (t, str(v))
    print(f"    best: {best[1]} {_fmt_t(best[0])} (default {_fmt_t(t_default)})", flush=True)


def bench_cache_write(timer, copy_bw, iters, results):
    from kernels import triton_ops

    print("\n== reshape_and_cache (bfloat16, 8 KV heads, dim 128, block_size 16) ==")
    kvh, d, bs = 8, 128, 16
    for n in (64, 8192):
        try:
            num_blocks = max(2 * n // bs, 1024)
            kc = torch.randn(num_blocks, kvh, bs, d, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            k = torch.randn(n, kvh, d, device="cuda", dtype=torch.bfloat16)
            v = torch.randn_like(k)
            slots = torch.randperm(num_blocks * bs, device="cuda")[:n]
            t_tri = timer(functools.partial(triton_ops.reshape_and_cache, k, v, kc, vc, slots), iters=iters)
            t_ref = timer(functools.partial(torch_ops.reshape_and_cache, k, v, kc, vc, slots), iters=iters)
            moved = 2 * (2 * n * kvh * d * 2)  # K and V, read once and written once
            results.append(dict(case=f"reshape_and_cache {n}", triton_s=t_tri, torch_s=t_ref,
                                frac_copy=moved / t_tri / copy_bw))
            print(f"{n:6} tokens: triton {_fmt_t(t_tri)} ({moved / t_tri / 1e9:6.0f} GB/s, "
                  f"{moved / t_tri / copy_bw:4.2f} of copy)   torch {_fmt_t(t_ref)}   speed-up {t_ref / t_tri:5.1f}",
                  flush=True)
        except Exception as e:
            print(f"{n:6} tokens: FAILED: {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()


# ------------------------------------------------------------------------------------------------
# end to end
# ------------------------------------------------------------------------------------------------
def _count_generated(outputs, fallback: int) -> tuple[int, bool]:
    """Generated tokens in ``LLM.generate``'s result, whatever its exact shape; (count, exact?)."""
    total = 0
    try:
        for o in outputs:
            ids = None
            for path in (("outputs", 0, "token_ids"), ("token_ids",), ("output_token_ids",)):
                cur = o
                try:
                    for p in path:
                        cur = cur[p] if isinstance(p, int) or isinstance(cur, dict) else getattr(cur, p)
                    ids = cur
                    break
                except (AttributeError, KeyError, IndexError, TypeError):
                    continue
            if ids is None:
                return fallback, False
            total += len(ids)
        return total, True
    except TypeError:
        return fallback, False


def bench_engine(num_prompts: int, max_tokens: int, model: str | None, results) -> None:
    print(f"\n== engine end to end: {num_prompts} prompts, greedy, {max_tokens} new tokens each, EOS ignored ==",
          flush=True)
    try:
        from engine.llm import LLM

        try:
            from engine.llm import SamplingParams
        except ImportError:
            from engine.request import SamplingParams
        kwargs = dict(dtype="bfloat16", device="cuda")
        if model:
            kwargs["model"] = model
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        print(f"engine loaded in {time.perf_counter() - t0:.1f} s", flush=True)
        prompts = plain_prompts(num_prompts)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        saved = kernels._FORCED
        try:
            for backend in ("triton", "torch"):
                try:
                    kernels.set_backend(backend)
                    # warm-up on the same prompts: Triton compiles each kernel variant on first use
                    # (prefill and decode tile shapes, split counts); keep that out of the timing
                    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    outs = llm.generate(prompts, params)
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    n, exact = _count_generated(outs, num_prompts * max_tokens)
                    results.append(dict(case=f"engine {backend}", tokens=n, seconds=dt, tokens_per_s=n / dt))
                    print(f"attention={backend:6}: {n} tokens{'' if exact else ' (assumed)'} in {dt:.2f} s = "
                          f"{n / dt:8.1f} tokens/s", flush=True)
                except Exception as e:
                    print(f"attention={backend}: FAILED: {type(e).__name__}: {e}", flush=True)
                    traceback.print_exc()
        finally:
            kernels.set_backend(saved)
    except Exception as e:
        print(f"engine bench FAILED: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc()


# ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Benchmark the paged-attention kernels on a GPU.")
    ap.add_argument("--engine", action="store_true", help="also measure the engine's end-to-end tokens/s")
    ap.add_argument("--engine-only", action="store_true", help="only the engine measurement")
    ap.add_argument("--model", default=None, help="passed to LLM(model=...) for --engine (default: the engine's)")
    ap.add_argument("--prompts", type=int, default=64, help="prompts for --engine (default 64)")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt for --engine (default 128)")
    ap.add_argument("--sweep", action="store_true", help="time alternative tile/warp/stage/split settings per case")
    ap.add_argument("--quick", action="store_true", help="fewer decode cases")
    ap.add_argument("--iters", type=int, default=50, help="timed runs per measurement (median reported)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {list(MODELS)}")
    ap.add_argument("--json", default=None, help="also write all numbers to this JSON file")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench.kernels needs a CUDA GPU (none found); nothing to measure.")
        return 0
    import triton

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"device: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
          f"torch {torch.__version__}, triton {triton.__version__}", flush=True)
    results: list[dict] = []
    if not args.engine_only:
        copy_bw = copy_bandwidth(dev)
        print(f"device-to-device copy: {copy_bw / 1e9:.0f} GB/s (bytes read + written)", flush=True)
        results.append(dict(case="copy", bytes_per_s=copy_bw))
        timer = Timer(dev)
        models = {k: MODELS[k] for k in args.models.split(",") if k in MODELS}
        bench_attention(timer, copy_bw, models, QUICK_DECODE_CASES if args.quick else DECODE_CASES, PREFILL_CASES,
                        args.iters, args.sweep, results)
        bench_cache_write(timer, copy_bw, args.iters, results)
        del timer
        torch.cuda.empty_cache()
    if args.engine or args.engine_only:
        bench_engine(args.prompts, args.max_tokens, args.model, results)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"device": props.name, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

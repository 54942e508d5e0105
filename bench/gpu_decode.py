"""The decode step at GPU speed: our engine with and without the static-buffer / CUDA-graph decode path,
against transformers' continuous batching, in one run (issue: GPU scale, goal 3).

    python -m bench.gpu_decode [--device cuda] [--dtype bfloat16] [--json out.json]
    python -m bench.gpu_decode --device cpu --tiny --n 8     (a smoke run of the same code on CPU)

The model is SmolLM2-135M built from its config with random weights (the device machine has no
network and no GGUF; tokens/s with EOS ignored does not depend on the weights), the tokenizer a
synthetic word-level one over the same vocabulary (only detokenization uses it), the workload W64's token
ids (``bench/w64.json``: 64 requests, greedy, EOS ignored). Prints, per system: generated tokens/s,
the median decode step with 64 requests running (ms), and for the graph path the capture time and
memory; the graph path once more in batch-invariant mode (its cost); then the ratios (static / eager,
batch-invariant / default, ours / transformers' continuous batching). Every mode first runs once on a
few short requests (Triton compiles its kernels then), and the timed runs of the modes are interleaved
``--repeat`` times; the best run of each is printed, all of them are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.workloads import load_workload
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import SamplingParams

W64 = "bench/w64.json"
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def random_model(device: str, dtype: torch.dtype, tiny: bool = False, seed: int = 0):
    """SmolLM2-135M (or the engine's 2-layer toy, :func:`engine.tiny_random_llama`) from its config with random
    weights, on ``device`` in ``dtype``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine import tiny_random_llama

    if tiny:
        return tiny_random_llama(SMOLLM2_135M["vocab_size"], seed=seed, max_positions=2048, dtype=dtype, device=device)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(device=device, dtype=dtype).eval()


def synthetic_tokenizer(vocab_size: int):
    """A word-level tokenizer whose token ``i`` is the word ``t{i}`` (no files, no network)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", pad_token="t0", unk_token="t0")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_engine(model, tokenizer, requests, static: str, device: str, **engine_args) -> dict:
    """W64 through a fresh :class:`EngineCore`; every step timed (seconds, synchronized on CUDA)."""
    t0 = time.perf_counter()
    core = EngineCore(EngineConfig(max_num_seqs=64, static_decode=static, **engine_args), model=model,
                      tokenizer=tokenizer)
    build_s = time.perf_counter() - t0
    for r in requests:
        core.add_request(r.request_id, r.prompt_token_ids,
                         SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True))
    steps: list[tuple[float, int, int]] = []  # (seconds, requests scheduled, tokens computed)
    _sync(device)
    start = time.perf_counter()
    while core.has_unfinished_requests():
        t = time.perf_counter()
        core.step()
        _sync(device)
        snap = core.telemetry.latest()
        steps.append((time.perf_counter() - t, snap.num_running if snap else 0, snap.num_scheduled_tokens if snap else 0))
    wall = time.perf_counter() - start
    gen = sum(r.max_tokens for r in requests)
    full = [s for s, running, tokens in steps if running == len(requests) and tokens == running]
    static_runner = core.runner.static
    bi = engine_args.get("batch_invariant", False)
    return {
        "system": f"ours (static_decode={static}{', batch_invariant' if bi else ''})",
        "tokens_per_s": gen / wall,
        "wall_s": wall,
        "steps": len(steps),
        "decode_step_ms_at_full_batch": 1000 * statistics.median(full) if full else None,
        "full_batch_steps": len(full),
        "engine_build_s": build_s,
        "graphs": bool(static_runner and static_runner.use_graphs),
        "capture_s": static_runner.capture_seconds if static_runner else 0.0,
        "graph_memory_mib": (static_runner.graph_memory_bytes / 2**20) if static_runner else 0.0,
    }


def run_hf(model, tokenizer, requests) -> dict:
    """transformers' continuous batching on the same workload (its own model instance)."""
    from bench.metrics import summarize
    from bench.systems import run_hf_cb

    run = run_hf_cb(model, tokenizer, requests, max_requests_per_batch=64)
    s = summarize(run)
    return {"system": "transformers continuous batching", "tokens_per_s": s["tokens_per_s"], "wall_s": run.wall,
            "steps": len(run.steps)}


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--n", type=int, default=64, help="requests of W64 to run (default all 64)")
    p.add_argument("--max-tokens", type=int, default=None, help="cap every request's max_tokens (quick runs)")
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy model instead of SmolLM2-135M (smoke runs)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' continuous batching")
    p.add_argument("--repeat", type=int, default=2, help="timed runs of each mode, interleaved (the best is shown)")
    p.add_argument("--json", default=None, help="write the results here")
    a = p.parse_args(argv)
    dtype = getattr(torch, a.dtype)
    requests = load_workload(W64, n=a.n, max_tokens_cap=a.max_tokens)
    tok = synthetic_tokenizer(49152)
    model = random_model(a.device, dtype, a.tiny)
    kv = {"kv_cache_memory": "2GiB"} if a.device.startswith("cuda") else {"num_blocks": 1024}
    modes = (("on", False), ("off", False), ("on", True))
    # warm-up: every mode once on a few short requests, so that no timed run pays Triton's compiles
    short = load_workload(W64, n=min(8, a.n), max_tokens_cap=4)
    for static, bi in modes:
        run_engine(model, tok, short, static, a.device, batch_invariant=bi, **kv)
    runs: dict[tuple, list[dict]] = {m: [] for m in modes}
    for _ in range(a.repeat):  # modes interleaved, so a drift of the machine touches all of them
        for static, bi in modes:
            runs[(static, bi)].append(run_engine(model, tok, requests, static, a.device, batch_invariant=bi, **kv))
    results = []
    for m in modes:
        r = max(runs[m], key=lambda x: x["tokens_per_s"])  # the best of the repeats
        r["tokens_per_s_runs"] = [x["tokens_per_s"] for x in runs[m]]
        r["decode_step_ms_runs"] = [x["decode_step_ms_at_full_batch"] for x in runs[m]]
        results.append(r)
        print(f"{r['system']:38} {r['tokens_per_s']:9.0f} tokens/s  decode step at {a.n} running: "
              f"{r['decode_step_ms_at_full_batch'] or float('nan'):.2f} ms  graphs={r['graphs']} "
              f"capture {r['capture_s']:.1f} s, {r['graph_memory_mib']:.0f} MiB  (runs: "
              + ", ".join(f"{t:.0f}" for t in r["tokens_per_s_runs"]) + " tokens/s)", flush=True)
    if not a.no_hf:
        try:
            h = run_hf(random_model(a.device, dtype, a.tiny), tok, requests)
            results.append(h)
            print(f"{h['system']:38} {h['tokens_per_s']:9.0f} tokens/s", flush=True)
        except Exception as e:  # transformers' API moves; the ratio then says so
            print(f"transformers continuous batching failed: {e!r}")
    on, off, inv = results[0], results[1], results[2]
    print(f"static / eager tokens/s: {on['tokens_per_s'] / off['tokens_per_s']:.2f}x")
    print(f"batch-invariant / default tokens/s (static): {inv['tokens_per_s'] / on['tokens_per_s']:.2f}x")
    if len(results) > 3:
        print(f"ours (static) / transformers continuous batching: {on['tokens_per_s'] / results[3]['tokens_per_s']:.2f}x")
    env = {"device": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu", "dtype": a.dtype,
           "torch": torch.__version__, "transformers": _transformers_version(), "n": a.n, "tiny": a.tiny}
    print(json.dumps(env))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

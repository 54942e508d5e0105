"""vLLM's side of ``bench/peers.py``: runs in ``.venv-peers`` (vLLM's CPU build), never in the project venv.

The driver writes the workloads to a JSON file and starts this script as a subprocess::

    .venv-peers/bin/python -P bench/vllm_worker.py --model .peers/smollm2-hf --spec SPEC.json \
        --out RESULT.json [--dtype bfloat16] [--threads 2] [--kv-cache-gib 2]

SPEC.json: ``{"check": [ids], "w64": [{"prompt_token_ids": [...], "max_tokens": N}, ...],
"prefill": {"prompt_token_ids": [...], "warmup_token_ids": [...]}, "mixed": [{...}, ...],
"warmup": [{...}]}`` (each key optional). Every request is greedy with EOS ignored, so each produces
exactly ``max_tokens`` tokens. The results (JSON) go to ``--out`` and to stdout as one line
``@@PEERS_RESULT {...}``.

It uses only vLLM's public offline API: ``LLM(model=..., dtype=..., max_num_seqs=...)``,
``LLM.generate`` with ``TokensPrompt`` and ``SamplingParams(temperature=0, max_tokens=, ignore_eos=True)``.
vLLM's CPU backend reads ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache; else it takes most of the RAM) and
``VLLM_CPU_OMP_THREADS_BIND`` (cores to bind its threads to; else it leaves one core idle): this script
sets both before importing vLLM, from ``--kv-cache-gib`` and ``--threads``. vLLM starts processes, so
everything runs under ``if __name__ == "__main__"``.
"""

from __future__ import annotations

import os
import sys

# Run as `python bench/vllm_worker.py`, bench/ would come first on the path and its modules (kernels.py)
# would shadow other packages: drop it (the driver also passes -P).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

RESULT_PREFIX = "@@PEERS_RESULT "


def _params(SamplingParams, req: dict):
    kw = {"logprobs": int(req["logprobs"])} if req.get("logprobs") else {}
    return SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]), ignore_eos=req.get("ignore_eos", True), **kw)


def _generate(llm, SamplingParams, TokensPrompt, reqs: list[dict]) -> tuple[float, list]:
    prompts = [TokensPrompt(prompt_token_ids=list(r["prompt_token_ids"])) for r in reqs]
    params = [_params(SamplingParams, r) for r in reqs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def _engine_info(llm) -> dict:
    info = {}
    try:
        cfg = llm.llm_engine.vllm_config
        info["max_num_batched_tokens"] = cfg.scheduler_config.max_num_batched_tokens
        info["max_num_seqs"] = cfg.scheduler_config.max_num_seqs
        info["enable_chunked_prefill"] = cfg.scheduler_config.enable_chunked_prefill
        info["enable_prefix_caching"] = cfg.cache_config.enable_prefix_caching
        info["block_size"] = cfg.cache_config.block_size
        info["dtype"] = str(cfg.model_config.dtype).replace("torch.", "")
    except Exception as e:  # attribute names move between vLLM releases: the info is optional
        info["error"] = repr(e)
    return info


def run(args) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    if args.threads:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    try:
        from vllm.inputs import TokensPrompt
    except ImportError:  # older releases: a plain dict is the same prompt
        def TokensPrompt(prompt_token_ids):  # noqa: N802
            return {"prompt_token_ids": prompt_token_ids}

    with open(args.spec) as f:
        spec = json.load(f)
    res: dict = {"system": "vllm", "vllm_version": vllm.__version__, "torch_version": torch.__version__,
                 "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")}}
    kw = dict(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, seed=0)
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.max_model_len:
        kw["max_model_len"] = args.max_model_len
    t0 = time.perf_counter()
    llm = LLM(**kw)
    res["load_s"] = time.perf_counter() - t0
    res["engine"] = _engine_info(llm)

    if spec.get("check"):
        _, outs = _generate(llm, SamplingParams, TokensPrompt, [
            {"prompt_token_ids": spec["check"], "max_tokens": 16, "ignore_eos": False, "logprobs": 5}])
        o = outs[0].outputs[0]
        res["check"] = {"token_ids": list(o.token_ids), "text": o.text}
        try:  # the first position's top-5 (token id -> logprob): how close the greedy choice was
            res["check"]["first_top5"] = {int(t): round(float(lp.logprob), 3) for t, lp in o.logprobs[0].items()}
        except Exception:
            pass
    if spec.get("warmup"):
        res["warmup_s"], _ = _generate(llm, SamplingParams, TokensPrompt, spec["warmup"])

    if spec.get("w64"):
        dt, outs = _generate(llm, SamplingParams, TokensPrompt, spec["w64"])
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        res["w64"] = {"seconds": dt, "requests": len(outs), "generated_tokens": gen, "tokens_per_s": gen / dt}

    if spec.get("prefill"):
        p = spec["prefill"]
        if p.get("warmup_token_ids"):  # a different prompt: the prefix cache must not serve the measured one
            _generate(llm, SamplingParams, TokensPrompt, [{"prompt_token_ids": p["warmup_token_ids"], "max_tokens": 1}])
        dt, _ = _generate(llm, SamplingParams, TokensPrompt, [{"prompt_token_ids": p["prompt_token_ids"], "max_tokens": 1}])
        n = len(p["prompt_token_ids"])
        res["prefill"] = {"seconds": dt, "prompt_tokens": n, "tokens_per_s": n / dt}

    if spec.get("mixed"):
        dt, outs = _generate(llm, SamplingParams, TokensPrompt, spec["mixed"])
        res["mixed"] = {"seconds": dt, "requests": len(outs),
                        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="vLLM's side of bench/peers.py (runs in .venv-peers)")
    ap.add_argument("--model", required=True, help="HF folder (bench/hf_export.py)")
    ap.add_argument("--spec", required=True, help="workloads JSON written by bench/peers.py")
    ap.add_argument("--out", default=None, help="write the results JSON here too")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=0, help="bind vLLM's threads to cores 0..N-1 (0: vLLM's choice)")
    ap.add_argument("--kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=0, help="0: vLLM's default")
    ap.add_argument("--max-model-len", type=int, default=0, help="0: the model's")
    args = ap.parse_args(argv)
    res = run(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f)
    print(RESULT_PREFIX + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

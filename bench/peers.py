"""Our engine against vLLM's CPU backend, on the same machine, in one run (``make bench-peers``).

Runs in the PROJECT venv. vLLM lives in its own venv, ``.venv-peers`` (``bench/peers_setup.sh``), and
loads the same weights from a Hugging Face folder (``bench/hf_export.py``, default ``.peers/smollm2-hf``);
its side runs as subprocesses (``bench/vllm_worker.py``, ``bench/vllm_serve_client.py``) that hand back
JSON. Ours runs in this process, before vLLM, with the same dtype, threads and KV budget.

Work (each: ours, then vLLM; greedy, EOS ignored, so both generate exactly the same number of tokens):

* ``w64``: the reference workload ``bench/w64.json`` (64 chat requests, 8,161 generated tokens), all
  at once, offline: generated tokens/s (``--num-requests N`` takes the first N, for a smoke run);
* ``prefill``: one ``--prefill-tokens`` (4,000) token prompt, ``max_tokens=1``: prompt tokens/s (time of
  the generate call, after a warm-up on another prompt of the same length, so no prefix cache helps);
* ``mixed``: ``--mixed-chats`` (8) W64 chats decoding ``--mixed-chat-tokens`` (64) tokens and one
  ``--prefill-tokens`` prompt (``max_tokens=1``), all arriving together: wall seconds for all;
* ``http`` (``--http`` or ``--only http``): our ``app.py`` server, then vLLM's OpenAI server, each driven
  by vLLM's serving benchmark client (random dataset, 64 prompts of 256 tokens, 128 out, all at once,
  ``--ignore-eos``, temperature 0): output tokens/s, TTFT and TPOT.

Prints the CPU (name, avx2 / avx512_bf16 / amx), dtype and threads, then ``work | ours | vLLM |
ours/vLLM`` (for rates > 1 means we are faster; for times < 1 means we are faster); ``--json PATH``
saves everything (both systems' raw results and the table).

    python bench/peers.py                             # w64, prefill, mixed
    python bench/peers.py --http --json out/peers.json
    python bench/peers.py --num-requests 4 --prefill-tokens 1000 --only w64,prefill   # smoke
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: the repository root, not bench/, goes first on the path
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]  # bench/kernels.py would shadow our kernels package
    sys.path.insert(0, os.path.dirname(_here))

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from bench.peers_run import cpu_times, free_port, peers_versions, run_http, run_vllm, server_cmds, steal_since  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
DEFAULT_W64 = os.path.join(BENCH, "w64.json")
DEFAULT_HF = os.path.join(ROOT, ".peers", "smollm2-hf")
DEFAULT_PEERS_VENV = os.path.join(ROOT, ".venv-peers")
DEFAULT_LOG_DIR = os.path.join(ROOT, ".peers", "logs")
WORKS = ("w64", "prefill", "mixed", "http")
DEFAULT_WORKS = ("w64", "prefill", "mixed")
CHECK_QUESTION = "What is the capital of France?"
# token ids drawn for synthetic prompts: past the special and byte tokens, inside the vocabulary (49,152)
SYNTH_LOW, SYNTH_HIGH = 200, 49000


# ==================================================================================================
# workloads (pure: no model, no torch; tests/test_peers.py checks them)
# ==================================================================================================
def load_w64(path: str = DEFAULT_W64, n: int | None = None) -> list[dict]:
    """The W64 requests as ``{"prompt_token_ids", "max_tokens"}`` dicts (the first ``n`` if given)."""
    with open(path) as f:
        data = json.load(f)
    reqs = data["requests"] if isinstance(data, dict) else data
    out = [{"prompt_token_ids": [int(t) for t in r["prompt_token_ids"]], "max_tokens": int(r["max_tokens"])}
           for r in reqs]
    return out[:n] if n else out


def synthetic_prompt(num_tokens: int, seed: int) -> list[int]:
    """``num_tokens`` deterministic token ids (seeded); different seeds give prompts that share no
    prefix block, so a prefix cache cannot serve one from another."""
    rng = random.Random(seed)
    return [rng.randrange(SYNTH_LOW, SYNTH_HIGH) for _ in range(num_tokens)]


def mixed_requests(chats: Sequence[dict], num_chats: int = 8, chat_tokens: int = 64, long_tokens: int = 4000,
                   long_max_tokens: int = 1, seed: int = 3) -> list[dict]:
    """The mixed case: ``num_chats`` chat prompts (taken in order from ``chats``, cycling if needed) each
    decoding ``chat_tokens`` tokens, then one ``long_tokens`` prompt (``long_max_tokens`` out), all
    submitted together."""
    if not chats:
        raise ValueError("mixed_requests needs at least one chat prompt")
    out = [{"prompt_token_ids": list(chats[i % len(chats)]["prompt_token_ids"]), "max_tokens": chat_tokens}
           for i in range(num_chats)]
    out.append({"prompt_token_ids": synthetic_prompt(long_tokens, seed), "max_tokens": long_max_tokens})
    return out


def build_spec(works: Sequence[str], w64: Sequence[dict], prefill_tokens: int = 4000, mixed_chats: int = 8,
               mixed_chat_tokens: int = 64, mixed_long_max_tokens: int = 1, check_ids: list[int] | None = None,
               warmup_requests: int = 4) -> dict:
    """What both systems run, as plain JSON: ``warmup`` (short synthetic requests, run first),
    ``check`` (a chat prompt for a greedy output check), then the selected offline works.

    The prefill prompt, its warm-up prompt and the mixed case's long prompt use three different seeds,
    so none of them hits the prefix cache filled by another.
    """
    spec: dict = {"warmup": [{"prompt_token_ids": synthetic_prompt(32, 100 + i), "max_tokens": 8}
                             for i in range(warmup_requests)]}
    if check_ids:
        spec["check"] = list(check_ids)
    if "w64" in works:
        spec["w64"] = [dict(r) for r in w64]
    if "prefill" in works:
        spec["prefill"] = {"prompt_token_ids": synthetic_prompt(prefill_tokens, 1),
                           "warmup_token_ids": synthetic_prompt(prefill_tokens, 2)}
    if "mixed" in works:
        spec["mixed"] = mixed_requests(w64, mixed_chats, mixed_chat_tokens, prefill_tokens, mixed_long_max_tokens,
                                       seed=3)
    return spec


def parse_only(text: str | None, http: bool = False) -> list[str]:
    """``--only`` (comma-separated) and ``--http`` -> the works to run, in the canonical order."""
    if text:
        names = [w.strip() for w in text.split(",") if w.strip()]
        bad = [w for w in names if w not in WORKS]
        if bad:
            raise ValueError(f"unknown work(s) {bad}; choose from {', '.join(WORKS)}")
    else:
        names = list(DEFAULT_WORKS)
    if http and "http" not in names:
        names.append("http")
    return [w for w in WORKS if w in names]


# ==================================================================================================
# the table (pure)
# ==================================================================================================
# (key, label, unit, higher_is_better, getter path in a result dict)
METRICS = (
    ("w64", "W64 offline: generated tokens/s", "tok/s", True, ("w64", "tokens_per_s")),
    ("prefill", "Prefill: prompt tokens/s", "tok/s", True, ("prefill", "tokens_per_s")),
    ("mixed", "Mixed (chats + long prompt): wall s", "s", False, ("mixed", "seconds")),
    ("http", "HTTP: output tokens/s", "tok/s", True, ("http", "output_throughput")),
    ("http", "HTTP: median TTFT ms", "ms", False, ("http", "median_ttft_ms")),
    ("http", "HTTP: median TPOT ms", "ms", False, ("http", "median_tpot_ms")),
    ("http", "HTTP: duration s", "s", False, ("http", "duration")),
)


def _get(d: dict | None, path: Sequence[str]):
    for k in path:
        if not isinstance(d, dict) or k not in d or d.get("invalid"):
            return None
        d = d[k]
    return d if isinstance(d, (int, float)) and not isinstance(d, bool) else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """``ours / theirs``, or None when either is missing or ``theirs`` is 0."""
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def compare(ours: dict, vllm: dict) -> list[dict]:
    """One row per metric present on either side: ``work, label, unit, higher_is_better, ours, vllm,
    ratio`` (``ours / vllm``) and ``better`` (``"ours"``, ``"vllm"``, ``"tie"`` within 2 %, or None)."""
    rows = []
    for work, label, unit, higher, path in METRICS:
        a, b = _get(ours, path), _get(vllm, path)
        if a is None and b is None:
            continue
        r = ratio(a, b)
        better = None
        if r is not None:
            if abs(r - 1) <= 0.02:
                better = "tie"
            else:
                better = "ours" if (r > 1) == higher else "vllm"
        rows.append({"work": work, "label": label, "unit": unit, "higher_is_better": higher,
                     "ours": a, "vllm": b, "ratio": r, "better": better})
    return rows


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def format_table(rows: Sequence[dict]) -> str:
    """``work | ours | vLLM | ours/vLLM`` as a fixed-width text table, with which side is better."""
    head = ("work", "ours", "vLLM", "ours/vLLM", "better")
    body = []
    for r in rows:
        arrow = "higher" if r["higher_is_better"] else "lower"
        body.append((f"{r['label']} ({arrow} is better)", _num(r["ours"]), _num(r["vllm"]),
                     "-" if r["ratio"] is None else f"{r['ratio']:.2f}x", r["better"] or "-"))
    widths = [max(len(head[i]), *(len(b[i]) for b in body)) if body else len(head[i]) for i in range(len(head))]

    def line(cells):
        return " | ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(cells))

    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([line(head), sep, *(line(b) for b in body)])


def cpu_info() -> dict:
    """CPU model name and the flags that matter for bf16 matmuls (Linux; empty elsewhere)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name") and ":" in ln:
                    name = ln.split(":", 1)[1].strip()
                elif ln.startswith("flags") and ":" in ln:
                    flags = set(ln.split(":", 1)[1].split())
    except OSError:
        pass
    want = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
    return {"name": name, "cores": os.cpu_count(), "flags": {k: k in flags for k in want}}


def format_header(info: dict) -> str:
    cpu = info.get("cpu", {})
    fl = cpu.get("flags", {})
    flags = " ".join(f"{k}={'yes' if fl.get(k) else 'no'}" for k in ("avx2", "avx512_bf16", "amx_bf16"))
    lines = [f"CPU: {cpu.get('name')} ({cpu.get('cores')} cores; {flags})",
             f"dtype: {info.get('dtype')}  threads: {info.get('threads')}  KV: {info.get('kv_cache_gib')} GiB each"]
    if info.get("versions"):
        lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v))
    return "\n".join(lines)


# ==================================================================================================
# ours
# ==================================================================================================
def run_ours(spec: dict, dtype: str, threads: int, kv_cache_gib: float, max_num_seqs: int = 64,
             max_num_batched_tokens: int | None = None, log=print) -> dict:
    """Our engine (``engine.llm.LLM``) on ``spec``, in this process; same result schema as the worker."""
    import torch

    from engine.llm import LLM
    from engine.request import SamplingParams

    torch.set_num_threads(threads)

    def gen(llm, reqs):
        prompts = [list(r["prompt_token_ids"]) for r in reqs]
        params = [SamplingParams(temperature=0.0, max_tokens=int(r["max_tokens"]), ignore_eos=r.get("ignore_eos", True))
                  for r in reqs]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        return time.perf_counter() - t0, outs

    res: dict = {"system": "ours", "torch_version": torch.__version__}
    t0 = time.perf_counter()
    kw = dict(max_num_seqs=max_num_seqs, kv_cache_memory=f"{kv_cache_gib}GiB", device="cpu")
    if max_num_batched_tokens:
        kw["max_num_batched_tokens"] = max_num_batched_tokens
    llm = LLM(dtype=dtype, **kw)
    res["load_s"] = time.perf_counter() - t0
    cfg = llm.engine.config
    res["engine"] = {k: getattr(cfg, k, None) for k in ("max_num_batched_tokens", "prefill_chunk_tokens",
                                                         "max_num_seqs", "enable_prefix_caching", "block_size",
                                                         "num_blocks")}
    res["engine"]["dtype"] = dtype
    log(f"ours: loaded in {res['load_s']:.1f} s")
    if spec.get("check"):
        _, outs = gen(llm, [{"prompt_token_ids": spec["check"], "max_tokens": 16, "ignore_eos": False}])
        ids = list(outs[0].outputs[0].token_ids)
        res["check"] = {"token_ids": ids, "text": llm.tokenizer.decode(ids, skip_special_tokens=True)}
    if spec.get("warmup"):
        res["warmup_s"], _ = gen(llm, spec["warmup"])
    if spec.get("w64"):
        dt, outs = gen(llm, spec["w64"])
        n = sum(len(o.outputs[0].token_ids) for o in outs)
        res["w64"] = {"seconds": dt, "requests": len(outs), "generated_tokens": n, "tokens_per_s": n / dt}
        log(f"ours: w64 {n} tokens in {dt:.1f} s")
    if spec.get("prefill"):
        p = spec["prefill"]
        if p.get("warmup_token_ids"):
            gen(llm, [{"prompt_token_ids": p["warmup_token_ids"], "max_tokens": 1}])
        dt, _ = gen(llm, [{"prompt_token_ids": p["prompt_token_ids"], "max_tokens": 1}])
        n = len(p["prompt_token_ids"])
        res["prefill"] = {"seconds": dt, "prompt_tokens": n, "tokens_per_s": n / dt}
        log(f"ours: prefill {n} tokens in {dt:.2f} s")
    if spec.get("mixed"):
        dt, outs = gen(llm, spec["mixed"])
        res["mixed"] = {"seconds": dt, "requests": len(outs),
                        "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
        log(f"ours: mixed in {dt:.2f} s")
    if spec.get("w64"):  # the decode step at 64 requests against this machine's physical floor, same run
        from bench.step_profile import profile_decode_step

        p = profile_decode_step(llm.engine.model, llm.tokenizer, 64, 150, torch_profile=False,
                                kv_cache_memory=f"{kv_cache_gib}GiB", device="cpu")
        res["floor"] = {"step_ms": p["step_ms"], "context": p["context"], "forward": p["forward"], **p["floor"]}
        log(f"ours: decode step at 64 requests {p['step_ms']:.1f} ms, floor {p['floor']['floor_ms']:.1f} ms")
    del llm
    gc.collect()
    return res


def format_floor(f: dict) -> str:
    """One line: our decode step at 64 requests, its physical floor on this machine and their ratio
    (:func:`bench.step_profile.step_floor`: the step's FLOPs at the measured matmul rate plus its KV bytes at
    the measured copy bandwidth)."""
    return (f"decode step at 64 requests (ours, {f['forward']} forward, mean context {f['context']:.0f}): "
            f"{f['step_ms']:.1f} ms; physical floor {f['floor_ms']:.1f} ms = {f['gflop']:.1f} GFLOP at "
            f"{f['matmul_gflops']:.0f} GFLOP/s + {f['kv_mb']:.0f} MB of KV at {f['bandwidth_gbs']:.1f} GB/s; "
            f"step / floor = {f['step_ms'] / f['floor_ms']:.2f}")


# ==================================================================================================
# main
# ==================================================================================================
def default_dtype() -> str:
    """The engine's auto choice on this CPU: bfloat16 with native bf16, else float32."""
    from engine.model_loader import cpu_supports_bf16

    return "bfloat16" if cpu_supports_bf16() else "float32"


def check_ids(hf_dir: str) -> list[int] | None:
    """The chat-rendered ids of the check question, with the exported folder's tokenizer."""
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(hf_dir)
        ids = tok.apply_chat_template([{"role": "user", "content": CHECK_QUESTION}], add_generation_prompt=True,
                                      tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    except Exception as e:  # the check is informative only
        print(f"(no output check: {e!r})", file=sys.stderr)
        return None


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default=None, help="bfloat16 / float32 for both (default: the engine's auto choice)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads / cores for both (default: all)")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(WORKS)} (default: w64,prefill,mixed)")
    ap.add_argument("--http", action="store_true", help="add the HTTP comparison")
    ap.add_argument("--num-requests", type=int, default=None, help="first N W64 requests only (smoke runs)")
    ap.add_argument("--workload", default=DEFAULT_W64, help="W64-style JSON (default: bench/w64.json)")
    ap.add_argument("--prefill-tokens", type=int, default=4000, help="length of the long prompt (default 4000)")
    ap.add_argument("--mixed-chats", type=int, default=8)
    ap.add_argument("--mixed-chat-tokens", type=int, default=64)
    ap.add_argument("--mixed-long-max-tokens", type=int, default=1)
    ap.add_argument("--http-num-prompts", type=int, default=64)
    ap.add_argument("--http-input-len", type=int, default=256)
    ap.add_argument("--http-output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="same step budget for both (default: each system's own: ours 2048, vLLM CPU 4096 offline / 2048 server)")
    ap.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache of each system (GiB, default 2)")
    ap.add_argument("--hf-dir", default=DEFAULT_HF, help="HF folder of the model (bench/hf_export.py)")
    ap.add_argument("--peers-venv", default=DEFAULT_PEERS_VENV)
    ap.add_argument("--log-dir", default=DEFAULT_LOG_DIR, help="subprocess logs (default .peers/logs)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for one subprocess (vLLM compiles at start)")
    ap.add_argument("--skip-ours", action="store_true", help="vLLM only")
    ap.add_argument("--skip-vllm", action="store_true", help="ours only")
    ap.add_argument("--json", default=None, help="write all results here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        works = parse_only(args.only, args.http)
    except ValueError as e:
        build_parser().error(str(e))
    args.dtype = args.dtype or default_dtype()
    args.hf_dir = os.path.abspath(args.hf_dir)
    os.makedirs(args.log_dir, exist_ok=True)
    if not args.skip_vllm and not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        raise SystemExit(f"{args.hf_dir} has no HF model: run `python bench/hf_export.py` first")

    def log(msg):
        print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    info = {"cpu": cpu_info(), "dtype": args.dtype, "threads": args.threads, "kv_cache_gib": args.kv_cache_gib,
            "works": works, "python": platform.python_version()}
    offline = [w for w in works if w != "http"]
    w64 = load_w64(args.workload, args.num_requests)
    spec = build_spec(offline, w64, args.prefill_tokens, args.mixed_chats, args.mixed_chat_tokens,
                      args.mixed_long_max_tokens, check_ids(args.hf_dir) if offline else None)
    info["workloads"] = {"w64_requests": len(spec.get("w64", [])),
                         "w64_tokens": sum(r["max_tokens"] for r in spec.get("w64", [])),
                         "prefill_tokens": args.prefill_tokens if "prefill" in works else None,
                         "mixed": [len(r["prompt_token_ids"]) for r in spec.get("mixed", [])]}
    ours: dict = {}
    theirs: dict = {}
    steal: dict = {}  # percent of CPU time stolen by the hypervisor during each half (shared VMs)

    def half(label: str, run, *run_args):
        start = cpu_times()
        result = run(*run_args)
        steal[label] = steal_since(start)
        return result

    if offline:
        if not args.skip_ours:
            ours = half("ours offline", run_ours, spec, args.dtype, args.threads, args.kv_cache_gib,
                        args.max_num_seqs, args.max_num_batched_tokens, log)
        if not args.skip_vllm:
            theirs = half("vLLM offline", run_vllm, spec, args, log)
    if "http" in works:
        p1, p2 = free_port(), free_port()
        s_ours, s_vllm = server_cmds(args, p1, p2)
        if not args.skip_ours:
            ours["http"] = half("ours HTTP", run_http, "ours", s_ours, p1, args, log)
        if not args.skip_vllm:
            theirs["http"] = half("vLLM HTTP", run_http, "vllm", s_vllm, p2, args, log)
    info["steal_pct"] = steal

    import torch

    info["versions"] = {"ours torch": torch.__version__, **peers_versions(args.peers_venv)}
    rows = compare(ours, theirs)
    print(format_header(info))
    if "check" in ours or "check" in theirs:
        a = ours.get("check", {}).get("token_ids", [])
        b = theirs.get("check", {}).get("token_ids", [])
        print(f"check ({CHECK_QUESTION!r}, greedy 16 tokens): ours {ours.get('check', {}).get('text')!r} | "
              f"vLLM {theirs.get('check', {}).get('text')!r} | same first {common_prefix(a, b)} tokens")
    print(format_table(rows))
    if ours.get("floor"):
        print(format_floor(ours["floor"]))
    if any(v is not None for v in steal.values()):
        print("CPU time stolen by the hypervisor (other guests) during each half: " +
              ", ".join(f"{k} {v:.1f}%" for k, v in steal.items() if v is not None) +
              " (a half with more ran on a slower machine)")
    for side, res in (("ours", ours), ("vLLM", theirs)):
        for work, r in res.items():
            if isinstance(r, dict) and r.get("invalid"):
                print(f"{side} {work}: INVALID, left out of the table: {r['invalid']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"info": info, "rows": rows, "ours": ours, "vllm": theirs}, f, indent=1, default=str)
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmarks: our engine (continuous and static) against transformers' baselines, in one process.

``python -m bench`` runs a workload through several *systems* with the same model weights, the
same dtype and the same number of threads, and prints one table (``--json`` / ``--html`` save it):

* ``ours-continuous``: :class:`engine.core.EngineCore`, iteration-level batching, paged KV cache;
* ``ours-static``: the same engine with ``policy="static"`` (a batch starts only when the previous one
  is done; each request reserves ``prompt + max_tokens`` of KV up front);
* ``hf-static``: transformers' ``generate`` in static batches (``--hf-batch-size``, 16) with left
  padding, each batch run to its longest ``max_tokens`` (the naive baseline);
* ``hf-cb``: transformers' built-in continuous batching (``init_continuous_batching``) with a bounded
  paged cache (its CPU default would take 60% of RAM). It gets its own model instance: a model switched
  to transformers' paged attention must not serve plain ``generate``.

Workloads (all seeded, nothing downloaded):

* ``offline`` (default): every request at time 0. Default: 64 built-in chat prompts
  (:mod:`engine.prompts`) with right-skewed output lengths between 16 and 256 tokens
  (:func:`bench.workloads.skewed_max_tokens`); ``--workload PATH`` reads a W64-style JSON file instead (the reference
  workload ``bench/w64.json``). Greedy, EOS ignored: every system generates exactly the same
  number of tokens.
* ``online``: the same requests arriving as a Poisson process at ``--rate`` requests/s; TTFT, TPOT and
  end-to-end latency percentiles.
* ``multiturn``: ``--conversations`` C chats of ``--turns`` T turns; each turn resends the whole history
  (prompt + previous answers, token for token), once with prefix caching and once without.

``--profile`` prints where one decode step at 64 running requests spends its time instead;
``--mode replay`` replays the workload through our scheduler and KV manager alone (no model) at block
sizes 8, 16 and 32: steps, idle slot-steps and KV shares in seconds.

Engine settings (``--model``, ``--dtype``, ``--device``, ``--policy``, ``--max-num-seqs``,
``--max-num-batched-tokens``, ``--block-size``, ``--num-blocks``, ``--kv-cache-memory``,
``--enable-prefix-caching/--no-enable-prefix-caching``) are the engine's own options
(:mod:`engine.options`), with the bench's defaults (64 slots, 2048 tokens per step, blocks of 16).
``--policy`` applies to ``--profile``; the systems ``ours-continuous`` and ``ours-static`` fix their own.

Units: times in seconds unless a key ends in ``_ms``; rates per second; KV in tokens (one token = K and
V of every layer); shares in percent.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence

import torch

from bench.metrics import environment, format_multiturn, format_table, step_series, summarize
from bench.step_profile import print_profile, profile_decode_step
from bench.systems import SYSTEMS, replay_schedule, run_hf_cb, run_hf_static, run_ours
from bench.workloads import BenchRequest, MultiTurn, load_workload, offline_workload, poisson_arrivals
from engine.options import add_engine_options, engine_kwargs

# The bench's engine defaults (the engine's own today, pinned here so that results stay comparable).
BENCH_DEFAULTS: dict[str, object] = {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "block_size": 16}
# Engine options that are not EngineConfig settings of our systems: the model is loaded once for all
# systems, and each of our systems fixes its policy.
_NOT_ENGINE_ARGS = ("model", "dtype", "device", "policy")


def load_models(args, need_hf_cb: bool):
    """``(model, tokenizer, cb_model or None)`` with the chosen dtype and device."""
    from engine.model_loader import load_model

    model, tok = load_model(args.model, args.dtype, args.device)
    cb_model = None
    if need_hf_cb:
        cb_model, _ = load_model(args.model, next(model.parameters()).dtype, args.device)
    return model, tok, cb_model


def engine_args_from(args) -> dict:
    """Engine settings shared by both of our systems: :func:`engine.options.engine_kwargs` of ``args``
    without the model, dtype, device and policy, and without unset (None) values; ``--num-blocks``
    wins over ``--kv-cache-memory``."""
    kw = {k: v for k, v in engine_kwargs(args).items() if k not in _NOT_ENGINE_ARGS and v is not None}
    if "num_blocks" in kw:
        kw.pop("kv_cache_memory", None)
    return kw


def warm_up(model, tokenizer, requests: Sequence[BenchRequest], systems: Sequence[str]) -> None:
    """Run two 2-token requests through our engine and through ``generate`` (if used), so first-call
    costs (allocator, thread pool, lazy imports) fall on no measured system."""
    tiny = [BenchRequest(f"warm{i}", list(r.prompt_token_ids), 2) for i, r in enumerate(requests[:2])]
    if any(s.startswith("ours") for s in systems):
        run_ours(model, tokenizer, tiny, "continuous", num_blocks=64, max_num_seqs=4)
    if "hf-static" in systems:
        run_hf_static(model, tokenizer, tiny, 2)


def run_systems(systems: Sequence[str], model, tokenizer, cb_model, requests: Sequence[BenchRequest], args,
                label: str) -> list[dict]:
    """Run ``requests`` through each system in ``systems``; returns their :func:`summarize` dicts, each
    with ``same_tokens_as_ours`` (requests whose tokens equal ``ours-continuous``'s, when it ran)."""
    results = []
    ref_tokens = None
    warm_up(model, tokenizer, requests, systems)
    for name in systems:
        print(f"[{label}] {name} ...", flush=True)
        load_before = os.getloadavg()[0]
        t = time.perf_counter()
        if name == "ours-continuous":
            run = run_ours(model, tokenizer, requests, "continuous", **engine_args_from(args))
        elif name == "ours-static":
            run = run_ours(model, tokenizer, requests, "static", **engine_args_from(args))
        elif name == "hf-static":
            run = run_hf_static(model, tokenizer, requests, args.hf_batch_size)
        elif name == "hf-cb":
            run = run_hf_cb(cb_model, tokenizer, requests, page_size=args.hf_cb_page_size,
                            num_blocks=args.hf_cb_num_blocks, max_batch_tokens=args.max_num_batched_tokens,
                            max_requests_per_batch=args.max_num_seqs)
        else:
            raise ValueError(f"unknown system {name!r}; choose from {SYSTEMS}")
        m = summarize(run)
        toks = {r.request_id: r.output_token_ids for r in run.requests}
        if name == "ours-continuous":
            ref_tokens = toks
        m["same_tokens_as_ours"] = (None if ref_tokens is None
                                    else sum(1 for k, v in toks.items() if ref_tokens.get(k) == v))
        m["workload"] = label
        m["series"] = step_series(run)
        m["load_before"], m["load_after"] = load_before, os.getloadavg()[0]
        results.append(m)
        print(f"[{label}] {name}: {m['generated_tokens']} tokens in {m['wall_s']:.1f} s = "
              f"{m['tokens_per_s']:.1f} tokens/s ({time.perf_counter() - t:.1f} s; 1-min load average "
              f"{m['load_before']:.2f} -> {m['load_after']:.2f})", flush=True)
    return results


def run_multiturn(model, tokenizer, args) -> list[dict]:
    """The multi-turn workload through ``ours-continuous`` with prefix caching on, then off."""
    out = []
    warm_up(model, tokenizer, MultiTurn(tokenizer, 2, 1, 2, args.seed).first_turns(), ["ours-continuous"])
    for caching in (True, False):
        mt = MultiTurn(tokenizer, args.conversations, args.turns, args.turn_tokens, args.seed)
        kw = engine_args_from(args)
        kw["enable_prefix_caching"] = caching
        print(f"[multiturn] prefix caching {'on' if caching else 'off'} ...", flush=True)
        run = run_ours(model, tokenizer, mt.first_turns(), "continuous", next_turn=mt.next_turn, **kw)
        m = summarize(run)
        m["system"] = f"ours-continuous, prefix caching {'on' if caching else 'off'}"
        m["workload"] = f"multiturn {args.conversations}x{args.turns}"
        m["prefix_caching"] = caching
        m["series"] = step_series(run)
        out.append(m)
    return out



def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m bench`` (see ``--help``): the bench's own flags, then the engine's
    options from :func:`engine.options.add_engine_options` with :data:`BENCH_DEFAULTS`."""
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", default="offline", choices=["offline", "online", "multiturn", "all", "replay"],
                   help="workload kind (default: offline); all = offline, online and multiturn; replay = our "
                   "scheduler and KV manager alone, no model, at block sizes 8/16/32 (steps, idle slots, KV)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {','.join(SYSTEMS)}")
    p.add_argument("--workload", default=None, help="a W64-style JSON file (e.g. bench/w64.json); "
                   "default: built-in prompts with skewed max_tokens")
    p.add_argument("--num-requests", type=int, default=None, help="requests (default 64; quick 16)")
    p.add_argument("--max-tokens-low", type=int, default=16)
    p.add_argument("--max-tokens-high", type=int, default=None, help="longest output (default 256; quick 48)")
    p.add_argument("--quick", action="store_true", help="a short smoke run: 16 requests, outputs 16..48 tokens, "
                   "multiturn 4x3 turns of 16 tokens")
    p.add_argument("--rate", type=float, default=None, help="online arrivals per second (default 4; quick 8)")
    p.add_argument("--conversations", type=int, default=None, help="multiturn chats (default 16; quick 4)")
    p.add_argument("--turns", type=int, default=None, help="turns per chat (default 4; quick 3)")
    p.add_argument("--turn-tokens", type=int, default=None, help="tokens per answer (default 64; quick 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--hf-cb-page-size", type=int, default=16)
    p.add_argument("--hf-cb-num-blocks", type=int, default=None, help="default: enough for all requests at once")
    p.add_argument("--profile", action="store_true", help="profile one decode step at 64 running requests and exit")
    p.add_argument("--profile-context", type=int, default=150)
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    p.add_argument("--html", default=None, help="write a Plotly HTML report (needs plotly)")
    add_engine_options(p.add_argument_group("engine options (as in python -m engine and app.py; --policy is for "
                                                "--profile: each of our systems fixes its own)"),
                       defaults=BENCH_DEFAULTS)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark chosen by ``argv``; print tables, write ``--json`` / ``--html``. Returns the exit
    status (0, or 2 for an unknown system)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.threads:
        torch.set_num_threads(args.threads)
    n, high = _fill_defaults(args)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            print(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}", file=sys.stderr)
            return 2
    load_start = _print_load_start()
    if args.mode == "replay":
        _run_replay(args, n, high)
        return 0
    need_cb = "hf-cb" in systems and args.mode in ("offline", "online", "all") and not args.profile
    t = time.perf_counter()
    model, tok, cb_model = load_models(args, need_cb)
    env = environment(model)
    print(f"model loaded in {time.perf_counter() - t:.1f} s: dtype={env['dtype']} device={env['device']} "
          f"threads={env['threads']} torch={env['torch']} transformers={env['transformers']} cpu={env['processor']!r} "
          f"native bf16={env['cpu_native_bf16']}", flush=True)
    report: dict = {"environment": env, "args": {k: v for k, v in vars(args).items()}, "load_start": load_start}
    if args.profile:
        kw = engine_args_from(args)
        kw["max_num_seqs"] = max(64, args.max_num_seqs)
        kw["policy"] = args.policy
        p = profile_decode_step(model, tok, 64, args.profile_context, **kw)
        print_profile(p)
        report["profile"] = p
    elif args.mode == "multiturn":
        _run_multiturn_mode(model, tok, args, env, report)
    else:
        _run_workload_modes(systems, model, tok, cb_model, args, env, report, n, high)
    _finish(args, report, env)
    return 0


def _fill_defaults(args) -> tuple[int, int]:
    """The defaults that depend on ``--quick`` (set on ``args``); returns ``(requests, longest output)``."""
    q = args.quick
    args.rate = args.rate or (8.0 if q else 4.0)
    args.conversations = args.conversations or (4 if q else 16)
    args.turns = args.turns or (3 if q else 4)
    args.turn_tokens = args.turn_tokens or (16 if q else 64)
    return args.num_requests or (16 if q else 64), args.max_tokens_high or (48 if q else 256)


def _print_load_start() -> tuple[float, float, float]:
    """Print the load average now (and a warning when other processes hold the cores); return it."""
    load_start = os.getloadavg()
    print(f"load average at start: {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} "
          f"({os.cpu_count()} CPUs)", flush=True)
    if load_start[0] > (os.cpu_count() or 1) and torch.get_num_threads() > 1:
        print(f"warning: load average {load_start[0]:.1f} > {os.cpu_count()} CPUs: {torch.get_num_threads()}-thread "
              "OpenMP matmuls slow down several times when other processes hold the cores; compare systems "
              "only within this run, or use --threads 1 (or OMP_WAIT_POLICY=PASSIVE)", flush=True)
    return load_start


def _run_replay(args, n: int, high: int) -> None:
    """``--mode replay``: the workload through our scheduler and KV manager alone, at block sizes 8/16/32."""
    from engine.model_loader import load_tokenizer

    requests = (load_workload(args.workload) if args.workload
                else offline_workload(load_tokenizer(args.model), n, args.max_tokens_low, high, args.seed))
    kw = engine_args_from(args)
    print(f"{'policy':<11} {'block':>5} {'steps':>6} {'idle slot-steps':>15} {'KV real %':>9} "
          f"{'KV peak tok':>11}")
    for policy in ("continuous", "static"):
        for bs in (8, 16, 32):
            kw.update(block_size=bs, num_blocks=args.num_blocks or 11648 // bs)
            r = replay_schedule(requests, policy, **kw)
            print(f"{policy:<11} {bs:>5} {r['steps']:>6} {r['idle_slot_steps']:>15} "
                  f"{r['kv_real_pct_mean']:>9.1f} {r['kv_reserved_peak']:>11}")


def _run_multiturn_mode(model, tok, args, env: dict, report: dict) -> None:
    """The multi-turn workload (:func:`run_multiturn`): into ``report["multiturn"]``, and printed."""
    res = run_multiturn(model, tok, args)
    report["multiturn"] = res
    print(f"\n== multiturn: {args.conversations} conversations x {args.turns} turns, {args.turn_tokens} "
          f"tokens per answer, dtype {env['dtype']} ==")
    print(format_multiturn(res))


def _run_workload_modes(systems: list[str], model, tok, cb_model, args, env: dict, report: dict, n: int,
                        high: int) -> None:
    """``--mode offline / online / all``: the workload through ``systems`` (and, for ``all``, the multi-turn
    one), each into ``report`` and printed as a table."""
    q = args.quick
    if args.workload:
        requests = load_workload(args.workload, n if (args.num_requests or q) else None,
                                 high if (args.max_tokens_high or q) else None)
        label = os.path.basename(args.workload)
    else:
        requests = offline_workload(tok, n, args.max_tokens_low, high, args.seed)
        label = f"builtin-{n}"
    print(f"workload {label}: {len(requests)} requests, {sum(len(r.prompt_token_ids) for r in requests)} prompt "
          f"tokens, {sum(r.max_tokens for r in requests)} tokens to generate", flush=True)
    if args.mode in ("offline", "all"):
        res = run_systems(systems, model, tok, cb_model, requests, args, f"{label} offline")
        report["offline"] = res
        print(f"\n== offline: {label}, dtype {env['dtype']}, {env['threads']} threads ==")
        print(format_table(res))
    if args.mode in ("online", "all"):
        online = poisson_arrivals(requests, args.rate, args.seed)
        res = run_systems(systems, model, tok, cb_model, online, args, f"{label} online {args.rate:g}/s")
        report["online"] = res
        print(f"\n== online: {label}, Poisson {args.rate:g} requests/s, dtype {env['dtype']} ==")
        print(format_table(res))
    if args.mode == "all":
        _run_multiturn_mode(model, tok, args, env, report)


def _finish(args, report: dict, env: dict) -> None:
    """Print the load average at the end; write ``--json`` and ``--html``."""
    load_end = os.getloadavg()
    report["load_end"] = load_end
    print(f"\nload average at end: {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}; dtype {env['dtype']}, "
          f"{env['threads']} threads")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.json}")
    if args.html:
        from bench.report import write_report  # plotly is imported only when a report is asked for

        write_report(report, args.html)
        print(f"wrote {args.html}")


if __name__ == "__main__":
    sys.exit(main())

"""The linear layers of one decode step on CPU, per GEMM path and row count: ``python -m bench.cpu_linears``.

For the shapes of a Llama-family model (default SmolLM2-135M: 30 layers of merged QKV ``[960 x 576]``,
O ``[576 x 576]``, merged gate/up ``[3072 x 576]`` and down ``[576 x 1536]``, then the LM head
``[49152 x 576]``), random bfloat16 weights, it times all the step's linears one after the other (the
weights, 270 MB in bfloat16, are streamed from memory as in a real step) at each row count, for every
path this CPU has:

* ``own``: the engine's own GEMM (``kernels/csrc/gemm_bf16_cpu.cpp``: bfloat16 weights widened to float32
  in registers, float32 FMAs), where the C++ extension has it (AVX-512);
* ``own-dp``: the same GEMM on VDPBF16PS (``dot_products=True``), where the build has AVX512-BF16 (the
  engine's choice on AMD CPUs with it);
* ``onednn``: oneDNN's bfloat16 linear on prepacked weights (``torch.ops.mkldnn._linear_pointwise``),
  where the CPU has native bfloat16;
* ``mkl32``: ``F.linear`` in float32 on float32 copies of the weights (MKL), input cast up and output
  rounded to bfloat16, as ``kernels.cpu_linear.Linear``'s float32 path does;
* ``torch``: ``F.linear`` in bfloat16 (``--all`` only: slow where the CPU has no native bfloat16).

With ``--dtype float32`` (the engine's dtype on AVX2-only CPUs) the weights and inputs are float32 and the
paths are ``own32`` (the engine's own float32 GEMM, ``kernels/csrc/gemm_f32_cpu.cpp``, where the extension
has it) and ``mkl32`` (``F.linear`` in float32).

The paths alternate within each row count (one pass of each, repeated), and the median pass is
reported with its GFLOP/s and the ratio of the best other path's time to the faster own path's. It
prints the CPU's name, its vector flags and the thread count: compare ratios from one run, not times across machines.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bench.peers import cpu_info
from kernels import cpu_linear, cpu_ops


def step_shapes(hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, layers: int,
                vocab: int) -> list[tuple[int, int]]:
    """``(out_features, in_features)`` of every linear of one decode step, in the order the forward runs
    them: per layer QKV, O, gate/up, down; then the LM head."""
    qkv = (heads + 2 * kv_heads) * head_dim
    per_layer = [(qkv, hidden), (hidden, heads * head_dim), (2 * intermediate, hidden), (hidden, intermediate)]
    return per_layer * layers + [(vocab, hidden)]


OWN = ("own", "own-dp", "own32")  # the engine's own GEMMs: float32 FMAs and VDPBF16PS; float32 weights


def build_paths(shapes, with_torch: bool, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict:
    """``{name: [callable(x) per shape]}`` for the paths this CPU has in ``dtype`` (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    weights = [(torch.randn(o, i, generator=g) * 0.02).to(dtype) for o, i in shapes]
    paths: dict = {}
    if dtype == torch.float32:
        if cpu_ops.available() and cpu_ops.gemm_f32_available():
            packed32 = [cpu_linear.pack_gemm_weight_f32(w) for w in weights]
            paths["own32"] = [lambda x, p=p: cpu_ops.gemm_f32(x, p) for p in packed32]
        paths["mkl32"] = [lambda x, w=w: F.linear(x, w) for w in weights]
        return paths
    if cpu_ops.available() and cpu_ops.gemm_bf16_available():
        packed = [cpu_linear.pack_gemm_weight(w) for w in weights]
        paths["own"] = [lambda x, p=p: cpu_ops.gemm_bf16(x, p) for p in packed]
        if cpu_ops.gemm_bf16_dp_available():
            paths["own-dp"] = [lambda x, p=p: cpu_ops.gemm_bf16(x, p, None, True) for p in packed]
    if cpu_linear.available() and cpu_linear.native_bf16():
        onednn = [cpu_linear._pack(w) for w in weights]
        paths["onednn"] = [lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                           for p in onednn]
    w32 = [w.float() for w in weights]
    paths["mkl32"] = [lambda x, w=w: F.linear(x.float(), w).to(torch.bfloat16) for w in w32]
    if with_torch:
        paths["torch"] = [lambda x, w=w: F.linear(x, w) for w in weights]
    return paths


def time_step(fns, shapes, rows: int, g: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> float:
    """Seconds for one pass over all the step's linears at ``rows`` rows (inputs made beforehand)."""
    inputs = {i: torch.randn(rows, i, generator=g).to(dtype) for i in {i for _, i in shapes}}
    xs = [inputs[i] for _, i in shapes]
    t = time.perf_counter()
    for fn, x in zip(fns, xs):
        fn(x)
    return time.perf_counter() - t


def cpu_description() -> str:
    """The CPU's name and the vector flags of :func:`bench.peers.cpu_info` it has."""
    cpu = cpu_info()
    feats = [k for k, on in cpu["flags"].items() if on]
    return f"{cpu['name'] or 'unknown CPU'} ({', '.join(feats) or 'no AVX2'})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Time one decode step's linear layers per CPU GEMM path.")
    ap.add_argument("--rows", default="1,4,8,16,32,48,64,96,128,256,512", help="comma-separated row counts")
    ap.add_argument("--repeats", type=int, default=7, help="passes of each path per row count (median reported)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--all", action="store_true", help="also time F.linear in bfloat16")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                    help="weights and inputs (float32: the own float32 GEMM against F.linear)")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = step_shapes(args.hidden, args.intermediate, args.heads, args.kv_heads, args.head_dim, args.layers,
                         args.vocab)
    params = sum(o * i for o, i in shapes)
    dtype = getattr(torch, args.dtype)
    paths = build_paths(shapes, args.all, dtype=dtype)
    print(f"CPU: {cpu_description()}; {torch.get_num_threads()} threads; torch {torch.__version__}")
    size = torch.empty((), dtype=dtype).element_size()
    print(f"{len(shapes)} linears, {params / 1e6:.0f} M parameters ({size * params / 1e6:.0f} MB in {args.dtype}); "
          f"paths: {', '.join(paths)}; median of {args.repeats} passes, paths alternating")
    g = torch.Generator().manual_seed(1)
    for fns in paths.values():  # first touch: page in the weights and build any lazy state
        time_step(fns, shapes, 1, g, dtype)
    head = f"{'rows':>5} | " + " | ".join(f"{n:>16}" for n in paths) + " | best other / best own"
    print(head)
    print("-" * len(head))
    for rows in (int(r) for r in args.rows.split(",") if r.strip()):
        times: dict[str, list[float]] = {n: [] for n in paths}
        for _ in range(args.repeats):
            for name, fns in paths.items():
                times[name].append(time_step(fns, shapes, rows, g, dtype))
        med = {n: statistics.median(ts) for n, ts in times.items()}
        cells = [f"{1e3 * t:7.1f} ms {2 * rows * params / t / 1e9:4.0f} GF" for t in med.values()]
        ours = [t for n, t in med.items() if n in OWN]
        others = [t for n, t in med.items() if n not in OWN]
        ratio = f"{min(others) / min(ours):.2f}x" if ours and others else "-"
        print(f"{rows:>5} | " + " | ".join(f"{c:>16}" for c in cells) + f" | {ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Compile the Triton kernels for Hopper (sm_90) without a GPU, and report their resources.

Uses the ``ptxas`` and ``cuobjdump`` that ship inside the triton wheel; needs no driver and no GPU.
For each attention variant it prints registers per thread, stack bytes (register spills), shared
memory, which matrix instructions the PTX uses (``wgmma`` = Hopper warpgroup MMA, ``mma.sync`` = the
older tensor-core path, neither = FMA units) and whether loads are pipelined through ``cp.async``.
The test suite uses :func:`compile_all` to check that every kernel builds for sm_90 on CPU-only CI.

Run: ``python -m bench.compile_report [--quick | --check]`` with ``TRITON_INTERPRET`` unset (in
interpreter mode triton's own ``@jit`` helpers, such as ``tl.cdiv``, are interpreter objects that the
compiler cannot use).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

# triton (and kernels.triton_ops, which imports it) are imported inside the functions: only
# kernels/triton_ops.py imports triton at module level, so that importing this module never fixes
# triton's interpreter mode before tests/conftest.py has chosen it.

_TL = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _jit_fn(fn):
    from triton.runtime.jit import JITFunction

    return fn if isinstance(fn, JITFunction) else JITFunction(fn.fn)  # interpreter mode wraps the function


def _compile(fn, ptr_types: dict, float_args: set, consts: dict, num_warps: int, num_stages: int, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _jit_fn(fn)
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in ptr_types:
            sig[a] = "*" + ptr_types[a]
        elif a in float_args:
            sig[a] = "fp32"
        else:
            sig[a] = "i32"
    # what a real launch sees: 16-byte-aligned pointers and strides divisible by 16 (head_dim 64/128)
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if a in ptr_types or a.startswith("stride_")}
    return triton.compile(
        ASTSource(fn, sig, consts, attrs),
        target=GPUTarget("cuda", arch, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )


def compile_attention(dtype: str, head_dim: int, group: int, num_splits: int, block_m: int, tile_n: int,
                      num_warps: int, num_stages: int, block_size: int = 16, arch: int = 90):
    """Compile one variant of :func:`kernels.triton_ops._unified_attention_kernel` for ``sm_<arch>``."""
    import triton

    from kernels import triton_ops

    gp = triton.next_power_of_2(group)
    bm = max(block_m, gp, 16)
    consts = dict(
        HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, GROUP=group,
        GROUP_PAD=gp, BLOCK_Q=bm // gp, BLOCK_M=bm, TILE_N=tile_n, NUM_SPLITS=num_splits,
        DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
    )
    t = _TL[dtype]
    ptr = {"q_ptr": t, "k_cache_ptr": t, "v_cache_ptr": t, "out_ptr": t, "block_tables_ptr": "i32",
           "seq_lens_ptr": "i32", "qsl_ptr": "i32", "part_acc_ptr": "fp32", "part_m_ptr": "fp32", "part_l_ptr": "fp32"}
    return _compile(triton_ops._unified_attention_kernel, ptr, {"qk_scale"}, consts, num_warps, num_stages, arch)


def compile_reduce(dtype: str, head_dim: int, num_splits: int, arch: int = 90):
    """Compile :func:`kernels.triton_ops._reduce_splits_kernel` for ``sm_<arch>``."""
    import triton

    from kernels import triton_ops

    consts = dict(HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim), NUM_SPLITS=num_splits)
    ptr = {"part_acc_ptr": "fp32", "part_m_ptr": "fp32", "part_l_ptr": "fp32", "out_ptr": _TL[dtype], "qsl_ptr": "i32"}
    return _compile(triton_ops._reduce_splits_kernel, ptr, set(), consts, 4, 1, arch)


def compile_cache_write(dtype: str, head_dim: int, num_kv_heads: int, block_size: int, arch: int = 90):
    """Compile :func:`kernels.triton_ops._reshape_and_cache_kernel` for ``sm_<arch>``."""
    import triton

    from kernels import triton_ops

    consts = dict(NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                  H_PAD=triton.next_power_of_2(num_kv_heads), D_PAD=triton.next_power_of_2(head_dim))
    t = _TL[dtype]
    ptr = {"key_ptr": t, "value_ptr": t, "key_cache_ptr": t, "value_cache_ptr": t, "slot_ptr": "i64"}
    return _compile(triton_ops._reshape_and_cache_kernel, ptr, set(), consts, 2, 1, arch)


def compile_rms_norm(dtype: str, hidden: int, residual: bool, arch: int = 90):
    """Compile :func:`kernels.triton_ops._rms_norm_kernel` for ``sm_<arch>`` (launch options as the host's)."""
    import triton

    from kernels import triton_ops

    block = triton.next_power_of_2(hidden)
    t = _TL[dtype]
    ptr = {"x_ptr": t, "res_ptr": t, "w_ptr": t, "out_ptr": t}
    return _compile(triton_ops._rms_norm_kernel, ptr, {"eps"}, dict(HAS_RESIDUAL=residual, BLOCK=block),
                    triton_ops.rms_norm_warps(block), 1, arch)


def resources(kernel) -> dict:
    """Registers / stack / shared memory of a compiled kernel (read with the wheel's cuobjdump) and
    counts of matrix and async-copy instructions in its PTX."""
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    regs = stack = -1
    if os.path.exists(cuobjdump):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            txt = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+)", txt)
        if m:
            regs, stack = int(m.group(1)), int(m.group(2))
    ptx = kernel.asm["ptx"]
    return {
        "regs": regs,
        "stack": stack,
        "smem": kernel.metadata.shared,
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma.sync": ptx.count("mma.sync"),
        "cp.async": ptx.count("cp.async"),
    }


def compile_all(arch: int = 90) -> list[tuple[str, dict]]:
    """Build a representative set of every kernel (default configurations, with and without split-KV)
    for ``sm_<arch>``; returns ``(name, resources)`` pairs. Raises if any fails to compile."""
    from kernels import triton_ops

    out = []
    for dtype, head_dim, group, phase, splits in (
        ("bf16", 128, 4, "decode", 8),
        ("bf16", 64, 3, "prefill", 1),
        ("fp16", 64, 3, "decode", 1),
        ("fp32", 128, 1, "prefill", 2),
    ):
        cfg = triton_ops._default_config(dtype == "fp32", head_dim, group, 1 if phase == "decode" else 512)
        k = compile_attention(dtype, head_dim, group, splits, cfg["block_m"], cfg["tile_n"], cfg["num_warps"],
                              cfg["num_stages"], arch=arch)
        out.append((f"attention {dtype} D={head_dim} G={group} {phase} splits={splits}", resources(k)))
    out.append(("reduce bf16 D=128 splits=8", resources(compile_reduce("bf16", 128, 8, arch))))
    out.append(("reshape_and_cache bf16 D=64 kvh=3", resources(compile_cache_write("bf16", 64, 3, 16, arch))))
    out.append(("rms_norm bf16 hidden=576 +residual", resources(compile_rms_norm("bf16", 576, True, arch))))
    out.append(("rms_norm fp32 hidden=4096", resources(compile_rms_norm("fp32", 4096, False, arch))))
    return out


def main() -> None:
    from kernels import triton_ops

    ap = argparse.ArgumentParser(description="Compile the Triton kernels for sm_90 without a GPU; print resources.")
    ap.add_argument("--quick", action="store_true", help="only the default configurations")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90 = Hopper)")
    ap.add_argument("--check", action="store_true", help="only build a representative set of every kernel")
    args = ap.parse_args()
    if _interpreting():
        raise SystemExit("unset TRITON_INTERPRET: under the interpreter triton's own helpers cannot be compiled")
    if args.check:
        for name, r in compile_all(args.arch):
            print(f"{name}: {r}")
        return

    for dtype in ("bf16", "fp16", "fp32"):
        for head_dim, group in ((64, 3), (128, 4)):
            for phase, max_q in (("decode", 1), ("prefill", 512)):
                cfg = triton_ops._default_config(dtype == "fp32", head_dim, group, max_q)
                variants = [cfg]
                if not args.quick:
                    for tn in (32, 64):
                        for nw in (4, 8):
                            v = dict(cfg, tile_n=tn, num_warps=nw)
                            if v not in variants:
                                variants.append(v)
                for v in variants:
                    k = compile_attention(dtype, head_dim, group, 1, v["block_m"], v["tile_n"], v["num_warps"],
                                          v["num_stages"], arch=args.arch)
                    r = resources(k)
                    print(f"{dtype:5} D={head_dim:<4} G={group} {phase:8} BM={v['block_m']:<3} TN={v['tile_n']:<3} "
                          f"warps={v['num_warps']} stages={v['num_stages']} regs={r['regs']:<4} stack={r['stack']:<4} "
                          f"smem={r['smem']:<6} wgmma={r['wgmma']:<3} mma.sync={r['mma.sync']:<3} "
                          f"cp.async={r['cp.async']:<4} {'default' if v == cfg else ''}", flush=True)
    for name, r in compile_all(args.arch)[-2:]:
        print(f"{name}: {r}")


if __name__ == "__main__":
    main()

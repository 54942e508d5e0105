"""The C++ fused elementwise ops of the engine's CPU forward (RMSNorm, residual add + RMSNorm, RoPE,
SiLU-and-mul) against their torch references in ``kernels.torch_ops``, and their row independence.

Until these tests they were covered only end to end (equivalence with transformers, batch invariance).
Shapes include hidden sizes that are not a multiple of the vector width (the scalar tails), strided rows
(views into a fused QKV output, as the forward passes them) and float32, bfloat16 and float16 storage.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_ops, torch_ops

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="C++ CPU extension unavailable")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# float32: only the order of the RMS sum and the exp polynomial differ; a 16-bit result may then land
# one rounding step away (one unit in the last place of bfloat16 is 2^-8 relative)
TOL = {torch.float32: dict(rtol=2e-6, atol=2e-6), torch.bfloat16: dict(rtol=8e-3, atol=8e-3),
       torch.float16: dict(rtol=1e-3, atol=1e-3)}


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.dtype == b.dtype == dtype
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


def _rand(*shape, dtype, seed=0, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 576), (64, 576), (3, 37), (5, 8), (2, 1000)])
def test_rms_norm_matches_reference(dtype, rows, hidden):
    x = _rand(rows, hidden, dtype=dtype, scale=3.0)
    w = _rand(hidden, dtype=dtype, seed=1)
    _close(cpu_ops.rms_norm(x, w, 1e-5), torch_ops.rms_norm(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (33, 576), (4, 45)])
def test_fused_add_rms_norm_matches_reference(dtype, rows, hidden):
    x, res = _rand(rows, hidden, dtype=dtype, seed=2), _rand(rows, hidden, dtype=dtype, seed=3)
    w = _rand(hidden, dtype=dtype, seed=4)
    x1, r1, x2, r2 = x.clone(), res.clone(), x.clone(), res.clone()
    cpu_ops.fused_add_rms_norm(x1, r1, w, 1e-6)
    torch_ops.fused_add_rms_norm(x2, r2, w, 1e-6)
    assert torch.equal(r1, r2)  # the residual is one rounded addition: exact
    _close(x1, x2, dtype)


def _rope_tables(max_pos: int, head_dim: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (2, 1, 24)])
def test_rotary_embedding_matches_reference_on_strided_qkv_views(dtype, heads, kv_heads, head_dim):
    tokens = 11
    qkv = _rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=5)
    cos, sin = _rope_tables(300, head_dim, dtype)
    positions = torch.tensor([0, 1, 2, 299, 17, 17, 5, 100, 3, 250, 64], dtype=torch.int64)
    a, b = qkv.clone(), qkv.clone()
    for t in (a, b):
        q, k = t[:, :heads * head_dim], t[:, heads * head_dim:(heads + kv_heads) * head_dim]
        assert q.stride(0) == t.shape[1]  # rows strided, as the forward passes them
        (cpu_ops if t is a else torch_ops).rotary_embedding(positions, q, k, cos, sin, head_dim)
    v0 = (heads + kv_heads) * head_dim
    assert torch.equal(a[:, v0:], qkv[:, v0:])  # V untouched
    _close(a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (64, 1536), (3, 20), (2, 7)])
def test_silu_and_mul_matches_reference(dtype, rows, inter):
    x = _rand(rows, 2 * inter, dtype=dtype, seed=6, scale=4.0)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)  # saturating and signed-zero gates
    _close(cpu_ops.silu_and_mul(x), torch_ops.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_rows_do_not_depend_on_the_batch(dtype):
    """Each row is computed alone: its result is the same bits alone or among 63 others."""
    hidden, inter, heads, kv, hd = 576, 1536, 9, 3, 64
    batch = _rand(64, hidden, dtype=dtype, seed=7)
    w = _rand(hidden, dtype=dtype, seed=8)
    row = batch[40:41].clone()
    assert torch.equal(cpu_ops.rms_norm(batch, w, 1e-5)[40:41], cpu_ops.rms_norm(row, w, 1e-5))
    g = _rand(64, 2 * inter, dtype=dtype, seed=9)
    assert torch.equal(cpu_ops.silu_and_mul(g)[40:41], cpu_ops.silu_and_mul(g[40:41].clone()))
    qkv = _rand(64, (heads + 2 * kv) * hd, dtype=dtype, seed=10)
    cos, sin = _rope_tables(512, hd, dtype)
    pos = torch.arange(64, dtype=torch.int64) * 7
    full, one = qkv.clone(), qkv[40:41].clone()
    for t, p in ((full, pos), (one, pos[40:41].clone())):
        cpu_ops.rotary_embedding(p, t[:, :heads * hd], t[:, heads * hd:(heads + kv) * hd], cos, sin, hd)
    assert torch.equal(full[40:41], one)

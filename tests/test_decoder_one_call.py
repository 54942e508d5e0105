"""All decoder layers in one C++ call (``kernels.cpu_ops.decoder_layers``, used by the engine's own Llama
forward where every linear is on an own GEMM): bit-identical to the Python loop over the layers, for a
step of prompt chunks and one of decode rows beside a chunk, with and without QKV biases (Qwen2), and
the rules that choose the path."""

import pytest
import torch

import kernels
from engine.attention import AttentionMetadata
from engine.models.llama import LlamaForward

pytestmark = pytest.mark.skipif(not kernels.cpp_available(), reason="needs the C++ CPU kernels")

BLOCK = 16


def tiny(kind: str, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    args = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(5)
    model = LlamaForCausalLM(LlamaConfig(**args)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**args))
    with torch.no_grad():  # random biases (transformers initialises them to zero)
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model.eval().to(dtype)


def caches(model, num_blocks=8):
    cfg = model.config
    shape = (num_blocks, cfg.num_key_value_heads, BLOCK, cfg.hidden_size // cfg.num_attention_heads)
    return [(torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))
            for _ in range(cfg.num_hidden_layers)]


def step(seqs, kv):
    """``(positions, meta)`` for sequences ``(block_ids, tokens already cached, new tokens)``."""
    positions, slots, qsl, lens = [], [], [0], []
    for blocks, before, new in seqs:
        for p in range(before, before + new):
            positions.append(p)
            slots.append(blocks[p // BLOCK] * BLOCK + p % BLOCK)
        qsl.append(qsl[-1] + new)
        lens.append(before + new)
    width = max(len(b) for b, _, _ in seqs)
    bt = torch.tensor([b + [0] * (width - len(b)) for b, _, _ in seqs], dtype=torch.int32)
    meta = AttentionMetadata(kv_caches=kv, slot_mapping=torch.tensor(slots), block_tables=bt,
                             seq_lens=torch.tensor(lens, dtype=torch.int32),
                             query_start_loc=torch.tensor(qsl, dtype=torch.int32), seq_lens_list=lens,
                             query_start_loc_list=qsl)
    return torch.tensor(positions), meta


def one_call_forward(model):
    fwd = LlamaForward(model)
    if fwd.one_call_plan() is None:
        pytest.skip("no linear on an own GEMM here (bfloat16 needs AVX-512; float32 an AVX2-only CPU)")
    return fwd


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_one_call_equals_the_python_loop_bit_for_bit(kind, dtype, monkeypatch):
    from kernels import cpu_linear, cpu_ops

    if dtype == torch.float32 and cpu_ops.gemm_f32_available():  # AVX-512 CPUs keep F.linear for float32
        monkeypatch.setattr(cpu_linear, "own_gemm_f32_cpu", lambda: True)
    model = tiny(kind, dtype)
    fused = one_call_forward(model)
    monkeypatch.setenv("CBP_CPU_FUSED_LAYERS", "0")
    loop = LlamaForward(model)
    assert loop.one_call_plan() is None
    kv_fused, kv_loop = caches(model), caches(model)
    g = torch.Generator().manual_seed(1)
    steps = [
        [([1, 2], 0, 21), ([3], 0, 5)],                  # two prompts (one over a block boundary)
        [([1, 2], 21, 1), ([3], 5, 1), ([4, 5], 0, 17)],  # two decode rows beside a prompt chunk
        [([1, 2], 22, 1), ([3], 6, 1), ([4, 5], 17, 3)],  # decode rows beside the chunk's rest
    ]
    for seqs in steps:
        positions, meta_f = step(seqs, kv_fused)
        _, meta_l = step(seqs, kv_loop)
        ids = torch.randint(3, 256, (len(positions),), generator=g)
        rows = torch.tensor(meta_f.query_start_loc_list[1:]) - 1  # each sequence's last row samples
        a = fused(ids, positions, meta_f, rows)
        b = loop(ids, positions, meta_l, rows)
        assert torch.equal(a, b)
        for (kf, vf), (kl, vl) in zip(kv_fused, kv_loop):
            assert torch.equal(kf, kl) and torch.equal(vf, vl)


def test_one_call_adds_its_time_to_the_profile_counters():
    model = tiny("llama", torch.bfloat16)
    fwd = one_call_forward(model)
    fwd.timings = torch.zeros(3, dtype=torch.float64)
    positions, meta = step([([1, 2], 0, 20)], caches(model))
    fwd(torch.arange(3, 23), positions, meta, torch.tensor([19]))
    assert (fwd.timings > 0).all()


def test_the_python_loop_runs_when_the_kernels_are_not_the_cpp_ones():
    model = tiny("llama", torch.bfloat16)
    fwd = one_call_forward(model)
    positions, meta = step([([1], 0, 4)], caches(model))
    expected = fwd(torch.arange(3, 7), positions, meta, torch.tensor([3]))
    kernels.set_backend("torch")
    try:
        assert fwd._layers_in_one_call(fwd.embed[:4].clone(), positions, meta) is None
        assert fwd(torch.arange(3, 7), positions, meta, torch.tensor([3])).shape == expected.shape
    finally:
        kernels.set_backend(None)

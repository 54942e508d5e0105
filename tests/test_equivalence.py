"""Greedy float32 output of the engine equals transformers' own ``generate`` on each prompt alone,
token for token, whatever else is in the batch: with plenty of blocks, under a pool small enough to
force preemption, with a token budget small enough to chunk every prompt, and without prefix caching."""

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import SamplingParams
from tests.conftest import hf_greedy

QUESTIONS = [
    "What is the capital of France?",
    "Tell me about volcanoes.",
    "Write a haiku about the sea.",
    "What is 2+2?",
    "Explain photosynthesis to a child.",
    "List three colours of the rainbow.",
    "Why is the sky blue?",
    "Give me a short tip for learning to cook.",
]
MAX_TOKENS = [24, 20, 16, 12, 24, 18, 22, 14]


@pytest.fixture(scope="module")
def references(real_model):
    model, tok = real_model
    prompts = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    return prompts, [hf_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]


def run_engine(model, tok, prompts, **cfg):
    eng = EngineCore(EngineConfig(**cfg), model=model, tokenizer=tok)
    for i, (p, n) in enumerate(zip(prompts, MAX_TOKENS)):
        eng.add_request(f"q{i}", p, SamplingParams(temperature=0, max_tokens=n))
    outs = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
    assert eng.kv.pool.num_used_blocks == 0
    return eng, [outs[f"q{i}"].token_ids for i in range(len(prompts))]


CONFIGS = {
    "plenty": dict(num_blocks=256),
    "preempting": dict(num_blocks=14, max_num_seqs=8),
    "chunked": dict(num_blocks=256, max_num_batched_tokens=16),
    "no-prefix-cache": dict(num_blocks=256, enable_prefix_caching=False, max_num_seqs=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers_generate(real_model, references, name):
    model, tok = real_model
    prompts, refs = references
    eng, got = run_engine(model, tok, prompts, **CONFIGS[name])
    for i, (g, r) in enumerate(zip(got, refs)):
        assert g == r, f"prompt {i} ({QUESTIONS[i]!r}) differs under {name}"
    if name == "preempting":
        assert eng.scheduler.num_preemptions > 0
    if name == "chunked":
        assert max(s.num_scheduled_tokens for s in eng.telemetry.snapshots()) <= 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_matches_transformers_generate_cuda():
    """The same check on a GPU through the Triton kernels (float32)."""
    from engine.model_loader import load_model

    model, tok = load_model(None, "float32", "cuda")
    prompts = []
    for q in QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        prompts.append(tok(text, add_special_tokens=False)["input_ids"])
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    for cfg in (CONFIGS["plenty"], CONFIGS["preempting"], CONFIGS["chunked"]):
        _, got = run_engine(model, tok, prompts, **cfg)
        assert got == refs


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_greedy_matches_transformers_generate_cuda_random_weights():
    """The same check on a GPU without the embedded GGUF (the device machine has none): SmolLM2-135M's
    shapes with random weights, float32, token-id prompts, in the default and the batch-invariant mode."""
    import random

    from tests.conftest import smollm2_shaped_model, word_tokenizer

    model = smollm2_shaped_model(49152, 30, 8192, seed=0, device="cuda", rms_norm_eps=1e-5, rope_theta=100000.0)
    tok = word_tokenizer(49152)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(5, 60))] for _ in MAX_TOKENS]
    refs = [hf_greedy(model, p, n) for p, n in zip(prompts, MAX_TOKENS)]
    for cfg_ in (CONFIGS["plenty"], CONFIGS["preempting"], CONFIGS["chunked"], dict(num_blocks=256, batch_invariant=True)):
        _, got = run_engine(model, tok, prompts, **cfg_)
        assert got == refs, cfg_

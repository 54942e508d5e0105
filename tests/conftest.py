"""Shared test set-up.

Without CUDA, Triton kernels run through its interpreter: TRITON_INTERPRET must be set before triton is
first imported, so it is set here, at collection time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


def pytest_sessionstart(session):
    """Build the C++ CPU kernels before the first test when this checkout has not built them yet, and show the
    build's own log lines on the terminal (what is compiled and about how long it takes, then a line every 10 s,
    or the wait for another process's build): under ``pytest -q`` the build (minutes on two cores) would
    otherwise look like a hung first test. A failed build is said too; the tests then run the torch path where
    the kernels are missing, as the app does."""
    import logging
    import sys

    from kernels import cpu_build, cpu_ops

    name = cpu_ops.extension_name()
    if cpu_build.is_built(name, cpu_build.build_folder(name)):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def say(text: str) -> None:
        if reporter is not None:
            reporter.write_line(text)
        else:
            print(text, file=sys.stderr, flush=True)

    class Terminal(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            say(record.getMessage())

    log, handler = logging.getLogger(cpu_build.__name__), Terminal(logging.INFO)
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        ok = cpu_ops.available()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    if not ok:
        say(f"C++ CPU kernels not built ({cpu_ops.unavailable_reason()}); the torch path runs instead")


@pytest.fixture(scope="session")
def tokenizer():
    """The embedded SmolLM2 tokenizer (chat template included); loaded once."""
    from engine.model_loader import load_tokenizer

    return load_tokenizer(None)


def make_tiny_model(vocab_size: int, seed: int = 0):
    """The engine's tiny random-weight Llama (float32, CPU; :func:`engine.tiny_random_llama`)."""
    from engine import tiny_random_llama

    return tiny_random_llama(vocab_size, seed=seed)


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer over ``vocab_size`` ids, token ``i`` = the word ``t{i}`` (no files: the device
    machine has no GGUF tokenizer; engine tests that pass token ids need one only to detokenize)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t2", pad_token="t0", unk_token="t0")


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return make_tiny_model(len(tokenizer))


@pytest.fixture(scope="session")
def real_model():
    """The embedded SmolLM2-135M-Instruct in float32 on CPU, with its tokenizer; loaded once."""
    from engine.model_loader import load_model

    return load_model(None, "float32", "cpu")


def hf_greedy(model, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy ``generate`` on one prompt alone (the equivalence oracle)."""
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([input_ids], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             temperature=None, top_p=None, top_k=None)
    return out[0, len(input_ids):].tolist()


SMOLLM2_SHAPES = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      tie_word_embeddings=True)  # SmolLM2-135M's widths and heads


def smollm2_shaped_model(vocab_size: int, num_layers: int, max_positions: int, *, seed: int, device: str,
                         dtype: torch.dtype = torch.float32, **config):
    """A Llama with SmolLM2-135M's widths and heads (hidden 576, 9 query and 3 KV heads), ``num_layers``
    layers and random weights from ``seed``, on ``device`` in ``dtype``; ``config`` overrides LlamaConfig
    fields (the device machine has no GGUF)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, num_hidden_layers=num_layers, max_position_embeddings=max_positions,
                      **{**SMOLLM2_SHAPES, **config})
    return LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()


def invariance_target(greedy: bool, seed: int):
    """The target request of the batch-invariance checks: 10 tokens, EOS ignored, its logprobs kept; greedy, or
    seeded sampling at temperature 0.8."""
    from engine.request import SamplingParams

    return SamplingParams(temperature=0.0 if greedy else 0.8, seed=None if greedy else seed, max_tokens=10,
                          ignore_eos=True, logprobs=0)


def target_alone_and_beside(model, tokenizer, prompt, target, neighbours, *, alone_blocks: int, mixed_blocks: int,
                            budget: int, chunk_cap: int, after: int, twice: bool, batch_invariant: bool = True):
    """The target's (token ids, logprobs) alone (no prefix caching) and beside ``neighbours``
    ((prompt, max_tokens, temperature) triples, EOS ignored) with a step budget of ``budget`` tokens and
    prefill chunks of at most ``min(budget, chunk_cap)``; see :func:`run_beside_neighbours`."""
    from engine.request import SamplingParams

    alone = run_beside_neighbours(model, tokenizer, prompt, target, [],
                                  dict(num_blocks=alone_blocks, enable_prefix_caching=False), 0, False, batch_invariant)
    beside = [(p, SamplingParams(temperature=t, max_tokens=n, ignore_eos=True)) for p, n, t in neighbours]
    cfg = dict(num_blocks=mixed_blocks, max_num_batched_tokens=budget, prefill_chunk_tokens=min(budget, chunk_cap))
    return alone, run_beside_neighbours(model, tokenizer, prompt, target, beside, cfg, after, twice, batch_invariant)


def run_beside_neighbours(model, tokenizer, prompt, target, neighbours, cfg: dict, target_after_steps: int,
                          twice: bool, batch_invariant: bool = True):
    """For the batch-invariance tests (CPU and CUDA): the ``target`` request's (token ids, logprobs) in an
    engine (batch-invariant unless ``batch_invariant`` is False) with ``neighbours`` ((prompt, params)
    pairs) added first and the target after ``target_after_steps`` steps; with ``twice`` the target runs
    once before (so its prompt now hits the prefix cache). Every block must be back in the pool."""
    from engine.config import EngineConfig
    from engine.core import EngineCore

    eng = EngineCore(EngineConfig(**cfg, batch_invariant=batch_invariant), model=model, tokenizer=tokenizer)
    if twice:
        eng.add_request("warm", prompt, target)
        while eng.has_unfinished_requests():
            eng.step()
    for i, (p, sp) in enumerate(neighbours):
        eng.add_request(f"n{i}", p, sp)
    for _ in range(target_after_steps):
        if eng.has_unfinished_requests():
            eng.step()
    eng.add_request("target", prompt, target)
    got = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == "target" and o.finished:
                got = o
    assert eng.kv.pool.num_used_blocks == 0
    return got.token_ids, [lp[1] for lp in got.outputs[0].logprobs]

"""Tests of engine.sampler.Sampler: greedy, mixed batches, seeds, top-k / top-p / min-p, repetition
penalty, dtypes, and a cheap deterministic check of the sampling distribution."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.request import Request, SamplingParams
from engine.sampler import Sampler

VOCAB = 1000


def req(rid: str = "r", prompt: list[int] | None = None, out: list[int] | None = None, **kw) -> Request:
    r = Request(rid, prompt if prompt is not None else [1, 2, 3], SamplingParams(**kw))
    r.output_token_ids = list(out or [])
    return r


def rand_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


# ---------------------------------------------------------------------------------------- greedy
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_greedy_equals_argmax(dtype):
    logits = rand_logits(7).to(dtype)
    reqs = [req(f"r{i}", temperature=0.0) for i in range(7)]
    out = Sampler().sample(logits, reqs)
    assert out == logits.float().argmax(-1).tolist()
    assert all(type(t) is int for t in out)
    assert all(r.generator is None for r in reqs)


def test_empty_batch():
    assert Sampler().sample(torch.empty(0, VOCAB), []) == []


def test_bad_shape_raises():
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, VOCAB), [req()])
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(VOCAB), [req()])
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(1, VOCAB, dtype=torch.int64), [req()])


def test_mixed_batch_greedy_rows_exact_argmax():
    logits = rand_logits(10, seed=1)
    before = logits.clone()
    reqs = []
    for i in range(10):
        if i % 3 == 0:
            reqs.append(req(f"g{i}", temperature=0.0))
        else:
            reqs.append(req(f"s{i}", temperature=1.3, top_k=(50 if i % 2 else -1), top_p=0.9, seed=i))
    out = Sampler(seed=0).sample(logits, reqs)
    argmax = logits.argmax(-1).tolist()
    for i, r in enumerate(reqs):
        if r.sampling_params.temperature == 0.0:
            assert out[i] == argmax[i]
        assert 0 <= out[i] < VOCAB
    assert torch.equal(logits, before), "the sampler must not modify the caller's logits"


def test_top_k_1_and_tiny_top_p_equal_greedy():
    logits = rand_logits(16, seed=2)
    argmax = logits.argmax(-1).tolist()
    for kw in ({"top_k": 1}, {"top_p": 1e-9}, {"min_p": 1.0}, {"temperature": 1e-6}, {"top_k": 1, "top_p": 0.5}):
        reqs = [req(f"r{i}", seed=i, **kw) for i in range(16)]
        for _ in range(3):
            assert Sampler().sample(logits, reqs) == argmax, kw


# ---------------------------------------------------------------------------------------- seeds
def _params(i: int) -> dict:
    choices = [
        {"temperature": 1.0},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.5, "top_k": 20},
        {"temperature": 0.9, "min_p": 0.05, "top_k": 100, "top_p": 0.95},
        {"temperature": 1.2, "repetition_penalty": 1.3},
        {"temperature": 0.0},
    ]
    return choices[i % len(choices)]


@pytest.mark.parametrize("kind", range(5))
def test_seeded_request_independent_of_batch(kind):
    """Same seed and same logits row -> same tokens alone, and at any row of batches of any size."""
    steps = 6
    target_rows = [rand_logits(1, seed=100 + s)[0] for s in range(steps)]

    def run(batch_size: int, position: int, others_seed: int) -> list[int]:
        sampler = Sampler(seed=others_seed)
        target = req("t", prompt=[5, 6, 7], seed=1234, **_params(kind))
        others = [req(f"o{j}", prompt=[j], **_params(j + others_seed)) for j in range(batch_size - 1)]
        for j, o in enumerate(others):
            if j % 2:
                o.sampling_params.seed = 99 + j
        tokens = []
        for s in range(steps):
            batch = others[:position] + [target] + others[position:]
            logits = rand_logits(batch_size, seed=1000 * others_seed + s)
            logits[position] = target_rows[s]
            out = sampler.sample(logits, batch)
            tokens.append(out[position])
            target.output_token_ids.append(out[position])
            for j, o in enumerate(batch):
                if o is not target:
                    o.output_token_ids.append(out[j])
        return tokens

    alone = run(1, 0, 0)
    for batch_size, position, others_seed in [(2, 1, 1), (5, 0, 2), (5, 3, 3), (9, 8, 4), (17, 11, 5)]:
        assert run(batch_size, position, others_seed) == alone, (batch_size, position)


def test_seed_generator_kept_and_reproducible():
    logits = rand_logits(1, seed=3, scale=0.5)
    a, b, c = req("a", seed=7), req("b", seed=7), req("c", seed=8)
    s = Sampler()
    ta = [s.sample(logits, [a])[0] for _ in range(20)]
    assert isinstance(a.generator, torch.Generator)
    g = a.generator
    s.sample(logits, [a])
    assert a.generator is g, "the generator is created once"
    tb = [Sampler().sample(logits, [b])[0] for _ in range(20)]
    tc = [s.sample(logits, [c])[0] for _ in range(20)]
    assert ta == tb
    assert ta != tc
    assert len(set(ta)) > 1, "a flat distribution must not always give the same token"


def test_unseeded_requests_get_generators_from_the_sampler_seed():
    logits = rand_logits(4, seed=4, scale=0.5)

    def run(seed):
        s = Sampler(seed=seed)
        reqs = [req(f"r{i}") for i in range(4)]
        out = [s.sample(logits, reqs) for _ in range(5)]
        assert all(isinstance(r.generator, torch.Generator) for r in reqs)
        return out

    assert run(11) == run(11)
    assert run(11) != run(12)


# ---------------------------------------------------------------------------------------- filters
def test_min_p_filtering_and_ratio():
    # probabilities 0.5, 0.3, 0.15, 0.05 and nothing else; min_p 0.4 -> threshold 0.2: only 0 and 1
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.full((1, 300), -math.inf)
    logits[0, :4] = probs.log()
    n = 2000
    reqs = [req(f"r{i}", seed=i, min_p=0.4) for i in range(n)]
    out = Sampler().sample(logits.expand(n, -1), reqs)
    counts = torch.bincount(torch.tensor(out), minlength=300)
    assert set(out) == {0, 1}
    assert abs(counts[0].item() / n - 0.5 / 0.8) < 0.04


def test_top_k_and_top_p_keep_the_right_sets():
    probs = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    logits = torch.full((1, 50), -30.0)
    logits[0, :5] = probs.log()
    n = 1500
    cases = [({"top_k": 2}, {0, 1}), ({"top_p": 0.6}, {0, 1}), ({"top_p": 0.66}, {0, 1, 2}), ({"top_k": 3, "top_p": 0.5}, {0, 1})]
    for kw, allowed in cases:
        reqs = [req(f"r{i}", seed=i, **kw) for i in range(n)]
        out = Sampler(top_p_candidates=4).sample(logits.expand(n, -1), reqs)
        assert set(out) == allowed, kw


def test_zero_probability_tokens_never_drawn():
    logits = torch.full((1, 4096), -math.inf)
    allowed = torch.tensor([3, 700, 701, 4095])
    logits[0, allowed] = torch.tensor([0.0, -20.0, 1.0, -1.0])
    n = 1000
    reqs = [req(f"r{i}", seed=i) for i in range(n)]
    out = set(Sampler().sample(logits.expand(n, -1), reqs))
    assert out <= set(allowed.tolist())
    assert {3, 701, 4095} <= out


def _reference_allowed(x: torch.Tensor, p: SamplingParams, tol: float = 1e-5) -> set[int]:
    """Tokens a sort-based reference (vLLM's apply_top_k_top_p) may keep; tolerant at the top-p edge."""
    x = x.float() / p.temperature
    if p.min_p > 0:
        x = x.masked_fill(x < x.max() + math.log(p.min_p), -math.inf)
    vals, idx = x.sort(descending=True)
    if 0 < p.top_k < x.numel():
        vals[p.top_k:] = -math.inf
    probs = torch.softmax(vals.double(), -1)
    before = probs.cumsum(0) - probs
    keep = (before < p.top_p + tol) & (probs > 0)
    return set(idx[keep].tolist())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.sampled_from([7, 300, 2000]),
    rows=st.integers(1, 6),
    temperature=st.sampled_from([0.3, 1.0, 2.5]),
    top_k=st.sampled_from([-1, 0, 1, 3, 50]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.05]),
    min_p=st.sampled_from([0.0, 0.1]),
    scale=st.sampled_from([0.1, 2.0, 8.0]),
)
def test_sampled_tokens_are_in_the_reference_kept_set(seed, vocab, rows, temperature, top_k, top_p, min_p, scale):
    logits = rand_logits(rows, vocab=vocab, seed=seed, scale=scale)
    reqs = [req(f"r{i}", seed=seed + i, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p) for i in range(rows)]
    out = Sampler(top_p_candidates=2).sample(logits, reqs)
    for i in range(rows):
        assert out[i] in _reference_allowed(logits[i], reqs[i].sampling_params)


def test_top_p_large_nucleus_escalates():
    """A flat distribution: the nucleus is far larger than the first candidate set."""
    vocab = 3000
    logits = rand_logits(1, vocab=vocab, seed=5, scale=0.05)
    n = 400
    reqs = [req(f"r{i}", seed=i, top_p=0.9) for i in range(n)]
    out = Sampler(top_p_candidates=4).sample(logits.expand(n, -1), reqs)
    allowed = _reference_allowed(logits[0], reqs[0].sampling_params, tol=0.0)
    assert len(allowed) > 2000
    assert set(out) <= allowed
    assert len(set(out)) > 300


# ---------------------------------------------------------------------------------------- penalty
def test_repetition_penalty_changes_the_argmax():
    logits = torch.full((2, 10), -5.0)
    logits[0, 4], logits[0, 6] = 2.0, 1.9  # 4 is in the history: 2.0 / 1.2 = 1.67 < 1.9
    logits[1, 4], logits[1, 6] = -1.0, -1.1  # 4 is in the history: -1.0 * 1.2 = -1.2 < -1.1
    before = logits.clone()
    s = Sampler()
    plain = [req("a", prompt=[4], temperature=0.0), req("b", prompt=[1], out=[4], temperature=0.0)]
    assert s.sample(logits, plain) == [4, 4]
    pen = [
        req("a", prompt=[4], temperature=0.0, repetition_penalty=1.2),
        req("b", prompt=[1], out=[4, 4], temperature=0.0, repetition_penalty=1.2),
    ]
    assert s.sample(logits, pen) == [6, 6]
    # mixed: only the second row is penalised
    assert s.sample(logits, [plain[0], pen[1]]) == [4, 6]
    assert torch.equal(logits, before)


def _reference_penalty(ids: list[int], logits: torch.Tensor, penalty: float) -> torch.Tensor:
    """transformers' RepetitionPenaltyLogitsProcessor.__call__ (v5), on one row ``[1, vocab]``
    (importing transformers' generation package just for it takes seconds)."""
    ids_t = torch.tensor([ids], dtype=torch.int64)
    score = torch.gather(logits, 1, ids_t)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return logits.scatter(1, ids_t, score)


def test_repetition_penalty_matches_transformers_formula():
    logits = rand_logits(3, seed=6)
    reqs = [
        req("a", prompt=[1, 5, 5, 999], out=[7, 8], repetition_penalty=1.3),
        req("b", prompt=[2], repetition_penalty=1.0),
        req("c", prompt=[0, 3], out=[3, 998, 0], repetition_penalty=0.7),
    ]
    x = logits.clone()
    s = Sampler()
    s._apply_repetition_penalty(x, [reqs[0], reqs[2]], [0, 2])
    for i, r in enumerate(reqs):
        ref = _reference_penalty(r.all_token_ids, logits[i : i + 1].clone(), r.sampling_params.repetition_penalty)
        assert torch.equal(x[i : i + 1], ref), r.request_id


def test_repetition_penalty_out_of_range_token_raises():
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(1, 10), [req("a", prompt=[10], temperature=0.0, repetition_penalty=1.1)])


# ---------------------------------------------------------------------------------------- dtypes, distribution
def test_bf16_logits_random_rows():
    logits = rand_logits(4, seed=7)
    s32 = Sampler().sample(logits.bfloat16().float(), [req(f"r{i}", seed=i, top_p=0.9) for i in range(4)])
    s16 = Sampler().sample(logits.bfloat16(), [req(f"r{i}", seed=i, top_p=0.9) for i in range(4)])
    assert s16 == s32


@pytest.mark.parametrize("vocab", [8, 1000])
def test_temperature_distribution(vocab):
    """Frequencies of 4,000 seeded draws match softmax(logits / T) (total variation < 0.05)."""
    g = torch.Generator().manual_seed(8)
    base = torch.randn(vocab, generator=g)
    if vocab > 8:  # most mass on a few tokens spread over several 256-token blocks, plus a long tail
        base[[3, 300, 511, 999]] += 4.0
    t = 1.7
    n = 4000
    reqs = [req(f"r{i}", seed=10_000 + i, temperature=t) for i in range(n)]
    out = Sampler().sample(base.expand(n, -1), reqs)
    freq = torch.bincount(torch.tensor(out), minlength=vocab).double() / n
    expected = torch.softmax(base.double() / t, -1)
    if vocab > 8:  # compare on the heavy tokens plus one bucket for the tail
        heavy = torch.tensor([3, 300, 511, 999])
        tail = torch.ones(vocab, dtype=torch.bool)
        tail[heavy] = False
        freq = torch.cat([freq[heavy], freq[tail].sum().unsqueeze(0)])
        expected = torch.cat([expected[heavy], expected[tail].sum().unsqueeze(0)])
    tv = 0.5 * (freq - expected).abs().sum().item()
    assert tv < 0.05, (freq, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits():
    logits = rand_logits(6, seed=9)
    greedy = [req(f"g{i}", temperature=0.0) for i in range(6)]
    assert Sampler().sample(logits.cuda().bfloat16(), greedy) == logits.bfloat16().float().argmax(-1).tolist()
    mixed = lambda: [req(f"r{i}", seed=i, **_params(i)) for i in range(6)]  # noqa: E731
    cpu = Sampler().sample(logits, mixed())
    gpu = Sampler().sample(logits.cuda(), mixed())
    assert cpu == gpu

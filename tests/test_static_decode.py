"""The padded static-buffer decode path (engine/static_decode.py) on CPU: the same greedy tokens as the
eager path, through staggered arrivals, finishing rows, preemption, parallel sampling (copy-on-write of
a shared block) and prefix-cache hits; padding rows write nothing to the cache."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.llm import LLM
from engine.request import SamplingParams
from engine.static_decode import capture_sizes
from tests.conftest import word_tokenizer


def test_capture_sizes_cover_every_batch_up_to_the_slots():
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64)[-3:] == [48, 56, 64]
    with pytest.raises(ValueError):
        capture_sizes(0)


def test_static_decode_is_off_on_cpu_by_default_and_rejects_unknown_values(tiny_model, tokenizer):
    core = EngineCore(EngineConfig(num_blocks=32, block_size=4, max_num_seqs=4), model=tiny_model, tokenizer=tokenizer)
    assert core.runner.static is None
    with pytest.raises(ValueError, match="static_decode"):
        EngineConfig(static_decode="maybe")


def test_capture_runs_after_a_collection_with_the_collector_off(monkeypatch):
    """Graphs of an engine dropped in a reference cycle must not be destroyed in the middle of another
    engine's capture (that invalidated it on an H200): the collector runs first and is off while capturing."""
    import gc

    from engine.static_decode import StaticDecode

    seen, calls = [], []
    monkeypatch.setattr(gc, "collect", lambda *a: calls.append("collect") or 0)
    monkeypatch.setattr(StaticDecode, "_capture_all", lambda self: seen.append(gc.isenabled()))
    assert gc.isenabled()
    StaticDecode._capture(object.__new__(StaticDecode))
    assert calls == ["collect"] and seen == [False] and gc.isenabled()

    def fail(self):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(StaticDecode, "_capture_all", fail)
    with pytest.raises(RuntimeError):
        StaticDecode._capture(object.__new__(StaticDecode))
    assert gc.isenabled()  # a capture that raises leaves the collector on


def _run(model, tokenizer, static: str, schedule, **kw) -> tuple[dict[str, list[int]], EngineCore]:
    """``schedule``: per step index, the ``(id, prompt, params)`` added before that step."""
    cfg = EngineConfig(**({"num_blocks": 40, "block_size": 4, "max_num_seqs": 6, "static_decode": static} | kw))
    core = EngineCore(cfg, model=model, tokenizer=tokenizer)
    used = {"static": 0}
    if core.runner.static is not None:
        real = core.runner.static.execute

        def counted(scheduled):
            used["static"] += 1
            return real(scheduled)

        core.runner.static.execute = counted  # type: ignore[method-assign]
    tokens: dict[str, list[int]] = {}
    step = 0
    while step <= max(schedule) or core.has_unfinished_requests():
        for rid, prompt, params in schedule.get(step, []):
            core.add_request(rid, prompt, params)
        for out in core.step():
            if out.finished:
                tokens[out.request_id] = list(out.token_ids)
        step += 1
    assert core.kv.pool.num_used_blocks == 0
    core.used_static = used["static"]  # type: ignore[attr-defined]
    return tokens, core


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


SCHEDULE = {
    0: [("a", "the quick brown fox", _greedy(20)), ("b", "hello", _greedy(7))],
    2: [("c", "a much longer prompt that spans several blocks of four tokens each", _greedy(15))],
    5: [("d", "the quick brown fox", _greedy(12))],  # prefix-cache hit on a's prompt
    9: [("e", "x", _greedy(30)), ("f", "y z", _greedy(3)), ("g", "hello", _greedy(9))],
}


def test_padded_static_decode_gives_the_eager_tokens(tiny_model, tokenizer):
    eager, _ = _run(tiny_model, tokenizer, "off", SCHEDULE)
    static, core = _run(tiny_model, tokenizer, "on", SCHEDULE)
    assert core.used_static > 20  # most steps are pure decode steps
    assert static == eager


def test_static_decode_survives_preemption_and_copy_on_write(tiny_model, tokenizer):
    schedule = {
        0: [(f"r{i}", f"prompt number {i} with some words", _greedy(24)) for i in range(5)],
        3: [("n", "fork me", SamplingParams(n=3, temperature=0, max_tokens=10, ignore_eos=True))],
    }
    eager, c1 = _run(tiny_model, tokenizer, "off", schedule, num_blocks=28)
    static, c2 = _run(tiny_model, tokenizer, "on", schedule, num_blocks=28)
    assert c1.scheduler.num_preemptions > 0 and c2.scheduler.num_preemptions > 0  # the pool is too small
    assert c2.kv.num_cow_copies > 0 and c2.used_static > 0
    assert static == eager


def test_padding_rows_write_nothing_to_the_cache(tiny_model, tokenizer):
    core = EngineCore(EngineConfig(num_blocks=16, block_size=4, max_num_seqs=8, static_decode="on"),
                      model=tiny_model, tokenizer=tokenizer)
    core.add_request("solo", "hi there", _greedy(6))
    core.step()  # prefill
    free = [b for b in range(16) if core.kv.pool.ref_cnt[b] == 0]
    before = [(k[free].clone(), v[free].clone()) for k, v in core.runner.kv_caches]
    core.add_request("two", "ok", _greedy(4))
    core.add_request("three", "yes", _greedy(4))  # three decoding rows run padded to 4
    held: set[int] = set()
    while core.has_unfinished_requests():
        for req in core.scheduler.running:
            held.update(req.block_ids)
        core.step()
        for req in core.scheduler.running:
            held.update(req.block_ids)
    assert core.runner.static is not None and core.runner.static.padded_size(3) == 4
    # blocks no request held still hold what they held: the padding rows (slot -1) wrote nothing
    untouched = [i for i, b in enumerate(free) if b not in held]
    assert untouched
    for (k, v), (k0, v0) in zip(core.runner.kv_caches, before):
        assert torch.equal(k[free][untouched], k0[untouched]) and torch.equal(v[free][untouched], v0[untouched])


def test_real_model_float32_greedy_tokens_equal_with_and_without_static_decode():
    prompts = ["The capital of France is", "List three colours:", "def fib(n):", "Once upon a time"]
    params = [_greedy(n) for n in (24, 9, 17, 30)]
    outs = {}
    for static in ("off", "on"):
        llm = LLM(dtype="float32", max_num_seqs=4, num_blocks=64, static_decode=static)
        outs[static] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["on"] == outs["off"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_gives_the_eager_tokens():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).to("cuda").eval()
    tok = word_tokenizer(512)
    schedule = {0: [(f"r{i}", [3 + i, 40 + i, 7] * (i + 1), _greedy(12 + 3 * i)) for i in range(5)],
                4: [("late", [9, 9, 9, 9, 9], _greedy(20))]}
    eager, _ = _run(model, tok, "off", schedule, num_blocks=64, max_num_seqs=8)
    graphs, core = _run(model, tok, "auto", schedule, num_blocks=64, max_num_seqs=8)
    static = core.runner.static
    assert static is not None and static.use_graphs and static.capture_seconds > 0 and core.used_static > 10
    assert graphs == eager

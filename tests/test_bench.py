"""The benchmark's measurements on tiny runs (tiny model, CPU): the counts must add up exactly."""

from __future__ import annotations

import json

import pytest

from bench import metrics, systems, workloads


@pytest.fixture(scope="module")
def workload(tokenizer):
    return workloads.offline_workload(tokenizer, n=6, low=2, high=9)


@pytest.fixture(scope="module")
def clean_model(tiny_model):
    """The shared tiny model, with the bench's forward timer removed again afterwards."""
    yield tiny_model
    clock = getattr(tiny_model, "_cbp_forward_clock", None)
    if clock is not None:
        clock.remove()


def test_skewed_lengths_are_seeded_bounded_and_right_skewed():
    a = workloads.skewed_max_tokens(400)
    assert a == workloads.skewed_max_tokens(400)
    assert min(a) >= 16 and max(a) <= 256
    assert sorted(a)[200] < sum(a) / len(a)  # median below mean: a long tail of long answers


def test_percentile_interpolates():
    assert metrics.percentile([], 50) is None
    assert metrics.percentile([3.0], 99) == 3.0
    assert metrics.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert metrics.percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0


def test_continuous_run_counts(clean_model, tokenizer, workload):
    run = systems.run_ours(clean_model, tokenizer, workload, "continuous", max_num_seqs=8, num_blocks=64)
    m = metrics.summarize(run)
    lengths = [r.max_tokens for r in workload]
    assert m["generated_tokens"] == sum(lengths)
    assert sorted(r.num_output_tokens for r in run.requests) == sorted(lengths)
    # every request is admitted at step 1 (slots to spare) and gets one token per step
    assert m["steps"] == max(lengths)
    assert m["idle_slot_steps"] == 0
    assert m["preemptions"] == 0
    assert [s.num_scheduled for s in run.steps] == [sum(1 for n in lengths if n > k) for k in range(max(lengths))]
    for s in run.steps:  # KV after each step: the blocks of requests that finished in it are already freed
        assert 0 <= s.kv_real <= s.kv_reserved
        assert s.kv_reserved % 16 == 0
        assert (s.kv_reserved > 0) == (s is not run.steps[-1])
        assert 0.0 <= s.forward <= s.duration
    assert 0 < m["kv_real_pct_mean"] <= 100
    assert m["kv_reserved_peak"] == max(s.kv_reserved for s in run.steps)
    assert 0 <= m["outside_forward_pct"] < 100
    prompt = sum(len(r.prompt_token_ids) for r in workload)
    assert m["prefill_tokens"] + m["prefix_hit_tokens"] == prompt  # shared system prompt: blocks reused
    assert m["tokens_per_s"] == pytest.approx(m["generated_tokens"] / m["wall_s"])
    for r in run.requests:
        assert 0 <= r.arrival <= r.first_token <= r.finish


def test_static_holds_finished_rows_and_reserves_up_front(clean_model, tokenizer, workload):
    workload = [workloads.BenchRequest(r.request_id, r.prompt_token_ids, n) for r, n in zip(workload, [2, 30, 8, 20])]
    cont = metrics.summarize(systems.run_ours(clean_model, tokenizer, workload, "continuous", max_num_seqs=8,
                                          num_blocks=64))
    run = systems.run_ours(clean_model, tokenizer, workload, "static", max_num_seqs=8, num_blocks=64)
    m = metrics.summarize(run)
    lengths = [r.max_tokens for r in workload]
    assert m["generated_tokens"] == sum(lengths)
    assert m["steps"] == max(lengths)  # one batch
    assert m["idle_slot_steps"] == sum(max(lengths) - n for n in lengths)
    # prompt + max_tokens reserved at admission: a lower share holds real tokens
    assert m["kv_real_pct_mean"] < cont["kv_real_pct_mean"]
    # the model-free replay of the same schedule gives the same counts
    for policy, measured in (("static", m), ("continuous", cont)):
        r = systems.replay_schedule(workload, policy, max_num_seqs=8, num_blocks=64)
        assert (r["steps"], r["idle_slot_steps"], r["kv_reserved_peak"]) == (
            measured["steps"], measured["idle_slot_steps"], measured["kv_reserved_peak"])
        assert r["kv_real_pct_mean"] == pytest.approx(measured["kv_real_pct_mean"])
    assert run.steps[0].kv_reserved >= sum(-(-(len(r.prompt_token_ids) + r.max_tokens - 1) // 16) * 16
                                           for r in workload) - 16  # the shared system-prompt block counts once


def test_hf_static_matches_ours_and_counts_padding(clean_model, tokenizer, workload):
    ours = systems.run_ours(clean_model, tokenizer, workload, "continuous", max_num_seqs=8, num_blocks=64)
    run = systems.run_hf_static(clean_model, tokenizer, workload, batch_size=4)
    m = metrics.summarize(run)
    lengths = [r.max_tokens for r in workload]
    batches = [lengths[:4], lengths[4:]]
    assert m["generated_tokens"] == sum(lengths)
    assert m["steps"] == sum(max(b) for b in batches)
    assert m["idle_slot_steps"] == sum(max(b) - n for b in batches for n in b)
    for s in run.steps:
        assert s.kv_real <= s.kv_reserved
    ref = {r.request_id: r.output_token_ids for r in ours.requests}
    assert all(ref[r.request_id] == r.output_token_ids for r in run.requests)  # greedy fp32, same tokens


def test_multiturn_resends_history_and_prefix_caching_saves_prefill(clean_model, tokenizer):
    results = {}
    for caching in (True, False):
        mt = workloads.MultiTurn(tokenizer, conversations=2, turns=3, max_tokens=3)
        seen = []

        def next_turn(done, out, mt=mt, seen=seen):
            nxt = mt.next_turn(done, out)
            if nxt is not None:
                assert nxt.prompt_token_ids[: len(done.prompt_token_ids) + len(out)] == done.prompt_token_ids + out
                seen.append(nxt.request_id)
            return nxt

        run = systems.run_ours(clean_model, tokenizer, mt.first_turns(), "continuous", next_turn=next_turn,
                             max_num_seqs=4, num_blocks=128, enable_prefix_caching=caching)
        assert sorted(seen) == ["c0t1", "c0t2", "c1t1", "c1t2"]
        results[caching] = metrics.summarize(run)
        assert results[caching]["generated_tokens"] == 2 * 3 * 3
    on, off = results[True], results[False]
    assert off["prefix_hit_tokens"] == 0
    assert on["prefix_hit_tokens"] > 0
    assert on["prefill_tokens"] + on["prefix_hit_tokens"] == off["prefill_tokens"]


def test_table_json_and_html_report(clean_model, tokenizer, workload, tmp_path):
    run = systems.run_ours(clean_model, tokenizer, workload[:2], "continuous", max_num_seqs=4, num_blocks=32)
    m = metrics.summarize(run)
    m["series"] = metrics.step_series(run)
    m["same_tokens_as_ours"] = 2
    text = metrics.format_table([m])
    assert "ours-continuous" in text and "tok/s" in text
    report = {"environment": {"dtype": "float32"}, "offline": [m], "load_start": [1, 1, 1], "load_end": [1, 1, 1]}
    json.dumps(report)  # JSON-ready
    pytest.importorskip("plotly")
    from bench.report import write_report

    path = tmp_path / "r.html"
    write_report(report, str(path))
    assert "ours-continuous" in path.read_text()


def test_command_line_uses_the_engine_options():
    """``python -m bench`` declares the engine's options once (engine.options), with the bench's defaults."""
    from bench.cli import build_parser, engine_args_from

    def picked(args, keys=("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks", "kv_cache_memory",
                           "enable_prefix_caching")):
        kw = engine_args_from(args)
        assert not {"model", "dtype", "device", "policy"} & set(kw)  # loaded once / fixed by each system
        assert None not in kw.values()  # unset values are left to the engine
        return {k: kw[k] for k in keys if k in kw}

    args = build_parser().parse_args(["--quick", "--systems", "ours-continuous"])
    assert args.model is None and args.dtype is None and args.device is None and args.policy == "continuous"
    assert picked(args) == {"max_num_seqs": 64, "max_num_batched_tokens": 2048, "block_size": 16,
                            "enable_prefix_caching": True}
    args = build_parser().parse_args(["--no-enable-prefix-caching", "--num-blocks", "32", "--kv-cache-memory", "1GiB",
                                      "--max-num-seqs", "8", "--policy", "static"])
    assert picked(args) == {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "block_size": 16, "num_blocks": 32,
                            "enable_prefix_caching": False}
    args = build_parser().parse_args(["--kv-cache-memory", "0.5"])
    assert engine_args_from(args)["kv_cache_memory"] == "0.5"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--no-prefix-caching"])  # vLLM's name now: --no-enable-prefix-caching


def test_one_prompt_bank_serves_every_user():
    import random

    from engine.prompts import plain_prompts, synthetic_chat

    p = plain_prompts(45)
    assert p[0] == "Tell me about volcanoes." and p[20] == "Tell me about volcanoes. (part 2)"
    assert len(set(p)) == 45
    a = [synthetic_chat(random.Random(3)) for _ in range(2)]
    assert a[0] == a[1]  # seeded
    chats = [synthetic_chat(random.Random(i)) for i in range(40)]
    assert all(16 <= mt <= 256 for _, mt in chats)
    assert any("Continuous batching lets" in msgs[0]["content"] for msgs, _ in chats)  # a long preamble


def test_decode_step_profile_refuses_a_pool_too_small_instead_of_spinning(clean_model, tokenizer):
    from bench.step_profile import profile_decode_step

    with pytest.raises(ValueError, match="KV blocks"):  # 3 requests at context 40 need more than 4 blocks
        profile_decode_step(clean_model, tokenizer, num_requests=3, context=40, steps=2, torch_profile=False,
                            num_blocks=4)


def test_decode_step_profile_times_the_parts_and_puts_them_back(clean_model, tokenizer):
    from bench.step_profile import profile_decode_step

    p = profile_decode_step(clean_model, tokenizer, num_requests=3, context=40, steps=2, torch_profile=False,
                            num_blocks=64)
    assert p["num_running"] == 3 and p["context"] >= 40
    for part in ("schedule", "sample", "attention (paged_attention)", "other (step glue)"):
        assert part in p["parts_ms"]
    assert any(k.startswith("update") for k in p["parts_ms"])  # update_from_output, or update before the rename
    assert p["step_ms"] > 0 and 0 <= p["forward_ms"] <= p["step_ms"]
    import kernels

    assert kernels.paged_attention.__name__ == "paged_attention"  # the module's own function is back

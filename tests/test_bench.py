"""The benchmark's measurements on tiny runs (tiny model, CPU): the counts must add up exactly."""

from __future__ import annotations

import json

import pytest

from engine import bench


@pytest.fixture(scope="module")
def workload(tokenizer):
    return bench.offline_workload(tokenizer, n=6, low=2, high=9)


@pytest.fixture(scope="module")
def clean_model(tiny_model):
    """The shared tiny model, with the bench's forward timer removed again afterwards."""
    yield tiny_model
    clock = getattr(tiny_model, "_cbp_forward_clock", None)
    if clock is not None:
        clock.remove()


def test_skewed_lengths_are_seeded_bounded_and_right_skewed():
    a = bench.skewed_max_tokens(400)
    assert a == bench.skewed_max_tokens(400)
    assert min(a) >= 16 and max(a) <= 256
    assert sorted(a)[200] < sum(a) / len(a)  # median below mean: a long tail of long answers


def test_percentile_interpolates():
    assert bench.percentile([], 50) is None
    assert bench.percentile([3.0], 99) == 3.0
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert bench.percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0


def test_continuous_run_counts(clean_model, tokenizer, workload):
    run = bench.run_ours(clean_model, tokenizer, workload, "continuous", max_num_seqs=8, num_blocks=64)
    m = bench.summarize(run)
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
    workload = [bench.BenchRequest(r.request_id, r.prompt_token_ids, n) for r, n in zip(workload, [2, 30, 8, 20])]
    cont = bench.summarize(bench.run_ours(clean_model, tokenizer, workload, "continuous", max_num_seqs=8,
                                          num_blocks=64))
    run = bench.run_ours(clean_model, tokenizer, workload, "static", max_num_seqs=8, num_blocks=64)
    m = bench.summarize(run)
    lengths = [r.max_tokens for r in workload]
    assert m["generated_tokens"] == sum(lengths)
    assert m["steps"] == max(lengths)  # one batch
    assert m["idle_slot_steps"] == sum(max(lengths) - n for n in lengths)
    # prompt + max_tokens reserved at admission: a lower share holds real tokens
    assert m["kv_real_pct_mean"] < cont["kv_real_pct_mean"]
    # the model-free replay of the same schedule gives the same counts
    for policy, metrics in (("static", m), ("continuous", cont)):
        r = bench.replay_schedule(workload, policy, max_num_seqs=8, num_blocks=64)
        assert (r["steps"], r["idle_slot_steps"], r["kv_reserved_peak"]) == (
            metrics["steps"], metrics["idle_slot_steps"], metrics["kv_reserved_peak"])
        assert r["kv_real_pct_mean"] == pytest.approx(metrics["kv_real_pct_mean"])
    assert run.steps[0].kv_reserved >= sum(-(-(len(r.prompt_token_ids) + r.max_tokens - 1) // 16) * 16
                                           for r in workload) - 16  # the shared system-prompt block counts once


def test_hf_static_matches_ours_and_counts_padding(clean_model, tokenizer, workload):
    ours = bench.run_ours(clean_model, tokenizer, workload, "continuous", max_num_seqs=8, num_blocks=64)
    run = bench.run_hf_static(clean_model, tokenizer, workload, batch_size=4)
    m = bench.summarize(run)
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
        mt = bench.MultiTurn(tokenizer, conversations=2, turns=3, max_tokens=3)
        seen = []

        def next_turn(done, out, mt=mt, seen=seen):
            nxt = mt.next_turn(done, out)
            if nxt is not None:
                assert nxt.prompt_token_ids[: len(done.prompt_token_ids) + len(out)] == done.prompt_token_ids + out
                seen.append(nxt.request_id)
            return nxt

        run = bench.run_ours(clean_model, tokenizer, mt.first_turns(), "continuous", next_turn=next_turn,
                             max_num_seqs=4, num_blocks=128, enable_prefix_caching=caching)
        assert sorted(seen) == ["c0t1", "c0t2", "c1t1", "c1t2"]
        results[caching] = bench.summarize(run)
        assert results[caching]["generated_tokens"] == 2 * 3 * 3
    on, off = results[True], results[False]
    assert off["prefix_hit_tokens"] == 0
    assert on["prefix_hit_tokens"] > 0
    assert on["prefill_tokens"] + on["prefix_hit_tokens"] == off["prefill_tokens"]


def test_table_json_and_html_report(clean_model, tokenizer, workload, tmp_path):
    run = bench.run_ours(clean_model, tokenizer, workload[:2], "continuous", max_num_seqs=4, num_blocks=32)
    m = bench.summarize(run)
    m["series"] = bench.step_series(run)
    m["same_tokens_as_ours"] = 2
    text = bench.format_table([m])
    assert "ours-continuous" in text and "tok/s" in text
    report = {"environment": {"dtype": "float32"}, "offline": [m], "load_start": [1, 1, 1], "load_end": [1, 1, 1]}
    json.dumps(report)  # JSON-ready
    pytest.importorskip("plotly")
    from ui.report import write_report

    path = tmp_path / "r.html"
    write_report(report, str(path))
    assert "ours-continuous" in path.read_text()

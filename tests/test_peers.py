"""bench/peers.py without vLLM and without a model: workloads, table, ratios, argument handling."""

from __future__ import annotations

import os

import pytest

from bench import peers, peers_run  # light: neither imports torch nor vLLM at module level

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))




def test_w64_file_loads_whole_and_cut():
    reqs = peers.load_w64()
    assert len(reqs) == 64
    assert sum(r["max_tokens"] for r in reqs) == 8161
    assert all(isinstance(t, int) for t in reqs[0]["prompt_token_ids"])
    assert peers.load_w64(n=4) == reqs[:4]


def test_synthetic_prompts_are_deterministic_and_distinct():
    a = peers.synthetic_prompt(4000, 1)
    assert len(a) == 4000 and a == peers.synthetic_prompt(4000, 1)
    assert all(peers.SYNTH_LOW <= t < peers.SYNTH_HIGH for t in a)
    b = peers.synthetic_prompt(4000, 2)
    assert a[:16] != b[:16]  # no shared first block: the prefix cache cannot serve one from the other


def test_mixed_case_is_eight_chats_and_one_long_prompt():
    chats = [{"prompt_token_ids": [1, 2, i], "max_tokens": 200} for i in range(3)]
    reqs = peers.mixed_requests(chats, num_chats=8, chat_tokens=64, long_tokens=4000, long_max_tokens=1)
    assert len(reqs) == 9
    assert [r["max_tokens"] for r in reqs] == [64] * 8 + [1]
    assert [r["prompt_token_ids"][-1] for r in reqs[:8]] == [0, 1, 2, 0, 1, 2, 0, 1]  # cycles over the chats
    assert len(reqs[-1]["prompt_token_ids"]) == 4000
    with pytest.raises(ValueError):
        peers.mixed_requests([], 8)


def test_build_spec_selects_works_and_separates_long_prompts():
    w64 = peers.load_w64(n=8)
    spec = peers.build_spec(["w64", "prefill", "mixed"], w64, prefill_tokens=4000, check_ids=[1, 2, 3])
    assert spec["check"] == [1, 2, 3]
    assert len(spec["warmup"]) == 4 and all(r["max_tokens"] == 8 for r in spec["warmup"])
    assert spec["w64"] == w64
    p = spec["prefill"]
    assert len(p["prompt_token_ids"]) == len(p["warmup_token_ids"]) == 4000
    long_mixed = spec["mixed"][-1]["prompt_token_ids"]
    firsts = {tuple(p["prompt_token_ids"][:16]), tuple(p["warmup_token_ids"][:16]), tuple(long_mixed[:16])}
    assert len(firsts) == 3
    only = peers.build_spec(["prefill"], w64, prefill_tokens=1000)
    assert set(only) == {"warmup", "prefill"} and len(only["prefill"]["prompt_token_ids"]) == 1000


def test_parse_only():
    assert peers.parse_only(None) == ["w64", "prefill", "mixed"]
    assert peers.parse_only(None, http=True) == ["w64", "prefill", "mixed", "http"]
    assert peers.parse_only("mixed,w64") == ["w64", "mixed"]
    with pytest.raises(ValueError, match="unknown"):
        peers.parse_only("w64,bogus")


def test_ratio_and_compare_on_fake_results():
    assert peers.ratio(10, 5) == 2 and peers.ratio(None, 5) is None and peers.ratio(1, 0) is None
    ours = {"w64": {"tokens_per_s": 900.0}, "prefill": {"tokens_per_s": 2000.0}, "mixed": {"seconds": 3.0},
            "http": {"output_throughput": 500.0, "median_ttft_ms": 100.0, "median_tpot_ms": 50.0, "duration": 20.0}}
    vllm = {"w64": {"tokens_per_s": 450.0}, "prefill": {"tokens_per_s": 4000.0}, "mixed": {"seconds": 6.0},
            "http": {"output_throughput": 500.0, "median_ttft_ms": 200.0, "median_tpot_ms": 50.5, "duration": 10.0}}
    rows = {r["label"]: r for r in peers.compare(ours, vllm)}
    w = rows["W64 offline: generated tokens/s"]
    assert w["ratio"] == pytest.approx(2.0) and w["better"] == "ours"
    assert rows["Prefill: prompt tokens/s"]["better"] == "vllm"
    m = rows["Mixed (chats + long prompt): wall s"]
    assert m["ratio"] == pytest.approx(0.5) and m["better"] == "ours"  # lower time is better
    assert rows["HTTP: output tokens/s"]["better"] == "tie"
    assert rows["HTTP: median TPOT ms"]["better"] == "tie"
    assert rows["HTTP: duration s"]["better"] == "vllm"


def test_compare_skips_missing_and_keeps_one_sided():
    rows = peers.compare({"w64": {"tokens_per_s": 100.0}}, {})
    assert len(rows) == 1 and rows[0]["vllm"] is None and rows[0]["ratio"] is None and rows[0]["better"] is None
    assert peers.compare({}, {}) == []


def test_compare_leaves_out_an_invalid_run():
    failed = {"http": {"output_throughput": 0.0, "duration": 0.02, "invalid": "4 of 4 requests failed"}}
    good = {"http": {"output_throughput": 60.0, "duration": 1.0}}
    rows = {r["label"]: r for r in peers.compare(failed, good)}
    assert rows["HTTP: output tokens/s"]["ours"] is None and rows["HTTP: output tokens/s"]["ratio"] is None


def test_format_table_and_header():
    rows = peers.compare({"w64": {"tokens_per_s": 812.345}, "mixed": {"seconds": 4.5}},
                         {"w64": {"tokens_per_s": 900.0}, "mixed": {"seconds": 3.0}})
    text = peers.format_table(rows)
    lines = text.splitlines()
    assert [c.strip() for c in lines[0].split("|")] == ["work", "ours", "vLLM", "ours/vLLM", "better"]
    assert len(lines) == 4 and set(lines[1]) <= {"-", "+"}
    assert "812" in lines[2] and "900" in lines[2] and "0.90x" in lines[2] and "vllm" in lines[2]
    assert "higher is better" in lines[2] and "lower is better" in lines[3] and "1.50x" in lines[3]
    assert len({len(ln) for ln in lines}) == 1  # aligned columns
    assert "-" in peers.format_table(peers.compare({"w64": {"tokens_per_s": 1.0}}, {})).splitlines()[2]
    head = peers.format_header({"cpu": {"name": "Test CPU", "cores": 2, "flags": {"avx2": True, "avx512_bf16": False}},
                                "dtype": "bfloat16", "threads": 2, "kv_cache_gib": 2.0,
                                "versions": {"vllm": "0.32.0", "vllm torch": None}})
    assert "Test CPU" in head and "avx2=yes" in head and "avx512_bf16=no" in head and "amx_bf16=no" in head
    assert "dtype: bfloat16" in head and "threads: 2" in head and "vllm 0.32.0" in head


def test_read_result_takes_the_last_marked_line():
    text = "INFO noise\n@@PEERS_RESULT {\"a\": 1}\nmore\n@@PEERS_RESULT {\"a\": 2}\n"
    assert peers_run.read_result(text) == {"a": 2}
    assert peers_run.read_result("nothing here") is None


def test_cpu_info_shape():
    info = peers.cpu_info()
    assert set(info) == {"name", "cores", "flags"} and "avx512_bf16" in info["flags"]


def test_format_floor_names_step_floor_and_ratio():
    line = peers.format_floor({"step_ms": 66.0, "context": 159.0, "forward": "own", "floor_ms": 16.5, "gflop": 17.9,
                               "matmul_gflops": 2500.0, "kv_mb": 235.0, "bandwidth_gbs": 27.5})
    assert "66.0 ms" in line and "floor 16.5 ms" in line and "step / floor = 4.00" in line and "own forward" in line


def test_steal_meter(monkeypatch, tmp_path):
    """The share of CPU time the hypervisor gave to other guests between two reads of /proc/stat."""
    stat = tmp_path / "stat"
    real_open = open

    def fake_open(path, *a, **k):
        return real_open(stat, *a, **k) if path == "/proc/stat" else real_open(path, *a, **k)

    monkeypatch.setattr("builtins.open", fake_open)
    stat.write_text("cpu  100 0 50 800 0 0 0 50 0 0\ncpu0 1 2 3\n")
    start = peers_run.cpu_times()
    assert start == (50, 1000)
    stat.write_text("cpu  180 0 60 900 0 0 0 60 0 0\n")  # 200 more ticks, 10 of them stolen
    assert peers_run.steal_since(start) == pytest.approx(5.0)
    assert peers_run.steal_since(None) is None
    stat.write_text("intr 1 2\n")
    assert peers_run.cpu_times() is None

"""The Compare tab's batch-invariance demo (ui/invariance.py) on the tiny model: in batch-invariant mode the
target's tokens alone and inside the busy batch are identical; the HTML marks what differs."""

from __future__ import annotations

import pytest
import torch

import kernels
from tests._browser import serve
from tests.conftest import make_tiny_model
from ui import invariance

pytestmark = pytest.mark.skipif(not kernels.cpp_available(), reason="needs the C++ CPU kernels")


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def runs(request, tokenizer):
    model = make_tiny_model(len(tokenizer), seed=3).to(request.param)
    return invariance.run_invariance(model, tokenizer)


def test_batch_invariant_mode_gives_the_same_tokens_alone_and_in_a_busy_batch(runs):
    inv = runs["batch_invariant"]
    assert len(inv.alone) == invariance.TARGET_TOKENS
    assert inv.alone == inv.busy
    assert inv.first_difference is None
    assert len(inv.logprobs_alone) == invariance.TARGET_TOKENS and inv.logprobs_alone == inv.logprobs_busy
    assert inv.max_logprob_difference == 0.0
    assert inv.max_batch > 1  # the target really shared steps with the neighbours
    assert inv.neighbours == len(invariance.NEIGHBOURS)
    assert len(runs["default"].busy) == invariance.TARGET_TOKENS


def test_float32_default_mode_is_batch_invariant_where_the_own_float32_gemm_runs(runs, request):
    """On CPUs whose float32 linears run on the engine's own GEMM (AVX2 without AVX-512: one FMA chain per
    output whatever the batch), the default mode needs no row tiles to be batch invariant in float32: the
    target's tokens and log-probabilities are the same alone and in the busy batch, bit for bit."""
    from kernels import cpu_linear

    if request.node.callspec.params["runs"] != torch.float32 or not cpu_linear.own_gemm_f32_cpu():
        pytest.skip("float32 linears on the own GEMM only (CPUs with AVX2 and no AVX-512)")
    default = runs["default"]
    assert default.alone == default.busy and default.max_logprob_difference == 0.0
    assert default.max_batch > 1


def test_first_difference_and_html_mark_the_tokens_from_where_the_runs_part():
    run = invariance.InvarianceRun(False, [1, 2, 3, 4], [1, 2, 9, 4], ["a", "b", "<c>", "\n"], ["a", "b", "z", "\n"],
                                   12, 13)
    assert run.first_difference == 2
    same = invariance.InvarianceRun(True, [1, 2], [1, 2], ["a", "b"], ["a", "b"], 12, 13,
                                    logprobs_alone=[-0.5, -1.0], logprobs_busy=[-0.5, -1.0])
    assert same.first_difference is None
    near = invariance.InvarianceRun(False, [1, 2], [1, 2], ["a", "b"], ["a", "b"], 12, 13,
                                    logprobs_alone=[-0.5, -1.0], logprobs_busy=[-0.5, -1.00002])
    assert invariance.verdict(near) == ("identical, 2 of 2 tokens; but their log-probabilities differ by up to "
                                        "2.0e-05 (a near-tie would flip a token)")
    out = invariance.invariance_html({"default": run, "batch_invariant": same})
    assert 'data-mode="default" data-first-diff="2"' in out
    assert 'data-mode="batch_invariant" data-first-diff=""' in out
    assert "&lt;c&gt;" in out and "↵" in out  # token texts are escaped; a newline is shown
    assert out.count("cbp-tok-diff") == 4  # tokens 3 and 4 of both rows of the default mode
    assert "differs from token 3 of 4" in out
    assert "identical, 2 of 2 tokens; log-probabilities equal bit for bit" in out
    ko = invariance.invariance_html({"default": run, "batch_invariant": same}, "ko")
    assert "4개 중 3번째부터 다름" in ko and "혼자:" in ko


def test_the_invariance_endpoint_answers_in_the_compare_tab(tokenizer):
    """The accordion's button in the Compare tab is the API endpoint /invariance (tiny float32 model)."""
    gradio_client = pytest.importorskip("gradio_client")
    import gradio as gr

    from ui import compare

    model = make_tiny_model(len(tokenizer), seed=3)
    with gr.Blocks() as demo:
        compare.build_compare_tab((model, tokenizer))
    url = serve(demo)
    try:
        client = gradio_client.Client(url, verbose=False, headers={"Accept-Language": "ko-KR,ko;q=0.9"})
        out = client.predict(api_name="/invariance")
        client.close()
        assert 'data-mode="batch_invariant" data-first-diff=""' in out and "혼자:" in out
    finally:
        demo.close()

"""The Compare tab's logic (ui/compare.py) on the tiny model: exact slot assignments per step."""

from __future__ import annotations

import pytest

from ui import compare


@pytest.fixture(scope="module")
def classic(tiny_model, tokenizer):
    return compare.run_compare(tiny_model, tokenizer, "classic")


def test_continuous_refills_freed_slots_at_the_next_step(classic):
    h = classic["continuous"].slot_history
    assert h[0] == {"A": 0, "B": 1, "C": 2}
    assert h[1] == {"A": 0, "B": 1, "C": 2}  # A's 2nd (last) token
    assert h[2] == {"B": 1, "C": 2, "D": 0}  # step 3: D takes A's slot; C's 3rd (last) token
    assert h[3] == {"B": 1, "D": 0, "E": 2}  # step 4: E takes C's slot
    assert h[4] == {"B": 1, "D": 0, "E": 2}  # step 5: B's 5th (last) token
    assert h[5] == {"D": 0, "E": 2}
    assert h[6] == {"E": 2}
    assert classic["continuous"].admitted[:4] == [["A", "B", "C"], [], ["D"], ["E"]]
    assert classic["continuous"].steps == 7
    assert classic["continuous"].idle_slot_steps == 0


def test_static_starts_d_and_e_only_after_b_finishes(classic):
    run = classic["static"]
    h = run.slot_history
    assert h[0] == h[1] == {"A": 0, "B": 1, "C": 2}
    assert h[2] == {"B": 1, "C": 2}  # A's row stays empty (held)
    assert h[3] == h[4] == {"B": 1}  # B's 4th and 5th tokens
    assert h[5] == {"D": 0, "E": 1}  # step 6: D and E start only after B's fifth token
    assert h[6] == h[7] == h[8] == {"D": 0, "E": 1}
    assert run.steps == 9
    # held-but-idle rows: A at steps 3-5 (3), C at steps 4-5 (2): 5 slot-steps
    assert run.idle_slot_steps == 5


def test_both_generate_the_same_tokens_and_figures_share_the_axis(classic):
    s, c = classic["static"], classic["continuous"]
    assert s.generated_tokens == c.generated_tokens == 2 + 5 + 3 + 4 + 4
    assert s.texts == c.texts  # greedy: the policy changes when, not what
    fig_s, fig_c = compare.compare_figures(classic)
    assert fig_s.layout.xaxis.range == fig_c.layout.xaxis.range == (0.5, 9.5)
    assert fig_s.layout.title.text.startswith("static: 9 steps · 5 idle slot-steps")
    assert fig_c.layout.title.text.startswith("continuous: 7 steps · 0 idle slot-steps")
    # the heatmap holds D in slot 0 at step 3 under continuous
    z = fig_c.data[0]
    assert z.customdata[0][2][0] == "D"
    assert "2 fewer steps" in compare.summary_markdown(classic, compare.PRESETS["classic"])


def test_compare_tab_builds(tiny_model, tokenizer):
    gr = pytest.importorskip("gradio")
    with gr.Blocks() as demo:
        comps = compare.build_compare_tab((tiny_model, tokenizer))
    assert set(comps) == {"preset", "run", "summary", "static", "continuous"}
    assert demo is not None

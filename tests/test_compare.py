"""The Compare tab's logic (ui/compare.py) on the tiny model: exact slot assignments per step."""

from __future__ import annotations

import json
import re

import gradio as gr
import pytest

from tests._browser import serve
from ui import compare, i18n


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
    assert fig_s.layout.title.text == "static: 9 steps · 5 idle slot-steps"  # no tokens/s: too noisy here
    assert fig_c.layout.title.text == "continuous: 7 steps · 0 idle slot-steps"
    # the heatmap holds D in slot 0 at step 3 under continuous
    z = fig_c.data[0]
    assert z.customdata[0][2][0] == "D"


def test_headline_counts_steps_and_idle_slot_steps_in_english_and_korean(classic):
    assert compare.headline_markdown(classic) == (
        "### static 9 steps · 5 idle slot-steps → continuous 7 steps · 0 idle: 2 fewer steps (1.29x)")
    assert compare.headline_markdown(classic, "ko") == (
        "### 정적 배칭 9 스텝 · 유휴 슬롯-스텝 5 → 연속 배칭 7 스텝 · 유휴 0: 2 스텝 적음 (1.29배)")
    assert "tokens/s" not in compare.headline_markdown(classic)


def test_headline_when_static_loses_nothing(tiny_model, tokenizer):
    runs = compare.run_compare(tiny_model, tokenizer, "uniform")
    assert runs["static"].steps == runs["continuous"].steps
    assert compare.headline_markdown(runs).endswith(": the same number of steps")
    assert compare.headline_markdown(runs, "ko").endswith(": 스텝 수 같음")


def test_figures_in_korean(classic):
    fig_s, fig_c = compare.compare_figures(classic, lang="ko")
    ko = i18n.figure_labels("ko")
    assert fig_s.layout.title.text == "정적 배칭: 9 스텝 · 유휴 슬롯-스텝 5"
    assert fig_c.layout.title.text == "연속 배칭: 7 스텝 · 유휴 슬롯-스텝 0"
    for fig in (fig_s, fig_c):
        assert fig.layout.xaxis.title.text == ko["step"] == "엔진 스텝"
        assert fig.layout.yaxis.title.text == ko["slot"]
        names = {tr.name for tr in fig.data[1:] if tr.name}
        assert {ko["admitted"], ko["prefill"], ko["decode"], ko["idle"]} <= names
        assert not names & {"admitted", "prefill", "decode", "idle (held)"}
        assert ko["request"] in fig.data[0].hovertemplate
    # English by default, and for a language we do not have
    fig_en, _ = compare.compare_figures(classic, lang="fr")
    assert fig_en.layout.xaxis.title.text == "engine step"
    assert fig_en.layout.title.text == "static: 9 steps · 5 idle slot-steps"


def test_preset_titles_in_both_languages():
    for key, preset in compare.PRESETS.items():
        assert preset.i18n_key == f"cmp_preset_{key}"
        assert i18n.EN[preset.i18n_key] == preset.title == preset.title_for("en")  # one English text
        assert preset.title_for("ko") == i18n.KO[preset.i18n_key] != preset.title
    assert compare.PRESETS["classic"].title_for("ko").startswith("기본: 슬롯 3개")
    custom = compare.ComparePreset("mine", "Mine: 2 slots", 2, (("A", "Hi.", 2),))
    assert custom.i18n_key is None and custom.title_for("ko") == "Mine: 2 slots"


def test_every_compare_text_has_a_korean_translation():
    keys = [k for k in i18n.EN if k.startswith("cmp_")]
    assert keys and all(k in i18n.KO and i18n.KO[k] != i18n.EN[k] for k in keys), keys
    for k in keys:  # the server fills the same placeholders in both languages
        assert re.findall(r"{(\w+)}", i18n.EN[k]) == re.findall(r"{(\w+)}", i18n.KO[k]) or k == "cmp_headline"
    assert sorted(re.findall(r"{(\w+)}", i18n.EN["cmp_headline"])) == sorted(
        re.findall(r"{(\w+)}", i18n.KO["cmp_headline"]))


def _i18n_key(value) -> str | None:
    """The translation key of a component's text (an ``I18nData``, or the string Gradio makes of one)."""
    if isinstance(value, str) and value.startswith("__i18n__"):
        return json.loads(value[len("__i18n__"):])["key"]
    return getattr(value, "key", None)


def test_compare_tab_is_one_row_of_two_equal_plots_with_translated_labels(tiny_model, tokenizer):
    with gr.Blocks() as demo:
        comps = compare.build_compare_tab((tiny_model, tokenizer))
    assert set(comps) == {"preset", "run", "summary", "static", "continuous"}
    static, continuous = comps["static"], comps["continuous"]
    row = static.parent
    assert isinstance(row, gr.Row) and continuous.parent is row
    assert row.children == [static, continuous]
    assert static.scale == continuous.scale == 1 and row.equal_height
    controls = comps["run"].parent  # workload and button: one row above (Gradio wraps the dropdown in a Form)
    assert isinstance(controls, gr.Row) and comps["preset"].parent.parent is controls
    # every visible text is a translation key the browser resolves (English or Korean)
    assert _i18n_key(comps["run"].value) == "cbp_cmp_run"
    assert _i18n_key(comps["summary"].value) == "cbp_cmp_hint"
    assert _i18n_key(comps["preset"].label) == "cbp_cmp_workload"
    assert [_i18n_key(label) for label, _ in comps["preset"].choices] == [
        f"cbp_cmp_preset_{k}" for k in compare.PRESETS]
    assert [v for _, v in comps["preset"].choices] == list(compare.PRESETS)
    notes = [b for b in demo.blocks.values() if isinstance(b, gr.Markdown) and b.elem_id == "compare-note"]
    assert len(notes) == 1 and _i18n_key(notes[0].value) == "cbp_cmp_note"



def test_compare_api_endpoint_answers_in_the_callers_language(tiny_model, tokenizer):
    gradio_client = pytest.importorskip("gradio_client")
    with gr.Blocks() as demo:
        compare.build_compare_tab((tiny_model, tokenizer))
    url = serve(demo)
    try:
        client = gradio_client.Client(url, verbose=False)  # no Accept-Language: English
        headline, fig_s, fig_c = client.predict("classic", api_name="/compare")
        assert headline == "### static 9 steps · 5 idle slot-steps → continuous 7 steps · 0 idle: 2 fewer steps (1.29x)"
        assert fig_s and fig_c
        client.close()
        client = gradio_client.Client(url, verbose=False, headers={"Accept-Language": "ko-KR,ko;q=0.9,en;q=0.8"})
        headline, _, _ = client.predict("classic", api_name="/compare")
        assert headline.startswith("### 정적 배칭 9 스텝")
        client.close()
    finally:
        demo.close()


def test_the_page_runs_compare_on_a_tiny_model_with_the_loaded_models_schedule(real_model, classic):
    """The page's runs use a tiny random model over the loaded model's tokenizer (:func:`compare.schedule_model`):
    the same slots at the same steps as the loaded model itself, well within the 3 s a presenter can wait."""
    import time

    model, tokenizer = real_model
    tiny = compare.schedule_model(model, tokenizer)
    assert compare.schedule_model(model, tokenizer) is tiny  # built once
    assert sum(p.numel() for p in tiny.parameters()) < sum(p.numel() for p in model.parameters()) / 10
    t0 = time.perf_counter()
    fast = compare.run_compare(tiny, tokenizer, "classic")
    took = time.perf_counter() - t0
    real = compare.run_compare(model, tokenizer, "classic")
    for policy in ("static", "continuous"):
        assert fast[policy].slot_history == real[policy].slot_history == classic[policy].slot_history
        assert fast[policy].admitted == real[policy].admitted
    assert took <= 3.0, took

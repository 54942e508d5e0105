"""The Compare tab: one small workload under ``static`` and then ``continuous`` batching, on the real engine.

Both runs use two fresh :class:`engine.core.EngineCore` instances with their own small KV pools, stepped
synchronously on the calling thread (Gradio runs the handler in a worker thread). The app's live
``AsyncEngine`` is never touched: its scheduler, KV cache and telemetry stay as they are.

The page runs them on a tiny random-weight Llama with the loaded model's tokenizer (:func:`schedule_model`,
built once): every request is greedy with EOS ignored and generates exactly its ``max_tokens``, and its
prompt is tokenized by the same tokenizer and chat template, so the schedule (which request holds which slot
at which step) is the one the loaded model would give, while a run takes a fraction of a second instead of
18-32 s for SmolLM2 on a busy 2-core machine, and takes no CPU from the live engine's chats.

The first preset is the classic picture: three slots; A, B and C need 2, 5 and 3 new tokens, D and E
(4 tokens each) wait. Under ``static``, D and E start only after B's fifth token (step 6); under
``continuous``, D takes A's slot in step 3 and E takes C's slot in step 4.

The tab is one slide at 1366x768: workload and button, a one-line headline (steps and idle slot-steps of
both runs; no tokens/s, which swing by a third between identical runs of such a small workload), then the
two grids side by side. Texts are English or Korean (``ui.i18n`` keys ``cmp_*``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from engine import PHASE_IDLE, EngineConfig, EngineCore, SamplingParams, StepSnapshot, tiny_random_llama
from ui import figures, i18n
from ui.invariance import build_invariance_section
from ui.model_source import ModelSource, model_of

PLOT_HEIGHT = 280  # pixels per grid: header, controls, headline and both grids fit a 1366x768 screen
# pixels around each grid's plot area: the title above, tick labels and axis title below, the request legend
# at the right (outside the grid); with no margin auto-expansion the plot area is 214 px, 76% of the figure
COMPARE_MARGIN = {"t": 30, "b": 36, "l": 50, "r": 120, "autoexpand": False}

@dataclass(frozen=True)
class ComparePreset:
    """A small workload for the Compare tab.

    Attributes:
        key: short name (dropdown value).
        title: one line shown in the dropdown, in English; the page shows the ``ui.i18n`` text
            ``cmp_preset_<key>`` when there is one (Korean under a Korean browser), see :meth:`title_for`.
        max_num_seqs: batch slots of both engines.
        requests: ``(request id, user message, max_tokens)``, queued in this order at step 0 (greedy,
            EOS ignored, so each request generates exactly ``max_tokens`` tokens).
    """

    key: str
    title: str
    max_num_seqs: int
    requests: tuple[tuple[str, str, int], ...]

    @property
    def i18n_key(self) -> str | None:
        """The ``ui.i18n`` key of the translated title, or None when this preset has none."""
        key = f"cmp_preset_{self.key}"
        return key if key in i18n.EN else None

    def title_for(self, lang: str) -> str:
        """The title in ``lang``: the Korean text for "ko" when there is one, else :attr:`title`."""
        key = self.i18n_key
        return i18n.KO.get(key, self.title) if key and lang == "ko" else self.title


PRESETS: dict[str, ComparePreset] = {
    p.key: p
    for p in (
        ComparePreset(
            "classic", "Classic: 3 slots; A, B, C need 2, 5, 3 tokens; D and E wait", 3,
            (("A", "Say hello.", 2), ("B", "Name five colours.", 5), ("C", "Count to three.", 3),
             ("D", "Name a fruit.", 4), ("E", "Name an animal.", 4)),
        ),
        ComparePreset(
            "skewed", "Skewed: 4 slots, 12 chats of 3 to 40 tokens", 4,
            tuple((chr(ord("A") + i), f"Tell me about {topic}.", n) for i, (topic, n) in enumerate(
                [("volcanoes", 40), ("tea", 3), ("owls", 6), ("maps", 4), ("bridges", 24), ("snow", 3),
                 ("tigers", 8), ("chess", 5), ("rivers", 30), ("clouds", 4), ("trains", 12), ("frogs", 6)])),
        ),
        ComparePreset(
            "uniform", "Uniform: 4 slots, 8 chats of 8 tokens each (static loses nothing)", 4,
            tuple((chr(ord("A") + i), f"Tell me about {topic}.", 8) for i, topic in enumerate(
                ["the moon", "coffee", "penguins", "jazz", "glaciers", "robots", "pizza", "whales"])),
        ),
    )
}


@dataclass
class PolicyRun:
    """One policy's run of a preset.

    Attributes:
        policy: ``"static"`` or ``"continuous"``.
        snapshots: the engine's telemetry, one snapshot per step (oldest first).
        steps: engine steps to finish every request.
        idle_slot_steps: slot-steps held by a request without computing (finished rows under static).
        generated_tokens: tokens generated in all (tokens).
        wall_s: wall time of the run (seconds).
        slot_history: per step, request id -> slot of each request computed in that step.
        admitted: per step, ids of the requests that took a slot.
        texts: request id -> generated text.
    """

    policy: str
    snapshots: list[StepSnapshot]
    steps: int
    idle_slot_steps: int
    generated_tokens: int
    wall_s: float
    slot_history: list[dict[str, int]] = field(default_factory=list)
    admitted: list[list[str]] = field(default_factory=list)
    texts: dict[str, str] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time (noisy on the small presets: the tab shows steps only)."""
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0


_SCHEDULE_MODELS: dict[tuple, Any] = {}
_SCHEDULE_LOCK = threading.Lock()


def schedule_model(model, tokenizer):
    """A tiny random-weight Llama (2 layers, hidden 64) over ``tokenizer``'s vocabulary, on ``model``'s device
    and dtype, built once per tokenizer, device and dtype (seeded: the same weights every time). The Compare
    tab runs on it: the steps and slots of its greedy, fixed-length requests depend only on their token
    counts, which the tokenizer gives, not on the weights."""
    param = next(model.parameters())
    key = (id(tokenizer), str(param.device), param.dtype)
    with _SCHEDULE_LOCK:
        if key not in _SCHEDULE_MODELS:
            _SCHEDULE_MODELS[key] = tiny_random_llama(len(tokenizer), max_positions=2048, dtype=param.dtype,
                                                      device=param.device)
        return _SCHEDULE_MODELS[key]


def run_policy(model, tokenizer, preset: ComparePreset, policy: str, num_blocks: int = 64,
               block_size: int = 16) -> PolicyRun:
    """Run ``preset`` on a fresh engine with ``policy`` over the shared ``model``; synchronous.

    Args:
        model, tokenizer: an already loaded model (shared, not copied) and its tokenizer.
        preset: the workload.
        policy: ``"static"`` or ``"continuous"``.
        num_blocks: KV blocks of this engine's own pool (small: ``num_blocks x block_size`` tokens).
        block_size: tokens per block.
    """
    cfg = EngineConfig(policy=policy, max_num_seqs=preset.max_num_seqs, num_blocks=num_blocks,
                       block_size=block_size, enable_prefix_caching=False, telemetry_capacity=4096,
                       static_decode="off")  # no CUDA graphs to capture for a run of a few steps
    core = EngineCore(cfg, model=model, tokenizer=tokenizer)
    for rid, message, n in preset.requests:
        core.add_request(rid, [{"role": "user", "content": message}],
                         SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    t0 = time.perf_counter()
    texts = {rid: out.text for rid, out in core.run_to_end().items()}
    wall = time.perf_counter() - t0
    snaps = core.telemetry.snapshots()
    history = [{s.request_id: s.batch_slot for s in snap.batch_slots if s.request_id is not None and s.phase != PHASE_IDLE}
               for snap in snaps]
    return PolicyRun(
        policy=policy, snapshots=snaps, steps=core.step_count, idle_slot_steps=core.telemetry.total_idle_slot_steps,
        generated_tokens=core.telemetry.total_generated_tokens, wall_s=wall, slot_history=history,
        admitted=[list(s.admitted) for s in snaps], texts=texts,
    )


def run_compare(model, tokenizer, preset: ComparePreset | str = "classic", **kwargs) -> dict[str, PolicyRun]:
    """Run ``preset`` under ``static`` and then ``continuous``; returns ``{"static": ..., "continuous": ...}``.
    ``kwargs`` go to :func:`run_policy`."""
    if isinstance(preset, str):
        preset = PRESETS[preset]
    return {policy: run_policy(model, tokenizer, preset, policy, **kwargs) for policy in ("static", "continuous")}


def text(lang: str, key: str, **values: Any) -> str:
    """The Compare tab's text ``key`` (``ui.i18n`` key ``cmp_<key>``) in ``lang`` ("ko" or English), with
    ``values`` filled in; for text drawn on the server (headline, figure titles)."""
    table = i18n.KO if lang == "ko" else i18n.EN
    template = table.get("cmp_" + key) or i18n.EN["cmp_" + key]
    return template.format(**values) if values else template


def run_label(run: PolicyRun, lang: str = "en") -> str:
    """``"static: 9 steps · 5 idle slot-steps"`` (``"정적 배칭: 9 스텝 · 유휴 슬롯-스텝 5"`` in Korean).

    No tokens/s: on a workload this small the wall time is dominated by noise (the same run swings by a
    third), while the step counts are exact."""
    return text(lang, "run_label", policy=text(lang, run.policy), steps=run.steps, idle=run.idle_slot_steps)


def compare_figures(runs: dict[str, PolicyRun], labels: dict | None = None, height: int = PLOT_HEIGHT,
                    lang: str = "en"):
    """Two slot-occupancy figures (``static``, ``continuous``) with the same request colours and the same
    step axis, titled with their step counts and idle slot-steps (:func:`run_label`).

    Args:
        runs: :func:`run_compare`'s result.
        labels: axis, legend and hover labels (default: ``ui.i18n.figure_labels(lang)``).
        height: height of each figure (pixels).
        lang: language of the titles and default labels ("en" or "ko").
    """
    if labels is None:
        labels = i18n.figure_labels(lang)
    all_snaps = [s for r in runs.values() for s in r.snapshots]
    colors = figures.default_colors(all_snaps)
    last = max((r.steps for r in runs.values()), default=1)
    # the presets' request ids are letters: each grid writes them in the first cell of each run
    letters = {rid: rid for rid in colors if len(rid) <= 2} if last <= 30 else None
    out = []
    for policy in ("static", "continuous"):
        run = runs[policy]
        fig = figures.occupancy_figure(run.snapshots, colors, labels, height=height, window=last, letters=letters,
                                       lang=lang)
        # the legend in the right margin, measured against the plot area (never the whole figure), so it
        # is outside the grid and the grid keeps its height (a legend measured against the figure, with
        # margin auto-expansion, had left a 190 px band above a 47 px grid)
        fig.update_layout(title={"text": run_label(run, lang), "x": 0.01, "y": 0.98, "yanchor": "top",
                                 "font": {"size": 15}},
                          uirevision=None, margin=COMPARE_MARGIN,
                          legend={"orientation": "v", "yref": "paper", "x": 1.02, "xanchor": "left", "y": 0.5,
                                  "yanchor": "middle", "font": {"size": 12}})
        fig.update_xaxes(range=[0.5, last + 0.5], dtick=1 if last <= 24 else None)
        fig.update_traces(marker_size=12, selector={"name": labels["admitted"]})
        fig.update_traces(showlegend=False, selector={"name": labels["mine"]})  # no chat of yours here
        out.append(fig)
    return tuple(out)


def headline_markdown(runs: dict[str, PolicyRun], lang: str = "en") -> str:
    """One Markdown heading line comparing the two runs by steps and idle slot-steps, in ``lang`` ("en" or
    "ko"): ``"### static 9 steps · 5 idle slot-steps → continuous 7 steps · 0 idle: 2 fewer steps (1.29x)"``.
    """
    s, c = runs["static"], runs["continuous"]
    diff = s.steps - c.steps
    if diff > 0 and c.steps:
        delta = text(lang, "fewer", n=diff, ratio=f"{s.steps / c.steps:.2f}")
    elif diff == 0:
        delta = text(lang, "same")
    else:
        delta = text(lang, "more", n=abs(diff))
    return "### " + text(lang, "headline", static=text(lang, "static"), continuous=text(lang, "continuous"),
                         s_steps=s.steps, s_idle=s.idle_slot_steps, c_steps=c.steps, c_idle=c.idle_slot_steps,
                         delta=delta)


# Each grid is drawn by the page's own plotly.js (the cartesian bundle the live panels load, ui/live.py) from
# the figure's JSON: a gr.Plot would load Gradio's own plotly.js (4.6 MB) on the first run in a tab, which took
# seconds on a busy 2-core laptop.
DRAW_GRID_JS = """
const draw = () => {
  const div = element.querySelector('.cbp-fig');
  if (!div || !props.value) return;
  const go = () => { const fig = JSON.parse(props.value);
    window.Plotly.react(div, fig.data, fig.layout, {displayModeBar: false, responsive: true}); };
  if (window.Plotly) go(); else { const t = setInterval(() => { if (window.Plotly) { clearInterval(t); go(); } }, 50); }
};
draw();
watch('value', draw);
"""


def _grid(elem_id: str) -> gr.HTML:
    """One grid's place: a gr.HTML whose value is a Plotly figure's JSON, drawn by :data:`DRAW_GRID_JS`."""
    return gr.HTML("", html_template=f'<div class="cbp-fig" style="height: {PLOT_HEIGHT}px"></div>',
                   js_on_load=DRAW_GRID_JS, scale=1, min_width=300, min_height=PLOT_HEIGHT, elem_id=elem_id)


# the grids' frame (the page's CSS, ui/page_markup.py): a border like the other boxes', no padding to eat the plot
COMPARE_CSS = """
#compare-static .cbp-fig, #compare-continuous .cbp-fig { border: 1px solid var(--border-color-primary);
  border-radius: var(--block-radius); overflow: hidden; }
#compare-static .html-container, #compare-continuous .html-container { padding: 0; }
"""


def build_compare_tab(engine: ModelSource, default: str = "classic") -> dict[str, Any]:
    """Create the Compare tab's components in the current Gradio context (call inside ``with gr.Tab(...)``).

    One slide at 1366x768: the workload and the button in one row, a one-line headline (steps and idle
    slot-steps of both runs), the two grids side by side in one row (equal widths, :data:`PLOT_HEIGHT`
    pixels high), then a short explanation below them. Component texts follow the browser's language
    (``gr.I18n``); the headline and the figures' texts follow the request's Accept-Language (English
    when it has none, e.g. a ``gradio_client`` call).

    Args:
        engine: the app's ``AsyncEngine`` (its model object and tokenizer are reused; its state is not
            touched), or an ``EngineCore``, an ``LLM`` or a ``(model, tokenizer)`` pair (:func:`model_of`).
        default: preset selected at first.

    Returns:
        The components by name: ``preset``, ``run``, ``summary`` (the headline), ``static``, ``continuous``.
        The button's event is the API endpoint ``/compare`` (preset key -> headline, static figure and
        continuous figure as Plotly JSON text), one run at a time.
    """
    t = i18n.t

    def on_run(key: str, request: gr.Request):
        lang = i18n.language(request.headers.get("accept-language") if request is not None else None)
        model, tokenizer = model_of(engine)
        preset = PRESETS.get(key) or PRESETS[default]
        runs = run_compare(schedule_model(model, tokenizer), tokenizer, preset)
        fig_s, fig_c = compare_figures(runs, lang=lang)
        return headline_markdown(runs, lang), fig_s.to_json(), fig_c.to_json()

    with gr.Row(equal_height=True, elem_id="compare-controls"):
        choices = [(t(p.i18n_key) if p.i18n_key else p.title, k) for k, p in PRESETS.items()]
        preset = gr.Dropdown(choices=choices, value=default, label=t("cmp_workload"), show_label=False, scale=3,
                             min_width=320, elem_id="compare-preset")
        run = gr.Button(t("cmp_run"), variant="primary", scale=1, min_width=200, elem_id="compare-run")
    summary = gr.Markdown(t("cmp_hint"), elem_id="compare-summary")
    with gr.Row(equal_height=True, elem_id="compare-plots"):
        static = _grid("compare-static")
        continuous = _grid("compare-continuous")
    gr.Markdown(t("cmp_note"), elem_classes="cbp-note", elem_id="compare-note")
    # Gradio's own progress text ("processing | 1.2s") has no translation: hidden, the headline says it instead
    def on_start(request: gr.Request) -> str:
        lang = i18n.language(request.headers.get("accept-language") if request is not None else None)
        return "### " + text(lang, "running")

    running = run.click(on_start, None, summary, api_visibility="private", queue=False)
    running.then(on_run, preset, [summary, static, continuous], api_name="compare", concurrency_limit=1,
                 show_progress="hidden")
    with gr.Accordion(t("inv_title"), open=False, elem_id="invariance"):
        build_invariance_section(engine)
    return {"preset": preset, "run": run, "summary": summary, "static": static, "continuous": continuous}

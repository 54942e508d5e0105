"""The Compare tab's batch-invariance demo: one seeded prompt alone and inside a busy batch, token for token.

For each mode (the default engine and ``--batch-invariant``) one fresh :class:`engine.core.EngineCore`
is built on the app's already loaded model (weights shared; the own forward merges its projections once
per engine) with its own small KV pool and no prefix caching, so every prefill is computed. On it the
target request runs twice, synchronously on the calling thread:

1. **alone**: the only request of every step;
2. **in a busy batch**: twelve neighbours of different lengths start first; the target arrives three
   steps later, so its prefill shares a step with their decodes and its decode shares steps with a batch
   that shrinks as they finish.

The target is sampled (temperature 0.8, a fixed seed): its generator draws the same numbers in both runs,
so any difference comes from the logits. In the default mode they may depend on how many rows the step's
matrix products had (some kernels, MKL's float32 GEMM among them, change their summation order with the
batch shape; oneDNN's bfloat16 AMX kernels mostly do not): whether the runs part depends on the CPU and
the dtype. In batch-invariant mode every linear runs in fixed tiles of rows, so the two runs agree token
for token. Where the tokens agree, the demo also compares each token's log-probability: equal bit for bit,
or the largest difference (the last bits moved with the batch, and a near-tie would flip a token). It
shows what happens on the machine it runs on; it asserts nothing.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

import gradio as gr

from engine import EngineConfig, EngineCore, SamplingParams
from ui import i18n
from ui.model_source import ModelSource, model_of

TARGET_MESSAGE = "Write a short story about a lighthouse keeper and a storm."
TARGET_TOKENS = 48  # tokens the target generates (EOS ignored)
TARGET_SEED = 7
TARGET_TEMPERATURE = 0.8
NEIGHBOURS = (  # (user message, max_tokens): varied prompt and output lengths, some finish mid-way
    ("Name three rivers.", 12), ("Explain how a bicycle works, step by step.", 60), ("Say hi.", 6),
    ("List five kinds of clouds and describe each one.", 56), ("What is tea?", 20),
    ("Tell me about volcanoes.", 40), ("Count from one to twenty.", 30), ("Why is the sky blue?", 24),
    ("Describe a busy train station in the morning.", 52), ("Name a fruit.", 8),
    ("Give me a recipe for pancakes.", 44), ("What do owls eat?", 16),
)
ARRIVAL_STEP = 3  # the target arrives after this many steps of the neighbours


@dataclass
class InvarianceRun:
    """One mode's pair of runs of the target request.

    Attributes:
        batch_invariant: the engine's mode (``EngineConfig.batch_invariant``).
        alone: token ids the target generated as the only request (``TARGET_TOKENS`` of them).
        busy: token ids it generated among the neighbours.
        pieces_alone, pieces_busy: each token's text (decoded one by one).
        neighbours: how many requests shared the busy run.
        max_batch: the most sequences computed in one step of the busy run.
        dtype: the model's dtype (``"bfloat16"``, ``"float32"``).
        logprobs_alone, logprobs_busy: each generated token's log-probability (natural log) in each run.
    """

    batch_invariant: bool
    alone: list[int]
    busy: list[int]
    pieces_alone: list[str]
    pieces_busy: list[str]
    neighbours: int
    max_batch: int
    dtype: str = ""
    logprobs_alone: list[float] = field(default_factory=list)
    logprobs_busy: list[float] = field(default_factory=list)

    @property
    def first_difference(self) -> int | None:
        """0-based index of the first token that differs between the two runs, or None when identical."""
        for i, (a, b) in enumerate(zip(self.alone, self.busy)):
            if a != b:
                return i
        return None if len(self.alone) == len(self.busy) else min(len(self.alone), len(self.busy))

    @property
    def max_logprob_difference(self) -> float:
        """The largest ``|logprob alone - logprob busy|`` over the tokens before the first difference (0.0
        when bit-identical): the logits can differ in their last bits even where the tokens agree."""
        end = self.first_difference
        pairs = list(zip(self.logprobs_alone, self.logprobs_busy))[:end]
        return max((abs(a - b) for a, b in pairs), default=0.0)


def _target_params() -> SamplingParams:
    return SamplingParams(temperature=TARGET_TEMPERATURE, seed=TARGET_SEED, max_tokens=TARGET_TOKENS,
                          ignore_eos=True, logprobs=0)


def _run_to_end(core: EngineCore, target: str, neighbours: bool) -> tuple[list[int], list[float], int]:
    """Run ``core`` until every request finished (:meth:`engine.EngineCore.run_to_end`); the target's token ids,
    their logprobs and the most requests running after one of its steps (from the engine's telemetry)."""
    if neighbours:
        for i, (message, n) in enumerate(NEIGHBOURS):
            core.add_request(f"n{i}", [{"role": "user", "content": message}],
                             SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        core.run_to_end(max_steps=ARRIVAL_STEP)
    arrived = core.step_count
    core.add_request(target, [{"role": "user", "content": TARGET_MESSAGE}], _target_params())
    out = core.run_to_end()[target]
    if out.error:
        raise RuntimeError(out.error)
    logprobs = [lp for _, lp, _ in out.outputs[0].logprobs or []]
    largest = max((s.num_running for s in core.telemetry.snapshots() if s.step > arrived), default=0)
    return list(out.token_ids), logprobs, largest


def run_mode(model, tokenizer, batch_invariant: bool, num_blocks: int = 160, block_size: int = 16) -> InvarianceRun:
    """The target alone and then in a busy batch on one fresh engine in the given mode; synchronous.

    Args:
        model, tokenizer: the already loaded model (shared, not copied) and its tokenizer.
        batch_invariant: build the engine with ``EngineConfig.batch_invariant``.
        num_blocks, block_size: the engine's own KV pool (blocks, tokens per block); large enough for the
            target and all neighbours at once.

    Raises:
        ValueError: ``batch_invariant`` on a model the engine has no own forward for (see
            :func:`engine.models.build_forward`).
    """
    cfg = EngineConfig(max_num_seqs=len(NEIGHBOURS) + 1, num_blocks=num_blocks, block_size=block_size,
                       enable_prefix_caching=False, batch_invariant=batch_invariant, telemetry_capacity=512)
    core = EngineCore(cfg, model=model, tokenizer=tokenizer)
    alone, lp_alone, _ = _run_to_end(core, "alone", neighbours=False)
    busy, lp_busy, largest = _run_to_end(core, "busy", neighbours=True)
    return InvarianceRun(batch_invariant=batch_invariant, alone=alone, busy=busy,
                         logprobs_alone=lp_alone, logprobs_busy=lp_busy,
                         pieces_alone=[tokenizer.decode([t]) for t in alone],
                         pieces_busy=[tokenizer.decode([t]) for t in busy],
                         neighbours=len(NEIGHBOURS), max_batch=largest,
                         dtype=str(core.runner.dtype).removeprefix("torch."))


def run_invariance(model, tokenizer, **kwargs) -> dict[str, InvarianceRun]:
    """Both modes: ``{"default": ..., "batch_invariant": ...}`` (``kwargs`` go to :func:`run_mode`)."""
    return {"default": run_mode(model, tokenizer, False, **kwargs),
            "batch_invariant": run_mode(model, tokenizer, True, **kwargs)}


def _text(lang: str, key: str, **values: Any) -> str:
    table = i18n.KO if lang == "ko" else i18n.EN
    template = table.get("inv_" + key) or i18n.EN["inv_" + key]
    return template.format(**values) if values else template


def _tokens_html(pieces: list[str], first_diff: int | None) -> str:
    out = []
    for i, piece in enumerate(pieces):
        shown = html.escape(piece).replace("\n", "↵")
        cls = "cbp-tok" if first_diff is None or i < first_diff else "cbp-tok cbp-tok-diff"
        out.append(f'<span class="{cls}" title="token {i + 1}">{shown}</span>')
    return "".join(out)


def verdict(run: InvarianceRun, lang: str = "en") -> str:
    """One line: identical (``"identical, 48 of 48 tokens; log-probabilities bit for bit"``), identical tokens
    whose log-probabilities differ (by how much), or where the runs part."""
    d = run.first_difference
    if d is not None:
        return _text(lang, "differs", i=d + 1, n=len(run.alone))
    line = _text(lang, "identical", n=len(run.alone))
    diff = run.max_logprob_difference
    return line + "; " + (_text(lang, "lp_equal") if diff == 0.0 else _text(lang, "lp_differ", d=f"{diff:.1e}"))


def invariance_html(runs: dict[str, InvarianceRun], lang: str = "en") -> str:
    """The demo's result as HTML: per mode a verdict and the two token rows, tokens from the first
    difference on marked (class ``cbp-tok-diff``)."""
    dtype = runs["default"].dtype
    parts = [f"<p><i>{html.escape(_text(lang, 'dtype', dtype=dtype))}</i></p>"] if dtype else []
    for key in ("default", "batch_invariant"):
        run = runs[key]
        d = run.first_difference
        parts.append(
            f'<div class="cbp-inv" data-mode="{key}" data-first-diff="{"" if d is None else d}">'
            f"<b>{html.escape(_text(lang, key))}</b>: {html.escape(verdict(run, lang))}"
            f'<div class="cbp-inv-row"><i>{html.escape(_text(lang, "alone"))}</i> '
            f"{_tokens_html(run.pieces_alone, d)}</div>"
            f'<div class="cbp-inv-row"><i>{html.escape(_text(lang, "busy", n=run.neighbours, m=run.max_batch))}</i> '
            f"{_tokens_html(run.pieces_busy, d)}</div></div>")
    return "".join(parts)


INVARIANCE_CSS = """
.cbp-inv { margin: 4px 0 10px 0; line-height: 1.7; }
.cbp-inv-row { font-family: ui-monospace, monospace; font-size: 13px; overflow-wrap: anywhere; }
.cbp-tok { border-right: 1px dotted #bbb; padding: 0 1px; white-space: pre-wrap; }
.cbp-tok-diff { background: #ffd6d6; color: #8b0000; }
"""


def build_invariance_section(engine: ModelSource) -> dict[str, Any]:
    """The demo's components in the current Gradio context (the Compare tab calls it in an accordion):
    a button, a one-line summary and the HTML of :func:`invariance_html`.

    Args:
        engine: the app's ``AsyncEngine`` (its model and tokenizer are reused, its state is not touched),
            or an ``EngineCore``, an ``LLM`` or a ``(model, tokenizer)`` pair (:func:`ui.model_source.model_of`).

    Returns:
        The components by name: ``run`` (the button; its event is the API endpoint ``/invariance``, one run
        at a time) and ``result`` (the HTML).
    """
    def on_run(request: gr.Request) -> str:
        lang = i18n.language(request.headers.get("accept-language") if request is not None else None)
        model, tokenizer = model_of(engine)
        try:
            runs = run_invariance(model, tokenizer)
        except ValueError as exc:  # no own forward for this model: batch-invariant mode is not available
            return f"<p>{html.escape(str(exc))}</p>"
        return invariance_html(runs, lang)

    gr.Markdown(i18n.t("inv_note"), elem_classes="cbp-note")
    run = gr.Button(i18n.t("inv_run"), variant="primary", elem_id="invariance-run")
    result = gr.HTML("", elem_id="invariance-result")
    run.click(on_run, None, result, api_name="invariance", concurrency_limit=1)
    return {"run": run, "result": result}

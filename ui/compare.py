"""The Compare tab: one small workload under ``static`` and then ``continuous`` batching, on the real engine.

Both runs use two fresh :class:`engine.core.EngineCore` instances built on the app's already loaded model
object (weights shared, nothing reloaded) with their own small KV pools, stepped synchronously on the
calling thread (Gradio runs the handler in a worker thread). The app's live ``AsyncEngine`` is never
touched: its scheduler, KV cache and telemetry stay as they are.

The first preset is the classic picture: three slots; A, B and C need 2, 5 and 3 new tokens, D and E
(4 tokens each) wait. Under ``static``, D and E start only after B's fifth token (step 6); under
``continuous``, D takes A's slot in step 3 and E takes C's slot in step 4.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import SamplingParams
from engine.telemetry import PHASE_IDLE, StepSnapshot
from ui import figures


@dataclass(frozen=True)
class ComparePreset:
    """A small workload for the Compare tab.

    Attributes:
        key: short name (dropdown value).
        title: one line shown in the dropdown.
        max_num_seqs: batch slots of both engines.
        requests: ``(request id, user message, max_tokens)``, queued in this order at step 0 (greedy,
            EOS ignored, so each request generates exactly ``max_tokens`` tokens).
    """

    key: str
    title: str
    max_num_seqs: int
    requests: tuple[tuple[str, str, int], ...]


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
        """Generated tokens per second of wall time."""
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0


def model_of(engine: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of an ``AsyncEngine``, an ``EngineCore``, an ``LLM`` or a
    ``(model, tokenizer)`` pair."""
    if isinstance(engine, tuple):
        return engine
    core = getattr(engine, "core", None) or getattr(engine, "engine", None) or engine
    return core.model, core.tokenizer


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
                       block_size=block_size, enable_prefix_caching=False, telemetry_capacity=4096)
    core = EngineCore(cfg, model=model, tokenizer=tokenizer)
    for rid, message, n in preset.requests:
        core.add_request(rid, [{"role": "user", "content": message}],
                         SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    texts: dict[str, str] = {}
    t0 = time.perf_counter()
    while core.has_unfinished_requests():
        for out in core.step():
            if out.finished:
                texts[out.request_id] = out.text
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


def run_label(run: PolicyRun) -> str:
    """``"static: 9 steps · 6 idle slot-steps · 12.3 tokens/s"``."""
    return (f"{run.policy}: {run.steps} steps · {run.idle_slot_steps} idle slot-steps · "
            f"{run.tokens_per_s:.1f} tokens/s")


def compare_figures(runs: dict[str, PolicyRun], labels: dict | None = None, height: int = 300):
    """Two slot-occupancy figures (``static``, ``continuous``) with the same request colours and the same
    step axis, titled with their step counts, idle slot-steps and tokens/s."""
    all_snaps = [s for r in runs.values() for s in r.snapshots]
    colors = figures.default_colors(all_snaps)
    last = max((r.steps for r in runs.values()), default=1)
    out = []
    for policy in ("static", "continuous"):
        run = runs[policy]
        fig = figures.occupancy_figure(run.snapshots, colors, labels, height=height)
        fig.update_layout(title={"text": run_label(run), "x": 0.01, "font": {"size": 14}}, uirevision=None,
                          margin={"t": 40})
        fig.update_xaxes(range=[0.5, last + 0.5], dtick=1 if last <= 40 else None)
        if last <= 40:  # small grids: name each request in the cell where it took its slot
            for snap in run.snapshots:
                for sl in snap.batch_slots:
                    if sl.request_id in snap.admitted:
                        fig.add_annotation(x=snap.step, y=sl.batch_slot, text=f"<b>{sl.request_id}</b>", showarrow=False,
                                           xshift=14, font={"size": 12, "color": "black"})
        out.append(fig)
    return tuple(out)


def summary_markdown(runs: dict[str, PolicyRun], preset: ComparePreset) -> str:
    """A short Markdown comparison of the two runs."""
    s, c = runs["static"], runs["continuous"]
    lines = [
        f"**{preset.title}**",
        "",
        "| policy | steps | idle slot-steps | tokens/s |",
        "|---|---:|---:|---:|",
        f"| static | {s.steps} | {s.idle_slot_steps} | {s.tokens_per_s:.1f} |",
        f"| continuous | {c.steps} | {c.idle_slot_steps} | {c.tokens_per_s:.1f} |",
        "",
    ]
    if c.steps:
        lines.append(f"Continuous batching needs {s.steps - c.steps} fewer steps ({s.steps / c.steps:.2f}x): a "
                     "finished request's slot is given to a waiting one at the very next step instead of "
                     "staying empty until the whole batch is done.")
    return "\n".join(lines)


def build_compare_tab(engine: Any, default: str = "classic") -> dict:
    """Create the Compare tab's components in the current Gradio context (call inside ``with gr.Tab(...)``).

    Args:
        engine: the app's ``AsyncEngine`` (its model object and tokenizer are reused; its state is not
            touched), or an ``EngineCore`` / ``(model, tokenizer)``.
        default: preset selected at first.

    Returns:
        The components by name: ``preset``, ``run``, ``summary``, ``static``, ``continuous``. The button's
        event is the API endpoint ``/compare`` (preset key -> summary, static figure, continuous figure),
        one run at a time.
    """
    import gradio as gr

    def on_run(key: str):
        model, tokenizer = model_of(engine)
        preset = PRESETS.get(key) or PRESETS[default]
        runs = run_compare(model, tokenizer, preset)
        fig_s, fig_c = compare_figures(runs)
        return summary_markdown(runs, preset), fig_s, fig_c

    gr.Markdown(
        "Run the same requests through two fresh engines on the loaded model: **static** batching (a batch "
        "starts only when the previous one is done) and **continuous** batching (a freed slot is refilled at "
        "the next step). Each row is a batch slot, each column an engine step; ▷ marks where a request took "
        "its slot, grey cells are slots held by a finished request. Your chats are not affected.",
        elem_classes="cbp-note",
    )
    with gr.Row():
        preset = gr.Dropdown(choices=[(p.title, k) for k, p in PRESETS.items()], value=default, label="Workload",
                             scale=4, elem_id="compare-preset")
        run = gr.Button("Run static, then continuous", variant="primary", scale=1, elem_id="compare-run")
    summary = gr.Markdown(elem_id="compare-summary")
    static = gr.Plot(label="static", elem_id="compare-static")
    continuous = gr.Plot(label="continuous", elem_id="compare-continuous")
    run.click(on_run, preset, [summary, static, continuous], api_name="compare", concurrency_limit=1)
    return {"preset": preset, "run": run, "summary": summary, "static": static, "continuous": continuous}

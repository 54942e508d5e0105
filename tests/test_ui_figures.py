"""The panels' figure builders on a hand-made telemetry sequence: exact cells, no engine, no server."""

from __future__ import annotations

import asyncio

import pytest

from engine.telemetry import PHASE_DECODE, PHASE_IDLE, PHASE_PREFILL, BatchSlotSnapshot, StepSnapshot, Telemetry
from ui import figures as F

NUM_BLOCKS = 8
BS = 4


def snap(step, slots, tables, *, reuses=None, cached=(), admitted=(), finished=(), waiting=0, tokens=None):
    """A StepSnapshot from ``slots`` = [(request id, phase, scheduled, computed) or None] and block tables."""
    ref = [0] * NUM_BLOCKS
    for blocks in tables.values():
        for b in blocks:
            ref[b] += 1
    return StepSnapshot(
        step=step, time=float(step), duration=0.1, forward_time=0.08,
        batch_slots=tuple(BatchSlotSnapshot(i, None, PHASE_IDLE) if s is None else BatchSlotSnapshot(i, *s) for i, s in enumerate(slots)),
        block_tables={k: tuple(v) for k, v in tables.items()}, block_refcount=tuple(ref),
        block_tokens=tuple(tokens or [0] * NUM_BLOCKS), block_reuses=tuple(reuses or [0] * NUM_BLOCKS),
        cached_blocks=frozenset(cached), num_running=len(tables), num_waiting=waiting,
        num_scheduled_tokens=sum(s[2] for s in slots if s), num_generated_tokens=sum(1 for s in slots if s),
        num_preemptions=0, finished=tuple(finished), admitted=tuple(admitted),
    )


# Two slots, eight blocks of four tokens. A (6-token prompt) and B (3-token prompt) start at step 1; B
# finishes at step 2 and its slot and block 2 go to C at step 3 (block 2 reused); block 5 stays cached.
SEQ = [
    snap(1, [("A", PHASE_PREFILL, 6, 6), ("B", PHASE_PREFILL, 3, 3)], {"A": [0, 1], "B": [2]},
         admitted=("A", "B"), waiting=1, tokens=[4, 2, 3, 0, 0, 0, 0, 0]),
    snap(2, [("A", PHASE_DECODE, 1, 7), ("B", PHASE_DECODE, 1, 4)], {"A": [0, 1]}, finished=("B",),
         waiting=1, cached=(2,), tokens=[4, 3, 4, 0, 0, 0, 0, 0]),
    snap(3, [("A", PHASE_DECODE, 1, 8), ("C", PHASE_PREFILL, 5, 5)], {"A": [0, 1], "C": [2, 3]},
         reuses=[0, 0, 1, 0, 0, 0, 0, 0], cached=(5,), admitted=("C",), tokens=[4, 4, 4, 1, 0, 4, 0, 0]),
]


def test_default_colors_follow_first_appearance():
    assert F.default_colors(SEQ) == {"A": 0, "B": 1, "C": 2}


def test_occupancy_cells_are_slot_request_and_phase():
    fig = F.occupancy_figure(SEQ)
    heat, adm = fig.data[0], fig.data[1]
    assert list(heat.x) == [1, 2, 3]
    ids = [[c[0] for c in row] for row in heat.customdata]
    assert ids == [["A", "A", "A"], ["B", "B", "C"]]
    K = F.K
    assert [list(r) for r in heat.z] == [[K + 0, 0, 0], [K + 1, 1, K + 2]]  # light = prefill, full = decode
    phases = [[c[1] for c in row] for row in heat.customdata]
    assert phases == [["prefill", "decode", "decode"], ["prefill", "decode", "prefill"]]
    assert list(heat.customdata[1][2][2:]) == [5, 5]  # tokens this step, tokens in cache
    # admissions are marked where they happened, including C taking B's slot
    assert sorted(zip(adm.x, adm.y)) == [(1, 0), (1, 1), (3, 1)]


def test_occupancy_empty_and_idle_slots():
    seq = [snap(1, [("A", PHASE_IDLE, 0, 9), None], {"A": [0]})]
    heat = F.occupancy_figure(seq).data[0]
    assert list(heat.z[0]) == [F.IDLE_CODE] and list(heat.z[1]) == [None]
    assert heat.customdata[1][0][0] == ""


def test_block_map_cells_owner_free_cached_and_reused():
    fig = F.block_map_figure(SEQ[-1], F.default_colors(SEQ), columns=4)
    heat, reused, shared = fig.data[0], fig.data[1], fig.data[2]
    z = [v for row in heat.z for v in row]
    owners = [c[1] for row in heat.customdata for c in row]
    assert z == [0, 0, 2, 2, F.FREE_CODE, F.CACHED_CODE, F.FREE_CODE, F.FREE_CODE]
    assert owners[:4] == ["A", "A", "C", "C"]
    assert owners[4:] == ["free", "free, cached prefix", "free", "free"]
    ids = [c[0] for row in heat.customdata for c in row]
    assert ids == list(range(NUM_BLOCKS))
    assert [list(c[2:]) for row in heat.customdata for c in row][:4] == [[4, 1, 0], [4, 1, 0], [4, 1, 1], [1, 1, 0]]
    # block 2 (row 0, column 2) was handed from B to C: it is the only reused mark
    assert list(zip(reused.x, reused.y)) == [(2, 0)]
    assert len(shared.x) == 0


def test_block_map_shared_block_and_grid_shape():
    s = snap(1, [("A", PHASE_DECODE, 1, 5), ("D", PHASE_PREFILL, 5, 5)], {"A": [0, 1], "D": [0, 4]})
    fig = F.block_map_figure(s, {"A": 3, "D": 4}, columns=3)
    heat, shared = fig.data[0], fig.data[2]
    assert len(heat.z) == 3 and all(len(r) == 3 for r in heat.z)  # 8 blocks in 3 columns: 3 rows
    assert heat.z[2][2] is None  # past the last block
    assert heat.customdata[0][0][1] == "A, D" and heat.customdata[0][0][3] == 2
    assert list(zip(shared.x, shared.y)) == [(0, 0)]
    assert heat.z[1][1] == 4  # block 4 belongs to D


def test_block_map_without_snapshot_is_empty():
    assert len(F.block_map_figure(None).data) == 0


def test_grid_columns():
    assert F.block_grid_columns(8) == 8
    assert F.block_grid_columns(728) == 48
    assert F.block_grid_columns(100_000) == 64


def test_color_assigner_keeps_live_colours_distinct_and_stable():
    ca = F.ColorAssigner()
    first = ca.update(SEQ[:1])
    assert first["A"] != first["B"]
    later = ca.update(SEQ)
    assert later["A"] == first["A"] and later["B"] == first["B"] and later["C"] not in (first["A"], first["B"])
    # many requests alive at once: all distinct up to the palette size
    many = [snap(1, [(f"r{i}", PHASE_DECODE, 1, 1) for i in range(F.K)], {})]
    assert len(set(F.ColorAssigner().update(many).values())) == F.K


def test_rates_and_counters():
    fig = F.rates_figure(SEQ)
    assert list(fig.data[0].y) == [2, 1, 2] and list(fig.data[1].y) == [1, 1, 0]
    assert list(fig.data[2].y) == [37.5, 25.0, 50.0]
    c = F.counter_values({"running": 3, "waiting": 1, "kv_usage": 0.25, "tokens_per_s": 12.34,
                          "ttft_p50": 0.1, "ttft_p90": None, "tpot_p50": 0.02, "tpot_p90": 0.03})
    assert c["kv_usage"] == "25.0 %" and c["tokens_per_s"] == "12.3 tok/s"
    assert c["ttft"] == "100 ms / -" and c["tpot"] == "20 ms / 30 ms"


def test_figures_accept_translated_labels():
    from ui.i18n import EN, FIGURE_LABELS, KO, figure_labels, language

    assert set(EN) == set(KO) and set(FIGURE_LABELS["ko"]) == set(F.LABELS_EN)

    assert language("ko-KR,ko;q=0.9,en;q=0.8") == "ko" and language("en-US,ko;q=0.5") == "en"
    assert language(None) == "en" and language("fr-FR") == "en"
    fig = F.occupancy_figure(SEQ, labels=figure_labels("ko"))
    assert fig.layout.xaxis.title.text == "엔진 스텝"


def test_panels_rebuild_only_on_new_steps_and_skip_unchanged():
    pytest.importorskip("gradio")
    from ui.panels import Panels

    tel = Telemetry(capacity=16)
    for s in SEQ[:2]:
        tel.record(s)
    panels = Panels(tel, max_builds_per_s=50)

    async def run():
        first = await panels.refresh(96, None, "en")
        key = first[-1]
        again = await panels.refresh(96, key, "en")
        tel.record(SEQ[2])
        newer = await panels.refresh(96, key, "en")
        return first, again, newer

    first, again, newer = asyncio.run(run())
    assert first[-1] == (2, 96, "en") and first[0].type == "plotly"
    assert again[:3] == ({"__type__": "update"},) * 3  # gr.skip(): nothing sent to a tab that is up to date
    assert newer[-1] == (3, 96, "en") and newer[0] is not first[0]
    assert panels.builds == 2

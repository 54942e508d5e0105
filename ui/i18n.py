"""English and Korean texts: component labels through Gradio's ``gr.I18n`` (translated in the browser
from its locale), and figure labels chosen on the server from the request's Accept-Language header
(plot text is drawn by Plotly, which Gradio's i18n does not reach)."""

from __future__ import annotations

import gradio as gr

from ui.block_tiles import TILE_LABELS_KO
from ui.figures import LABELS_EN

HOW_EN = """\
**Slot occupancy.** Each row is one batch slot (one of the `max_num_seqs` sequences the engine computes \
together), each column one engine step. A colour is one request: light = *prefill* (prompt tokens being \
computed, maybe in chunks), full = *decode* (one new token per step), grey = a slot held without work \
(static policy). ▷ marks the step at which a waiting request took a slot. With continuous batching a \
finished request's slot is given to a waiting one at the very next step; with the static policy it stays \
empty until the whole batch is done.

**Block map.** The KV cache is one pool of fixed-size blocks (`block_size` tokens each). Each cell is a \
physical block, in the colour of the request whose block table holds it; white = free, pale blue-grey = free \
but still holding a cached prefix that a new request with the same beginning can reuse; × = past the end of \
the pool. Your own request is outlined in both panels. A dot marks a block \
that had served another request before: memory is recycled block by block, nothing is reserved per request, \
so at most one partly filled block per request is wasted. ▷ marks the blocks taken in the step shown; hover \
says whose a block was and when it was freed.

**Counters.** Running and waiting requests, share of blocks in use, generated tokens per second (last 5 s), \
time to first token and time per output token (median / 90th percentile of finished requests), prefix-cache \
hits over the last 64 steps.

**Talk mode.** ‖ Pause holds the engine between two steps (messages queue, streams wait), ▶| Step runs exactly \
one step, ▶▶| Next hand-over / Next block reuse run until a slot or a block changes hands and pause there, slow \
motion makes each step last at least that long, and Look back pins the panels at an earlier step. \
Each reply's status line says where its request is: queued, prefilling, decoding, preempted, finished.
"""

HOW_KO = """\
**슬롯 점유.** 각 행은 배치 슬롯 하나(엔진이 함께 계산하는 `max_num_seqs`개 시퀀스 중 하나), 각 열은 엔진 \
스텝 하나입니다. 색 하나가 요청 하나입니다: 옅은 색 = *프리필*(프롬프트 토큰 계산, 여러 조각으로 나뉠 수 있음), \
진한 색 = *디코드*(스텝마다 새 토큰 하나), 회색 = 일은 없이 자리만 차지한 슬롯(정적 배칭). ▷ 표시는 대기 중이던 \
요청이 슬롯을 받은 스텝입니다. 연속 배칭에서는 끝난 요청의 슬롯을 바로 다음 스텝에 대기 요청이 이어받고, 정적 \
배칭에서는 배치 전체가 끝날 때까지 비어 있습니다.

**블록 맵.** KV 캐시는 고정 크기 블록(블록당 `block_size` 토큰)의 풀 하나입니다. 각 칸은 물리 블록 하나이며, \
그 블록을 블록 테이블에 가진 요청의 색으로 칠해집니다. 흰색 = 비어 있음, 옅은 청회색 = 비어 있지만 같은 앞부분을 \
가진 새 요청이 재사용할 수 있는 프리픽스가 캐시되어 있음, × = 풀 바깥. 내 요청은 두 패널에서 테두리로 표시됩니다. \
점은 전에 다른 요청이 쓰던 블록이라는 표시입니다. \
메모리는 블록 단위로 재활용되고 요청마다 미리 잡아 두지 않으므로, 낭비는 요청당 덜 찬 블록 하나뿐입니다. \
▷ 표시는 보고 있는 스텝에 요청이 받은 블록이며, 마우스를 올리면 전에 누구의 블록이었고 언제 해제되었는지 나옵니다.

**카운터.** 실행 중/대기 중 요청 수, 사용 중인 블록 비율, 초당 생성 토큰(최근 5초), 첫 토큰까지 시간과 출력 \
토큰당 시간(끝난 요청의 중앙값 / 90번째 백분위), 최근 64스텝의 프리픽스 캐시 적중.

**발표 모드.** ‖ 일시 정지는 두 스텝 사이에서 엔진을 멈추고(메시지는 대기, 스트림은 멈춤), ▶| 한 스텝은 정확히 \
한 스텝만 실행하며, ▶▶| 다음 슬롯 인계 / 다음 블록 재사용은 슬롯이나 블록의 주인이 바뀔 때까지 실행한 뒤 \
그 스텝에서 멈추고, 슬로 모션은 스텝마다 최소 시간을 두고, 되돌아보기는 패널을 이전 스텝에 고정합니다. 각 답변의 \
상태 줄은 요청이 어디에 있는지(대기, 프리필, 디코딩, 선점, 완료) 알려 줍니다.
"""

EN = {
    "title": "# Continuous Batching Playground",
    "subtitle": "Many chats, one engine: continuous batching over a paged KV cache, drawn live from the "
                "engine's own state. Open several tabs and chat at once.",
    "chat": "Chat", "placeholder": "Message (Enter sends)", "send": "Send", "stop": "Stop",
    "clear": "Clear", "sampling": "Sampling", "temperature": "Temperature", "top_p": "Top-p",
    "max_new_tokens": "Max new tokens", "seed": "Seed (-1 = random)",
    "loadgen": "Load generator", "loadgen_help": "For talks: add N synthetic chats (built-in prompts of "
    "varied length) at a chosen rate to fill the batch and watch slots being swapped.",
    "num_chats": "Number of chats", "rate": "Rate (chats per second)", "start_load": "Add synthetic chats",
    "stop_load": "Stop synthetic chats", "load_status": "Load generator status",
    "running": "Running", "waiting": "Waiting", "kv_usage": "KV cache used", "tokens_per_s": "Generated",
    "ttft": "TTFT p50 / p90", "tpot": "TPOT p50 / p90", "totals": "Totals", "prefix_cache": "Prefix cache",
    "tab_playground": "Playground", "tab_compare": "Compare: static vs continuous",
    "occupancy": "Slot occupancy per engine step", "blocks": "Physical KV block map",
    "rates": "Running / waiting requests and KV usage", "window": "Steps shown", "live": "Live updates",
    "how_title": "How it works", "how": HOW_EN, "engine": "Engine",
    "pause": "‖ Pause", "resume": "▶ Resume", "step": "▶| Step", "slow_motion": "Slow motion (min. seconds per step)",
    "look_back": "Look back (steps before the newest; 0 = live)",
    "next_handover": "▶▶| Next hand-over", "next_reuse": "▶▶| Next block reuse", "talk_preset": "◉ Talk preset",
    "cmp_note": "Two fresh engines run the same requests: **static** batching (the next batch starts when the "
                "whole batch is done), then **continuous** (a freed slot is refilled at the next step). Rows: batch "
                "slots; columns: engine steps; ▷ a request takes its slot; grey: a slot held by a finished request. "
                "They run a tiny model with the loaded model's tokenizer: every request generates exactly its "
                "tokens, so the steps are the loaded model's, in a fraction of a second. Your chats are not affected.",
    "cmp_workload": "Workload", "cmp_run": "Run static, then continuous",
    "cmp_static": "static", "cmp_continuous": "continuous",
    "cmp_hint": "Pick a workload and press the button: the step counts of both runs appear here.",
    "cmp_preset_classic": "Classic: 3 slots; A, B, C need 2, 5, 3 tokens; D and E wait",
    "cmp_preset_skewed": "Skewed: 4 slots, 12 chats of 3 to 40 tokens",
    "cmp_preset_uniform": "Uniform: 4 slots, 8 chats of 8 tokens each (static loses nothing)",
    "cmp_run_label": "{policy}: {steps} steps · {idle} idle slot-steps",
    "cmp_headline": "{static} {s_steps} steps · {s_idle} idle slot-steps → {continuous} {c_steps} steps · "
                    "{c_idle} idle: {delta}",
    "cmp_fewer": "{n} fewer steps ({ratio}x)", "cmp_same": "the same number of steps", "cmp_more": "{n} more steps",
    "cmp_running": "Running static, then continuous…",
    "inv_title": "Batch invariance: the same prompt alone and inside a busy batch",
    "inv_note": "One seeded request (temperature 0.8, 48 tokens) runs twice on a fresh engine: alone, then "
                "arriving while 12 other chats decode. Its random draws are the same both times, so any difference "
                "comes from the logits. By default nothing guarantees that they match: some matrix kernels (MKL's "
                "float32 ones among them) sum in an order that depends on how many rows the step has, and whether "
                "the runs part depends on the CPU and the dtype. With **--batch-invariant** every linear runs in "
                "fixed tiles of rows, and the two runs agree token for token (at some cost in speed). Marked: "
                "tokens from the first difference on.",
    "inv_run": "Run alone and in a busy batch, in both modes",
    "inv_default": "default engine", "inv_batch_invariant": "--batch-invariant", "inv_dtype": "{dtype} on this CPU",
    "inv_identical": "identical, {n} of {n} tokens", "inv_differs": "differs from token {i} of {n}",
    "inv_lp_equal": "log-probabilities equal bit for bit",
    "inv_lp_differ": "but their log-probabilities differ by up to {d} (a near-tie would flip a token)",
    "inv_alone": "alone:", "inv_busy": "with {n} others (up to {m} per step):",
}

KO = {
    "title": "# 연속 배칭 플레이그라운드",
    "subtitle": "여러 채팅, 하나의 엔진: 페이지드 KV 캐시 위의 연속 배칭(continuous batching)을 엔진의 실제 "
                "상태로 실시간으로 그립니다. 탭을 여러 개 열고 동시에 채팅해 보세요.",
    "chat": "채팅", "placeholder": "메시지 (Enter로 보내기)", "send": "보내기", "stop": "중지",
    "clear": "지우기", "sampling": "샘플링 설정", "temperature": "온도 (temperature)", "top_p": "Top-p",
    "max_new_tokens": "최대 생성 토큰 수", "seed": "시드 (-1 = 무작위)",
    "loadgen": "부하 생성기", "loadgen_help": "발표용: 길이가 다양한 내장 프롬프트로 가상 채팅 N개를 정한 "
    "속도로 추가해 배치를 채우고, 슬롯이 교체되는 모습을 보여 줍니다.",
    "num_chats": "채팅 수", "rate": "속도 (초당 채팅 수)", "start_load": "가상 채팅 추가",
    "stop_load": "가상 채팅 중지", "load_status": "부하 생성기 상태",
    "running": "실행 중", "waiting": "대기 중", "kv_usage": "KV 캐시 사용률", "tokens_per_s": "생성 속도",
    "ttft": "첫 토큰 시간 TTFT p50 / p90", "tpot": "토큰당 시간 TPOT p50 / p90", "totals": "누계", "prefix_cache": "프리픽스 캐시",
    "tab_playground": "플레이그라운드", "tab_compare": "비교: 정적 vs 연속 배칭",
    "occupancy": "엔진 스텝별 슬롯 점유", "blocks": "물리 KV 블록 맵",
    "rates": "실행/대기 요청 수와 KV 사용률", "window": "표시할 스텝 수", "live": "실시간 갱신",
    "how_title": "어떻게 동작하나요?", "how": HOW_KO, "engine": "엔진",
    "pause": "‖ 일시 정지", "resume": "▶ 계속", "step": "▶| 한 스텝", "slow_motion": "슬로 모션 (스텝당 최소 초)",
    "look_back": "되돌아보기 (최신 스텝에서 몇 스텝 전; 0 = 실시간)",
    "next_handover": "▶▶| 다음 슬롯 인계", "next_reuse": "▶▶| 다음 블록 재사용", "talk_preset": "◉ 발표용 설정",
    "cmp_note": "새 엔진 두 개가 같은 요청을 실행합니다: 먼저 **정적 배칭**(배치 전체가 끝나야 다음 배치 시작), 이어서 "
                "**연속 배칭**(빈 슬롯을 바로 다음 스텝에 채움). 행: 배치 슬롯, 열: 엔진 스텝, ▷: 요청이 슬롯을 받음, "
                "회색: 끝난 요청이 자리만 차지한 슬롯. 불러온 모델의 토크나이저를 쓰는 작은 모델로 실행합니다: 요청마다 "
                "정해진 토큰 수만큼 생성하므로 스텝은 불러온 모델과 같고, 1초도 걸리지 않습니다. 내 채팅에는 영향이 없습니다.",
    "cmp_workload": "워크로드", "cmp_run": "정적 배칭, 이어서 연속 배칭 실행",
    "cmp_static": "정적 배칭", "cmp_continuous": "연속 배칭",
    "cmp_hint": "워크로드를 고르고 버튼을 누르면 두 실행의 스텝 수가 여기에 나옵니다.",
    "cmp_preset_classic": "기본: 슬롯 3개; A, B, C는 토큰 2, 5, 3개 필요; D와 E는 대기",
    "cmp_preset_skewed": "편중: 슬롯 4개, 토큰 3~40개짜리 채팅 12개",
    "cmp_preset_uniform": "균일: 슬롯 4개, 토큰 8개짜리 채팅 8개 (정적 배칭도 손해 없음)",
    "cmp_run_label": "{policy}: {steps} 스텝 · 유휴 슬롯-스텝 {idle}",
    "cmp_headline": "{static} {s_steps} 스텝 · 유휴 슬롯-스텝 {s_idle} → {continuous} {c_steps} 스텝 · "
                    "유휴 {c_idle}: {delta}",
    "cmp_fewer": "{n} 스텝 적음 ({ratio}배)", "cmp_same": "스텝 수 같음", "cmp_more": "{n} 스텝 더 많음",
    "cmp_running": "정적 배칭, 이어서 연속 배칭 실행 중…",
    "inv_title": "배치 불변성: 같은 프롬프트를 혼자, 그리고 바쁜 배치 안에서",
    "inv_note": "시드를 준 요청 하나(temperature 0.8, 토큰 48개)를 새 엔진에서 두 번 실행합니다: 혼자, 그리고 다른 채팅 "
                "12개가 디코딩하는 중에 도착해서. 두 번 모두 난수는 같으므로 차이는 로짓에서만 생깁니다. 기본 설정에서는 "
                "같다는 보장이 없습니다: 일부 행렬 커널(MKL의 float32 커널 등)은 스텝의 행 수에 따라 합산 순서가 달라지고, "
                "결과가 갈리는지는 CPU와 dtype에 따라 다릅니다. **--batch-invariant**에서는 모든 선형 층이 고정된 행 타일로 "
                "계산되어 두 실행이 토큰 하나하나까지 같습니다(속도를 조금 대가로). 표시: 첫 차이부터의 토큰.",
    "inv_run": "두 모드에서 혼자, 그리고 바쁜 배치 안에서 실행",
    "inv_default": "기본 엔진", "inv_batch_invariant": "--batch-invariant", "inv_dtype": "이 CPU에서 {dtype}",
    "inv_identical": "같음, 토큰 {n}개 중 {n}개", "inv_differs": "토큰 {n}개 중 {i}번째부터 다름",
    "inv_lp_equal": "로그 확률도 비트 하나까지 같음",
    "inv_lp_differ": "하지만 로그 확률이 최대 {d}만큼 다름 (거의 동점이면 토큰이 바뀔 수 있음)",
    "inv_alone": "혼자:", "inv_busy": "다른 요청 {n}개와 함께 (스텝당 최대 {m}개):",
}

PREFIX = "cbp_"  # Gradio's own translations use keys such as "blocks" and "chat": keep ours apart
I18N = gr.I18n(en={PREFIX + k: v for k, v in EN.items()}, ko={PREFIX + k: v for k, v in KO.items()})

FIGURE_LABELS = {
    "en": dict(LABELS_EN),
    "ko": {
        **TILE_LABELS_KO,
        "step": "엔진 스텝", "slot": "배치 슬롯", "request": "요청",
        "tokens_step": "이번 스텝 토큰", "tokens_cache": "캐시된 토큰", "admitted": "슬롯 배정",
        "block": "블록", "owner": "소유", "free": "비어 있음", "cached": "비어 있음 (프리픽스 캐시)",
        "filled": "채워진 토큰", "refcount": "참조 수", "reused": "재사용 횟수", "shared": "공유 블록", "cache_hit": "프리픽스 캐시 적중",
        "reused_marker": "재사용된 블록", "running": "실행 중", "waiting": "대기 중", "kv": "KV 사용률 %",
        "prefill": "프리필", "decode": "디코드", "idle": "유휴 (점유)",
        "outside": "풀 밖", "mine": "내 요청", "cache_hit_tokens": "프리픽스 캐시 적중 토큰", "took_slot": "슬롯을 받음",
        "taken_marker": "이번 스텝에 받은 블록", "taken_at": "스텝 {step}에 받음", "origin_new": "처음 쓰는 블록",
        "origin_reused": "{owner}의 블록이었음, 스텝 {freed}에 해제", "origin_own": "다시 자기 블록, 스텝 {freed}에 해제",
        "origin_cached": "{owner}의 캐시된 프리픽스, 스텝 {freed}에 해제", "origin_shared": "{owner}와 공유",
        "totals_fmt": "{tok} 토큰 · {steps} 스텝 · 선점 {preempt}회",
        "prefix_fmt": "적중 {rate}% · {saved} 토큰 절약", "prefix_window_fmt": " (최근 {steps} 스텝)",
    },
}


def t(key: str):
    """The translatable text ``key`` (an ``I18nData`` the browser resolves to English or Korean)."""
    if key not in EN:
        raise KeyError(key)
    return I18N(PREFIX + key)


def language(accept_language: str | None) -> str:
    """``"ko"`` or ``"en"`` from an Accept-Language header: the first listed language we have."""
    for part in (accept_language or "").split(","):
        code = part.split(";")[0].strip().lower()[:2]
        if code in FIGURE_LABELS:
            return code
    return "en"


def figure_labels(lang: str) -> dict[str, str]:
    """Axis, legend and hover labels of the figures in ``lang`` (English when unknown)."""
    return FIGURE_LABELS.get(lang, FIGURE_LABELS["en"])


# What a chat's own bubble says about its request (server-side: chosen from the request's Accept-Language).
STATE_TEXTS = {
    "en": {
        "sent": "⏳ Sent to the engine",
        "queued": "⏳ Queued: {position} of {waiting} waiting",
        "prefilling": "⚙️ Prefilling: {computed} of {prompt} prompt tokens",
        "decoding": "✍️ Decoding: {tokens} token{s}",
        "preempted": "⏸ Preempted: its blocks were reclaimed; queued again ({position} of {waiting}), it will recompute",
        "finished": "✓ Finished: {tokens} token{s} ({reason})",
        "stopped": "⏹ Stopped after {tokens} token{s}",
        "failed": "⚠️ Failed",
        "paused": " · engine paused",
        "mine": "your request · {color}",
        "mine_panel": "Your request: {color}, outlined in both panels.",
        "busy": "A reply is still streaming: wait for it to end, or press Stop.",
        "host_only": "Only the host can pause, step or slow the engine here.",
        "talk_on": "Talk preset: the engine restarted with {slots} slots and {blocks} KV blocks, most recently freed "
                   "blocks first; {window} steps shown. Replies in flight were ended.",
        "talk_kept": "Talk preset: the engine already runs it; {window} steps shown.",
    },
    "ko": {
        "sent": "⏳ 엔진에 보냄",
        "queued": "⏳ 대기 중: 대기열 {waiting}개 중 {position}번째",
        "prefilling": "⚙️ 프리필 중: 프롬프트 토큰 {prompt}개 중 {computed}개",
        "decoding": "✍️ 디코딩 중: 토큰 {tokens}개",
        "preempted": "⏸ 선점됨: 블록을 돌려주고 다시 대기 중 ({waiting}개 중 {position}번째), 다시 계산합니다",
        "finished": "✓ 완료: 토큰 {tokens}개 ({reason})",
        "stopped": "⏹ 토큰 {tokens}개 후 중지됨",
        "failed": "⚠️ 실패",
        "paused": " · 엔진 일시 정지",
        "mine": "내 요청 · {color}",
        "mine_panel": "내 요청: {color}, 두 패널에서 테두리로 표시됩니다.",
        "busy": "아직 답변을 받는 중입니다. 끝날 때까지 기다리거나 중지를 누르세요.",
        "host_only": "여기서는 진행자만 엔진을 멈추거나 한 스텝씩 실행하거나 느리게 할 수 있습니다.",
        "talk_on": "발표용 설정: 엔진을 슬롯 {slots}개, KV 블록 {blocks}개, 가장 최근에 해제된 블록부터 쓰도록 다시 "
                   "시작했습니다. 스텝 {window}개를 표시합니다. 진행 중이던 답변은 끝났습니다.",
        "talk_kept": "발표용 설정: 엔진이 이미 이 설정입니다. 스텝 {window}개를 표시합니다.",
    },
}


# Finish reasons as the engine names them (vLLM's), said in each language; unknown ones are shown as they are.
FINISH_REASONS = {
    "en": {},  # the engine's own words ("stop", "length")
    "ko": {"stop": "정지 조건", "length": "길이 제한", "abort": "중지됨", "error": "오류"},
}


def finish_reason_text(lang: str, reason: str | None) -> str:
    """A finish reason (``"stop"``, ``"length"``, ``"abort"``, ``"error"``) in ``lang``; other values as given."""
    reason = reason or "stop"
    return FINISH_REASONS.get(lang, FINISH_REASONS["en"]).get(reason, reason)


def state_text(lang: str, key: str, **values) -> str:
    """The chat-state text ``key`` in ``lang`` (English when unknown) with ``values`` filled in; a ``reason``
    value (a finish reason) is said in ``lang`` (:func:`finish_reason_text`).

    Raises:
        KeyError: unknown ``key``.
    """
    plural = "" if values.get("tokens") == 1 else "s"  # English only; the Korean texts have no {s}
    if "reason" in values:
        values["reason"] = finish_reason_text(lang, values["reason"])
    return STATE_TEXTS.get(lang, STATE_TEXTS["en"])[key].format(s=plural, **values)


# The pace line above the panels (server-side, like the status lines).
PACE_TEXTS = {
    "en": {"paused": "‖ **Engine paused** after step {step}: Step runs one step",
           "running": "▶ Engine running · step {step}", "slow": " · slow motion: {s:.2f} s per step",
           "pinned": " · pinned at step {end} (newest {newest}); Look back 0 follows live",
           "seeking_handover": " · running to the next hand-over (a slot changes owner)…",
           "seeking_reuse": " · running to the next block reuse (a freed block taken by another request)…",
           "found_handover": " · **hand-over** · slot {slot}: {prev} → {new}",
           "found_reused": " · **block reuse** · block {block}: {prev} (freed at step {freed}) → {new}",
           "found_cached": " · **block reuse** · block {block}: {prev}'s cached prefix (freed at step {freed}) → {new}",
           "not_found_handover": " · no hand-over in the steps run", "not_found_reuse": " · no block reuse in the steps run"},
    "ko": {"paused": "‖ **엔진 일시 정지** (스텝 {step} 이후): 한 스텝 버튼으로 한 스텝씩 실행",
           "running": "▶ 엔진 실행 중 · 스텝 {step}", "slow": " · 슬로 모션: 스텝당 {s:.2f}초",
           "pinned": " · 스텝 {end}에 고정 (최신 {newest}); 되돌아보기 0이면 실시간",
           "seeking_handover": " · 다음 슬롯 인계(슬롯 주인이 바뀜)까지 실행 중…",
           "seeking_reuse": " · 다음 블록 재사용(해제된 블록을 다른 요청이 받음)까지 실행 중…",
           "found_handover": " · **슬롯 인계** · 슬롯 {slot}: {prev} → {new}",
           "found_reused": " · **블록 재사용** · 블록 {block}: {prev} (스텝 {freed}에 해제) → {new}",
           "found_cached": " · **블록 재사용** · 블록 {block}: {prev}의 캐시된 프리픽스(스텝 {freed}에 해제) → {new}",
           "not_found_handover": " · 실행한 스텝에서 슬롯 인계 없음", "not_found_reuse": " · 실행한 스텝에서 블록 재사용 없음"},
}


# The header line under the title (server-side: the page is built once, the language is the request's).
SUMMARY_TEXTS = {
    "en": "`{model}` · **{slots}** slots · **{blocks}** KV blocks × **{block_size}** tokens · policy `{policy}` · "
          "free blocks `{order}` · context {context} tokens",
    "ko": "`{model}` · 슬롯 **{slots}**개 · KV 블록 **{blocks}**개 × 블록당 토큰 **{block_size}**개 · 정책 `{policy}` · "
          "빈 블록 순서 `{order}` · 컨텍스트 {context} 토큰",
}
EMBEDDED_MODEL = {"en": "SmolLM2-135M-Instruct (embedded)", "ko": "SmolLM2-135M-Instruct (내장)"}

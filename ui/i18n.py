"""English and Korean texts: component labels through Gradio's ``gr.I18n`` (translated in the browser
from its locale), and figure labels chosen on the server from the request's Accept-Language header
(plot text is drawn by Plotly, which Gradio's i18n does not reach)."""

from __future__ import annotations

import gradio as gr

from ui.figures import LABELS_EN

HOW_EN = """\
**Slot occupancy.** Each row is one batch slot (one of the `max_num_seqs` sequences the engine computes \
together), each column one engine step. A colour is one request: light = *prefill* (prompt tokens being \
computed, maybe in chunks), full = *decode* (one new token per step), grey = a slot held without work \
(static policy). ▷ marks the step at which a waiting request took a slot. With continuous batching a \
finished request's slot is given to a waiting one at the very next step; with the static policy it stays \
empty until the whole batch is done.

**Block map.** The KV cache is one pool of fixed-size blocks (`block_size` tokens each). Each cell is a \
physical block, in the colour of the request whose block table holds it; white = free, pale grey = free \
but still holding a cached prefix that a new request with the same beginning can reuse. A dot marks a block \
that had served another request before: memory is recycled block by block, nothing is reserved per request, \
so at most one partly filled block per request is wasted.

**Counters.** Running and waiting requests, share of blocks in use, generated tokens per second (last 5 s), \
time to first token and time per output token (median / 90th percentile of finished requests).
"""

HOW_KO = """\
**슬롯 점유.** 각 행은 배치 슬롯 하나(엔진이 함께 계산하는 `max_num_seqs`개 시퀀스 중 하나), 각 열은 엔진 \
스텝 하나입니다. 색 하나가 요청 하나입니다: 옅은 색 = *프리필*(프롬프트 토큰 계산, 여러 조각으로 나뉠 수 있음), \
진한 색 = *디코드*(스텝마다 새 토큰 하나), 회색 = 일은 없이 자리만 차지한 슬롯(정적 배칭). ▷ 표시는 대기 중이던 \
요청이 슬롯을 받은 스텝입니다. 연속 배칭에서는 끝난 요청의 슬롯을 바로 다음 스텝에 대기 요청이 이어받고, 정적 \
배칭에서는 배치 전체가 끝날 때까지 비어 있습니다.

**블록 맵.** KV 캐시는 고정 크기 블록(블록당 `block_size` 토큰)의 풀 하나입니다. 각 칸은 물리 블록 하나이며, \
그 블록을 블록 테이블에 가진 요청의 색으로 칠해집니다. 흰색 = 비어 있음, 옅은 회색 = 비어 있지만 같은 앞부분을 \
가진 새 요청이 재사용할 수 있는 프리픽스가 캐시되어 있음. 점은 전에 다른 요청이 쓰던 블록이라는 표시입니다. \
메모리는 블록 단위로 재활용되고 요청마다 미리 잡아 두지 않으므로, 낭비는 요청당 덜 찬 블록 하나뿐입니다.

**카운터.** 실행 중/대기 중 요청 수, 사용 중인 블록 비율, 초당 생성 토큰(최근 5초), 첫 토큰까지 시간과 출력 \
토큰당 시간(끝난 요청의 중앙값 / 90번째 백분위).
"""

EN = {
    "title": "# Continuous Batching Playground",
    "subtitle": "Many chats, one engine: continuous batching over a paged KV cache, drawn live from the "
                "engine's own state. Open several tabs and chat at once.",
    "chat": "Chat", "placeholder": "Type a message and press Enter", "send": "Send", "stop": "Stop",
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
}

KO = {
    "title": "# 연속 배칭 플레이그라운드",
    "subtitle": "여러 채팅, 하나의 엔진: 페이지드 KV 캐시 위의 연속 배칭(continuous batching)을 엔진의 실제 "
                "상태로 실시간으로 그립니다. 탭을 여러 개 열고 동시에 채팅해 보세요.",
    "chat": "채팅", "placeholder": "메시지를 입력하고 Enter를 누르세요", "send": "보내기", "stop": "중지",
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
}

PREFIX = "cbp_"  # Gradio's own translations use keys such as "blocks" and "chat": keep ours apart
I18N = gr.I18n(en={PREFIX + k: v for k, v in EN.items()}, ko={PREFIX + k: v for k, v in KO.items()})

FIGURE_LABELS = {
    "en": dict(LABELS_EN),
    "ko": {
        "step": "엔진 스텝", "slot": "배치 슬롯", "request": "요청",
        "tokens_step": "이번 스텝 토큰", "tokens_cache": "캐시된 토큰", "admitted": "슬롯 배정",
        "block": "블록", "owner": "소유", "free": "비어 있음", "cached": "비어 있음 (프리픽스 캐시)",
        "filled": "채워진 토큰", "refcount": "참조 수", "reused": "재사용 횟수", "shared": "공유 블록", "cache_hit": "프리픽스 캐시 적중",
        "reused_marker": "재사용된 블록", "running": "실행 중", "waiting": "대기 중", "kv": "KV 사용률 %",
        "prefill": "프리필", "decode": "디코드", "idle": "유휴 (점유)",
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

"""The request colours (ui/palette.py): far apart in CIEDE2000 on a white screen and on a washed-out
projector, named, and assigned so that requests on screen at once, and requests running at the same step,
never share a colour; each request also gets a letter.

CIEDE2000 is written here from its published definition (Sharma, Wu, Dalal, "The CIEDE2000 color-difference
formula", Color Research & Application 30(1), 2005), checked against the paper's test pairs.
"""

from __future__ import annotations

import pytest

from engine.telemetry import PHASE_DECODE
from tests.test_ui_figures import snap
from ui import figures as F

# Threshold: CIEDE2000 >= 15 between any two colours a viewer must tell apart. (CIEDE2000 ~ 1 is a
# just-noticeable difference side by side; ~10 is "clearly different", and small heatmap cells need more.)
MIN_DE2000 = 16.5  # every distance the panels rely on (palette_distances)
MIN_PAIR_DE2000 = 18.0  # two full request colours on a white screen
MIN_PROJECTOR_DE2000 = 11.0  # two full request colours on a washed-out projector (see projected())
PROJECTOR_AMBIENT = 0.25  # share of white light a projector's picture sits on in a lit room (linear RGB)


def _rgb(color: str) -> tuple[float, float, float]:
    """(r, g, b) in 0..255 from "#RRGGBB" or plotly's "rgb(r, g, b)"."""
    if color.startswith("#"):
        return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))
    return tuple(float(v) for v in color[color.index("(") + 1:-1].split(","))


def _lab(color: str) -> tuple[float, float, float]:
    """CIELAB (D65) of an sRGB colour."""
    lin = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in (v / 255 for v in _rgb(color))]
    r, g, b = lin
    xyz = ((0.4124564 * r + 0.3575761 * g + 0.1804375 * b) / 0.95047,
           0.2126729 * r + 0.7151522 * g + 0.0721750 * b,
           (0.0193339 * r + 0.1191920 * g + 0.9503041 * b) / 1.08883)
    fx, fy, fz = (t ** (1 / 3) if t > 216 / 24389 else (24389 / 27 * t + 16) / 116 for t in xyz)
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def _de2000_lab(lab1, lab2) -> float:
    """CIEDE2000 colour difference of two CIELAB colours (Sharma, Wu, Dalal 2005)."""
    from math import atan2, cos, degrees, exp, hypot, radians, sin, sqrt

    (L1, a1, b1), (L2, a2, b2) = lab1, lab2
    cbar7 = ((hypot(a1, b1) + hypot(a2, b2)) / 2) ** 7
    g = 0.5 * (1 - sqrt(cbar7 / (cbar7 + 25 ** 7)))
    a1, a2 = (1 + g) * a1, (1 + g) * a2
    c1, c2 = hypot(a1, b1), hypot(a2, b2)
    h1, h2 = degrees(atan2(b1, a1)) % 360, degrees(atan2(b2, a2)) % 360
    dh = 0.0 if c1 * c2 == 0 else (h2 - h1 + 180) % 360 - 180
    d_l, d_c, d_h = L2 - L1, c2 - c1, 2 * sqrt(c1 * c2) * sin(radians(dh / 2))
    lbar, cbar = (L1 + L2) / 2, (c1 + c2) / 2
    if c1 * c2 == 0:
        hbar = h1 + h2
    elif abs(h1 - h2) <= 180:
        hbar = (h1 + h2) / 2
    else:
        hbar = (h1 + h2 + 360) / 2 if h1 + h2 < 360 else (h1 + h2 - 360) / 2
    t = (1 - 0.17 * cos(radians(hbar - 30)) + 0.24 * cos(radians(2 * hbar)) + 0.32 * cos(radians(3 * hbar + 6))
         - 0.20 * cos(radians(4 * hbar - 63)))
    s_l = 1 + 0.015 * (lbar - 50) ** 2 / sqrt(20 + (lbar - 50) ** 2)
    s_c, s_h = 1 + 0.045 * cbar, 1 + 0.015 * cbar * t
    r_t = -2 * sqrt(cbar ** 7 / (cbar ** 7 + 25 ** 7)) * sin(radians(60 * exp(-(((hbar - 275) / 25) ** 2))))
    return sqrt((d_l / s_l) ** 2 + (d_c / s_c) ** 2 + (d_h / s_h) ** 2 + r_t * (d_c / s_c) * (d_h / s_h))


def de2000(c1: str, c2: str) -> float:
    return _de2000_lab(_lab(c1), _lab(c2))


def projected(color: str, ambient: float = PROJECTOR_AMBIENT) -> str:
    """``color`` as a washed-out projector shows it: room light adds ``ambient`` of white to every channel in
    linear light (black becomes a grey, saturated colours pale), back to "#RRGGBB"."""
    def lin(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    def enc(c: float) -> int:
        v = 12.92 * c if c <= 0.0031308 else 1.055 * c ** (1 / 2.4) - 0.055
        return round(255 * min(1.0, max(0.0, v)))

    rgb = [ambient + (1 - ambient) * lin(v / 255) for v in _rgb(color)]
    return "#" + "".join(f"{enc(v):02X}" for v in rgb)


def test_de2000_matches_published_pairs():
    # Sharma, Wu, Dalal (2005), Table 1: pairs 1, 3, 7 and 17
    for lab1, lab2, want in [((50, 2.6772, -79.7751), (50, 0, -82.7485), 2.0425),
                             ((50, 2.5, 0), (50, 0, -2.5), 4.3065),
                             ((50, 0, 0), (50, -1, 2), 2.3669),
                             ((50, 2.5, 0), (73, 25, -18), 27.1492)]:
        assert _de2000_lab(lab1, lab2) == pytest.approx(want, abs=1e-4)
    assert de2000("#FFFFFF", "#000000") == pytest.approx(100, abs=0.01)


def palette_distances(colors: list[str]) -> list[tuple[float, str, str]]:
    """Every distance the panels rely on among ``colors`` (palette entries) and the fixed colours."""
    out = []
    for i, a in enumerate(colors):
        la = F.light_shade(a)
        for fixed in (F.IDLE_COLOR, F.CACHED_COLOR, F.FREE_COLOR):
            out.append((de2000(a, fixed), a, fixed))
        out.append((de2000(la, F.FREE_COLOR), f"light {a}", "white"))  # a prefill cell is not blank
        out.append((de2000(la, F.IDLE_COLOR), f"light {a}", "idle"))  # nor grey
        for j, b in enumerate(colors):
            if i < j:
                out.append((de2000(a, b), a, b))
            out.append((de2000(a, F.light_shade(b)), a, f"light {b}"))  # decode of one vs prefill of any
    return out


def test_palette_has_16_named_colours_far_apart():
    assert len(F.PALETTE) >= 16 and len(F.PALETTE) == F.K and len(set(F.PALETTE)) == F.K
    for lang in ("en", "ko"):
        names = F.PALETTE_NAMES[lang]
        assert len(names) == F.K and len(set(names)) == F.K and all(names)
    worst = min(palette_distances(list(F.PALETTE)))
    assert worst[0] >= MIN_DE2000, worst
    pairs = [(de2000(a, b), a, b) for i, a in enumerate(F.PALETTE) for b in F.PALETTE[i + 1:]]
    assert min(pairs)[0] >= MIN_PAIR_DE2000, min(pairs)


def test_every_two_colours_stay_apart_on_a_washed_out_projector():
    """Any two request colours can sit side by side (neighbouring slot rows, neighbouring blocks), so every
    pair, not only palette neighbours, must stay apart when a projector washes the picture out."""
    assert projected("#000000") != "#000000" and projected("#FFFFFF") == "#FFFFFF"
    pairs = [(de2000(projected(a), projected(b)), a, b) for i, a in enumerate(F.PALETTE) for b in F.PALETTE[i + 1:]]
    assert min(pairs)[0] >= MIN_PROJECTOR_DE2000, min(pairs)
    # the blank (free) and grey (idle) cells too
    for a in F.PALETTE:
        for fixed in (F.FREE_COLOR, F.IDLE_COLOR):
            assert de2000(projected(a), projected(fixed)) >= MIN_PROJECTOR_DE2000, (a, fixed)


def test_color_names():
    teal = F.PALETTE_NAMES["en"].index("teal")
    assert F.color_name(teal) == "teal" and F.color_name(teal, "ko") == "청록"
    assert F.color_name(teal + F.K) == "teal" and F.color_name(0, "fr") == F.PALETTE_NAMES["en"][0]


def test_sixteen_live_requests_get_sixteen_distinguishable_colours():
    live = [snap(1, [(f"r{i}", PHASE_DECODE, 1, 1) for i in range(16)], {})]
    ca = F.ColorAssigner()
    idx = ca.update(live)
    assert len(set(idx.values())) == 16 and ca.index_of("r3") == idx["r3"] and ca.index_of("nope") is None
    worst = min(palette_distances([F.PALETTE[i] for i in idx.values()]))
    assert worst[0] >= MIN_DE2000, worst


def test_cached_and_outside_cells_stand_apart_from_free_and_grid():
    # the grid colour shows between cells and in the cells past the last block ("not in the pool")
    assert de2000(F.CACHED_COLOR, F.GRID_COLOR) >= 10
    assert de2000(F.CACHED_COLOR, F.FREE_COLOR) >= 15
    assert de2000(F.FREE_COLOR, F.GRID_COLOR) >= 4  # free cells are told apart by the grid lines


# --------------------------------------------------------------------------- assignment
def test_requests_running_at_the_same_step_never_share_a_colour_even_past_16_in_the_window():
    """Sixteen slots and short requests: more than 16 requests in the window, so colours repeat in it, but
    never between two requests that run at the same step."""
    ca = F.ColorAssigner()
    window: list = []
    running: dict[int, str] = {}
    n = 0
    for step in range(1, 60):
        for slot in range(16):  # every slot's request lasts 3 to 6 steps, then a new one takes the slot
            if slot not in running or (step + slot) % (3 + slot % 4) == 0:
                running[slot] = f"r{n}"
                n += 1
        window = (window + [snap(step, [(running[s], PHASE_DECODE, 1, 1) for s in range(16)], {})])[-48:]
        colors = ca.update(window)
        now = [colors[running[s]] for s in range(16)]
        assert len(set(now)) == 16, (step, now)
    assert len(colors) > 16  # the window held more requests than colours


def test_requests_holding_slots_in_the_window_have_distinct_colours_and_letters():
    """The talk preset's case: 4 slots, fewer than 16 requests in the window: all distinct, letters A, B, ..."""
    ca = F.ColorAssigner()
    seq = [snap(s, [(f"q{(s + k) // 5}-{k}", PHASE_DECODE, 1, 1) for k in range(4)], {}) for s in range(1, 16)]
    colors = ca.update(seq)
    assert len(colors) <= 16 and len(set(colors.values())) == len(colors)
    letters = ca.letters(colors)
    assert sorted(letters.values()) == sorted(F.LETTERS[:len(colors)])
    assert ca.letter_of("nope") is None
    first = next(iter(colors))
    assert F.request_label(colors[first], letters[first]) == f"{F.color_name(colors[first])} {letters[first]}"
    assert F.request_label(colors[first], letters[first], "ko").startswith(F.PALETTE_NAMES["ko"][colors[first]])

"""The playground page's markup and style: its CSS (fixed heights, fonts, counters) and the HTML the live
channel's poller (``ui/live.js``) fills: the live area with both panels, the tab's session mark and the
counters."""

from __future__ import annotations

import html

from ui.compare import COMPARE_CSS
from ui.invariance import INVARIANCE_CSS
from ui.panel_table import PLOT_HEIGHT, SHOWN
from ui.panels import COUNTER_KEYS

# Fixed layout: the lines above the panels have fixed heights (a longer text is cut, never wraps the panels
# down), the panels a fixed height, and Plotly's own hover label is hidden (ui/live.js writes the hovered
# cell's text into #cbp-hover instead, so no tooltip covers the cells it describes). Fonts: the theme's, then
# Korean ones (a projector laptop without a Korean system font otherwise shows boxes; Debian: fonts-nanum).
CSS = f"""
.gradio-container {{ font-family: var(--font), "Noto Sans KR", "NanumGothic", "Malgun Gothic",
  "Apple SD Gothic Neo", sans-serif; }}
.cbp-note {{ font-size: 0.9em; }}
.cbp-panel {{ height: {PLOT_HEIGHT}px; min-height: {PLOT_HEIGHT}px; overflow: hidden; }}
.cbp-panel .cbp-plot {{ width: 100%; height: {PLOT_HEIGHT}px; }}
#cbp-live .cbp-panel .hoverlayer {{ display: none; }}
#pace-status {{ height: 2.8em; line-height: 1.4em; overflow: hidden; display: -webkit-box;
  -webkit-line-clamp: 2; -webkit-box-orient: vertical; }}
#mine, #cbp-hover {{ height: 1.4em; line-height: 1.4em; overflow: hidden; white-space: nowrap;
  text-overflow: ellipsis; }}
#cbp-hover {{ font-size: 0.9em; opacity: 0.85; }}
.cbp-req {{ white-space: nowrap; }}
.cbp-req i {{ display: inline-block; width: 0.8em; height: 0.8em; margin-right: 0.25em; border-radius: 2px;
  vertical-align: -0.05em; }}
#pacing {{ flex-wrap: wrap; gap: 6px; }}
#pacing button {{ white-space: nowrap; flex: 0 0 auto; width: auto; min-width: 0; }}
#cbp-counters {{ display: grid; grid-template-columns: repeat(4, minmax(100px, 1fr)); gap: 6px; }}
#cbp-counters .cbp-counter {{ border: 1px solid var(--border-color-primary); border-radius: 6px; padding: 4px 8px; }}
#cbp-counters .cbp-counter.cbp-wide {{ grid-column: span 2; }}
#cbp-counters .cbp-label {{ font-size: 0.8em; opacity: 0.75; }}
#cbp-counters .cbp-value {{ font-variant-numeric: tabular-nums; }}
#live-reply {{ border: 1px solid var(--border-color-primary); border-radius: 8px; padding: 6px 10px; }}
#live-reply-title {{ font-size: 0.85em; opacity: 0.8; }}
#live-reply-text {{ white-space: pre-wrap; }}
#load-status {{ font-variant-numeric: tabular-nums; min-height: 1.4em; }}
#load-status-label {{ font-size: 0.85em; opacity: 0.75; margin-bottom: 0; }}
""" + INVARIANCE_CSS + COMPARE_CSS


def live_html() -> str:
    """The live area the page's poller fills (``ui/live.js``): pace line, the tab's own request, the hovered
    cell's line and the panels that are always shown (:data:`ui.panel_table.SHOWN`, one element each, by name).
    It is never replaced (the panels drawn before the page's load event stay)."""
    panels = "".join(f'<div id="{name}" class="cbp-panel"></div>' for name in SHOWN)
    return f'<div id="cbp-live"><div id="pace-status"></div><div id="mine"></div><div id="cbp-hover"></div>{panels}</div>'


def folded_html(name: str) -> str:
    """The element of folded panel ``name`` (in its accordion; :data:`ui.panel_table.FOLDED`)."""
    return f'<div id="{name}" class="cbp-panel" data-folded="1"></div>'


def session_html(session: str = "") -> str:
    """A hidden mark that tells the poller which tab it is (Gradio's session hash, set at page load)."""
    return f'<span id="cbp-session" data-cbp-session="{html.escape(session)}" hidden></span>'


def counters_html() -> str:
    """The counters' cells (label and value filled by the poller), ids ``counter-<key>``."""
    cells = "".join(f'<div id="counter-{k}" class="cbp-counter{" cbp-wide" if k in ("totals", "prefix_cache") else ""}">'
                    '<div class="cbp-label"></div><div class="cbp-value">-</div></div>' for k in COUNTER_KEYS)
    return f'<div id="cbp-counters">{cells}</div>'

"""Remote mode's panels as pure functions: each KV publisher's liveness (last event, nothing received, greyed
while its server's /metrics fails), the KV map counting seconds from now, greyed blocks, the off note, the
counters one column per engine, and error texts that start with a plain sentence."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx

from ui.remote.backend import BackendState
from ui.remote.errors import RemoteError, from_exception, from_status
from ui.remote.figures import counters_html, kv_map_figure, kv_summary, publisher_lines
from ui.remote.kv import BlockRecord
from ui.remote.metrics import EngineCounters, ScrapeResult
from ui.remote.page import KV_OFF_NO_URL, kv_servers, notice_markdown


def sub(endpoint, label, last=None, started=0.0, error=None):
    return SimpleNamespace(endpoint=endpoint, label=label, last_message_at=last, started_at=started, error=error)


def test_each_publisher_says_when_it_last_sent_and_is_greyed_while_its_server_fails():
    subs = [sub("tcp://a:5557", "kv0", last=88.0), sub("tcp://b:5557", "kv1", started=95.0),
            sub("tcp://c:5557", "kv2", started=10.0), sub("tcp://d:5557", "kv3", error="ZMQError: bad address")]
    lines, stale = publisher_lines(subs, {"kv0": "The server does not answer (ConnectError)"}, now=100.0)
    assert lines[0].startswith('<span class="cbp-stale">`tcp://a:5557`: last event 12 s ago')
    assert "its server's /metrics fails" in lines[0] and "does not answer" in lines[0] and stale == {"kv0"}
    assert lines[1] == "`tcp://b:5557`: no event yet (5 s)"
    assert lines[2].startswith("`tcp://c:5557`: nothing received in 90 s: check --kv-events-url")
    assert lines[3].startswith("⚠️ `tcp://d:5557`: the KV event subscriber stopped") and "ZMQError" in lines[3]
    caption = kv_summary({k: 0 for k in ("live", "removed", "stored_again", "chains", "total_batches",
                                         "total_stored", "total_removed", "total_cleared", "total_gaps",
                                         "total_replayed", "total_lost", "total_dropped")} | {"live": 38},
                         lines, 16, "not exposed", as_last_seen=True)
    assert caption.startswith("**38** blocks stored as last seen") and "last event 12 s ago" in caption


def test_kv_endpoints_pair_with_their_servers():
    assert kv_servers(["tcp://a:1"], ["http://x:8000"]) == ["http://x:8000"]  # one of each: by position
    assert kv_servers(["tcp://a:1", "tcp://b:1"], ["http://router:8000", "http://a:8000", "http://b:8000"]) == [
        "http://a:8000", "http://b:8000"]  # by host
    assert kv_servers(["tcp://c:1"], ["http://a:1", "http://b:1"]) == [None]


def test_the_kv_map_counts_from_now_and_greys_a_stale_publishers_blocks():
    recs = [BlockRecord(1, "kv0", None, None, 90.0, 90.0), BlockRecord(2, "kv1", None, None, 95.0, 95.0, removed=97.0)]
    fig = kv_map_figure(recs, now=100.0, stale={"kv0"})
    by_name = {t.name: t for t in fig.data}
    assert list(by_name["server not answering (as last seen)"].x[:2]) == [-10.0, 0.0]  # drawn up to now
    assert list(by_name["removed"].x[:2]) == [-5.0, -3.0] and not by_name["stored"].x
    assert "seconds before now" in fig.layout.xaxis.title.text
    off = kv_map_figure([], off_reason=KV_OFF_NO_URL)
    text = off.layout.annotations[0].text
    assert "&quot;" not in text and '"enable_kv_cache_events"' in text and text.count("<br>") >= 2


def test_counters_are_one_column_per_engine_and_a_failed_server_is_a_sentence():
    e = EngineCounters(url="http://a:8000", engine="0", dialect="vllm")
    e.running, e.num_gpu_blocks, e.block_size = 3.0, 27000, 16
    html = counters_html([ScrapeResult("http://a:8000", [e]),
                          ScrapeResult("http://b:8000", [], str(from_exception(httpx.ConnectError("refused"))))])
    assert html.count("<th>http://") == 1 and "<th>KV blocks</th><td>27,000 x 16</td>" in html
    assert "http://b:8000: not read: The server does not answer" in html


def test_errors_start_with_a_sentence_and_keep_the_technical_text():
    closed = from_exception(httpx.RemoteProtocolError("peer closed connection without sending complete message body"))
    assert str(closed).startswith("The server closed the connection in the middle of the reply: it probably crashed")
    assert str(closed).endswith("(RemoteProtocolError: peer closed connection without sending complete message body)")
    assert closed.unreachable and not from_status(400, "too long").unreachable
    assert str(from_status(404, "Not Found", "/v1/models")).startswith("The server has no /v1/models (HTTP 404)")
    assert "developer.mozilla.org" not in str(from_status(404, "Not Found"))
    assert isinstance(from_exception(closed), RemoteError) and from_exception(closed) is closed
    assert notice_markdown(BackendState(reachable=True)) == ""
    down = notice_markdown(BackendState(reachable=False, error="The server does not answer."), "fixed line")
    assert down.startswith("⚠️ fixed line\n\n⚠️ The server does not answer. Chats fail until it answers")


def test_remote_mode_imports_no_model_library():
    """Remote mode runs no model: everything ``app.py --backend-url`` imports to serve the page (its page, client,
    scraper, KV subscribers, uvicorn with the HTTP limits) loads without torch or transformers."""
    code = ("import sys, app, ui.remote.page, ui.remote.backend, ui.remote.client, ui.remote.kv, ui.remote.metrics, "
            "ui.queue_polling, server.serving, server.options; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr

"""Remote mode without a server: the /metrics reader (vLLM, SGLang and our own names), the KV map (both wire
encodings, a cleared cache, the memory bound), the KV subscriber over real ZMQ sockets (a sequence gap filled
by the replay socket), the streaming client on a fake transport (text, Stop closing the stream, errors), the
options, and the page's handlers called without a browser."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import pytest
import zmq

import app
from engine.kv_wire import decode_batch, encode_batch
from ui.remote.client import RemoteClient, RemoteError, RequestLog
from ui.remote.kv import END_SEQ, KVMap, KVSubscriber
from ui.remote.metrics import Histogram, MetricsScraper, metrics_url, parse_metrics

M = 'model_name="Qwen/Qwen3-0.6B"'
VLLM_TEXT = f"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{engine="0",{M}}} 3.0
vllm:num_requests_running{{engine="1",{M}}} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{engine="0",{M}}} 2.0
vllm:num_requests_waiting{{engine="1",{M}}} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{engine="0",{M}}} 0.25
vllm:kv_cache_usage_perc{{engine="1",{M}}} 0.5
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{{engine="0",{M}}} 1000.0
vllm:prefix_cache_queries_created{{engine="0",{M}}} 1.7e9
vllm:prefix_cache_queries_total{{engine="1",{M}}} 10.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{{engine="0",{M}}} 250.0
vllm:prefix_cache_hits_total{{engine="1",{M}}} 0.0
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{{engine="0",{M}}} 4.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{engine="0",{M}}} 5000.0
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{{engine="0",{M}}} 9000.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.1",{M}}} 2.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="0.5",{M}}} 6.0
vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",{M}}} 8.0
vllm:time_to_first_token_seconds_count{{engine="0",{M}}} 8.0
vllm:time_to_first_token_seconds_sum{{engine="0",{M}}} 2.4
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_bucket{{engine="0",le="0.01",{M}}} 50.0
vllm:inter_token_latency_seconds_bucket{{engine="0",le="0.025",{M}}} 100.0
vllm:inter_token_latency_seconds_bucket{{engine="0",le="+Inf",{M}}} 100.0
vllm:inter_token_latency_seconds_count{{engine="0",{M}}} 100.0
vllm:inter_token_latency_seconds_sum{{engine="0",{M}}} 1.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="27000"}} 1.0
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{{generation="0"}} 12.0
"""
SGLANG_TEXT = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.12
sglang:cache_hit_rate{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
sglang:gen_throughput{model_name="meta-llama/Llama-3.1-8B-Instruct"} 123.4
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2000.0
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.2",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
sglang:time_to_first_token_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.15
sglang:time_to_first_token_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
# TYPE sglang:time_per_output_token_seconds histogram
sglang:time_per_output_token_seconds_bucket{le="0.02",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
sglang:time_per_output_token_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
sglang:time_per_output_token_seconds_sum{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.1
sglang:time_per_output_token_seconds_count{model_name="meta-llama/Llama-3.1-8B-Instruct"} 10.0
"""


def test_vllm_metrics_one_record_per_data_parallel_engine():
    e0, e1 = parse_metrics(VLLM_TEXT, "http://r0:8000", scraped_at=100.0)
    assert (e0.engine, e1.engine, e0.dialect, e0.model_name) == ("0", "1", "vllm", "Qwen/Qwen3-0.6B")
    assert (e0.running, e0.waiting, e0.kv_usage, e1.running, e1.kv_usage) == (3, 2, 0.25, 1, 0.5)
    assert (e0.prefix_queries, e0.prefix_hits, e0.hit_rate, e1.hit_rate) == (1000, 250, 0.25, 0.0)
    assert (e0.preemptions, e0.generation_tokens, e0.prompt_tokens) == (4, 5000, 9000)
    assert e0.ttft is not None and e0.ttft.count == 8 and e0.ttft.mean == pytest.approx(0.3)
    assert e0.ttft.quantile(0.5) == pytest.approx(0.1 + 0.4 * (4 - 2) / (6 - 2))  # inside the (0.1, 0.5] bucket
    assert e0.itl is not None and e0.itl.quantile(0.5) == pytest.approx(0.01)
    assert (e0.block_size, e0.num_gpu_blocks, e1.num_gpu_blocks) == (16, 27000, None)
    assert e1.ttft is None and e1.generation_tokens is None
    assert e1.raw["python_gc_objects_collected_total"] == 12  # an engine-less sample goes to every engine
    assert e0.raw["vllm:num_requests_running"] == 3


def test_sglang_metrics_and_our_own_dialect():
    (s,) = parse_metrics(SGLANG_TEXT, "http://sg:30000")
    assert (s.dialect, s.engine, s.running, s.waiting, s.kv_usage, s.hit_rate, s.gen_throughput) == (
        "sglang", "", 4, 1, 0.12, 0.5, 123.4)
    assert s.generation_tokens == 2000 and s.ttft is not None and s.ttft.quantile(0.5) == pytest.approx(0.1)
    assert s.itl is not None and s.itl.mean == pytest.approx(0.01)
    cbp = VLLM_TEXT.replace("vllm:", "cbp:").replace('engine="1",', 'engine="0",')
    cbp += 'cbp:num_requests_pending{model_name="m"} 2.0\n'
    (c,) = parse_metrics(cbp.replace('engine="0",', ""))
    assert (c.dialect, c.engine, c.pending, c.running) == ("cbp", "", 2, 4)
    both = parse_metrics(VLLM_TEXT + 'cbp:num_requests_pending{model_name="m"} 2.0\n')
    assert {e.dialect for e in both} == {"vllm"} and both[0].raw["cbp:num_requests_pending"] == 2
    assert parse_metrics("# nothing\nprocess_cpu_seconds_total 1.0\n") == []
    with pytest.raises(ValueError):
        parse_metrics("vllm:x{ 1\n")
    assert Histogram().quantile(0.5) is None and Histogram().mean is None
    assert metrics_url("http://h:8000/v1/") == "http://h:8000/metrics"


def test_scraper_rates_recent_histograms_and_errors():
    texts = [VLLM_TEXT, VLLM_TEXT.replace("5000.0", "5600.0").replace(
        f'le="0.1",{M}}} 2.0', f'le="0.1",{M}}} 4.0').replace(
        f'le="0.5",{M}}} 6.0', f'le="0.5",{M}}} 8.0').replace(
        f'le="+Inf",{M}}} 8.0', f'le="+Inf",{M}}} 10.0').replace(
        f'seconds_count{{engine="0",{M}}} 8.0', f'seconds_count{{engine="0",{M}}} 10.0')]

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "down":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, text=texts.pop(0) if len(texts) > 1 else texts[0])

    s = MetricsScraper(["http://up:8000", "http://down:8000"], transport=httpx.MockTransport(handler))
    first = s.scrape()
    assert first[1].engines == [] and "ConnectError" in (first[1].error or "")
    time.sleep(0.05)
    second = s.scrape()
    e0 = second[0].engines[0]
    assert e0.gen_throughput is not None and e0.gen_throughput > 0
    assert e0.ttft_recent is not None and e0.ttft_recent.count == 2 and e0.ttft_recent.quantile(0.5) <= 0.1
    assert len(s.engines()) == 2
    s.close()


def _stored(hashes, parent=None):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": list(range(16 * len(hashes))), "block_size": 16}


def test_kv_map_both_encodings_stored_again_chains_clear_and_bound():
    m = KVMap(max_blocks=5)
    m.apply(decode_batch(encode_batch([_stored([11, 12, 13])], ts=1.0, encoding="vllm")), "a")
    m.apply(decode_batch(encode_batch([_stored([14], parent=13), {"type": "BlockRemoved", "block_hashes": [12]}],
                                      ts=2.0, encoding="array")), "a")
    m.apply(decode_batch(encode_batch([_stored([12], parent=11)], ts=3.0)), "a")
    recs = {r.block_hash: r for r in m.records()}
    assert [recs[h].depth for h in (11, 12, 13, 14)] == [0, 1, 2, 3]
    assert (recs[12].store_count, recs[12].stored_again, recs[12].removed, recs[12].first_stored) == (2, 1, None, 1.0)
    assert m.block_size == 16 and m.summary()["live"] == 4 and m.summary()["stored_again"] == 1
    m.apply(decode_batch(encode_batch([{"type": "AllBlocksCleared"}], ts=4.0, data_parallel_rank=None)), "a")
    assert m.summary()["live"] == 0 and m.totals.cleared == 1
    m.apply(decode_batch(encode_batch([_stored([21, 22, 23])], ts=5.0, data_parallel_rank=1)), "a")
    assert len(m.blocks) == 5 and m.totals.dropped == 2  # the blocks removed longest ago went first
    assert {r.source for r in m.records()} == {"a", "a/dp1"}
    assert m.totals.stored == 8 and m.totals.removed == 5


def _serve_replay(router: zmq.Socket, buffer: dict[int, bytes], done: threading.Event) -> None:
    while not done.is_set():
        if not router.poll(50):
            continue
        ident, _, start = router.recv_multipart()
        first = int.from_bytes(start, "big")
        for seq in sorted(buffer):
            if seq >= first:
                router.send_multipart([ident, b"", seq.to_bytes(8, "big"), buffer[seq]])
        router.send_multipart([ident, b"", END_SEQ.to_bytes(8, "big", signed=True), b""])


@contextlib.contextmanager
def _publisher_with_replay(payloads: dict[int, bytes]):
    """A PUB socket and a ROUTER replay server answering from ``payloads`` (a thread), on loopback ports:
    yields ``(ctx, pub, pub_url, replay_url)``; everything is closed after."""
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    done = threading.Event()
    server = threading.Thread(target=_serve_replay, args=(router, payloads, done), daemon=True)
    server.start()
    try:
        yield ctx, pub, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"
    finally:
        done.set()
        server.join(2)
        pub.close(0)
        router.close(0)
        ctx.term()


def test_subscriber_fills_a_sequence_gap_from_the_replay_socket():
    payloads = {0: encode_batch([_stored([1, 2])], ts=1.0), 1: encode_batch([_stored([3], parent=2)], ts=2.0,
                                                                            encoding="array"),
                2: encode_batch([{"type": "BlockRemoved", "block_hashes": [1]}], ts=3.0),
                3: encode_batch([_stored([1])], ts=4.0)}
    m = KVMap()
    with _publisher_with_replay(payloads) as (ctx, pub, pub_url, replay_url):
        sub = KVSubscriber(pub_url, m, replay_url, topic="kv-events", catch_up=False, replay_timeout=30,
                           context=ctx).start()  # (this replay server holds seq 3 already)
        try:
            deadline = time.monotonic() + 30
            while m.totals.batches == 0:  # a SUB socket misses what was sent before it joined: resend seq 0
                assert time.monotonic() < deadline, "no KV batch received"
                pub.send_multipart([b"kv-events", (0).to_bytes(8, "big"), payloads[0]])
                pub.send_multipart([b"other-topic", (0).to_bytes(8, "big"), b"not msgpack"])
                time.sleep(0.05)
            pub.send_multipart([b"kv-events", (3).to_bytes(8, "big"), payloads[3]])  # 1 and 2 only in the replay
            while sub.last_seq != 3:
                assert time.monotonic() < deadline, f"stuck at seq {sub.last_seq} ({sub.error})"
                time.sleep(0.02)
        finally:
            sub.stop()
    t = m.totals
    assert (t.batches, t.gaps, t.replayed, t.lost, t.bad) == (4, 1, 2, 0, 0)
    recs = {r.block_hash: r for r in m.records()}
    assert recs[3].parent == 2 and recs[3].depth == 2
    assert recs[1].stored_again == 1 and recs[1].removed is None and recs[1].stored == 4.0
    assert not sub.alive and sub.error is None


def test_subscriber_joining_late_catches_up_from_the_replay_socket():
    payloads = {0: encode_batch([_stored([1, 2])], ts=1.0), 1: encode_batch([_stored([3], parent=2)], ts=2.0),
                2: encode_batch([{"type": "BlockRemoved", "block_hashes": [3]}], ts=3.0),
                3: encode_batch([_stored([4], parent=2)], ts=4.0)}
    m = KVMap()
    with _publisher_with_replay(payloads) as (ctx, pub, pub_url, replay_url):
        sub = KVSubscriber(pub_url, m, replay_url, replay_timeout=30, context=ctx).start()
        try:
            deadline = time.monotonic() + 30
            while sub.last_seq != 3:  # joined after seq 0..3 were published, the publisher idle since: the
                # catch-up at connect replays them all without waiting for a live message
                assert time.monotonic() < deadline, f"stuck at seq {sub.last_seq} ({sub.error})"
                time.sleep(0.05)
            for _ in range(5):  # a live copy of seq 3 (the SUB socket may still deliver it) is not applied twice
                pub.send_multipart([b"", (3).to_bytes(8, "big"), payloads[3]])
                time.sleep(0.05)
        finally:
            sub.stop()
    t = m.totals
    assert (t.batches, t.gaps, t.replayed, t.lost, t.stored, t.removed) == (4, 0, 4, 0, 4, 1)
    recs = {r.block_hash: r for r in m.records()}
    assert recs[4].depth == 2 and recs[4].rooted and recs[3].removed == 3.0


def _sse(*texts: str, finish: str = "stop") -> list[bytes]:
    import json

    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
    chunks += [{"choices": [{"index": 0, "delta": {"content": t}}]} for t in texts]
    chunks += [{"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
               {"choices": [], "usage": {"completion_tokens": len(texts)}}]
    return [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]


class FakeServer:
    """An OpenAI-compatible fake: ``/v1/models``, and chat streams of ``texts`` (``delay`` seconds apart)."""

    def __init__(self, texts=("Hel", "lo", "!"), delay: float = 0.0, status: int = 200) -> None:
        self.texts, self.delay, self.status = texts, delay, status
        self.bodies: list[dict] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        import json

        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake-model"}]})
        self.bodies.append(json.loads(request.content))
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "busy, retry"}})
        me = self

        async def stream():
            for chunk in _sse(*me.texts):
                await asyncio.sleep(me.delay)
                yield chunk

        return httpx.Response(200, content=stream(), headers={"x-served-by": "replica-7", "content-type": "text/event-stream"})


def test_client_streams_records_and_stop_closes_the_stream():
    async def run():
        fake = FakeServer()
        client = RemoteClient("http://fake:8000/v1", transport=httpx.MockTransport(fake))
        texts = [t async for t in client.stream_chat([{"role": "user", "content": "hi"}], max_tokens=8, seed=3,
                                                     extra={"ignore_eos": True})]
        assert texts == ["Hel", "lo", "!"] and client.model == "fake-model"
        assert fake.bodies[0]["stream"] is True and fake.bodies[0]["seed"] == 3 and fake.bodies[0]["ignore_eos"]
        (rec,) = client.log.records()
        assert (rec.status, rec.finish_reason, rec.replica, rec.chunks, rec.completion_tokens) == (
            "finished", "stop", "replica-7", 3, 3)
        assert rec.submitted <= rec.first_token <= rec.ended

        slow = FakeServer(texts=tuple("abcdefghij"), delay=0.05)
        client2 = RemoteClient("http://fake:8000", "m", transport=httpx.MockTransport(slow), log=RequestLog())
        agen = client2.stream_chat([{"role": "user", "content": "hi"}])
        assert await agen.__anext__() == "a"
        await agen.aclose()  # Stop: the stream is closed before its end
        (rec2,) = client2.log.records()
        assert rec2.status == "aborted" and rec2.ended is not None  # (a real server: tests/test_remote.py)

        busy = RemoteClient("http://fake:8000", "m", transport=httpx.MockTransport(FakeServer(status=429)))
        with pytest.raises(RemoteError, match="busy, retry") as err:
            async for _ in busy.stream_chat([{"role": "user", "content": "hi"}]):
                pass
        assert err.value.status == 429 and busy.log.records()[0].status == "error"

    asyncio.run(run())


def test_remote_options_repeat_split_and_read_the_environment():
    a = app.parse_args(["--backend-url", "http://a:8000", "--backend-url", "http://b:8000 http://c:8000",
                        "--kv-events-url", "tcp://a:5557"], env={"CBP_BACKEND_URL": "http://env:1"})
    assert app.split_urls(a.backend_url) == ["http://a:8000", "http://b:8000", "http://c:8000"]
    assert app.split_urls(a.kv_events_url) == ["tcp://a:5557"] and a.kv_events_topic == ""
    e = app.parse_args([], env={"CBP_BACKEND_URL": "http://x:1, http://y:2", "CBP_KV_EVENTS_TOPIC": "kv-events"})
    assert app.split_urls(e.backend_url) == ["http://x:1", "http://y:2"] and e.kv_events_topic == "kv-events"
    assert app.split_urls(app.parse_args([], env={}).backend_url) == []
    names = [o.name for o in (*app.UI_OPTIONS, *app.REMOTE_OPTIONS)]
    assert len(names) == len(set(names))


def test_page_builds_and_its_handlers_run_without_a_browser():
    import gradio as gr

    from tests.test_ui_handlers import req
    from ui.remote.page import build_remote_app

    async def until_final(h, session):
        deadline = time.monotonic() + 30
        while not json.loads(h.poll(session))["chat"]["final"]:
            assert time.monotonic() < deadline, h.poll(session)
            await asyncio.sleep(0.01)

    async def run():
        fake = FakeServer(texts=tuple("abcdefghijklmnop"), delay=0.02)
        client = RemoteClient("http://fake:8000", "m", transport=httpx.MockTransport(fake))
        scraper = MetricsScraper(["http://fake:8000"], transport=httpx.MockTransport(
            lambda r: httpx.Response(200, text=VLLM_TEXT)))
        demo = build_remote_app(client, scraper, refresh_s=1.0)
        assert isinstance(demo, gr.Blocks) and demo.cbp_router is not None and "live.js" in demo.cbp_head
        h, chat = demo.cbp_remote, demo.cbp_remote.chat
        shown, box, rid = await chat.start("hello", [], req("tab"), temperature=0.0, top_p=1.0, max_new_tokens=16)
        assert box == "" and shown == [{"role": "user", "content": "hello"}] and rid.startswith("chat-")
        await until_final(h, "tab")
        history, _send = chat.commit(req("tab"))
        assert history[-1] == {"role": "assistant", "content": "abcdefghijklmnop"}
        assert history[-2]["metadata"]["title"].startswith("✓ Finished: 16 tokens (stop)")  # the server's usage
        header, notice, counters, timeline, kv_fig, kv_md, load = await h.refresh()
        assert "model `m`" in header and notice["visible"] is False
        assert "Qwen/Qwen3-0.6B" not in counters and "27,000 x 16" in counters and "lag by seconds" in counters
        assert len(timeline.data[0].y) == 1 and "KV map off" in kv_md and kv_fig.layout.annotations
        assert "&quot;" not in kv_fig.layout.annotations[0].text and "<br>" in kv_fig.layout.annotations[0].text
        await chat.start("again", history, req("tab"), temperature=0.0, top_p=1.0, max_new_tokens=16)
        while not json.loads(h.poll("tab"))["chat"]["text"]:  # the first text
            await asyncio.sleep(0.01)
        await chat.stop(req("tab"))
        await until_final(h, "tab")
        stopped, _ = chat.commit(req("tab"))
        assert stopped[-2]["metadata"]["id"] == "cbp-stopped" and "[stopped]" not in stopped[-1]["content"]
        await asyncio.sleep(0.05)
        assert client.log.records()[-1].status == "aborted"
        assert (await chat.clear(req("tab")))[:2] == ([], "")
        assert (await h.start_load(3, 50)).startswith("run 1: 3 requested")
        deadline = time.monotonic() + 30
        while h.load.counts()["finished"] < 3:
            assert time.monotonic() < deadline, h.load.status()
            await asyncio.sleep(0.05)
        assert await h.stop_load() == "run 1: 3 requested · 0 queued · 0 decoding · 3 finished · 0 stopped · 0 failed"
        assert {r.source for r in client.log.records()} == {"chat", "load"}

    asyncio.run(run())


def test_a_vllm_metric_without_an_engine_label_makes_no_row_of_its_own():
    from ui.remote.metrics import parse_metrics

    text = ('# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            '# TYPE vllm:lora_requests_info gauge\nvllm:lora_requests_info{max_lora="0",model_name="m"} 1.0\n')
    rows = parse_metrics(text)
    assert [(r.engine, r.running) for r in rows] == [("0", 3.0)]


def test_hostile_kv_batches_and_stream_chunks_end_cleanly():
    """A malformed KV batch is refused whole (the subscriber counts it bad and goes on); a stream chunk not
    shaped as OpenAI's, or a 200 that is not an event stream, ends the chat with a RemoteError."""
    import asyncio

    import msgspec

    from engine.kv_wire import decode_batch
    from ui.remote.client import RemoteClient, RemoteError

    for bad in ([1.0, [{"type": "BlockStored", "block_hashes": ["abc"], "token_ids": [], "block_size": 16}]],
                [1.0, [{"type": "BlockStored", "block_hashes": [1], "medium": [1], "block_size": 16}]],
                [1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": [16]}]],
                [1.0, [{"type": "BlockRemoved", "block_hashes": [None]}]], [float("nan"), []],
                [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": {}, "block_size": 16}]]):
        with pytest.raises(ValueError):
            decode_batch(msgspec.msgpack.encode(bad))

    def answer(body: bytes, kind: str = "text/event-stream"):
        def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path.endswith("/models"):
                return httpx.Response(200, json={"data": [{"id": "m"}]})
            return httpx.Response(200, content=body, headers={"content-type": kind})
        return httpx.MockTransport(handler)

    async def run(transport) -> str:
        client = RemoteClient("http://x", transport=transport)
        out = ""
        async for t in client.stream_chat([{"role": "user", "content": "hi"}]):
            out += t
        return out

    for body in (b'data: {"choices": ["x"]}\n\n', b'data: {"choices": [{"delta": "x"}]}\n\n',
                 b'data: {"choices": [{"delta": {"content": 5}}]}\n\n', b'data: {"choices": {"a": 1}}\n\n'):
        with pytest.raises(RemoteError, match="shaped|not a list"):
            asyncio.run(run(answer(body)))
    with pytest.raises(RemoteError, match="text/event-stream"):
        asyncio.run(run(answer(b"<html>hi</html>", "text/html")))
    models_list = httpx.MockTransport(lambda r: httpx.Response(200, json=[{"id": "m"}]))
    with pytest.raises(RemoteError, match="lists no model"):
        asyncio.run(RemoteClient("http://x", transport=models_list).resolve_model())


def test_subscriber_outlives_a_hostile_batch():
    import msgspec

    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    m = KVMap()
    sub = KVSubscriber(f"tcp://127.0.0.1:{port}", m, context=ctx).start()
    bad = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "medium": [1],
                                         "block_size": 16}]])
    try:
        deadline = time.monotonic() + 30
        seq = 0
        # (both: the SUB socket may join between the two sends of a round and get the good one alone)
        while m.totals.batches == 0 or m.totals.bad == 0:
            assert time.monotonic() < deadline, f"no KV batch applied: {m.totals}"
            pub.send_multipart([b"", seq.to_bytes(8, "big"), bad])
            pub.send_multipart([b"", (seq + 1).to_bytes(8, "big"), encode_batch([_stored([7])], ts=1.0)])
            seq += 2
            time.sleep(0.05)
        assert sub.alive and m.totals.bad >= 1
        assert {r.block_hash for r in m.records()} == {7}
    finally:
        sub.stop()
        pub.close(0)
        ctx.term()


def test_a_trickling_metrics_server_gets_an_error_row_in_bounded_time():
    from ui.remote.metrics import MetricsScraper

    def trickle():
        for _ in range(20):
            time.sleep(0.2)
            yield b"# a byte at a time\n"

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "slow":
            return httpx.Response(200, content=trickle())
        return httpx.Response(200, text=VLLM_TEXT)

    scraper = MetricsScraper(["http://slow:1", "http://fast:1"], timeout=1.0, transport=httpx.MockTransport(handler))
    t0 = time.monotonic()
    slow, fast = scraper.scrape()
    assert time.monotonic() - t0 < 3.0
    assert "took over" in (slow.error or "") and not slow.engines
    assert fast.error is None and fast.engines


def test_a_restarted_publishers_old_blocks_are_marked_removed():
    m = KVMap()
    m.apply(decode_batch(encode_batch([_stored([1, 2])], ts=1.0, data_parallel_rank=0)), "kv")
    m.apply(decode_batch(encode_batch([_stored([9])], ts=1.0)), "other")
    assert m.forget_source("kv", 2.0) == 2
    live = {r.block_hash for r in m.records() if r.removed is None}
    assert live == {9} and m.totals.removed == 2

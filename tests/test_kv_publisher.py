"""Our engine publishes its KV cache events as vLLM does (ZMQ PUB + ROUTER replay, msgpack batches) and its
metrics under vLLM's names: a subscriber written for vLLM follows our engine unchanged."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.kv_events import BlockStored as OurStored
from engine.kv_wire import decode_batch, encode_batch, external_hash
from engine.request import SamplingParams
from server.kv_publisher import END_SEQ, KVEventPublisher, offset_port, parse_kv_events_config

ON = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:%d", ' \
     '"replay_endpoint": "tcp://*:%d", "topic": "kv-events"%s}'


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


# vLLM's example subscriber's types (examples/online_serving/kv_events_subscriber.py): everything positional
class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_Event):
    pass


class ExampleBatch(_Batch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def test_config_parses_vllms_json_and_refuses_what_it_does_not_know():
    assert parse_kv_events_config(None) is None and parse_kv_events_config("  ") is None
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                                 '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}')
    assert cfg.enabled and cfg.endpoint == "tcp://*:5557" and cfg.buffer_steps == 10_000 and cfg.encoding == "vllm"
    assert not parse_kv_events_config('{"enable_kv_cache_events": false}').enabled
    assert not parse_kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}').enabled
    for bad in ("[1]", "{", '{"endpoint": 5}', '{"nope": 1}', '{"publisher": "kafka"}', '{"encoding": "json"}',
                '{"buffer_steps": 0}', '{"hwm": true}'):
        with pytest.raises(ValueError):
            parse_kv_events_config(bad)
    assert offset_port("tcp://*:5557", 2) == "tcp://*:5559" and offset_port("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_port("tcp://*:5557", 0) == "tcp://*:5557"


def test_wire_encodings_round_trip_and_the_array_one_reads_with_vllms_example_types():
    events = [{"type": "BlockStored", "block_hashes": [b"\x01" * 32, b"\x02" * 32], "parent_block_hash": None,
               "token_ids": list(range(32)), "block_size": 16},
              {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32]}, {"type": "AllBlocksCleared"}]
    for encoding in ("vllm", "array"):
        batch = decode_batch(encode_batch(events, 12.5, 0, encoding=encoding))
        assert batch.ts == 12.5 and batch.data_parallel_rank == 0
        assert [e.type for e in batch.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
        assert batch.events[0].block_hashes == [external_hash(b"\x01" * 32), external_hash(b"\x02" * 32)]
        assert batch.events[0].token_ids == list(range(32)) and batch.events[0].block_size == 16
    example = msgspec.msgpack.Decoder(type=ExampleBatch).decode(encode_batch(events, 1.0, encoding="array"))
    assert isinstance(example.events[0], BlockStored) and example.events[0].block_hashes[1] == external_hash(b"\x02" * 32)
    # the newest sources' map-shaped batch decodes too
    assert decode_batch(msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "AllBlocksCleared"}]})).events
    for bad in (b"\xc1", msgspec.msgpack.encode(5), msgspec.msgpack.encode([1.0, [7]])):
        with pytest.raises(ValueError):
            decode_batch(bad)


def recv_all(sub: zmq.Socket, timeout_ms: int = 2000, until: int | None = None) -> list[tuple[bytes, int, bytes]]:
    """What arrives until ``timeout_ms`` passes without a message (200 ms after the first one); with ``until``, until
    the message numbered ``until - 1`` arrived (30 s at most between two: a loaded machine may deliver late)."""
    out = []
    if until is not None:
        timeout_ms = 30_000
    while sub.poll(timeout_ms):
        topic, seq, payload = sub.recv_multipart()
        out.append((topic, int.from_bytes(seq, "big"), payload))
        if until is not None and out[-1][1] >= until - 1:
            break
        timeout_ms = 200 if until is None else 30_000
    return out


@pytest.mark.parametrize("encoding", ["vllm", "array"])
def test_a_subscriber_follows_the_engines_prefix_cache_and_replays_what_it_missed(tiny_model, tokenizer, encoding):
    core = EngineCore(EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4), model=tiny_model,
                      tokenizer=tokenizer)
    pub_port, replay_port = free_ports(2)
    extra = f', "encoding": "{encoding}"'
    publisher = KVEventPublisher(core.telemetry, 16, parse_kv_events_config(ON % (pub_port, replay_port, extra)))
    publisher.start(background=False)  # this test runs its rounds
    assert publisher.poll_once() == 0  # before the first step: nothing yet (the server's thread starts here too)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    try:
        # the SUB connection is up (however slowly a loaded machine made it); the sleep below lets the
        # subscription itself reach the PUB socket
        assert monitor.poll(30_000), "the SUB socket did not connect"
        sub.disable_monitor()
        monitor.close(linger=0)
        ours: list = []
        prompt = list(range(5, 5 + 50))  # 3 full blocks of 16
        for rid in ("a", "b"):  # b hits a's cached prefix: nothing new is stored for it
            core.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
            while core.has_unfinished_requests():
                core.step()
                ours.extend(e for e in core.telemetry.latest().kv_events if isinstance(e, OurStored))
        time.sleep(1.0)  # the slow-joiner: the SUB connection settles before the first batch goes out
        assert publisher.poll_once() >= 1
        got = recv_all(sub, until=publisher.seq)
        assert got and all(t == b"kv-events" for t, _, _ in got)
        assert [s for _, s, _ in got] == list(range(len(got)))
        events = [e for _, _, p in got for e in decode_batch(p).events]
        stored = [h for e in events if e.type == "BlockStored" for h in e.block_hashes]
        assert stored == [external_hash(e.block_hash) for e in ours] and len(stored) >= 3
        first = next(e for e in events if e.type == "BlockStored")
        assert first.parent_block_hash is None and first.block_size == 16 and first.token_ids[:16] == prompt[:16]
        if encoding == "array":  # vLLM's example subscriber reads every batch
            for _, _, p in got:
                msgspec.msgpack.Decoder(type=ExampleBatch).decode(p)
        # a reset of the prefix cache is published as the removal of every free cached block
        core.kv.pool.reset_prefix_cache()
        core.add_request("c", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=1))
        while core.has_unfinished_requests():
            core.step()
        publisher.poll_once()
        later_msgs = recv_all(sub, until=publisher.seq)
        later = [e for _, _, p in later_msgs for e in decode_batch(p).events]
        removed = {h for e in later if e.type == "BlockRemoved" for h in e.block_hashes}
        assert set(stored) <= removed
        # replay from sequence 1 (vLLM's ROUTER protocol: [start seq] -> [seq, payload]..., then [-1, b""])
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        deadline = time.monotonic() + 30
        while not dealer.poll(50) and time.monotonic() < deadline:
            publisher.serve_replay()
        replayed = []
        while dealer.poll(30_000):  # (it ends at the end marker)
            frames = dealer.recv_multipart()
            # vLLM 0.32's framing carries the topic (empty on the end marker); the older one does not
            assert len(frames) == (4 if encoding == "vllm" else 3) and frames[0] == b""
            if encoding == "vllm":
                assert frames[1] == (b"" if frames[2] == END_SEQ else b"kv-events")
            seq, payload = frames[-2:]
            if seq == END_SEQ:
                assert payload == b""
                break
            replayed.append((int.from_bytes(seq, "big"), payload))
        assert replayed == [(s, p) for _, s, p in (got + later_msgs)[1:]]
        assert [s for s, _ in replayed] == list(range(1, publisher.seq))
        dealer.close(linger=0)
    finally:
        sub.close(linger=0)
        publisher.stop()


def test_the_server_publishes_with_the_flag_and_speaks_vllms_metric_names(tiny_model, tokenizer):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from engine.async_engine import AsyncEngine
    from server.app import build_server
    from server.serving import ServerThread

    engine = AsyncEngine(EngineCore(EngineConfig(num_blocks=64, block_size=16, max_num_seqs=4, telemetry_capacity=16),
                                    model=tiny_model, tokenizer=tokenizer))
    pub_port, replay_port = free_ports(2)
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        app = build_server(engine, None, "tiny", kv_events_config=ON % (pub_port, replay_port, ""))
        assert app.state.kv_publisher is not None and app.state.kv_publisher.endpoint.endswith(str(pub_port))
        sub.connect(f"tcp://127.0.0.1:{pub_port}")
        sub.setsockopt_string(zmq.SUBSCRIBE, "")
        with ServerThread(app) as srv:
            body = {"model": "tiny", "prompt": " ".join(["hello world"] * 30), "max_tokens": 12, "ignore_eos": True}
            for _ in range(2):
                assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).status_code == 200
            events = [e for _, _, p in recv_all(sub, 30_000) for e in decode_batch(p).events]
            assert any(e.type == "BlockStored" for e in events)
            fams = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                     "vllm:generation_tokens", "vllm:prompt_tokens", "vllm:time_to_first_token_seconds",
                     "vllm:inter_token_latency_seconds", "vllm:iteration_tokens_total", "vllm:cache_config_info",
                     "vllm:request_success", "cbp:num_requests_running", "cbp:api_rejected_requests"):
            assert name in fams, name
        running = fams["vllm:num_requests_running"].samples[0]
        assert running.labels == {"model_name": "tiny", "engine": "0"}
        info = fams["vllm:cache_config_info"].samples[0].labels
        assert info["block_size"] == "16" and info["num_gpu_blocks"] == "64"
        hits = sum(s.value for s in fams["vllm:prefix_cache_hits"].samples if s.name.endswith("_total"))
        assert hits > 0  # the second request found the first one's prefix
        steps = [s for s in fams["vllm:iteration_tokens_total"].samples if s.name.endswith("_count")]
        assert steps[0].value == engine.telemetry.total_steps > engine.config.telemetry_capacity  # every step
        gen = [s for s in fams["vllm:generation_tokens"].samples if s.name.endswith("_total")]
        assert gen[0].value == 24
        assert fams["vllm:request_success"].samples[0].labels["engine"] == "0"
    finally:
        sub.close(linger=0)
        if getattr(app.state, "kv_publisher", None):
            app.state.kv_publisher.stop()
        engine.shutdown()


def test_metrics_observe_each_finished_request_once_even_past_the_ring():
    """More requests finish between two scrapes than the finished-request ring keeps: the histograms count every
    one of them once (they are counted as they finish, not read back from the ring), the requests finished
    before the metrics existed included."""
    from engine.telemetry import FinishedRequestStats, Telemetry
    from server.metrics import EngineMetrics

    class FakeEngine:
        telemetry = Telemetry(max_finished=4)
        config = EngineConfig(num_blocks=8, block_size=16)
        num_pending, is_running = 0, True

        def on_finished(self, listener):
            return self.telemetry.on_finished(listener)

    def finish(n):
        for _ in range(n):
            FakeEngine.telemetry.record_finished(FinishedRequestStats("r", 0.1, 0.01, 0.5, 3, 2, "stop"))

    finish(2)  # before the metrics: read back from the ring once
    metrics = EngineMetrics(FakeEngine(), "m")  # type: ignore[arg-type]

    def count():
        metrics.render()
        return metrics.registry.get_sample_value("cbp:e2e_request_latency_seconds_count", {"model_name": "m"})

    assert count() == 2
    finish(10)
    assert count() == 12  # the ring keeps 4 of the 10
    assert count() == 12
    finish(3)
    assert count() == 15
    assert metrics.registry.get_sample_value("vllm:e2e_request_latency_seconds_count",
                                             {"model_name": "m", "engine": "0"}) == 15
    assert metrics.registry.get_sample_value("vllm:inter_token_latency_seconds_count",
                                             {"model_name": "m", "engine": "0"}) == 15  # 2 tokens: one gap each

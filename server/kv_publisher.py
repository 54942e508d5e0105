"""The engine's KV cache events published as vLLM publishes them: ZMQ PUB + ROUTER replay, msgpack batches.

Opt-in with vLLM's own flag and JSON, ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'`` (or
``CBP_KV_EVENTS_CONFIG``), so subscribers written for vLLM (its example subscriber, KV-aware routers such as
llm-d's KV cache manager or NVIDIA Dynamo's KV router) follow our engine unchanged.

Wire (as vLLM's ``vllm/distributed/kv_events.py``): each message is ``[topic, sequence number (8 bytes,
big-endian, from 0), payload]``; the payload one event batch per engine step that changed the prefix cache
(:mod:`engine.kv_wire`). The ROUTER replay socket answers a request ``[b"", start sequence number]`` (a REQ
socket's framing; a DEALER sends the empty frame itself) with every kept batch from there, ``[b"", topic, seq,
payload]`` each, then ``[b"", b"", -1, b""]`` (vLLM 0.32; with the ``"array"`` encoding, as vLLM's earlier
releases, without the topic frames). An endpoint with ``*``, ``::``, ``ipc://`` or ``inproc://``
is bound, any other connected (vLLM's rule); a data-parallel rank adds itself to the TCP ports.

The events come from :meth:`engine.telemetry.Telemetry.kv_feed` (what the local panels replay), mapped by
:func:`engine.kv_events.to_vllm_events`: only full blocks that enter the prefix cache (``BlockStored``), leave it
(``BlockRemoved``) or are all forgotten (``AllBlocksCleared``), by content hash; no physical block ids and no
request ids, as in vLLM. Only with prefix caching on (without it nothing is ever stored).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

import zmq

from engine import ENCODINGS, KVFeed, encode_batch, to_vllm_events

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields (same names, same defaults), plus ``encoding`` and ``poll_interval``.

    Attributes:
        enable_kv_cache_events: publish at all.
        publisher: ``"zmq"`` or ``"null"`` (default: ``"zmq"`` when enabled).
        endpoint: the PUB address (``tcp://*:5557``: bind on every interface).
        replay_endpoint: the ROUTER replay address (None: no replay).
        buffer_steps: batches kept for replay.
        hwm: ZMQ high-water mark of the PUB socket (messages).
        max_queue_size: accepted for vLLM's JSON; unused (the thread reads the engine's feed: nothing queues).
        topic: the first frame of every message.
        data_parallel_rank: the rank sent in every batch and added to the TCP ports (0 here: one engine).
        encoding: ``"vllm"`` (vLLM 0.11-0.32: batch array, events tagged maps) or ``"array"`` (earlier releases
            and vLLM's example subscriber: everything positional); see :mod:`engine.kv_wire`.
        poll_interval: seconds between two reads of the engine's KV feed.
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    data_parallel_rank: int = 0
    encoding: str = "vllm"
    poll_interval: float = 0.02

    @property
    def enabled(self) -> bool:
        """Whether events are published (enabled and a ``zmq`` publisher)."""
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"


def parse_kv_events_config(text: str | None) -> KVEventsConfig | None:
    """``--kv-events-config`` / ``CBP_KV_EVENTS_CONFIG``: vLLM's JSON object (None or empty: off).

    Raises:
        ValueError: not a JSON object, an unknown field, a value of the wrong type, or an unknown publisher or
            encoding.
    """
    if text is None or not str(text).strip():
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object")
    known = {f.name: f for f in fields(KVEventsConfig)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)} (known: {', '.join(known)})")
    types: dict[str, Any] = {"enable_kv_cache_events": bool, "publisher": (str, type(None)), "endpoint": str,
             "replay_endpoint": (str, type(None)), "buffer_steps": int, "hwm": int, "max_queue_size": int,
             "topic": str, "data_parallel_rank": int, "encoding": str, "poll_interval": (int, float)}
    for name, value in raw.items():
        want = types[name]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ValueError(f"--kv-events-config: {name} has the wrong type ({type(value).__name__})")
    cfg = KVEventsConfig(**raw)
    if cfg.publisher not in (None, "zmq", "null"):
        raise ValueError(f"--kv-events-config: publisher must be 'zmq' or 'null', not {cfg.publisher!r}")
    if cfg.encoding not in ENCODINGS:
        raise ValueError(f"--kv-events-config: encoding must be one of {', '.join(ENCODINGS)}")
    if not all(1 <= v <= 1 << 31 for v in (cfg.buffer_steps, cfg.hwm, cfg.max_queue_size)) \
            or not 0 <= cfg.data_parallel_rank < 1024 or not 0 < cfg.poll_interval <= 10:
        raise ValueError("--kv-events-config: buffer_steps, hwm and max_queue_size must be in [1, 2**31], "
                         "data_parallel_rank in [0, 1024), poll_interval in (0, 10] seconds")
    for name in ("endpoint", "replay_endpoint"):
        value = offset_port(getattr(cfg, name), cfg.data_parallel_rank)
        if value and value.startswith("tcp://"):
            port = value.rsplit(":", 1)[-1]
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--kv-events-config: {name} {value!r} has no TCP port in 1-65535")
    return cfg


def offset_port(endpoint: str | None, rank: int) -> str | None:
    """``endpoint`` with ``rank`` added to its TCP port (``inproc://x`` gets ``_dp<rank>``), as vLLM does for
    data-parallel ranks; unchanged for rank 0."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://") and ":" in endpoint[6:]:
        host, port = endpoint.rsplit(":", 1)
        return f"{host}:{int(port) + rank}"
    return endpoint


def binds(endpoint: str) -> bool:
    """Whether the publisher binds ``endpoint`` (``*``, ``::``, ``ipc://``, ``inproc://``) or connects to it (vLLM's
    rule)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Follows one engine's KV feed in a thread and publishes it in vLLM's wire format.

    Args:
        telemetry: the engine's :class:`engine.telemetry.Telemetry` (read through ``kv_feed`` only), or a
            callable that returns the engine's current one (``lambda: engine.telemetry``): an engine reconfigured
            with a new pool (the talk preset) starts a new telemetry, and the publisher goes on with it, its
            first batch an ``AllBlocksCleared`` (the new pool holds nothing).
        block_size: tokens per block (the events' ``block_size``).
        config: an enabled :class:`KVEventsConfig`.
        context: a ZMQ context (default: the process's shared one).

    Attributes:
        sent: batches published so far; ``seq`` the next sequence number.
        resyncs: times the publisher fell behind the telemetry ring and events were lost (logged).

    Raises:
        zmq.ZMQError: an endpoint cannot be bound or connected (:meth:`start`).
    """

    def __init__(self, telemetry, block_size: int, config: KVEventsConfig, context: zmq.Context | None = None):
        self._source = telemetry if callable(telemetry) else (lambda: telemetry)
        self.telemetry = self._source()
        self.block_size = block_size
        self.config = config
        self.ctx = context or zmq.Context.instance()
        self.endpoint = offset_port(config.endpoint, config.data_parallel_rank)
        self.replay_endpoint = offset_port(config.replay_endpoint, config.data_parallel_rank)
        self.topic = config.topic.encode()
        self.seq = 0
        self.sent = 0
        self.resyncs = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cursor: tuple[int, int] | None = None
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None

    def start(self, background: bool = True) -> KVEventPublisher:
        """Open the sockets and, with ``background``, start the thread (else the caller runs :meth:`poll_once`
        and :meth:`serve_replay`); returns self."""
        pub = self.ctx.socket(zmq.PUB)
        pub.set_hwm(self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        assert self.endpoint is not None
        try:
            (pub.bind if binds(self.endpoint) else pub.connect)(self.endpoint)
            if self.replay_endpoint:
                replay = self.ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                try:
                    replay.bind(self.replay_endpoint)
                except zmq.ZMQError:
                    replay.close(linger=0)
                    raise
                self._replay = replay
        except zmq.ZMQError:
            pub.close(linger=0)  # nothing stays bound by a publisher that did not start
            raise
        self._pub = pub
        if background:
            self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread and close the sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)

    def payloads(self, feed: KVFeed) -> list[bytes]:
        """The batches of one feed: one per step with vLLM-visible events (a first frame of an empty cache
        becomes ``AllBlocksCleared``)."""
        cfg, rank, out = self.config, self.config.data_parallel_rank, []
        if feed.frame is not None:
            if self._cursor is not None or feed.frame.hashed_blocks:
                # fell behind the ring (or started late): what was stored meanwhile is unknown to subscribers
                self.resyncs += 1
                log.warning("KV event publisher fell behind the engine by more than the telemetry keeps: "
                            "subscribers miss some stored/removed blocks")
            events = to_vllm_events([feed.frame], self.block_size)
            if events:
                out.append(encode_batch(events, time.time(), rank, encoding=cfg.encoding))
        for step in feed.steps:
            events = to_vllm_events(step.events, self.block_size)
            if events:
                out.append(encode_batch(events, time.time(), rank, encoding=cfg.encoding))
        self._cursor = feed.cursor
        return out

    def poll_once(self) -> int:
        """Read the feed once and publish what it gives (the thread's loop body); returns batches sent."""
        n = 0
        current = self._source()
        if current is not self.telemetry:  # a new pool: the old telemetry's last events, then the new one's
            n += self._publish(self.telemetry.kv_feed(self._cursor))
            self.telemetry, self._cursor = current, (0, 0)  # from its first step (the empty pool)
        return n + self._publish(self.telemetry.kv_feed(self._cursor))

    def _publish(self, feed: KVFeed) -> int:
        n = 0
        for payload in self.payloads(feed):
            self._send(payload)
            n += 1
        return n

    def _send(self, payload: bytes) -> None:
        assert self._pub is not None
        seq = self.seq
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.seq += 1
        self.sent += 1

    def serve_replay(self, most: int = 4) -> None:
        """Answer at most ``most`` replay requests waiting on the ROUTER socket (none without a replay endpoint);
        the rest wait for the next round, so a flood of requests cannot hold back the live events."""
        if self._replay is None:
            return
        for _ in range(most):
            if not self._replay.poll(0):
                break
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV event replay: a request of %d frames ignored", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            # vLLM 0.32 puts the topic before each replayed [seq, payload] (an empty one before the end
            # marker); its earlier releases, whose all-positional encoding "array" is, sent none
            topic = (self.topic,) if self.config.encoding == "vllm" else ()
            end_topic = (b"",) if topic else ()
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", *topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", *end_topic, END_SEQ, b""))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.serve_replay()
                self.poll_once()
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                log.warning("KV event publisher: %s", exc)
            except Exception:  # never take the server down for telemetry
                log.exception("KV event publisher failed a round")
            self._stop.wait(self.config.poll_interval)

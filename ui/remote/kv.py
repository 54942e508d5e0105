"""Remote mode: a map of the KV cache blocks a vLLM-style server publishes as KV cache events over ZMQ.

The publisher (vLLM's ``--kv-events-config``, or this project's server) sends multipart messages
``[topic, sequence number (8 bytes, big-endian), msgpack payload]`` on a PUB socket; an optional ROUTER socket
replays buffered ones: asked ``[b"", start sequence (8 bytes)]`` it answers ``[b"", seq, payload]`` messages and
ends with seq = -1 (8 bytes, signed) and an empty payload. :class:`KVSubscriber` (a thread) subscribes, asks the
replay for the messages of a sequence gap, decodes each payload with :func:`engine.kv_wire.decode_batch` and feeds
:class:`KVMap`, which keeps per block hash: when it was stored and removed, its parent (the prefix chain), how
many times it was stored and whether it was stored again after a removal.

What the events cannot say: vLLM publishes only full blocks, only with prefix caching on, and names a block by
its content hash: physical block ids, which request stored or uses a block, and partial blocks are not sent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import zmq

from engine import WireBatch, decode_batch

log = logging.getLogger(__name__)

END_SEQ = -1
REPLAY_BACKOFF_S = 30.0  # after a replay request went unanswered, gaps count as lost for this long
MAX_SOURCES = 256  # publishers (and ranks) named in the caption
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # larger KV event messages are refused by the SUB socket
NOT_EXPOSED = ("vLLM's KV events name blocks by content hash only: physical block ids, request ids and partial "
               "blocks are not exposed (and only full blocks are published, with prefix caching on)")


@dataclass
class BlockRecord:
    """One block hash as the events told it (times: the publisher's batch ``ts``, seconds since the epoch).

    Attributes:
        block_hash: the hash (int, low 64 bits of the block's sha256 in vLLM).
        source: who published it (the subscriber's label, plus ``/dp<rank>`` when the batch had a rank).
        medium: the tier (``"GPU"``, ``"CPU"``...; None when not said).
        parent: the hash of the block before it in its prefix chain (None: a first block, or not said).
        first_stored: the first time it was stored.
        stored: the latest time it was stored.
        removed: when it was removed (None while stored).
        store_count: times stored (2 or more: stored again).
        stored_again: times stored again after a removal (the same content cached a second time).
        depth: its position in its prefix chain as far as seen (0: a first block, or its parent was never seen).
        rooted: whether the chain back to a first block (parent None) was seen; False when it began before the
            subscriber joined (or its start was forgotten).
    """

    block_hash: int
    source: str
    medium: str | None
    parent: int | None
    first_stored: float
    stored: float
    removed: float | None = None
    store_count: int = 1
    stored_again: int = 0
    depth: int = 0
    rooted: bool = True

    @property
    def live(self) -> bool:
        """Stored and not removed since."""
        return self.removed is None


@dataclass
class KVTotals:
    """Counts since the map started: batches and events applied; block hashes stored, removed (as the events
    said, also those whose store came before the subscriber joined) and stored again after a removal; caches
    cleared; sequence gaps seen; messages replayed (gaps and the catch-up at joining) and lost (gaps the replay
    did not fill); hashes dropped from memory (oldest removed first); undecodable payloads; publisher restarts
    (the sequence went back)."""

    batches: int = 0
    events: int = 0
    stored: int = 0
    removed: int = 0
    stored_again: int = 0
    cleared: int = 0
    gaps: int = 0
    replayed: int = 0
    lost: int = 0
    dropped: int = 0
    bad: int = 0
    restarts: int = 0


class KVMap:
    """Per-hash block state from KV event batches; bounded: past ``max_blocks`` hashes, the ones removed
    longest ago are forgotten first (then the oldest stored). Thread-safe.

    Args:
        max_blocks: most hashes kept.
        max_log: most ``(ts, source, stored, removed, stored_again)`` batch lines kept for the rate view.
    """

    def __init__(self, max_blocks: int = 20000, max_log: int = 5000) -> None:
        self.max_blocks = max_blocks
        self.blocks: OrderedDict[tuple[str, str | None, int], BlockRecord] = OrderedDict()  # by first store
        self._removed: OrderedDict[tuple[str, str | None, int], None] = OrderedDict()  # by removal time
        self.totals = KVTotals()
        self.batch_log: deque[tuple[float, str, int, int, int]] = deque(maxlen=max_log)
        self.sources: dict[str, float] = {}  # source -> time of its last batch
        self.block_size: int | None = None
        self._lock = threading.Lock()

    def apply(self, batch: WireBatch, source: str = "") -> None:
        """Apply one decoded batch published by ``source`` (the rank of the batch is appended to it)."""
        src = source if batch.data_parallel_rank is None else f"{source}/dp{batch.data_parallel_rank}"
        ts = batch.ts
        stored = removed = again = 0
        with self._lock:
            self.totals.batches += 1
            self.sources[src] = ts
            for ev in batch.events:
                self.totals.events += 1
                if ev.type == "BlockStored":
                    if ev.block_size:
                        self.block_size = ev.block_size
                    parent = _as_int(ev.parent_block_hash)
                    for h in ev.block_hashes:
                        again += self._store(src, ev.medium, _hash(h), parent, ts)
                        stored += 1
                        parent = _hash(h)
                        if len(self.blocks) > self.max_blocks:  # bounded within a batch too
                            self._bound()
                elif ev.type == "BlockRemoved":
                    for h in ev.block_hashes:  # counted even when its store was not seen (before joining)
                        self._remove((src, ev.medium, _hash(h)), ts)
                        removed += 1
                elif ev.type == "AllBlocksCleared":
                    self.totals.cleared += 1
                    for key, rec in self.blocks.items():
                        if key[0] == src and rec.removed is None:
                            removed += self._remove(key, ts)
            self.totals.stored += stored
            self.totals.removed += removed
            self.totals.stored_again += again
            self.batch_log.append((ts, src, stored, removed, again))
            self._bound()
            while len(self.sources) > MAX_SOURCES:  # a rank that changes every batch: keep the newest
                self.sources.pop(next(iter(self.sources)))

    def forget_source(self, source: str, ts: float) -> int:
        """Mark every live block of ``source`` (and of its ranks, ``source/dp<r>``) removed at ``ts``: its
        publisher restarted, so its cache starts empty (vLLM sends no ``AllBlocksCleared`` at start). Returns
        the blocks marked."""
        with self._lock:
            keys = [k for k, r in self.blocks.items() if r.removed is None
                    and (k[0] == source or k[0].startswith(source + "/dp"))]
            n = sum(self._remove(k, ts) for k in keys)
            self.totals.removed += n
            return n

    def _store(self, src: str, medium: str | None, h: int, parent: int | None, ts: float) -> int:
        key = (src, medium, h)
        rec = self.blocks.get(key)
        if rec is None:
            up = self.blocks.get((src, medium, parent)) if parent is not None else None
            depth, rooted = (0, parent is None) if up is None else (up.depth + 1, up.rooted)
            self.blocks[key] = BlockRecord(h, src, medium, parent, ts, ts, depth=depth, rooted=rooted)
            return 0
        rec.store_count += 1
        rec.stored = ts
        if parent is not None:
            rec.parent = parent
        if rec.removed is None:
            return 0
        rec.removed = None
        rec.stored_again += 1
        self._removed.pop(key, None)
        return 1

    def _remove(self, key: tuple[str, str | None, int], ts: float) -> int:
        rec = self.blocks.get(key)
        if rec is None or rec.removed is not None:
            return 0
        rec.removed = ts
        self._removed[key] = None
        return 1

    def _bound(self) -> None:
        while len(self.blocks) > self.max_blocks:
            if self._removed:
                key, _ = self._removed.popitem(last=False)
                del self.blocks[key]
            else:
                self.blocks.popitem(last=False)
            self.totals.dropped += 1

    def records(self) -> list[BlockRecord]:
        """Copies of the block records, oldest first store first."""
        with self._lock:
            return [BlockRecord(**vars(r)) for r in self.blocks.values()]

    def summary(self) -> dict[str, int]:
        """Counts now: ``live`` blocks, ``removed`` ones still remembered, ``stored_again`` (hashes stored
        again after a removal at least once), ``chains`` (live first blocks: depth 0), plus :class:`KVTotals`
        as ``total_*``."""
        with self._lock:
            recs = list(self.blocks.values())
            totals = dict(vars(self.totals))
        out = {"live": sum(1 for r in recs if r.removed is None), "removed": sum(1 for r in recs if r.removed),
               "stored_again": sum(1 for r in recs if r.stored_again), "chains": sum(
                   1 for r in recs if r.removed is None and r.depth == 0)}
        out.update({f"total_{k}": v for k, v in totals.items()})
        return out


def _hash(h: int | bytes) -> int:
    """A block hash as an int (bytes: their low 64 bits, as vLLM's int hashes)."""
    if isinstance(h, (bytes, bytearray)):
        return int.from_bytes(bytes(h)[-8:], "big")
    return int(h)


def _as_int(h: int | bytes | None) -> int | None:
    return None if h is None else _hash(h)


class KVSubscriber:
    """A thread subscribed to one publisher's KV events, feeding a :class:`KVMap`.

    Args:
        endpoint: the publisher's PUB address to connect to (``tcp://host:5557``).
        kv_map: the map to feed (shared by several subscribers: one per replica or rank).
        replay_endpoint: its ROUTER replay address (``tcp://host:5558``), or None: gaps are counted as lost.
        topic: topic prefix to subscribe to ("" = every topic; vLLM's examples publish ``"kv-events"``).
        label: the source name in the map (default: ``endpoint``).
        replay_timeout: seconds to wait for a replay to end.
        catch_up: at connect (and, if that found nothing, at the first message), ask the replay for every
            earlier message it still keeps (the blocks stored before this subscriber joined), so an idle
            deployment's cache shows at once; needs ``replay_endpoint``.
        context: a ``zmq.Context`` (default: the process's shared instance).

    Attributes:
        last_seq: the last sequence number applied (-1 before the first message).
        error: the last error in the thread (one line), None when none.
        started_at: when the thread was started (``time.time()`` seconds; None before).
        last_message_at: when the latest message came, live or replayed (``time.time()``; None: none yet).
    """

    def __init__(self, endpoint: str, kv_map: KVMap, replay_endpoint: str | None = None, topic: str = "",
                 label: str | None = None, replay_timeout: float = 2.0, catch_up: bool = True,
                 context: zmq.Context | None = None) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint or None
        self.topic = topic
        self.label = label or endpoint
        self.kv_map = kv_map
        self.replay_timeout = replay_timeout
        self.catch_up = catch_up
        self.last_seq = -1
        self._skip_upto: int | None = None  # live messages the catch-up at connect already applied
        self._skip_until = 0.0
        self._replay_off_until = 0.0  # no replay request before this (monotonic seconds): it did not answer
        self.error: str | None = None
        self.started_at: float | None = None
        self.last_message_at: float | None = None
        self._ctx = context or zmq.Context.instance()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-sub {endpoint}", daemon=True)
        self.connected = threading.Event()

    def start(self) -> KVSubscriber:
        """Start the thread (it connects; the publisher need not be up yet). Returns ``self``."""
        self.started_at = time.time()
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Ask the thread to end and wait up to ``timeout`` seconds."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """Whether the thread runs."""
        return self._thread.is_alive()

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100000)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # a larger message drops the connection (it reconnects)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        replay = None
        try:
            sub.connect(self.endpoint)
            if self.replay_endpoint:
                replay = self._ctx.socket(zmq.DEALER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.connect(self.replay_endpoint)
            self.connected.set()
            if replay is not None and self.catch_up:
                got = self._replayed(0, None, replay)
                self._apply_all(got)
                if got:
                    self.last_seq = self._skip_upto = max(got)
                    self._skip_until = time.monotonic() + 1.0
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                try:
                    self._on_message(frames, replay)
                except zmq.ZMQError as exc:
                    self.error = f"replay: {exc}"
                except Exception as exc:  # noqa: BLE001 -- one bad message must not end the subscriber
                    self.kv_map.totals.bad += 1
                    self.error = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # the thread must report, not die silently
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("KV events from %s stopped: %s", self.endpoint, self.error)
        finally:
            sub.close(0)
            if replay is not None:
                replay.close(0)

    def _on_message(self, frames: list[bytes], replay: zmq.Socket | None) -> None:
        self.last_message_at = time.time()
        if len(frames) < 2 or len(frames[-2]) != 8:  # [topic,] 8-byte sequence number, payload
            self.kv_map.totals.bad += 1
            return
        seq = int.from_bytes(frames[-2], "big", signed=True)
        payload = frames[-1]
        if self._skip_upto is not None:  # the SUB socket may hold messages the catch-up at connect applied:
            # skip those for a second (after it, a lower number is a restarted publisher's)
            if seq <= self._skip_upto and time.monotonic() < self._skip_until:
                return
            self._skip_upto = None
        if seq == self.last_seq:  # the same message again
            return
        if seq < self.last_seq:  # a restarted publisher counts from 0 again, its cache empty: follow it
            self.kv_map.totals.restarts += 1
            self.kv_map.forget_source(self.label, time.time())
        elif self.last_seq >= 0 and seq > self.last_seq + 1:
            self.kv_map.totals.gaps += 1
            self._fill(self.last_seq + 1, seq, replay)
        elif self.last_seq < 0 and seq > 0 and self.catch_up and replay is not None:
            self._fill(0, seq, replay, count_lost=False)  # what the publisher did before we joined
        self._apply(payload)
        self.last_seq = seq

    def _fill(self, start: int, end: int, replay: zmq.Socket | None, count_lost: bool = True) -> None:
        """Apply the messages ``start .. end - 1`` from the replay socket (those it no longer has are lost)."""
        got = self._replayed(start, end, replay)
        self._apply_all(got)
        if count_lost:
            self.kv_map.totals.lost += min((end - start) - len(got), 1 << 20)  # (a wild jump counts once)

    def _apply_all(self, got: dict[int, bytes]) -> None:
        if got:
            self.last_message_at = time.time()
        for seq in sorted(got):
            self._apply(got[seq])
        self.kv_map.totals.replayed += len(got)

    def _replayed(self, start: int, end: int | None, replay: zmq.Socket | None) -> dict[int, bytes]:
        """The messages ``start .. end - 1`` (``end`` None: all from ``start``) the replay socket still keeps,
        by sequence number (empty when it does not answer within ``replay_timeout``)."""
        got: dict[int, bytes] = {}
        if replay is not None and time.monotonic() < self._replay_off_until:
            return got  # it did not answer lately: do not wait on it at every gap
        if replay is not None:
            while replay.poll(0):  # a late answer to an earlier request: not this one's
                replay.recv_multipart()
            try:
                replay.send_multipart([b"", start.to_bytes(8, "big")], flags=zmq.NOBLOCK)
            except zmq.Again:
                self._replay_off_until = time.monotonic() + REPLAY_BACKOFF_S
                return got
            answered = False
            deadline = time.monotonic() + self.replay_timeout
            while not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0 or not replay.poll(int(left * 1000)):
                    break
                frames = replay.recv_multipart()
                answered = True
                if len(frames) < 2 or len(frames[-2]) != 8:
                    continue
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq == END_SEQ or not frames[-1]:
                    break
                if seq >= start and (end is None or seq < end):
                    got[seq] = frames[-1]
            if not answered:  # a dead replay endpoint: leave it alone for a while
                self._replay_off_until = time.monotonic() + REPLAY_BACKOFF_S
        return got

    def _apply(self, payload: bytes) -> None:
        """Decode and apply one batch; a malformed one is counted as bad and skipped (the thread goes on)."""
        try:
            batch = decode_batch(payload)
        except ValueError:
            self.kv_map.totals.bad += 1
            return
        try:
            self.kv_map.apply(batch, self.label)
        except Exception as exc:  # noqa: BLE001 -- a hostile batch must not end the subscriber
            self.kv_map.totals.bad += 1
            log.warning("KV events from %s: a batch could not be applied: %s", self.endpoint, exc)


def start_subscribers(endpoints: list[str], replay_endpoints: list[str], topic: str, kv_map: KVMap,
                      ) -> list[KVSubscriber]:
    """One started :class:`KVSubscriber` per endpoint, paired with ``replay_endpoints`` by position (fewer
    replay endpoints: the rest have none). Labels: ``kv0``, ``kv1``... when several, else ``kv``."""
    subs = []
    for i, ep in enumerate(endpoints):
        label = "kv" if len(endpoints) == 1 else f"kv{i}"
        subs.append(KVSubscriber(ep, kv_map, replay_endpoints[i] if i < len(replay_endpoints) else None, topic,
                                 label=label).start())
    return subs

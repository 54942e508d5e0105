"""KV cache events: what changed in the block pool in one step, and the block state they replay to.

Two vocabularies, one stream. The block pool (:class:`engine.kv_cache.BlockPool`) says only what it
knows, one event per change, in order, at a cost proportional to the blocks that changed, never to the
pool:

- :class:`BlockAllocated`: a block went to a request, from the free queue, as a cached-free block (a
  prefix hit) or as a block another request holds (a shared prefix hit);
- :class:`BlockReleased`: a block's refcount dropped to 0 (back in the free queue);
- :class:`BlockStored`: a full block's content hash entered the prefix-cache map;
- :class:`BlockEvicted`: a cached block was taken for new data and its hash dropped;
- :class:`PrefixCacheCleared`: the hashes of free blocks were forgotten (``reset_prefix_cache``);
- :class:`KVFrame`: the empty pool, as the pool's first event.

The telemetry's :class:`engine.kv_provenance.Provenance` turns that into the *KV events* a step carries
(``StepSnapshot.kv_events``): each :class:`BlockAllocated` becomes a :class:`BlockTake` (kind ``new`` /
``reused`` / ``own``: from the free queue; ``cached``; ``shared``; with whose the block was and the step
it was freed), each :class:`BlockReleased` a :class:`BlockFreed` (its last holder, the step), and a
:class:`KVFrame` of the whole replayable state is put in again whenever a reader may have missed events.

:class:`BlockState` replays the KV events: per block the reuse count and whether it holds a cached hash,
and the provenance of every held block. Refcounts, fill and ownership are not in the events: they follow
from a step's block tables and each request's computed tokens (:func:`block_arrays`).

Mapping onto vLLM's KV cache events (``BlockStored(block_hashes, parent_block_hash, token_ids,
block_size)``, ``BlockRemoved(block_hashes)``, ``AllBlocksCleared``): :func:`to_vllm_events`. Ours carry
physical block ids and request ids in addition; vLLM's carry neither, so the takes and frees have no
counterpart there.
"""

from __future__ import annotations

import array
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

# BlockTake.kind: where a block a request takes comes from
TAKE_NEW = "new"  # never held by any request before
TAKE_REUSED = "reused"  # freed by another request; its old contents are overwritten
TAKE_CACHED = "cached"  # a free block still holding a cached prefix (prefix-cache hit): contents kept
TAKE_SHARED = "shared"  # a prefix-cache hit on a block another request holds now (refcount > 1)
TAKE_OWN = "own"  # freed by the same request before (it was preempted, or a copy-on-write of its own)


# BlockAllocated.source: where the pool found the block it hands to a request
FROM_FREE = "free"  # the free queue (its old contents, if any, are overwritten)
FROM_CACHED = "cached"  # a free block still holding a cached prefix (a prefix-cache hit): contents kept
FROM_HELD = "held"  # a block another request holds now (a prefix-cache hit, refcount > 1)


@dataclass(frozen=True, slots=True)
class BlockAllocated:
    """The pool handed ``block_id`` to ``request_id`` (None: a fork's siblings, no take of their own), found
    in ``source`` (``FROM_FREE``, ``FROM_CACHED`` or ``FROM_HELD``). A pool event: the telemetry turns it
    into a :class:`BlockTake`."""

    block_id: int
    request_id: str | None
    source: str


@dataclass(frozen=True, slots=True)
class BlockReleased:
    """Block ``block_id``'s refcount dropped to 0: it is back in the free queue. A pool event: the telemetry
    turns it into a :class:`BlockFreed`."""

    block_id: int


@dataclass(frozen=True)
class BlockTake:
    """Provenance of one block a request took: whose it was before and when it was freed (plain data).

    Attributes:
        block_id: the physical block.
        request_id: the request that took it.
        step: the engine step in which it was taken.
        kind: one of ``"new"``, ``"reused"``, ``"cached"``, ``"shared"``, ``"own"`` (see the ``TAKE_*``
            constants).
        previous_owner: the request that held it last before (None for a block never used).
        freed_step: the engine step in which that owner freed it (None when never freed: a new or a
            shared block).
    """

    block_id: int
    request_id: str
    step: int
    kind: str
    previous_owner: str | None = None
    freed_step: int | None = None


@dataclass(frozen=True, slots=True)
class BlockFreed:
    """A block's refcount dropped to 0 in ``step``; ``request_id`` held it last (None: a forked copy)."""

    block_id: int
    request_id: str | None
    step: int


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full block ``block_id`` now holds content ``block_hash`` (sha256 chained on ``parent_hash``, None
    for a first block) of ``token_ids`` (``block_size`` token ids): it can be found by a prefix lookup."""

    block_id: int
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class BlockEvicted:
    """Cached block ``block_id`` was taken for new data: its hash ``block_hash`` is no longer findable."""

    block_id: int
    block_hash: bytes


@dataclass(frozen=True, slots=True)
class PrefixCacheCleared:
    """The prefix cache forgot the hashes of these free blocks (held blocks keep theirs)."""

    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class KVFrame:
    """The replayable block state at one point of the event stream (plain data; O(blocks touched)).

    Attributes:
        step: the engine step it was taken in (0: the empty pool).
        num_blocks / block_size: the pool (blocks; tokens per block).
        block_reuses: block -> times handed to a request other than its previous owner (only blocks > 0).
        hashed_blocks: blocks holding a findable hash (held or free).
        block_origins: held block -> the :class:`BlockTake` by which its (first) holder got it.
    """

    step: int
    num_blocks: int
    block_size: int
    block_reuses: Mapping[int, int] = field(default_factory=dict)
    hashed_blocks: frozenset[int] = frozenset()
    block_origins: Mapping[int, BlockTake] = field(default_factory=dict)


class BlockState:
    """Per-block state replayed from events: reuse counts, cached hashes, held blocks' provenance.

    Attributes:
        num_blocks / block_size: the pool (0 until the first :class:`KVFrame`).
        reuses: per block, times reused (``array('I')``, length ``num_blocks``).
        hashed: per block, 1 when it holds a findable hash (``bytearray``).
        origins: held block -> its :class:`BlockTake`.
    """

    def __init__(self, num_blocks: int = 0, block_size: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.reuses = array.array("I", bytes(4 * num_blocks))
        self.hashed = bytearray(num_blocks)
        self.origins: dict[int, BlockTake] = {}

    def copy(self) -> BlockState:
        """An independent copy (O(num_blocks) memory copy)."""
        out = BlockState.__new__(BlockState)
        out.num_blocks, out.block_size = self.num_blocks, self.block_size
        out.reuses, out.hashed, out.origins = array.array("I", self.reuses), bytearray(self.hashed), dict(self.origins)
        return out

    def apply(self, events: Iterable) -> None:
        """Replay ``events`` in order (O(events))."""
        reuses, hashed, origins = self.reuses, self.hashed, self.origins
        for e in events:
            t = type(e)
            if t is BlockTake:
                if e.kind != TAKE_SHARED:  # a shared block keeps its first holder's origin
                    if e.previous_owner is not None and e.previous_owner != e.request_id:
                        reuses[e.block_id] += 1
                    origins[e.block_id] = e
            elif t is BlockFreed:
                origins.pop(e.block_id, None)
            elif t is BlockStored:
                hashed[e.block_id] = 1
            elif t is BlockEvicted:
                hashed[e.block_id] = 0
            elif t is PrefixCacheCleared:
                for b in e.block_ids:
                    hashed[b] = 0
            elif t is KVFrame:
                self._load(e)
                reuses, hashed, origins = self.reuses, self.hashed, self.origins

    def _load(self, frame: KVFrame) -> None:
        self.__init__(frame.num_blocks, frame.block_size)  # type: ignore[misc]
        for b, n in frame.block_reuses.items():
            self.reuses[b] = n
        for b in frame.hashed_blocks:
            self.hashed[b] = 1
        self.origins = dict(frame.block_origins)

    def frame(self, step: int) -> KVFrame:
        """This state as a :class:`KVFrame` (O(num_blocks) scan)."""
        reuses = np.frombuffer(self.reuses, np.uint32)
        nz = np.flatnonzero(reuses)
        hashed = np.flatnonzero(np.frombuffer(self.hashed, np.uint8))
        return KVFrame(step, self.num_blocks, self.block_size, dict(zip(nz.tolist(), reuses[nz].tolist())),
                       frozenset(hashed.tolist()), dict(self.origins))


class BlockArrays:
    """One step's per-block state as numpy arrays (length ``num_blocks`` each), for drawing any pool.

    Attributes:
        refcount: block tables holding each block (int32).
        tokens: tokens filled (int32; ``block_size`` for a cached-free block).
        reuses: times reused (uint32).
        cached: free and holding a findable prefix (bool).
        hit: held and found in the prefix cache by its request (bool).
        owner: index into ``owner_ids`` of the first request (in block-table order) holding it; -1 = free.
        owner_ids: request ids, in block-table order.
        origins: held block -> its :class:`BlockTake`.
    """

    def __init__(self, refcount, tokens, reuses, cached, hit, owner, owner_ids: list[str],
                 origins: Mapping[int, BlockTake]) -> None:
        self.refcount, self.tokens, self.reuses, self.cached, self.hit = refcount, tokens, reuses, cached, hit
        self.owner, self.owner_ids, self.origins = owner, owner_ids, origins

    @property
    def num_blocks(self) -> int:
        return len(self.refcount)

    @functools.cached_property
    def as_fields(self) -> dict:
        """The :class:`engine.telemetry.StepSnapshot` per-block fields (tuples and frozensets) built from
        the arrays, once (O(num_blocks))."""
        return {"block_refcount": tuple(self.refcount.tolist()), "block_tokens": tuple(self.tokens.tolist()),
                "block_reuses": tuple(self.reuses.tolist()),
                "cached_blocks": frozenset(np.flatnonzero(self.cached).tolist()),
                "cache_hit_blocks": frozenset(np.flatnonzero(self.hit).tolist()), "block_origins": self.origins}


def owner_array(num_blocks: int, tables: Mapping[str, Sequence[int]]) -> tuple[np.ndarray, list[str]]:
    """Per block, the index (into the returned ids) of the first block table holding it; -1 when none."""
    ids = list(tables)
    owner = np.full(num_blocks, -1, np.int32)
    for i in range(len(ids) - 1, -1, -1):  # the first table wins: it is written last
        blocks = tables[ids[i]]
        if blocks:
            owner[np.asarray(blocks, np.int64)] = i
    return owner, ids


def block_arrays(state: BlockState, tables: Mapping[str, Sequence[int]],
                 request_fill: Mapping[str, tuple[int, int]]) -> BlockArrays:
    """The per-block arrays of one step from the replayed ``state`` and the step's block tables.

    Args:
        state: the :class:`BlockState` after the step's events.
        tables: request id -> its block table (physical block ids).
        request_fill: request id -> ``(num_computed_tokens, num_hit_blocks)`` (tokens; leading blocks found
            in the prefix cache).
    """
    n, bs = state.num_blocks, state.block_size
    refcount = np.zeros(n, np.int32)
    tokens = np.zeros(n, np.int32)
    hit = np.zeros(n, bool)
    for rid, blocks in tables.items():
        if not blocks:
            continue
        idx = np.asarray(blocks, np.int64)
        np.add.at(refcount, idx, 1)
        computed, num_hit = request_fill.get(rid, (0, 0))
        fill = np.clip(computed - bs * np.arange(len(idx)), 0, bs).astype(np.int32)
        np.maximum.at(tokens, idx, fill)
        hit[idx[:num_hit]] = True
    cached = (np.frombuffer(state.hashed, np.uint8) > 0) & (refcount == 0)
    tokens[cached] = bs
    owner, ids = owner_array(n, tables)
    return BlockArrays(refcount, tokens, np.frombuffer(state.reuses, np.uint32).copy(), cached, hit, owner, ids,
                       dict(state.origins))


def to_vllm_events(events: Iterable, block_size: int) -> list[dict]:
    """Our events as vLLM's KV cache events (dicts with their field names), in order.

    :class:`BlockStored` runs that chain (each parent is the previous block) become one ``BlockStored``
    with their ``block_hashes`` and concatenated ``token_ids``; evictions and a cleared cache become
    ``BlockRemoved``; an empty :class:`KVFrame` (the pool's first event) becomes ``AllBlocksCleared``. A frame
    with cached blocks (a resync), the takes and the frees have no vLLM counterpart and are left out.
    """
    out: list[dict] = []
    for e in events:
        t = type(e)
        last = out[-1] if out else None
        if t is BlockStored:
            if last and last["type"] == "BlockStored" and last["block_hashes"][-1] == e.parent_hash:
                last["block_hashes"].append(e.block_hash)
                last["token_ids"].extend(e.token_ids)
            else:
                out.append({"type": "BlockStored", "block_hashes": [e.block_hash], "parent_block_hash": e.parent_hash,
                            "token_ids": list(e.token_ids), "block_size": block_size})
        elif t is BlockEvicted or t is PrefixCacheCleared:
            hashes = [e.block_hash] if t is BlockEvicted else list(e.block_hashes)
            if last and last["type"] == "BlockRemoved":
                last["block_hashes"].extend(hashes)
            elif hashes:
                out.append({"type": "BlockRemoved", "block_hashes": hashes})
        elif t is KVFrame and not e.hashed_blocks:
            out.append({"type": "AllBlocksCleared"})
    return out


@dataclass(frozen=True)
class KVStepEvents:
    """One step of a :class:`KVFeed`: its events and what the block map needs besides (plain data).

    Attributes:
        step: the engine step.
        events: the KV events of the step, in order (possibly only those after the feed's cursor).
        block_tables: request id -> block table after the step (running requests).
        request_fill: request id -> ``(num_computed_tokens, num_hit_blocks)`` after the step.
    """

    step: int
    events: tuple
    block_tables: Mapping[str, tuple[int, ...]]
    request_fill: Mapping[str, tuple[int, int]]


@dataclass(frozen=True)
class KVFeed:
    """What a reader that follows the KV cache gets (:meth:`engine.telemetry.Telemetry.kv_feed`).

    Attributes:
        frame: the full state after the newest step when the reader starts or fell behind the ring, else None.
        steps: the steps since the reader's cursor, oldest first (empty with a frame).
        cursor: ``(step, events seen of it)``: give it back to get only what follows.
    """

    frame: KVFrame | None
    steps: tuple[KVStepEvents, ...]
    cursor: tuple[int, int]

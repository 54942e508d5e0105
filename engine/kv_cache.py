"""Paged KV cache bookkeeping: the block pool and the per-request block tables.

Only ids and counts live here; the K/V tensors themselves are owned by the model runner (layout in
``kernels/__init__.py``). The design follows vLLM's v1 KV cache manager (PagedAttention, Kwon et al.,
SOSP 2023; automatic prefix caching as in vLLM/SGLang): fixed-size blocks, refcounts, an LRU free
queue, and a hash map from a full block's content hash to the block that holds it.

One meaning of *cached* throughout: a block is cached when its content hash is in that map
(:attr:`BlockPool.hash_to_block`), so a request whose prompt starts with the same tokens can find it; a
*cached-free* block has refcount 0 but is still findable until it is taken for new data. A request's
*hashed* blocks (:attr:`KVCacheManager.num_hashed_blocks`) are its leading full blocks already entered
in the map.
"""

from __future__ import annotations

import collections
import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.config import FREE_BLOCK_ORDERS
from engine.kv_events import (  # BlockTake and TAKE_* are re-exported
    TAKE_CACHED,
    TAKE_NEW,
    TAKE_OWN,
    TAKE_REUSED,
    TAKE_SHARED,
    BlockEvicted,
    BlockFreed,
    BlockStored,
    BlockTake,
    KVFrame,
    PrefixCacheCleared,
)
from engine.request import Request


def hash_block(parent_hash: bytes | None, token_ids: list[int] | tuple[int, ...], salt: str | None = None) -> bytes:
    """Content hash of a full block: sha256 over the parent block's hash, an optional cache salt and
    the block's token ids (little-endian uint32 each). Chaining the parent makes the hash identify the
    whole prefix, not only this block's tokens."""
    h = hashlib.sha256()
    h.update(parent_hash or b"\0" * 32)
    if salt:
        h.update(salt.encode("utf-8"))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


class BlockPool:
    """``num_blocks`` physical blocks with refcounts, a free queue and a prefix-hash map.

    A block is *free* when its refcount is 0; free blocks wait in ``free_queue`` in the order they
    were freed. With ``free_block_order="lru"`` (the default, vLLM's) new blocks are taken from its
    head (least recently freed first), so cached prefixes live longest; with ``"mru"`` from its tail
    (most recently freed first), so a waiting request takes exactly the blocks a finished one just
    freed, at the price of evicting the freshest cached prefixes first. A free block that still has a
    hash is *cached-free*: :meth:`touch` can bring it back until it is taken for new data, at which
    point its hash is dropped (evicted).

    Provenance: every block a request takes is recorded as a :class:`BlockTake` (whose it was, the step
    it was freed), at a cost proportional to the blocks taken or freed, never to the pool;
    :meth:`take_events` hands them over once per step, :attr:`origins` keeps the take of every held block.

    Events: every change (takes, frees, hashes stored, evicted or cleared) is also appended to one ordered
    stream (:mod:`engine.kv_events`), which starts with a :class:`KVFrame` of the empty pool;
    :meth:`pop_events` hands it over (the engine: once per step, into the telemetry).

    Attributes:
        ref_cnt: per block, number of block tables holding it.
        block_hash: per block, its content hash when full and cached, else None.
        reuses: per block, times it was handed to a request other than its previous owner.
        step: the engine step now running (set by the engine; stamps takes and frees).
        freed_step: per block, the step it was last freed in (None: never freed).

    Raises:
        ValueError: ``num_blocks`` < 1 or an unknown ``free_block_order``.
    """

    def __init__(self, num_blocks: int, free_block_order: str = "lru", block_size: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if free_block_order not in FREE_BLOCK_ORDERS:
            raise ValueError(f"free_block_order must be one of {FREE_BLOCK_ORDERS}, got {free_block_order!r}")
        self.num_blocks = num_blocks
        self.free_block_order = free_block_order
        self.step = 0
        self.freed_step: list[int | None] = [None] * num_blocks
        self.origins: dict[int, BlockTake] = {}  # held block -> how its holder(s) got it
        self._takes: list[BlockTake] = []  # taken since the last take_events()
        self.block_size = block_size
        self._events: list = [KVFrame(0, num_blocks, block_size)]  # since the last pop_events()
        self._origins_copy: dict[int, BlockTake] | None = {}  # a frozen copy for snapshots; None when stale
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.reuses = [0] * num_blocks
        self.last_owner: list[str | None] = [None] * num_blocks
        # blocks never used are taken lowest id first in either order
        ids = range(num_blocks) if free_block_order == "lru" else range(num_blocks - 1, -1, -1)
        self.free_queue: collections.OrderedDict[int, None] = collections.OrderedDict((i, None) for i in ids)
        self.hash_to_block: dict[bytes, int] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks with refcount 0 (cached-free included)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def _mark_owner(self, block_id: int, owner: str | None, kind: str | None = None) -> None:
        """Record that ``owner`` took ``block_id`` (refcount 0 -> 1): its reuse count and provenance."""
        if owner is not None:
            prev = self.last_owner[block_id]
            if prev is not None and prev != owner:
                self.reuses[block_id] += 1
            self.last_owner[block_id] = owner
            if kind is None:
                kind = TAKE_NEW if prev is None else TAKE_OWN if prev == owner else TAKE_REUSED
            self._record_take(BlockTake(block_id, owner, self.step, kind, prev, self.freed_step[block_id]))

    def _record_take(self, take: BlockTake) -> None:
        self._takes.append(take)
        self._events.append(take)
        if take.kind != TAKE_SHARED:  # a shared block keeps the origin of its first holder
            self.origins[take.block_id] = take
            self._origins_copy = None

    def take_events(self) -> tuple[BlockTake, ...]:
        """The blocks taken since the last call, in order (the engine calls it once per step)."""
        out, self._takes = tuple(self._takes), []
        return out

    def pop_events(self) -> tuple:
        """The KV events (:mod:`engine.kv_events`) since the last call, in order."""
        out, self._events = tuple(self._events), []
        return out

    def emit_frame(self) -> None:
        """Append a :class:`KVFrame` of the whole state now to the events (O(num_blocks)): a reader that
        lost events (a telemetry record that failed) is whole again from it."""
        self._events.append(KVFrame(self.step, self.num_blocks, self.block_size,
                                    {b: n for b, n in enumerate(self.reuses) if n},
                                    frozenset(b for b, h in enumerate(self.block_hash) if h is not None), dict(self.origins)))

    def origins_snapshot(self) -> dict[int, BlockTake]:
        """A copy of :attr:`origins` (held block -> its :class:`BlockTake`) that is never changed later;
        the same object until a block is taken or freed, so an unchanged step costs nothing."""
        if self._origins_copy is None:
            self._origins_copy = dict(self.origins)
        return self._origins_copy

    def allocate(self, n: int, owner: str | None = None) -> list[int]:
        """Take ``n`` free blocks (least recently freed first, or most recently freed first with
        ``free_block_order="mru"``), evicting their cached hashes; refcount becomes 1.

        Raises:
            RuntimeError: when fewer than ``n`` blocks are free (callers check first).
        """
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        mru = self.free_block_order == "mru"
        for _ in range(n):
            bid, _ = self.free_queue.popitem(last=mru)
            h = self.block_hash[bid]
            if h is not None:
                self._events.append(BlockEvicted(bid, h))
                self.block_hash[bid] = None
                if self.hash_to_block.get(h) == bid:
                    del self.hash_to_block[h]
                self.num_evictions += 1
            self.ref_cnt[bid] = 1
            self._mark_owner(bid, owner)
            out.append(bid)
        return out

    def touch(self, block_ids: list[int], owner: str | None = None) -> None:
        """Add one reference to each block (a prefix-cache hit); a cached-free block leaves the free
        queue."""
        for bid in block_ids:
            if self.ref_cnt[bid] == 0:
                del self.free_queue[bid]
                self._mark_owner(bid, owner, TAKE_CACHED)
            elif owner is not None:
                self._record_take(BlockTake(bid, owner, self.step, TAKE_SHARED, self.last_owner[bid]))
            self.ref_cnt[bid] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, in the given order; blocks reaching 0 join the tail of
        the free queue (so the first given is evicted first)."""
        for bid in block_ids:
            self.ref_cnt[bid] -= 1
            if self.ref_cnt[bid] == 0:
                self.free_queue[bid] = None
                self.freed_step[bid] = self.step
                self._events.append(BlockFreed(bid, self.last_owner[bid], self.step))
                if self.origins.pop(bid, None) is not None:
                    self._origins_copy = None
            elif self.ref_cnt[bid] < 0:
                raise RuntimeError(f"block {bid} freed more often than allocated")

    def lookup(self, block_hash: bytes) -> int | None:
        """The block holding content ``block_hash``, or None."""
        return self.hash_to_block.get(block_hash)

    def cache(self, block_id: int, block_hash: bytes, parent_hash: bytes | None = None,
              token_ids: tuple[int, ...] = ()) -> None:
        """Record that full block ``block_id`` holds content ``block_hash`` (chained on ``parent_hash``, of
        ``token_ids``: both only for the :class:`BlockStored` event). If another block already holds the
        same content, the map keeps that one and this block stays uncached."""
        if self.block_hash[block_id] is not None:
            return
        if block_hash in self.hash_to_block:
            return
        self.block_hash[block_id] = block_hash
        self.hash_to_block[block_hash] = block_id
        self._events.append(BlockStored(block_id, block_hash, parent_hash, tuple(token_ids)))

    def cached_free_blocks(self) -> list[int]:
        """Free blocks that still hold a findable prefix."""
        return [b for b in self.free_queue if self.block_hash[b] is not None]

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash of free blocks."""
        ids, hashes = [], []
        for b in self.free_queue:
            h = self.block_hash[b]
            if h is not None:
                self.block_hash[b] = None
                self.hash_to_block.pop(h, None)
                ids.append(b)
                hashes.append(h)
        if ids:
            self._events.append(PrefixCacheCleared(tuple(ids), tuple(hashes)))


@dataclass(frozen=True)
class KVCacheSnapshot:
    """Plain-data view of the paged KV cache after a step (for telemetry; safe to keep).

    The per-block fields (``block_refcount`` to ``block_origins``) cost O(num_blocks) and are None when
    :meth:`KVCacheManager.snapshot` is asked for none (a large pool: the telemetry rebuilds them from the
    KV events on demand); everything else costs O(running requests) or less.

    Attributes:
        block_tables: request id -> physical block ids, for each request given to :meth:`KVCacheManager.snapshot`.
        request_fill: request id -> ``(num_computed_tokens, num_hit_blocks)`` for the same requests (tokens;
            leading blocks it got from the prefix cache): with the block tables, what each block holds.
        block_refcount: per physical block, the number of block tables holding it.
        block_tokens: per physical block, tokens filled in it (0..block_size; ``block_size`` for a
            cached-free block).
        block_reuses: per physical block, times it was handed to a request other than its previous owner.
        cached_blocks: free blocks that still hold a findable prefix.
        cache_hit_blocks: held blocks that their request got from the prefix cache.
        block_origins: held block -> the :class:`BlockTake` by which its (first) holder got it.
        num_used_blocks: blocks held by requests.
        prefix_cache_queries / prefix_cache_hits: prompt tokens looked up / found so far (tokens).
    """

    block_tables: dict[str, tuple[int, ...]]
    block_refcount: tuple[int, ...] | None
    block_tokens: tuple[int, ...] | None
    block_reuses: tuple[int, ...] | None
    cached_blocks: frozenset[int] | None
    cache_hit_blocks: frozenset[int] | None
    num_used_blocks: int
    block_origins: dict[int, BlockTake] | None
    prefix_cache_queries: int
    prefix_cache_hits: int
    request_fill: dict[str, tuple[int, int]] = field(default_factory=dict)


class KVCacheManager:
    """Per-request block tables over a :class:`BlockPool`: allocation on demand, freeing, and prefix
    caching.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: look up and record full blocks by content hash.
        free_block_order: ``"lru"`` (take the least recently freed block first) or ``"mru"`` (the most
            recently freed first); see :class:`BlockPool`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 free_block_order: str = "lru") -> None:
        self.pool = BlockPool(num_blocks, free_block_order, block_size)
        self._tables: dict[str, tuple[int, ...]] = {}  # request id -> its block table as last snapshotted
        self._dirty: set[str] = set()  # requests whose block table changed since the last snapshot
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_hashed_blocks: dict[str, int] = {}  # request id -> leading blocks already hashed
        self.block_hashes: dict[str, list[bytes]] = {}  # request id -> hashes of its full blocks
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens found cached
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write block copies
        self.num_cow_copies = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by requests."""
        return self.pool.num_used_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (0..1)."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def _hashes(self, request: Request, upto_blocks: int) -> list[bytes]:
        """Hashes of the request's first ``upto_blocks`` full blocks (computed once, then extended)."""
        hashes = self.block_hashes.setdefault(request.request_id, [])
        if len(hashes) < upto_blocks:
            tokens = request.all_token_ids
            bs = self.block_size
            salt = getattr(request, "cache_salt", None)
            for i in range(len(hashes), upto_blocks):
                hashes.append(hash_block(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs], salt))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest run of cached full blocks that starts the request's tokens.

        The last token is never counted (it must be computed to give logits), so at most
        ``(num_tokens - 1) // block_size`` blocks match. Does not take references, and does not count the
        lookup in the hit-rate counters: the caller does with :meth:`record_prefix_lookup` once the request
        is admitted (a request that waits for blocks is looked up again at every step).

        Returns:
            ``(block ids, number of tokens they hold)``.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self._hashes(request, max_blocks):
            bid = self.pool.lookup(h)
            if bid is None:
                break
            hits.append(bid)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one admitted request's prefix-cache lookup: its ``num_tokens`` queried, ``num_hit_tokens``
        found (tokens). No-op without prefix caching. The scheduler counts each request once, at its first
        admission (not again when a preempted request is recomputed)."""
        if self.enable_prefix_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[int] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after ``request.num_computed_tokens``.

        Args:
            request: the request; its ``block_ids`` grows in place.
            num_new_tokens: tokens to compute this step (tokens).
            computed_blocks: prefix-cache hits to take (only when the request holds no blocks yet).
            num_lookahead_tokens: extra tokens to reserve (the static policy reserves
                ``prompt + max_tokens`` up front).

        Returns:
            The newly allocated block ids (possibly empty), or None when the pool has too few free
            blocks; then nothing changes.
        """
        computed_blocks = computed_blocks or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        need = self.blocks_needed(num_computed + num_new_tokens + num_lookahead_tokens)
        have = len(request.block_ids) + len(computed_blocks)
        new = max(0, need - have)
        # copy-on-write: blocks this step writes into that another block table also holds
        cow = []
        if request.block_ids:
            last = min(len(request.block_ids), self.blocks_needed(num_computed + num_new_tokens))
            cow = [i for i in range(num_computed // self.block_size, last) if self.pool.ref_cnt[request.block_ids[i]] > 1]
        # cached-free hits leave the free queue when touched, so they count against what is free
        hits_in_free = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if new + len(cow) + hits_in_free > self.pool.num_free_blocks:
            return None
        if cow or computed_blocks or new:
            self._dirty.add(request.request_id)
        for i in cow:
            src = request.block_ids[i]
            dst = self.pool.allocate(1, request.request_id)[0]
            self.pool.free([src])
            request.block_ids[i] = dst
            self.pending_copies.append((src, dst))
            self.num_cow_copies += 1
        if computed_blocks:
            self.pool.touch(computed_blocks, request.request_id)
            request.block_ids.extend(computed_blocks)
            self.num_hashed_blocks[request.request_id] = len(request.block_ids)
        new_ids = self.pool.allocate(new, request.request_id) if new else []
        request.block_ids.extend(new_ids)
        return new_ids

    def cache_blocks(self, request: Request) -> None:
        """Record the hashes of the request's full, computed blocks (after a step)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        start = self.num_hashed_blocks.get(rid, 0)
        if full <= start:
            return
        hashes = self._hashes(request, full)
        tokens, bs = request.all_token_ids, self.block_size
        for i in range(start, full):
            self.pool.cache(request.block_ids[i], hashes[i], hashes[i - 1] if i else None,
                            tuple(tokens[i * bs : (i + 1) * bs]))
        self.num_hashed_blocks[rid] = full

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the same block table as ``parent`` (one more reference on each block);
        later writes into a shared block copy it first (see :meth:`allocate_slots`)."""
        self.pool.touch(parent.block_ids, None)
        child.block_ids = list(parent.block_ids)
        self._dirty.add(child.request_id)
        self.num_hashed_blocks[child.request_id] = self.num_hashed_blocks.get(parent.request_id, 0)

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write ``(src, dst)`` block copies planned since the last call."""
        out, self.pending_copies = self.pending_copies, []
        return out

    def free(self, request: Request) -> None:
        """Return all the request's blocks to the pool (tail first, so its last blocks are evicted
        first) and clear its block table. Safe to call twice."""
        if request.block_ids:
            self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
        self.num_hashed_blocks.pop(request.request_id, None)
        self._dirty.add(request.request_id)

    def forget(self, request: Request) -> None:
        """Drop the request's per-request caches (hash list); call when it is finished."""
        self.block_hashes.pop(request.request_id, None)

    def block_tables(self, requests: Iterable[Request]) -> dict[str, tuple[int, ...]]:
        """Request id -> block table (a tuple) of each of ``requests``; a table unchanged since the last
        call is the same tuple again, so the cost is O(requests + blocks that changed hands)."""
        cache, dirty, out = self._tables, self._dirty, {}
        for r in requests:
            rid, ids = r.request_id, r.block_ids
            t = cache.get(rid)
            if t is None or rid in dirty or len(t) != len(ids) or (ids and t[-1] != ids[-1]):
                t = cache[rid] = tuple(ids)
            out[rid] = t
        if len(cache) > len(out):
            for rid in [k for k in cache if k not in out]:
                del cache[rid]
        dirty.clear()
        return out

    def snapshot(self, requests: Iterable[Request], per_block: bool = True) -> KVCacheSnapshot:
        """A :class:`KVCacheSnapshot` of the pool, with the block tables of ``requests`` (the running
        ones). ``request.num_hit_blocks`` leading blocks of each count as prefix-cache hits. Without
        ``per_block`` the per-block fields are None and the cost is independent of the pool size."""
        requests = list(requests)
        bs = self.block_size
        pool = self.pool
        tables = self.block_tables(requests)
        fill = {r.request_id: (r.num_computed_tokens, r.num_hit_blocks) for r in requests}
        common: dict[str, Any] = dict(block_tables=tables, request_fill=fill, num_used_blocks=pool.num_used_blocks,
                      prefix_cache_queries=self.prefix_queries, prefix_cache_hits=self.prefix_hits)
        if not per_block:
            return KVCacheSnapshot(block_refcount=None, block_tokens=None, block_reuses=None, cached_blocks=None,
                                   cache_hit_blocks=None, block_origins=None, **common)
        tokens = [0] * pool.num_blocks
        hit_blocks: set[int] = set()
        for r in requests:
            hit_blocks.update(r.block_ids[: r.num_hit_blocks])
            for j, b in enumerate(r.block_ids):
                tokens[b] = max(tokens[b], min(bs, max(0, r.num_computed_tokens - j * bs)))
        cached = pool.cached_free_blocks()
        for b in cached:
            tokens[b] = bs
        return KVCacheSnapshot(block_refcount=tuple(pool.ref_cnt), block_tokens=tuple(tokens),
                               block_reuses=tuple(pool.reuses), cached_blocks=frozenset(cached),
                               cache_hit_blocks=frozenset(hit_blocks), block_origins=pool.origins_snapshot(), **common)

"""Paged KV cache bookkeeping: the block pool and the per-request block tables.

Only ids and counts live here; the K/V tensors themselves are owned by the model runner (layout in
``kernels/__init__.py``). The design follows vLLM's v1 KV cache manager (PagedAttention, Kwon et al.,
SOSP 2023; automatic prefix caching as in vLLM/SGLang): fixed-size blocks, refcounts, a free queue (LRU
or MRU), and a hash map from a full block's content hash to the block that holds it.

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

from engine.config import FREE_BLOCK_ORDERS
from engine.kv_events import (
    FROM_CACHED,
    FROM_FREE,
    FROM_HELD,
    BlockAllocated,
    BlockEvicted,
    BlockReleased,
    BlockStored,
    KVFrame,
    PrefixCacheCleared,
)
from engine.request import Request

# free_block_order -> whether new blocks come from the free queue's tail (the most recently freed) instead
# of its head (the least recently freed); blocks never used are queued so that the lowest id goes first
TAKE_FROM_TAIL = {"lru": False, "mru": True}


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

    Its one output besides the blocks is an ordered stream of events (:mod:`engine.kv_events`: blocks
    allocated and released, hashes stored, evicted or cleared), which starts with a :class:`KVFrame` of the
    empty pool; :meth:`pop_events` hands it over (the engine: once per step, to the telemetry, which derives
    whose each block was from it: :mod:`engine.kv_provenance`). The cost is proportional to the blocks that
    change, never to the pool.

    Attributes:
        ref_cnt: per block, number of block tables holding it.
        block_hash: per block, its content hash when full and cached, else None.

    Raises:
        ValueError: ``num_blocks`` < 1 or an unknown ``free_block_order``.
    """

    def __init__(self, num_blocks: int, free_block_order: str = "lru", block_size: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        if free_block_order not in FREE_BLOCK_ORDERS:
            raise ValueError(f"free_block_order must be one of {FREE_BLOCK_ORDERS}, got {free_block_order!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_order = free_block_order
        self._from_tail = TAKE_FROM_TAIL[free_block_order]
        self._events: list = [KVFrame(0, num_blocks, block_size)]  # since the last pop_events()
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        ids = range(num_blocks - 1, -1, -1) if self._from_tail else range(num_blocks)
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

    def pop_events(self) -> tuple:
        """The pool's events (:mod:`engine.kv_events`) since the last call, in order."""
        out, self._events = tuple(self._events), []
        return out

    def allocate(self, n: int, owner: str | None = None) -> list[int]:
        """Take ``n`` free blocks for ``owner`` (least recently freed first, or most recently freed first
        with ``free_block_order="mru"``), evicting their cached hashes; refcount becomes 1.

        Raises:
            RuntimeError: when fewer than ``n`` blocks are free (callers check first).
        """
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        events = self._events
        for _ in range(n):
            bid, _ = self.free_queue.popitem(last=self._from_tail)
            h = self.block_hash[bid]
            if h is not None:
                events.append(BlockEvicted(bid, h))
                self.block_hash[bid] = None
                if self.hash_to_block.get(h) == bid:
                    del self.hash_to_block[h]
                self.num_evictions += 1
            self.ref_cnt[bid] = 1
            events.append(BlockAllocated(bid, owner, FROM_FREE))
            out.append(bid)
        return out

    def touch(self, block_ids: list[int], owner: str | None = None) -> None:
        """Add one reference to each block for ``owner`` (a prefix-cache hit, or a fork when None); a
        cached-free block leaves the free queue."""
        for bid in block_ids:
            if self.ref_cnt[bid] == 0:
                del self.free_queue[bid]
                self._events.append(BlockAllocated(bid, owner, FROM_CACHED))
            else:
                self._events.append(BlockAllocated(bid, owner, FROM_HELD))
            self.ref_cnt[bid] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, in the given order; blocks reaching 0 join the tail of
        the free queue (so the first given is evicted first)."""
        for bid in block_ids:
            self.ref_cnt[bid] -= 1
            if self.ref_cnt[bid] == 0:
                self.free_queue[bid] = None
                self._events.append(BlockReleased(bid))
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

    def forget(self, request: Request) -> None:
        """Drop the request's per-request caches (hash list); call when it is finished."""
        self.block_hashes.pop(request.request_id, None)

"""vLLM's KV cache events on the wire: msgpack payloads of ZMQ messages, encoded and decoded.

A publisher sends ZMQ multipart messages ``[topic, sequence number (8 bytes, big-endian), payload]``; the
payload is an event batch ``(ts, events, data_parallel_rank)`` whose events are ``BlockStored(block_hashes,
parent_block_hash, token_ids, block_size, lora_id, medium, lora_name, ...)``, ``BlockRemoved(block_hashes,
medium, ...)`` or ``AllBlocksCleared``, each tagged by its class name (vLLM's ``vllm/distributed/kv_events.py``,
msgspec structs with ``tag=True``). Releases differ in the shape:

- ``"vllm"`` (vLLM 0.11 to 0.32, the default here): the batch is an array ``[ts, events, rank?]``, each event a
  map with a ``"type"`` key;
- ``"array"`` (earlier releases, and the types of vLLM's example subscriber): the batch an array and each
  event an array ``[type, field, field, ...]`` in declaration order;
- the newest sources encode the batch as a map too (``{"ts": ..., "events": [...]}``): decoded, not encoded.

:func:`decode_batch` reads all three. Block hashes are ints, the low 64 bits of the block's sha256 (as vLLM
sends them by default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``); bytes are accepted when decoding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgspec

ENCODINGS = ("vllm", "array")
MEDIUM = "GPU"  # vLLM's name for the engine's own KV tier (also on its CPU backend)

# positional field order of each event type (the "array" encoding), as declared by vLLM
_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
_MIN_FIELDS = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}  # the oldest releases sent fewer
_ENCODER = msgspec.msgpack.Encoder()


def external_hash(block_hash: bytes | int) -> int:
    """A block hash as vLLM publishes it: the low 64 bits of the sha256 digest (an int in [0, 2**64))."""
    if isinstance(block_hash, int):
        return block_hash & 0xFFFF_FFFF_FFFF_FFFF
    return int.from_bytes(bytes(block_hash)[-8:], "big")


@dataclass
class WireEvent:
    """One decoded KV cache event.

    Attributes:
        type: ``"BlockStored"``, ``"BlockRemoved"`` or ``"AllBlocksCleared"`` (other types are kept by name).
        block_hashes: the blocks' hashes (ints or bytes, as sent; empty for ``AllBlocksCleared``).
        parent_block_hash: the hash of the block before the first one (``BlockStored``; None: a first block).
        token_ids: the stored blocks' token ids, ``block_size`` per block (``BlockStored``).
        block_size: tokens per block (``BlockStored``; 0 otherwise).
        medium: where the blocks live (``"GPU"``, ``"CPU"`` ...; None when not said).
        fields: every field as decoded (by name).
    """

    type: str
    block_hashes: list
    parent_block_hash: int | bytes | None = None
    token_ids: list | None = None
    block_size: int = 0
    medium: str | None = None
    fields: dict | None = None


@dataclass
class WireBatch:
    """One decoded event batch: ``ts`` (publisher's wall clock, seconds), ``events`` (list of
    :class:`WireEvent`), ``data_parallel_rank`` (None when not sent)."""

    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


def _event_value(e: dict, encoding: str, medium: str) -> Any:
    kind = e["type"]
    values: dict[str, Any]
    if kind == "BlockStored":
        values = {"block_hashes": [external_hash(h) for h in e["block_hashes"]],
                  "parent_block_hash": None if e.get("parent_block_hash") is None
                  else external_hash(e["parent_block_hash"]),
                  "token_ids": list(e["token_ids"]), "block_size": int(e["block_size"]), "lora_id": None,
                  "medium": medium, "lora_name": None}
    elif kind == "BlockRemoved":
        values = {"block_hashes": [external_hash(h) for h in e["block_hashes"]], "medium": medium}
    elif kind == "AllBlocksCleared":
        values = {}
    else:
        raise ValueError(f"unknown KV event type {kind!r}")
    if encoding == "array":
        return [kind, *values.values()]
    return {"type": kind, **values}


def encode_batch(events: list[dict], ts: float, data_parallel_rank: int | None = None, *,
                 encoding: str = "vllm", medium: str = MEDIUM) -> bytes:
    """One event batch as a msgpack payload.

    Args:
        events: vLLM-shaped events (dicts with ``"type"`` and vLLM's field names), e.g. from
            :func:`engine.kv_events.to_vllm_events`; hashes may be bytes (converted by :func:`external_hash`).
        ts: wall-clock time of the batch (seconds since the epoch).
        data_parallel_rank: the publishing rank (None: left out, as vLLM does for rank-less batches).
        encoding: ``"vllm"`` or ``"array"`` (see the module docstring).
        medium: the events' ``medium`` field.

    Raises:
        ValueError: an unknown encoding or event type.
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, not {encoding!r}")
    body: list[Any] = [float(ts), [_event_value(e, encoding, medium) for e in events]]
    if data_parallel_rank is not None:
        body.append(int(data_parallel_rank))
    return _ENCODER.encode(body)


def _decode_event(raw: Any) -> WireEvent:
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = {k: v for k, v in raw.items() if k != "type"}
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _FIELDS.get(kind)
        if names is None:
            fields = {f"field{i}": v for i, v in enumerate(raw[1:])}
        else:
            if not _MIN_FIELDS[kind] <= len(raw) - 1 <= len(names):
                raise ValueError(f"{kind} with {len(raw) - 1} fields")
            fields = dict(zip(names, raw[1:]))
    else:
        raise ValueError(f"not a KV event: {type(raw).__name__}")
    if not isinstance(kind, str):
        raise ValueError("a KV event without a type")
    hashes = fields.get("block_hashes") or []
    if not isinstance(hashes, list) or not all(_is_hash(h) for h in hashes):
        raise ValueError(f"{kind}.block_hashes is not a list of ints or bytes")
    parent = fields.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise ValueError(f"{kind}.parent_block_hash is not an int or bytes")
    tokens = fields.get("token_ids")
    if tokens is not None and not (isinstance(tokens, list) and all(type(t) is int for t in tokens)):
        raise ValueError(f"{kind}.token_ids is not a list of ints")
    size, medium = fields.get("block_size") or 0, fields.get("medium")
    if type(size) is not int or size < 0 or (medium is not None and not isinstance(medium, str)):
        raise ValueError(f"{kind}: block_size must be an int >= 0 and medium a string")
    return WireEvent(kind, hashes, parent, tokens, size, medium, fields)


def _is_hash(h: Any) -> bool:
    return (type(h) is int and -(1 << 63) <= h < (1 << 64)) or (isinstance(h, bytes) and 0 < len(h) <= 64)


def decode_batch(payload: bytes) -> WireBatch:
    """A msgpack event batch in any of the encodings of the module docstring, validated whole (hashes ints
    or bytes, token ids ints, a finite time), so a reader applies all of a batch or none of it.

    Raises:
        ValueError: the payload is not msgpack or not a well-formed event batch.
    """
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and 2 <= len(raw) <= 3:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) == 3 else None
    else:
        raise ValueError("not a KV event batch")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not math.isfinite(ts) \
            or not isinstance(events, list):
        raise ValueError("a KV event batch needs a finite time and a list of events")
    if rank is not None and (type(rank) is not int or not 0 <= rank < 1 << 16):
        raise ValueError("data_parallel_rank must be an int in [0, 65536)")
    return WireBatch(float(ts), [_decode_event(e) for e in events], rank)

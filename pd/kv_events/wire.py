"""vLLM's KV event wire format, so that llm-d's and Dynamo's consumers read pdserve's stream unchanged.

    a message: the multipart frames (topic, sequence number as 8 bytes big-endian, payload)
    payload:   msgpack [ts, [event, ...], data_parallel_rank]            (msgspec array_like structs)
    event:     ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
               ["BlockRemoved", block_hashes, medium]
               ["AllBlocksCleared"]

Block hashes are 16-byte strings (engine/core/prefix_cache.py chain_hashes); lora_id and lora_name are
null (no adapters here). The replay socket (ZeroMQ ROUTER) answers a request frame holding a starting
sequence number (8 bytes big-endian) with (sequence number, payload) per buffered batch from it, then
(-1 as 8 signed bytes, b"").
"""

from __future__ import annotations

import time
from typing import Any

import msgpack

from engine.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def _event(e: KVEvent) -> list[Any]:
    if isinstance(e, BlockStored):
        return ["BlockStored", list(e.block_hashes), e.parent_block_hash, list(e.token_ids), e.block_size, None, e.medium, None]
    if isinstance(e, BlockRemoved):
        return ["BlockRemoved", list(e.block_hashes), e.medium]
    return ["AllBlocksCleared"]


def encode_batch(events: list[KVEvent], dp_rank: int, ts: float | None = None) -> bytes:
    return msgpack.packb([time.time() if ts is None else ts, [_event(e) for e in events], dp_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent], int | None]:
    """(ts, events, data_parallel_rank). Raises ValueError on a payload of another shape."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        ts, items = float(raw[0]), raw[1]
        rank = raw[2] if len(raw) > 2 else None
        events: list[KVEvent] = []
        for item in items:
            tag = item[0]
            if tag == "BlockStored":
                hashes, parent, tokens, bs, medium = item[1], item[2], item[3], item[4], item[6]
                events.append(BlockStored(tuple(bytes(h) for h in hashes), parent, tuple(tokens), int(bs), medium))
            elif tag == "BlockRemoved":
                events.append(BlockRemoved(tuple(bytes(h) for h in item[1]), item[2]))
            elif tag == "AllBlocksCleared":
                events.append(AllBlocksCleared())
            else:
                raise ValueError(f"unknown KV event {tag!r}")
        return ts, events, rank
    except (TypeError, IndexError, KeyError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise ValueError(f"not a KV event batch: {e}") from None

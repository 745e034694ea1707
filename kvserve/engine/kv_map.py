"""The KV pool's page map for the dashboard: which block is free, cached-free, used or shared.

Taken on the engine thread (the only one that may read the pool), in two halves so that thread
pays only for copies done at C speed:

    engine thread   take(engine) -> KVMap: the block tables and the cached block ids, copied
    any thread      KVMap.states() -> uint8[num_blocks]     (numpy, no loop over blocks)
                    encode_runs(states) -> base64 of runs    (one uint32 per run)

A block's state follows from the pool's invariants (block_pool.py): its reference count is the
number of tables that hold it, and a free block with a hash is a cached (evictable) one. So:

    refs = bincount(all table entries)      FREE   refs == 0, no hash
                                            CACHED refs == 0, hash (a prefix hit revives it)
                                            USED   refs == 1
                                            SHARED refs >= 2 (a prefix or a fork's blocks)

Wire format of a map: little-endian uint32 per run of equal states, ``length << 2 | state``,
base64; the runs cover the pool in block order. A block table is sent the same way as runs of
consecutive ids: uint32 pairs ``(first id, length)``.
"""
from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvserve.engine.llm_engine import LLMEngine

FREE, CACHED, USED, SHARED = 0, 1, 2, 3
STATE_NAMES = ("free", "cached", "used", "shared")


@dataclass(frozen=True)
class KVMap:
    time: float
    num_blocks: int
    block_size: int
    tables: dict[str, list[int]]  # every table holding blocks (they define the reference counts)
    running: tuple[str, ...]  # request ids in the running batch, in schedule order
    cached: list[int]  # ids of blocks carrying a prefix-cache hash (used or free)

    def states(self) -> np.ndarray:
        return block_states(self.num_blocks, self.tables.values(), self.cached)


def take(engine: LLMEngine) -> KVMap:
    """Copy what the map needs from the engine. Engine thread only; O(blocks held) at C speed."""
    kv = engine.kv
    return KVMap(time=time.time(), num_blocks=kv.pool.num_blocks, block_size=kv.block_size,
                 tables=kv.held_tables(),
                 running=tuple(r.request_id for r in engine.scheduler.running),
                 cached=list(kv.pool.cached.values()))


def block_states(num_blocks: int, tables, cached: list[int]) -> np.ndarray:
    parts = [np.asarray(t, dtype=np.int64) for t in tables if t]
    refs = np.bincount(np.concatenate(parts), minlength=num_blocks) if parts else np.zeros(num_blocks, np.int64)
    states = np.zeros(num_blocks, dtype=np.uint8)
    if cached:
        states[np.asarray(cached, dtype=np.int64)] = CACHED
    states[refs == 1] = USED
    states[refs > 1] = SHARED
    return states


def encode_runs(states: np.ndarray) -> str:
    """Run-length encoding of a state array (values < 4), as base64 of ``length << 2 | state``."""
    n = states.size
    if n == 0:
        return ""
    starts = np.flatnonzero(np.concatenate(([True], states[1:] != states[:-1])))
    lengths = np.diff(np.append(starts, n)).astype(np.uint32)
    runs = (lengths << np.uint32(2)) | states[starts].astype(np.uint32)
    return base64.b64encode(runs.astype("<u4").tobytes()).decode("ascii")


def encode_table(table: list[int]) -> str:
    """A block table as base64 uint32 pairs (first id, length) of runs of consecutive ids."""
    if not table:
        return ""
    ids = np.asarray(table, dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], np.diff(ids) != 1)))
    lengths = np.diff(np.append(starts, ids.size))
    pairs = np.stack([ids[starts], lengths], axis=1).astype("<u4")
    return base64.b64encode(pairs.tobytes()).decode("ascii")

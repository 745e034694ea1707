"""PrefixPins: holds on the cached blocks of stable prompt prefixes, so the LRU cannot evict them.

A pin takes one reference on each cached block of a token prefix, as a request's table does, so
its blocks stay out of the free queue and a later request with the same prefix always hits them:

    prefix tokens   |instructions ..|.. tool defs ..|..  |     (the partial tail is never pinned)
    pinned blocks   [      4        ,       9       ]
    key             key of block 9 (it chains the salt and every token before it)

A pin is found by the prefix cache's own chained keys (``kv_cache_manager.hash_block`` from
``salt_root(cache_salt)``), so it holds only blocks a request with the same ``cache_salt`` would
hit: a pin never turns one tenant's KV into another's hit. With sliding-window groups a pin of
``N`` blocks holds every global group's ``N`` and each local group's blocks from the first one a
query after ``N`` blocks reads (what ``get_computed_blocks`` needs for a hit of ``N``).

Invariants (``check`` asserts them):
  1. ``refs[b]`` is the number of pins holding block ``b``; each of them is one of ``b``'s
     references in the pool, so a pinned block is never free: it keeps its hash (a prefix hit).
  2. ``len(refs) <= max_blocks``: distinct pinned blocks stay within the budget; over it, the
     least recently used pins go first.
  3. A pin has at least one owner; removing its last owner, or its TTL passing, releases it.
  4. ``pins`` is in LRU order, which is also expiry order (each use refreshes the TTL).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvserve.engine.kv_cache_manager import KVCacheManager, group_key, hash_block, salt_root
from kvserve.engine.kv_groups import NULL


@dataclass
class Pin:
    blocks: list[int]  # every group's pinned blocks
    num_tokens: int
    expires: float
    owners: set[str] = field(default_factory=set)


class PrefixPins:
    def __init__(self, kv: KVCacheManager, max_fraction: float, ttl: float,
                 clock: Callable[[], float] = time.monotonic):
        self.kv, self.ttl, self.clock = kv, ttl, clock
        self.max_blocks = int(max_fraction * kv.pool.num_blocks)
        self.pins: OrderedDict[bytes, Pin] = OrderedDict()  # LRU order: last used at the back
        self.refs: dict[int, int] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.refs)

    def keys_of(self, token_ids: list[int], cache_salt: str | None) -> list[bytes]:
        """The prefix cache's keys of the full blocks of ``token_ids``."""
        bs, keys = self.kv.block_size, []
        parent = salt_root(cache_salt)
        for i in range(len(token_ids) // bs):
            parent = hash_block(parent, self.kv.hash_extra, token_ids[i * bs:(i + 1) * bs])
            keys.append(parent)
        return keys

    def _cached(self, keys: list[bytes]) -> list[int] | None:
        """Every group's cached block a hit of all of ``keys`` needs, or None if one is missing."""
        out = []
        for g in range(len(self.kv.windows)):
            for h in keys[self.kv.first_needed(g, len(keys) * self.kv.block_size):]:
                bid = self.kv.pool.lookup(group_key(h, g))
                if bid is None:
                    return None
                out.append(bid)
        return out

    def pin(self, token_ids: list[int], cache_salt: str | None, owner: str) -> int:
        """Pin the longest cached run of ``token_ids``' full blocks (at most the budget) for
        ``owner``; a pin of the same prefix gains the owner and is refreshed. Returns the number
        of tokens pinned (0: nothing cached, or no budget)."""
        self.expire()
        if not self.kv.enable_caching or self.max_blocks == 0:
            return 0
        keys = self.keys_of(token_ids, cache_salt)
        n, blocks = len(keys), None
        while n:
            blocks = self._cached(keys[:n])
            if blocks is not None and len(blocks) <= self.max_blocks:
                break
            n -= 1
        if not n:
            return 0
        key = keys[n - 1]
        pin = self.pins.get(key)
        if pin is None:
            pin = self.pins[key] = Pin(blocks, n * self.kv.block_size, 0.0)
            self.kv.pool.touch(blocks)
            for b in blocks:
                self.refs[b] = self.refs.get(b, 0) + 1
        self.pins.move_to_end(key)
        pin.owners.add(owner)
        pin.expires = self.clock() + self.ttl
        while len(self.refs) > self.max_blocks:  # the newest pin alone fits, so this ends
            self._release(next(iter(self.pins)))
        return pin.num_tokens

    def unpin(self, owner: str) -> int:
        """Drop ``owner`` from every pin; release those left without one. Returns pins released."""
        gone = []
        for key, pin in self.pins.items():
            pin.owners.discard(owner)
            if not pin.owners:
                gone.append(key)
        for key in gone:
            self._release(key)
        return len(gone)

    def expire(self) -> int:
        """Release the pins unused for ``ttl``. Every use moves a pin to the back and sets its
        expiry to now + ttl, so LRU order is expiry order: only the front is checked (each step)."""
        now, n = self.clock(), 0
        while self.pins and next(iter(self.pins.values())).expires <= now:
            self._release(next(iter(self.pins)))
            n += 1
        return n

    def clear(self) -> None:
        """Release every pin (the prefix cache is about to be reset)."""
        for key in list(self.pins):
            self._release(key)

    def _release(self, key: bytes) -> None:
        pin = self.pins.pop(key)
        for b in pin.blocks:
            self.refs[b] -= 1
            if not self.refs[b]:
                del self.refs[b]
        self.kv.pool.free(list(reversed(pin.blocks)))

    def held(self) -> list[int]:
        """Every pin's blocks, one entry per reference."""
        return [b for pin in self.pins.values() for b in pin.blocks]

    def check(self) -> None:
        counts: dict[int, int] = {}
        for b in self.held():
            counts[b] = counts.get(b, 0) + 1
        assert counts == self.refs, (counts, self.refs)
        assert NULL not in counts
        assert len(self.refs) <= self.max_blocks, (len(self.refs), self.max_blocks)
        expiries = [pin.expires for pin in self.pins.values()]
        assert expiries == sorted(expiries), expiries
        for pin in self.pins.values():
            assert pin.owners, pin
            for b in pin.blocks:
                blk = self.kv.pool.blocks[b]
                assert blk.ref_cnt >= self.refs[b] and blk.block_hash is not None, blk

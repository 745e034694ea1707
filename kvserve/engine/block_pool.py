"""BlockPool: the bookkeeping of the paged KV cache. Plain Python, no torch.

The KV cache is split into ``num_blocks`` pages of ``block_size`` token slots each. A request
holds an append-only block table; its token ``p`` lives in slot ``table[p // bs] * bs + p % bs``:

    request tokens  |t0 .. t15|t16 .. t31|t32 t33 _ _ ...|
    block table     [   7     ,    2     ,      9        ]   (block 9 is partial)

Invariants (``check_invariants`` asserts them; the tests call it after every operation):
  1. Every block is either in use (``ref_cnt > 0``) or in the free queue (``ref_cnt == 0``),
     never both and never neither.
  2. A free block may still carry a hash: it is a *cached* block, revived by a prefix hit
     (``touch``) or evicted when the free queue hands it out, oldest-freed first (LRU).
  3. ``cached[h] == b``  <=>  ``blocks[b].block_hash == h``: the map and the blocks agree, and
     only full blocks whose KV is (or is being) written carry a hash.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Insertion order = LRU order: freed blocks go to the back, allocation takes the front.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        # Counters for stats.
        self.num_evictions = 0
        # With a tiered store: (block, hash) of cached blocks evicted since the last take, so
        # their KV can leave for the tiers before the block is overwritten.
        self.record_evictions = False
        self.evicted: list[tuple[int, bytes]] = []
        # With disk/Redis tiers: (block, hash) of blocks registered since the last take, so their
        # KV is written through once it is computed.
        self.record_sealed = False
        self.sealed: list[tuple[int, bytes]] = []

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    # -- operations ------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the free queue (evicting their cached hashes), ref_cnt = 1."""
        if n > len(self.free_queue):
            raise RuntimeError(f"allocate({n}) with only {len(self.free_queue)} free blocks")
        out = []
        for _ in range(n):
            bid, _ = self.free_queue.popitem(last=False)
            blk = self.blocks[bid]
            if blk.block_hash is not None:
                if self.record_evictions:
                    self.evicted.append((bid, blk.block_hash))
                del self.cached[blk.block_hash]
                blk.block_hash = None
                self.num_evictions += 1
            blk.ref_cnt = 1
            out.append(bid)
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Take another reference on each block, reviving cached free blocks."""
        for bid in block_ids:
            blk = self.blocks[bid]
            if blk.ref_cnt == 0:
                del self.free_queue[bid]
            blk.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block. Pass a table tail-first so that, at equal age, a
        sequence's last blocks are evicted before its first (which more requests share)."""
        for bid in block_ids:
            blk = self.blocks[bid]
            if blk.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {bid}")
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self.free_queue[bid] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Register a full, in-use block under its content hash (first writer wins)."""
        if not self.enable_caching:
            return
        blk = self.blocks[block_id]
        if blk.block_hash is not None or block_hash in self.cached:
            return  # already cached, or the same content already lives in another block
        blk.block_hash = block_hash
        self.cached[block_hash] = block_id
        if self.record_sealed:
            self.sealed.append((block_id, block_hash))

    def uncache(self, block_id: int) -> None:
        """Forget a free block's hash (its KV moved to a tier); it stays free."""
        blk = self.blocks[block_id]
        if blk.block_hash is not None and blk.ref_cnt == 0:
            del self.cached[blk.block_hash]
            blk.block_hash = None

    def reset_prefix_cache(self) -> None:
        self.evicted.clear()
        self.sealed.clear()
        for bid in self.cached.values():
            self.blocks[bid].block_hash = None
        self.cached.clear()

    def check_invariants(self) -> None:
        free = set(self.free_queue)
        assert len(free) == len(self.free_queue)
        for blk in self.blocks:
            assert blk.ref_cnt >= 0, blk
            assert (blk.ref_cnt == 0) == (blk.block_id in free), blk
            if blk.block_hash is not None:
                assert self.cached.get(blk.block_hash) == blk.block_id, blk
        for h, bid in self.cached.items():
            assert self.blocks[bid].block_hash == h

"""KVCacheManager: per-request block tables on top of the BlockPool, with prefix caching.

A full block's key chains the parent block's key with the block's token ids and the cache's
``hash_extra`` (model and KV dtype), so equal keys mean equal KV on any replica:

    key_i = blake2b(key_{i-1} | extra | tokens[i*bs:(i+1)*bs]),   key_{-1} = salt_root(cache_salt)

A request's ``cache_salt`` enters the first key only, and every later key chains from it: two
requests with different salts share no block, in the GPU cache or in the KV tiers (keyed the same).

Only full blocks are shared through the cache. A partial block is shared only by a fork
(``n > 1``); the first sibling to append to it gets a private copy (copy on write), recorded in
``pending_copies`` for the runner to perform before the forward pass.
"""
from __future__ import annotations

import hashlib
import struct
from math import ceil

from kvserve.engine.block_pool import BlockPool
from kvserve.engine.request import PENDING_TOKEN, Request


def hash_block(parent: bytes, extra: bytes, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(extra)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return h.digest()


def salt_root(cache_salt: str | None) -> bytes:
    """The parent of a request's first block: empty without a salt (the shared cache)."""
    if cache_salt is None:
        return b""
    return hashlib.blake2b(cache_salt.encode("utf-8", "surrogatepass"), digest_size=16,
                           person=b"kvserve-salt").digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_extra: bytes = b""):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.hash_extra = hash_extra
        self.tables: dict[str, list[int]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks of a table registered in the cache
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write this step
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found cached

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    def blocks_for(self, num_tokens: int) -> int:
        return ceil(num_tokens / self.block_size)

    def _update_hashes(self, req: Request) -> None:
        bs, hashes = self.block_size, req.block_hashes
        while (len(hashes) + 1) * bs <= req.num_tokens:
            i = len(hashes)
            tokens = req.all_token_ids[i * bs:(i + 1) * bs]
            if tokens[-1] == PENDING_TOKEN:  # a token still being sampled (async scheduling): later
                break
            parent = hashes[-1] if hashes else salt_root(req.cache_salt)
            hashes.append(hash_block(parent, self.hash_extra, tokens))

    def get_computed_blocks(self, req: Request) -> list[int]:
        """The longest run of cached blocks holding this request's leading tokens. At least one
        token is always left to compute, so the step produces logits to sample from."""
        if not self.enable_caching or req.params.prompt_logprobs is not None:
            return []
        self._update_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in req.block_hashes[:max_blocks]:
            bid = self.pool.lookup(h)
            if bid is None:
                break
            hits.append(bid)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def can_allocate(self, req: Request, num_new_tokens: int, computed: list[int] = (),
                     reserve_blocks: int = 0) -> bool:
        return self._blocks_needed(req, num_new_tokens, computed) + reserve_blocks <= (
            self.pool.num_free_blocks - sum(1 for b in computed if self.pool.blocks[b].ref_cnt == 0))

    def _tokens_after(self, req: Request, num_new_tokens: int, computed: list[int]) -> int:
        """Tokens the request's table must hold after this step (cached blocks count as computed)."""
        start = len(computed) * self.block_size if computed else req.num_computed_tokens
        return start + num_new_tokens

    def _blocks_needed(self, req: Request, num_new_tokens: int, computed: list[int]) -> int:
        table = self.tables.get(req.request_id, ())
        need = self.blocks_for(self._tokens_after(req, num_new_tokens, computed)) - len(table) - len(computed)
        if self._needs_cow(req, table):
            need += 1
        return max(need, 0)

    def _needs_cow(self, req: Request, table) -> bool:
        return (bool(table) and req.num_computed_tokens % self.block_size != 0
                and self.pool.blocks[table[-1]].ref_cnt > 1)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[int] = (),
                       reserve_blocks: int = 0) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``req`` (after ``computed`` cached
        blocks, for a request being admitted). False, changing nothing, if the pool is short."""
        table = self.tables.get(req.request_id)
        if table and not computed and not reserve_blocks:
            total = req.num_computed_tokens + num_new_tokens
            if total <= len(table) * self.block_size and not self._needs_cow(req, table):
                # Most decode steps: the tokens fit in the blocks it holds, none of them shared.
                self._cache_full_blocks(req, total)
                return True
        if not self.can_allocate(req, num_new_tokens, computed, reserve_blocks):
            return False
        table = self.tables.setdefault(req.request_id, [])
        self._num_hashed.setdefault(req.request_id, 0)
        if computed:
            self.pool.touch(computed)
            table.extend(computed)
            self._num_hashed[req.request_id] = len(table)
        if self._needs_cow(req, table):
            (new,) = self.pool.allocate(1)
            self.pending_copies.append((table[-1], new))
            self.pool.free([table[-1]])
            table[-1] = new
        total = self._tokens_after(req, num_new_tokens, computed)
        extra = self.blocks_for(total) - len(table)
        if extra > 0:
            table.extend(self.pool.allocate(extra))
        self._cache_full_blocks(req, total)
        return True

    def _cache_full_blocks(self, req: Request, num_tokens: int) -> None:
        """Register blocks that will be full once this step's tokens are written."""
        if not self.enable_caching:
            return
        num_full = num_tokens // self.block_size
        done = self._num_hashed[req.request_id]
        if num_full <= done:
            return
        self._update_hashes(req)
        num_full = min(num_full, len(req.block_hashes))  # (a block with a pending token waits)
        table = self.tables[req.request_id]
        for i in range(done, num_full):
            self.pool.cache_block(table[i], req.block_hashes[i])
        self._num_hashed[req.request_id] = num_full

    def fork(self, parent: Request, child: Request) -> None:
        table = self.tables[parent.request_id]
        self.pool.touch(table)
        self.tables[child.request_id] = list(table)
        self._num_hashed[child.request_id] = self._num_hashed[parent.request_id]

    def free(self, req: Request) -> list[int]:
        table = self.tables.pop(req.request_id, [])
        self._num_hashed.pop(req.request_id, None)
        self.pool.free(table[::-1])
        return table

    def trim(self, req: Request) -> None:
        """Free the blocks past ``req.num_computed_tokens`` (rejected drafts' slots). None of
        them is hash-registered: registered blocks hold only known tokens, all computed."""
        table = self.tables.get(req.request_id)
        keep = self.blocks_for(req.num_computed_tokens)
        if table is not None and len(table) > keep:
            extra = table[keep:]
            del table[keep:]
            self.pool.free(extra[::-1])

    def table(self, req: Request) -> list[int]:
        return self.tables[req.request_id]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out

    # -- stats -----------------------------------------------------------------------------
    def kv_waste(self, requests: list[Request]) -> tuple[int, int]:
        """(slots allocated to requests, slots of those holding a token or one being written)."""
        bs = self.block_size
        full: set[int] = set()  # blocks some table fills
        tails = []
        for req in requests:  # called every step: full blocks go in at C speed, tails after
            table = self.tables.get(req.request_id)
            if not table:
                continue
            n = min(req.num_tokens, len(table) * bs)
            n_full = n // bs
            if n_full == len(table):
                full.update(table)
                continue
            full.update(table[:n_full])
            tails.append((table[n_full], n - n_full * bs))
            tails.extend((bid, 0) for bid in table[n_full + 1:])
        partial: dict[int, int] = {}
        for bid, f in tails:  # a block shared with another table may be fuller there
            if bid not in full and f > partial.get(bid, -1):
                partial[bid] = f
        return (len(full) + len(partial)) * bs, len(full) * bs + sum(partial.values())

    def check_invariants(self, live: list[Request]) -> None:
        """Reference counts equal the number of tables holding each block; hashes match tokens."""
        self.pool.check_invariants()
        counts: dict[int, int] = {}
        for table in self.tables.values():
            for bid in table:
                counts[bid] = counts.get(bid, 0) + 1
        for blk in self.pool.blocks:
            assert blk.ref_cnt == counts.get(blk.block_id, 0), (blk, counts.get(blk.block_id))
        by_id = {r.request_id: r for r in live}
        assert set(self.tables) <= set(by_id), set(self.tables) - set(by_id)
        for rid, table in self.tables.items():
            req = by_id[rid]
            for i in range(self._num_hashed[rid]):
                blk = self.pool.blocks[table[i]]
                want = req.block_hashes[i]
                if blk.block_hash is not None:
                    assert blk.block_hash == want, (rid, i)
                parent = req.block_hashes[i - 1] if i else salt_root(req.cache_salt)
                toks = req.all_token_ids[i * self.block_size:(i + 1) * self.block_size]
                assert want == hash_block(parent, self.hash_extra, toks), (rid, i)

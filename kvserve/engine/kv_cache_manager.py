"""KVCacheManager: per-request block tables on top of the BlockPool, with prefix caching.

A full block's key chains the parent block's key with the block's token ids and the cache's
``hash_extra`` (model and KV dtype), so equal keys mean equal KV on any replica:

    key_i = blake2b(key_{i-1} | extra | tokens[i*bs:(i+1)*bs]),   key_{-1} = salt_root(cache_salt)

A request's ``cache_salt`` enters the first key only, and every later key chains from it: two
requests with different salts share no block, in the GPU cache or in the KV tiers (keyed the same).

Only full blocks are shared through the cache. A partial block is shared only by a fork
(``n > 1``); the first sibling to append to it gets a private copy (copy on write), recorded in
``pending_copies`` for the runner to perform before the forward pass.

Groups (``kv_groups.py``): a request holds one table per group, all of the same length. Group 0's
keys are the chain above; group ``g``'s key of a block is its group-0 key tagged with ``g``. A
sliding-window group frees, before each step, the blocks wholly before the first key any of the
request's future queries sees (``num_computed_tokens - window + 1``) and marks their entries
``NULL``; freed blocks keep their hash, so they stay prefix hits until the pool reuses them. A
prefix of ``N`` blocks is a hit when every global group holds all ``N`` and every local group the
blocks its first uncomputed query sees; a local group takes references on those only.

Eviction under a ``kv_budget`` (streaming, SnapKV, H2O): ``kv_evict.py``.
"""
from __future__ import annotations

import hashlib
import struct
from math import ceil

import torch

from kvserve.engine.block_pool import BlockPool
from kvserve.engine.kv_evict import BlockEviction
from kvserve.engine.kv_groups import NULL, null_before
from kvserve.engine.request import PENDING_TOKEN, Request
from kvserve.kv_eviction import (
    OBS_WINDOW,
    SCORED,
    SINK_BLOCKS,
    budget_blocks,
    full_attention_blocks,
    recent_blocks,
    recent_start,
)


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


def group_key(block_hash: bytes, group: int) -> bytes:
    """Group ``group``'s key of a block whose group-0 key is ``block_hash``."""
    if group == 0:
        return block_hash
    return hashlib.blake2b(block_hash, digest_size=16, person=b"kvserve-group",
                           salt=group.to_bytes(16, "little")).digest()


class KVCacheManager(BlockEviction):
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_extra: bytes = b"", windows: tuple[int | None, ...] = (None,),
                 eviction: str = "streaming"):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.hash_extra = hash_extra
        self.windows = tuple(windows)  # per group (None: global)
        self.group_tables: list[dict[str, list[int]]] = [{} for _ in self.windows]
        self.tables = self.group_tables[0]
        # Eviction decides on group 0's table (global: groups sort global first) and every other
        # global group follows it entry for entry; local groups keep their window whatever the budget.
        self.global_groups = [g for g, w in enumerate(self.windows) if w is None]
        self._num_hashed: dict[str, int] = {}  # leading blocks of a table registered in the cache
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) copy-on-write this step
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found cached
        self.eviction = eviction  # how a request with a kv_budget evicts (``kv_eviction.py``)
        self._scores: dict[str, torch.Tensor] = {}  # scored eviction: attention per position
        self._exact: dict[str, int] = {}  # scored eviction: blocks computed before the first eviction

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

    def first_needed(self, group: int, num_tokens: int) -> int:
        """The first block of ``group`` a query after ``num_tokens`` computed tokens may read."""
        w = self.windows[group]
        return 0 if w is None else max(0, num_tokens - w + 1) // self.block_size

    def _group_hits(self, req: Request, num_blocks: int) -> list[list[int]] | None:
        """Per group, the cached blocks of the first ``num_blocks`` (NULL where a local group's
        window no longer reaches), or None if one it needs is not cached."""
        out = []
        for g in range(len(self.windows)):
            lo = self.first_needed(g, num_blocks * self.block_size)
            hits = [NULL] * lo
            for h in req.block_hashes[lo:num_blocks]:
                bid = self.pool.lookup(group_key(h, g))
                if bid is None:
                    return None
                hits.append(bid)
            out.append(hits)
        return out

    def get_computed_blocks(self, req: Request) -> list[int]:
        """The longest run of cached blocks holding this request's leading tokens (group 0's; a
        local group's entries out of the window are NULL). At least one token is always left to
        compute, so the step produces logits to sample from."""
        if not self.enable_caching or req.params.prompt_logprobs is not None:
            return []
        self._update_hashes(req)
        limit = min((req.num_tokens - 1) // self.block_size, self._cacheable(req))
        if req.params.kv_budget is not None and self.eviction == "h2o":
            return []
        if req.params.kv_budget is not None and self.eviction == "snapkv":  # the window is computed
            limit = min(limit, max(0, req.num_prompt_tokens - OBS_WINDOW) // self.block_size)
        keys = req.block_hashes[:limit]
        n = len(keys)
        found: list[list[int | None]] = []  # per group, the cached block of each key (or None)
        for g, w in enumerate(self.windows):
            ids = []
            for h in keys[:n]:
                bid = self.pool.lookup(group_key(h, g))
                if bid is None and w is None:
                    break
                ids.append(bid)
            if w is None:
                n = len(ids)
            found.append(ids)
        # The longest prefix every local group holds the window of: a block one misses caps it.
        changed = True
        while n and changed:
            changed = False
            for g, w in enumerate(self.windows):
                if w is None:
                    continue
                missing = [i for i in range(self.first_needed(g, n * self.block_size), n) if found[g][i] is None]
                if missing:
                    n, changed = missing[-1], True
        if not n:
            return []
        lo = self.first_needed(0, n * self.block_size)
        return [NULL] * lo + found[0][lo:n]

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def can_allocate(self, req: Request, num_new_tokens: int, computed: list[int] = (),
                     reserve_blocks: int = 0) -> bool:
        hits = self._hits_of(req, computed)
        revived = sum(1 for gh in hits for b in set(gh) if b != NULL and self.pool.blocks[b].ref_cnt == 0)
        return self._blocks_needed(req, num_new_tokens, hits) + reserve_blocks <= self.pool.num_free_blocks - revived

    def _hits_of(self, req: Request, computed: list[int]) -> list[list[int]]:
        if not computed:
            return [[] for _ in self.windows]
        hits = self._group_hits(req, len(computed))
        assert hits is not None and hits[0] == list(computed), "prefix hits went stale before allocation"
        if req.params.kv_budget is not None and self.eviction == "streaming":  # no reference to the hits
            # its first query does not see
            stop = recent_start(req.params.kv_budget, self.block_size, len(computed) * self.block_size)
            for g in self.global_groups:
                hits[g][SINK_BLOCKS:stop] = [NULL] * len(hits[g][SINK_BLOCKS:stop])
        return hits

    def _tokens_after(self, req: Request, num_new_tokens: int, hits: list[list[int]]) -> int:
        """Tokens the request's tables must hold after this step (cached blocks count as computed)."""
        start = len(hits[0]) * self.block_size if hits[0] else req.num_computed_tokens
        return start + num_new_tokens

    def _blocks_needed(self, req: Request, num_new_tokens: int, hits: list[list[int]]) -> int:
        total = self.blocks_for(self._tokens_after(req, num_new_tokens, hits))
        need = 0
        for g, tables in enumerate(self.group_tables):
            table = tables.get(req.request_id, ())
            need += max(0, total - len(table) - len(hits[g]) + (1 if self._needs_cow(req, table) else 0))
        return need

    def _needs_cow(self, req: Request, table) -> bool:
        return (bool(table) and req.num_computed_tokens % self.block_size != 0
                and table[-1] != NULL and self.pool.blocks[table[-1]].ref_cnt > 1)

    def _cacheable(self, req: Request) -> int:
        """Leading blocks of ``req`` computed as under full attention (all, without a budget)."""
        budget = req.params.kv_budget
        if budget is None:
            return 1 << 62
        if self.eviction in SCORED:
            return self._exact.get(req.request_id, 1 << 62)
        return full_attention_blocks(budget, self.block_size)

    def step_tokens(self, req: Request, num_new_tokens: int, computed: list[int] = ()) -> int:
        """How many of ``num_new_tokens`` a request with a ``kv_budget`` computes this step so
        that, after what its policy evicts first (done here), it holds at most its budget's
        blocks. Once at the budget that is the rest of its last block, or one more block; a
        SnapKV prompt runs to its end unevicted (it is compressed there)."""
        budget = req.params.kv_budget
        if budget is None:
            return num_new_tokens
        bs, table = self.block_size, self.tables.get(req.request_id)
        if table is None:  # being admitted: what it holds is its prefix hits
            c, slack = len(computed) * bs, 0
            held = sum(1 for b in self._hits_of(req, computed)[0] if b != NULL)
        else:
            self._evict(req)
            c = req.num_computed_tokens
            held, slack = sum(1 for b in table if b != NULL), len(table) * bs - c
        if self.eviction == "snapkv" and c < req.num_prompt_tokens:
            return min(num_new_tokens, req.num_prompt_tokens - c)
        return min(num_new_tokens, max(1, slack + (budget_blocks(budget, bs) - held) * bs))

    def free_out_of_window(self, req: Request) -> int:
        """Give back the blocks of ``req``'s local tables that no future query reads (before
        ``num_computed_tokens - window + 1``). Returns how many references were dropped."""
        freed = []
        for g, w in enumerate(self.windows):
            table = self.group_tables[g].get(req.request_id)
            if w is None or not table:
                continue
            stop = min(self.first_needed(g, req.num_computed_tokens), len(table))
            freed += null_before(table, stop)  # tail first, as ``free`` does; NULLs are a prefix
        self.pool.free(freed)
        return len(freed)

    def allocate_slots(self, req: Request, num_new_tokens: int, computed: list[int] = (),
                       reserve_blocks: int = 0) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``req`` (after ``computed`` cached
        blocks, for a request being admitted). False, changing nothing but freeing blocks out of
        the windows, if the pool is short."""
        self.free_out_of_window(req)
        self._evict(req)
        table = self.tables.get(req.request_id)
        if table and not computed and not reserve_blocks and len(self.group_tables) == 1:
            total = req.num_computed_tokens + num_new_tokens
            if total <= len(table) * self.block_size and not self._needs_cow(req, table):
                # Most decode steps: the tokens fit in the blocks it holds, none of them shared.
                self._cache_full_blocks(req, total)
                return True
        if not self.can_allocate(req, num_new_tokens, computed, reserve_blocks):
            return False
        hits = self._hits_of(req, computed)
        rid = req.request_id
        total = self._tokens_after(req, num_new_tokens, hits)
        self._num_hashed.setdefault(rid, 0)
        for g, tables in enumerate(self.group_tables):  # every hit first: allocations may evict
            table = tables.setdefault(rid, [])
            if hits[g]:
                self.pool.touch([b for b in hits[g] if b != NULL])
                table.extend(hits[g])
        for tables in self.group_tables:
            table = tables[rid]
            if self._needs_cow(req, table):
                (new,) = self.pool.allocate(1)
                self.pending_copies.append((table[-1], new))
                self.pool.free([table[-1]])
                table[-1] = new
            extra = self.blocks_for(total) - len(table)
            if extra > 0:
                table.extend(self.pool.allocate(extra))
        if hits[0]:
            self._num_hashed[rid] = len(hits[0])
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
        num_full = min(num_full, len(req.block_hashes), self._cacheable(req))  # (a pending token waits)
        for g, tables in enumerate(self.group_tables):
            table = tables[req.request_id]
            for i in range(done, num_full):
                if table[i] != NULL:
                    self.pool.cache_block(table[i], group_key(req.block_hashes[i], g))
        self._num_hashed[req.request_id] = max(done, num_full)

    def fork(self, parent: Request, child: Request) -> None:
        for tables in self.group_tables:
            table = tables[parent.request_id]
            self.pool.touch([b for b in table if b != NULL])
            tables[child.request_id] = list(table)
        self._num_hashed[child.request_id] = self._num_hashed[parent.request_id]
        if parent.request_id in self._scores:
            self._scores[child.request_id] = self._scores[parent.request_id].clone()
        if parent.request_id in self._exact:
            self._exact[child.request_id] = self._exact[parent.request_id]

    def free(self, req: Request) -> list[int]:
        """Give back every block of ``req``; returns its group-0 table."""
        out = []
        for tables in reversed(self.group_tables):
            out = tables.pop(req.request_id, [])
            self.pool.free([b for b in reversed(out) if b != NULL])
        self._num_hashed.pop(req.request_id, None)
        self._scores.pop(req.request_id, None)
        self._exact.pop(req.request_id, None)
        return out

    def trim(self, req: Request) -> None:
        """Free the blocks past ``req.num_computed_tokens`` (rejected drafts' slots). None of
        them is hash-registered: registered blocks hold only known tokens, all computed."""
        keep = self.blocks_for(req.num_computed_tokens)
        for tables in self.group_tables:
            table = tables.get(req.request_id)
            if table is not None and len(table) > keep:
                extra = table[keep:]
                del table[keep:]
                self.pool.free([b for b in reversed(extra) if b != NULL])

    def table(self, req: Request) -> list[int]:
        return self.tables[req.request_id]

    def tables_of(self, req: Request) -> list[list[int]]:
        """``req``'s table in every group (NULL: freed out of a window)."""
        return [tables[req.request_id] for tables in self.group_tables]

    def held_tables(self) -> dict[str, list[int]]:
        """Per request, every block it holds in any group."""
        out: dict[str, list[int]] = {}
        for tables in self.group_tables:
            for rid, table in tables.items():
                out.setdefault(rid, []).extend(b for b in table if b != NULL)
        return out

    def take_pending_copies(self) -> list[tuple[int, int]]:
        out, self.pending_copies = self.pending_copies, []
        return out

    # -- stats -----------------------------------------------------------------------------
    def kv_waste(self, requests: list[Request]) -> tuple[int, int]:
        """(slots allocated to requests, slots of those holding a token or one being written)."""
        bs = self.block_size
        full: set[int] = set()  # blocks some table fills
        tails = []
        for tables in self.group_tables:
            for req in requests:  # called every step: full blocks go in at C speed, tails after
                table = tables.get(req.request_id)
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
        full.discard(NULL)  # a local group's freed entries (a prefix before its window)
        partial: dict[int, int] = {}
        for bid, f in tails:  # a block shared with another table may be fuller there
            if bid not in full and f > partial.get(bid, -1):
                partial[bid] = f
        return (len(full) + len(partial)) * bs, len(full) * bs + sum(partial.values())

    def check_invariants(self, live: list[Request], held: list[int] = ()) -> None:
        """Reference counts equal the number of tables holding each block (plus its entries in
        ``held``: pins' references); hashes match tokens; a local table's NULL entries are a
        prefix before its window."""
        self.pool.check_invariants()
        counts: dict[int, int] = {}
        for bid in held:
            counts[bid] = counts.get(bid, 0) + 1
        for tables in self.group_tables:
            for table in tables.values():
                for bid in table:
                    counts[bid] = counts.get(bid, 0) + 1
        counts.pop(NULL, None)
        for blk in self.pool.blocks:
            assert blk.ref_cnt == counts.get(blk.block_id, 0), (blk, counts.get(blk.block_id))
        by_id = {r.request_id: r for r in live}
        assert set(self.tables) <= set(by_id), set(self.tables) - set(by_id)
        for g, tables in enumerate(self.group_tables):
            assert set(tables) == set(self.tables)
            for rid, table in tables.items():
                req = by_id[rid]
                assert len(table) == len(self.tables[rid]), (rid, g)
                nulls = sum(1 for b in table if b == NULL)
                budget = req.params.kv_budget if self.windows[g] is None else None  # local: its window
                if budget is not None and g:  # another global group: group 0's entries exactly
                    assert [b == NULL for b in table] == [b == NULL for b in self.tables[rid]], (rid, g)
                if budget is not None and self.eviction in SCORED:
                    # within the budget once evicting (SnapKV: after its prompt); recent ones kept
                    if self.eviction == "h2o" or req.num_computed_tokens > req.num_prompt_tokens:
                        assert len(table) - nulls <= budget_blocks(budget, self.block_size), (rid, table)
                    r = recent_blocks(self.eviction, budget, self.block_size)
                    assert NULL not in table[len(table) - r:], (rid, table)
                elif budget is not None:  # a run after the sinks, before the next query's recent blocks
                    lo = SINK_BLOCKS
                    assert all(b == NULL for b in table[lo:lo + nulls]), (rid, table)
                    assert not nulls or lo + nulls <= recent_start(budget, self.block_size,
                                                                   req.num_computed_tokens), (rid, table)
                else:
                    assert all(b == NULL for b in table[:nulls]), (rid, g, table)
                if nulls and budget is None:
                    assert self.windows[g] is not None, (rid, g)
                    assert nulls <= self.first_needed(g, req.num_computed_tokens), (rid, g, nulls)
                for i in range(self._num_hashed[rid]):
                    want = req.block_hashes[i]
                    if table[i] != NULL and self.pool.blocks[table[i]].block_hash is not None:
                        assert self.pool.blocks[table[i]].block_hash == group_key(want, g), (rid, g, i)
                    if g:
                        continue
                    parent = req.block_hashes[i - 1] if i else salt_root(req.cache_salt)
                    toks = req.all_token_ids[i * self.block_size:(i + 1) * self.block_size]
                    assert want == hash_block(parent, self.hash_extra, toks), (rid, i)

"""Property-based tests of BlockPool: a state machine checked against a plain reference model.

The model keeps, per block, its reference count and hash, the free queue in LRU order and the
hash -> block map. After every rule the pool must agree with the model, pass its own
``check_invariants`` and leak nothing (free + in use == num_blocks).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.engine.block_pool import BlockPool

HASHES = [bytes([i]) * 4 for i in range(12)]  # a small hash space, so collisions happen


class BlockPoolMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 12), enable_caching=st.booleans())
    def setup(self, num_blocks, enable_caching):
        self.pool = BlockPool(num_blocks, enable_caching)
        # Reference model.
        self.ref = [0] * num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        self.free_order: list[int] = list(range(num_blocks))  # front = next to hand out
        self.cached: dict[bytes, int] = {}
        self.evictions = 0

    # -- helpers ---------------------------------------------------------------------------
    def _in_use(self) -> list[int]:
        return [b for b, r in enumerate(self.ref) if r > 0]

    def _model_free(self, bid: int) -> None:
        assert self.ref[bid] > 0
        self.ref[bid] -= 1
        if self.ref[bid] == 0:
            self.free_order.append(bid)

    # -- rules -----------------------------------------------------------------------------
    @rule(data=st.data())
    def allocate(self, data):
        n = data.draw(st.integers(0, self.pool.num_blocks + 1), label="n")
        if n > len(self.free_order):
            before = (list(self.pool.free_queue), dict(self.pool.cached))
            with pytest.raises(RuntimeError):
                self.pool.allocate(n)
            # A failed allocation changes nothing.
            assert (list(self.pool.free_queue), dict(self.pool.cached)) == before
            return
        got = self.pool.allocate(n)
        want = self.free_order[:n]
        del self.free_order[:n]
        assert got == want, "allocation must take the least recently freed blocks first"
        assert len(set(got)) == n
        for b in got:
            assert self.ref[b] == 0
            self.ref[b] = 1
            if self.hash[b] is not None:  # evicted
                del self.cached[self.hash[b]]
                self.hash[b] = None
                self.evictions += 1

    @precondition(lambda self: any(r > 0 for r in self.ref) or self.cached)
    @rule(data=st.data())
    def touch(self, data):
        # Touch in-use blocks and/or cached free blocks (a prefix hit revives them).
        candidates = sorted(set(self._in_use()) | set(self.cached.values()))
        bids = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=4, unique=True),
                         label="bids")
        self.pool.touch(bids)
        for b in bids:
            if self.ref[b] == 0:
                self.free_order.remove(b)
            self.ref[b] += 1

    @precondition(lambda self: any(r > 0 for r in self.ref))
    @rule(data=st.data())
    def free(self, data):
        in_use = self._in_use()
        bids = data.draw(st.lists(st.sampled_from(in_use), min_size=1, max_size=len(in_use), unique=True),
                         label="bids")
        self.pool.free(bids)
        for b in bids:
            self._model_free(b)

    @rule(data=st.data())
    def double_free(self, data):
        # Freeing a block with no reference left must raise.
        free_now = list(self.free_order)
        if not free_now:
            return
        b = data.draw(st.sampled_from(free_now), label="bid")
        with pytest.raises(RuntimeError, match="double free"):
            self.pool.free([b])
        assert self.pool.blocks[b].ref_cnt == 0

    @precondition(lambda self: any(r > 0 for r in self.ref))
    @rule(data=st.data(), h=st.sampled_from(HASHES))
    def cache_block(self, data, h):
        b = data.draw(st.sampled_from(self._in_use()), label="bid")
        self.pool.cache_block(b, h)
        if self.pool.enable_caching and self.hash[b] is None and h not in self.cached:
            self.hash[b] = h
            self.cached[h] = b

    @rule(h=st.sampled_from(HASHES))
    def lookup(self, h):
        got = self.pool.lookup(h)
        want = self.cached.get(h) if self.pool.enable_caching else None
        assert got == want
        if got is not None:
            assert self.pool.blocks[got].block_hash == h

    @rule()
    def reset_prefix_cache(self):
        self.pool.reset_prefix_cache()
        for b in self.cached.values():
            self.hash[b] = None
        self.cached.clear()

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def agrees_with_model(self):
        pool = self.pool
        pool.check_invariants()
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        assert pool.num_used_blocks == sum(1 for r in self.ref if r > 0), "leaked or lost a block"
        assert list(pool.free_queue) == self.free_order
        assert [b.ref_cnt for b in pool.blocks] == self.ref
        assert [b.block_hash for b in pool.blocks] == self.hash
        assert pool.cached == self.cached
        assert pool.num_cached_blocks == len(self.cached)
        assert pool.num_evictions == self.evictions
        if not pool.enable_caching:
            assert not pool.cached


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])


# -- plain properties ---------------------------------------------------------------------------
def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0)


@settings(max_examples=100, deadline=None)
@given(num_blocks=st.integers(1, 16), data=st.data())
def test_allocate_then_free_everything_returns_the_pool(num_blocks, data):
    pool = BlockPool(num_blocks)
    taken = []
    while pool.num_free_blocks:
        n = data.draw(st.integers(1, pool.num_free_blocks))
        taken += pool.allocate(n)
        pool.check_invariants()
    assert sorted(taken) == list(range(num_blocks))
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    order = data.draw(st.permutations(taken))
    pool.free(list(order))
    pool.check_invariants()
    assert pool.num_used_blocks == 0
    assert list(pool.free_queue) == list(order), "freed blocks join the back of the LRU queue"
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([order[0]])


def test_cached_free_block_is_revived_by_touch_and_evicted_lru():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache_block(a, b"A")
    pool.cache_block(b, b"B")
    pool.free([c, b, a])  # tail first: c is evicted first, then b, then a
    pool.check_invariants()
    assert pool.num_used_blocks == 0 and pool.num_cached_blocks == 2
    # A prefix hit revives a cached free block without evicting it.
    assert pool.lookup(b"A") == a
    pool.touch([a])
    assert pool.blocks[a].ref_cnt == 1 and a not in pool.free_queue
    pool.check_invariants()
    # Allocation takes c (never cached) then b (cached -> evicted).
    assert pool.allocate(2) == [c, b]
    assert pool.lookup(b"B") is None and pool.num_evictions == 1
    assert pool.lookup(b"A") == a
    pool.check_invariants()


def test_first_writer_wins():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"h")
    pool.cache_block(b, b"h")  # same content elsewhere: not registered twice
    pool.cache_block(a, b"other")  # a block keeps its first hash
    assert pool.cached == {b"h": a}
    assert pool.blocks[b].block_hash is None and pool.blocks[a].block_hash == b"h"
    pool.check_invariants()


def test_caching_disabled_never_caches():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"h")
    assert pool.lookup(b"h") is None and pool.num_cached_blocks == 0
    pool.check_invariants()

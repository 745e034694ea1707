"""The router's prefix index and rule (kvserve/cluster/prefix_index.py): no Ray, no model."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from kvserve.cluster.prefix_index import Load, PrefixIndex, block_hashes
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Request
from kvserve.sampling_params import SamplingParams

pytestmark = pytest.mark.unit

BS = 4


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n)]


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_block_hashes_are_the_prefix_cache_chain(salt):
    """The router's hashes are the KV cache manager's own, block for block (same salt, no extra)."""
    toks = _tokens(1, 10 * BS + 3)
    kv = KVCacheManager(64, BS, hash_extra=b"")
    req = Request("r", toks, SamplingParams(max_tokens=1))
    req.cache_salt = salt
    kv._update_hashes(req)
    assert block_hashes(toks, BS, salt) == req.block_hashes
    assert len(req.block_hashes) == 10
    assert block_hashes(toks, BS, "other")[0] != req.block_hashes[0]  # a salt shares nothing


def test_a_prompt_goes_where_its_prefix_is():
    idx = PrefixIndex(block_size=BS)
    a, b = _tokens(2, 40 * BS), _tokens(3, 40 * BS)
    ha, hb = block_hashes(a, BS), block_hashes(b, BS)
    idx.record("r0", ha)
    idx.record("r1", hb)
    follow_b = block_hashes(b + _tokens(4, 8 * BS), BS)
    assert idx.matched("r1", follow_b) == 40 and idx.matched("r0", follow_b) == 0
    assert idx.choose(["r0", "r1"], follow_b, 48 * BS, {}) == ["r1", "r0"]
    # Nothing cached anywhere: the least loaded first.
    fresh = block_hashes(_tokens(5, 8 * BS), BS)
    assert idx.choose(["r0", "r1"], fresh, 8 * BS, {"r0": Load(3), "r1": Load(1)})[0] == "r1"


def test_a_hot_prefix_spills_once_its_queue_costs_more_than_the_prefill():
    idx = PrefixIndex(block_size=BS, queue_weight=64.0)
    hot = block_hashes(_tokens(6, 32 * BS), BS)  # 128 tokens saved on the holder
    idx.record("r0", hot)
    assert idx.choose(["r0", "r1"], hot, 32 * BS, {"r0": Load(1), "r1": Load(0)})[0] == "r0"
    assert idx.choose(["r0", "r1"], hot, 32 * BS, {"r0": Load(3), "r1": Load(0)})[0] == "r1"
    # A replica out of KV loses its prefix advantage.
    assert idx.choose(["r0", "r1"], hot, 32 * BS, {"r0": Load(0, kv_free=0.01), "r1": Load(2)})[0] == "r1"


def test_a_session_sticks_to_its_replica_while_it_is_a_candidate():
    idx = PrefixIndex(block_size=BS)
    idx.record("r1", block_hashes(_tokens(7, 8 * BS), BS), session="t/s1")
    other = block_hashes(_tokens(8, 16 * BS), BS)
    idx.record("r0", other)
    assert idx.choose(["r0", "r1"], other, 16 * BS, {"r1": Load(9)}, session="t/s1")[0] == "r1"
    assert idx.choose(["r0", "r2"], other, 16 * BS, {}, session="t/s1")[0] == "r0"  # r1 gone: by prefix
    idx.forget("r1")
    assert "t/s1" not in idx.sessions and "r1" not in idx.held


@settings(max_examples=60, deadline=None)
@given(hs.lists(hs.tuples(hs.sampled_from(["r0", "r1", "r2"]), hs.integers(0, 30), hs.integers(0, 12),
                          hs.integers(1, 40)), min_size=1, max_size=40))
def test_index_stays_within_capacity_and_matches_a_prefix(ops):
    """Invariant 1 after every operation; a match is always a leading run of recorded hashes."""
    idx = PrefixIndex(block_size=BS)
    for replica, seed, nblocks, cap in ops:
        idx.set_capacity(replica, cap)
        hashes = block_hashes(_tokens(seed % 5, nblocks * BS), BS)
        idx.record(replica, hashes)
        for r, held in idx.held.items():
            assert len(held) <= idx.capacity.get(r, idx.default_capacity)
        m = idx.matched(replica, hashes)
        assert all(h in idx.held[replica] for h in hashes[:m])
        assert m == len(hashes) or hashes[m] not in idx.held[replica]
    idx.keep_only({"r0"})
    assert set(idx.held) <= {"r0"} and all(r == "r0" for r in idx.sessions.values())


def test_a_conversation_stays_home_until_its_replica_is_much_busier():
    """Continuous batching: a request a replica is running costs a newcomer a decode row per
    step, so 400 cached tokens keep a conversation home while its replica runs six more requests
    than another, and not at eighteen more."""
    idx = PrefixIndex(block_size=BS)
    history = _tokens(9, 100 * BS)  # 400 tokens cached on r0
    idx.record("r0", block_hashes(history, BS))
    turn = block_hashes(history + _tokens(10, 2 * BS), BS)
    assert idx.choose(["r0", "r1"], turn, 102 * BS, {"r0": Load(8), "r1": Load(2)})[0] == "r0"
    assert idx.choose(["r0", "r1"], turn, 102 * BS, {"r0": Load(20), "r1": Load(2)})[0] == "r1"

"""Pinned prefixes (``engine/prefix_pins.py``): under memory pressure a pinned prefix stays a
prefix-cache hit while an unpinned one is evicted; pins stay within their share of the pool,
least recently used first out; a pin is scoped by ``cache_salt``; every block comes back free
once pins are released and requests finish. Hits are read from ``num_cached_tokens``."""
from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.errors import ConfigError

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
BS = 16


def _ids(seed: int, n: int) -> list[int]:
    return random.Random(seed).choices(range(1, 250), k=n)


def _cached(llm, ids, salt=None) -> int:
    p = {"prompt_token_ids": ids} if salt is None else {"prompt_token_ids": ids, "cache_salt": salt}
    return llm.generate(p, ONE, use_tqdm=False)[0].num_cached_tokens


def _pressure(llm, seed: int) -> None:
    """Unrelated prompts that together fill the whole pool several times over."""
    n = llm.engine.num_kv_blocks * BS * 3 // 96 + 1
    for i in range(n):
        _cached(llm, _ids(10_000 * seed + i, 96))


@pytest.fixture
def llm():
    # A pool of a few dozen blocks, so a handful of prompts evicts everything unpinned.
    llm = LLM(model="dummy:tiny", kv_cache_memory="320KiB", block_size=BS, show_progress=False,
              max_model_len=256, max_pinned_fraction=0.25)
    assert 32 <= llm.engine.num_kv_blocks <= 64, llm.engine.num_kv_blocks
    return llm


def _all_free(llm) -> bool:
    pool = llm.engine.kv.pool
    return pool.num_free_blocks == pool.num_blocks


def test_pinned_prefix_survives_pressure_unpinned_is_evicted(llm):
    pinned, unpinned = _ids(1, 3 * BS + 5), _ids(2, 3 * BS + 5)
    assert llm.pin_prefix(pinned) == 3 * BS
    assert _cached(llm, unpinned) == 0
    assert llm.engine.pins.num_blocks == 3
    _pressure(llm, 1)
    llm.engine.check_invariants()
    assert _cached(llm, pinned + _ids(3, 20)) == 3 * BS
    assert _cached(llm, unpinned + _ids(4, 20)) == 0
    # Released: the same pressure evicts it too, and nothing is left held.
    assert llm.unpin() == 1 and llm.engine.pins.num_blocks == 0
    llm.engine.check_invariants()
    assert _all_free(llm)
    _pressure(llm, 2)
    assert _cached(llm, pinned + _ids(5, 20)) == 0
    assert _all_free(llm)


def test_pins_stay_within_budget_oldest_out_first(llm):
    budget = llm.engine.pins.max_blocks
    assert budget == int(0.25 * llm.engine.num_kv_blocks) >= 6
    prefixes = [_ids(100 + i, 2 * BS) for i in range(budget)]  # 2 blocks each: twice the budget
    for i, p in enumerate(prefixes):
        assert llm.pin_prefix(p, owner=f"o{i}") == 2 * BS
        assert llm.engine.pins.num_blocks <= budget
        llm.engine.check_invariants()
    kept = budget // 2
    _pressure(llm, 3)
    hits = [_cached(llm, p + [7]) for p in prefixes]
    assert hits == [0] * (budget - kept) + [2 * BS] * kept, hits
    # One prefix longer than the whole budget: pinned up to the budget, every other pin gone.
    assert llm.pin_prefix(_ids(200, (budget + 2) * BS + 3), owner="long") == budget * BS
    assert llm.engine.pins.num_blocks == budget and len(llm.engine.pins.pins) == 1
    for i in range(budget):
        assert llm.unpin(f"o{i}") == 0
    assert llm.unpin("long") == 1
    assert _all_free(llm)


def test_pin_is_scoped_by_cache_salt(llm):
    ids = _ids(7, 2 * BS + 1)
    assert llm.pin_prefix({"prompt_token_ids": ids, "cache_salt": "tenant-a"}, owner="a") == 2 * BS
    # The same tokens under another salt, or none, find nothing to pin and no hit.
    assert llm.engine.pin_prefix(ids, "b", cache_salt="tenant-b") == 0
    assert llm.engine.pin_prefix(ids, "c") == 0
    _pressure(llm, 4)
    assert _cached(llm, ids + [9], "tenant-b") == 0
    assert _cached(llm, ids + [9]) == 0
    assert _cached(llm, ids + [9], "tenant-a") == 2 * BS
    assert llm.unpin("a") == 1
    assert _all_free(llm)


def test_pin_expires_after_its_ttl(llm):
    now = [0.0]
    pins = llm.engine.pins
    pins.clock = lambda: now[0]
    ids = _ids(8, 2 * BS)
    assert llm.pin_prefix(ids, owner="x") == 2 * BS
    now[0] = pins.ttl - 1
    assert llm.pin_prefix(ids, owner="y") == 2 * BS  # used again: the TTL starts over
    now[0] = 2 * pins.ttl - 2
    _cached(llm, _ids(9, 20))  # a step expires what is due
    assert pins.num_blocks == 2
    now[0] = 2 * pins.ttl
    _cached(llm, _ids(9, 20))
    assert pins.num_blocks == 0 and not pins.pins
    assert _all_free(llm)


@pytest.mark.parametrize("kw", [dict(max_pinned_fraction=-0.1), dict(max_pinned_fraction=float("nan")),
                                dict(max_pinned_fraction=1.0), dict(pin_ttl_seconds=0),
                                dict(pin_ttl_seconds=float("inf"))])
def test_bad_pin_config_is_refused_naming_it(kw):
    with pytest.raises(ConfigError, match=next(iter(kw))):
        LLM(model="dummy:tiny", kv_cache_memory="96KiB", show_progress=False, **kw)


def test_window_groups_pin_only_what_a_hit_needs(tmp_path):
    from test_window_kv import GLOBAL, LOCAL, make_gemma3
    _, path = make_gemma3(tmp_path, [LOCAL, LOCAL, GLOBAL], window=16)  # groups: global, local, local
    llm = LLM(path, show_progress=False, kv_cache_memory="128KiB", block_size=8, max_model_len=256,
              max_pinned_fraction=0.5)
    eng = llm.engine
    assert eng.kv.windows == (None, 16, 16) and 40 <= eng.num_kv_blocks <= 160, (eng.kv.windows, eng.num_kv_blocks)
    prefix = _ids(11, 64 + 3)
    assert llm.pin_prefix(prefix) == 64
    # All 8 global blocks; of each local group only blocks 6 and 7, the window of a query at token 64.
    assert eng.pins.num_blocks == 8 + 2 + 2
    other = _ids(13, 64 + 3)
    assert _cached(llm, other) == 0
    n = eng.num_kv_blocks * 8 * 3 // 96 + 1
    for i in range(n):
        _cached(llm, _ids(20_000 + i, 96))
    eng.check_invariants()
    assert _cached(llm, prefix + _ids(12, 10)) == 64
    assert _cached(llm, other + _ids(12, 10)) == 0
    assert llm.unpin() == 1
    eng.check_invariants()
    assert _all_free(llm)


def test_pins_give_way_to_a_request_that_needs_their_blocks():
    llm = LLM(model="dummy:tiny", kv_cache_memory="320KiB", block_size=BS, show_progress=False,
              max_model_len=1024, max_pinned_fraction=0.5)
    eng = llm.engine
    for i in range(eng.pins.max_blocks // 2):
        assert llm.pin_prefix(_ids(300 + i, 2 * BS), owner=f"o{i}") == 2 * BS
    assert eng.pins.num_blocks == eng.pins.max_blocks
    big = _ids(400, (eng.num_kv_blocks - 2) * BS)  # fits the pool only with the pinned blocks back
    out = llm.generate({"prompt_token_ids": big}, ONE, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1
    assert eng.pins.num_blocks == 0
    eng.check_invariants()
    assert _all_free(llm)

"""What keeps multi-turn conversations with the tiers on as fast as with them off:

- a block leaving the GPU is not copied to the tiers again when they already hold its KV (keys
  are content hashes);
- a session's own next turn keeps its history on the GPU instead of moving it off and back;
- idle offload leaves on the GPU the blocks that a staying session shares (a system prompt);
- the prefill speed that the load-or-recompute choice compares with leaves out the tier copies.

The CPU tier's pinned slots (one copy into a slab instead of a pinned allocation per chunk) are
exercised here on the CPU with unpinned slots: same code path, same reuse of slots. Idle time
passes on a fake clock (``llm.engine.sessions.clock``).
"""
from __future__ import annotations

import time

import torch
from tierutil import (
    CPU_BIG,
    KV_SESSIONS,
    KV_SMALL,
    ONE,
    FakeClock,
    blocks,
    evict_from_gpu,
    favor_loading,
    gen,
    prefix_keys,
)

from kvserve.kvtier.store import CostModel
from kvserve.kvtier.tiers import CpuTier

IDLE = 0.5


def _spy_copies(llm) -> list[bytes]:
    """Every key whose KV is copied out of the GPU (evictions, session turns and idle sessions
    all go through ``TieredStore.offload``)."""
    copied: list[bytes] = []
    store = llm.engine.store
    real_offload = store.offload

    def offload(data, blocks, *a, **kw):
        copied.extend(k for _, k in blocks if not store.holds(k))
        return real_offload(data, blocks, *a, **kw)
    store.offload = offload
    return copied


def _turns(llm, prompts, sid: str, first: list[int], n: int, reference, between=None) -> list[int]:
    """``n`` turns of one conversation; each checked against recomputation. Returns the history."""
    history = list(first)
    for t in range(n):
        out = gen(llm, history, session_id=sid)
        assert out.outputs[0].token_ids == reference(history), (sid, t)
        history += list(out.outputs[0].token_ids) + prompts.tail[3 * t:3 * t + 3]
        if between is not None:
            between()
    return history


def test_kv_leaves_the_gpu_once_per_key(make_llm, prompts, reference):
    """A conversation whose KV is evicted from the GPU after every turn: each turn loads its
    history from the CPU tier, and no key is ever copied out of the GPU twice (the tiers hold
    it after the first copy), not again on every eviction of a loaded block."""
    llm = make_llm(kv_cache_memory=KV_SMALL, cpu_kv_memory=CPU_BIG, idle_offload_seconds=3600)
    favor_loading(llm)
    copied = _spy_copies(llm)
    store = llm.engine.store
    history: list[int] = []
    hist = _turns(llm, prompts, "s1", prompts.a, 3, reference,
                  between=lambda: (history.append(1), evict_from_gpu(llm, prompts.prefix, seed=len(history))))
    assert len(copied) == len(set(copied)), "a key was copied out of the GPU twice"
    assert store.load_stats.offloads_skipped > 0
    assert store.load_stats.session_blocks_written > 0
    assert store.load_stats.tokens_loaded["cpu"] > 0
    out = gen(llm, hist, ONE, session_id="s1")
    assert out.metrics.num_loaded_tokens + out.metrics.num_cached_tokens >= 16 * (len(hist) // 16 - 1)
    llm.engine.check_invariants()
    store.cpu.check_invariants()


def test_idle_offload_keeps_blocks_a_staying_session_shares(make_llm, prompts, reference):
    """Two sessions share a system prompt (the 19-block prefix). One goes idle while the other
    is pinned: only the idle one's own blocks leave the GPU; the shared prefix stays, and the
    idle session's next turn gets it from the GPU and its own blocks from the CPU tier (the
    shared blocks do not leave, taking the pinned session's prefix with them)."""
    llm = make_llm(kv_cache_memory=KV_SESSIONS, cpu_kv_memory=CPU_BIG, idle_offload_seconds=IDLE)
    clock = llm.engine.sessions.clock = FakeClock()
    favor_loading(llm)
    eng, pool = llm.engine, llm.engine.kv.pool
    eng.pin_session("s2")
    out_a = gen(llm, prompts.a, session_id="s1")
    out_b = gen(llm, prompts.b, session_id="s2")
    shared = prefix_keys(llm, prompts.prefix)
    keys_a = prefix_keys(llm, list(prompts.a) + list(out_a.outputs[0].token_ids)[:-1])
    own_a = [k for k in keys_a if k not in shared]
    assert own_a and len(shared) == 19
    clock.advance(IDLE + 0.3)
    eng.offload_idle_sessions()  # (or a step already did, during s2's turn)
    assert "s1" not in eng.sessions and eng.store.load_stats.idle_offloaded_blocks == len(own_a)
    assert all(pool.lookup(k) is None for k in own_a)
    assert all(pool.lookup(k) is not None for k in shared)  # s2 (pinned) still holds them
    p2 = list(prompts.a) + list(out_a.outputs[0].token_ids) + prompts.tail[:6]
    out2 = gen(llm, p2, session_id="s1")
    assert out2.metrics.num_cached_tokens == 16 * len(shared)
    assert out2.metrics.num_loaded_tokens == 16 * len(own_a)
    assert out2.outputs[0].token_ids == reference(p2)
    pb2 = list(prompts.b) + list(out_b.outputs[0].token_ids) + prompts.tail[:6]
    assert gen(llm, pb2, session_id="s2").outputs[0].token_ids == reference(pb2)
    eng.check_invariants()


def test_a_newcomer_keeps_the_prefix_it_shares_with_an_idle_session(make_llm, prompts, reference):
    """An idle session's prefix is hit by a new request in the step where the session is found
    idle: the idle check runs after scheduling, so the newcomer holds those blocks and they stay
    on the GPU (were the check to run first, the newcomer would load them back)."""
    llm = make_llm(kv_cache_memory=KV_SESSIONS, cpu_kv_memory=CPU_BIG, idle_offload_seconds=IDLE)
    clock = llm.engine.sessions.clock = FakeClock()
    favor_loading(llm)
    shared = prefix_keys(llm, prompts.prefix)
    gen(llm, prompts.a, session_id="s1")
    clock.advance(IDLE + 0.3)
    out = gen(llm, prompts.b, session_id="s2")
    assert out.metrics.num_cached_tokens == 16 * len(shared)
    assert out.metrics.num_loaded_tokens == 0
    assert "s1" not in llm.engine.sessions  # s1 did leave, without its shared prefix
    assert llm.engine.store.load_stats.idle_offloaded_blocks > 0
    assert all(llm.engine.kv.pool.lookup(k) is not None for k in shared)
    assert out.outputs[0].token_ids == reference(prompts.b)


def test_prefill_speed_leaves_out_the_tier_copies(make_llm, prompts, reference):
    """The step time fed to the cost model leaves out the loads and the copies out to the
    tiers. Here each load and each write at the end of a turn takes 0.3 s more: the steps
    that had them are fed at least that much less than they took, not the whole step. (Real
    sleeps: the engine times its steps with the real clock.)"""
    llm = make_llm(kv_cache_memory=KV_SMALL, cpu_kv_memory=CPU_BIG, idle_offload_seconds=3600)
    eng, store = llm.engine, llm.engine.store
    seen: list[tuple[float, float, float]] = []  # (step time, seconds fed, delay injected)
    injected = [0.0]
    real_step, real_observe = eng.step, store.cost.observe_prefill
    real_loaded, real_put_from = store.loaded, store.cpu.put_from

    def step(*a, **kw):
        injected[0] = 0.0
        return real_step(*a, **kw)

    def observe(tokens, seconds):
        seen.append((eng.stats.last.step_time, seconds, injected[0]))
        real_observe(tokens, seconds)

    def slow_loaded(run, seconds):
        time.sleep(0.3)
        injected[0] += 0.3
        real_loaded(run, seconds + 0.3)

    def slow_put_from(items, *a, **kw):
        time.sleep(0.3)
        injected[0] += 0.3
        return real_put_from(items, *a, **kw)
    eng.step, store.cost.observe_prefill = step, observe
    store.loaded, store.cpu.put_from = slow_loaded, slow_put_from
    store.cost.prefill_tokens_per_s = 50.0  # loading wins whatever the measurement says
    store.cost.full_weight_tokens = 1 << 30  # (and the measurements barely move it)
    # One token a turn: the prompt's step is also the turn's last, where its blocks are written.
    gen(llm, prompts.a, ONE, session_id="s1")
    evict_from_gpu(llm, prompts.prefix)
    eng.flush_kv_to_tiers()  # the floods' blocks too: s2's step evicts them without a runner copy
    p2 = list(prompts.prefix) + prompts.tail  # 44 tokens to compute after the loaded prefix
    out = gen(llm, p2, ONE, session_id="s2")
    assert out.metrics.num_loaded_tokens > 0
    assert out.outputs[0].token_ids == reference(p2)[:1]
    assert store.load_stats.session_blocks_written > 0
    delayed = [(t, s, d) for t, s, d in seen if d > 0]
    assert len(delayed) >= 2, seen  # s1's prompt (a write), s2's (a load, a write)
    assert any(d >= 0.6 for _, _, d in delayed), seen
    assert all(t - s >= d - 0.01 for t, s, d in delayed), delayed


def test_cost_model_weights_small_prefills_less():
    cm = CostModel(prefill_tokens_per_s=10_000.0, full_weight_tokens=512)
    cm.observe_prefill(64, 0.064)  # 1k tokens/s, mostly the step's fixed cost
    small = cm.prefill_tokens_per_s
    assert 10_000 > small > 10_000 - 0.3 * 9_000 / 4
    cm2 = CostModel(prefill_tokens_per_s=10_000.0, full_weight_tokens=512)
    cm2.observe_prefill(1024, 1.024)
    assert cm2.prefill_tokens_per_s < small


# -- the CPU tier's slots ----------------------------------------------------------------------------
def _chunk(seed: int, shape=(2, 2, 4, 2, 8), dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_slots_are_reused_and_never_mix_contents():
    class Tier(CpuTier):
        SLAB_BYTES = 3 * 1024  # slabs of 3 slots of 1 KiB

    shape = (2, 2, 4, 2, 8)  # 256 floats = 1 KiB
    tier = Tier(8 * 1024, slot_bytes=1024)
    keys = [bytes([i]) * 16 for i in range(30)]
    for i, k in enumerate(keys):
        assert tier.put(k, _chunk(i, shape))
        tier.check_invariants()
        assert tier.num_slots <= 8
    assert len(tier.chunks) == 8 and tier.num_slots == 8 and len(tier.slabs) == 3
    for i, k in enumerate(keys[-8:], start=22):
        assert torch.equal(tier.get(k), _chunk(i, shape))
    # put_from (the store's path out of the GPU) into reused slots, and a pinned chunk survives
    tier.get(keys[-1], pin=True)
    stored = tier.put_from([(bytes([100 + i]) * 16, _chunk(100 + i, shape)) for i in range(10)])
    assert len(stored) == 10 and keys[-1] in tier
    tier.check_invariants()
    assert torch.equal(tier.get(keys[-1]), _chunk(29, shape))
    for i in range(3, 10):
        assert torch.equal(tier.get(bytes([100 + i]) * 16), _chunk(100 + i, shape))
    # other sizes still go in plainly
    assert tier.put(b"x" * 16, torch.ones(10)) and b"x" * 16 not in tier.slot_of
    tier.discard(keys[-1])
    assert keys[-1] in tier  # still pinned
    tier.unpin(keys[-1])
    tier.clear()
    tier.check_invariants()
    assert not tier.chunks and len(tier.free_slots) == tier.num_slots


def test_slots_grown_ahead_on_a_background_thread():
    class Tier(CpuTier):
        SLAB_BYTES = 4 * 1024

    tier = Tier(64 * 1024, slot_bytes=1024, grow_ahead=True)
    deadline = time.monotonic() + 10
    for i in range(40):
        assert tier.put(bytes([i]) * 16, _chunk(i))
        while tier._growing and time.monotonic() < deadline:
            time.sleep(0.001)
        tier.check_invariants()
    assert tier.num_slots <= 64 and len(tier.chunks) == 40
    for i in range(40):
        assert torch.equal(tier.get(bytes([i]) * 16), _chunk(i))


def test_engine_with_slotted_cpu_tier_matches_recompute(make_llm, prompts, reference):
    """The GPU configuration (chunks in slots of a few slabs, grown ahead) on the CPU, under a
    tier so small that slots are reused: several sessions, evictions, loads, idle offload."""
    llm = make_llm(kv_cache_memory=KV_SMALL, cpu_kv_memory=blocks(34), idle_offload_seconds=IDLE)
    clock = llm.engine.sessions.clock = FakeClock()
    store = llm.engine.store

    class Tier(CpuTier):
        SLAB_BYTES = 8 * store.chunk_bytes

    store.cpu = store.staging = Tier(store.cpu.capacity, False, store.chunk_bytes, grow_ahead=True)
    favor_loading(llm)
    for r in range(2):
        for sid, first in (("s1", prompts.a), ("s2", prompts.c)):
            _turns(llm, prompts, f"{sid}-{r}", first, 2, reference,
                   between=lambda seed=r + 7: evict_from_gpu(llm, prompts.prefix, seed=seed))
        clock.advance(IDLE + 0.1)
    assert store.cpu.num_slots == store.cpu.max_slots  # every slot in use, reused since
    assert store.load_stats.tokens_loaded["cpu"] > 0
    llm.engine.check_invariants()
    store.cpu.check_invariants()

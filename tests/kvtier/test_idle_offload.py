"""Sessions: a conversation idle for ``idle_offload_seconds`` leaves the GPU for the tiers, and
its next turn loads it back, with the output of plain recomputation. Idle time passes on a fake
clock (``llm.engine.sessions.clock``)."""
from __future__ import annotations

import threading

from tierutil import CPU_BIG, GREEDY, KV_SESSIONS, ONE, FakeClock, favor_loading, gen, prefix_keys

IDLE = 0.5


def _engine(make_llm, **kw):
    llm = make_llm(kv_cache_memory=KV_SESSIONS, idle_offload_seconds=IDLE, **kw)
    clock = llm.engine.sessions.clock = FakeClock()
    return llm, clock


def _turn2(prompts, turn1_prompt, turn1_output):
    return list(turn1_prompt) + list(turn1_output) + prompts.tail[:6]


def _first_turn(llm, prompts, reference, sid="s1"):
    favor_loading(llm)
    out1 = gen(llm, prompts.a, session_id=sid)
    assert out1.outputs[0].token_ids == reference(prompts.a)
    p2 = _turn2(prompts, prompts.a, out1.outputs[0].token_ids)
    keys = prefix_keys(llm, list(prompts.a) + list(out1.outputs[0].token_ids)[:-1])  # tokens with KV
    pool = llm.engine.kv.pool
    assert all(pool.lookup(k) is not None for k in keys)  # on the GPU after turn 1
    return p2, keys


def test_idle_sessions_own_next_turn_finds_it_on_the_gpu(make_llm, prompts, reference):
    """Nothing runs while the session is idle (offline API), then its next turn arrives: the
    session is active again and its history is served from the GPU prefix cache, not moved to
    the tiers by ``add_request`` and loaded straight back (a copy of its whole history out of
    the GPU and back in, for no GPU memory gained). Its KV is in the CPU tier all the same:
    written at the end of turn 1."""
    llm, clock = _engine(make_llm, cpu_kv_memory=CPU_BIG)
    p2, keys = _first_turn(llm, prompts, reference)
    store = llm.engine.store
    assert all(k in store.cpu for k in keys)
    assert store.load_stats.session_blocks_written == len(keys)
    clock.advance(IDLE + 0.3)
    out2 = gen(llm, p2, session_id="s1")
    load = store.load_stats
    assert load.idle_offloaded_blocks == 0
    assert out2.metrics.num_cached_tokens == 16 * len(keys)
    assert out2.metrics.num_loaded_tokens == 0
    assert out2.outputs[0].token_ids == reference(p2)
    llm.engine.check_invariants()


def test_idle_session_offloaded_while_the_engine_serves_others(make_llm, prompts, reference):
    """The same with other traffic during the idle time: the engine's step finds the session
    idle, moves its blocks to the CPU tier (they become plain free blocks on the GPU), and the
    next turn loads them."""
    llm, clock = _engine(make_llm, cpu_kv_memory=CPU_BIG)
    p2, keys = _first_turn(llm, prompts, reference)
    pool = llm.engine.kv.pool
    gen(llm, prompts.tail[:20], ONE)  # not yet idle: stays
    assert llm.engine.store.load_stats.idle_offloaded_blocks == 0
    assert all(pool.lookup(k) is not None for k in keys)
    clock.advance(IDLE + 0.3)
    gen(llm, prompts.tail[:21], ONE)  # another client's request: the step checks for idle sessions
    load = llm.engine.store.load_stats
    assert load.idle_offloaded_blocks == len(keys)
    assert all(pool.lookup(k) is None for k in keys)  # left the GPU prefix cache
    assert all(k in llm.engine.store.cpu for k in keys)
    assert "s1" not in llm.engine.sessions

    out2 = gen(llm, p2, session_id="s1")
    assert out2.metrics.num_cached_tokens == 0
    assert out2.metrics.num_loaded_tokens == 16 * len(keys)
    assert load.tokens_loaded["cpu"] == 16 * len(keys)
    assert out2.outputs[0].token_ids == reference(p2)
    assert "s1" in llm.engine.sessions  # its second turn is tracked again
    llm.engine.check_invariants()


def test_pinned_session_stays_on_the_gpu(make_llm, prompts, reference):
    llm, clock = _engine(make_llm, cpu_kv_memory=CPU_BIG)
    llm.engine.pin_session("s1")
    p2, keys = _first_turn(llm, prompts, reference)
    clock.advance(IDLE + 0.3)
    gen(llm, prompts.tail[:21], ONE)
    assert llm.engine.store.load_stats.idle_offloaded_blocks == 0
    assert all(llm.engine.kv.pool.lookup(k) is not None for k in keys)
    out2 = gen(llm, p2, session_id="s1")
    assert out2.metrics.num_cached_tokens == 16 * len(keys) and out2.metrics.num_loaded_tokens == 0
    assert out2.outputs[0].token_ids == reference(p2)


def test_forced_offload_of_all_sessions(make_llm, prompts, reference, tmp_path):
    """``offload_idle_sessions(force=True)`` (the server's offload endpoint) with only a disk
    tier: the blocks go to disk and the next turn loads them from there."""
    llm = make_llm(kv_cache_memory=KV_SESSIONS, disk_kv_dir=str(tmp_path / "kv"), idle_offload_seconds=3600)
    p2, keys = _first_turn(llm, prompts, reference)
    assert llm.engine.offload_idle_sessions() == 0  # not idle for an hour
    assert llm.engine.offload_idle_sessions(force=True) == len(keys)
    llm.engine.store.flush()
    assert all(k in llm.engine.store.disk for k in keys)
    out2 = gen(llm, p2, session_id="s1")
    assert out2.metrics.num_cached_tokens == 0
    assert out2.metrics.num_loaded_tokens == 16 * len(keys)
    assert llm.engine.store.load_stats.tokens_loaded["disk"] == 16 * len(keys)
    assert out2.outputs[0].token_ids == reference(p2)


def test_idle_offload_to_a_slow_disk_is_not_lost_for_the_next_turn(make_llm, prompts, reference, tmp_path):
    """The next turn arrives while the disk is still writing the session's blocks: the first
    few are on disk (and gone from memory), the rest still wait in memory for the writer."""
    llm, clock = _engine(make_llm, disk_kv_dir=str(tmp_path / "kv"))
    disk = llm.engine.store.disk
    real_put = disk.put
    done: list[bytes] = []
    stalled, go_on = threading.Event(), threading.Event()

    def slow_put(key, data):  # a disk that writes 5 chunks, then stalls until the turn is served
        if len(done) == 5:
            stalled.set()
            go_on.wait(60)
        ok = real_put(key, data)
        done.append(key)
        return ok
    disk.put = slow_put
    try:
        p2, keys = _first_turn(llm, prompts, reference)  # its blocks are queued for the disk
        assert stalled.wait(60)
        clock.advance(IDLE + 0.3)
        assert llm.engine.offload_idle_sessions() == len(keys)  # (the server's idle tick)
        assert llm.engine.store._writes.unfinished_tasks > 0
        out2 = gen(llm, p2, session_id="s1")
    finally:
        go_on.set()
    assert out2.outputs[0].token_ids == reference(p2)
    assert llm.engine.store.load_stats.idle_offloaded_blocks == len(keys)
    assert out2.metrics.num_cached_tokens + out2.metrics.num_loaded_tokens == 16 * len(keys)


def test_a_salted_session_leaves_and_comes_back_for_its_salt_only(make_llm, prompts, reference):
    """Idle offload with a cache_salt: the session's blocks go to the CPU tier under salted keys;
    the same tokens under another salt load nothing, the session's next turn loads them all."""
    llm, clock = _engine(make_llm, cpu_kv_memory=CPU_BIG)
    favor_loading(llm)

    def run(tokens, salt, sid=None):
        return llm.generate({"prompt_token_ids": list(tokens), "cache_salt": salt}, GREEDY, use_tqdm=False,
                            session_id=sid)[0]

    out1 = run(prompts.a, "tenant-1", "s1")
    assert out1.outputs[0].token_ids == reference(prompts.a)
    p2 = _turn2(prompts, prompts.a, out1.outputs[0].token_ids)
    clock.advance(IDLE + 0.3)
    moved = llm.engine.offload_idle_sessions()
    assert moved == (len(prompts.a) + len(out1.outputs[0].token_ids) - 1) // 16
    other = run(p2, "tenant-2")
    assert (other.metrics.num_cached_tokens, other.metrics.num_loaded_tokens) == (0, 0)
    out2 = run(p2, "tenant-1", "s1")
    assert (out2.metrics.num_cached_tokens, out2.metrics.num_loaded_tokens) == (0, 16 * moved)
    assert out2.outputs[0].token_ids == other.outputs[0].token_ids == reference(p2)
    llm.engine.check_invariants()

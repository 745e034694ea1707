"""Greedy output is the same whether a long shared prefix comes from the GPU prefix cache, the CPU
tier, the disk tier, Redis, or is recomputed by a fresh engine without tiers; the metrics and tier
stats say which path it took. On the tiny model, and once on the default model's real weights."""
from __future__ import annotations

import pytest
from tierutil import (
    CPU_BIG,
    GREEDY,
    KV_SMALL,
    KV_SMALL_BLOCKS,
    LOADABLE,
    ONE,
    Reference,
    evict_from_gpu,
    favor_loading,
    forget_cpu_tier,
    gen,
    prefix_keys,
)

from kvserve import LLM, SamplingParams


def _tokens_loaded(llm) -> dict:
    return dict(llm.engine.store.snapshot()["load"]["tokens_loaded"])


def test_gpu_prefix_cache_and_cpu_tier(make_llm, prompts, reference):
    llm = make_llm(kv_cache_memory=KV_SMALL, cpu_kv_memory=CPU_BIG)
    favor_loading(llm)
    assert llm.engine.num_kv_blocks == KV_SMALL_BLOCKS  # one prompt fits, one flood evicts it
    ref_a, ref_b, ref_c = reference(prompts.a, prompts.b, prompts.c)

    first = gen(llm, prompts.a)
    assert first.metrics.num_cached_tokens == 0 and first.metrics.num_loaded_tokens == 0
    assert first.outputs[0].token_ids == ref_a

    # GPU prefix cache: the prefix is still on the GPU.
    hit = gen(llm, prompts.b)
    assert hit.metrics.num_cached_tokens == LOADABLE and hit.metrics.num_loaded_tokens == 0
    assert hit.outputs[0].token_ids == ref_b
    assert _tokens_loaded(llm) == {"cpu": 0, "disk": 0, "redis": 0}

    # CPU tier: evicted from the GPU, the prefix waits in CPU memory.
    evict_from_gpu(llm, prompts.prefix)
    stats = llm.engine.store.snapshot()
    assert stats["load"]["offloaded_blocks"] >= LOADABLE // 16
    keys = prefix_keys(llm, prompts.prefix)
    assert all(k in llm.engine.store.cpu for k in keys)
    out = gen(llm, prompts.c)
    assert out.metrics.num_cached_tokens == 0
    assert out.metrics.num_loaded_tokens == LOADABLE
    assert _tokens_loaded(llm) == {"cpu": LOADABLE, "disk": 0, "redis": 0}
    assert out.outputs[0].token_ids == ref_c
    llm.engine.store.cpu.check_invariants()
    assert not llm.engine.store.cpu.pins  # the loaded chunks were released

    # Prompt log-probs need every prompt position computed: no prefix may come from a tier.
    evict_from_gpu(llm, prompts.prefix, seed=2)
    assert all(k in llm.engine.store.cpu for k in keys)
    lp = gen(llm, prompts.b, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    assert lp.metrics.num_cached_tokens == 0 and lp.metrics.num_loaded_tokens == 0
    assert lp.prompt_logprobs[0] is None and len(lp.prompt_logprobs) == len(prompts.b)
    assert all(lp.prompt_logprobs[i] and prompts.b[i] in lp.prompt_logprobs[i] for i in range(1, len(prompts.b)))
    assert lp.outputs[0].token_ids == ref_b[:1]
    llm.engine.check_invariants()


def test_disk_tier(make_llm, prompts, reference, tmp_path):
    llm = make_llm(kv_cache_memory=KV_SMALL, disk_kv_dir=str(tmp_path / "kv"))
    favor_loading(llm)
    ref_a, ref_b = reference(prompts.a, prompts.b)
    assert gen(llm, prompts.a).outputs[0].token_ids == ref_a
    evict_from_gpu(llm, prompts.prefix)
    disk = llm.engine.store.disk
    keys = prefix_keys(llm, prompts.prefix)
    assert all(k in disk and (tmp_path / "kv" / k.hex()[:2] / f"{k.hex()}.kvc").is_file() for k in keys)

    out = gen(llm, prompts.b)
    assert out.metrics.num_cached_tokens == 0
    assert out.metrics.num_loaded_tokens == LOADABLE
    assert _tokens_loaded(llm) == {"cpu": 0, "disk": LOADABLE, "redis": 0}
    snap = llm.engine.store.snapshot()["disk"]
    assert snap["hits"] >= len(keys) and snap["corrupt"] == 0 and snap["bytes_out"] > 0
    assert 0 < snap["used_bytes"] <= snap["capacity_bytes"]
    assert out.outputs[0].token_ids == ref_b
    # Staged chunks are let go once on the GPU, and write-behind copies once written (the flush).
    llm.engine.store.flush()
    assert llm.engine.store.staging.used == 0

    # Two prompts with the prefix in one batch: it is read from disk once and shared on the GPU.
    evict_from_gpu(llm, prompts.prefix, seed=2)
    outs = llm.generate([{"prompt_token_ids": prompts.c}, {"prompt_token_ids": prompts.a}], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference(prompts.c, prompts.a)
    for o in outs:
        assert o.metrics.num_cached_tokens + o.metrics.num_loaded_tokens == LOADABLE
    assert sum(o.metrics.num_loaded_tokens for o in outs) == LOADABLE
    assert _tokens_loaded(llm) == {"cpu": 0, "disk": 2 * LOADABLE, "redis": 0}
    llm.engine.check_invariants()


def test_redis_tier(make_llm, prompts, reference, redis_server):
    llm = make_llm(kv_cache_memory=KV_SMALL, redis_url=redis_server)
    favor_loading(llm)
    ref_a, ref_b = reference(prompts.a, prompts.b)
    assert gen(llm, prompts.a).outputs[0].token_ids == ref_a
    evict_from_gpu(llm, prompts.prefix)
    r = redis_server.client()
    keys = prefix_keys(llm, prompts.prefix)
    assert all(r.exists(b"kvserve:kv:" + k.hex().encode()) for k in keys)

    out = gen(llm, prompts.b)
    assert out.metrics.num_cached_tokens == 0
    assert out.metrics.num_loaded_tokens == LOADABLE
    assert _tokens_loaded(llm) == {"cpu": 0, "disk": 0, "redis": LOADABLE}
    snap = llm.engine.store.snapshot()["redis"]
    assert snap["available"] and snap["hits"] >= len(keys) and snap["corrupt"] == 0
    assert out.outputs[0].token_ids == ref_b
    llm.engine.check_invariants()


def _nearest_tier_serves(llm, prompts, reference, redis_server):
    """With CPU, disk and Redis on, the chunks are written to all three and the CPU tier serves;
    with the CPU copies gone, the disk serves; with the disk copies gone too, Redis does."""
    favor_loading(llm)
    store = llm.engine.store
    keys = prefix_keys(llm, prompts.prefix)
    ref_a, ref_b, ref_c = reference(prompts.a, prompts.b, prompts.c)
    assert gen(llm, prompts.a).outputs[0].token_ids == ref_a
    evict_from_gpu(llm, prompts.prefix)
    assert all(k in store.cpu and k in store.disk and store.redis.contains(k) for k in keys)

    out = gen(llm, prompts.b)
    assert (out.metrics.num_cached_tokens, out.metrics.num_loaded_tokens) == (0, LOADABLE)
    assert _tokens_loaded(llm) == {"cpu": LOADABLE, "disk": 0, "redis": 0}
    assert out.outputs[0].token_ids == ref_b

    evict_from_gpu(llm, prompts.prefix, seed=2)
    forget_cpu_tier(llm)
    out = gen(llm, prompts.c)
    assert (out.metrics.num_cached_tokens, out.metrics.num_loaded_tokens) == (0, LOADABLE)
    assert _tokens_loaded(llm) == {"cpu": LOADABLE, "disk": LOADABLE, "redis": 0}
    assert out.outputs[0].token_ids == ref_c

    # All of prompt A's full blocks (those before its last token) come back from Redis.
    keys_a = prefix_keys(llm, prompts.a)[:(len(prompts.a) - 1) // 16]
    assert keys_a[:len(keys)] == keys
    evict_from_gpu(llm, prompts.prefix, seed=3)
    forget_cpu_tier(llm)
    for k in keys_a:
        store.disk.drop(k)
    assert all(store.redis.contains(k) for k in keys_a)
    out = gen(llm, prompts.a)
    assert (out.metrics.num_cached_tokens, out.metrics.num_loaded_tokens) == (0, 16 * len(keys_a))
    assert _tokens_loaded(llm) == {"cpu": LOADABLE, "disk": LOADABLE, "redis": 16 * len(keys_a)}
    assert out.outputs[0].token_ids == ref_a
    llm.engine.check_invariants()


def test_all_tiers_the_nearest_one_serves(make_llm, prompts, reference, redis_server, tmp_path):
    llm = make_llm(kv_cache_memory=KV_SMALL, cpu_kv_memory=CPU_BIG, disk_kv_dir=str(tmp_path / "kv"),
                   redis_url=redis_server)
    _nearest_tier_serves(llm, prompts, reference, redis_server)


@pytest.mark.slow
def test_all_tiers_on_the_default_model(model_path, prompts, redis_server, tmp_path):
    """The same on the default model's real weights and shapes (30 layers, 3 KV heads of 64)."""
    kw = dict(show_progress=False, device="cpu", dtype="float32")
    reference = Reference(lambda: LLM(model_path, kv_cache_memory="64MiB", enable_prefix_caching=False, **kw))
    # 24 blocks of 720 KiB, as on the tiny model: one prompt fits, one flood evicts it.
    llm = LLM(model_path, kv_cache_memory="17MiB", cpu_kv_memory="64MiB", disk_kv_dir=str(tmp_path / "kv"),
              redis_url=redis_server, **kw)
    assert llm.engine.num_kv_blocks == KV_SMALL_BLOCKS
    _nearest_tier_serves(llm, prompts, reference, redis_server)


def _split_prefix(llm, prompts):
    """Leave the first 8 blocks of the prefix in the CPU tier (a shorter prompt brought them back
    from disk) and the other 11 only on disk."""
    store = llm.engine.store
    keys = prefix_keys(llm, prompts.prefix)
    gen(llm, prompts.a, ONE)
    evict_from_gpu(llm, prompts.prefix)
    forget_cpu_tier(llm)
    short = prompts.prefix[:8 * 16 + 5] + prompts.other
    out = gen(llm, short, ONE)  # loads the first 8 blocks from disk into memory
    assert out.metrics.num_loaded_tokens == 8 * 16
    assert store.load_stats.tokens_loaded == {"cpu": 0, "disk": 8 * 16, "redis": 0}
    evict_from_gpu(llm, prompts.prefix, seed=2)
    assert all(k in store.disk for k in keys)
    assert all(k in store.cpu for k in keys[:8]) and not any(k in store.cpu for k in keys[8:])
    return keys


def test_prefix_split_between_cpu_and_disk_loads_whole(make_llm, prompts, reference, tmp_path):
    """The engine loads all of a prefix whose first blocks are in memory and the rest on disk
    ("the longest prefix it finds"): memory first, then disk, even though the first block
    missing from memory comes after blocks that are in memory."""
    llm = make_llm(kv_cache_memory=KV_SMALL, cpu_kv_memory=CPU_BIG, disk_kv_dir=str(tmp_path / "kv"))
    favor_loading(llm)
    store = llm.engine.store
    keys = _split_prefix(llm, prompts)
    disk_hits = store.disk.stats.hits
    out = gen(llm, prompts.b)
    assert out.outputs[0].token_ids == reference(prompts.b)
    assert (out.metrics.num_cached_tokens, out.metrics.num_loaded_tokens) == (0, LOADABLE)
    assert store.disk.stats.hits - disk_hits == len(keys) - 8  # only the missing ones were read
    llm.engine.check_invariants()


def test_loads_from_memory_are_credited_to_the_cpu_tier(make_llm, prompts, tmp_path):
    llm = make_llm(kv_cache_memory=KV_SMALL, cpu_kv_memory=CPU_BIG, disk_kv_dir=str(tmp_path / "kv"))
    favor_loading(llm)
    store = llm.engine.store
    _split_prefix(llm, prompts)
    disk_hits = store.disk.stats.hits
    before = dict(store.load_stats.tokens_loaded)
    out = gen(llm, prompts.b, ONE)
    assert out.metrics.num_loaded_tokens == LOADABLE
    read_from_disk = 16 * (store.disk.stats.hits - disk_hits)
    assert read_from_disk == LOADABLE - 8 * 16
    assert store.load_stats.tokens_loaded["disk"] - before["disk"] == read_from_disk
    assert store.load_stats.tokens_loaded["cpu"] - before["cpu"] == 8 * 16


def test_cost_model_recomputes_when_that_is_cheaper(make_llm, prompts, reference, tmp_path):
    """A prefill measured as (absurdly) fast makes every tier too slow: the prefix is found in
    the tiers but recomputed, the choice is counted, and the output is the same."""
    llm = make_llm(kv_cache_memory=KV_SMALL, cpu_kv_memory=CPU_BIG, disk_kv_dir=str(tmp_path / "kv"))
    store = llm.engine.store
    ref_b = reference(prompts.b)
    gen(llm, prompts.a, ONE)
    evict_from_gpu(llm, prompts.prefix)
    assert all(k in store.cpu and k in store.disk for k in prefix_keys(llm, prompts.prefix))
    store.cost.prefill_tokens_per_s = 1e15
    store.cost.observe_prefill = lambda tokens, seconds: None
    out = gen(llm, prompts.b)
    assert out.metrics.num_cached_tokens == 0 and out.metrics.num_loaded_tokens == 0
    st = store.snapshot()["load"]
    assert st["tokens_loaded"] == {"cpu": 0, "disk": 0, "redis": 0}
    assert st["recomputes_chosen"] >= 1 and st["tokens_recomputed_by_choice"] == LOADABLE
    assert out.outputs[0].token_ids == ref_b
    assert not store.cpu.pins


def test_cost_model_decision():
    from kvserve.kvtier.store import CostModel
    cm = CostModel(prefill_tokens_per_s=1000.0, bandwidth={"cpu": 1e9, "disk": 1e8, "redis": 1e7},
                   latency={"cpu": 0.0, "disk": 1e-3, "redis": 1e-2})
    # 160 tokens recompute in 0.16 s.
    assert cm.should_load("cpu", 160, 10 * 2**20, 10)  # 0.01 s
    assert cm.should_load("disk", 160, 10 * 2**20, 10)  # 0.01 + 0.105 s
    assert not cm.should_load("redis", 160, 10 * 2**20, 10)  # 0.1 + 1.05 s
    cm.observe_transfer("redis", 100 * 2**20, 0.01)  # measured 10 GB/s: the estimate follows
    assert cm.bandwidth["redis"] > 1e9
    cm.observe_prefill(10_000, 0.1)  # 100k tokens/s
    assert cm.prefill_tokens_per_s > 20_000
    assert not cm.should_load("disk", 160, 10 * 2**20, 10)

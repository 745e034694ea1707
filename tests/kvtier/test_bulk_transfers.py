"""Transfers larger than the store's fixed batches: a flush of more blocks than the write queue
holds reaches the disk whole, and a load of more chunks than one copy batch is exact."""
from __future__ import annotations

import random

from tierutil import tiny_llm

from kvserve import LLM, SamplingParams


def test_flush_of_a_large_cache_drops_nothing(tmp_path):
    """More cached blocks than the write queue holds: the flush waits instead of dropping."""
    llm = LLM("dummy:tiny", block_size=1, kv_cache_memory="64MiB", disk_kv_dir=str(tmp_path), show_progress=False)
    rng = random.Random(2)
    llm.generate([{"prompt_token_ids": [rng.randrange(1, 500) for _ in range(700)]} for _ in range(3)],
                 SamplingParams(max_tokens=1, temperature=0, ignore_eos=True), use_tqdm=False)
    cached = llm.engine.kv.pool.num_cached_blocks
    assert cached > 512 * 3  # well past the write queue's 512 entries
    assert llm.engine.flush_kv_to_tiers() == cached
    disk = llm.engine.store.disk
    assert len(disk.files) == cached and disk.stats.errors == 0


def test_a_load_longer_than_one_copy_batch_is_exact(tmp_path):
    """Loads go to the device in batches of 256 chunks; a run of ~600 crosses two boundaries."""
    prompt = {"prompt_token_ids": [random.Random(3).randrange(1, 500) for _ in range(601)]}
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = tiny_llm(block_size=1, kv_cache_memory="64MiB").generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    llm = tiny_llm(block_size=1, kv_cache_memory="64MiB", cpu_kv_memory="64MiB")
    llm.generate(prompt, sp, use_tqdm=False)
    llm.engine.flush_kv_to_tiers()
    llm.engine.kv.pool.reset_prefix_cache()
    out = llm.generate(prompt, sp, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0 and out.metrics.num_loaded_tokens == 600
    assert out.outputs[0].token_ids == ref

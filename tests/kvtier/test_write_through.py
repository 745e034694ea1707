"""Write-through: full blocks reach disk/Redis as their KV is computed, so a script that simply
ends (or dies once the writes landed) leaves its prefixes to the next process; ``with LLM(...)``
and the exit hook wait for the queue; a full queue drops writes (counted) instead of blocking the
step; a chunk Redis already holds is not sent again."""
from __future__ import annotations

import collections
import functools
import json
import os
import subprocess
import sys
import time

import pytest
from tierutil import KV_SMALL, LOADABLE, ONE, blocks, evict_from_gpu, favor_loading, gen, prefix_keys

from kvserve import kvtier
from kvserve.kvtier.lower import DiskTier

HERE = os.path.dirname(os.path.abspath(__file__))

FIRST = """
import os, sys, time
sys.path.insert(0, {here!r})
from tierutil import KV_SMALL, ONE, Prompts, gen, tiny_llm
from kvserve.kvtier.lower import DiskTier
put = DiskTier.put
def slow_put(self, key, data):  # a slow disk: the writer is still behind when the script ends
    time.sleep(0.05)
    return put(self, key, data)
DiskTier.put = slow_put
def main():
    llm = tiny_llm(kv_cache_memory=KV_SMALL, disk_kv_dir={kv_dir!r})
    gen(llm, Prompts().a, ONE)
    if {how!r} == "dies-after-writes":
        llm.engine.store.flush()  # the writes landed; then the process dies without any exit hook
        os._exit(0)
    return llm
llm = main()
if {how!r} == "llm-dropped":
    del llm  # gone before the exit hooks run: its queued writes are still waited for
# the script just ends: no shutdown()
"""


@pytest.mark.parametrize("how", ["script-ends", "llm-dropped", "dies-after-writes"])
def test_a_process_that_just_ends_leaves_its_prefixes(make_llm, prompts, reference, tmp_path, how):
    kv_dir = str(tmp_path / "kv")
    code = FIRST.format(here=HERE, kv_dir=kv_dir, how=how)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert p.returncode == 0, p.stderr[-3000:]

    llm = make_llm(kv_cache_memory=KV_SMALL, disk_kv_dir=kv_dir)  # same host: same generated secret
    favor_loading(llm)
    assert all(k in llm.engine.store.disk for k in prefix_keys(llm, prompts.prefix))
    out = gen(llm, prompts.b)
    assert out.outputs[0].token_ids == reference(prompts.b)
    assert out.num_cached_tokens == out.metrics.num_loaded_tokens == LOADABLE
    assert llm.engine.store.disk.stats.corrupt == 0


def _slow_disk(monkeypatch, seconds: float) -> None:
    put = DiskTier.put

    def slow_put(self, key, data):
        time.sleep(seconds)
        return put(self, key, data)
    monkeypatch.setattr(DiskTier, "put", slow_put)


def test_context_manager_waits_for_every_write(make_llm, prompts, tmp_path, monkeypatch):
    _slow_disk(monkeypatch, 0.02)
    with make_llm(kv_cache_memory=KV_SMALL, disk_kv_dir=str(tmp_path / "kv")) as llm:
        gen(llm, prompts.a, ONE)
        store = llm.engine.store
        assert store._writes.unfinished_tasks > 0  # the writer is behind the step
    assert store._writes.unfinished_tasks == 0
    cached = list(llm.engine.kv.pool.cached)
    assert cached and all(k in store.disk for k in cached)
    assert store.load_stats.written_through >= len(prefix_keys(llm, prompts.prefix))
    stores = store.disk.stats.stores
    llm.shutdown()  # idempotent: nothing left to write
    assert store.disk.stats.stores == stores


@pytest.mark.parametrize("cpu", [0, blocks(64)], ids=["no-cpu-tier", "cpu-tier"])
def test_full_write_queue_drops_without_blocking_and_shutdown_writes_the_rest(
        make_llm, prompts, reference, tmp_path, monkeypatch, cpu):
    delay = 0.15
    _slow_disk(monkeypatch, delay)
    monkeypatch.setattr(kvtier, "TieredStore", functools.partial(kvtier.TieredStore, write_queue=1))
    llm = make_llm(kv_cache_memory=KV_SMALL, disk_kv_dir=str(tmp_path / "kv"), cpu_kv_memory=cpu)
    store = llm.engine.store
    assert store._writes.maxsize == 1
    t0 = time.perf_counter()
    out = gen(llm, prompts.a)
    took = time.perf_counter() - t0
    assert out.outputs[0].token_ids == reference(prompts.a)
    keys = prefix_keys(llm, prompts.prefix)
    assert store.load_stats.writes_dropped > 0
    assert took < delay * len(keys) / 2  # the steps never waited for the slow disk
    llm.shutdown()
    assert all(k in store.disk for k in keys)


def test_chunks_redis_holds_are_not_written_again(make_llm, prompts, reference, redis_server):
    """No CPU tier: a prefix loaded from Redis, or computed and written once, leaves the GPU
    again and again without being sent again."""
    llm = make_llm(kv_cache_memory=KV_SMALL, redis_url=redis_server)
    favor_loading(llm)
    tier = llm.engine.store.redis
    writes = collections.Counter()
    put = tier.put

    def counting_put(key, data):
        writes[key] += 1
        return put(key, data)
    tier.put = counting_put
    keys = prefix_keys(llm, prompts.prefix)
    ref_a, ref_b, ref_c = reference(prompts.a, prompts.b, prompts.c)
    assert gen(llm, prompts.a).outputs[0].token_ids == ref_a
    for seed, p, ref in ((1, prompts.b, ref_b), (2, prompts.c, ref_c), (3, prompts.a, ref_a)):
        evict_from_gpu(llm, prompts.prefix, seed=seed)
        out = gen(llm, p)
        assert out.outputs[0].token_ids == ref
        assert out.metrics.num_loaded_tokens == LOADABLE
    llm.engine.store.flush()
    assert {writes[k] for k in keys} == {1}, json.dumps({k.hex(): writes[k] for k in keys})
    assert tier.stats.corrupt == 0

"""Faults in the tiers under the engine: damaged chunks on disk or in Redis, Redis going away
and coming back, Redis missing at start-up, a disk quota too small, a directory that cannot be
written. Each time the output is the recomputed one and the engine keeps serving. Redis's retry
interval passes on a fake clock (``RedisTier.clock``)."""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

import pytest
from tierutil import (
    KV_SMALL,
    LOADABLE,
    ONE,
    FakeClock,
    blocks,
    evict_from_gpu,
    favor_loading,
    gen,
    prefix_keys,
)

from kvserve import LLM
from kvserve.errors import ConfigError
from kvserve.kvtier.lower import DiskTier

REDIS_PREFIX = b"kvserve:kv:"


def _rkey(k: bytes) -> bytes:
    return REDIS_PREFIX + k.hex().encode()


def _tokens_loaded(llm) -> dict:
    return dict(llm.engine.store.load_stats.tokens_loaded)


def test_damaged_disk_chunks_are_recomputed(make_llm, prompts, reference, tmp_path):
    """A flipped byte, a truncated file and another chunk's file under this chunk's name: each
    is caught, dropped and counted; the prefix loads up to it and the rest is recomputed; the
    recomputed blocks are written through again, so the directory heals."""
    llm = make_llm(kv_cache_memory=KV_SMALL, disk_kv_dir=str(tmp_path / "kv"))
    favor_loading(llm)
    disk = llm.engine.store.disk
    keys = prefix_keys(llm, prompts.prefix)
    ref_a, ref_b, ref_c = reference(prompts.a, prompts.b, prompts.c)
    gen(llm, prompts.a, ONE)
    evict_from_gpu(llm, prompts.prefix)
    assert all(k in disk for k in keys)

    # 1. One byte flipped in the middle of block 10's file.
    path = disk.path(keys[10])
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0x40
    Path(path).write_bytes(bytes(data))
    out = gen(llm, prompts.b)
    assert out.outputs[0].token_ids == ref_b
    assert (out.metrics.num_cached_tokens, out.metrics.num_loaded_tokens) == (0, 10 * 16)
    assert disk.stats.corrupt == 1
    llm.engine.store.flush()  # dropped, recomputed, written through again: healed at once
    assert keys[10] in disk and Path(path).read_bytes() != bytes(data)

    # 2. Block 5's file cut in half (the directory healed block 10 meanwhile).
    evict_from_gpu(llm, prompts.prefix, seed=2)
    assert all(k in disk for k in keys)
    path = disk.path(keys[5])
    os.truncate(path, os.path.getsize(path) // 2)
    out = gen(llm, prompts.c)
    assert out.outputs[0].token_ids == ref_c
    assert (out.metrics.num_cached_tokens, out.metrics.num_loaded_tokens) == (0, 5 * 16)
    assert disk.stats.corrupt == 2
    llm.engine.store.flush()
    assert keys[5] in disk and os.path.getsize(path) == disk.files[keys[5]] > 0

    # 3. Block 4's chunk in block 3's file: intact, checksummed, but not this key.
    evict_from_gpu(llm, prompts.prefix, seed=3)
    assert all(k in disk for k in keys)
    Path(disk.path(keys[3])).write_bytes(Path(disk.path(keys[4])).read_bytes())
    out = gen(llm, prompts.a)
    assert out.outputs[0].token_ids == ref_a
    assert (out.metrics.num_cached_tokens, out.metrics.num_loaded_tokens) == (0, 3 * 16)
    assert disk.stats.corrupt == 3

    # 4. A vanished file.
    evict_from_gpu(llm, prompts.prefix, seed=4)
    os.unlink(disk.path(keys[2]))
    out = gen(llm, prompts.b)
    assert out.outputs[0].token_ids == ref_b and out.metrics.num_loaded_tokens == 2 * 16
    llm.engine.store.flush()  # a vanished file is forgotten, then written through again
    assert keys[2] in disk and os.path.exists(disk.path(keys[2]))

    # Healed: everything is back on disk and the whole prefix loads.
    evict_from_gpu(llm, prompts.prefix, seed=5)
    assert all(k in disk for k in keys)
    before = _tokens_loaded(llm)["disk"]
    out = gen(llm, prompts.a)
    assert out.outputs[0].token_ids == ref_a
    assert out.metrics.num_loaded_tokens >= LOADABLE
    assert _tokens_loaded(llm)["disk"] - before == out.metrics.num_loaded_tokens
    assert disk.used == sum(disk.files.values()) <= disk.capacity
    llm.engine.check_invariants()


def test_damaged_redis_chunks_are_recomputed(make_llm, prompts, reference, redis_server):
    llm = make_llm(kv_cache_memory=KV_SMALL, redis_url=redis_server)
    favor_loading(llm)
    stats = llm.engine.store.redis.stats
    r = redis_server.client()
    keys = prefix_keys(llm, prompts.prefix)
    ref_a, ref_b, ref_c = reference(prompts.a, prompts.b, prompts.c)
    gen(llm, prompts.a, ONE)
    evict_from_gpu(llm, prompts.prefix)
    assert all(r.exists(_rkey(k)) for k in keys)

    # 1. Garbage under block 10's key.
    r.set(_rkey(keys[10]), b"definitely not a KV chunk")
    out = gen(llm, prompts.b)
    assert out.outputs[0].token_ids == ref_b
    assert (out.metrics.num_cached_tokens, out.metrics.num_loaded_tokens) == (0, 10 * 16)
    assert stats.corrupt == 1 and stats.available
    llm.engine.store.flush()  # dropped, recomputed and written through again
    assert len(r.get(_rkey(keys[10]))) > 25

    # 2. Block 8's chunk under block 7's key (a valid chunk, the wrong one), and block 12 cut short.
    evict_from_gpu(llm, prompts.prefix, seed=2)
    assert all(r.exists(_rkey(k)) for k in keys)  # block 10 was written again
    r.set(_rkey(keys[7]), r.get(_rkey(keys[8])))
    v = r.get(_rkey(keys[12]))
    r.set(_rkey(keys[12]), v[:len(v) - 100])
    out = gen(llm, prompts.c)
    assert out.outputs[0].token_ids == ref_c
    assert (out.metrics.num_cached_tokens, out.metrics.num_loaded_tokens) == (0, 7 * 16)
    # The rest of the prefix was checked at block 7's failure: block 12 was found with it.
    assert stats.corrupt == 3

    # 3. Both were recomputed and written through again; one flipped bit in block 12.
    llm.engine.store.flush()
    assert len(r.get(_rkey(keys[7]))) == len(r.get(_rkey(keys[12]))) == len(v)
    evict_from_gpu(llm, prompts.prefix, seed=3)
    assert len(r.get(_rkey(keys[12]))) == len(v)
    v = bytearray(r.get(_rkey(keys[12])))
    v[100] ^= 1
    r.set(_rkey(keys[12]), bytes(v))
    out = gen(llm, prompts.a)
    assert out.outputs[0].token_ids == ref_a
    assert out.metrics.num_loaded_tokens == 12 * 16
    assert stats.corrupt == 4
    llm.engine.check_invariants()


def test_redis_stopped_mid_run_then_back(make_llm, prompts, reference, redis_server):
    llm = make_llm(kv_cache_memory=KV_SMALL, redis_url=redis_server)
    favor_loading(llm)
    tier = llm.engine.store.redis
    clock = tier.clock = FakeClock()
    keys = prefix_keys(llm, prompts.prefix)
    ref_b, ref_c = reference(prompts.b, prompts.c)
    gen(llm, prompts.a, ONE)
    evict_from_gpu(llm, prompts.prefix)
    assert tier.stats.stores >= len(keys)

    redis_server.stop()
    out = gen(llm, prompts.b)
    assert out.outputs[0].token_ids == ref_b
    assert out.metrics.num_loaded_tokens == 0
    snap = llm.engine.store.snapshot()["redis"]
    assert snap["available"] is False and snap["errors"] >= 1 and snap["last_error"]
    # Still serving, and not waiting on the dead server (writes while it is off are skipped).
    evict_from_gpu(llm, prompts.prefix, seed=2)
    out = gen(llm, prompts.c)
    assert out.outputs[0].token_ids == ref_c and out.metrics.num_loaded_tokens == 0
    assert llm.engine.store.snapshot()["redis"]["available"] is False

    redis_server.start()  # same port, empty (no persistence)
    clock.advance(tier.retry_seconds + 0.2)  # the tier asks again every retry_seconds
    stores = tier.stats.stores
    gen(llm, prompts.a, ONE)
    evict_from_gpu(llm, prompts.prefix, seed=3)
    assert tier.stats.available is True
    assert tier.stats.stores >= stores + len(keys)
    r = redis_server.client()
    assert all(r.exists(_rkey(k)) for k in keys)
    before = tier.stats.hits
    out = gen(llm, prompts.b)
    assert out.outputs[0].token_ids == ref_b
    assert (out.metrics.num_cached_tokens, out.metrics.num_loaded_tokens) == (0, LOADABLE)
    assert tier.stats.hits - before >= len(keys)
    llm.engine.check_invariants()


def test_redis_back_after_an_outage_serves_reads_without_writes(make_llm, prompts, reference, redis_server):
    """Redis goes away and comes back with its data (as a server with persistence would); the
    next request whose prefix is there loads it, even if nothing was written in between."""
    llm = make_llm(kv_cache_memory=KV_SMALL, redis_url=redis_server)
    favor_loading(llm)
    tier = llm.engine.store.redis
    clock = tier.clock = FakeClock()
    gen(llm, prompts.a, ONE)
    evict_from_gpu(llm, prompts.prefix)
    r = redis_server.client()
    saved = {k: r.get(k) for k in r.keys(REDIS_PREFIX + b"*")}
    assert len(saved) >= len(prefix_keys(llm, prompts.prefix))

    redis_server.stop()
    gen(llm, prompts.tail[:36], ONE)  # finds Redis gone
    assert tier.stats.available is False
    redis_server.start()
    r = redis_server.client()
    for k, v in saved.items():
        r.set(k, v)
    clock.advance(tier.retry_seconds + 0.2)
    out = gen(llm, prompts.b)
    assert out.outputs[0].token_ids == reference(prompts.b)
    assert (out.metrics.num_cached_tokens, out.metrics.num_loaded_tokens) == (0, LOADABLE)


def test_redis_unreachable_at_start_up(make_llm, prompts, reference, redis_server):
    redis_server.stop()  # nothing listens on its port now
    llm = make_llm(kv_cache_memory=KV_SMALL, redis_url=redis_server)
    favor_loading(llm)
    tier = llm.engine.store.redis
    clock = tier.clock = FakeClock()  # starts at the real clock, which timed the failed first try
    assert tier.stats.available is False and tier.stats.last_error
    out = gen(llm, prompts.b)
    assert out.outputs[0].token_ids == reference(prompts.b) and out.metrics.num_loaded_tokens == 0

    redis_server.start()
    clock.advance(tier.retry_seconds + 0.2)
    evict_from_gpu(llm, prompts.prefix)  # the evicted blocks are written: the tier is back
    assert tier.stats.available is True
    r = redis_server.client()
    assert all(r.exists(_rkey(k)) for k in prefix_keys(llm, prompts.prefix))


@pytest.mark.parametrize("size,max_chunks", [(blocks(1) // 2, 0), (blocks(5) + blocks(1) // 2, 5)],
                         ids=["smaller-than-a-chunk", "five-chunks"])
def test_disk_quota_too_small(make_llm, prompts, reference, tmp_path, size, max_chunks):
    kv_dir = tmp_path / "kv"
    llm = make_llm(kv_cache_memory=KV_SMALL, disk_kv_dir=str(kv_dir), disk_kv_size=size)
    favor_loading(llm)
    disk = llm.engine.store.disk
    gen(llm, prompts.a, ONE)
    evict_from_gpu(llm, prompts.prefix)
    files = [f for f in kv_dir.rglob("*") if f.is_file()]
    assert len(files) == len(disk.files) <= max_chunks
    assert disk.used == sum(f.stat().st_size for f in files) <= disk.capacity
    if max_chunks:
        assert disk.stats.stores > max_chunks  # it kept taking writes, evicting the oldest
    else:
        assert disk.stats.stores == 0
    out = gen(llm, prompts.b)
    assert out.outputs[0].token_ids == reference(prompts.b)
    assert out.metrics.num_loaded_tokens <= 16 * max_chunks
    llm.engine.check_invariants()


def test_read_only_disk_directory_reads_but_does_not_write(make_llm, prompts, reference, tmp_path):
    if os.geteuid() == 0:
        pytest.skip("running as root: chmod 0o555 does not stop root from writing (the file-in-place-of-"
                    "the-directory tests cover the unwritable case)")
    kv_dir = tmp_path / "kv"
    first = make_llm(kv_cache_memory=KV_SMALL, disk_kv_dir=str(kv_dir))
    ref_a, ref_b = reference(prompts.a, prompts.b)
    gen(first, prompts.a, ONE)
    first.shutdown()
    del first
    n_files = len(list(kv_dir.rglob("*.kvc")))
    for d in [kv_dir, *[p for p in kv_dir.iterdir() if p.is_dir()]]:
        d.chmod(0o555)
    try:
        llm = make_llm(kv_cache_memory=KV_SMALL, disk_kv_dir=str(kv_dir))
        favor_loading(llm)
        disk = llm.engine.store.disk
        assert disk.stats.writable is False
        out = gen(llm, prompts.b)
        assert out.outputs[0].token_ids == ref_b
        assert out.metrics.num_loaded_tokens == LOADABLE  # reads continue
        evict_from_gpu(llm, prompts.prefix)
        assert len(list(kv_dir.rglob("*.kvc"))) == n_files and disk.stats.stores == 0
        out = gen(llm, prompts.a)
        assert out.outputs[0].token_ids == ref_a
    finally:
        for d in [kv_dir, *[p for p in kv_dir.iterdir() if p.is_dir()]]:
            d.chmod(0o755)


def test_disk_dir_that_is_a_file_is_a_config_error(tmp_path):
    f = tmp_path / "not-a-dir"
    f.write_bytes(b"x")
    for path in (f, f / "sub"):
        with pytest.raises(ConfigError) as e:
            LLM("dummy:tiny", show_progress=False, kv_cache_memory="4MiB", disk_kv_dir=str(path))
        assert e.value.option == "disk_kv_dir" and "disk_kv_dir" in str(e.value)


def test_disk_dir_replaced_by_a_file_mid_run(make_llm, prompts, reference, tmp_path):
    """The directory disappears under a running engine and a file takes its place: writes fail
    (counted), chunks already indexed read as missing, and the engine keeps serving."""
    kv_dir = tmp_path / "kv"
    llm = make_llm(kv_cache_memory=KV_SMALL, disk_kv_dir=str(kv_dir))
    favor_loading(llm)
    disk = llm.engine.store.disk
    ref_b, ref_c = reference(prompts.b, prompts.c)
    gen(llm, prompts.a, ONE)
    evict_from_gpu(llm, prompts.prefix)
    assert len(disk.files) > 0
    os.rename(kv_dir, tmp_path / "moved-away")
    kv_dir.write_bytes(b"I am a file now")

    out = gen(llm, prompts.b)  # the index says the prefix is there; reading it fails
    assert out.outputs[0].token_ids == ref_b and out.metrics.num_loaded_tokens == 0
    errors = disk.stats.errors
    evict_from_gpu(llm, prompts.prefix, seed=2)  # its blocks cannot be written
    assert disk.stats.errors > errors and disk.stats.last_error
    out = gen(llm, prompts.c)
    assert out.outputs[0].token_ids == ref_c and out.metrics.num_loaded_tokens == 0
    assert disk.used == sum(disk.files.values())
    llm.engine.check_invariants()


def test_redis_is_asked_again_only_once_its_retry_is_due(redis_server):
    from kvserve.kvtier.lower import RedisTier
    redis_server.stop()
    clock = FakeClock()
    tier = RedisTier(redis_server, clock=clock)
    assert tier.stats.available is False and not tier.may_answer()
    redis_server.start()
    key = b"k" * 16
    assert tier.put(key, b"data") is False and tier.stats.available is False  # not asked yet
    clock.advance(tier.retry_seconds)
    assert tier.may_answer()
    assert tier.put(key, b"data") and tier.stats.available is True
    assert tier.get(key) == b"data"


def test_full_disk_stops_writes_then_they_resume_once_there_is_room(tmp_path, monkeypatch):
    """ENOSPC turns the disk tier's writes off; a write is tried again after RETRY_S, and once
    the disk has room the tier writes again (before, writes stayed off until a restart)."""
    now = [0.0]
    disk = DiskTier(str(tmp_path / "kv"), capacity=1 << 20, clock=lambda: now[0])
    real_mkstemp = tempfile.mkstemp
    full = [True]

    def mkstemp(*a, **kw):
        if full[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_mkstemp(*a, **kw)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    assert disk.put(b"\x01" * 16, b"a" * 100) is False
    assert disk.stats.writable is False and disk.stats.errors == 1
    full[0] = False  # room again, but the retry is not due: nothing is tried
    assert disk.put(b"\x02" * 16, b"b" * 100) is False and disk.stats.errors == 1
    now[0] += DiskTier.RETRY_S
    assert disk.put(b"\x03" * 16, b"c" * 100) is True
    assert disk.stats.writable is True and disk.get(b"\x03" * 16) == b"c" * 100
    full[0] = True  # full again: off again, and the retry waits its interval again
    assert disk.put(b"\x04" * 16, b"d" * 100) is False and disk.stats.writable is False
    now[0] += DiskTier.RETRY_S / 2
    full[0] = False
    assert disk.put(b"\x05" * 16, b"e" * 100) is False

"""Property-based tests of the CPU and disk tiers against a model of what they must hold.

CpuTier: random puts of random-size tensors, gets (pinning or not) and unpins. After every step:
``used`` equals the bytes stored and never exceeds ``capacity`` (``check_invariants``), a pinned
chunk is still there, a present chunk is exactly the tensor put, a put is refused only when the
pinned chunks leave no room, and what a put evicts is the least recently used unpinned chunks.

DiskTier: random puts of random-size byte strings, gets and drops under a small capacity, and
restarts (a new DiskTier over the same directory). After every step: ``used`` never exceeds
``capacity`` and equals the sizes indexed, the index is exactly the chunk files on disk, a
present chunk reads back byte for byte, and a restart finds the same index.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.kvtier.lower import DiskTier
from kvserve.kvtier.tiers import CpuTier

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _key(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class CpuTierMachine(RuleBasedStateMachine):
    CAPACITY = 1000

    def __init__(self):
        super().__init__()
        self.tier = CpuTier(self.CAPACITY)
        # Content-addressed: a key always names the same content, so the first tensor made for a
        # key is the one every later put of that key carries.
        self.content: dict[bytes, torch.Tensor] = {}
        self.lru: list[bytes] = []  # model of the tier's order, least recently used first
        self.pins: dict[bytes, int] = {}

    def _tensor(self, i: int, numel: int, dtype_i: int) -> torch.Tensor:
        k = _key(i)
        if k not in self.content:
            dtype = DTYPES[dtype_i]
            g = torch.Generator().manual_seed(i * 1000 + numel)
            self.content[k] = torch.randn(numel, generator=g).to(dtype)
        return self.content[k]

    def _touch(self, k: bytes) -> None:
        if k in self.lru:
            self.lru.remove(k)
        self.lru.append(k)

    @rule(i=st.integers(0, 14), numel=st.integers(1, 200), dtype_i=st.integers(0, 2))
    def put(self, i, numel, dtype_i):
        kv = self._tensor(i, numel, dtype_i)
        k, size = _key(i), _nbytes(kv)
        before = list(self.tier.chunks)
        present = k in self.tier
        ok = self.tier.put(k, kv)
        after = list(self.tier.chunks)
        if present:
            assert ok and k in self.tier
            assert sorted(after) == sorted(before)  # nothing evicted, nothing replaced
            self._touch(k)
            return
        pinned_bytes = sum(_nbytes(self.content[p]) for p, n in self.pins.items() if n)
        fits = pinned_bytes + size <= self.CAPACITY
        assert ok == fits, (ok, pinned_bytes, size)
        if not ok:
            assert after == before  # a refused put changes nothing
            return
        evicted = [x for x in before if x not in after]
        unpinned_lru = [x for x in self.lru if not self.pins.get(x)]
        # What goes is the least recently used unpinned chunks, and no more than needed.
        assert evicted == unpinned_lru[:len(evicted)], (evicted, unpinned_lru)
        used_before = sum(_nbytes(self.content[x]) for x in before)
        assert used_before - sum(_nbytes(self.content[x]) for x in evicted) + size <= self.CAPACITY
        if evicted:
            assert used_before - sum(_nbytes(self.content[x]) for x in evicted[:-1]) + size > self.CAPACITY
        for x in evicted:
            self.lru.remove(x)
        self._touch(k)

    @rule(i=st.integers(0, 14), pin=st.booleans())
    def get(self, i, pin):
        k = _key(i)
        present = k in self.tier
        got = self.tier.get(k, pin=pin)
        if not present:
            assert got is None
            assert k not in self.tier.pins
            return
        assert got is not None and _bits(got) == _bits(self.content[k]) and got.dtype == self.content[k].dtype
        self._touch(k)
        if pin:
            self.pins[k] = self.pins.get(k, 0) + 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data):
        k = data.draw(st.sampled_from(sorted(k for k, n in self.pins.items() if n)))
        self.tier.unpin(k)
        self.pins[k] -= 1
        if not self.pins[k]:
            del self.pins[k]

    @invariant()
    def invariants(self):
        t = self.tier
        t.check_invariants()
        assert 0 <= t.used <= t.capacity
        assert t.used == sum(_nbytes(x) for x in t.chunks.values())
        assert list(t.chunks) == self.lru  # the LRU order is the model's
        for k, n in self.pins.items():
            assert k in t.chunks, "a pinned chunk was evicted"
            assert t.pins.get(k) == n
        assert set(t.pins) == set(self.pins)
        for k, kv in t.chunks.items():
            assert _bits(kv) == _bits(self.content[k]) and kv.dtype == self.content[k].dtype


TestCpuTier = CpuTierMachine.TestCase
TestCpuTier.settings = SETTINGS


class _SmallSlabs(CpuTier):
    SLAB_BYTES = 800  # two slots a slab


class SlottedCpuTierMachine(CpuTierMachine):
    """The same with fixed-size slots (how the store keeps pinned memory): even keys are
    slot-sized (400 bytes) and live in slots of two-slot slabs, reused after evictions; odd keys
    keep their random sizes and are stored plainly. Contents must never mix."""

    def __init__(self):
        super().__init__()
        self.tier = _SmallSlabs(self.CAPACITY, slot_bytes=400)

    def _tensor(self, i: int, numel: int, dtype_i: int) -> torch.Tensor:
        if i % 2 == 0:
            numel = 400 // DTYPES[dtype_i].itemsize
        return super()._tensor(i, numel, dtype_i)


TestSlottedCpuTier = SlottedCpuTierMachine.TestCase
TestSlottedCpuTier.settings = SETTINGS


class DiskTierMachine(RuleBasedStateMachine):
    CAPACITY = 3000

    def __init__(self):
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="kvtier-disk-")
        self.tier = DiskTier(self.root, self.CAPACITY)
        self.content: dict[bytes, bytes] = {}
        self.restarts = 0

    def teardown(self):
        shutil.rmtree(self.root, ignore_errors=True)

    def _data(self, i: int, size: int) -> bytes:
        k = _key(i)
        if k not in self.content:
            self.content[k] = hashlib.shake_256(f"{i}/{size}".encode()).digest(size)
        return self.content[k]

    def _files_on_disk(self) -> dict[bytes, int]:
        out = {}
        for sub in os.listdir(self.root):
            d = os.path.join(self.root, sub)
            for name in os.listdir(d):
                assert name.endswith(".kvc"), f"stray file {name} (a temporary file left behind?)"
                out[bytes.fromhex(name[:-4])] = os.path.getsize(os.path.join(d, name))
        return out

    @rule(i=st.integers(0, 11), size=st.integers(1, 1400))
    def put(self, i, size):
        data = self._data(i, size)
        k = _key(i)
        present = k in self.tier
        ok = self.tier.put(k, data)
        assert ok == (present or len(data) <= self.CAPACITY)
        if ok:
            assert k in self.tier

    @rule(i=st.integers(0, 11))
    def get(self, i):
        k = _key(i)
        present = k in self.tier
        got = self.tier.get(k)
        assert (got is not None) == present
        if got is not None:
            assert got == self.content[k]

    @rule(i=st.integers(0, 11))
    def drop(self, i):
        k = _key(i)
        self.tier.drop(k)
        assert k not in self.tier
        assert not os.path.exists(self.tier.path(k))

    @rule()
    def restart(self):
        before = dict(self.tier.files)
        used = self.tier.used
        self.tier = DiskTier(self.root, self.CAPACITY)
        self.restarts += 1
        assert dict(self.tier.files) == before  # same chunks, same sizes
        assert self.tier.used == used
        for k in before:
            assert self.tier.get(k) == self.content[k]

    @invariant()
    def invariants(self):
        t = self.tier
        assert 0 <= t.used <= t.capacity
        assert t.used == sum(t.files.values())
        assert self._files_on_disk() == dict(t.files)
        assert t.stats.writable and t.stats.errors == 0


TestDiskTier = DiskTierMachine.TestCase
TestDiskTier.settings = SETTINGS


def test_disk_tier_restart_keeps_lru_order_of_writes(tmp_path):
    """The rebuilt index orders chunks by file age, so the oldest written is evicted first."""
    t = DiskTier(str(tmp_path), 10_000)
    for i in range(4):
        assert t.put(_key(i), bytes([i]) * 1000)
        os.utime(t.path(_key(i)), (1_000_000 + i, 1_000_000 + i))
    t2 = DiskTier(str(tmp_path), 10_000)
    assert list(t2.files) == [_key(i) for i in range(4)]
    assert t2.put(_key(9), b"z" * 7000)  # 4000 + 7000 > 10000: the oldest goes
    assert _key(0) not in t2 and _key(1) in t2 and t2.used == 10_000


def test_disk_tier_ignores_foreign_and_temporary_files(tmp_path):
    t = DiskTier(str(tmp_path), 10_000)
    assert t.put(_key(1), b"a" * 100)
    sub = os.path.dirname(t.path(_key(1)))
    for name in ("x.tmp", "notes.txt", "zz.kvc"):  # a crashed write, a stranger, a bad name
        with open(os.path.join(sub, name), "wb") as f:
            f.write(b"junk")
    os.makedirs(os.path.join(str(tmp_path), "other-dir"))
    t2 = DiskTier(str(tmp_path), 10_000)
    assert list(t2.files) == [_key(1)] and t2.used == 100


def test_disk_tier_restart_with_a_smaller_capacity_respects_it(tmp_path):
    t = DiskTier(str(tmp_path), 10_000)
    for i in range(8):
        assert t.put(_key(i), bytes([i]) * 1000)
    t2 = DiskTier(str(tmp_path), 4_000)  # restarted with a smaller quota: used must follow it
    assert t2.used <= t2.capacity
    assert list(t2.files) == [_key(i) for i in range(4, 8)]  # the oldest went, from disk too
    on_disk = {bytes.fromhex(n[:-4]) for d in os.listdir(tmp_path) for n in os.listdir(tmp_path / d)}
    assert on_disk == set(t2.files)

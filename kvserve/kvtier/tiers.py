"""The memory tier under the GPU, and the counters every tier keeps (``TierStats``).

The CPU tier holds tensors (LRU, bounded in bytes; chunks in use are pinned and never evicted).
The disk and Redis tiers are in ``lower.py``.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    stores: int = 0
    bytes_in: int = 0  # stored into the tier
    bytes_out: int = 0  # loaded from it
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    corrupt: int = 0  # chunks that failed their checks (and were dropped)
    errors: int = 0
    available: bool = True
    writable: bool = True
    last_error: str = ""

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0

    def load_bandwidth(self) -> float | None:
        """Bytes/s measured over this tier's loads, None before the first."""
        return self.bytes_out / self.load_seconds if self.load_seconds > 0 and self.bytes_out else None


class CpuTier:
    """LRU over tensors, bounded by ``capacity`` bytes. ``pin``/``unpin`` protect chunks being
    loaded: a pinned chunk is never evicted, and a put that would need to evict one is refused.

    With ``slot_bytes`` (the store sets it to one chunk's size when the memory is pinned), chunks
    of that size live in fixed slots carved from a few large slabs, allocated as the tier fills
    and reused after evictions: a put is one copy into a slot instead of a pinned allocation of
    its own (a ``cudaHostAlloc`` per 2 MiB chunk took 1.3 ms on the H200, on the engine thread).
    A slot is reused once its chunk leaves, so a tensor from ``get`` is only valid while the chunk
    is pinned (``get(pin=True)`` ... ``unpin``), which is how the store reads them. With
    ``grow_ahead`` (the default for pinned memory) the next slab is allocated on a short-lived
    background thread while free slots remain, so the engine thread rarely pins memory itself."""

    name = "cpu"
    SLAB_BYTES = 64 << 20

    def __init__(self, capacity: int, pin_memory: bool = False, slot_bytes: int | None = None,
                 grow_ahead: bool | None = None):
        self.capacity = capacity
        self.pin_memory = pin_memory
        self.chunks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.pins: dict[bytes, int] = {}
        self.tags: dict[bytes, str] = {}  # where a chunk came from, if not spilled from the GPU
        self.used = 0
        self.stats = TierStats()
        self.lock = threading.RLock()
        self.slot_bytes = slot_bytes if slot_bytes and slot_bytes <= capacity else None
        self.max_slots = capacity // slot_bytes if self.slot_bytes else 0
        self.slabs: list[torch.Tensor] = []
        self.free_slots: list[torch.Tensor] = []  # uint8 [slot_bytes] views into the slabs
        self.slot_of: dict[bytes, torch.Tensor] = {}
        self.num_slots = 0
        self.slab_seconds = 0.0  # spent allocating (pinning) slabs, on any thread
        self.grow_ahead = pin_memory if grow_ahead is None else grow_ahead
        self._slab_slots = max(1, self.SLAB_BYTES // self.slot_bytes) if self.slot_bytes else 0
        self._growing = 0  # slots being allocated by the background thread
        if self.slot_bytes:
            with self.lock:
                self._grow_ahead()  # the first slab, while the engine starts

    def __contains__(self, key: bytes) -> bool:
        return key in self.chunks

    def touch(self, key: bytes) -> bool:
        """Whether ``key`` is here; if so it becomes the most recently used."""
        with self.lock:
            if key not in self.chunks:
                return False
            self.chunks.move_to_end(key)
            return True

    def _make_room(self, size: int) -> bool:
        """Evict least recently used unpinned chunks until ``size`` more bytes fit (caller holds
        the lock). False, evicting nothing, when only pinned chunks could make the room."""
        if size > self.capacity:
            return False
        victims, freed = [], 0
        for k in self.chunks:  # oldest first, skipping pinned chunks
            if self.used - freed + size <= self.capacity:
                break
            if self.pins.get(k):
                continue
            victims.append(k)
            freed += self.chunks[k].numel() * self.chunks[k].element_size()
        if self.used - freed + size > self.capacity:
            return False  # only pinned chunks left to evict
        for k in victims:
            self._remove(k)
        return True

    def _remove(self, key: bytes) -> None:
        kv = self.chunks.pop(key)
        self.tags.pop(key, None)
        self.used -= kv.numel() * kv.element_size()
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self.free_slots.append(slot)

    def _slot(self) -> torch.Tensor | None:
        """A free slot (caller holds the lock, after ``_make_room``), allocating a slab if none;
        None when every slot the capacity allows is in use or on its way (then a plain copy)."""
        if not self.free_slots:
            n = min(self._slab_slots, self.max_slots - self.num_slots - self._growing)
            if n > 0:
                try:
                    self._add_slab(self._alloc_slab(n), n)
                except RuntimeError:  # out of (pinned) memory: no more slots, puts copy plainly
                    log.exception("CPU KV tier: allocating %d bytes of slots failed", n * self.slot_bytes)
                    self.max_slots = self.num_slots + self._growing
        slot = self.free_slots.pop() if self.free_slots else None
        if len(self.free_slots) < self._slab_slots // 2:
            self._grow_ahead()
        return slot

    def _grow_ahead(self) -> None:
        """Start allocating the next slab on a background thread (caller holds the lock)."""
        n = min(self._slab_slots, self.max_slots - self.num_slots)
        if self.grow_ahead and not self._growing and n > 0:
            self._growing = n
            threading.Thread(target=self._grow, args=(n,), daemon=True, name="kvtier-slab").start()

    def _alloc_slab(self, n: int) -> torch.Tensor:
        t0 = time.perf_counter()
        slab = torch.empty(n * self.slot_bytes, dtype=torch.uint8, pin_memory=self.pin_memory)
        self.slab_seconds += time.perf_counter() - t0
        return slab

    def _add_slab(self, slab: torch.Tensor, n: int) -> None:
        self.slabs.append(slab)
        self.free_slots.extend(slab[i * self.slot_bytes:(i + 1) * self.slot_bytes] for i in range(n))
        self.num_slots += n

    def _grow(self, n: int) -> None:
        slab = None
        try:
            slab = self._alloc_slab(n)  # outside the lock: the engine thread goes on meanwhile
        except Exception:  # out of pinned memory: no more slots, puts copy plainly
            log.exception("CPU KV tier: allocating %d bytes of slots failed", n * self.slot_bytes)
        with self.lock:
            self._growing = 0
            if slab is not None:
                self._add_slab(slab, n)
            else:
                self.grow_ahead = False
                self.max_slots = self.num_slots

    def put(self, key: bytes, kv: torch.Tensor, tag: str | None = None) -> bool:
        size = kv.numel() * kv.element_size()
        with self.lock:
            if key in self.chunks:
                self.chunks.move_to_end(key)
                return True
            if not self._make_room(size):
                return False
            t0 = time.perf_counter()
            slot = self._slot() if size == self.slot_bytes else None
            if slot is not None:
                stored = slot.view(kv.dtype).view(kv.shape)
                stored.copy_(kv)
                self.slot_of[key] = slot
            else:
                stored = kv.contiguous()
                if self.pin_memory and not stored.is_pinned():
                    stored = stored.pin_memory()
            self._insert(key, stored, size, tag)
            self.stats.store_seconds += time.perf_counter() - t0
            return True

    def put_from(self, items: list[tuple[bytes, torch.Tensor]], tag: str | None = None) -> list[bytes]:
        """Store each ``(key, kv)`` where ``kv`` may be on the GPU: copied straight into a slot
        (asynchronously from the device when the slot is pinned), else as ``put``. The caller
        synchronizes the device before anything reads the stored chunks. Returns the keys stored."""
        done = []
        with self.lock:
            for key, kv in items:
                if key in self.chunks:
                    self.chunks.move_to_end(key)
                    continue
                size = kv.numel() * kv.element_size()
                if not self._make_room(size):
                    continue
                t0 = time.perf_counter()
                slot = self._slot() if size == self.slot_bytes else None
                if slot is not None:
                    stored = slot.view(kv.dtype).view(kv.shape)
                    stored.copy_(kv, non_blocking=self.pin_memory)
                    self.slot_of[key] = slot
                else:
                    stored = kv.to("cpu", copy=True).contiguous()
                    if self.pin_memory:
                        stored = stored.pin_memory()
                self._insert(key, stored, size, tag)
                self.stats.store_seconds += time.perf_counter() - t0
                done.append(key)
        return done

    def _insert(self, key: bytes, kv: torch.Tensor, size: int, tag: str | None) -> None:
        self.chunks[key] = kv
        if tag is not None:
            self.tags[key] = tag
        self.used += size
        self.stats.stores += 1
        self.stats.bytes_in += size

    def get(self, key: bytes, pin: bool = False) -> torch.Tensor | None:
        with self.lock:
            kv = self.chunks.get(key)
            if kv is None:
                self.stats.misses += 1
                return None
            self.chunks.move_to_end(key)
            self.stats.hits += 1
            if pin:
                self.pins[key] = self.pins.get(key, 0) + 1
            return kv

    def discard(self, key: bytes) -> None:
        """Drop a chunk unless it is pinned (being loaded)."""
        with self.lock:
            if key in self.chunks and not self.pins.get(key):
                self._remove(key)

    def clear(self) -> None:
        """Drop every unpinned chunk (memory pressure, tests)."""
        with self.lock:
            for key in [k for k in self.chunks if not self.pins.get(k)]:
                self._remove(key)

    def unpin(self, key: bytes) -> None:
        with self.lock:
            n = self.pins.get(key, 0) - 1
            if n > 0:
                self.pins[key] = n
            else:
                self.pins.pop(key, None)

    def check_invariants(self) -> None:
        assert self.used == sum(t.numel() * t.element_size() for t in self.chunks.values())
        assert self.used <= self.capacity
        assert set(self.pins) <= set(self.chunks), set(self.pins) - set(self.chunks)
        assert set(self.tags) <= set(self.chunks), set(self.tags) - set(self.chunks)
        assert set(self.slot_of) <= set(self.chunks), set(self.slot_of) - set(self.chunks)
        assert len(self.slot_of) + len(self.free_slots) == self.num_slots
        assert self.num_slots + self._growing <= self.max_slots
        ptrs = [s.data_ptr() for s in self.slot_of.values()] + [s.data_ptr() for s in self.free_slots]
        assert len(set(ptrs)) == len(ptrs), "a slot is used twice"
        for k, slot in self.slot_of.items():
            assert self.chunks[k].data_ptr() == slot.data_ptr()

"""TieredStore: the tiers together, the background I/O, and the load-or-recompute cost model.

    spill (GPU eviction, idle session, shutdown) --put--> CPU tier (LRU, pinned)
    seal (a block's KV computed: write-through)   \\--writer thread--> disk, Redis (encoded chunks)
    new request --prefetch thread--> disk / Redis --authenticate + checks--> staging (CPU) --> GPU

Written through: with disk or Redis on, every full block is queued for them once its KV is
computed, so a process that ends without a shutdown (or dies after the write landed) leaves its
prefixes behind. The queue is bounded: when the writer falls behind, a write is dropped and
counted (``writes_dropped``), never waited for on the step. A key a tier is known to hold is
never written to it again.

The scheduler never waits for disk or Redis: a request whose prefix may live there is handed to
the prefetch thread and stays in the queue (others go ahead) until its chunks are in memory or
known missing. Loading from memory into the GPU happens in the runner before the step's forward.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from kvserve.kvtier.chunk import ChunkCodec, ChunkError
from kvserve.kvtier.lower import DiskTier, RedisTier
from kvserve.kvtier.tiers import CpuTier

log = logging.getLogger(__name__)


@dataclass
class CostModel:
    """Load a prefix from a tier when its measured transfer time beats recomputing it at the
    measured prefill speed. Bandwidths and the prefill speed start from conservative guesses and
    follow what the engine measures (exponential moving averages)."""
    prefill_tokens_per_s: float = 2000.0
    bandwidth: dict = field(default_factory=lambda: {"cpu": 2e9, "disk": 5e8, "redis": 2e8})
    latency: dict = field(default_factory=lambda: {"cpu": 0.0, "disk": 2e-4, "redis": 1e-3})
    alpha: float = 0.3
    full_weight_tokens: int = 512  # a step computing fewer prompt tokens moves the estimate less

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """``seconds``: the step's compute only (the engine leaves out KV loads and offloads).
        Weighted by size: a small prefill's speed is mostly the step's fixed cost, and says
        little about what recomputing a long prefix would take."""
        if tokens >= 32 and seconds > 0:
            a = self.alpha * min(1.0, tokens / self.full_weight_tokens)
            self.prefill_tokens_per_s += a * (tokens / seconds - self.prefill_tokens_per_s)

    def observe_transfer(self, tier: str, nbytes: int, seconds: float) -> None:
        if nbytes >= 1 << 16 and seconds > 0:
            bw = self.bandwidth.get(tier, 1e9)
            self.bandwidth[tier] = bw + self.alpha * (nbytes / seconds - bw)

    def load_seconds(self, tier: str, nbytes: int, nchunks: int) -> float:
        return self.latency.get(tier, 0.0) * nchunks + nbytes / self.bandwidth.get(tier, 1e9)

    def recompute_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def should_load(self, tier: str, tokens: int, nbytes: int, nchunks: int) -> bool:
        return self.load_seconds(tier, nbytes, nchunks) < self.recompute_seconds(tokens)


@dataclass
class LoadStats:
    tokens_loaded: dict = field(default_factory=lambda: {"cpu": 0, "disk": 0, "redis": 0})
    tokens_recomputed_by_choice: int = 0  # found in a tier, recomputed because that was cheaper
    seconds_saved: float = 0.0  # estimated: recompute time minus load time of what was loaded
    loads_chosen: int = 0
    recomputes_chosen: int = 0
    offloaded_blocks: int = 0  # copied to the tiers by the runner when the GPU cache evicted them
    idle_offloaded_blocks: int = 0  # left the GPU with their idle session
    session_blocks_written: int = 0  # copied to the tiers at the end of a session's turn
    offloads_skipped: int = 0  # left the GPU without a copy: the tiers already held their KV
    load_seconds: float = 0.0  # copying loaded chunks into the GPU (measured by the runner)
    offload_seconds: float = 0.0  # copying blocks out of the GPU through ``offload``
    written_through: int = 0  # full blocks queued for disk/Redis as their KV was computed
    writes_dropped: int = 0  # disk/Redis writes dropped because the write queue was full
    chunks_scrubbed: int = 0  # further chunks of a prefix checked after one failed (bad ones dropped)


class TieredStore:
    def __init__(self, block_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                 cpu_bytes: int = 0, disk_dir: str | None = None, disk_bytes: int = 0,
                 redis_url: str | None = None, block_size: int = 16, secret: bytes | None = None,
                 encrypt: bool = False, write_queue: int = 512, staging_bytes: int = 0):
        """``secret``: authenticates (``encrypt``: and encrypts) the disk and Redis chunks
        (``kvtier.secret.tier_secret``); needed when either is on. ``staging_bytes``: at least
        this much staging memory (a disaggregated decode instance receives KV there)."""
        self.block_shape, self.dtype, self.device = tuple(block_shape), dtype, device
        self.block_size = block_size
        self.chunk_bytes = dtype.itemsize
        for s in self.block_shape:
            self.chunk_bytes *= s
        pin = device.type == "cuda"
        slot = self.chunk_bytes if pin else None  # pinned memory: in slots of large slabs
        self.cpu = CpuTier(cpu_bytes, pin, slot) if cpu_bytes else None
        # Where prefetched chunks wait for the GPU when there is no CPU tier to hold them.
        self.staging = self.cpu or CpuTier(max(64 * self.chunk_bytes, 256 << 20, staging_bytes), pin, slot)
        self.disk = DiskTier(disk_dir, disk_bytes) if disk_dir else None
        self.redis = RedisTier(redis_url) if redis_url else None
        self.lower = [t for t in (self.disk, self.redis) if t is not None]
        if self.lower and secret is None:
            raise ValueError("disk and Redis tiers need a secret (kvserve.kvtier.secret.tier_secret)")
        self.codec = ChunkCodec(secret, encrypt) if self.lower else None
        self.cost = CostModel(prefill_tokens_per_s=20000.0 if device.type == "cuda" else 2000.0,
                              bandwidth={"cpu": 2e10 if pin else 4e9, "disk": 5e8, "redis": 2e8})
        self.load_stats = LoadStats()
        self._writes: queue.Queue = queue.Queue(maxsize=write_queue)  # chunks waiting for disk/Redis (host memory)
        self._deferred: list[tuple[list[bytes], object]] = []  # offload(defer=True) copies awaiting commit()
        self._prefetches: queue.Queue = queue.Queue()
        self.prefetch_done: dict[int, int] = {}  # prefetch token -> chunks staged (set when finished)
        self._prefetch_seq = 0
        self._threads = []
        if self.lower:
            for target in (self._writer, self._prefetcher):
                t = threading.Thread(target=target, daemon=True, name=f"kvtier-{target.__name__[1:]}")
                t.start()
                self._threads.append(t)

    @property
    def keeps_spills(self) -> bool:
        """Whether blocks leaving the GPU have a tier to go to (a store with staging memory only,
        for received KV, has none)."""
        return self.cpu is not None or bool(self.lower)

    @property
    def tiers(self):
        return [t for t in (self.cpu, self.disk, self.redis) if t is not None]

    # -- storing -------------------------------------------------------------------------
    def put(self, key: bytes, kv: torch.Tensor, wait: bool = False) -> None:
        """One block's KV (on the CPU) leaves the GPU: into the CPU tier, and written behind to
        disk and Redis so it survives eviction from memory, restarts and other replicas."""
        if self.cpu is not None:
            self.cpu.put(key, kv)
        elif self.lower:  # no CPU tier: keep it in the staging memory until it is read back
            self.staging.put(key, kv)
        if self.lower:
            self._queue_write(key, kv, wait)

    def _queue_write(self, key: bytes, kv: torch.Tensor, wait: bool) -> None:
        try:
            self._writes.put((key, kv), block=wait)
        except queue.Full:  # the disks are behind: drop the write rather than stall a step
            self.load_stats.writes_dropped += 1
            if self.cpu is None:  # staged only for the writer: left there, it would count as held
                self.staging.discard(key)

    def _writer(self) -> None:
        while True:
            key, kv = self._writes.get()
            try:
                data = None
                for t in self.lower:
                    if t.holds(key):
                        continue
                    data = data or self.codec.encode(key, kv)
                    t.put(key, data)
                if self.cpu is None:  # written through: the write-behind copy in memory can go
                    self.staging.discard(key)
            except Exception:  # a writer must never die: count it and go on
                log.exception("KV tier write failed")
            finally:
                self._writes.task_done()

    def holds(self, key: bytes) -> bool:
        """Whether the tiers already hold ``key``'s KV, so a block leaving the GPU needs no copy
        (keys are content hashes: same key, same KV). Memory counts (the CPU tier, refreshed in
        its LRU; without one, the staging memory), and disk or Redis only when there is no CPU
        tier (with one, a copy into memory is what makes the next load fast). Redis counts when
        this process wrote or read the key there (no round trip)."""
        if self.cpu is not None:
            return self.cpu.touch(key)
        return self.staging.touch(key) or any(t.holds(key) for t in self.lower)

    def held_below(self, key: bytes) -> bool:
        """Whether every lower tier holds ``key``: writing it through would change nothing."""
        return all(t.holds(key) for t in self.lower)

    def offload(self, data: torch.Tensor, blocks: list[tuple[int, bytes]], batch: int = 64,
                wait: bool = False, defer: bool = False) -> int:
        """Copy the KV of these device blocks (``data[:, :, block]``, the runner's cache) into the
        tiers under their keys, skipping keys they already hold. On the GPU each block goes
        straight into a pinned slot of the CPU tier with an asynchronous copy, one synchronize per
        batch (no pageable buffer, no clone, no pinned allocation per block). The lower tiers get
        their write-behind copy as with ``put`` (``wait``: block on a full queue rather than drop
        the write). ``defer``: no synchronize at all: the copies are queued on the stream (after
        the step's forward, for write-through), their chunks pinned in memory, and ``commit``
        hands them to the writer once the device is past them. Returns the blocks copied."""
        tier = self.cpu if self.cpu is not None else self.staging
        todo, in_memory = [], []
        for k, b in {k: b for b, k in blocks}.items():
            if not self.holds(k):
                todo.append((k, b))
            elif (defer or wait) and self.lower and not self.held_below(k):
                in_memory.append(k)
        # Write-through and shutdown: a lower tier lacks a block memory holds (its write was
        # dropped, or the tier lost it): written from the copy in memory.
        if in_memory:
            self._write_behind(tier, in_memory, wait)
        if not todo:
            return 0
        t0 = time.perf_counter()
        done, keys = 0, []
        for i in range(0, len(todo), batch):
            part = todo[i:i + batch]
            idx = torch.tensor([b for _, b in part], device=data.device)
            rows = data.movedim(2, 0)[idx]  # [n, <one block>], contiguous, on the device
            stored = tier.put_from([(k, rows[j]) for j, (k, _) in enumerate(part)])
            done += len(stored)
            if defer:
                if self.lower:  # no room in memory (every chunk pinned): the write is lost
                    self.load_stats.writes_dropped += len(part) - len(stored)
                with tier.lock:  # not evicted (its slot not reused) before the copy lands
                    stored = [k for k in stored if k in tier.chunks]  # (one this batch's puts evicted: lost)
                    for k in stored:
                        tier.pins[k] = tier.pins.get(k, 0) + 1
                keys.extend(stored)
                continue
            if data.device.type == "cuda":
                torch.cuda.current_stream(data.device).synchronize()
            self._write_behind(tier, stored, wait)
        if defer and keys:
            event = None
            if data.device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(data.device))
            self._deferred.append((keys, event))
        self.load_stats.offload_seconds += time.perf_counter() - t0
        return done

    def _write_behind(self, tier: CpuTier, keys: list[bytes], wait: bool, unpin: bool = False) -> None:
        """Queue the lower tiers' writes of ``keys``, now in ``tier`` (``unpin``: as ``offload``
        with ``defer`` left them)."""
        with tier.lock:  # (the writer's discard of a written staging chunk waits for the unpin)
            if unpin:
                for k in keys:
                    tier.unpin(k)
            # The writer gets its own copy: a slot is reused after eviction.
            held = [(k, tier.chunks[k].clone()) for k in keys if k in tier.chunks] if self.lower else []
        for k, kv in held:
            self._queue_write(k, kv, wait)

    def commit(self, ok: bool = True) -> None:
        """The step whose copies ``offload(defer=True)`` queued is done: once the device is past
        them, hand their chunks to the writer. ``ok`` false (the step failed): drop them instead."""
        deferred, self._deferred = self._deferred, []
        tier = self.cpu if self.cpu is not None else self.staging
        for keys, event in deferred:
            if event is not None:
                event.synchronize()
            if ok:
                self._write_behind(tier, keys, wait=False, unpin=True)
                continue
            with tier.lock:
                for k in keys:
                    tier.unpin(k)
                    tier.discard(k)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait until every queued write reached its tier (shutdown, tests)."""
        deadline = time.monotonic() + timeout
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    # -- finding -------------------------------------------------------------------------
    def in_memory(self, key: bytes) -> bool:
        return key in self.staging  # the CPU tier itself when there is one

    def may_have_below(self, key: bytes) -> bool:
        """Whether disk or Redis might hold ``key`` (disk: its index; Redis: only asking tells)."""
        if self.disk is not None and key in self.disk:
            return True
        # While Redis is down, ask again once a retry is due (the prefetch thread pings).
        return self.redis is not None and self.redis.may_answer()

    def start_prefetch(self, keys: list[bytes]) -> int:
        """Bring the leading run of ``keys`` that lives in disk/Redis into memory, off the step.
        Returns the token under which ``prefetch_done`` reports it (unique, unlike request ids)."""
        self._prefetch_seq += 1
        self._prefetches.put((self._prefetch_seq, list(keys)))
        return self._prefetch_seq

    def _prefetcher(self) -> None:
        while True:
            rid, keys = self._prefetches.get()
            n = 0
            try:
                for key in keys:
                    if self.in_memory(key):
                        n += 1
                        continue
                    bad: list = []
                    got = self._fetch(key, len(keys) - n, bad)
                    if bad:
                        self._scrub(bad, keys[n + 1:])
                    if got is None:
                        break
                    n += 1
            except Exception:
                log.exception("KV tier prefetch failed")
            self.prefetch_done[rid] = n

    def _scrub(self, tiers: list, keys: list[bytes]) -> None:
        """A chunk of these tiers failed its checks: check the rest of the prefix there too and
        drop every bad one now, so that one request finds them all (the run stops at the first
        bad chunk; what follows is recomputed and written through in place of the dropped)."""
        for t in tiers:
            for key in keys:
                if isinstance(t, DiskTier) and not t.holds(key):
                    continue
                data = t.get(key)
                if data is None:
                    continue
                self.load_stats.chunks_scrubbed += 1
                try:
                    self.codec.decode(data, key, self.block_shape, self.dtype)
                except ChunkError as e:
                    self._drop_bad(t, key, e)

    def _drop_bad(self, t, key: bytes, e: ChunkError) -> None:
        t.stats.corrupt += 1
        log.warning("%s KV tier: dropping chunk %s: %s", t.name, key.hex()[:12], e)
        t.drop(key)

    def _fetch(self, key: bytes, remaining: int, bad: list) -> torch.Tensor | None:
        """``key``'s chunk from the first lower tier that has a valid one (and is worth loading
        from), staged in memory; tiers whose chunk failed its checks are appended to ``bad``."""
        for t in self.lower:
            tokens = remaining * self.block_size
            measured = t.stats.load_bandwidth() is not None  # never measured: one load to learn its speed
            if measured and not self.cost.should_load(t.name, tokens, remaining * self.chunk_bytes, remaining):
                self.load_stats.recomputes_chosen += 1
                continue
            t0 = time.perf_counter()
            data = t.get(key)
            if data is None:
                continue
            try:
                kv = self.codec.decode(data, key, self.block_shape, self.dtype)
            except ChunkError as e:
                self._drop_bad(t, key, e)
                bad.append(t)
                continue
            self.cost.observe_transfer(t.name, len(data), time.perf_counter() - t0)
            if self.staging.put(key, kv, tag=t.name):  # tagged: a load from it credits this tier
                return kv
            return None  # no room to stage: recompute the rest
        return None

    def take_run(self, keys: list[bytes]) -> list[tuple[bytes, torch.Tensor, str]]:
        """The leading run of ``keys`` held in memory, pinned until ``release``d, with the tier
        each came from; cut where loading stops paying (the cost model)."""
        run = []
        for key in keys:
            kv = self.staging.get(key, pin=True) if key in self.staging else None
            if kv is None:
                break
            run.append((key, kv, self.staging.tags.get(key) or "cpu"))
        if not run:
            return run
        tokens = len(run) * self.block_size
        # What is already in memory costs only the copy to the device.
        if not self.cost.should_load("cpu", tokens, len(run) * self.chunk_bytes, 1):
            self.release(run)
            self.load_stats.recomputes_chosen += 1
            self.load_stats.tokens_recomputed_by_choice += tokens
            return []
        return run

    def release(self, run) -> None:
        for key, _, _ in run:
            self.staging.unpin(key)

    def loaded(self, run, seconds: float) -> None:
        """The runner copied ``run`` into the GPU: account for it and let the chunks go."""
        st = self.load_stats
        tokens = len(run) * self.block_size
        st.loads_chosen += 1
        for key, _, origin in run:
            st.tokens_loaded[origin] = st.tokens_loaded.get(origin, 0) + self.block_size
            self.staging.tags.pop(key, None)  # from now on it is served from memory
        st.seconds_saved += max(0.0, self.cost.recompute_seconds(tokens) - seconds)
        st.load_seconds += seconds
        self.cost.observe_transfer("cpu", len(run) * self.chunk_bytes, seconds)
        self.release(run)
        if self.staging is not self.cpu:  # staged chunks have done their job
            for key, _, _ in run:
                self.staging.discard(key)

    # -- stats ---------------------------------------------------------------------------
    def snapshot(self) -> dict:
        out = {"load": dict(vars(self.load_stats)), "cost_model": {
            "prefill_tokens_per_s": self.cost.prefill_tokens_per_s, "bandwidth": dict(self.cost.bandwidth)}}
        for t in self.tiers:
            s = vars(t.stats).copy()
            s["hit_rate"] = t.stats.hit_rate
            s["used_bytes"] = getattr(t, "used", None)
            s["capacity_bytes"] = getattr(t, "capacity", None)
            if isinstance(t, CpuTier):
                s["slab_bytes"] = sum(x.numel() for x in t.slabs)
                s["slab_seconds"] = t.slab_seconds
            out[t.name] = s
        return out

"""Scheduler: continuous batching by counters.

Each step moves every scheduled request's ``num_computed_tokens`` toward ``num_tokens`` within
a token budget. A prompt is a request far behind (possibly chunked over several steps), a decode
step is a request one token behind; prefix-cache hits start a request ahead, preemption sends it
back to zero (recompute) or keeps its counter with its KV in CPU memory (swap). There is no
separate prefill phase.

Order: running requests first, in arrival order (they hold KV), then waiting ones, FCFS. When the
pool runs dry the newest running request is preempted and put at the head of the queue; nothing
is admitted in a step that preempted, so an old request is never overtaken for long.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_table: list[int]
    samples: bool = False  # the step reaches the end of the known tokens, so a token is sampled

    def __post_init__(self):
        r = self.request
        self.samples = r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    swap_out: dict[str, list[int]] = field(default_factory=dict)  # request id -> device blocks
    swap_in: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    # Tiered KV store: blocks whose KV leaves for the tiers before this step writes anything
    # (evicted from the prefix cache), and chunks to copy into freshly allocated blocks.
    offloads: list[tuple[int, bytes]] = field(default_factory=list)  # (block, key)
    loads: list[tuple[list[int], list]] = field(default_factory=list)  # (blocks, store run) per request

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, sched: SchedulerConfig, cache: CacheConfig, kv: KVCacheManager,
                 max_model_len: int, swap_capacity_blocks: int = 0, store=None):
        self.config = sched
        self.cache_config = cache
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swap_capacity_blocks = swap_capacity_blocks
        self.swap_used_blocks: dict[str, int] = {}
        self.watermark_blocks = int(cache.watermark * kv.pool.num_blocks)
        self.num_preemptions = 0
        self.store = store  # kvserve.kvtier.TieredStore, or None
        if store is not None:
            kv.pool.record_evictions = True

    # -- admission -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.waiting.append(req)

    def blocks_to_finish(self, num_prompt_tokens: int, max_tokens: int, n: int) -> int:
        """Blocks a request needs at its largest: its prompt plus n completions."""
        full_prompt_blocks = num_prompt_tokens // self.kv.block_size
        per_child = self.kv.blocks_for(num_prompt_tokens + max_tokens) - full_prompt_blocks
        return self.kv.blocks_for(num_prompt_tokens) + n * per_child

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        out = SchedulerOutput(scheduled, 0)
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0 or (req.token_pending and self._length_done(req)):
                # Nothing to compute; or (async scheduling) the token in flight is its last.
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRequest(req, n, self.kv.table(req)))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted; the running list ends here

        idx = 0
        while (idx < len(self.waiting) and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[idx]
            run: list = []
            if req.swapped_out:
                computed: list[int] = []
                n = min(req.num_tokens - req.num_computed_tokens, budget)
            else:
                computed = self.kv.get_computed_blocks(req)
                if self.store is not None and req.metrics.first_scheduled_time is None:
                    keys = req.block_hashes[len(computed):(req.num_tokens - 1) // self.kv.block_size]
                    if keys and self._awaiting_prefetch(req, keys):
                        idx += 1  # its chunks are on their way from disk/Redis: others go first
                        continue
                    run = self.store.take_run(keys) if keys else []
                n_hit = (len(computed) + len(run)) * self.kv.block_size
                n = req.num_tokens - n_hit
                if not self.config.enable_chunked_prefill and n > budget:
                    if scheduled:
                        if run:
                            self.store.release(run)
                        break
                    # A prompt over the budget still runs alone rather than never.
                else:
                    n = min(n, budget)
            # The watermark keeps room for running requests to grow; alone, a request may use it all.
            reserve = self.watermark_blocks if self.running else 0
            n_loaded = len(run) * self.kv.block_size
            if not self.kv.allocate_slots(req, n_loaded + n, computed, reserve_blocks=reserve):
                if run:
                    self.store.release(run)
                break
            del self.waiting[idx]
            if req.swapped_out:
                blocks = self.kv.table(req)[: self.kv.blocks_for(req.num_computed_tokens)]
                out.swap_in[req.request_id] = list(blocks)
                self.swap_used_blocks.pop(req.request_id, None)
                req.swapped_out = False
            else:
                if run:
                    out.loads.append((self.kv.table(req)[len(computed):len(computed) + len(run)], run))
                req.num_computed_tokens = n_hit
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = time.time()
                    req.metrics.num_cached_tokens = len(computed) * self.kv.block_size
                    req.metrics.num_loaded_tokens = n_loaded
                    self.kv.record_prefix_lookup(req.num_prompt_tokens, len(computed) * self.kv.block_size)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, n, self.kv.table(req)))
            budget -= n

        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        out.copies = self.kv.take_pending_copies()
        if self.store is not None:
            evicted, self.kv.pool.evicted = self.kv.pool.evicted, []
            # Only what the tiers do not hold yet is copied out (keys are content hashes): most
            # evicted blocks were loaded from the CPU tier or written there at the end of their
            # session's turn, and copying them again cost ~1 ms a block on the engine thread.
            out.offloads = [(b, k) for b, k in evicted if not self.store.holds(k)]
            self.store.load_stats.offloads_skipped += len(evicted) - len(out.offloads)
        return out

    def _length_done(self, req: Request) -> bool:
        return req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len

    def _awaiting_prefetch(self, req: Request, keys: list[bytes]) -> bool:
        """True while the store's prefetch thread is fetching ``req``'s chunks from disk/Redis.
        Started once per request, only when there are lower tiers and the first missing chunk is
        not already in memory."""
        store = self.store
        if not store.lower or req.prefetch_state == "done":
            return False
        if req.prefetch_state is None:
            # The first chunk not already in memory decides: if no lower tier may hold it, the
            # request goes on now (what is in memory loads, the rest is computed).
            first_missing = next((k for k in keys if not store.in_memory(k)), None)
            if first_missing is None or not store.may_have_below(first_missing):
                req.prefetch_state = "done"
                return False
            req.prefetch_state = "pending"
            req.prefetch_token = store.start_prefetch(keys)
            return True
        if store.prefetch_done.pop(req.prefetch_token, None) is not None:
            req.prefetch_state = "done"
            return False
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        req.metrics.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        n_blocks = self.kv.blocks_for(req.num_computed_tokens)
        free_swap = self.swap_capacity_blocks - sum(self.swap_used_blocks.values())
        if (self.cache_config.preemption_mode == "swap" and 0 < n_blocks <= free_swap):
            out.swap_out[req.request_id] = list(self.kv.table(req)[:n_blocks])
            self.swap_used_blocks[req.request_id] = n_blocks
            req.swapped_out = True
        else:
            req.num_computed_tokens = 0
        self.kv.free(req)
        out.preempted.append(req.request_id)
        self.waiting.appendleft(req)

    # -- after the forward -----------------------------------------------------------------
    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark ``req`` finished and give its blocks back (it may be running or waiting)."""
        req.status = status
        req.metrics.finished_time = time.time()
        if self.store is not None and req.prefetch_state == "pending":
            self.store.prefetch_done.pop(req.prefetch_token, None)  # (a later finish leaves one int)
        self.kv.free(req)
        self.swap_used_blocks.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def fork(self, parent: Request, child: Request) -> None:
        """Put ``child`` right after ``parent`` in the running list, sharing its blocks."""
        self.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        self.running.insert(self.running.index(parent) + 1 + child.index - 1, child)

"""Scheduler: continuous batching by counters.

Each step moves every scheduled request's ``num_computed_tokens`` toward ``num_tokens`` within
a token budget. A prompt is a request far behind (possibly chunked over several steps), a decode
step is a request one token behind; prefix-cache hits start a request ahead, preemption sends it
back to zero (recompute) or keeps its counter with its KV in CPU memory (swap). There is no
separate prefill phase.

After the step, ``update`` applies what the model produced: counters move, tokens are appended,
a request owing forks (``n > 1``) forks, and a request that reached end-of-text, a stop token or
its length finishes and gives its blocks back. Each of those rules is written here once.

Order: running requests first, in arrival order (they hold KV), then waiting ones, FCFS. When the
pool runs dry the newest running request is preempted and put at the head of the queue; nothing
is admitted in a step that preempted, so an old request is never overtaken for long.

Admission keeps room for what the running requests will still need (``decode_reserve``): the rest
of their prompts and a fraction of the tokens each may still generate. Without it a long queue
fills the pool with prompts, the decodes that follow run it dry, and the preempted requests
compute their prompts again. The fraction is learned from finished requests (generated over
allowed, a moving average), so a workload that stops early at end-of-text keeps little room and
one that runs to ``max_tokens`` keeps it all; preemption stays the fallback when it is too low.
"""
from __future__ import annotations

import time
from collections import deque

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.kv_groups import NULL
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.step import (
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)

# A request's future tokens counted at most, in the room admission keeps: one without max_tokens
# may generate the whole context, which would otherwise keep a request's worth of a long-context
# model's pool per running request.
RESERVE_TOKENS_CAP = 4096
RESERVE_LEARNING = 1 / 16  # the moving average's weight of each finished request


class Scheduler:
    def __init__(self, sched: SchedulerConfig, cache: CacheConfig, kv: KVCacheManager,
                 max_model_len: int, swap_capacity_blocks: int = 0, tiers=None):
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
        # The fraction of a running request's remaining tokens that admission keeps room for.
        self.decode_ratio = 1.0 if sched.decode_reserve is None else float(sched.decode_reserve)
        # Every unfinished request by group (a request with n > 1 and its forks): for aborts.
        self.groups: dict[str, list[Request]] = {}
        self.tiers = tiers  # kvserve.kvtier.TierConnector, or None
        if tiers is not None:
            kv.pool.record_evictions = True
            kv.pool.record_sealed = tiers.writes_through

    # -- admission -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.groups[req.group_id] = [req]
        self.waiting.append(req)

    def abort_group(self, group_id: str) -> list[Request]:
        """Finish every unfinished request of the group as aborted; returns the group."""
        reqs = self.groups.pop(group_id, [])
        for req in reqs:
            if not req.is_finished:
                self.finish(req, RequestStatus.FINISHED_ABORTED)
        return reqs

    def blocks_to_finish(self, num_prompt_tokens: int, max_tokens: int, n: int,
                         kv_budget: int | None = None) -> int:
        """Blocks a request needs at its largest: its prompt plus n completions, in every KV
        group; a sliding-window group holds at most its window and the largest step's tokens;
        under a ``kv_budget`` each sequence's global groups hold at most the budget's blocks
        (SnapKV: or its whole prompt, held until compressed)."""
        full_prompt_blocks = num_prompt_tokens // self.kv.block_size
        per_child = self.kv.blocks_for(num_prompt_tokens + max_tokens) - full_prompt_blocks
        full = self.kv.blocks_for(num_prompt_tokens) + n * per_child
        held = full
        if kv_budget is not None:
            per_seq = kv_budget // self.kv.block_size
            if self.cache_config.kv_eviction == "snapkv":
                per_seq = max(per_seq, self.kv.blocks_for(num_prompt_tokens))
            held = min(n * per_seq, full)
        step = self._largest_step(num_prompt_tokens)
        if kv_budget is not None and self.cache_config.kv_eviction in ("streaming", "h2o"):
            # ``KVCacheManager.step_tokens`` cuts such a request's steps to its budget's free blocks
            # and the rest of its last one (a SnapKV prompt runs to its end uncut)
            step = min(step, kv_budget + self.kv.block_size - 1)
        return sum(held if w is None else min(full, n * self._window_blocks(w, step)) for w in self.kv.windows)

    def _largest_step(self, num_prompt_tokens: int) -> int:
        """The most tokens one step computes for a request: the token budget (a prompt over it
        runs whole only unchunked)."""
        step = self.config.max_num_batched_tokens
        return step if self.config.enable_chunked_prefill else max(step, num_prompt_tokens)

    def _window_blocks(self, window: int, step: int) -> int:
        """The most blocks a sliding-window group holds for one sequence: its window and a step."""
        return self.kv.blocks_for(window - 1 + step) + 1

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
            n_known = req.num_tokens - req.num_computed_tokens
            drafts = req.spec_token_ids  # (replaced, never changed in place: it may go as is)
            if drafts:
                req.spec_token_ids = []
                n = min(n_known + len(drafts), budget)
                drafts = drafts[:max(0, n - n_known)]  # a budget cut drops drafts first
            else:
                n = min(n_known, budget)
            if req.params.kv_budget is not None:
                n = self.kv.step_tokens(req, n)
            if n <= 0 or (req.length_reached and req.token_pending):
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
                scheduled.append(ScheduledRequest(req, n, self.kv.table(req), draft_token_ids=drafts,
                                                  group_tables=self._group_tables(req)))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted; the running list ends here

        idx = 0
        owed = None  # blocks the running requests are still expected to take (computed when needed)
        while (idx < len(self.waiting) and budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[idx]
            run: list = []
            if req.swapped_out:
                computed: list[int] = []
                n = min(req.num_tokens - req.num_computed_tokens, budget)
            else:
                computed = self.kv.get_computed_blocks(req)
                if self.tiers is not None and req.metrics.first_scheduled_time is None:
                    keys = req.block_hashes[len(computed):(req.num_tokens - 1) // self.kv.block_size]
                    if keys and self.tiers.awaiting_prefetch(req, keys):
                        idx += 1  # its chunks are on their way from disk/Redis: others go first
                        continue
                    run = self.tiers.take_run(keys) if keys else []
                n_hit = (len(computed) + len(run)) * self.kv.block_size
                n = req.num_tokens - n_hit
                if not self.config.enable_chunked_prefill and n > budget:
                    if scheduled:
                        if run:
                            self.tiers.release(run)
                        break
                    # A prompt over the budget still runs alone rather than never.
                else:
                    n = min(n, budget)
                if req.params.kv_budget is not None:  # admitted on its budget, not its length
                    n = self.kv.step_tokens(req, n, computed)
            # The watermark and the decode reserve keep room for running requests to grow (and this
            # one, once admitted); alone, a request may use it all.
            reserve = 0
            n_loaded = len(run) * self.kv.block_size
            if self.running:
                if owed is None:
                    owed = sum(self._owed_blocks(r) for r in self.running) if self.decode_ratio else 0
                reserve = self.watermark_blocks + owed
                if self.decode_ratio:
                    after = (req.num_computed_tokens if req.swapped_out else n_hit) + n  # (hits and loads)
                    reserve += self._owed_blocks(req, self.kv.blocks_for(after), after)
            if not self.kv.allocate_slots(req, n_loaded + n, computed, reserve_blocks=reserve):
                if run:
                    self.tiers.release(run)
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
            if owed is not None and self.decode_ratio:
                c = req.num_computed_tokens + n
                owed += self._owed_blocks(req, self.kv.blocks_for(c), c)
            scheduled.append(ScheduledRequest(req, n, self.kv.table(req), group_tables=self._group_tables(req)))
            budget -= n

        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        out.copies = self.kv.take_pending_copies()
        if self.tiers is not None:
            evicted, self.kv.pool.evicted = self.kv.pool.evicted, []
            out.offloads = self.tiers.to_offload(evicted)
            sealed, self.kv.pool.sealed = self.kv.pool.sealed, []
            out.writes = self.tiers.to_write(sealed)
        return out

    def _owed_blocks(self, req: Request, held: int | None = None, computed: int | None = None) -> int:
        """Blocks ``req`` is expected to take beyond what it holds with ``held`` blocks spanned and
        ``computed`` tokens computed (None: as it stands): the rest of its prompt and
        ``decode_ratio`` of the tokens it may still generate, and for each fork to come its copy
        of the last prompt block and its own tokens; in each KV group, a sliding-window group at
        most its window and a step (as ``blocks_to_finish``), less the blocks it still holds (those
        its window reaches). A request with a ``kv_budget`` holds at most its budget's blocks:
        nothing is counted."""
        if req.params.kv_budget is not None:
            return 0
        kv, bs = self.kv, self.kv.block_size
        left = int(self.decode_ratio * min(req.max_tokens - req.num_output_tokens, RESERVE_TOKENS_CAP) + 0.5)
        target = kv.blocks_for(req.num_tokens + left)
        fork = target - req.num_tokens // bs
        if held is None:
            held, computed = len(kv.table(req)), req.num_computed_tokens
        step = self._largest_step(req.num_prompt_tokens)
        owed = 0
        for g, w in enumerate(kv.windows):
            if w is None:
                owed += max(0, target - held) + req.pending_forks * fork
            else:
                cap = min(target, self._window_blocks(w, step))
                own = self._own_window_blocks(req, g, held, computed)
                owed += max(0, cap - own) + req.pending_forks * min(fork, cap)
        return owed

    def _own_window_blocks(self, req: Request, g: int, held: int, computed: int) -> int:
        """The blocks of a sliding-window group ``req`` holds alone within its window. Blocks it
        shares (a fork's prompt, a prefix-cache hit) do not count: as the window moves past
        them each sharer takes blocks of its own. A request being admitted (``held`` past its
        table) holds none yet."""
        table = self.kv.group_tables[g].get(req.request_id)
        if table is None or len(table) < held:
            return 0
        blocks = self.kv.pool.blocks
        return sum(1 for b in table[self.kv.first_needed(g, computed):held] if b != NULL and blocks[b].ref_cnt == 1)

    def _learn_decode_ratio(self, req: Request) -> None:
        """Move the learned fraction toward what a finished request generated of what it could."""
        allowed = min(req.max_tokens, RESERVE_TOKENS_CAP)
        if self.config.decode_reserve is None and allowed > 0:
            frac = min(1.0, req.num_output_tokens / allowed)
            self.decode_ratio += (frac - self.decode_ratio) * RESERVE_LEARNING

    def _group_tables(self, req: Request) -> list[list[int]] | None:
        return self.kv.tables_of(req) if len(self.kv.windows) > 1 else None

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
    def update(self, out: SchedulerOutput, result: ModelRunnerOutput, advanced: bool = False) -> EngineCoreOutputs:
        """Apply a step's results. ``advanced``: the step's counters were moved and its tokens
        appended as placeholders when the next step was launched ahead (``lookahead``)."""
        core = EngineCoreOutputs()
        now = time.time()
        for i, scores in result.kv_scores.items():  # scored KV eviction's attention, for the next step
            if not out.scheduled[i].request.is_finished:
                self.kv.record_scores(out.scheduled[i].request, scores)
        running = RequestStatus.RUNNING  # looked up once: an enum member lookup is slow
        for s, toks, lps, plps in zip(out.scheduled, result.sampled_token_ids, result.logprobs,
                                      result.prompt_logprobs):
            req = s.request
            if req.is_finished:  # stopped or aborted after the launch (look-ahead): dropped
                continue
            start = req.num_computed_tokens
            if not advanced:
                core.num_prompt_tokens += max(0, min(s.num_new_tokens, req.num_prompt_tokens - start))
                req.num_computed_tokens += s.num_new_tokens
                if s.draft_token_ids and toks:
                    # The KV of rejected drafts is garbage: their slots are recomputed, and
                    # blocks holding only them go back to the pool.
                    req.num_computed_tokens -= len(s.draft_token_ids) - (len(toks) - 1)
                    self.kv.trim(req)
            if not toks:  # a prompt chunk that does not reach the end
                core.outputs.append(EngineCoreOutput(req.request_id, req.group_id, req.index, [],
                                                     prompt_logprobs=plps, prompt_logprobs_start=start,
                                                     metrics=req.metrics,
                                                     num_output_tokens=req.num_output_tokens))
                continue
            core.num_generated_tokens += len(toks)
            if len(toks) == 1 and not req.pending_forks:
                # One token, no forks: the common decode step, without the general loop's
                # lists. Whatever the general loop learns to do per token must hold here too.
                tok = toks[0]
                if advanced:
                    req.resolve_pending(tok)
                else:
                    req.all_token_ids.append(tok)
                    req.output_token_ids.append(tok)
                status = self._stop_status(req, tok)
                if req.grammar is not None and req.grammar.defer(tok) and status is None:
                    status = RequestStatus.FINISHED_STOPPED
                if status is not None:
                    self.finish(req, status)
                    core.finished.append(req)
                m = req.metrics
                if m.first_token_time is None:
                    m.first_token_time = now
                m.num_generation_tokens += 1
                core.outputs.append(EngineCoreOutput(
                    req.request_id, req.group_id, req.index, toks, lps, plps, start,
                    status if status is not None else running, req.stop_reason, m,
                    len(req.output_token_ids)))
                continue
            if req.pending_forks:
                runs = [(r, [t], [lp]) for r, t, lp in zip(self._fork_all(req, core), toks, lps)]
            else:
                runs = [(req, toks, lps)]
            for r, ts, ls in runs:
                n = len(ts)
                status = None
                for k, tok in enumerate(ts):
                    if advanced and k == 0:
                        r.resolve_pending(tok)
                    else:
                        r.append_token(tok)
                    status = self._stop_status(r, tok)
                    if r.grammar is not None and r.grammar.defer(tok) and status is None:
                        status = RequestStatus.FINISHED_STOPPED
                    if status is not None:  # tokens accepted past a stop are dropped
                        n = k + 1
                        self.finish(r, status)
                        core.finished.append(r)
                        break
                if r.metrics.first_token_time is None:
                    r.metrics.first_token_time = now
                r.metrics.num_generation_tokens += n
                core.outputs.append(EngineCoreOutput(
                    r.request_id, r.group_id, r.index, ts[:n] if n < len(ts) else ts,
                    ls[:n] if n < len(ls) else ls, plps if r is req else [], start,
                    status if status is not None else running, r.stop_reason, r.metrics,
                    r.num_output_tokens))
        return core

    def _fork_all(self, parent: Request, core: EngineCoreOutputs) -> list[Request]:
        """The parent's first token is sampled: its n - 1 siblings start here, sharing its blocks."""
        family = [parent]
        gens = parent.generators
        for i in range(1, parent.pending_forks + 1):
            child = parent.fork(i)
            self.fork(parent, child)
            self.groups[parent.group_id].append(child)
            core.forks.append((parent, child))
            family.append(child)
        parent.pending_forks = 0
        if gens is not None:
            parent.generators = gens[:1]
        return family

    @staticmethod
    def _stop_status(r: Request, tok: int) -> RequestStatus | None:
        """End-of-text and stop tokens (once ``min_tokens`` are out), then the length. Stop
        strings need the text: the output processor finds those."""
        p = r.params
        if len(r.output_token_ids) >= p.min_tokens:
            if not p.ignore_eos and tok in r.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if p.stop_token_ids and tok in p.stop_token_ids:
                r.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if r.length_reached:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Mark ``req`` finished and give its blocks back (it may be running or waiting). A
        group leaves ``groups`` once all its requests have finished."""
        req.status = status
        req.metrics.finished_time = time.time()
        if status != RequestStatus.FINISHED_ABORTED:
            self._learn_decode_ratio(req)
        if self.tiers is not None:
            self.tiers.forget(req)
        self.kv.free(req)
        self.swap_used_blocks.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        group = self.groups.get(req.group_id)
        if group is not None and len(group) == req.params.n and all(r.is_finished for r in group):
            del self.groups[req.group_id]

    def fork(self, parent: Request, child: Request) -> None:
        """Put ``child`` right after ``parent`` in the running list, sharing its blocks."""
        self.kv.fork(parent, child)
        child.status = RequestStatus.RUNNING
        self.running.insert(self.running.index(parent) + 1 + child.index - 1, child)

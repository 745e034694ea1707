"""Property-based tests of Scheduler + KVCacheManager, with no model.

A ``Sim`` drives the scheduler exactly as ``LLMEngine.step`` does: ``schedule()``, then the real
``Scheduler.update`` with random tokens for each sampling request (``n`` of them for a request that
forks), which advances the counters, forks and finishes at ``max_tokens``. It plays the model
runner against a *shadow KV cache*: every slot records which token prefix its KV was computed from.
Swap-out, copy-on-write and swap-in are applied in the runner's order, every scheduled token is
written, and then every position a scheduled request attends to must hold exactly that request's
prefix. So prefix-cache hits,
copy on write, swapping and preemption are checked for what they are for: the right KV. With KV
groups (``windows``: sliding-window layers) each group's table is written and read the same way,
a local group's only over the keys its queries see, and every block out of the window must have
gone back to the pool before the step. With streaming eviction (``kv_budgets``) a budgeted request
reads only its sink and recent blocks, the blocks between must have gone back, and KV computed
under the mask is keyed by the budget too, so a request reading it through the prefix cache fails.

After every operation the bookkeeping invariants are checked too (reference counts, hashes, no
leaked block, queues consistent), and at the end every request must finish within a bounded
number of steps, in arrival order of admission, leaving the pool empty.
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.kv_groups import NULL
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.step import ModelRunnerOutput
from kvserve.kv_eviction import SINK_BLOCKS, full_attention_blocks, recent_start
from kvserve.sampling_params import SamplingParams

MAX_MODEL_LEN = 4096


def prefix_keys(tokens: list[int]) -> list[int]:
    """keys[p] identifies tokens[:p + 1], what the KV at position p is computed from."""
    keys, h = [], 0
    for t in tokens:
        h = hash((h, t))
        keys.append(h)
    return keys


class Sim:
    """Scheduler + KVCacheManager + a shadow KV cache, stepped like LLMEngine.step."""

    def __init__(self, *, num_blocks: int, block_size: int, mode: str = "recompute",
                 swap_blocks: int = 0, budget: int = 2048, max_num_seqs: int = 256,
                 chunked: bool = True, caching: bool = True, watermark: float = 0.0,
                 seed: int = 0, vocab: int = 50, windows: tuple[int | None, ...] = (None,),
                 kv_budgets: tuple[int | None, ...] = (None,), decode_reserve: float | None = 0.0):
        cache = CacheConfig(block_size=block_size, preemption_mode=mode, watermark=watermark,
                            enable_prefix_caching=caching, swap_space=swap_blocks * 1024)
        sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                enable_chunked_prefill=chunked, decode_reserve=decode_reserve)
        self.bs = block_size
        self.kv = KVCacheManager(num_blocks, block_size, caching, hash_extra=b"test", windows=windows)
        self.sched = Scheduler(sched, cache, self.kv, MAX_MODEL_LEN,
                               swap_capacity_blocks=swap_blocks if mode == "swap" else 0)
        self.rng = random.Random(seed)
        self.vocab = vocab
        self.kv_budgets = kv_budgets  # each request draws its kv_budget from these
        self.live: list[Request] = []  # unfinished requests, children included
        self.order: dict[str, int] = {}  # group id -> arrival sequence number
        self.first_step: dict[str, int] = {}  # group id -> step of first scheduling
        self.finished: list[Request] = []
        self.slots: list[int | None] = [None] * (num_blocks * block_size)  # shadow KV
        self.swapped: dict[str, list[list[int | None]]] = {}  # shadow CPU swap space
        self.steps = 0
        self.num_copies = 0
        self.max_preempted_in_a_row = 0
        self.check()

    # -- requests --------------------------------------------------------------------------
    def fits(self, prompt_len: int, max_tokens: int, n: int) -> bool:
        """LLMEngine.validate's capacity check."""
        return self.sched.blocks_to_finish(prompt_len, max_tokens, n) <= self.kv.pool.num_blocks

    def add(self, prompt: list[int], max_tokens: int, n: int = 1, prompt_logprobs: bool = False) -> Request | None:
        if not self.fits(len(prompt), max_tokens, n):
            return None  # LLMEngine.validate would reject it
        rid = f"r{len(self.order)}"
        params = SamplingParams(n=n, max_tokens=max_tokens, prompt_logprobs=0 if prompt_logprobs else None,
                                kv_budget=self.rng.choice(self.kv_budgets))
        req = Request(rid, list(prompt), params, max_model_len=MAX_MODEL_LEN)
        self.order[rid] = len(self.order)
        self.sched.add_request(req)
        self.live.append(req)
        return req

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.sched.finish(req, status)
        self._finished(req)

    def _finished(self, req: Request) -> None:
        assert req.is_finished
        self.swapped.pop(req.request_id, None)  # runner.drop_request
        self.live.remove(req)
        self.finished.append(req)
        assert req.request_id not in self.kv.tables
        assert req.request_id not in self.sched.swap_used_blocks

    def abort_group(self, group_id: str) -> None:
        """LLMEngine.abort_request: the whole group (a request and its forks) goes."""
        for r in self.sched.abort_group(group_id):
            if r in self.live:
                self._finished(r)
        assert group_id not in self.sched.groups

    def slot(self, table: list[int], p: int) -> int:
        return table[p // self.bs] * self.bs + p % self.bs

    def kv_key(self, r: Request, g: int, k: list[int], p: int) -> tuple:
        """What the KV at position ``p`` of ``r`` is computed from: its prefix, and its budget
        where the budget hid keys from it."""
        b = r.params.kv_budget
        masked = b is not None and p >= full_attention_blocks(b, self.bs) * self.bs
        return (g, k[p], b) if masked else (g, k[p])

    def reads(self, r: Request, lo: int, end: int) -> range | list[int]:
        """The positions a step of ``r`` over ``[num_computed_tokens, end)`` reads (from ``lo``)."""
        b = r.params.kv_budget
        if b is None:
            return range(lo, end)
        start = recent_start(b, self.bs, r.num_computed_tokens) * self.bs
        return [p for p in range(end) if p < SINK_BLOCKS * self.bs or p >= start]

    # -- one step --------------------------------------------------------------------------
    def step(self, on_schedule=None):
        """One engine step; ``on_schedule(out)`` sees the output before the model "runs"."""
        sched, kv, bs = self.sched, self.kv, self.bs
        oldest_running = sched.running[0] if sched.running else None
        unfinished_before = sched.num_unfinished
        out = sched.schedule()
        self.steps += 1
        if on_schedule is not None:
            on_schedule(out)
        scheduled = [s.request for s in out.scheduled]

        # -- the output itself ---------------------------------------------------------------
        assert len({id(r) for r in scheduled}) == len(scheduled), "a request scheduled twice"
        if unfinished_before:
            assert out.scheduled, "unfinished requests but an empty step: no progress"
        if oldest_running is not None and oldest_running.request_id not in out.preempted:
            assert oldest_running in scheduled, "the oldest running request was skipped"
        assert out.num_batched_tokens == sum(s.num_new_tokens for s in out.scheduled)
        if sched.config.enable_chunked_prefill or len(out.scheduled) > 1:
            assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
        if out.preempted:
            assert not out.swap_in, "admitted a swapped request in a step that preempted"
        for rid in out.swap_out:
            assert sched.cache_config.preemption_mode == "swap" and rid in out.preempted
        for s in out.scheduled:
            r = s.request
            assert r in sched.running and r.status == RequestStatus.RUNNING
            assert s.num_new_tokens >= 1
            assert r.num_computed_tokens + s.num_new_tokens <= r.num_tokens
            assert s.block_table == kv.table(r)
            assert len(s.block_table) == kv.blocks_for(r.num_computed_tokens + s.num_new_tokens)
            assert s.group_tables == (kv.tables_of(r) if len(kv.windows) > 1 else None)
            for g, w in enumerate(kv.windows):  # out of the window: freed; in it: held
                t = kv.tables_of(r)[g]
                lo = 0 if w is None else max(0, r.num_computed_tokens - w + 1) // bs
                if r.params.kv_budget is not None:  # the blocks between the sinks and the recent ones
                    hi = min(len(t), recent_start(r.params.kv_budget, bs, r.num_computed_tokens))
                    assert all(b == NULL for b in t[SINK_BLOCKS:hi]), (r, t)
                    t = t[:SINK_BLOCKS] + t[hi:]
                assert all(b == NULL for b in t[:lo]) and NULL not in t[lo:], (r, g, t)
            if r.group_id not in self.first_step:
                self.first_step[r.group_id] = self.steps
        for rid in out.preempted:
            assert rid not in {r.request_id for r in scheduled}
        dsts = [d for _, d in out.copies]
        assert len(set(dsts)) == len(dsts)
        assert not set(dsts) & {s for s, _ in out.copies}
        self.num_copies += len(out.copies)

        # -- the shadow runner: swap out, copy on write, swap in, write, then read -----------
        for rid, blocks in out.swap_out.items():
            self.swapped[rid] = [self.slots[b * bs:(b + 1) * bs] for b in blocks]
            assert len(self.kv.windows) == 1 and self.kv.windows[0] is None, "swap of a windowed table"
        if out.copies:
            data = [self.slots[s * bs:(s + 1) * bs] for s, _ in out.copies]
            for (_, d), content in zip(out.copies, data):
                self.slots[d * bs:(d + 1) * bs] = content
        for rid, blocks in out.swap_in.items():
            saved = self.swapped.pop(rid)
            assert len(saved) == len(blocks)
            for b, content in zip(blocks, saved):
                self.slots[b * bs:(b + 1) * bs] = content
        assert set(self.swapped) == {r.request_id for r in sched.waiting if r.swapped_out}

        # A slot's KV is (group, prefix key): a group's block holds its own layers' KV.
        writes: dict[int, tuple[int, int]] = {}
        keys = {}
        for s in out.scheduled:
            r = s.request
            keys[r.request_id] = k = prefix_keys(r.all_token_ids)
            for g, table in enumerate(kv.tables_of(r)):
                for p in range(r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens):
                    slot, key = self.slot(table, p), self.kv_key(r, g, k, p)
                    assert writes.setdefault(slot, key) == key, (
                        f"two requests write different KV into block {slot // bs} in one step")
        for slot, key in writes.items():
            self.slots[slot] = key
        for s in out.scheduled:
            r = s.request
            k = keys[r.request_id]
            for g, (w, table) in enumerate(zip(kv.windows, kv.tables_of(r))):
                lo = 0 if w is None else max(0, r.num_computed_tokens - w + 1)  # the first key read
                for p in self.reads(r, lo, r.num_computed_tokens + s.num_new_tokens):
                    got = self.slots[self.slot(table, p)]
                    assert got == self.kv_key(r, g, k, p), (
                        f"{r.request_id} reads wrong KV at position {p} (group {g}, block {table[p // bs]})")

        # -- the real Scheduler.update: advance, append, fork, finish ------------------------
        draws = [(1 + s.request.pending_forks) if s.samples else 0 for s in out.scheduled]
        toks = [[self.rng.randrange(self.vocab) for _ in range(k)] for k in draws]
        result = ModelRunnerOutput(toks, [[None] * k for k in draws], [[] for _ in draws])
        before = {id(s.request): (s.request.num_computed_tokens, s.request.num_output_tokens)
                  for s in out.scheduled}
        core = sched.update(out, result)
        for _, child in core.forks:
            self.live.append(child)
        for s, k in zip(out.scheduled, draws):
            r = s.request
            computed, n_out = before[id(r)]
            assert r.num_computed_tokens == computed + s.num_new_tokens
            assert r.num_output_tokens == n_out + (1 if k else 0)
        for r in core.finished:
            assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == r.max_tokens
            self._finished(r)
        self.check()
        return out

    def run_to_completion(self, max_steps: int | None = None) -> int:
        if max_steps is None:
            max_steps = self.step_bound()
        start = self.steps
        while self.sched.num_unfinished:
            assert self.steps - start < max_steps, (
                f"starvation: {self.sched.num_unfinished} requests unfinished after {max_steps} steps "
                f"(running={self.sched.running}, waiting={list(self.sched.waiting)})")
            self.step()
        self.check_drained()
        return self.steps - start

    def step_bound(self) -> int:
        """Generous: each step moves the oldest running request forward, which is never
        preempted, so each request needs at most its prompt plus its outputs, per sibling."""
        total = 0
        for r in self.live:
            per = r.num_tokens + r.max_tokens + 2
            total += per * (1 + r.pending_forks)
        return 2 * total + 20

    # -- invariants ------------------------------------------------------------------------
    def check(self) -> None:
        sched, kv, pool = self.sched, self.kv, self.kv.pool
        kv.check_invariants(self.live)
        running, waiting = sched.running, list(sched.waiting)
        assert len({id(r) for r in running + waiting}) == len(running) + len(waiting)
        assert {id(r) for r in running + waiting} == {id(r) for r in self.live}, \
            "a live request is in neither queue, or a finished one in a queue"
        for r in running:
            assert r.status == RequestStatus.RUNNING and not r.swapped_out
            assert r.request_id in kv.tables, f"running {r} has no block table"
            assert len(kv.tables[r.request_id]) == kv.blocks_for(r.num_computed_tokens)
            assert r.num_computed_tokens < r.num_tokens
        for r in waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.request_id not in kv.tables, f"waiting {r} holds blocks"
            if r.swapped_out:
                assert sched.swap_used_blocks[r.request_id] == kv.blocks_for(r.num_computed_tokens) > 0
            else:
                assert r.request_id not in sched.swap_used_blocks
                assert r.num_computed_tokens == 0
        assert sum(sched.swap_used_blocks.values()) <= sched.swap_capacity_blocks
        assert set(sched.swap_used_blocks) == {r.request_id for r in waiting if r.swapped_out}
        # Every used block is in some table, every table block is used: nothing leaked.
        held = kv.held_tables()
        distinct = {b for t in held.values() for b in t}
        assert pool.num_used_blocks == len(distinct), "leaked (or double-owned) blocks"
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        # Within a request's tables a block appears once.
        for rid, t in held.items():
            assert len(set(t)) == len(t), rid
        # Running then waiting: arrival order (children right after their group).
        key = [(self.order[r.group_id], r.index) for r in running + waiting]
        assert key == sorted(key), "queues out of arrival order"

    def check_drained(self) -> None:
        assert not self.live and self.sched.num_unfinished == 0
        assert self.kv.pool.num_used_blocks == 0, "blocks leaked after every request finished"
        assert not any(self.kv.group_tables) and not self.kv._num_hashed
        assert not self.sched.swap_used_blocks and not self.swapped
        assert not self.kv.pending_copies
        # FCFS: groups were first scheduled in arrival order.
        firsts = [self.first_step[g] for g in sorted(self.first_step, key=self.order.get)]
        assert firsts == sorted(firsts), "a later request was admitted before an earlier one"


# -- the state machine ------------------------------------------------------------------------
# The workload every machine draws: token budget, batch size, chunking, prefix caching, vocabulary
# (2: prompts share prefixes all the time), the room admission keeps for decoding (0: none, so
# small pools preempt often; None: learned) and the simulator's seed.
WORKLOAD = dict(
    decode_reserve=st.sampled_from([0.0, 0.0, None, 0.5]),
    budget=st.sampled_from([7, 16, 64, 2048]),
    max_num_seqs=st.sampled_from([2, 3, 256]),
    chunked=st.booleans(),
    caching=st.sampled_from([True, True, True, False]),
    vocab=st.sampled_from([2, 50]),
    seed=st.integers(0, 2**32 - 1),
)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([4, 16]),
        num_blocks=st.one_of(st.integers(8, 16), st.integers(8, 40)),
        mode=st.sampled_from(["recompute", "swap"]),
        swap_blocks=st.one_of(st.integers(0, 8), st.just(64)),
        **WORKLOAD,
    )
    def setup(self, **kw):
        self.sim = Sim(**kw)
        self.prompts: list[list[int]] = []

    @rule(data=st.data(),
          length=st.integers(1, 80),
          max_tokens=st.one_of(st.integers(1, 8), st.integers(1, 48)),
          n=st.integers(1, 3),
          share=st.sampled_from(["new", "new", "prefix", "same"]),
          prompt_logprobs=st.sampled_from([False, False, False, False, True]))
    def add(self, data, length, max_tokens, n, share, prompt_logprobs):
        sim = self.sim
        rng = random.Random(data.draw(st.integers(0, 2**32 - 1), label="prompt_seed"))
        if share != "new" and self.prompts:
            base = data.draw(st.sampled_from(self.prompts), label="base")
            if share == "same":
                prompt = list(base)
            else:
                keep = data.draw(st.integers(1, len(base)), label="keep")
                prompt = base[:keep] + [rng.randrange(sim.vocab) for _ in range(max(0, length - keep))]
        else:
            prompt = [rng.randrange(sim.vocab) for _ in range(length)]
        if sim.add(prompt, max_tokens, n, prompt_logprobs) is not None:
            self.prompts.append(prompt)

    @rule()
    def step(self):
        self.sim.step()

    @rule(k=st.integers(1, 6))
    def steps(self, k):
        for _ in range(k):
            if not self.sim.sched.num_unfinished:
                break
            self.sim.step()

    @precondition(lambda self: self.sim.live)
    @rule(data=st.data())
    def abort(self, data):
        req = data.draw(st.sampled_from(self.sim.live), label="victim")
        self.sim.abort_group(req.group_id)

    @rule()
    def reset_prefix_cache(self):
        self.sim.kv.pool.reset_prefix_cache()

    @invariant()
    def invariants_hold(self):
        self.sim.check()

    def teardown(self):
        # Everything still live must finish within a bounded number of steps, leaking nothing.
        if hasattr(self, "sim"):
            self.sim.run_to_completion()


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.filter_too_much])


class WindowedSchedulerMachine(SchedulerMachine):
    """The same workloads over KV groups of sliding-window layers (a global group and local
    ones, a lone local one as Mistral's, a local group 0), freeing out-of-window blocks."""

    @initialize(
        windows=st.sampled_from([(None, 6), (9,), (None, 5, 5), (12, None), (4, None, 17)]),
        block_size=st.sampled_from([4, 16]),
        num_blocks=st.one_of(st.integers(8, 16), st.integers(8, 60)),
        **WORKLOAD,
    )
    def setup(self, **kw):
        self.sim = Sim(mode="recompute", **kw)
        self.prompts = []


TestWindowedSchedulerMachine = WindowedSchedulerMachine.TestCase
TestWindowedSchedulerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                                 suppress_health_check=[HealthCheck.too_slow,
                                                                        HealthCheck.filter_too_much])


class StreamingSchedulerMachine(SchedulerMachine):
    """The same workloads with streaming KV eviction: each request under a random budget (the
    least one, a few blocks, or none), sharing prefixes, forking and preempted among the others."""

    @initialize(
        block_size=st.sampled_from([4, 16]),
        num_blocks=st.one_of(st.integers(8, 16), st.integers(8, 60)),
        **WORKLOAD,
    )
    def setup(self, block_size, **kw):
        budgets = (None, 2 * block_size + 1, 3 * block_size, 5 * block_size + 2)
        self.sim = Sim(mode="recompute", block_size=block_size, kv_budgets=budgets, **kw)
        self.prompts = []


TestStreamingSchedulerMachine = StreamingSchedulerMachine.TestCase
TestStreamingSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                                  suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.filter_too_much])


# -- run-to-completion over random workloads -----------------------------------------------------
workload = st.lists(
    st.tuples(st.integers(1, 80), st.integers(1, 40), st.integers(1, 3), st.integers(0, 3)),
    min_size=1, max_size=10)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workload,
       block_size=st.sampled_from([4, 16]),
       num_blocks=st.one_of(st.integers(8, 16), st.integers(8, 40)),
       mode=st.sampled_from(["recompute", "swap"]),
       swap_blocks=st.one_of(st.integers(0, 8), st.just(64)),
       budget=st.sampled_from([16, 64, 2048]),
       chunked=st.booleans(),
       decode_reserve=st.sampled_from([0.0, None, 1.0]),
       seed=st.integers(0, 2**32 - 1))
def test_all_requests_finish_fcfs_without_leaks(reqs, block_size, num_blocks, mode, swap_blocks,
                                                budget, chunked, decode_reserve, seed):
    sim = Sim(num_blocks=num_blocks, block_size=block_size, mode=mode, swap_blocks=swap_blocks,
              budget=budget, chunked=chunked, decode_reserve=decode_reserve, seed=seed)
    rng = random.Random(seed)
    shared = [rng.randrange(50) for _ in range(80)]
    added = []
    for length, max_tokens, n, prefix_kind in reqs:
        # prefix_kind 0: fresh prompt; 1..3: share a common prefix of 16 * kind tokens.
        prompt = [rng.randrange(50) for _ in range(length)]
        if prefix_kind:
            prompt = shared[:16 * prefix_kind] + prompt
            prompt = prompt[:80]
        r = sim.add(prompt, max_tokens, n)
        if r is not None:
            added.append(r)
    sim.run_to_completion()
    for r in added:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.num_output_tokens == r.max_tokens
    for r in sim.finished:
        assert r.status == RequestStatus.FINISHED_LENGTH and r.num_output_tokens == r.max_tokens
    assert len(sim.finished) == sum(r.params.n for r in added), "lost a fork"


# -- specific scenarios ---------------------------------------------------------------------------
def test_fork_shares_prompt_blocks_then_copy_on_write():
    bs = 4
    sim = Sim(num_blocks=16, block_size=bs)
    prompt = list(range(1, 11))  # 10 tokens: 2 full blocks + a partial one
    assert len(prompt) % bs != 0
    parent = sim.add(prompt, max_tokens=4, n=3)
    out = sim.step()  # the whole prompt; samples 3 tokens and forks
    assert [s.request for s in out.scheduled] == [parent] and not out.copies
    group = [r for r in sim.live if r.group_id == parent.request_id]
    assert [r.index for r in group] == [0, 1, 2]
    tables = [list(sim.kv.table(r)) for r in group]
    assert tables[0] == tables[1] == tables[2] and len(tables[0]) == 3
    for b in tables[0]:
        assert sim.kv.pool.blocks[b].ref_cnt == 3, "the children share the prompt's blocks"
    shared_last = tables[0][-1]
    used_before = sim.kv.pool.num_used_blocks

    out = sim.step()  # first decode step: each sibling writes position 10, in the shared block
    assert [s.request for s in out.scheduled] == group
    assert out.copies, "no copy on write recorded"
    assert len(out.copies) == 2  # the last sibling to write keeps the original
    assert all(src == shared_last for src, _ in out.copies)
    lasts = [sim.kv.table(r)[-1] for r in group]
    assert len(set(lasts)) == 3, "each sibling gets a private last block"
    assert {d for _, d in out.copies} | {shared_last} == set(lasts)
    for b in lasts:
        assert sim.kv.pool.blocks[b].ref_cnt == 1
    for b in tables[0][:-1]:
        assert sim.kv.pool.blocks[b].ref_cnt == 3, "full prompt blocks stay shared"
    assert sim.kv.pool.num_used_blocks == used_before + 2
    sim.run_to_completion()


@pytest.mark.parametrize("finish_first", [False, True])
def test_prefix_cache_hit_across_steps(finish_first):
    bs = 16
    sim = Sim(num_blocks=32, block_size=bs)
    prompt = [random.Random(7).randrange(1000) for _ in range(64)]
    a = sim.add(prompt, max_tokens=8)
    sim.step()  # a's prompt, all 64 tokens, registers its 4 full blocks
    assert a.num_computed_tokens == 64
    if finish_first:
        sim.run_to_completion()  # a's blocks go back to the pool, still cached
        assert sim.kv.pool.num_used_blocks == 0 and sim.kv.pool.num_cached_blocks >= 4
    hits_before = sim.kv.prefix_hits
    b = sim.add(prompt, max_tokens=2)
    seen = {}

    def on_schedule(out):
        sb = next(s for s in out.scheduled if s.request is b)
        seen.update(computed=b.num_computed_tokens, new=sb.num_new_tokens, samples=sb.samples)
        if not finish_first:
            assert sim.kv.table(b)[:3] == sim.kv.table(a)[:3], "b shares a's cached blocks"
            assert sim.kv.table(b)[3] != sim.kv.table(a)[3]
            for blk in sim.kv.table(b)[:3]:
                assert sim.kv.pool.blocks[blk].ref_cnt == 2

    sim.step(on_schedule)
    # 3 full blocks from the cache; the 4th is recomputed so the step has logits to sample.
    assert seen == {"computed": 48, "new": 16, "samples": True}
    assert b.num_computed_tokens == 64 and b.num_output_tokens == 1
    assert sim.kv.prefix_hits - hits_before == 48
    assert sim.kv.prefix_queries == 128
    assert b.metrics.num_cached_tokens == 48
    sim.run_to_completion()


def test_preemption_happens_in_both_modes():
    """The small pools of the property tests do preempt without a decode reserve (so those tests
    exercise it); with the default one, learned from 1, the same workload runs unpreempted."""
    for mode in ("recompute", "swap"):
        for reserve, preempts in ((0.0, True), (None, False), (1.0, False)):
            sim = Sim(num_blocks=8, block_size=4, mode=mode, swap_blocks=16, seed=1, decode_reserve=reserve)
            for i in range(4):
                sim.add([i + 1] * 5, max_tokens=20)
            sim.run_to_completion()
            assert (sim.sched.num_preemptions > 0) == preempts, (mode, reserve)
            assert all(r.num_output_tokens == 20 for r in sim.finished)


def test_decode_reserve_keeps_room_for_what_running_requests_still_generate():
    """Four requests of 4 prompt tokens and up to 20 new on a 16-block pool (blocks of 4): each
    takes 6 blocks at full length. Without a reserve all four are admitted at once (their prompts
    take a block each) and some are preempted later; reserving all of their tokens admits two (12
    of 16 blocks) and the others wait, unpreempted; reserving three quarters (15 tokens, 5 blocks
    each), three."""
    for reserve, admitted in ((0.0, 4), (1.0, 2), (0.75, 3), (None, 2)):
        sim = Sim(num_blocks=16, block_size=4, decode_reserve=reserve)
        for i in range(4):
            sim.add([i + 1] * 4, max_tokens=20)
        sim.step()
        assert len(sim.sched.running) == admitted, reserve
        sim.run_to_completion()
        if reserve != 0.75:
            assert (sim.sched.num_preemptions > 0) == (reserve == 0.0), reserve


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workload,
       block_size=st.sampled_from([4, 16]),
       num_blocks=st.integers(8, 40),
       windows=st.sampled_from([(None,), (None, 6), (9,), (None, 5, 5), (12, None)]),
       budget=st.sampled_from([7, 16, 64, 2048]),
       chunked=st.booleans(),
       caching=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_full_decode_reserve_never_preempts(reqs, block_size, num_blocks, windows, budget, chunked, caching,
                                            seed):
    """With all of every request's remaining tokens reserved (``decode_reserve=1``), no request
    is ever preempted, whatever the prompts, forks (n > 1), shared prefixes, chunking and KV
    groups with sliding windows: the reserve counts what each will hold at its largest, as
    ``blocks_to_finish`` does."""
    sim = Sim(num_blocks=num_blocks, block_size=block_size, budget=budget, chunked=chunked, caching=caching,
              windows=windows, decode_reserve=1.0, seed=seed)
    rng = random.Random(seed)
    shared = [rng.randrange(50) for _ in range(80)]
    for length, max_tokens, n, prefix_kind in reqs:
        prompt = [rng.randrange(50) for _ in range(length)]
        if prefix_kind:
            prompt = shared[:16 * prefix_kind] + prompt
        sim.add(prompt, max_tokens, n)
    sim.run_to_completion()
    assert sim.sched.num_preemptions == 0


def test_decode_reserve_learns_from_finished_requests():
    """The learned fraction follows what finished requests generated of what they could: requests
    stopping at a tenth of max_tokens bring it down from 1 toward 0.1, aborted ones leave it, and
    requests running to max_tokens bring it back up. A fixed reserve never moves."""
    def finish(sim, n, generated, status):
        for i in range(n):
            r = sim.add([i + 1] * 4, max_tokens=40)
            r.output_token_ids.extend([1] * generated)
            sim.sched.finish(r, status)
            sim.live.remove(r)

    sim = Sim(num_blocks=64, block_size=4, decode_reserve=None)
    assert sim.sched.decode_ratio == 1.0
    finish(sim, 64, 4, RequestStatus.FINISHED_STOPPED)
    assert 0.1 < sim.sched.decode_ratio < 0.12
    low = sim.sched.decode_ratio
    finish(sim, 16, 0, RequestStatus.FINISHED_ABORTED)
    assert sim.sched.decode_ratio == low
    finish(sim, 64, 40, RequestStatus.FINISHED_LENGTH)
    assert sim.sched.decode_ratio > 0.98
    fixed = Sim(num_blocks=64, block_size=4, decode_reserve=0.25)
    finish(fixed, 8, 4, RequestStatus.FINISHED_STOPPED)
    assert fixed.sched.decode_ratio == 0.25


def test_swap_keeps_progress():
    sim = Sim(num_blocks=8, block_size=4, mode="swap", swap_blocks=16, seed=3)
    reqs = [sim.add([i + 1] * 6, max_tokens=20) for i in range(3)]
    swapped_seen = False
    while sim.sched.num_unfinished:
        out = sim.step()
        for rid in out.swap_out:
            r = next(x for x in reqs if x.request_id == rid)
            assert r.swapped_out and r.num_computed_tokens > 0
            swapped_seen = True
    assert swapped_seen
    sim.check_drained()


# -- the admission watermark must not strand a request the engine accepted -------------------------
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=workload,
       block_size=st.sampled_from([4, 16]),
       num_blocks=st.integers(8, 40),
       watermark=st.sampled_from([0.05, 0.1, 0.2]),
       mode=st.sampled_from(["recompute", "swap"]),
       budget=st.sampled_from([16, 64, 2048]),
       chunked=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_all_requests_finish_with_watermark(reqs, block_size, num_blocks, watermark, mode, budget,
                                            chunked, seed):
    """Same as above with a non-zero watermark (the default 0.01 is 0 blocks below 100 blocks).
    Every request LLMEngine.validate accepts (blocks_to_finish <= num_blocks) must finish."""
    sim = Sim(num_blocks=num_blocks, block_size=block_size, mode=mode, swap_blocks=64,
              budget=budget, chunked=chunked, watermark=watermark, seed=seed)
    rng = random.Random(seed)
    for length, max_tokens, n, _ in reqs:
        sim.add([rng.randrange(50) for _ in range(length)], max_tokens, n)
    sim.run_to_completion()


@pytest.mark.parametrize("chunked,budget", [(False, 2048), (True, 8192)])
def test_accepted_prompt_is_admitted_default_watermark(chunked, budget):
    """Regression: a 3184-token prompt on a 200-block pool (block_size 16) has
    blocks_to_finish = 200, so LLMEngine.validate accepts it; admission used to ask for its 199
    blocks + the 2-block watermark (0.01 * 200) even on an empty pool, so it waited forever."""
    sim = Sim(num_blocks=200, block_size=16, watermark=0.01, chunked=chunked, budget=budget)
    assert sim.add(list(range(3184)), max_tokens=16) is not None
    assert sim.sched.blocks_to_finish(3184, 16, 1) == 200
    sim.run_to_completion(max_steps=50)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_request_is_readmitted_default_watermark(mode):
    """Regression, default watermark (0.01 -> 1 block of 100). r1 (396-token prompt,
    max_tokens 4, blocks_to_finish 100) is admitted and prefilled, then preempts itself when it
    needs its 100th block while r0 holds one. Its recompute / swap-in needs 100 blocks, which
    used to be asked for with 1 watermark block on top: never granted, even on an empty pool."""
    sim = Sim(num_blocks=100, block_size=4, watermark=0.01, budget=393, mode=mode, swap_blocks=200)
    sim.add([7], max_tokens=3)
    r1 = sim.add(list(range(1, 397)), max_tokens=4)
    assert r1 is not None and sim.sched.blocks_to_finish(396, 4, 1) == 100
    sim.run_to_completion(max_steps=50)
    assert r1.num_output_tokens == 4

"""LLMEngine: add requests, step, get outputs. Orchestration only; each rule lives elsewhere.

    step():  Scheduler.schedule() -> ModelRunner.launch() (device work queued; the host does the
             step's bookkeeping meanwhile) -> Scheduler.update() (tokens, forks, finishing)
             -> OutputProcessor.process() (text, stop strings, log-probs)
    async scheduling (``lookahead``): schedule + launch step N+1 before N's results are back
             (its sampled ids feed N+1 on the device), then fold N's results in while N+1 runs
"""
from __future__ import annotations

import dataclasses
import gc
import logging
import time

from kvserve.config import EngineConfig
from kvserve.engine import kv_plan, kv_policy, lookahead, startup
from kvserve.engine.faults import RequestFailedError
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.lookahead import InFlight
from kvserve.engine.memory_controls import MemoryControls, check_cache_salt
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.prefix_pins import PrefixPins
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.request_intake import PromptType, RequestIntake
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.sessions import Sessions
from kvserve.engine.stats import EngineStats, StepStats
from kvserve.engine.step import EngineCoreOutputs, SchedulerOutput
from kvserve.errors import ConfigError, InvalidRequestError
from kvserve.models import loader
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.structured import StructuredCompiler
from kvserve.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class LLMEngine(MemoryControls, RequestIntake):
    def __init__(self, config: EngineConfig):
        t_start = time.perf_counter()
        self.config = config
        src = loader.resolve(config.model)
        if src.quant_method and config.tensor_parallel_size > 1:  # (before any rank's process starts)
            raise ConfigError("tensor_parallel_size", f"{src.name} is a {src.quant_method.lower()} checkpoint, "
                              f"whose packed weights load on one rank; use tensor_parallel_size 1")
        if src.kind == "snapshot":
            config = startup.snapshot_defaults(config, src.handle)
        self.model_name = src.name
        self.arch = src.arch
        times: dict[str, float] = {}  # start-up phases (engine/startup.py)
        tokenizer = startup.in_background(times, "tokenizer", load_tokenizer, src.kind, src.path, config.tokenizer)
        try:
            limit, want = src.arch.max_position_embeddings, config.scheduler.max_model_len
            if want is not None and want > limit:
                raise InvalidRequestError("max_model_len", f"must be <= the model's context length {limit}, "
                                          f"got {want}")
            self.max_model_len = want or limit
            self.runner = ModelRunner(config, src, self.max_model_len)
        except BaseException:
            # The tokenizer's thread may be importing transformers: the next engine's import must not find it half made.
            tokenizer.exception()
            raise
        self.tokenizer = tokenizer.result()
        self.output_processor = OutputProcessor(self.tokenizer)
        self.config = config = self.runner.config  # with the device's defaults resolved
        rt = self.runner
        with startup.timed(times, "kv_profile"):
            kv_bytes = rt.determine_kv_memory()
        # The KV levers and why: chosen (kv_policy "auto") or as configured, shown in /metrics.
        chosen, self.kv_policy = kv_policy.choose(config, src.arch, rt, kv_bytes, self.max_model_len)
        if chosen.cache != config.cache:
            rt.use_cache_config(chosen.cache)
            self.config = config = rt.config
        groups = kv_plan.groups_for(config, src.arch, rt.kv_format)
        plan = kv_plan.plan(rt.kv_format, rt.kv_scales, groups.page_layers, kv_bytes,
                            config.cache, config.scheduler.max_num_seqs)
        self.kv_plan = plan = dataclasses.replace(plan, groups=groups)
        if plan.max_num_seqs != config.scheduler.max_num_seqs:
            config = dataclasses.replace(config, scheduler=dataclasses.replace(
                config.scheduler, max_num_seqs=plan.max_num_seqs))
            self.config = rt.config = config
        if config.cache.kv_eviction != "none" and any(w is not None for w in src.arch.layer_windows):
            # A budget bounds the global layers; local ones keep their window (``kv_evict.py``).
            if all(w is not None for w in src.arch.layer_windows):
                raise ConfigError("kv_eviction", f"{config.cache.kv_eviction!r} evicts from global-attention "
                                  f"layers; every layer of {src.name} has a sliding window, which bounds its "
                                  "KV already")
            if not groups.windowed:
                raise ConfigError("window_kv", f"kv_eviction {config.cache.kv_eviction!r} on {src.name}'s "
                                  "sliding-window layers needs window_kv 'free' (their own tables); got 'keep'")
        self._allocate_kv(plan)
        self.kv = KVCacheManager(plan.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching,
                                 kv_plan.cache_key(src, rt.dtype, config.seed, plan.fmt, plan.scales, groups),
                                 groups.windows, eviction=config.cache.kv_eviction)
        self.pins = PrefixPins(self.kv, config.cache.max_pinned_fraction, config.cache.pin_ttl_seconds)
        kt = config.kv_transfer_config
        # A consumer receives KV into the store's staging memory, tiers or not.
        self.store = (self._make_store(config.cache, kt) if config.cache.tiers_enabled or (kt and kt.is_consumer)
                      else None)
        self.tiers = self._connector(self.store) if self.store is not None else None
        self.runner.tiers = self.tiers
        self.scheduler = Scheduler(config.scheduler, config.cache, self.kv, self.max_model_len, plan.swap_blocks,
                                   tiers=self.tiers)
        self.sessions = Sessions(config.cache.idle_offload_seconds, max_sessions=config.cache.max_sessions,
                                 ttl_seconds=config.cache.session_ttl_seconds)
        self.stats = EngineStats()
        self.speculator = self._speculator(config.speculative, src) if config.speculative is not None else None
        self._inflight: InFlight | None = None  # async scheduling: the step launched ahead
        self._failed: dict[str, RequestFailedError] = {}  # see pop_failed
        self.eos_token_ids = self._eos_ids()
        self.kv_transfer = self._kv_transfer() if kt is not None else None
        self.structured = StructuredCompiler(self.tokenizer, self.arch.vocab_size, self.eos_token_ids)
        log.info("KV cache: %s", plan.describe())
        # What start-up left alive (modules, weights, tokenizer tables: most of the heap) stays
        # for the process's life: out of the collector's reach, a full collection during a run
        # walks only what requests allocate, not the whole heap. Frozen objects are still freed
        # by reference counting, but a frozen cycle is never collected: an engine dropped
        # earlier in this process (its runner, graphs and KV pool refer to each other) is only
        # unreachable garbage in the frozen set, so unfreeze and collect before freezing again.
        with startup.timed(times, "gc"):
            gc.unfreeze()
            gc.collect()
            gc.freeze()
        self.startup_seconds = startup.ordered({**times, **rt.startup_seconds, "total": time.perf_counter() - t_start})
        log.info("started in %.2f s: %s", self.startup_seconds["total"], startup.describe(self.startup_seconds))

    def _speculator(self, spec, src):
        from kvserve.engine.spec.speculator import Speculator
        draft = None
        if spec.method in ("draft_model", "layer_skip"):
            from kvserve.engine.spec.draft import DraftModel
            draft = DraftModel(self.config, spec, src, self.runner, self.kv_plan.num_blocks)
        s = Speculator(spec, draft)
        self.stats.spec = s.stats
        return s

    # -- sessions and the tiers ----------------------------------------------------------------
    # -- sleep mode (engine/sleep_mode.py) ----------------------------------------------------
    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.arch.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # -- properties ------------------------------------------------------------------------
    @property
    def num_kv_blocks(self) -> int:
        return self.kv.pool.num_blocks

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._inflight is not None

    # -- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, session_id: str | None = None,
                    cache_salt: str | None = None) -> None:
        """``cache_salt`` (or a prompt dict's "cache_salt", as in vLLM): only requests with the
        same salt share prefix-cache blocks; None shares with every unsalted request."""
        params = params or SamplingParams()
        if request_id in self.scheduler.groups:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        if cache_salt is None and isinstance(prompt, dict):
            cache_salt = prompt.get("cache_salt")
        check_cache_salt(cache_salt)
        text, ids = self.tokenize_prompt(prompt)
        own = params.kv_budget
        params = self.validate(ids, params)
        self._wake_for_work()
        req = Request(request_id, ids, params, eos_token_ids=self.eos_token_ids,
                      max_model_len=self.max_model_len, prompt=text, arrival_time=arrival_time)
        req.session_id = session_id
        req.cache_salt = cache_salt
        req.metrics.kv_policy = kv_policy.for_request(self.kv_policy, params.kv_budget, own != params.kv_budget)
        if params.structured_outputs is not None:
            req.grammar = self.structured.matcher(params.structured_outputs)
        if session_id is not None:
            # Even if it was idle long enough to leave the GPU: moving it out now would only
            # load it straight back.
            self.sessions.touch(session_id)
        self.output_processor.add_request(request_id, text, ids, params)
        self.scheduler.add_request(req)

    def abort_request(self, request_id: str) -> None:
        for req in self.scheduler.abort_group(request_id):
            self.runner.drop_request(req.request_id)
            if self.speculator is not None:
                self.speculator.drop_request(req.request_id)
        self.output_processor.abort(request_id)

    def _fail_request(self, group_id: str, cause: BaseException) -> None:
        """A fault of this request alone (``faults``): abort it, keep the error for its caller."""
        log.warning("request %r failed and was aborted: %r", group_id, cause, exc_info=cause)
        self.abort_request(group_id)
        self._failed.setdefault(group_id, RequestFailedError(group_id, cause))

    def pop_failed(self) -> dict[str, RequestFailedError]:
        """Requests (by their ids) aborted for a fault of their own since the last call."""
        failed, self._failed = self._failed, {}
        return failed

    # -- the step --------------------------------------------------------------------------
    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """One scheduling step. Returns an output for every request that moved (for streaming),
        or with ``only_finished`` just for those that finished (offline batches: building the
        rest is wasted host time).

        With ``async_scheduling`` the step after this one is scheduled and launched before this
        one's tokens reach the host, wherever the data allows (``lookahead.can_look_ahead``): the host's
        bookkeeping then runs while the device computes the next step, and a request that stops
        here has computed one token too many, which is dropped."""
        t_call = time.perf_counter()
        self.housekeeping()
        cur, self._inflight = self._inflight, None
        if cur is None:
            # Nothing in flight: a graph warmed by the last step is captured before the next.
            self.runner.capture_graph(idle=False)
            cur = self._schedule_and_launch()
            if cur is None:
                return []
        if (self.config.async_scheduling and not self.runner.capture_due
                and lookahead.can_look_ahead(cur.out, self.store is not None)
                and (self.speculator is None or not self.speculator.plan(self.scheduler.running))):
            lookahead.advance(cur)
            try:
                nxt = self._schedule_and_launch(ahead=True)
            except BaseException:
                self._complete(cur, only_finished, t_call)  # no placeholder may outlive the error
                raise
            # An empty schedule launched nothing (every request of this step may stop here):
            # keeping it "in flight" would keep has_unfinished_requests() true for a call.
            self._inflight = nxt if nxt is not None and not nxt.out.is_empty else None
        try:
            return self._complete(cur, only_finished, t_call)
        except BaseException:
            self._drop_inflight()  # it was built on this step's tokens
            raise

    def capture_idle_graph(self) -> bool:
        """With no request in flight (and awake): capture one graph not captured yet, per
        ``cuda_graph_capture``. Returns whether one was captured (the caller looks at its queue
        again before the next)."""
        if self.has_unfinished_requests() or self.is_sleeping():
            return False
        return self.runner.capture_graph(idle=True)

    def _drop_inflight(self) -> None:
        """Discard the step launched ahead, as a failed step: wait for its work (its buffers),
        ignore its results and errors. Its requests' counters never moved (they move when a
        step completes, or just before the next is launched ahead)."""
        nxt, self._inflight = self._inflight, None
        if nxt is None:
            return
        try:
            nxt.result()
        except BaseException:  # noqa: BLE001 - the first failure is the one raised
            pass
        self._step_failed(nxt.out)

    def _schedule_and_launch(self, ahead: bool = False) -> InFlight | None:
        t0 = time.perf_counter()
        io0 = self._tier_copy_seconds()
        if self.speculator is not None:  # no drafts past tokens not known yet
            (self.speculator.skip if ahead else self.speculator.propose)(self.scheduler.running)
        out = self.scheduler.schedule()
        if (out.is_empty and self.scheduler.waiting and not self.scheduler.running and self.pins.pins
                and not any(r.prefetch_state == "pending" for r in self.scheduler.waiting)):
            self.pins.clear()  # pins never starve a request: with nothing else to give way, they go
            out = self.scheduler.schedule()
        if out.is_empty and self.scheduler.waiting and not self.scheduler.running:
            if any(r.prefetch_state == "pending" for r in self.scheduler.waiting):
                time.sleep(0.001)  # only requests whose KV is on its way from disk/Redis: wait for it
                return None
            # Admission checks make this unreachable; fail loudly rather than spin forever.
            raise RuntimeError(f"scheduler stalled: {len(self.scheduler.waiting)} waiting requests fit nowhere "
                               f"({self.kv.pool.num_free_blocks} free blocks)")
        if self.store is not None and self.sessions.due():
            # After scheduling: blocks that this step's new requests hit (an idle session's
            # prefix shared with a newcomer) are theirs now and stay on the GPU.
            self.offload_idle_sessions()
        try:
            result = self.runner.launch(out) if not out.is_empty else (lambda: None)
            # While the device computes: the KV usage of this step's state, for the stats.
            kv_usage = self.kv.kv_waste(self.scheduler.running)
        except BaseException:
            self._step_failed(out)
            raise
        return InFlight(out, result, t0, io0, kv_usage)

    def _step_failed(self, out: SchedulerOutput) -> None:
        # Blocks hash-registered for this step never got their KV: nothing may hit them.
        self.pins.clear()
        self.kv.pool.reset_prefix_cache()
        if self.store is not None:
            for _, run in out.loads:
                self.tiers.release(run)

    def _complete(self, cur: InFlight, only_finished: bool, t_call: float) -> list[RequestOutput]:
        """Wait for the step's results and fold them in. (``t_call``: when this ``step()``
        began; a step launched ahead was scheduled during the previous call.)"""
        try:
            result = cur.result()
        except BaseException:
            self._step_failed(cur.out)
            if cur.advanced:
                lookahead.rollback(cur)
            raise
        out = cur.out
        if result is not None:
            for i, e in result.failed.items():  # before update: it skips aborted requests
                req = out.scheduled[i].request
                if not req.is_finished:  # a step launched ahead fails it again: once is enough
                    self._fail_request(req.group_id, e)
        core = (self.scheduler.update(out, result, cur.advanced) if result is not None
                else EngineCoreOutputs())
        self.runner.start_mask_fill()  # the matchers have this step's tokens: off the critical path
        if self.speculator is not None and result is not None:
            self.speculator.observe(out, result, cur.t0)
        for parent, child in core.forks:
            self.runner.fork_request(parent.request_id, child.request_id)
        outputs, stops, failed = self.output_processor.process(core, only_finished)
        for group_id, e in failed.items():
            self._fail_request(group_id, e)
        finished = [r for r in core.finished if r.group_id not in failed]
        for group_id, index in stops:
            req = next(r for r in self.scheduler.groups[group_id] if r.index == index)
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            finished.append(req)
        for req in finished:
            self.runner.drop_request(req.request_id)
            if self.speculator is not None:
                self.speculator.drop_request(req.request_id)
            if req.session_id is not None:
                self._end_session_turn(req.session_id, list(req.block_hashes))
        if self.kv_transfer is not None and finished:
            self.kv_transfer.finished(finished, outputs)
        self.stats.num_requests_finished += sum(o.finished for o in outputs)
        n_prompt = cur.num_prompt_tokens + core.num_prompt_tokens
        n_gen = core.num_generated_tokens
        dt = time.perf_counter() - t_call  # this call's time: steps launched ahead overlap
        self.stats.record(self._step_stats(out.num_batched_tokens, n_prompt, n_gen, dt, cur.kv_usage))
        if self.store is not None and n_prompt >= 32 and n_prompt >= 4 * n_gen and not out.offloads:
            # Prefill speed, for load-or-recompute: the step's own compute, without the copies
            # to and from the tiers (the runner's eviction copies are not timed: skipped).
            compute = time.perf_counter() - cur.t0 - (self._tier_copy_seconds() - cur.io0)
            self.store.cost.observe_prefill(n_prompt, compute)
        return outputs

    def _step_stats(self, n_batched: int, n_prompt: int, n_gen: int, dt: float,
                    kv_usage: tuple[int, int]) -> StepStats:
        pool = self.kv.pool
        alloc, filled = kv_usage
        q = self.kv.prefix_queries
        return StepStats(
            step=self.stats.num_steps, num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting), num_batched_tokens=n_batched,
            num_prompt_tokens=n_prompt, num_generated_tokens=n_gen,
            kv_blocks_used=pool.num_used_blocks, kv_blocks_free=pool.num_free_blocks,
            kv_blocks_cached=pool.num_cached_blocks, kv_slots_allocated=alloc, kv_slots_filled=filled,
            prefix_hit_rate=self.kv.prefix_hits / q if q else 0.0,
            num_preemptions=self.scheduler.num_preemptions, step_time=dt)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent); the engine cannot step after."""
        self.runner.close()

    def check_invariants(self) -> None:
        live = [r for g in self.scheduler.groups.values() for r in g if not r.is_finished]
        self.kv.check_invariants(live, self.pins.held() + self._transfer_held())
        self.pins.check()

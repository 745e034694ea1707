"""LLMEngine: add requests, step, get outputs.

    step():  Scheduler.schedule() -> ModelRunner.launch() (device work queued; the host does the
             step's bookkeeping meanwhile) -> finish() (sampled ids) -> tokens, text, stops, forks;
             finished requests free their blocks
    async scheduling: schedule + launch step N+1 before finish() of step N (its sampled ids
             feed N+1 on the device), then fold N's results in while N+1 runs
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

from kvserve.config import EngineConfig
from kvserve.engine.detokenizer import Detokenizer, find_stop
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.model_runner import ModelRunner, StepResult
from kvserve.engine.request import PENDING_TOKEN, Request, RequestStatus
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.stats import EngineStats, StepStats
from kvserve.errors import InvalidRequestError
from kvserve.models import loader
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

PromptType = str | list[int] | dict


@dataclasses.dataclass
class _Launched:
    """A step whose device work is queued: ``finish()`` waits for it and returns its results."""
    out: SchedulerOutput
    finish: Callable[[], list[StepResult]]
    t0: float
    io0: float
    kv_usage: tuple[int, int]
    advanced: bool = False  # counters moved and placeholders appended before the results came
    n_prompt: int = 0  # prompt tokens it computed (counted when advanced)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        src = loader.resolve(config.model)
        self.model_name = src.name
        self.arch = src.arch
        self.tokenizer = load_tokenizer(src.kind, src.path, config.tokenizer)
        self.detokenizer = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        limit = src.arch.max_position_embeddings
        want = config.scheduler.max_model_len
        if want is not None and want > limit:
            raise InvalidRequestError("max_model_len", f"must be <= the model's context length {limit}, got {want}")
        self.max_model_len = want or limit
        self.runner = ModelRunner(config, src, self.max_model_len)
        self.config = config = self.runner.config  # with the device's defaults resolved
        kv_bytes = self.runner.determine_kv_memory()
        if self.runner.kv_format.kivi:
            max_seqs = self.runner.plan_residual(kv_bytes)
            if max_seqs < config.scheduler.max_num_seqs:
                log.warning("%s KV cache: the full-precision key residual (one block per running sequence) "
                            "fits %d sequences in a quarter of the KV memory; max_num_seqs %d -> %d",
                            self.runner.kv_format.name, max_seqs, config.scheduler.max_num_seqs, max_seqs)
                config = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler,
                                                                                   max_num_seqs=max_seqs))
                self.config = self.runner.config = config
        block_bytes = self.runner.kv_bytes_per_block()
        num_blocks = (kv_bytes - self.runner.kv_fixed_bytes()) // block_bytes
        if num_blocks < 1:
            raise InvalidRequestError("kv_cache_memory", f"{kv_bytes} bytes is less than one KV block "
                                      f"({block_bytes} bytes at block_size {config.cache.block_size}) plus "
                                      f"{self.runner.kv_fixed_bytes()} bytes of KIVI key residual")
        swap_blocks = config.cache.swap_space // block_bytes if config.cache.preemption_mode == "swap" else 0
        self.runner.allocate_kv_cache(num_blocks, swap_blocks)
        # The prefix-cache key, and the tiers' chunk key: the same tokens give the same KV only
        # for the same weights, so the weights' fingerprint is part of it (tiers outlive processes).
        fmt = self.runner.kv_format
        extra = (f"{src.name}|{src.arch.num_layers}|{self.runner.dtype}|{loader.fingerprint(src, config.seed)}"
                 f"|kv={fmt.name}/{fmt.group}/{fmt.block_size}/{fmt.layout + '/' if fmt.layout else ''}"
                 f"{self._scales_id()}").encode()
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching, extra)
        self.store = self._make_store(config.cache) if config.cache.tiers_enabled else None
        self.runner.store = self.store
        self.scheduler = Scheduler(config.scheduler, config.cache, self.kv, self.max_model_len, swap_blocks,
                                   store=self.store)
        self.sessions: dict[str, tuple[float, list[bytes]]] = {}  # id -> (last active, block keys)
        self.pinned_sessions: set[str] = set()
        self._next_idle_check = 0.0
        self.groups: dict[str, list[Request]] = {}
        self.stats = EngineStats()
        self._inflight: _Launched | None = None  # async scheduling: the step launched ahead
        self.eos_token_ids = self._eos_ids()
        log.info("KV cache: %d blocks x %d tokens = %d tokens, %.3f GiB, %s", num_blocks,
                 config.cache.block_size, num_blocks * config.cache.block_size, num_blocks * block_bytes / 2**30,
                 fmt.describe())

    def _scales_id(self) -> str:
        """Calibrated KV scales change every code written: they are part of the cache key."""
        s = self.runner.kv_scales
        if s is None:
            return "dynamic"
        import hashlib
        return hashlib.blake2b(s.float().cpu().numpy().tobytes(), digest_size=8).hexdigest()

    def _make_store(self, cache):
        from kvserve.errors import ConfigError
        from kvserve.kvtier import TieredStore
        if not cache.enable_prefix_caching:
            raise ConfigError("cpu_kv_memory/disk_kv_dir/redis_url", "the KV tiers are keyed by the prefix "
                              "cache's block hashes: they need prefix caching on")
        rt = self.runner
        shape, dtype = rt.kv_cache.block_shape, rt.kv_cache.data.dtype
        if cache.disk_kv_dir is not None:
            try:
                os.makedirs(cache.disk_kv_dir, exist_ok=True)
            except OSError as e:
                raise ConfigError("disk_kv_dir", f"cannot create {cache.disk_kv_dir!r}: {e.strerror}") from None
        if cache.redis_url is not None:
            try:
                import redis  # noqa: F401
            except ImportError:
                raise ConfigError("redis_url", "needs the 'redis' package (pip install redis)") from None
        return TieredStore(shape, dtype, rt.device, cpu_bytes=cache.cpu_kv_memory, disk_dir=cache.disk_kv_dir,
                           disk_bytes=cache.disk_kv_size, redis_url=cache.redis_url, block_size=cache.block_size)

    # -- sessions and the tiers ----------------------------------------------------------------
    def offload_idle_sessions(self, now: float | None = None, force: bool = False,
                              only: str | None = None) -> int:
        """Move the KV of sessions idle for ``idle_offload_seconds`` (all, with ``force``) from
        the GPU prefix cache to the tiers; their blocks become plain free blocks. Returns blocks
        moved. A pinned session stays."""
        if self.store is None or not self.sessions:
            return 0
        now = time.monotonic() if now is None else now
        limit = self.config.cache.idle_offload_seconds
        going = [sid for sid, (last, _) in self.sessions.items()
                 if (only is None or sid == only) and sid not in self.pinned_sessions
                 and (force or now - last >= limit)]
        if not going:
            return 0
        # Blocks that a staying session also holds (a shared system prompt, a forked history)
        # stay: that session is active, or pinned, and would only load them back.
        keep = {k for sid, (_, keys) in self.sessions.items() if sid not in going for k in keys}
        moves: dict[bytes, int] = {}
        for sid in going:
            for key in self.sessions.pop(sid)[1]:
                bid = self.kv.pool.lookup(key)
                if key not in keep and bid is not None and self.kv.pool.blocks[bid].ref_cnt == 0:
                    moves[key] = bid
        if moves:
            # Most are in the tiers already (written at the end of their turn): only the rest
            # is copied, straight into the CPU tier's pinned slots.
            self.store.offload(self.runner.kv_cache.data, [(b, k) for k, b in moves.items()])
            for bid in moves.values():
                self.kv.pool.uncache(bid)
            self.store.load_stats.idle_offloaded_blocks += len(moves)
        return len(moves)

    def _end_session_turn(self, session_id: str, keys: list[bytes]) -> None:
        """A session's turn finished: remember its blocks, and copy those the tiers do not hold
        yet into them now, while their KV is certainly on the GPU. When the GPU cache later
        evicts them, or the session goes idle, they leave without a copy on the step's path."""
        self.sessions[session_id] = (time.monotonic(), keys)
        if self.store is None or session_id in self.pinned_sessions:
            return
        blocks = [(bid, k) for k in keys if (bid := self.kv.pool.lookup(k)) is not None]
        n = self.store.offload(self.runner.kv_cache.data, blocks)
        self.store.load_stats.session_blocks_written += n

    def _tier_copy_seconds(self) -> float:
        st = self.store.load_stats if self.store is not None else None
        return st.load_seconds + st.offload_seconds if st is not None else 0.0

    def pin_session(self, session_id: str, pinned: bool = True) -> None:
        (self.pinned_sessions.add if pinned else self.pinned_sessions.discard)(session_id)

    def flush_kv_to_tiers(self) -> int:
        """Write every block of the GPU prefix cache to the tiers and wait for the writes (at
        shutdown, so a restart or another replica finds them). Returns blocks written."""
        if self.store is None:
            return 0
        moves = [(bid, h) for h, bid in list(self.kv.pool.cached.items())]
        self.runner.offload_blocks(moves, wait=True)
        self.store.flush()
        return len(moves)

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
    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt", "this model has no tokenizer; pass prompt_token_ids")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, list):
            return None, list(prompt)
        raise InvalidRequestError("prompt", f"must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_ids)
        if n == 0:
            raise InvalidRequestError("prompt", "must not be empty")
        vocab = self.arch.vocab_size
        if any(type(t) is not int or not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequestError("prompt", f"token ids must be integers in [0, {vocab})")
        if n >= self.max_model_len:
            raise InvalidRequestError("prompt", f"has {n} tokens; max_model_len is {self.max_model_len}, "
                                      f"so at most {self.max_model_len - 1} prompt tokens fit")
        mt = params.max_tokens
        if mt is not None and n + mt > self.max_model_len:
            raise InvalidRequestError("max_tokens", f"prompt ({n} tokens) + max_tokens ({mt}) = {n + mt} exceeds "
                                      f"max_model_len {self.max_model_len}; allowed max_tokens <= {self.max_model_len - n}")
        need = self.scheduler.blocks_to_finish(n, mt if mt is not None else self.max_model_len - n, params.n)
        if need > self.num_kv_blocks:
            raise InvalidRequestError("max_tokens", f"the request needs {need} KV blocks at its longest "
                                      f"(prompt {n} + max_tokens {mt} tokens, n={params.n}) but the KV pool "
                                      f"holds {self.num_kv_blocks}; lower max_tokens or n, or raise kv_cache_memory")

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, session_id: str | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.groups:
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        self.validate(ids, params)
        req = Request(request_id, ids, params, eos_token_ids=self.eos_token_ids,
                      max_model_len=self.max_model_len, prompt=text, arrival_time=arrival_time)
        req.session_id = session_id
        if session_id is not None and session_id in self.sessions:
            # Its next turn is here: the session is active again, even if it was idle long
            # enough to leave the GPU (moving it out now would only load it straight back),
            # and until the turn runs its blocks stay, with those it shares with others.
            self.sessions[session_id] = (time.monotonic(), self.sessions[session_id][1])
        self.groups[request_id] = [req]
        self.scheduler.add_request(req)

    def abort_request(self, request_id: str) -> None:
        for req in self.groups.pop(request_id, []):
            if not req.is_finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            self.runner.drop_request(req.request_id)

    # -- the step --------------------------------------------------------------------------
    def step(self, only_finished: bool = False) -> list[RequestOutput]:
        """One scheduling step. Returns an output for every request that moved (for streaming),
        or with ``only_finished`` just for those that finished (offline batches: building the
        rest is wasted host time).

        With ``async_scheduling`` the step after this one is scheduled and launched before this
        one's tokens reach the host, wherever the data allows (``_can_look_ahead``): the host's
        bookkeeping then runs while the device computes the next step, and a request that stops
        here has computed one token too many, which is dropped."""
        t_call = time.perf_counter()
        cur, self._inflight = self._inflight, None
        if cur is None:
            cur = self._schedule_and_launch()
            if cur is None:
                return []
        if self.config.async_scheduling and self._can_look_ahead(cur.out):
            self._advance(cur)
            try:
                nxt = self._schedule_and_launch()
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

    def _drop_inflight(self) -> None:
        """Discard the step launched ahead, as a failed step: wait for its work (its buffers),
        ignore its results and errors. Its requests' counters never moved (they move when a
        step completes, or just before the next is launched ahead)."""
        nxt, self._inflight = self._inflight, None
        if nxt is None:
            return
        try:
            nxt.finish()
        except BaseException:  # noqa: BLE001 - the first failure is the one raised
            pass
        self._step_failed(nxt.out)

    def _rollback(self, cur: _Launched) -> None:
        """Undo ``_advance`` for a step whose results never came: the requests stand where the
        step found them, as after a failed synchronous step."""
        for s in cur.out.scheduled:
            req = s.request
            if req.is_finished:
                continue
            if s.samples and req.token_pending:
                req.drop_pending()
            req.num_computed_tokens -= s.num_new_tokens

    def _schedule_and_launch(self) -> _Launched | None:
        t0 = time.perf_counter()
        io0 = self._tier_copy_seconds()
        out = self.scheduler.schedule()
        if out.is_empty and self.scheduler.waiting and not self.scheduler.running:
            if any(r.prefetch_state == "pending" for r in self.scheduler.waiting):
                time.sleep(0.001)  # only requests whose KV is on its way from disk/Redis: wait for it
                return None
            # Admission checks make this unreachable; fail loudly rather than spin forever.
            raise RuntimeError(f"scheduler stalled: {len(self.scheduler.waiting)} waiting requests fit nowhere "
                               f"({self.kv.pool.num_free_blocks} free blocks)")
        if self.store is not None and self.sessions and time.monotonic() >= self._next_idle_check:
            # After scheduling: blocks that this step's new requests hit (an idle session's
            # prefix shared with a newcomer) are theirs now and stay on the GPU.
            self._next_idle_check = time.monotonic() + 0.25
            self.offload_idle_sessions()
        try:
            finish = self.runner.launch(out) if not out.is_empty else (lambda: [])
            # While the device computes: the KV usage of this step's state, for the stats.
            kv_usage = self.kv.kv_waste(self.scheduler.running)
        except BaseException:
            self._step_failed(out)
            raise
        return _Launched(out, finish, t0, io0, kv_usage)

    def _step_failed(self, out: SchedulerOutput) -> None:
        # Blocks hash-registered for this step never got their KV: nothing may hit them.
        self.kv.pool.reset_prefix_cache()
        if self.store is not None:
            for _, run in out.loads:
                self.store.release(run)

    def _can_look_ahead(self, out: SchedulerOutput) -> bool:
        """Whether the next step may be scheduled before this one's tokens are known: not with
        the KV tiers (their copies run beside the compute stream), nor when a request of this
        step forks (n > 1), samples with penalties (they read the tokens on the host) or wants
        prompt log-probs (read from this step's hidden states)."""
        if self.store is not None or out.is_empty:
            return False
        for s in out.scheduled:
            r = s.request
            if s.samples and (r.pending_forks or r.params.needs_penalties):
                return False
            if r.prompt_logprobs is not None and r.num_computed_tokens < r.num_prompt_tokens:
                return False
        return True

    def _advance(self, cur: _Launched) -> None:
        """Move the step's counters now, as its results would: each sampling request gets a
        placeholder for its token (``Request.resolve_pending`` fills it in)."""
        cur.advanced = True
        for s in cur.out.scheduled:
            req = s.request
            if req.is_finished:  # aborted since the launch
                continue
            if req.num_computed_tokens < req.num_prompt_tokens:
                cur.n_prompt += min(s.num_new_tokens, req.num_prompt_tokens - req.num_computed_tokens)
            req.num_computed_tokens += s.num_new_tokens
            if s.samples:
                req.append_token(PENDING_TOKEN)

    def _complete(self, cur: _Launched, only_finished: bool, t_call: float) -> list[RequestOutput]:
        """Wait for the step's results and fold them into the requests. (``t_call``: when this
        ``step()`` began; a step launched ahead was scheduled during the previous call.)"""
        try:
            results = cur.finish()
        except BaseException:
            self._step_failed(cur.out)
            if cur.advanced:
                self._rollback(cur)
            raise
        out = cur.out
        touched: dict[str, None] = {}
        n_prompt, n_gen = cur.n_prompt, 0
        for s, res in zip(out.scheduled, results):
            req = s.request
            if req.is_finished:  # (async scheduling) stopped or aborted after the launch: dropped
                continue
            if not cur.advanced:
                if req.num_computed_tokens < req.num_prompt_tokens:
                    n_prompt += min(s.num_new_tokens, req.num_prompt_tokens - req.num_computed_tokens)
                if res.prompt_logprobs:
                    self._add_prompt_logprobs(req, res)
                req.num_computed_tokens += s.num_new_tokens
            if res.token_ids:
                n_gen += len(res.token_ids)
                self._append_tokens(req, res, pending=cur.advanced)
            touched[req.group_id] = None
        if only_finished:
            touched = {g: None for g in touched if self._group_finished(g)}
        outputs = [self._make_output(g) for g in touched]
        for o in outputs:
            if o.finished:
                self.stats.num_requests_finished += 1
                for r in self.groups.pop(o.request_id):
                    self.runner.drop_request(r.request_id)
                    if r.session_id is not None:
                        self._end_session_turn(r.session_id, list(r.block_hashes))
        dt = time.perf_counter() - t_call  # this call's time: steps launched ahead overlap
        self.stats.record(self._step_stats(out.num_batched_tokens, n_prompt, n_gen, dt, cur.kv_usage))
        if self.store is not None and n_prompt >= 32 and n_prompt >= 4 * n_gen and not out.offloads:
            # Prefill speed, for load-or-recompute: the step's own compute, without the copies
            # to and from the tiers (the runner's eviction copies are not timed: skipped). With
            # them counted, the H200 multi-turn run ended at 752 tokens/s.
            compute = time.perf_counter() - cur.t0 - (self._tier_copy_seconds() - cur.io0)
            self.store.cost.observe_prefill(n_prompt, compute)
        return outputs

    def _append_tokens(self, req: Request, res: StepResult, pending: bool = False) -> None:
        """``pending``: the request's token was appended as a placeholder when the step was
        launched (async scheduling, no forks then)."""
        now = time.time()
        siblings = [req]
        if req.pending_forks:
            gens = req.generators
            for i in range(1, req.pending_forks + 1):
                child = req.fork(i)
                self.scheduler.fork(req, child)
                self.runner.fork_request(req.request_id, child.request_id)
                self.groups[req.group_id].append(child)
                siblings.append(child)
            req.pending_forks = 0
            if gens is not None:
                req.generators = gens[:1]
        for r, tok, lp in zip(siblings, res.token_ids, res.logprobs):
            if pending:
                r.resolve_pending(tok)
            else:
                r.append_token(tok)
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = now
            r.metrics.num_generation_tokens += 1
            if lp is not None:
                r.cumulative_logprob += lp[0]
                r.logprobs.append(self._logprob_dict(tok, lp[0], lp[1], lp[2]))
            self._check_stop(r, tok)

    def _check_stop(self, r: Request, tok: int) -> None:
        p = r.params
        n_new_chars = self.detokenizer.update(r) if self.detokenizer else 0
        status = None
        if r.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and tok in r.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
            elif p.stop_token_ids and tok in p.stop_token_ids:
                status, r.stop_reason = RequestStatus.FINISHED_STOPPED, tok
            elif (stop := find_stop(r, n_new_chars)) is not None:
                status, r.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        if status is None and (r.num_output_tokens >= r.max_tokens or r.num_tokens >= self.max_model_len):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish(r, status)

    def _logprob_dict(self, tok: int, lp: float, rank: int, top: list[tuple[int, float]]) -> dict[int, Logprob]:
        dec = self.detokenizer.decode_token if self.detokenizer else (lambda _: None)
        d = {tok: Logprob(lp, rank, dec(tok))}
        for r, (t, v) in enumerate(top, start=1):
            if t not in d:
                d[t] = Logprob(v, r, dec(t))
        return d

    def _add_prompt_logprobs(self, req: Request, res: StepResult) -> None:
        # Entry i is prompt position i; a recomputed chunk (after preemption) overwrites.
        del req.prompt_logprobs[req.num_computed_tokens + 1:]
        for tok, lp, rank, top in res.prompt_logprobs:
            req.prompt_logprobs.append(self._logprob_dict(tok, lp, rank, top))

    def _group_finished(self, group_id: str) -> bool:
        reqs = self.groups[group_id]
        return all(r.is_finished for r in reqs) and len(reqs) == reqs[0].params.n

    def _make_output(self, group_id: str) -> RequestOutput:
        reqs = sorted(self.groups[group_id], key=lambda r: r.index)
        first = reqs[0]
        finished = all(r.is_finished for r in reqs) and len(reqs) == first.params.n
        outs = [CompletionOutput(index=r.index, text=self._visible_text(r), token_ids=list(r.output_token_ids),
                                 cumulative_logprob=r.cumulative_logprob if r.logprobs is not None else None,
                                 logprobs=r.logprobs, finish_reason=r.status.finish_reason,
                                 stop_reason=r.stop_reason)
                for r in reqs]
        return RequestOutput(request_id=group_id, prompt=first.prompt,
                             prompt_token_ids=first.all_token_ids[:first.num_prompt_tokens],
                             prompt_logprobs=first.prompt_logprobs, outputs=outs, finished=finished,
                             metrics=first.metrics)

    @staticmethod
    def _visible_text(r: Request) -> str:
        """While running, hold back the tail that could still start a stop string, so a streamed
        text never shows part of a stop string that is cut off once it completes."""
        stops = r.params.stop_strings
        if r.is_finished or not stops or r.params.include_stop_str_in_output:
            return r.output_text
        hold = max(len(s) for s in stops) - 1
        return r.output_text[:max(0, len(r.output_text) - hold)]

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

    def check_invariants(self) -> None:
        live = [r for g in self.groups.values() for r in g if not r.is_finished]
        self.kv.check_invariants(live)

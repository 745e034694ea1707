"""ModelRunner: owns the model and the KV cache tensors; turns a SchedulerOutput into tokens."""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import torch

from kvserve import kernels, structured
from kvserve.config import EngineConfig
from kvserve.engine import decode_rows, kv_plan
from kvserve.engine.cuda_setup import CudaSetup
from kvserve.engine.device import DTYPES, GpuTimer, auto_dtype, choose_attention_backend, resolve_device
from kvserve.engine.faults import is_device_fault
from kvserve.engine.grammar_masks import DeferredSampling, GrammarMasks
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.kv_groups import NULL
from kvserve.engine.kv_lifecycle import KVLifecycle
from kvserve.engine.request import PENDING_TOKEN
from kvserve.engine.sampler import Sampler
from kvserve.engine.sampling_rows import PLACEHOLDER_ROW, prompt_logprobs, sample_one_by_one, sampling_row
from kvserve.engine.sleep_mode import SleepMode
from kvserve.engine.spec.verify_step import VerifyStep
from kvserve.engine.step import ModelRunnerOutput, SchedulerOutput
from kvserve.engine.step_metadata import StepMetadata
from kvserve.engine.tp_runner import TensorParallel
from kvserve.engine.weights import ModelWeights
from kvserve.kv_eviction import SCORED, score_rows
from kvserve.layers.attention import ForwardContext, forward_context, get_backend
from kvserve.models import loader, snapshot

log = logging.getLogger(__name__)




class ModelRunner(ModelWeights, KVLifecycle, StepMetadata, GrammarMasks, CudaSetup, VerifyStep, TensorParallel):
    def __init__(self, config: EngineConfig, src: loader.ModelSource, max_model_len: int,
                 tp_rank: int = 0, tp_store=None):
        """``tp_rank``, ``tp_store``: a tensor-parallel worker's rank and rank 0's store
        (``tp_workers.py``); rank 0 starts the workers itself."""
        self.device = resolve_device(config.device)
        if config.async_scheduling is None:
            # Scored KV eviction needs each step's attention scores before the next is scheduled;
            # tensor-parallel ranks take their input tokens from rank 0's host. (Speculative
            # decoding looks ahead only past steps without drafts: ``lookahead.can_look_ahead``.)
            config = dataclasses.replace(config, async_scheduling=self.device.type == "cuda"
                                         and config.tensor_parallel_size == 1
                                         and config.cache.kv_eviction in ("none", "streaming"))
        self.config = config
        if src.kind == "snapshot":  # runs in the dtype it was written in, on the device it was written for
            snapshot.check_compatible(src.handle, src.path, config.dtype, self.device)
            self.dtype = DTYPES[src.handle["dtype"]]
        elif config.dtype == "auto":
            self.dtype = auto_dtype(self.device)
        else:
            self.dtype = DTYPES[config.dtype]
        self.src = src
        self.arch = src.arch
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self._start_tp(tp_rank, tp_store)
        cache = config.cache
        self.backend_name = choose_attention_backend(config.attention_backend, self.device.type,
                                                     cache.kv_eviction, kernels.has_triton)
        self.kv_scales = self._local_scales(kv_plan.load_scales(config, src, self.device))
        self.kv_format = kv_plan.make_format(cache, self.arch, self.dtype, self.device, self.kv_scales)
        self._check_quantization()
        self.packed_weights: frozenset[str] = frozenset()
        self.startup_seconds: dict[str, float] = {}  # this runner's phases (engine/startup.py)
        self.model = self._build_and_load()
        self.pack_for_cpu(self.model)
        name = self.backend_name
        if name == "triton" and self.device.type != "cuda" and not kernels.interpreting():
            from kvserve.errors import ConfigError
            raise ConfigError("attention_backend", f"'triton' needs a CUDA device (or TRITON_INTERPRET=1 for "
                              f"tests), got {self.device}; use torch or auto")
        try:
            self.backend = get_backend(name, config.kernel)
        except ImportError:  # "auto" found Triton installed, but it does not import: the PyTorch path
            if name != "triton" or config.attention_backend != "auto":
                raise
            self.backend_name = name = "torch"
            self.backend = get_backend(name, config.kernel)
        self.sampler = Sampler(self.device, config.seed, copy_ahead=config.async_scheduling)
        self.kv_cache: KVCache | None = None
        self.kv_groups = None  # kv_groups.KVGroups of the cache, set with it
        self.graphs = None  # DecodeGraphs, captured after the KV cache exists
        self.compiled = None  # CPU: the model compiled for one-token steps (engine/cpu_compile.py)
        self.graph_capture = None  # when each of them is captured (engine/graph_capture.py)
        self._sampled = None  # (sampled ids on the device, scheduled, row -> scheduled index) of the last step
        self.tiers = None  # kvserve.kvtier.TierConnector, set by the engine when tiers are on
        self.kv_alloc = None  # KVCache's pool allocator, set by a CudaIpcConnector producer (shared memory)
        self.gpu_timer: GpuTimer | None = None  # set by benchmarks: device time of the steps
        self._bitmask: structured.BitmaskFiller | None = None  # made on the first constrained step
        # A step launched ahead whose grammar rows wait for their matchers to catch up.
        self._deferred: DeferredSampling | None = None
        # Draws of unseeded requests' draft verification (seeded ones use their own generators).
        self._spec_generator = torch.Generator().manual_seed(config.seed)
        # The CUDA profiling run's result (see _profile_cuda_kv_memory); a snapshot keeps it.
        self.kv_profile: dict | None = None
        self.sleep_mode = SleepMode(self) if config.enable_sleep_mode else None
        self.embedding_kv: dict[int, KVCache] = {}  # an embedded input's scratch cache, between its chunks

    @torch.inference_mode()
    def hidden_states(self, token_ids: list[int], start: int = 0, total: int | None = None, job: int = -1):
        """Final hidden states [T, H] of tokens [start, start + T) of an input of ``total`` (embeddings,
        engine/pooling.py): eager, over a scratch KV cache its first chunk makes and its last drops."""
        self._mirror("hidden_states", token_ids, start, total, job)
        n, num_blocks = len(token_ids), -(-(total := total or len(token_ids)) // self.block_size)
        if start == 0:
            self.embedding_kv[job] = KVCache(self.arch, num_blocks, self.block_size, self.dtype, self.device)
        scratch = self.embedding_kv[job] if start + n < total else self.embedding_kv.pop(job)
        meta, positions = self._build_metadata([(start, n, list(range(num_blocks)))])
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        with forward_context(ForwardContext(meta, scratch.layers, self.backend)), self._tp_guard():
            return self.model(ids, positions)

    def drop_embedding(self, job: int) -> None:
        """An input abandoned between its chunks: its scratch cache goes."""
        self._mirror("drop_embedding", job)
        self.embedding_kv.pop(job, None)

    # -- one step -------------------------------------------------------------------------
    def fork_request(self, parent_id: str, child_id: str) -> None:
        """A forked child shares its parent's unsealed last block, so it gets a copy of the
        parent's residual row."""
        self._mirror("fork_request", parent_id, child_id)
        self.kv_cache.fork(parent_id, child_id)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step and return what each scheduled request got."""
        return self.launch(out)()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Queue the step's GPU work and return a callable that waits for it and returns its
        ``ModelRunnerOutput``. Between the two the host is free (the engine does its
        bookkeeping there while the device computes)."""
        # A step launched before this one and holding its sampling (grammar rows) samples now: this
        # step's inputs are its tokens, read on the device. Held until here, its mask's fill ran
        # beside the host's bookkeeping and this step's scheduling.
        self.launch_sampling()
        kv = self.kv_cache
        if self.tiers is not None:
            # Before the step writes anything: evicted blocks leave first (a load or a new
            # token may be about to overwrite them), then loaded chunks fill their blocks.
            self.tiers.offload(kv.data, out.offloads)
            self.tiers.stats.offloaded_blocks += len(out.offloads)
            self.tiers.load(kv.data, out.loads)
        if out.swap_out or out.copies or out.swap_in or out.preempted:
            self._mirror("_apply_kv_ops", out.swap_out, out.copies, out.swap_in, out.preempted)
            self._apply_kv_ops(out.swap_out, out.copies, out.swap_in, out.preempted)
        sched = out.scheduled
        ids: list[int] = []
        pending_rows, pending_src = [], []  # async scheduling: input tokens sampled by the step in flight
        prompt_lp: list[int] = []  # requests whose prompt log-probs this step computes
        for i, s in enumerate(sched):
            r = s.request
            c = r.num_computed_tokens
            if r.wants_prompt_logprobs and c < r.num_prompt_tokens:
                prompt_lp.append(i)
            if s.num_new_tokens == 1 and not s.draft_token_ids:
                ids.append(r.all_token_ids[c])  # a decode step's one token, without a slice
            else:
                ids.extend(r.all_token_ids[c:c + s.num_new_tokens - len(s.draft_token_ids)])
                ids.extend(s.draft_token_ids)
            if ids and ids[-1] == PENDING_TOKEN:
                pending_rows.append(len(ids) - 1)
                pending_src.append(r.request_id)
        patch = None
        if pending_rows:
            tokens, prev_sched, prev_sample_of = self._sampled
            # Each request's own token is its first draw in the step in flight.
            row_of: dict[str, int] = {}
            for k, i in enumerate(prev_sample_of):
                row_of.setdefault(prev_sched[i].request.request_id, k)
            pending_src = [row_of[rid] for rid in pending_src]
            assert ids.count(PENDING_TOKEN) == len(pending_rows), "only a request's last token can be pending"
            src = torch.tensor(pending_src).to(self.device, non_blocking=True)
            patch = (torch.tensor(pending_rows).to(self.device, non_blocking=True), tokens[src])
        seqs = [(s.request.num_computed_tokens, s.num_new_tokens, s.block_table) for s in sched]
        group_seqs = None
        if self.kv_groups is not None and self.kv_groups.num_groups > 1:
            group_seqs = [[(c, n, s.group_tables[g]) for (c, n, _), s in zip(seqs, sched)]
                          for g in range(1, self.kv_groups.num_groups)]
        grammar_rows, grammar_reqs, n_rows = self._grammar_rows(sched)
        mask_job = None
        if grammar_rows and not any(r.token_pending for r in grammar_reqs):
            # The matchers are current: the mask fills on the host while the forward is queued
            # (on the CPU: while it runs).
            mask_job = self._fill_masks(n_rows, grammar_rows, grammar_reqs)
        if self.gpu_timer is not None:
            self.gpu_timer.start()
        res_slots = None
        if self.kv_format.kivi:
            self._mirror("_kv", "residual_rows", [s.request.request_id for s in sched])
            res_slots = kv.residual_rows([s.request.request_id for s in sched])
        budgets = [s.request.params.kv_budget for s in sched]
        scored = self._score_specs(sched) if any(b is not None for b in budgets) else None
        budgets = budgets if any(b is not None for b in budgets) else None
        assert patch is None or self.tp is None, "tensor-parallel ranks read input tokens from rank 0's host"
        self._mirror("_forward", ids, seqs, res_slots, None, None, None, group_seqs, budgets)
        with self._tp_guard():
            hidden, query_start = self._forward(ids, seqs, res_slots, patch, group_seqs=group_seqs,
                                                kv_budgets=budgets, kv_scored=scored)
        kv_scores = {i: sp[3] for i, sp in enumerate(scored or ()) if sp is not None and sp[3] is not None}

        # Rows to turn into logits: the last token of each sampling request, and every
        # position of a request that asked for prompt log-probs.
        sample_rows, rows, sample_of = [], [], []
        failed: dict[int, BaseException] = {}  # scheduled index -> its own fault (see faults.py)
        seeded: list[tuple[torch.Generator, torch.Tensor]] = []  # states before this step's draws
        verifying: list[int] = []  # requests with drafts: all their k + 1 positions are verified
        forks = False
        for i, s in enumerate(sched):
            if not s.samples:
                continue
            r = s.request
            if s.draft_token_ids:
                verifying.append(i)
            else:
                n_draws = r.pending_forks + 1
                forks = forks or n_draws > 1
                try:
                    mine = [sampling_row(r, j) for j in range(n_draws)]
                    if r.generators is not None:
                        seeded.extend((w.generator, w.generator.get_state()) for w in mine if w.generator is not None)
                except Exception as e:  # noqa: BLE001 - this request's fault, unless the device's
                    if is_device_fault(e):
                        raise
                    failed[i] = e
                    mine = [PLACEHOLDER_ROW] * n_draws
                last = query_start[i + 1] - 1
                for row in mine:
                    sample_rows.append(last)
                    rows.append(row)
                    sample_of.append(i)
        one_each = not forks and len(sample_of) == len(sched)  # sample_of is 0, 1, 2, ...
        pending = None
        deferred = None

        def sample(mask_job) -> None:
            nonlocal pending
            bitmask = None
            if mask_job is not None:
                mask, masked = mask_job.result()
                if masked:
                    bitmask = (mask.to(self.device, non_blocking=True), masked)
            try:
                pending = self.sampler.launch(logits, rows, bitmask)
            except Exception as e:  # noqa: BLE001 - narrowed down below
                if is_device_fault(e):
                    raise
                for g, state in seeded:  # a seeded request draws the same noise as if alone
                    g.set_state(state)
                # Afresh: the failed batch may have applied penalties to its logits in place.
                pending = sample_one_by_one(self.sampler, self._logits(picked), rows, sample_of, failed, bitmask)
            # The sampled ids stay on the device: a step scheduled before they reach the host
            # takes its requests' input tokens from here.
            self._sampled = (pending[0], sched, sample_of)

        if sample_rows:
            if len(sample_rows) == hidden.shape[0] and sample_rows == list(range(len(sample_rows))):
                picked = hidden  # every row sampled once, in order (a decode step)
            else:
                picked = hidden[torch.tensor(sample_rows).to(self.device, non_blocking=True)]
            logits = self._logits(picked)
            if grammar_rows and mask_job is None:
                # Launched ahead of the step in flight, whose tokens its matchers have not seen:
                # sampling waits for them (``start_mask_fill``, ``launch_sampling``); the forward
                # and the LM head are queued already.
                deferred = DeferredSampling(sample, lambda: self._fill_masks(n_rows, grammar_rows, grammar_reqs))
            else:
                sample(mask_job)
        else:
            self._sampled = None
        verify_logits = self._verify_logits(hidden, query_start, sched, verifying) if verifying else None
        if self.gpu_timer is not None:
            self.gpu_timer.stop()
        self._deferred = deferred

        @torch.inference_mode()
        def finish() -> ModelRunnerOutput:
            n = len(sched)
            if self._deferred is not None and self._deferred.sample is sample:
                self.launch_sampling()  # no step was launched after it: it samples now
            if pending is not None and one_each and not failed:  # a decode step: one token each
                so = self.sampler.finish(pending)
                res = ModelRunnerOutput([[t] for t in so.token_ids], [[lp] for lp in so.logprobs],
                                        [[] for _ in range(n)])
            else:
                res = ModelRunnerOutput.empty(n)
                if pending is not None:
                    so = self.sampler.finish(pending)
                    for k, i in enumerate(sample_of):
                        if i not in failed:
                            res.sampled_token_ids[i].append(so.token_ids[k])
                            res.logprobs[i].append(so.logprobs[k])
            res.failed = failed
            res.kv_scores = {i: t.cpu() for i, t in kv_scores.items()}
            for i, toks, lps in (self._verify_all(sched, verifying, verify_logits) if verifying else ()):
                if isinstance(toks, Exception):  # this request's fault, unless the device's
                    if is_device_fault(toks):
                        raise toks
                    failed[i] = toks
                else:
                    res.sampled_token_ids[i], res.logprobs[i] = toks, lps
            for i in prompt_lp:
                if i not in failed:
                    s = sched[i]
                    try:
                        res.prompt_logprobs[i] = prompt_logprobs(self._logits, s.request, s, hidden, query_start[i])
                    except Exception as e:  # noqa: BLE001 - this request's fault, unless the device's
                        if is_device_fault(e):
                            raise
                        failed[i] = e
                        res.sampled_token_ids[i], res.logprobs[i] = [], []
            if self.gpu_timer is not None:
                self.gpu_timer.collect()
            return res
        if self.tiers is None or not out.writes:
            return finish
        # Write-through: the blocks this step filled, copied out behind its work on the stream
        # (no wait here); the writer gets them once the step is done.
        self.tiers.offload(kv.data, out.writes, defer=True)
        self.tiers.stats.written_through += len(out.writes)

        def finish_and_write() -> ModelRunnerOutput:
            try:
                res = finish()
            except BaseException:
                self.tiers.commit(ok=False)
                raise
            self.tiers.commit()
            return res
        return finish_and_write

    def _score_specs(self, sched) -> list | None:
        """Scored KV eviction: per sequence with a budget, its kept (non-NULL) table indices, the
        (first, end) positions of the queries whose attention it records and the [keys] float32
        accumulator (None: nothing recorded, e.g. a SnapKV decode step); None for a sequence
        without one. (The device's block tables hold no NULLs: they read as block 0.)"""
        policy = self.config.cache.kv_eviction
        if policy not in SCORED:
            return None
        out = []
        for s in sched:
            r = s.request
            if r.params.kv_budget is None:
                out.append(None)
                continue
            c = r.num_computed_tokens
            lo, hi = score_rows(policy, c, s.num_new_tokens, r.num_prompt_tokens)
            acc = torch.zeros(c + s.num_new_tokens, device=self.device) if lo < hi else None
            kept = torch.tensor([i for i, b in enumerate(s.block_table) if b != NULL])
            out.append((kept.to(self.device, non_blocking=True), lo, hi, acc))
        return out

    def _forward(self, ids: list[int], seqs, res_slots: list[int] | None = None,
                 patch: tuple[torch.Tensor, torch.Tensor] | None = None,
                 rows: bool | None = None, model=None,
                 group_seqs: list | None = None,
                 kv_budgets: list[int | None] | None = None,
                 kv_scored: list | None = None) -> tuple[torch.Tensor, list[int]]:
        """The model over the step's tokens: a captured graph for a decode step that fits one,
        else eagerly. A step of a few tokens per sequence (a verify step) runs as a decode step
        of one row per token (``decode_rows.py``) where ``KernelConfig.decode_rows`` says so;
        ``rows`` overrides that choice (True: as rows where the cache format allows it).
        ``patch``: (rows, ids) on the device replacing pending input tokens. ``model``: (model,
        KV layers, graphs or None) run instead of the target's, on its device and backend (the
        draft model's steps). ``group_seqs``: ``seqs`` with the tables of KV groups 1, 2, ...
        (sliding-window models; always eager, never as rows). ``kv_budgets``: per sequence, its
        eviction budget (always eager, never as rows); ``kv_scored``: ``_score_specs``'s.
        Returns hidden states [T, hidden], one per token in order either way, and the
        sequences' query offsets."""
        net, kv_layers, g = model if model is not None else (self.model, self.kv_cache.layers, self.graphs)
        width = max(len(t) for _, _, t in seqs)
        mode = self.config.kernel.decode_rows
        as_rows = (res_slots is None and not group_seqs and not kv_budgets
                   and (mode != "never" if rows is None else rows) and decode_rows.eligible(seqs))
        if (g is not None and not group_seqs and not kv_budgets and (len(ids) == len(seqs) or as_rows)
                and g.fits(len(ids), width, as_rows)):
            positions, slots, seq_lens, query_start, tables = self._host_metadata(seqs)
            row_lens, row_tables = seq_lens, tables
            if as_rows:
                row_lens, _, row_tables = decode_rows.expand(positions, query_start, tables)
            res = None
            if res_slots is not None:
                res = (np.asarray(res_slots, dtype=np.int64),
                       self._residual_metadata(positions, seq_lens, query_start, res_slots)[0])
            args = (np.asarray(ids, dtype=np.int64), positions, slots, row_lens, row_tables, res, patch)
            cap = self.graph_capture if model is None else None  # a draft's graphs are all captured
            if cap is not None and not cap.ready(key := g.key(len(ids), as_rows)):
                hidden = g.run(*args, rows=as_rows, replay=False)  # not captured yet: its warm-up
                cap.ran_eagerly(key)
            else:
                hidden = g.run(*args, rows=as_rows)
            return hidden, query_start.tolist()
        # Eagerly as rows only where asked for (rows or "always"): past the graphs' sizes the
        # prefill kernel, which reads each context once, is the better choice.
        as_rows = as_rows and (rows is True or (rows is None and mode == "always"))
        meta, positions = self._build_metadata(seqs, res_slots, rows=as_rows, kv_budgets=kv_budgets)
        meta.kv_scored = kv_scored
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        if patch is not None:
            input_ids[patch[0]] = patch[1]
        layer_attn = None
        if group_seqs:
            # Under a kv_budget every global group evicts what group 0 does (``kv_evict.py``):
            # the same budgets, kept blocks and score accumulators; local groups keep their window.
            metas = [meta]
            for g, gs in enumerate(group_seqs, 1):
                glob = self.kv_groups.windows[g] is None
                metas.append(self._build_metadata(gs, kv_budgets=kv_budgets if glob else None)[0])
                metas[-1].kv_scored = kv_scored if glob else None
            layer_attn = [metas[i] for i in self.kv_groups.layer_group]
        if model is None and self.compiled is not None:
            net = self.compiled
        with forward_context(ForwardContext(meta, kv_layers, self.backend, layer_attn)):
            hidden = net(input_ids, positions)
        if as_rows:
            return hidden, np.cumsum([0] + [n for _, n, _ in seqs]).tolist()
        return hidden, meta.query_start

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head, under the backend's kernel choices (its skinny-GEMM row limit, PDL)."""
        self._share_rows(hidden)
        with forward_context(ForwardContext(None, [], self.backend)), self._tp_guard():
            return self.model.compute_logits(hidden)

    def _apply_kv_ops(self, swap_out: dict[str, list[int]], copies: list[tuple[int, int]],
                      swap_in: dict[str, list[int]], preempted: list[str]) -> None:
        """The step's KV moves, before its forward writes anything."""
        kv = self.kv_cache
        for rid, blocks in swap_out.items():
            kv.swap_out(rid, blocks)
        if copies:
            kv.copy_blocks(copies)
        for rid, blocks in swap_in.items():
            kv.swap_in(rid, blocks)
        for rid in preempted:  # recomputed from scratch (or a block boundary) when resumed
            kv.release(rid)

    def drop_request(self, request_id: str) -> None:
        if self.kv_cache is not None:
            self._mirror("drop_request", request_id)
            self.kv_cache.drop(request_id)

"""ModelRunner: owns the model and the KV cache tensors; turns a SchedulerOutput into tokens."""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from kvserve import kernels, structured
from kvserve.config import EngineConfig
from kvserve.engine import kv_plan
from kvserve.engine.device import DTYPES, GpuTimer, default_dtype, resolve_device
from kvserve.engine.faults import is_device_fault
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.request import PENDING_TOKEN
from kvserve.engine.sampler import Sampler
from kvserve.engine.sampling_rows import PLACEHOLDER_ROW, prompt_logprobs, sample_one_by_one, sampling_row
from kvserve.engine.spec import rejection
from kvserve.engine.step import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from kvserve.layers.attention import AttentionMetadata, ForwardContext, forward_context, get_backend
from kvserve.layers.quant_linear import quantize_model
from kvserve.models import loader

log = logging.getLogger(__name__)



class ModelRunner:
    def __init__(self, config: EngineConfig, src: loader.ModelSource, max_model_len: int):
        self.device = resolve_device(config.device)
        if config.async_scheduling is None:
            # Speculative decoding needs each step's accepted tokens before the next is scheduled.
            config = dataclasses.replace(config, async_scheduling=self.device.type == "cuda"
                                         and config.speculative is None)
        self.config = config
        if config.dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = DTYPES[config.dtype]
        self.arch = src.arch
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        cache = config.cache
        name = config.attention_backend
        if name == "auto":
            name = "triton" if self.device.type == "cuda" and kernels.has_triton() else "torch"
        self.backend_name = name
        self.kv_scales = kv_plan.load_scales(config, src, self.device)
        self.kv_format = kv_plan.make_format(cache, src.arch, self.dtype, self.device, self.kv_scales)
        if config.quantization is not None and src.quant_method is not None:
            from kvserve.errors import ConfigError
            raise ConfigError("quantization", f"{src.name} is already quantized (quantization_config: "
                              f"{src.quant_method}); only unquantized weights are quantized at load")
        t0 = time.perf_counter()
        with default_dtype(self.dtype), torch.device(self.device):
            self.model = loader.build_model(src.arch, max_positions=max_model_len)
        if src.kind == "dummy":
            loader.init_dummy_weights(self.model, config.seed)
        else:
            weights = loader.iter_weights(src)
            if config.show_progress:
                from tqdm import tqdm
                weights = tqdm(weights, total=loader.count_weights(src), desc="Loading weights",
                               unit="tensor", leave=False)
            with torch.no_grad():
                self.model.load_weights(weights)
        self.model.eval()
        if config.quantization is not None:
            quantize_model(self.model, config.quantization)
        self.load_time = time.perf_counter() - t0
        name = self.backend_name
        if name == "triton" and self.device.type != "cuda" and not kernels.interpreting():
            from kvserve.errors import ConfigError
            raise ConfigError("attention_backend", f"'triton' needs a CUDA device (or TRITON_INTERPRET=1 for "
                              f"tests), got {self.device}; use torch or auto")
        self.backend = get_backend(name, config.kernel)
        self.sampler = Sampler(self.device, config.seed, copy_ahead=config.async_scheduling)
        self.kv_cache: KVCache | None = None
        self.graphs = None  # DecodeGraphs, captured after the KV cache exists
        self._sampled = None  # (sampled ids on the device, scheduled, row -> scheduled index) of the last step
        self.tiers = None  # kvserve.kvtier.TierConnector, set by the engine when tiers are on
        self.gpu_timer: GpuTimer | None = None  # set by benchmarks: device time of the steps
        self._bitmask: structured.BitmaskFiller | None = None  # made on the first constrained step
        # Draws of unseeded requests' draft verification (seeded ones use their own generators).
        self._spec_generator = torch.Generator().manual_seed(config.seed)

    # -- KV cache ----------------------------------------------------------------------------
    def determine_kv_memory(self) -> int:
        cache = self.config.cache
        if cache.kv_cache_memory is not None:
            return cache.kv_cache_memory
        if self.device.type != "cuda":
            return cache.cpu_default_kv_memory
        return self._profile_cuda_kv_memory()

    def _profile_cuda_kv_memory(self) -> int:
        """Free memory after a forward at the largest batch the scheduler can form, times the
        utilisation fraction, minus what the profiling run showed is needed besides KV."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n_tokens = self.config.scheduler.max_num_batched_tokens
        n_seqs = min(self.config.scheduler.max_num_seqs, n_tokens)
        sizes = [n_tokens // n_seqs + (1 if i < n_tokens % n_seqs else 0) for i in range(n_seqs)]
        per = -(-(max(sizes) + 1) // self.block_size)
        tmp = KVCache(self.arch, n_seqs * per, self.block_size, self.dtype, self.device)
        seqs = [(0, s, list(range(i * per, (i + 1) * per))) for i, s in enumerate(sizes)]
        ids = torch.zeros(n_tokens, dtype=torch.long, device=self.device)
        meta, positions = self._build_metadata(seqs)
        with torch.inference_mode(), forward_context(ForwardContext(meta, tmp.layers, self.backend)):
            hidden = self.model(ids, positions)
            self._logits(hidden[-n_seqs:])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        del tmp
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_allocated(self.device)
        budget = total * self.config.cache.gpu_memory_utilization - used_by_others - peak
        if budget <= self.arch.num_layers * self.kv_format.block_bytes:
            raise RuntimeError(f"no GPU memory left for the KV cache (peak {peak / 2**30:.2f} GiB, "
                               f"total {total / 2**30:.2f} GiB); lower max_num_batched_tokens or set kv_cache_memory")
        return int(budget)

    @torch.inference_mode()
    def hidden_states(self, token_ids: list[int]) -> torch.Tensor:
        """The final hidden states [T, H] of one prompt, for embeddings: an eager forward with a
        scratch KV cache of the prompt's size, so the paged pool and the batch are untouched."""
        n = len(token_ids)
        num_blocks = -(-n // self.block_size)
        scratch = KVCache(self.arch, num_blocks, self.block_size, self.dtype, self.device)
        meta, positions = self._build_metadata([(0, n, list(range(num_blocks)))])
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        with forward_context(ForwardContext(meta, scratch.layers, self.backend)):
            return self.model(ids, positions)

    def allocate_kv_cache(self, plan: kv_plan.KVPlan) -> None:
        self.kv_cache = KVCache(self.arch, plan.num_blocks, self.block_size, self.dtype, self.device,
                                plan.swap_blocks, fmt=plan.fmt, residual_slots=plan.residual_rows, scales=plan.scales)
        if self.device.type == "cuda" and self.backend.name == "triton":
            self._warm_sdpa()
            if not self.config.enforce_eager:
                self.capture_graphs()

    def _warm_sdpa(self) -> None:
        """The first SDPA call initialises cuDNN (measured 1.7 s on an H200): pay it at start-up,
        not in the first request's time to first token."""
        from kvserve.layers.triton_attention import _sdpa_causal
        a = self.arch
        q = torch.randn(64, a.num_heads, a.head_dim, device=self.device, dtype=self.dtype)
        kv = torch.randn(64, a.num_kv_heads, a.head_dim, device=self.device, dtype=self.dtype)
        _sdpa_causal(q, kv, kv, a.head_dim ** -0.5)
        torch.cuda.synchronize(self.device)

    def capture_graphs(self) -> None:
        from kvserve.engine.cuda_graphs import DecodeGraphs
        max_batch = self.config.cuda_graph_max_batch or min(512, self.config.scheduler.max_num_seqs)
        max_blocks = -(-self.max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv_cache.layers, self.backend, self.device, max_batch,
                                   max_blocks, self.block_size, self.arch.num_kv_heads,
                                   kivi=self.kv_format.kivi,
                                   kv_format=self.kv_format,
                                   async_copies=self.config.async_scheduling)
        self.graphs.capture()
        msg = (f"CUDA graphs: {len(self.graphs.buckets)} decode batch sizes up to {max_batch} captured in "
               f"{self.graphs.capture_seconds:.1f} s, {self.graphs.memory_bytes / 2**20:.0f} MiB")
        log.info(msg)
        if self.config.show_progress:
            print(msg, flush=True)

    # -- one step -------------------------------------------------------------------------
    def _host_metadata(self, seqs: list[tuple[int, int, list[int]]]):
        """seqs: (num_computed, num_new, block_table) per sequence, in batch order. Returns numpy
        arrays: positions, slots, seq_lens, query_start, tables [B, max_blocks] int32."""
        bs = self.block_size
        B = len(seqs)
        qlens = np.fromiter((n for _, n, _ in seqs), dtype=np.int64, count=B)
        starts = np.fromiter((c for c, _, _ in seqs), dtype=np.int64, count=B)
        width = max(len(t) for _, _, t in seqs)
        tables = np.zeros((B, width), dtype=np.int32)
        for i, (_, _, t) in enumerate(seqs):
            tables[i, :len(t)] = t
        query_start = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(qlens, out=query_start[1:])
        row = np.repeat(np.arange(B), qlens)
        positions = starts[row] + (np.arange(int(query_start[-1])) - query_start[row])
        slots = tables[row, positions // bs].astype(np.int64) * bs + positions % bs
        return positions, slots, starts + qlens, query_start, tables

    def _residual_metadata(self, positions: np.ndarray, seq_lens: np.ndarray, query_start: np.ndarray,
                           res_slots: list[int]) -> tuple[np.ndarray, int]:
        """KIVI: each token's place in its sequence's residual row (-1 if its block fills this
        step and is sealed), and the most blocks one sequence fills."""
        bs = self.block_size
        qlens = np.diff(query_start)
        row = np.repeat(np.arange(len(seq_lens)), qlens)
        full_end = (seq_lens // bs * bs)[row]
        slots = np.asarray(res_slots, dtype=np.int64)[row]
        res_map = np.where(positions >= full_end, slots * bs + positions % bs, -1)
        max_seal = int((seq_lens // bs - (seq_lens - qlens) // bs).max()) if len(seq_lens) else 0
        return res_map, max_seal

    def fork_request(self, parent_id: str, child_id: str) -> None:
        """A forked child shares its parent's unsealed last block, so it gets a copy of the
        parent's residual row."""
        self.kv_cache.fork(parent_id, child_id)

    def _build_metadata(self, seqs: list[tuple[int, int, list[int]]], res_slots: list[int] | None = None):
        positions, slots, seq_lens, query_start, tables = self._host_metadata(seqs)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(tables).to(dev, non_blocking=True),
            seq_lens=seq_lens.tolist(), query_lens=[n for _, n, _ in seqs],
            query_start=query_start.tolist(), block_size=self.block_size)
        if res_slots is not None:
            res_map, meta.max_seal = self._residual_metadata(positions, seq_lens, query_start, res_slots)
            meta.res_slots = res_slots
            meta.res_mapping = torch.from_numpy(res_map).to(dev, non_blocking=True)
        self.backend.prepare(meta, dev)
        return meta, torch.from_numpy(positions).to(dev, non_blocking=True)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run the step and return what each scheduled request got."""
        return self.launch(out)()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Queue the step's GPU work and return a callable that waits for it and returns its
        ``ModelRunnerOutput``. Between the two the host is free (the engine does its
        bookkeeping there while the device computes)."""
        kv = self.kv_cache
        if self.tiers is not None:
            # Before the step writes anything: evicted blocks leave first (a load or a new
            # token may be about to overwrite them), then loaded chunks fill their blocks.
            self.tiers.offload(kv.data, out.offloads)
            self.tiers.stats.offloaded_blocks += len(out.offloads)
            self.tiers.load(kv.data, out.loads)
        for rid, blocks in out.swap_out.items():
            kv.swap_out(rid, blocks)
        if out.copies:
            kv.copy_blocks(out.copies)
        for rid, blocks in out.swap_in.items():
            kv.swap_in(rid, blocks)
        for rid in out.preempted:  # recomputed from scratch (or a block boundary) when resumed
            kv.release(rid)
        sched = out.scheduled
        ids: list[int] = []
        pending_rows, pending_src = [], []  # async scheduling: input tokens sampled by the step in flight
        for s in sched:
            r = s.request
            n_known = s.num_new_tokens - len(s.draft_token_ids)
            ids.extend(r.all_token_ids[r.num_computed_tokens:r.num_computed_tokens + n_known])
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
        if self.gpu_timer is not None:
            self.gpu_timer.start()
        res_slots = kv.residual_rows([s.request.request_id for s in sched]) if self.kv_format.kivi else None
        hidden, query_start = self._forward(ids, seqs, res_slots, patch)

        # Rows to turn into logits: the last token of each sampling request, and every
        # position of a request that asked for prompt log-probs.
        sample_rows, rows, sample_of = [], [], []
        failed: dict[int, BaseException] = {}  # scheduled index -> its own fault (see faults.py)
        seeded: list[tuple[torch.Generator, torch.Tensor]] = []  # states before this step's draws
        grammar_rows, grammars = [], []  # rows under a grammar and their matchers
        verifying: list[int] = []  # requests with drafts: all their k + 1 positions are verified
        for i, s in enumerate(sched):
            if s.samples and s.draft_token_ids:
                verifying.append(i)
            elif s.samples:
                r = s.request
                n_draws = r.pending_forks + 1
                try:
                    mine = [sampling_row(r, j) for j in range(n_draws)]
                    seeded.extend((w.generator, w.generator.get_state()) for w in mine if w.generator is not None)
                except Exception as e:  # noqa: BLE001 - this request's fault, unless the device's
                    if is_device_fault(e):
                        raise
                    failed[i] = e
                    mine = [PLACEHOLDER_ROW] * n_draws
                for row in mine:
                    if r.grammar is not None:  # forks draw their first token from the parent's state
                        grammar_rows.append(len(rows))
                        grammars.append(r.grammar)
                    sample_rows.append(query_start[i + 1] - 1)
                    rows.append(row)
                    sample_of.append(i)
        pending = None
        if sample_rows:
            if len(sample_rows) == hidden.shape[0] and sample_rows == list(range(len(sample_rows))):
                picked = hidden  # every row sampled once, in order (a decode step)
            else:
                picked = hidden[torch.tensor(sample_rows).to(self.device, non_blocking=True)]
            logits = self._logits(picked)
            bitmask = None
            if grammar_rows:
                # The device is busy with the forward: the host fills the grammar's mask meanwhile.
                if self._bitmask is None:
                    self._bitmask = structured.BitmaskFiller(self.arch.vocab_size, self.device)
                mask = self._bitmask(len(rows), grammar_rows, grammars)
                bitmask = (mask.to(self.device, non_blocking=True), grammar_rows)
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
        else:
            self._sampled = None
        verify_logits = self._verify_logits(hidden, query_start, sched, verifying) if verifying else []
        if self.gpu_timer is not None:
            self.gpu_timer.stop()

        @torch.inference_mode()
        def finish() -> ModelRunnerOutput:
            res = ModelRunnerOutput.empty(len(sched))
            res.failed = failed
            if pending is not None:
                so = self.sampler.finish(pending)
                for k, i in enumerate(sample_of):
                    if i not in failed:
                        res.sampled_token_ids[i].append(so.token_ids[k])
                        res.logprobs[i].append(so.logprobs[k])
            for i, logits in zip(verifying, verify_logits):
                try:
                    res.sampled_token_ids[i], res.logprobs[i] = self._verify(sched[i], logits)
                except Exception as e:  # noqa: BLE001 - this request's fault, unless the device's
                    if is_device_fault(e):
                        raise
                    failed[i] = e
            for i, s in enumerate(sched):
                r = s.request
                if r.wants_prompt_logprobs and r.num_computed_tokens < r.num_prompt_tokens and i not in failed:
                    try:
                        res.prompt_logprobs[i] = prompt_logprobs(self._logits, r, s, hidden, query_start[i])
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

    def _verify_logits(self, hidden: torch.Tensor, query_start: list[int], sched: list[ScheduledRequest],
                       verifying: list[int]) -> list[torch.Tensor]:
        """The logits at every position of each request with drafts (its last known token and
        its drafts), in one LM-head product; one [k + 1, vocab] tensor per request."""
        idx, sizes = [], []
        for i in verifying:
            end = query_start[i + 1]
            n = len(sched[i].draft_token_ids) + 1
            idx.extend(range(end - n, end))
            sizes.append(n)
        logits = self._logits(hidden[torch.tensor(idx).to(self.device, non_blocking=True)])
        return list(logits.split(sizes))

    def _verify(self, s: ScheduledRequest, logits: torch.Tensor):
        """One request's tokens (accepted drafts + the target's) and their log-probs, if asked."""
        r, drafts = s.request, s.draft_token_ids
        rows = [sampling_row(r, 0, drafts[:j]) for j in range(len(drafts) + 1)]
        processed = rejection.processed_logits(logits, rows)
        gen = r.generator if r.generator is not None else self._spec_generator
        toks = rejection.verify_request(processed, rows[0], drafts, r.spec_draft_probs, gen)
        n_lp = r.params.logprobs
        if n_lp is None:
            return toks, [None] * len(toks)
        raw = logits.float().log_softmax(dim=-1)
        return toks, [rejection.logprob_entry(raw[j], t, n_lp) for j, t in enumerate(toks)]

    def _forward(self, ids: list[int], seqs, res_slots: list[int] | None = None,
                 patch: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, list[int]]:
        """The model over the step's tokens: a captured graph for a decode step that fits one,
        else eagerly. ``patch``: (rows, ids) on the device replacing pending input tokens.
        Returns hidden states [T, hidden] and the query offsets."""
        g = self.graphs
        if g is not None and len(ids) == len(seqs) and g.fits(len(seqs), max(len(t) for _, _, t in seqs)):
            positions, slots, seq_lens, query_start, tables = self._host_metadata(seqs)
            res = None
            if res_slots is not None:
                res = (np.asarray(res_slots, dtype=np.int64),
                       self._residual_metadata(positions, seq_lens, query_start, res_slots)[0])
            hidden = g.run(np.asarray(ids, dtype=np.int64), positions, slots, seq_lens, tables, res, patch)
            return hidden, query_start.tolist()
        meta, positions = self._build_metadata(seqs, res_slots)
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
        if patch is not None:
            input_ids[patch[0]] = patch[1]
        with forward_context(ForwardContext(meta, self.kv_cache.layers, self.backend)):
            hidden = self.model(input_ids, positions)
        return hidden, meta.query_start

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head, under the backend's kernel choices (its skinny-GEMM row limit, PDL)."""
        with forward_context(ForwardContext(None, [], self.backend)):
            return self.model.compute_logits(hidden)

    def drop_request(self, request_id: str) -> None:
        if self.kv_cache is not None:
            self.kv_cache.drop(request_id)

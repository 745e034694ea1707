"""CUDA start-up of a ModelRunner: the KV memory left after a profiling forward, cuDNN's
first call, and the decode CUDA graphs."""
from __future__ import annotations

import logging

import torch

from kvserve.engine import decode_rows
from kvserve.engine.faults import is_device_fault
from kvserve.engine.kv_cache import KVCache
from kvserve.layers.attention import ForwardContext, forward_context
from kvserve.progress import progress

log = logging.getLogger("kvserve.engine.model_runner")


def _ends_the_engine(e: BaseException) -> bool:
    """A failed capture that the engine cannot serve on from (a CUDA error); out of memory only
    leaves that batch size eager."""
    return is_device_fault(e) and not isinstance(e, torch.OutOfMemoryError)


class CudaSetup:
    """ModelRunner's CUDA start-up (the runner holds the model, config, KV cache and backend)."""

    def _profile_cuda_kv_memory(self) -> int:
        """Free memory after a forward at the largest batch the scheduler can form, times the
        utilisation fraction, minus what the profiling run showed is needed besides KV. A
        snapshot written with the same step shape and backend keeps that run's peak, so the
        forward is skipped and only today's free memory is read."""
        torch.cuda.empty_cache()
        n_tokens = self.config.scheduler.max_num_batched_tokens
        n_seqs = min(self.config.scheduler.max_num_seqs, n_tokens)
        key = {"max_num_batched_tokens": n_tokens, "max_num_seqs": n_seqs, "backend": self.backend_name,
               "kv_cache_dtype": self.config.cache.kv_cache_dtype, "block_size": self.block_size}
        stored = self.src.handle.get("profile") if self.src.kind == "snapshot" else None
        if stored is not None and stored.get("key") == key:
            peak = stored["peak_bytes"]
        else:
            peak = self._profile_peak(n_tokens, n_seqs)
        self.kv_profile = {"key": key, "peak_bytes": peak}
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others = total - free - torch.cuda.memory_allocated(self.device)
        budget = total * self.config.cache.gpu_memory_utilization - used_by_others - peak
        if budget <= self.arch.num_layers * self.kv_format.block_bytes:
            raise RuntimeError(f"no GPU memory left for the KV cache (peak {peak / 2**30:.2f} GiB, "
                               f"total {total / 2**30:.2f} GiB); lower max_num_batched_tokens or set kv_cache_memory")
        return int(budget)

    def _profile_peak(self, n_tokens: int, n_seqs: int) -> int:
        """Peak allocated bytes of a forward over ``n_tokens`` tokens in ``n_seqs`` sequences."""
        torch.cuda.reset_peak_memory_stats(self.device)
        sizes = [n_tokens // n_seqs + (1 if i < n_tokens % n_seqs else 0) for i in range(n_seqs)]
        per = -(-(max(sizes) + 1) // self.block_size)
        tmp = KVCache(self.arch, n_seqs * per, self.block_size, self.dtype, self.device)
        seqs = [(0, s, list(range(i * per, (i + 1) * per))) for i, s in enumerate(sizes)]
        ids = torch.zeros(n_tokens, dtype=torch.long, device=self.device)
        meta, positions = self._build_metadata(seqs)
        with torch.inference_mode(), forward_context(ForwardContext(meta, tmp.layers, self.backend)):
            hidden = self.model(ids, positions)
            self.model.compute_logits(hidden[-n_seqs:])  # every tensor-parallel rank runs this forward
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device)
        del tmp
        torch.cuda.empty_cache()
        return peak

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
        sched, spec = self.config.scheduler, self.config.speculative
        rows = sched.max_num_seqs
        if spec is not None and self.config.kernel.decode_rows != "never":
            # Verify steps replay these graphs by rows (decode_rows.py): room for the largest.
            rows = max(rows, decode_rows.max_verify_rows(spec, sched.max_num_seqs, sched.max_num_batched_tokens))
        max_batch = self.config.cuda_graph_max_batch or min(512, rows)
        max_blocks = -(-self.max_model_len // self.block_size)
        self.graphs = DecodeGraphs(self.model, self.kv_cache.layers, self.backend, self.device, max_batch,
                                   max_blocks, self.block_size, self.arch.num_kv_heads,
                                   kivi=self.kv_format.kivi,
                                   kv_format=self.kv_format,
                                   async_copies=self.config.async_scheduling,
                                   rows=spec is not None and self.config.kernel.decode_rows != "never")
        self.arm_graphs(self.graphs)
        if self.config.cuda_graph_capture != "startup":
            return
        also = " (and for verify rows)" if len(self.graphs.row_variants) > 1 else ""
        msg = (f"CUDA graphs: {len(self.graphs.buckets)} decode batch sizes up to {max_batch}{also} captured in "
               f"{self.graphs.capture_seconds:.1f} s, {self.graphs.memory_bytes / 2**20:.0f} MiB")
        log.info(msg)
        if self.config.show_progress:
            print(msg, flush=True)

    def arm_graphs(self, capturer) -> None:
        """The capture plan over ``capturer``'s graphs (``engine/graph_capture.py``); in startup
        mode every graph is captured here."""
        from kvserve.engine.graph_capture import GraphCapture
        self.graph_capture = GraphCapture(self.config.cuda_graph_capture, capturer, _ends_the_engine)
        self.graph_capture.start(lambda keys: progress(self.config.show_progress, "Capturing CUDA graphs", "graph",
                                                      keys))

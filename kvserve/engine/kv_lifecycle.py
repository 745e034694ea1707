"""The runner's KV pool over an engine's life: sized, allocated with its device preparation
(cuDNN's first call, the decode graphs), released at sleep and restored at wake; and the decode
graphs captured between steps (``engine/graph_capture.py``)."""
from __future__ import annotations

import dataclasses
import logging
import time

from kvserve.engine import eager_warmup, kv_plan
from kvserve.engine.kv_cache import KVCache
from kvserve.engine.startup import timed

log = logging.getLogger("kvserve.engine.model_runner")


class KVLifecycle:
    """Mixed into ModelRunner, whose attributes these are."""

    def use_cache_config(self, cache) -> None:
        """Take a changed ``CacheConfig`` (``kv_policy`` auto) before the KV cache exists: its
        block size, scales and format."""
        self.config = dataclasses.replace(self.config, cache=cache)
        self.block_size = cache.block_size
        self.kv_scales = self._local_scales(kv_plan.load_scales(self.config, self.src, self.device))
        self.kv_format = kv_plan.make_format(cache, self.arch, self.dtype, self.device, self.kv_scales)

    def determine_kv_memory(self) -> int:
        cache = self.config.cache
        if cache.kv_cache_memory is not None:
            return cache.kv_cache_memory
        if self.device.type != "cuda":
            return cache.cpu_default_kv_memory
        self._mirror("_profile_cuda_kv_memory")
        with self._tp_guard():
            return self._profile_cuda_kv_memory()

    def allocate_kv_cache(self, plan: kv_plan.KVPlan) -> None:
        self._mirror("_worker_allocate", self.config, dataclasses.replace(plan, scales=None))
        self._kv_plan = plan
        with timed(self.startup_seconds, "kv_cache"):
            self.kv_cache = KVCache(self.arch, plan.num_blocks, self.block_size, self.dtype, self.device,
                                    plan.swap_blocks, fmt=plan.fmt, residual_slots=plan.residual_rows,
                                    scales=plan.scales, groups=plan.groups, alloc=self.kv_alloc)
        self.kv_groups = plan.groups
        if self.sleep_mode is None or self.sleep_mode.weights_awake:
            self.prepare_device()

    def prepare_device(self) -> None:
        """CUDA: cuDNN's first call and the decode graphs, once weights and KV pool are in place;
        the CPU: the compiled model, where it applies (engine/cpu_compile.py)."""
        plan = self._kv_plan
        if self.device.type == "cpu" and self.config.kernel.cpu_compile is not False and self.compiled is None:
            from kvserve.engine.cpu_compile import compile_decode
            with timed(self.startup_seconds, "cpu_compile"):
                self.compiled = compile_decode(self)
        if self.device.type == "cuda" and self.backend.name == "triton":
            with timed(self.startup_seconds, "sdpa_warmup"):
                self._warm_sdpa()
            # The captured graphs hold one block table per sequence: several groups run eagerly.
            if not self.config.enforce_eager and (plan.groups is None or plan.groups.num_groups == 1):
                with timed(self.startup_seconds, "graphs"):
                    self.capture_graphs()
            # Once: at a wake the shapes are compiled already. Tensor-parallel ranks and KIVI
            # caches (residual rows) step differently; they compile at their first steps.
            if "eager_warmup" not in self.startup_seconds and self.tp is None and not self.kv_format.kivi:
                n = min(eager_warmup.blocks_needed(self.block_size), plan.num_blocks)
                with timed(self.startup_seconds, "eager_warmup"):
                    eager_warmup.warm_eager(self, list(range(plan.num_blocks - n, plan.num_blocks)),
                                            groups=plan.groups.num_groups if plan.groups is not None else 1)

    def release_kv_cache(self) -> None:
        """Sleep: the KV pool and the graphs that read it go (their memory with them)."""
        self.graphs = self.graph_capture = None
        self.kv_cache = None
        self._sampled = None

    def restore_kv_cache(self) -> None:
        """Wake: the pool of the same plan again, so the block manager's accounting holds."""
        self.allocate_kv_cache(self._kv_plan)

    @property
    def capture_due(self) -> bool:
        """A graph waits to be captured after the step that warmed it: launch nothing ahead."""
        return self.graph_capture is not None and self.graph_capture.due

    def capture_graph(self, idle: bool) -> bool:
        """Capture the one graph the plan names now (nothing may be in flight on the device).
        Returns whether one was captured."""
        cap = self.graph_capture
        if cap is None or not (idle or cap.due):  # the common case, on every step: nothing to do
            return False
        t0 = time.perf_counter()
        key = cap.capture_next(idle)
        if key is not None:
            log.debug("CUDA graph %s captured in %.3f s (%s)", key, time.perf_counter() - t0,
                      "idle" if idle else "after its first step")
            if cap.complete:
                g = self.graphs
                log.info("CUDA graphs: all %d captured (%.1f s, %.0f MiB)", len(cap.captured),
                         g.capture_seconds, g.memory_bytes / 2**20)
        return key is not None

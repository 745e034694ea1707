"""An engine's start-up: the settings a snapshot brings, the tokenizer loaded beside the weights,
and where the seconds go.

``LLMEngine.startup_seconds`` holds one entry per phase (logged once at INFO when the engine is
ready):

    tokenizer     transformers' tokenizer, on its own thread while the weights load
    device_warmup CUDA: Triton's runtime, cuBLAS and cuDNN brought up and the kernel modules
                  imported, on their own thread while the weights load (``warm_device``)
    triton_key    CUDA: Triton's hash of its compiler, on a third thread (``triton_compiler_key``)
    build         the model's modules allocated (no random initialisation when every weight is
                  loaded next: ``layers/weight_init.py``)
    weights       the weights read (and converted, quantized) into them
    kv_profile    CUDA: the profiling forward that sizes the KV pool (a snapshot's stored peak
                  skips it: then only the free memory is read)
    kv_cache      the KV pool allocated
    sdpa_warmup   CUDA: cuDNN's first call
    graphs        CUDA graphs captured at start-up (``cuda_graph_capture`` startup)
    eager_warmup  CUDA: the eager steps' kernels compiled (``engine/eager_warmup.py``)
    gc            the full collection before start-up's objects are frozen out of the collector's reach
    total         ``LLMEngine.__init__`` from first line to last

Phases sum to less than ``total`` (the tokenizer, the device warm-up and Triton's key overlap;
the rest is bookkeeping).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvserve.config import EngineConfig

log = logging.getLogger(__name__)


@contextmanager
def timed(into: dict[str, float], phase: str) -> Iterator[None]:
    """Add the block's wall time to ``into[phase]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        into[phase] = into.get(phase, 0.0) + time.perf_counter() - t0


def in_background(into: dict[str, float], phase: str, fn: Callable, *args) -> concurrent.futures.Future:
    """``fn(*args)`` on a thread of its own, timed as ``phase``; the thread ends with it."""
    def run():
        with timed(into, phase):
            return fn(*args)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvserve-{phase}")
    try:
        return pool.submit(run)
    finally:
        pool.shutdown(wait=False)


def triton_compiler_key() -> None:
    """Triton keys its kernel cache by a hash of its own compiler, computed once per process
    at the first kernel launch: about 400 MB of shared library read and hashed. The
    hash releases the GIL, so on a thread of its own from the start of loading it costs the
    device warm-up nothing; the function is Triton's, cached by it after the first call."""
    try:
        from triton.runtime.cache import triton_key
        triton_key()
    except Exception as e:  # best effort: no Triton, or one that keys its cache another way, pays at its first launch
        log.debug("Triton's compiler key was not computed ahead: %r", e)


def warm_device(device, dtype, arch, backend: str, compiler_key: concurrent.futures.Future | None = None) -> None:
    """What a process pays once before its first forward, paid while the weights load instead
    of in the first request's time to first token: Triton's runtime (the first kernel launch
    of a process loads its driver helpers and launcher), cuBLAS's libraries, cuDNN's
    initialisation, and the import of the attention kernels. Nothing here touches the model.
    The loading threads spend their time in reads, hashing and copies, which release the GIL.
    ``compiler_key``: ``triton_compiler_key`` running on its own thread, awaited before the
    first Triton launch (which would otherwise hash the compiler a second time)."""
    import torch
    torch.cuda.set_device(device)  # this thread's
    # No random numbers: the device generator may be another engine's, mid-capture of a graph.
    x = torch.full((16, arch.hidden_size), 0.01, device=device, dtype=dtype)
    (x @ x.T).sum()  # cuBLAS
    if backend == "triton":
        try:
            from kvserve.kernels.rmsnorm import rmsnorm
            from kvserve.layers.triton_attention import _sdpa_causal
        except ImportError:  # Triton is installed but does not import: the runner falls back to torch
            torch.cuda.synchronize(device)
            return
        if compiler_key is not None:
            compiler_key.result()
        rmsnorm(x, torch.ones(arch.hidden_size, device=device, dtype=dtype), 1e-6)
        q = torch.full((64, arch.num_heads, arch.head_dim), 0.01, device=device, dtype=dtype)
        kv = torch.full((64, arch.num_kv_heads, arch.head_dim), 0.01, device=device, dtype=dtype)
        _sdpa_causal(q, kv, kv, arch.head_dim ** -0.5)  # cuDNN
    torch.cuda.synchronize(device)


PHASES = ("tokenizer", "device_warmup", "triton_key", "build", "weights", "kv_profile", "kv_cache", "sdpa_warmup",
          "graphs", "eager_warmup", "gc", "total")


def ordered(seconds: dict[str, float]) -> dict[str, float]:
    """The phases in the order of the list above (the tokenizer's thread finishes when it may)."""
    return {k: seconds[k] for k in sorted(seconds, key=lambda k: PHASES.index(k) if k in PHASES else len(PHASES))}


def describe(seconds: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f} s" for k, v in seconds.items() if k != "total")


def snapshot_defaults(config: EngineConfig, manifest: dict) -> EngineConfig:
    """A snapshot's KV-cache dtype is the default of the engines it starts (an explicit one wins)."""
    kv = manifest.get("kv_cache_dtype", "auto")
    cache = config.cache
    if cache.kv_cache_dtype != "auto" or kv == "auto":
        return config
    from kvserve.kv_format import default_block_size
    block = None if cache.block_size == default_block_size("auto") else cache.block_size
    return dataclasses.replace(config, cache=dataclasses.replace(cache, kv_cache_dtype=kv, block_size=block))

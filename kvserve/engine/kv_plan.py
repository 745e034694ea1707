"""The KV cache's plan: its format and scales, how its memory splits, and the key of its contents.

    KV memory  =  num_blocks x block_bytes          (paged blocks, scales included; a block holds
                                                     the layers of one KV group's page)
               +  residual_rows x residual_bytes    (KIVI formats: one full-precision key block per
                                                     running sequence, at most a quarter of the memory)
    cache key  =  model | layers | dtype | weights fingerprint | format | scales

The cache key is what the prefix cache hashes every block under and what the tiers file chunks
under: the same tokens give the same KV only for the same weights and the same format, and the
tiers outlive the process. The plan is made once, before anything is allocated; ``KVCache``
(device tensors, swap space, residual rows) and ``KVCacheManager`` (block tables) are built from it.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os

import torch

from kvserve.config import CacheConfig, EngineConfig
from kvserve.engine.kv_groups import KVGroups, plan_groups
from kvserve.errors import ConfigError, InvalidRequestError
from kvserve.kv_format import FP8_MAX, INT8_MAX, KVFormat
from kvserve.models import loader

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class KVPlan:
    fmt: KVFormat
    scales: torch.Tensor | None  # calibrated fp8/int8 scales [layers, 2, kv_heads], or None
    num_layers: int  # layers one block holds (a KV group's page)
    num_blocks: int
    swap_blocks: int  # CPU swap space for preempted requests, in blocks
    residual_rows: int  # KIVI: rows of the key residual (running sequences + 1); else 0
    max_num_seqs: int  # the scheduler's limit, lowered where the residual does not fit more
    groups: KVGroups | None = None  # None: one group of every layer

    @property
    def block_bytes(self) -> int:
        """One block in every layer, scales included: what a block really costs."""
        return self.num_layers * self.fmt.block_bytes

    @property
    def fixed_bytes(self) -> int:
        """KV memory that is not blocks: the KIVI key residual."""
        return self.num_layers * self.fmt.residual_bytes(self.residual_rows)

    def describe(self) -> str:
        bs = self.fmt.block_size
        return (f"{self.num_blocks} blocks x {bs} tokens = {self.num_blocks * bs} tokens, "
                f"{self.num_blocks * self.block_bytes / 2**30:.3f} GiB, {self.fmt.describe()}")


def load_scales(config: EngineConfig, src: loader.ModelSource, device: torch.device) -> torch.Tensor | None:
    """Calibrated fp8/int8 scales (``kvserve calibrate-kv``), on the device, or None: the file
    named by ``kv_scales``, else the one beside the model if there is one; "off": none."""
    from kvserve import kv_scales
    cache = config.cache
    name, path = cache.kv_cache_dtype, cache.kv_scales
    if path == "off":
        return None
    if path is None:
        if name not in ("fp8", "int8"):
            return None
        path = kv_scales.default_path(config.model)
        if path is None or not os.path.exists(path):
            return None
    elif name not in ("fp8", "int8"):
        raise ConfigError("kv_scales", f"calibrated scales apply to kv_cache_dtype fp8 or int8, not {name!r}")
    amax = kv_scales.load(path, src, config.seed, src.arch.num_layers, src.arch.num_kv_heads)
    qmax = FP8_MAX if name == "fp8" else INT8_MAX
    log.info("KV cache: calibrated %s scales from %s", name, path)
    return (amax / qmax).clamp_min(1e-8).to(device)


def make_format(cache: CacheConfig, arch, dtype: torch.dtype, device: torch.device,
                scales: torch.Tensor | None) -> KVFormat:
    fmt = KVFormat(cache.kv_cache_dtype, arch.num_kv_heads, arch.head_dim, cache.block_size, dtype,
                   cache.kv_group_size, static=scales is not None)
    if fmt.name == "fp8" and device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            raise ConfigError("kv_cache_dtype", f"fp8 needs a GPU with FP8 conversions (compute capability "
                              f">= 8.9: Ada, Hopper or newer); this one is {cap[0]}.{cap[1]}; use int8")
    return fmt


def groups_for(config: EngineConfig, arch, fmt: KVFormat) -> KVGroups:
    """The model's KV groups under ``window_kv``. Freeing out-of-window blocks leaves holes in
    the block tables, which the KIVI key residual, a draft model reading the target's tables,
    CPU swap and the tiers (their chunks hold every layer of a block) do not follow: KIVI and
    speculative decoding keep one group, swap and the tiers are refused with ``window_kv=free``."""
    cache = config.cache
    free = cache.window_kv == "free" and not fmt.kivi and config.speculative is None
    groups = plan_groups(arch.layer_windows, arch.num_layers, free)
    if groups.windowed:
        if cache.preemption_mode == "swap":
            raise ConfigError("preemption_mode", "'swap' is not supported with window_kv 'free' on a model "
                              "with sliding-window layers; use 'recompute' or window_kv 'keep'")
        if cache.tiers_enabled:
            raise ConfigError("cpu_kv_memory/disk_kv_dir/redis_url", "the KV tiers are not supported with "
                              "window_kv 'free' on a model with sliding-window layers; use window_kv 'keep'")
    return groups


def plan(fmt: KVFormat, scales: torch.Tensor | None, num_layers: int, kv_bytes: int, cache: CacheConfig,
         max_num_seqs: int, residual_share: float = 0.25) -> KVPlan:
    """Split ``kv_bytes`` between the blocks and, for KIVI formats, the key residual (one row per
    running sequence, up to ``residual_share`` of the memory: fewer rows lower ``max_num_seqs``)."""
    rows = 0
    if fmt.kivi:
        row = num_layers * fmt.residual_bytes(1)
        rows = min(max_num_seqs + 1, max(2, int(kv_bytes * residual_share) // row))
        if rows - 1 < max_num_seqs:
            log.warning("%s KV cache: the full-precision key residual (one block per running sequence) fits "
                        "%d sequences in a quarter of the KV memory; max_num_seqs %d -> %d",
                        fmt.name, rows - 1, max_num_seqs, rows - 1)
            max_num_seqs = rows - 1
    p = KVPlan(fmt, scales, num_layers, 0, 0, rows, max_num_seqs)
    num_blocks = (kv_bytes - p.fixed_bytes) // p.block_bytes
    if num_blocks < 1:
        raise InvalidRequestError("kv_cache_memory", f"{kv_bytes} bytes is less than one KV block "
                                  f"({p.block_bytes} bytes at block_size {fmt.block_size}) plus "
                                  f"{p.fixed_bytes} bytes of KIVI key residual")
    swap = cache.swap_space // p.block_bytes if cache.preemption_mode == "swap" else 0
    return dataclasses.replace(p, num_blocks=num_blocks, swap_blocks=swap)


def cache_key(src: loader.ModelSource, dtype: torch.dtype, seed: int, fmt: KVFormat,
              scales: torch.Tensor | None, groups: KVGroups | None = None) -> bytes:
    """The prefix cache's and the tiers' key extra (see the module docstring)."""
    # A block of a group's page holds other layers than a block of every layer.
    groups_tag = "" if groups is None or groups.num_groups == 1 else f"|groups={groups.num_groups}x{groups.page_layers}"
    sid = ("dynamic" if scales is None
           else hashlib.blake2b(scales.float().cpu().numpy().tobytes(), digest_size=8).hexdigest())
    return (f"{src.name}|{src.arch.num_layers}|{dtype}|{loader.fingerprint(src, seed)}"
            f"{groups_tag}|kv={fmt.name}/{fmt.group}/{fmt.block_size}/{fmt.layout + '/' if fmt.layout else ''}"
            f"{sid}").encode()

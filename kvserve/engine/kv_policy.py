"""``kv_policy="auto"``: the KV levers chosen from the model and the pool, once at start.

The levers, cheapest in quality first:

  1. sliding-window freeing   a model with sliding-window layers frees their blocks out of the
                              window (``window_kv="free"``, ``kv_groups.py``): exact, on unless
                              swap or the tiers are (they cannot follow the freed blocks)
  2. compressed KV            the model dtype, else int8 (per-token scales), else int4 (KIVI),
                              the first whose pool holds the target (below), else the one that
                              holds the most; lossy, but slightly
  3. tiers                    used as configured (``cpu_kv_memory``, ``disk_kv_dir``,
                              ``redis_url``): a block leaving the pool is offloaded, not lost
  4. eviction                 it drops context, so only with the user's consent: a request's
                              own ``kv_budget`` (under ``--kv-eviction``), or
                              ``kv_quality_floor="eviction"``, the declared floor that allows it:
                              when no allowed format reaches the target, the model dtype is kept
                              and a request that may grow past its share of the pool (below) is
                              given that share as its ``kv_budget`` (``--kv-eviction``'s policy,
                              else streaming, which runs on every backend); shorter ones keep
                              full KV

The target: ``min(max_num_seqs, 8)`` sequences of ``max_model_len`` tokens at once, counting
per sequence every KV group's blocks (a sliding-window group's window only). The share: the
most tokens of KV a sequence may hold for the target's sequences to fit at once. The quality
floor (``kv_quality_floor``: lossless, int8, int4 (the default), eviction) bounds the ladder: the
lossiest lever allowed. The format the user set (``kv_cache_dtype`` other than ``auto``) is kept,
and so is the model dtype where a lever that needs it is on (KV eviction, speculative decoding).
The choice and its reason are logged and kept in ``KVPolicyChoice``; with ``kv_policy="manual"``
it holds the configured levers, with the reason "configured" (``/metrics`` shows it either way,
as ``kvserve_kv_policy_info``); each request's output names the lever it ran under and why
(``RequestKVPolicy``).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from math import ceil

from kvserve.config import EngineConfig
from kvserve.engine import kv_plan
from kvserve.kv_eviction import kv_budget_min
from kvserve.kv_format import default_block_size
from kvserve.outputs import RequestKVPolicy

log = logging.getLogger(__name__)

LADDER = ("auto", "int8", "int4")  # model dtype first, then fewer bits
TARGET_SEQS = 8


@dataclass(frozen=True)
class KVPolicyChoice:
    kv_cache_dtype: str
    window_kv: str
    fits_sequences: int  # full-length sequences the pool holds with this choice
    target_sequences: int
    reason: str  # "configured" with kv_policy "manual"
    kv_format: str = ""  # what the pool stores: the model dtype's name for "auto", else kv_cache_dtype
    kv_eviction: str = "none"  # as configured, or streaming for the share (module docstring)
    tiers: bool = False  # CPU/disk/Redis KV tiers configured
    policy: str = "auto"  # kv_policy: "auto" or "manual"
    quality_floor: str = "int4"  # kv_quality_floor: the lossiest lever "auto" may use
    share: int | None = None  # kv_quality_floor "eviction": the kv_budget a request too long for it gets


def format_name(kv_cache_dtype: str, model_dtype) -> str:
    """What a pool of ``kv_cache_dtype`` stores: "float32"/"bfloat16"/... for "auto"."""
    return str(model_dtype).removeprefix("torch.") if kv_cache_dtype == "auto" else kv_cache_dtype


def budget_for(choice: KVPolicyChoice, params, prompt_tokens: int, max_model_len: int):
    """``params`` as the request runs under the policy: with a share (``kv_quality_floor``
    "eviction") and no ``kv_budget`` of its own, a request whose prompt and output may pass the
    share gets it as its budget (a copy of ``params``; the caller's may serve other requests)."""
    if choice.share is None or params.kv_budget is not None:
        return params
    longest = prompt_tokens + (params.max_tokens if params.max_tokens is not None else max_model_len - prompt_tokens)
    return params if longest <= choice.share else dataclasses.replace(params, kv_budget=choice.share)


def for_request(choice: KVPolicyChoice, kv_budget: int | None, chosen: bool = False) -> RequestKVPolicy:
    """The policy a request with ``kv_budget`` runs under: without a budget nothing is evicted.
    ``chosen``: the budget is the policy's share, not the request's own."""
    if kv_budget is None or choice.kv_eviction == "none":
        return RequestKVPolicy(choice.kv_format, "none")
    why = (f"kv_policy auto: the request may pass its share of the pool ({choice.share} tokens, "
           f"{choice.target_sequences} sequences at once)" if chosen else "the request's kv_budget")
    return RequestKVPolicy(choice.kv_format, choice.kv_eviction, kv_budget, why)


def _pool(config: EngineConfig, arch, runner, kv_bytes: int, fmt=None, scales=None):
    """The KV groups and the pool's plan under ``config.cache`` (in ``fmt`` if given)."""
    fmt = fmt or kv_plan.make_format(config.cache, arch, runner.dtype, runner.device, None)
    groups = kv_plan.groups_for(config, arch, fmt)
    return groups, kv_plan.plan(fmt, scales, groups.page_layers, kv_bytes, config.cache,
                                config.scheduler.max_num_seqs)


def share_tokens(config: EngineConfig, arch, runner, kv_bytes: int, max_model_len: int, target: int) -> int:
    """The most tokens a sequence may hold (under eviction: a sliding-window group keeps its
    window, the global ones the budget) for ``target`` sequences to fit the pool at once."""
    groups, p = _pool(config, arch, runner, kv_bytes)
    bs = config.cache.block_size
    local = sum(ceil(min(w, max_model_len) / bs) + 1 for w in groups.windows if w is not None)
    glob = sum(w is None for w in groups.windows)
    return bs * max(0, (p.num_blocks // target - local) // max(glob, 1))


def _fits(config: EngineConfig, arch, runner, kv_bytes: int, max_model_len: int, fmt=None, scales=None) -> int:
    """Full-length sequences the pool holds under ``config.cache`` (in ``fmt`` if given), and the
    scheduler can run at once: a KIVI format's key residual may lower ``max_num_seqs`` below
    what its blocks hold."""
    groups, p = _pool(config, arch, runner, kv_bytes, fmt, scales)
    bs = config.cache.block_size
    per_seq = sum(ceil(max_model_len / bs) if w is None else ceil(min(w, max_model_len) / bs) + 1
                  for w in groups.windows)
    return min(p.num_blocks // per_seq, p.max_num_seqs)


def choose(config: EngineConfig, arch, runner, kv_bytes: int,
           max_model_len: int) -> tuple[EngineConfig, KVPolicyChoice]:
    """The config with the levers set, and why; with ``kv_policy`` "manual", the config as it
    is and its levers, the reason "configured"."""
    cache = config.cache
    target = min(config.scheduler.max_num_seqs, TARGET_SEQS)
    if cache.kv_policy != "auto":
        n = _fits(config, arch, runner, kv_bytes, max_model_len, runner.kv_format, runner.kv_scales)
        return config, KVPolicyChoice(cache.kv_cache_dtype, cache.window_kv, n, target, "configured",
                                      format_name(cache.kv_cache_dtype, runner.dtype), cache.kv_eviction,
                                      cache.tiers_enabled, cache.kv_policy, cache.kv_quality_floor)
    windowed = any(w is not None for w in arch.layer_windows)
    fixed = None
    if cache.kv_cache_dtype != "auto":
        fixed = f"kv_cache_dtype {cache.kv_cache_dtype} was set"
    elif cache.kv_eviction != "none":
        fixed = f"kv_eviction {cache.kv_eviction} needs the model dtype"
    elif config.speculative is not None:
        fixed = "speculative decoding needs the model dtype"
    floor = cache.kv_quality_floor
    ladder = (cache.kv_cache_dtype,) if fixed else LADDER[:{"lossless": 1, "int8": 2}.get(floor, 3)]
    window_kv = cache.window_kv if cache.tiers_enabled or cache.preemption_mode == "swap" else "free"
    best = None
    for dtype in ladder:
        c = dataclasses.replace(cache, kv_cache_dtype=dtype, window_kv=window_kv,
                                block_size=cache.block_size if dtype == cache.kv_cache_dtype
                                else default_block_size(dtype))
        cand = dataclasses.replace(config, cache=c)
        n = _fits(cand, arch, runner, kv_bytes, max_model_len)
        # Short of the target everywhere: the format holding the most (fewer bits need not: the
        # KIVI formats keep a sliding-window model's every block, ``kv_plan.groups_for``).
        if best is None or n > best[2]:
            best = (cand, dtype, n)
        if n >= target:
            break
    cand, dtype, n = best
    share, evict_note = None, None
    if floor == "eviction" and n < target:
        cand, dtype, n, share, evict_note = _with_eviction(config, cand, dtype, n, arch, runner, kv_bytes,
                                                           max_model_len, target)
    parts = [("sliding-window blocks freed" if window_kv == "free" else f"window_kv {window_kv} (swap or tiers)")
             if windowed else "no sliding-window layers"]
    name = "the model dtype" if dtype == "auto" else dtype
    if fixed:
        parts.append(f"KV in {name} ({fixed})")
    elif dtype == "auto":
        parts.append(f"KV in the model dtype: the pool holds {n} sequences of {max_model_len} tokens "
                     f"(target {target})")
    else:
        parts.append(f"KV in {dtype}: the pool holds {n} sequences of {max_model_len} tokens (target {target})")
    if share is not None:
        parts.append(f"{cand.cache.kv_eviction} eviction for a request that may pass {share} tokens, the share "
                     f"that fits {target} sequences (kv_quality_floor eviction)")
    elif n < target:
        parts.append(evict_note or "short of the target: raise kv_cache_memory, add a KV tier, or allow eviction "
                     "(kv_quality_floor eviction, or --kv-eviction with a per-request kv_budget)")
    if cache.tiers_enabled:
        parts.append("KV tiers as configured")
    choice = KVPolicyChoice(dtype, window_kv, n, target, "; ".join(parts), format_name(dtype, runner.dtype),
                            cand.cache.kv_eviction, cache.tiers_enabled, quality_floor=floor, share=share)
    log.info("kv_policy auto: %s", choice.reason)
    return cand, choice


def _with_eviction(config, cand, dtype, n, arch, runner, kv_bytes, max_model_len, target):
    """``kv_quality_floor`` "eviction", no allowed format reaching the target: the model dtype
    and a share per request, where eviction can run; else the choice as it was and why not."""
    cache = cand.cache
    blocked = ("KV tiers" if cache.tiers_enabled else "preemption_mode swap" if cache.preemption_mode == "swap"
               else "speculative decoding" if config.speculative is not None
               # (a budget would cap the prompt blocks a decode instance takes from its producer)
               else "disaggregated prefill/decode (kv_transfer_config)" if config.kv_transfer_config is not None
               else f"kv_cache_dtype {cache.kv_cache_dtype}" if config.cache.kv_cache_dtype != "auto" else None)
    if blocked is None and arch.layer_windows and all(w is not None for w in arch.layer_windows):
        blocked = "every layer's sliding window (it bounds the KV already)"
    if blocked is not None:
        return cand, dtype, n, None, f"short of the target; eviction cannot run beside {blocked}"
    c = dataclasses.replace(cache, kv_cache_dtype="auto", block_size=config.cache.block_size,
                            kv_eviction=cache.kv_eviction if cache.kv_eviction != "none" else "streaming")
    ev = dataclasses.replace(config, cache=c)
    share = min(share_tokens(ev, arch, runner, kv_bytes, max_model_len, target), max_model_len)
    if share < kv_budget_min(c.block_size):
        return cand, dtype, n, None, (f"short of the target; the pool's share per sequence ({share} tokens) is "
                                      f"below the smallest kv_budget ({kv_budget_min(c.block_size)})")
    return ev, "auto", _fits(ev, arch, runner, kv_bytes, max_model_len), share, None

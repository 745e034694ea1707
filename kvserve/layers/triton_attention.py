"""Triton attention backend (CUDA): per layer and step, the kernels picked by one table
(``ROUTES``) from the step's phase and the cache's kind:

    phase    decode: every sequence brings one token (paged flash-decoding)
             prompt: one whole prompt with nothing cached, into a compressed cache (SDPA,
                     cuDNN/flash, on its own K/V in full precision)
             prefill: anything else: prompts alone or batched, chunked prefill, prefix-cache
                      hits, mixed prefill + decode (the paged varlen prefill kernel)
    cache    plain (the model's dtype), 8bit (fp8/int8), kivi (int4/int2 through the Triton
             kernels), kivi4 (KIVI int4 that the Gluon decode kernel takes)

A route is the step's RoPE + KV write (a kernel of its own) and the attention kernel; where the
route allows it and ``KernelConfig.fused_rope_decode`` asks for it, the attention kernel does the
write itself (one kernel less per layer; KIVI with 64-token blocks: two, the key seal too). The
backend holds the engine's ``KernelConfig`` and passes its choices to the launchers.

A layer with a sliding window (Gemma 3's local layers) passes it to both Triton kernels; a lone
prompt longer than its window takes the paged prefill kernel rather than SDPA's causal one, and
a KIVI int4 decode the Triton kernel rather than the Gluon one (which has no window). Streaming
KV eviction likewise: a step with a ``kv_budget`` hands each sequence's sink and recent span to
both kernels (``kernels.common.Streaming``), which skip the evicted keys. (Eviction keeps the
cache uncompressed, so these steps take the plain routes: every prompt the paged prefill kernel.)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvserve.config import KernelConfig
from kvserve.kernels import kivi_decode
from kvserve.kernels.common import KEEP_ALL, RopeWrite, SplitCounters, Streaming
from kvserve.kernels.decode_attention import decode_splits, paged_decode_attention
from kvserve.kernels.kv_quant import rope_kv_write_quant, seal_keys
from kvserve.kernels.prefill_attention import paged_prefill_attention
from kvserve.kernels.rope_kv_write import rope_kv_write
from kvserve.kv_eviction import SINK_BLOCKS, full_attention_blocks, recent_tokens
from kvserve.kv_format import KVViews
from kvserve.layers.forward_context import AttentionMetadata

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    _SDPA_ORDER = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH)
except ImportError:  # pragma: no cover - old torch
    sdpa_kernel = None


@dataclass
class _Call:
    """One layer's attention call, as the backend's ``forward`` receives it."""
    positions: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    rope: object  # RotaryEmbedding: its cos/sin tables
    k_cache: torch.Tensor | KVViews
    v_cache: torch.Tensor | None
    meta: AttentionMetadata
    scale: float
    kernel: KernelConfig
    counters: SplitCounters
    phase: str
    window: int | None = None

    def rope_write(self) -> RopeWrite:
        m = self.meta
        return RopeWrite(self.positions, m.slot_mapping, self.k, self.v, self.rope.cos, self.rope.sin, m.res_mapping)


# -- the step's RoPE + KV write ---------------------------------------------------------------
def _write_plain(c: _Call, fused: bool) -> None:
    if not fused:
        m = c.meta
        rope_kv_write(c.q, c.k, c.v, c.positions, m.slot_mapping, c.rope.cos, c.rope.sin, c.k_cache, c.v_cache,
                      rotate_k_inplace=c.phase == "prompt", pdl=c.kernel.pdl)


def _write_quant(c: _Call, fused: bool) -> None:
    """Quantize on write; KIVI first seals the key blocks this step fills (unless the fused decode
    kernel seals them itself: ``kivi_decode.seals``)."""
    m, f = c.meta, c.k_cache.fmt
    if f.kivi and not (fused and kivi_decode.seals(f)):
        seal_keys(c.k, c.rope.cos, c.rope.sin, m.cu_q, m.seq_lens_t, m.block_tables, m.res_slots_t, c.k_cache,
                  m.max_seal)
    if not fused:
        rope_kv_write_quant(c.q, c.k, c.v, c.positions, m.slot_mapping, m.res_mapping, c.rope.cos, c.rope.sin,
                            c.k_cache, rotate_k_inplace=c.phase == "prompt")


# -- the attention kernels ---------------------------------------------------------------------
def _decode(c: _Call, fused: bool) -> torch.Tensor:
    """The Triton split decode kernel (every cache kind)."""
    m = c.meta
    views = c.k_cache if isinstance(c.k_cache, KVViews) else None
    kvh = views.fmt.num_kv_heads if views is not None else c.k_cache.shape[2]
    splits = m.num_splits or decode_splits(views.fmt if views is not None else None, len(m.seq_lens), kvh,
                                           c.q.device)
    return paged_decode_attention(c.q, c.k_cache, c.v_cache, m.block_tables, m.seq_lens_t, c.scale, splits=splits,
                                  res_slots=m.res_slots_t, rope=c.rope_write() if fused else None,
                                  pdl=c.kernel.pdl, counters=c.counters, window=c.window, streaming=m.streaming)


def _decode_kivi4(c: _Call, fused: bool) -> torch.Tensor:
    """The Gluon KIVI int4 decode kernel; its split plan made by the step's first layer."""
    m, f, kc = c.meta, c.k_cache.fmt, c.kernel
    out = torch.empty_like(c.q)
    if not m.seq_lens:
        return out
    if m.decode_plan is None:
        m.decode_plan = kivi_decode.split_plan(m.seq_lens_t, m.block_tables, f.num_kv_heads, f.block_size,
                                               wave=kc.kivi_wave)
    return kivi_decode.kivi4_decode(c.q, c.k_cache, m.block_tables, m.seq_lens_t, m.res_slots_t, c.scale, out,
                                    rope=c.rope_write() if fused else None, plan=m.decode_plan,
                                    l2_ahead=kc.kivi_l2_ahead, wave=kc.kivi_wave)


def _prompt(c: _Call, fused: bool) -> torch.Tensor:
    return _sdpa_causal(c.q, c.k, c.v, c.scale)


def _prefill(c: _Call, fused: bool) -> torch.Tensor:
    m = c.meta
    return paged_prefill_attention(c.q, c.k_cache, c.v_cache, m.block_tables, m.cu_q, m.seq_lens_t,
                                   m.max_query_len, c.scale, res_slots=m.res_slots_t, window=c.window,
                                   streaming=m.streaming)


class Route(NamedTuple):
    write: Callable[[_Call, bool], None]  # the RoPE + KV write; told whether the attention kernel does it
    attend: Callable[[_Call, bool], torch.Tensor]
    fuses_write: bool  # the attention kernel can do the write itself (KernelConfig.fused_rope_decode)


ROUTES: dict[tuple[str, str], Route] = {
    ("decode", "plain"): Route(_write_plain, _decode, True),
    ("decode", "8bit"): Route(_write_quant, _decode, False),
    ("decode", "kivi"): Route(_write_quant, _decode, False),
    ("decode", "kivi4"): Route(_write_quant, _decode_kivi4, True),
    ("prompt", "plain"): Route(_write_plain, _prompt, False),  # only where SDPA_PROMPT_CACHES adds "plain"
    ("prompt", "8bit"): Route(_write_quant, _prompt, False),
    ("prompt", "kivi"): Route(_write_quant, _prompt, False),
    ("prefill", "plain"): Route(_write_plain, _prefill, False),
    ("prefill", "8bit"): Route(_write_quant, _prefill, False),
    ("prefill", "kivi"): Route(_write_quant, _prefill, False),
}


# The caches a lone prompt attends through SDPA, on its own K/V in full precision: the compressed
# ones, which the paged kernel would read back quantized. Into a plain cache the paged kernel reads
# the very K/V SDPA would, within 7% of cuDNN's time from 300 to 16k tokens once both are warm (an
# 8B model on an H100), and never builds a plan per shape as cuDNN does (benchmarks/lone_prompt.py).
SDPA_PROMPT_CACHES = ("8bit", "kivi")


def step_phase(meta: AttentionMetadata) -> str:
    """The step's phase (module docstring). A lone whole prompt is "prompt" whatever the cache;
    ``forward`` sends it to SDPA, on its own keys in full precision, only where the cache is
    compressed (``SDPA_PROMPT_CACHES``)."""
    if meta.max_query_len == 1:
        return "decode"
    plain_prompt = len(meta.seq_lens) == 1 and meta.query_lens[0] == meta.seq_lens[0] > 1
    if plain_prompt and meta.kv_budgets is not None and meta.kv_budgets[0] is not None:
        # Plainly causal only while every query sees every earlier key (the cache manager's step
        # cap keeps a budgeted request's first step so; the route does not rely on it).
        plain_prompt = meta.seq_lens[0] <= full_attention_blocks(meta.kv_budgets[0], meta.block_size) * meta.block_size
    return "prompt" if plain_prompt and sdpa_kernel is not None else "prefill"


def cache_kind(k_cache, q: torch.Tensor, phase: str, kernel: KernelConfig) -> str:
    """The kind of a layer's cache (module docstring); "kivi4" only where the Gluon kernel runs:
    a decode step, ``kernel.kivi_gluon`` and ``kivi_decode.supported``."""
    if not isinstance(k_cache, KVViews):
        return "plain"
    if not k_cache.fmt.kivi:
        return "8bit"
    if phase == "decode" and kernel.kivi_gluon and kivi_decode.supported(k_cache, q):
        return "kivi4"
    return "kivi"


class TritonPagedAttention:
    name = "triton"

    def __init__(self, kernel: KernelConfig | None = None):
        self.kernel = kernel or KernelConfig()
        self.counters = SplitCounters()  # the split decode kernel's, one buffer per device

    @staticmethod
    def prepare(meta: AttentionMetadata, device: torch.device) -> None:
        meta.seq_lens_t = torch.tensor(meta.seq_lens, dtype=torch.int32).to(device, non_blocking=True)
        meta.cu_q = torch.tensor(meta.query_start, dtype=torch.int32).to(device, non_blocking=True)
        meta.max_query_len = max(meta.query_lens) if meta.query_lens else 0
        meta.num_splits = 0  # 0: chosen in forward from the batch and KV head count
        if meta.res_slots is not None:
            meta.res_slots_t = torch.tensor(meta.res_slots, dtype=torch.int32).to(device, non_blocking=True)
        if meta.kv_budgets is not None:
            meta.streaming = streaming_spans(meta.kv_budgets, meta.block_size, device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope,
                k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
        phase = step_phase(meta)
        if phase == "prompt" and window is not None and meta.max_query_len > window:
            phase = "prefill"
        kind = cache_kind(k_cache, q, phase, self.kernel)
        if phase == "prompt" and kind not in SDPA_PROMPT_CACHES:
            phase = "prefill"
        if kind == "kivi4" and window is not None:
            kind = "kivi"
        route = ROUTES[phase, kind]
        fused = route.fuses_write and self.kernel.fused_rope_decode and not meta.decode_rows
        call = _Call(positions, q, k, v, rope, k_cache, v_cache, meta, scale, self.kernel, self.counters, phase,
                     window)
        route.write(call, fused)
        return route.attend(call, fused)


def streaming_spans(kv_budgets: list[int | None], block_size: int, device: torch.device) -> Streaming:
    """Streaming eviction's per-sequence budgets (None: every key) as the kernels take them."""
    recent = [KEEP_ALL if b is None else recent_tokens(b, block_size) for b in kv_budgets]
    return Streaming(SINK_BLOCKS * block_size, torch.tensor(recent, dtype=torch.int32).to(device, non_blocking=True))


def sdpa_padded_len(t: int) -> int:
    """The length a lone prompt is padded to for SDPA: up to a multiple of an eighth of the
    power of two at or below ``t``, and of 64 at least. At most 1/8 longer (64 tokens below
    512), and eight lengths per doubling: 40 up to 8,192 tokens."""
    step = max(64, (1 << (max(t, 1).bit_length() - 1)) // 8)
    return -(-t // step) * step


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One prompt with no cached context: the library's fastest causal kernel on contiguous
    K/V. K/V heads are expanded for GQA (cuDNN takes no grouped heads); at prefill sizes that
    copy is small against the attention's arithmetic.

    cuDNN builds an execution plan for each shape it meets: 41-67 ms each on an H200 for an 8B
    model's heads, paid by the first prompt of each length. So the prompt is padded at its end to
    ``sdpa_padded_len``: an engine meets at most eight shapes per doubling of length. Causal
    attention keeps every real row exact: row i sees keys 0..i, none of the padding. (A prompt
    into a plain cache takes the paged prefill kernel instead, which plans nothing.)"""
    T, H, D = q.shape
    KVH, P = k.shape[1], sdpa_padded_len(q.shape[0])
    # Dense [1, H, P, D] copies: q/k/v arrive as strided views of the packed qkv projection,
    # and the fused kernels behind SDPA are only trusted on plain layouts.
    qt, kt, vt = (q.new_empty(1, H, P, D) for _ in range(3))
    qt[0, :, :T] = q.transpose(0, 1)
    for dst, src in ((kt, k), (vt, v)):
        dst[0, :, :T].unflatten(0, (KVH, H // KVH)).copy_(src.transpose(0, 1).unsqueeze(1).expand(KVH, H // KVH, T, D))
    for x in (qt, kt, vt):
        x[0, :, T:].zero_()  # padded rows attend to real keys and zeros: finite, and dropped
    with sdpa_kernel(list(_SDPA_ORDER), set_priority=True):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    return o[0, :, :T].transpose(0, 1)

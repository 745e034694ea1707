"""Triton attention backend (CUDA): fused RoPE + KV write, then per step the fastest correct
kernel: paged flash-decoding when every sequence brings one token, SDPA (cuDNN/flash) for a
single plain prompt with nothing cached, the paged varlen prefill kernel otherwise (batched
prompts, chunked prefill, prefix-cache hits, mixed prefill + decode)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kernels import kivi_decode
from kvserve.kernels.decode_attention import decode_splits, fuses_rope, paged_decode_attention
from kvserve.kernels.kv_quant import rope_kv_write_quant, seal_keys
from kvserve.kernels.prefill_attention import paged_prefill_attention
from kvserve.kernels.rope_kv_write import rope_kv_write
from kvserve.layers.attention import AttentionMetadata
from kvserve.layers.kv_format import KVViews

try:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    _SDPA_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]
except ImportError:  # pragma: no cover - old torch
    sdpa_kernel = None


# Decode steps with an uncompressed cache or a KIVI int4 one (``fuses_rope``): the decode
# attention kernel does the RoPE + KV write itself (``paged_decode_attention(rope=...)``), one
# kernel less per layer (KIVI with 64-token blocks: two, the key seal too); the uncompressed one
# reads the cache before waiting on the QKV product.
# Batch-1 decode on the H200 (Llama-3-8B shape, graphs, PDL): 232.0 -> 238.5 tok/s at a 512-token
# prompt, 213.0 -> 218.0 at 7,936 (BENCHMARKS.md, ninth session). False: the separate
# ``rope_kv_write`` / ``rope_kv_write_quant`` kernel (the benchmarks' A/B).
FUSED_ROPE_DECODE = True


class TritonPagedAttention:
    name = "triton"

    @staticmethod
    def prepare(meta: AttentionMetadata, device: torch.device) -> None:
        meta.seq_lens_t = torch.tensor(meta.seq_lens, dtype=torch.int32).to(device, non_blocking=True)
        meta.cu_q = torch.tensor(meta.query_start, dtype=torch.int32).to(device, non_blocking=True)
        meta.max_query_len = max(meta.query_lens) if meta.query_lens else 0
        meta.num_splits = 0  # 0: chosen in forward from the batch and KV head count
        if meta.res_slots is not None:
            meta.res_slots_t = torch.tensor(meta.res_slots, dtype=torch.int32).to(device, non_blocking=True)

    @staticmethod
    def forward(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        B = len(meta.seq_lens)
        plain_prompt = B == 1 and meta.query_lens[0] == meta.seq_lens[0] > 1 if meta.seq_lens else False
        compressed = isinstance(k_cache, KVViews)
        fused = FUSED_ROPE_DECODE and meta.max_query_len == 1 and fuses_rope(k_cache, q)
        if compressed:  # quantize on write (KIVI: seal full key blocks first)
            kvh = k_cache.fmt.num_kv_heads
            if k_cache.fmt.kivi and not (fused and kivi_decode.seals(k_cache.fmt)):
                seal_keys(k, rope.cos, rope.sin, meta.cu_q, meta.seq_lens_t, meta.block_tables, meta.res_slots_t,
                          k_cache, meta.max_seal)
            if not fused:
                rope_kv_write_quant(q, k, v, positions, meta.slot_mapping, meta.res_mapping, rope.cos, rope.sin,
                                    k_cache, rotate_k_inplace=plain_prompt)
        else:
            kvh = k_cache.shape[2]
            if not fused:
                rope_kv_write(q, k, v, positions, meta.slot_mapping, rope.cos, rope.sin, k_cache, v_cache,
                              rotate_k_inplace=plain_prompt)
        if meta.max_query_len == 1:
            splits = meta.num_splits or decode_splits(k_cache.fmt if compressed else None, B, kvh, q.device)
            rope_args = (positions, meta.slot_mapping, k, v, rope.cos, rope.sin) if fused else None
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens_t, scale,
                                          splits=splits, res_slots=meta.res_slots_t, rope=rope_args,
                                          res_mapping=meta.res_mapping, plans=meta.plans)
        if plain_prompt and sdpa_kernel is not None:
            return _sdpa_causal(q, k, v, scale)
        return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.cu_q, meta.seq_lens_t,
                                       meta.max_query_len, scale, res_slots=meta.res_slots_t)


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One prompt with no cached context: the library's fastest causal kernel on contiguous
    K/V. K/V heads are expanded for GQA (cuDNN takes no grouped heads); at prefill sizes that
    copy is small against the attention's arithmetic."""
    H, KVH = q.shape[1], k.shape[1]
    # Dense [1, H, T, D] copies: q/k/v arrive as strided views of the packed qkv projection,
    # and the fused kernels behind SDPA are only trusted on plain layouts.
    qt = q.transpose(0, 1).unsqueeze(0).contiguous()
    kt = k.transpose(0, 1).repeat_interleave(H // KVH, dim=0).unsqueeze(0).contiguous()
    vt = v.transpose(0, 1).repeat_interleave(H // KVH, dim=0).unsqueeze(0).contiguous()
    with sdpa_kernel(_SDPA_ORDER, set_priority=True):
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    return o.squeeze(0).transpose(0, 1)

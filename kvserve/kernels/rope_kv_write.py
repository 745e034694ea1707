"""Fused RoPE + KV-cache write: rotate q and k (NeoX half-rotation layout) at each token's
position and store k and v into the paged cache at the token's slot, in one pass.

q is rotated in place (it lives in the step's scratch qkv buffer); k is written rotated to the
cache, and also back in place when ``rotate_k_inplace`` (for callers that attend over the
contiguous k, e.g. SDPA on a plain prompt). A slot < 0 marks a padding token: nothing is stored.

Rounding follows ``RotaryEmbedding`` exactly: cos/sin are cast to the activation dtype, each
product is rounded to it, then the sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.common import pdl_kw, wait_inputs


@triton.jit
def _rope_kv_write_kernel(Q, K, V, POS, SLOT, COS, SIN, KC, VC,
                          stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_cos, stride_kcs, stride_kch, stride_vcs, stride_vch,
                          NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
                          WRITE_K: tl.constexpr, USE_PDL: tl.constexpr):
    wait_inputs(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    slot = tl.load(SLOT + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    imask = i < HALF
    dt = Q.dtype.element_ty
    cos = tl.load(COS + pos * stride_cos + i, mask=imask, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(SIN + pos * stride_cos + i, mask=imask, other=0.0).to(dt).to(tl.float32)

    h = tl.arange(0, BLOCK_H)
    m = (h[:, None] < NUM_HEADS) & imask[None, :]
    qp = Q + t * stride_qt + h[:, None] * stride_qh + i[None, :]
    q1 = tl.load(qp, mask=m, other=0.0).to(tl.float32)
    q2 = tl.load(qp + HALF, mask=m, other=0.0).to(tl.float32)
    o1 = (q1 * cos).to(dt).to(tl.float32) + (-q2 * sin).to(dt).to(tl.float32)
    o2 = (q2 * cos).to(dt).to(tl.float32) + (q1 * sin).to(dt).to(tl.float32)
    tl.store(qp, o1.to(dt), mask=m)
    tl.store(qp + HALF, o2.to(dt), mask=m)

    kh = tl.arange(0, BLOCK_KH)
    km = (kh[:, None] < NUM_KV_HEADS) & imask[None, :]
    kp = K + t * stride_kt + kh[:, None] * stride_kh + i[None, :]
    k1 = tl.load(kp, mask=km, other=0.0).to(tl.float32)
    k2 = tl.load(kp + HALF, mask=km, other=0.0).to(tl.float32)
    r1 = ((k1 * cos).to(dt).to(tl.float32) + (-k2 * sin).to(dt).to(tl.float32)).to(dt)
    r2 = ((k2 * cos).to(dt).to(tl.float32) + (k1 * sin).to(dt).to(tl.float32)).to(dt)
    if WRITE_K:
        tl.store(kp, r1, mask=km)
        tl.store(kp + HALF, r2, mask=km)
    if slot >= 0:
        kc = KC + slot * stride_kcs + kh[:, None] * stride_kch + i[None, :]
        tl.store(kc, r1.to(KC.dtype.element_ty), mask=km)
        tl.store(kc + HALF, r2.to(KC.dtype.element_ty), mask=km)
        vp = V + t * stride_vt + kh[:, None] * stride_vh + i[None, :]
        vc = VC + slot * stride_vcs + kh[:, None] * stride_vch + i[None, :]
        tl.store(vc, tl.load(vp, mask=km, other=0.0).to(VC.dtype.element_ty), mask=km)
        tl.store(vc + HALF, tl.load(vp + HALF, mask=km, other=0.0).to(VC.dtype.element_ty), mask=km)


def rope_kv_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  slot_mapping: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, rotate_k_inplace: bool = False,
                  pdl: bool = True) -> None:
    """q: [T, H, D], k/v: [T, KVH, D] (strided views are fine, last dim contiguous);
    cos/sin: [max_pos, D] (halves duplicated); caches: [num_blocks, block_size, KVH, D]."""
    T, H, D = q.shape
    KVH = k.shape[1]
    assert D % 2 == 0 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if T == 0:
        return
    nb, bs = k_cache.shape[:2]
    kc = k_cache.view(nb * bs, KVH, D)
    vc = v_cache.view(nb * bs, KVH, D)
    half = D // 2
    _rope_kv_write_kernel[(T,)](
        q, k, v, positions, slot_mapping, cos, sin, kc, vc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
        NUM_HEADS=H, NUM_KV_HEADS=KVH, HALF=half, BLOCK_H=triton.next_power_of_2(H),
        BLOCK_KH=triton.next_power_of_2(KVH), BLOCK_HALF=triton.next_power_of_2(half),
        WRITE_K=rotate_k_inplace, num_warps=4, **pdl_kw(q, pdl),
        enable_fp_fusion=False)  # no FMA contraction: each product is rounded, as in the reference


def rope_kv_write_ref(q, k, v, positions, slot_mapping, cos, sin, k_cache, v_cache):
    """Plain PyTorch: returns rotated (q, k) and writes the caches, skipping slots < 0."""
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)

    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    qr, kr = q * c + rot(q) * s, k * c + rot(k) * s
    keep = slot_mapping >= 0
    nb, bs, kvh, d = k_cache.shape
    k_cache.view(nb * bs, kvh, d)[slot_mapping[keep]] = kr[keep].to(k_cache.dtype)
    v_cache.view(nb * bs, kvh, d)[slot_mapping[keep]] = v[keep].to(v_cache.dtype)
    return qr, kr

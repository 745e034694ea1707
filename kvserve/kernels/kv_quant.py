"""Compressed KV in the kernels: quantize on write (fused with RoPE), seal KIVI key blocks, and
the dequantizing tile loads the attention kernels read K and V through.

Formats and byte layout: ``kvserve/kv_format.py``. ``FMT`` codes, compile-time:
0 = uncompressed, 1 = fp8 (e4m3, symmetric), 2 = int8 (symmetric), 3 = KIVI int4/int2 (``BITS``).

Every quantizing step mirrors the PyTorch reference operation for operation (fp32 arithmetic,
correctly rounded division, scales rounded to fp16 before use), so the kernels write the same
codes the reference does.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kvserve.kernels import interpreting
from kvserve.kernels.common import online_softmax_probs
from kvserve.kv_format import FP8_MAX, INT8_MAX, MIN_SCALE, KVFormat, KVViews

FMT_PLAIN, FMT_FP8, FMT_INT8, FMT_KIVI = 0, 1, 2, 3


def fmt_code(fmt: KVFormat | None) -> int:
    if fmt is None or not fmt.quantized:
        return FMT_PLAIN
    return {"fp8": FMT_FP8, "int8": FMT_INT8}.get(fmt.name, FMT_KIVI)


# -- reading ---------------------------------------------------------------------------------
@triton.jit
def load_k_tile(KC, KS, RES, page, within, n, kvh, d, mask, full_end, res_row,
                s_cb, s_ct, s_ch, s_sb, s_st, s_sh, s_rt, s_rh,
                FMT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, DT: tl.constexpr):
    """Keys of one tile as [N, D] in ``DT``. ``page``/``within``/``n``: [N, 1] (block id, slot in
    the block, position); ``d``: [1, D]; ``mask``: [N, D]. KIVI: positions >= ``full_end`` (the
    sequence's unsealed last block) come from the residual row ``res_row`` (element offset).
    Keys of the other formats are stored like values, per token."""
    if FMT == 3:
        PER: tl.constexpr = 8 // BITS
        sealed = n < full_end
        qm = mask & sealed
        byte = tl.load(KC + page * s_cb + within * s_ct + kvh * s_ch + d // PER, mask=qm, other=0)
        code = ((byte.to(tl.int32) >> ((d % PER) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
        sp = KS + page * s_sb + kvh * s_sh + d * 2
        sc = tl.load(sp, mask=qm, other=0.0).to(tl.float32)
        mn = tl.load(sp + 1, mask=qm, other=0.0).to(tl.float32)
        r = tl.load(RES + res_row + (n - full_end) * s_rt + kvh * s_rh + d, mask=mask & (n >= full_end),
                    other=0.0)
        return tl.where(sealed, (code * sc + mn).to(DT), r.to(DT))
    return load_v_tile(KC, KS, page, within, kvh, d, mask, s_cb, s_ct, s_ch, s_sb, s_st, s_sh,
                       FMT, BITS, GROUP, DT, 1)


@triton.jit
def load_kv_tile(KC, VC, KS, VS, RES, page, within, n, kvh, d, mask, full_end, res_row,
                 s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_ksb, s_kst, s_ksh, s_vsb, s_vst, s_vsh, s_rt, s_rh,
                 FMT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, DT: tl.constexpr, VD: tl.constexpr):
    """Keys and values of one tile of the general path, [N, D] each. ``page``/``within``/``n``:
    [N]; ``d``: [D]; ``mask``: [N, D]; ``VD``: the value codes' channel stride (``kernel_args``).
    (The attention kernels' shared loader.)"""
    k = load_k_tile(KC, KS, RES, page[:, None], within[:, None], n[:, None], kvh, d[None, :], mask, full_end,
                    res_row, s_kb, s_ks, s_kh, s_ksb, s_kst, s_ksh, s_rt, s_rh, FMT, BITS, GROUP, DT)
    v = load_v_tile(VC, VS, page[:, None], within[:, None], kvh, d[None, :], mask, s_vb, s_vs, s_vh,
                    s_vsb, s_vst, s_vsh, FMT, BITS, GROUP, DT, VD)
    return k, v


@triton.jit
def load_v_tile(VC, VS, page, within, kvh, d, mask, s_cb, s_ct, s_ch, s_sb, s_st, s_sh,
                FMT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, DT: tl.constexpr, CD: tl.constexpr):
    """Values (or 8-bit keys) of one tile as [N, D] in ``DT`` (every format quantizes values per
    token; ``CD``: the codes' channel stride, 1 or an 8-bit format's block size)."""
    if FMT == 0:
        return tl.load(VC + page * s_cb + within * s_ct + kvh * s_ch + d, mask=mask, other=0.0)
    elif FMT == 3:
        PER: tl.constexpr = 8 // BITS
        byte = tl.load(VC + page * s_cb + within * s_ct + kvh * s_ch + d // PER, mask=mask, other=0)
        code = ((byte.to(tl.int32) >> ((d % PER) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
        sp = VS + page * s_sb + within * s_st + kvh * s_sh + (d // GROUP) * 2
        sc = tl.load(sp, mask=mask, other=0.0).to(tl.float32)
        mn = tl.load(sp + 1, mask=mask, other=0.0).to(tl.float32)
        return (code * sc + mn).to(DT)
    else:
        c = _codes(tl.load(VC + page * s_cb + within * s_ct + kvh * s_ch + d * CD, mask=mask, other=0), FMT,
                   tl.float32)
        sc = tl.load(VS + page * s_sb + within * s_st + kvh * s_sh + d // GROUP, mask=mask, other=0.0)
        return (c * sc.to(tl.float32)).to(DT)


def fast_path(fmt_kw: dict, head_dim: int) -> bool:
    """Whether the attention kernels take a compressed cache through ``compressed_tile``: one
    scale group per head (the default), and for 4/2-bit codes parts of >= 16 channels (the dots
    over each part need K >= 16 on the GPU: int2 with 32-channel heads takes the general path)."""
    if fmt_kw["FMT"] == FMT_PLAIN or fmt_kw["GROUP"] != head_dim:
        return False
    return fmt_kw["FMT"] != FMT_KIVI or head_dim // (8 // fmt_kw["BITS"]) >= 16


def fit_tile(views: KVViews | None, block_n: int, fast: bool) -> int:
    """The attention launchers' key tile for a cache: on the compressed fast path a tile lies in
    one block (KIVI: its channel scales; 8-bit: the values' layout), so at most a block."""
    return min(block_n, views.fmt.block_size) if fast else block_n


def kernel_args(views: KVViews | None, k_cache: torch.Tensor | None = None,
                v_cache: torch.Tensor | None = None) -> tuple[list, dict]:
    """The cache pointers, strides and constexprs the attention kernels take, for either an
    uncompressed (k_cache, v_cache) pair or a compressed layer's views. Returns (positional
    args: KC, VC, KS, VS, RES and 14 strides; constexprs)."""
    if views is None:
        kc, vc = k_cache, v_cache
        args = [kc, vc, kc, vc, kc,
                kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
                0, 0, 0, 0, 0, 0, 0, 0]
        return args, dict(FMT=0, BITS=16, GROUP=1, VD=1)
    f = views.fmt
    kc, vc, ks, vs = views.k_codes, views.v_codes, views.k_scales, views.v_scales
    if f.name == "fp8":  # the kernels load the bytes (masked lanes: 0) and bitcast them
        kc, vc = kc.view(torch.uint8), vc.view(torch.uint8)
    res = views.residual if views.residual is not None else ks
    if f.static:  # one calibrated scale per KV head: [kvh]
        k_s, v_s = (0, 0, ks.stride(0)), (0, 0, vs.stride(0))
        res_s = (0, 0)
    elif f.kivi:
        k_s = (ks.stride(0), 0, ks.stride(1))
        res_s = (res.stride(1), res.stride(2))
    else:
        k_s = (ks.stride(0), ks.stride(1), ks.stride(2))
        res_s = (0, 0)
    if not f.static:
        v_s = (vs.stride(0), vs.stride(1), vs.stride(2))
    args = [kc, vc, ks, vs, res,
            kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
            *k_s, *v_s, *res_s]
    # VD: the value codes' channel stride (8-bit formats store them channel-major: the block size)
    return args, dict(FMT=fmt_code(f), BITS=f.bits, GROUP=f.group, VD=vc.stride(3))


# -- writing ---------------------------------------------------------------------------------
@triton.jit
def rope_rotate(X, row_off, h_off, d, partner, sign, cos, sin, mask, DT: tl.constexpr):
    """NeoX rotation of x at element offsets ``row_off + h_off + d``, rounded like the
    reference: each product in ``DT``, then the sum. Only in a kernel compiled without FMA
    contraction (``enable_fp_fusion=False``): otherwise LLVM narrows the products to ``DT`` and
    fuses one into the add, one rounding fewer (a quarter of the elements 1 ulp off)."""
    x = tl.load(X + row_off + h_off + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(X + row_off + h_off + partner, mask=mask, other=0.0).to(tl.float32)
    return ((x * cos).to(DT).to(tl.float32) + (sign * xp * sin).to(DT).to(tl.float32)).to(DT)


@triton.jit
def _hadamard(x, R: tl.constexpr, D: tl.constexpr, LOG_D: tl.constexpr, RSQRT_D: tl.constexpr,
              DT: tl.constexpr):
    """x ([R, D] float32) times the orthonormal Hadamard matrix, rounded to ``DT``: the fast
    transform's butterflies, stride 1 first, then the 1/sqrt(D) - ``kv_format.hadamard``'s order."""
    for i in tl.static_range(LOG_D):
        x = _butterflies(x, R, D, 1 << i)
    return (x * RSQRT_D).to(DT)


@triton.jit
def _butterflies(x, R: tl.constexpr, D: tl.constexpr, S: tl.constexpr):
    """One stage of the fast Hadamard transform: (a, b) -> (a + b, a - b) for channels S apart."""
    y = tl.permute(tl.reshape(x, [R, D // (2 * S), 2, S]), [0, 1, 3, 2])
    a, b = tl.split(y)
    return tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [R, D])


@triton.jit
def _fp8e4m3_bits(y):
    """e4m3fn bit pattern of y (float32, |y| <= 448), rounded to nearest even: what the GPU's
    conversion does. Used under TRITON_INTERPRET, whose own fp8 cast drops the exponent carry
    (31.5 -> 16) and rounds ties up."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(y)
    ab = a.to(tl.int32, bitcast=True)
    e = ((ab >> 23) & 0xFF) - 127
    m = ab & 0x7FFFFF
    q = (m + 0x7FFFF + ((m >> 20) & 1)) >> 20  # 3 mantissa bits, ties to even
    carry = q >> 3
    normal = ((e + carry + 7) << 3) | (q & 7)
    # below 2^-6 the codes are subnormal steps of 2^-9 (and 8 is 2^-6, the first normal)
    x = a * 512.0
    r = tl.floor(x + 0.5)
    r = tl.where((r - x == 0.5) & ((r.to(tl.int32) & 1) == 1), r - 1.0, r)
    code = tl.where(a < 0.015625, r.to(tl.int32), normal)
    return code | sign


@triton.jit
def _quant_store(x, C, S, base_c, base_s, s_ch, s_sh,
                 NKV: tl.constexpr, BLOCK_KH: tl.constexpr, NG: tl.constexpr, GP: tl.constexpr,
                 PER: tl.constexpr, FMT: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr,
                 TINY: tl.constexpr, SOFT_FP8: tl.constexpr, STATIC: tl.constexpr, CD: tl.constexpr = 1):
    """Quantize x ([BLOCK_KH, NG, GP, PER] float32: one token, channel d = (g * GP + j) * PER + p)
    per (head, group) and store codes and scales. 8-bit: symmetric; KIVI: asymmetric (scale,
    min), codes packed PER to a byte."""
    h2 = tl.arange(0, BLOCK_KH)[:, None]
    g2 = tl.arange(0, NG)[None, :]
    h3 = tl.arange(0, BLOCK_KH)[:, None, None]
    g3 = tl.arange(0, NG)[None, :, None]
    j3 = tl.arange(0, GP)[None, None, :]
    if FMT == 3:
        p = tl.arange(0, PER)[None, None, None, :]
        mn = tl.min(tl.min(x, 3), 2).to(tl.float16).to(tl.float32)
        mx = tl.max(tl.max(x, 3), 2)
        sc = tl.maximum(tl.math.div_rn(mx - mn, QMAX), TINY).to(tl.float16).to(tl.float32)
        y = tl.math.div_rn(x - mn[:, :, None, None], sc[:, :, None, None])
        code = tl.minimum(tl.maximum(tl.floor(y + 0.5), 0.0), QMAX).to(tl.int32)
        packed = tl.sum(code << (p * BITS), 3)  # disjoint bits: the sum is the bitwise or
        tl.store(C + base_c + h3 * s_ch + g3 * GP + j3, packed.to(tl.uint8), mask=(h3 < NKV) & (j3 < GP))
        sp = S + base_s + h2 * s_sh + g2 * 2
        tl.store(sp, sc.to(tl.float16), mask=(h2 < NKV) & (g2 < NG))
        tl.store(sp + 1, mn.to(tl.float16), mask=(h2 < NKV) & (g2 < NG))
    else:
        if STATIC:  # calibrated: one fp32 scale per KV head, nothing stored per token
            sc = tl.load(S + h2 * s_sh + g2 * 0, mask=(h2 < NKV) & (g2 < NG), other=1.0)
        else:
            amax = tl.max(tl.max(tl.abs(x), 3), 2)
            sc = tl.maximum(tl.math.div_rn(amax, QMAX), TINY).to(tl.float16).to(tl.float32)
        y = tl.math.div_rn(x, sc[:, :, None, None])
        y = tl.minimum(tl.maximum(tl.where(y == y, y, 0.0), -QMAX), QMAX)  # NaN -> 0 (kv_format.quantize_sym)
        if FMT == 1 and SOFT_FP8:
            code = _fp8e4m3_bits(y).to(tl.uint8)
        elif FMT == 1:
            code = y.to(C.dtype.element_ty)
        else:
            code = tl.floor(y + 0.5).to(tl.int8)
        # PER == 1: x is [KH, NG, GP, 1]
        code3 = tl.reshape(code, (BLOCK_KH, NG, GP))
        tl.store(C + base_c + h3 * s_ch + (g3 * GP + j3) * CD, code3, mask=(h3 < NKV) & (j3 < GP))
        if not STATIC:
            tl.store(S + base_s + h2 * s_sh + g2, sc.to(tl.float16), mask=(h2 < NKV) & (g2 < NG))


@triton.jit
def _rope_kv_write_quant_kernel(Q, K, V, POS, SLOT, RSLOT, COS, SIN, KC, VC, KS, VS, RES,
                                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cos,
                                s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch, s_ksb, s_kss, s_ksh,
                                s_vsb, s_vss, s_vsh, s_rh, PAGE: tl.constexpr,
                                NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                                BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr,
                                FMT: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                                QMAX: tl.constexpr, TINY: tl.constexpr, WRITE_K: tl.constexpr,
                                SOFT_FP8: tl.constexpr, STATIC: tl.constexpr, VD: tl.constexpr,
                                ROT: tl.constexpr, LOG_D: tl.constexpr, RSQRT_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    slot = tl.load(SLOT + t).to(tl.int64)
    DT: tl.constexpr = Q.dtype.element_ty
    HALF: tl.constexpr = HEAD_DIM // 2
    # q: [H, D] tile
    d2 = tl.arange(0, HEAD_DIM)[None, :]
    partner2 = (d2 + HALF) % HEAD_DIM
    sign2 = tl.where(d2 < HALF, -1.0, 1.0)
    cos2 = tl.load(COS + pos * stride_cos + d2).to(DT).to(tl.float32)
    sin2 = tl.load(SIN + pos * stride_cos + d2).to(DT).to(tl.float32)
    h2 = tl.arange(0, BLOCK_H)[:, None]
    qm = (h2 < NUM_HEADS) & (d2 < HEAD_DIM)
    qr = rope_rotate(Q, t * stride_qt, h2 * stride_qh, d2, partner2, sign2, cos2, sin2, qm, DT)
    if ROT:  # keys are stored turned (KVFormat.rotate_keys): the queries turn with them
        qr = _hadamard(qr.to(tl.float32), BLOCK_H, HEAD_DIM, LOG_D, RSQRT_D, DT)
    # In place: a channel's partner is another thread's element, which must be read before it is
    # overwritten (without the barrier the H200 tests failed now and then)
    tl.debug_barrier()
    tl.store(Q + t * stride_qt + h2 * stride_qh + d2, qr, mask=qm)

    # k, v: [KH, NG, GP, PER] tiles, channel d = (g * GP + j) * PER + p
    PER: tl.constexpr = 8 // BITS
    GP: tl.constexpr = GROUP // PER
    NG: tl.constexpr = HEAD_DIM // GROUP
    h = tl.arange(0, BLOCK_KH)[:, None, None, None]
    g = tl.arange(0, NG)[None, :, None, None]
    j = tl.arange(0, GP)[None, None, :, None]
    p = tl.arange(0, PER)[None, None, None, :]
    d = (g * GP + j) * PER + p
    partner = (d + HALF) % HEAD_DIM
    sign = tl.where(d < HALF, -1.0, 1.0)
    cos = tl.load(COS + pos * stride_cos + d).to(DT).to(tl.float32)
    sin = tl.load(SIN + pos * stride_cos + d).to(DT).to(tl.float32)
    km = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    kr = rope_rotate(K, t * stride_kt, h * stride_kh, d, partner, sign, cos, sin, km, DT)
    if ROT:
        kr = tl.reshape(_hadamard(tl.reshape(kr.to(tl.float32), [BLOCK_KH, HEAD_DIM]), BLOCK_KH, HEAD_DIM, LOG_D,
                                  RSQRT_D, DT), [BLOCK_KH, NG, GP, PER])
    if WRITE_K:
        tl.debug_barrier()  # (in place, as q above)
        tl.store(K + t * stride_kt + h * stride_kh + d, kr, mask=km)
    if slot >= 0:
        vx = tl.load(V + t * stride_vt + h * stride_vh + d, mask=km, other=0.0).to(tl.float32)
        blk = slot // PAGE
        off = slot % PAGE
        _quant_store(vx, VC, VS, blk * s_vcb + off * s_vcs, blk * s_vsb + off * s_vss, s_vch, s_vsh,
                     NUM_KV_HEADS, BLOCK_KH, NG, GP, PER, FMT, BITS, QMAX, TINY, SOFT_FP8, STATIC, VD)
        if FMT == 3:  # keys wait in full precision until their block is sealed
            rslot = tl.load(RSLOT + t)
            if rslot >= 0:
                tl.store(RES + rslot * NUM_KV_HEADS * HEAD_DIM + h * s_rh + d, kr, mask=km)
        else:
            _quant_store(kr.to(tl.float32), KC, KS, blk * s_kcb + off * s_kcs, blk * s_ksb + off * s_kss, s_kch, s_ksh,
                         NUM_KV_HEADS, BLOCK_KH, NG, GP, PER, FMT, BITS, QMAX, TINY, SOFT_FP8, STATIC)


@triton.jit
def _seal_keys_kernel(K, POS_COS, POS_SIN, CU_Q, SEQ_LENS, BT, RSLOTS, RES, KC, KS,
                      stride_kt, stride_kh, stride_cos, stride_bt, s_rs, s_rt, s_rh,
                      s_cb, s_ct, s_ch, s_sb, s_sh,
                      HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BITS: tl.constexpr,
                      QMAX: tl.constexpr, TINY: tl.constexpr):
    """Quantize, channel by channel, every key block that this step fills: its earlier keys from
    the sequence's residual row, the step's own (rotated here, from the raw k) from K."""
    i = tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    L = tl.load(SEQ_LENS + b)
    ctx = L - q_len
    pg = ctx // PAGE + i
    if pg >= L // PAGE:
        return
    DT: tl.constexpr = K.dtype.element_ty
    PER: tl.constexpr = 8 // BITS
    DP: tl.constexpr = HEAD_DIM // PER
    HALF: tl.constexpr = HEAD_DIM // 2
    w = tl.arange(0, PAGE)[:, None, None]
    j = tl.arange(0, DP)[None, :, None]
    p = tl.arange(0, PER)[None, None, :]
    d = j * PER + p
    n = pg * PAGE + w  # positions
    new = n >= ctx
    row = (q_start + n - ctx).to(tl.int64)
    partner = (d + HALF) % HEAD_DIM
    sign = tl.where(d < HALF, -1.0, 1.0)
    full = new & (d < HEAD_DIM)
    cos = tl.load(POS_COS + n.to(tl.int64) * stride_cos + d, mask=full, other=0.0).to(DT).to(tl.float32)
    sin = tl.load(POS_SIN + n.to(tl.int64) * stride_cos + d, mask=full, other=0.0).to(DT).to(tl.float32)
    kr = rope_rotate(K, row * stride_kt, kvh * stride_kh, d, partner, sign, cos, sin, full, DT)
    rs = tl.load(RSLOTS + b).to(tl.int64)
    old = tl.load(RES + rs * s_rs + w * s_rt + kvh * s_rh + d, mask=(n < ctx) & (d < HEAD_DIM), other=0.0)
    x = tl.where(new, kr, old.to(DT)).to(tl.float32)
    mn = tl.min(x, 0).to(tl.float16).to(tl.float32)  # [DP, PER] per channel
    mx = tl.max(x, 0)
    sc = tl.maximum(tl.math.div_rn(mx - mn, QMAX), TINY).to(tl.float16).to(tl.float32)
    y = tl.math.div_rn(x - mn[None, :, :], sc[None, :, :])
    code = tl.minimum(tl.maximum(tl.floor(y + 0.5), 0.0), QMAX).to(tl.int32)
    packed = tl.sum(code << (p * BITS), 2)  # [PAGE, DP]
    blk = tl.load(BT + b.to(tl.int64) * stride_bt + pg).to(tl.int64)
    w2 = tl.arange(0, PAGE)[:, None]
    j2 = tl.arange(0, DP)[None, :]
    tl.store(KC + blk * s_cb + w2 * s_ct + kvh * s_ch + j2, packed.to(tl.uint8))
    dd = tl.arange(0, DP)[:, None] * PER + tl.arange(0, PER)[None, :]  # [DP, PER]
    sp = KS + blk * s_sb + kvh * s_sh + dd * 2
    tl.store(sp, sc.to(tl.float16))
    tl.store(sp + 1, mn.to(tl.float16))


def _qmax(fmt: KVFormat) -> float:
    if fmt.kivi:
        return float((1 << fmt.bits) - 1)
    return FP8_MAX if fmt.name == "fp8" else INT8_MAX


def seal_keys(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_q: torch.Tensor,
              seq_lens: torch.Tensor, block_tables: torch.Tensor, res_slots: torch.Tensor,
              views: KVViews, max_seal: int) -> None:
    """KIVI: seal the key blocks this step fills. k: [T, KVH, D] raw (before RoPE); max_seal:
    the most blocks any sequence fills this step (0: nothing to do)."""
    f = views.fmt
    if max_seal <= 0:
        return
    B = seq_lens.shape[0]
    KVH, D = k.shape[1], k.shape[2]
    res, kc, ks = views.residual, views.k_codes, views.k_scales
    _seal_keys_kernel[(max_seal, B, KVH)](
        k, cos, sin, cu_q, seq_lens, block_tables, res_slots, res, kc, ks,
        k.stride(0), k.stride(1), cos.stride(0), block_tables.stride(0),
        res.stride(0), res.stride(1), res.stride(2),
        kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1),
        HEAD_DIM=D, PAGE=f.block_size, BITS=f.bits, QMAX=_qmax(f), TINY=MIN_SCALE,
        num_warps=4, enable_fp_fusion=False)


def rope_kv_write_quant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        slot_mapping: torch.Tensor, res_mapping: torch.Tensor | None, cos: torch.Tensor,
                        sin: torch.Tensor, views: KVViews, rotate_k_inplace: bool = False) -> None:
    """Rotate q (in place) and k, quantize v (and k, for 8-bit formats) into the compressed cache
    at each token's slot (formats with ``rotate_keys``: q and k also turned by the Hadamard
    matrix); KIVI keys go to the residual at ``res_mapping`` (row * block_size +
    offset; < 0: none). Slots < 0 are padding."""
    T, H, D = q.shape
    KVH = k.shape[1]
    if T == 0:
        return
    f = views.fmt
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and D == f.head_dim
    kc, vc, vs = views.k_codes, views.v_codes, views.v_scales
    soft_fp8 = f.name == "fp8" and interpreting()
    if soft_fp8:
        kc, vc = kc.view(torch.uint8), vc.view(torch.uint8)
    if f.static:  # calibrated [kvh] scales; nothing per token
        ks = views.k_scales
        k_s, res, res_h = (0, 0, ks.stride(0)), ks, 0
        vs_s = (0, 0, vs.stride(0))
    elif f.kivi:  # keys: no per-token scales; the residual instead
        ks, k_s, res, res_h = vs, (0, 0, 0), views.residual, views.residual.stride(2)
    else:
        ks = views.k_scales
        k_s, res, res_h = (ks.stride(0), ks.stride(1), ks.stride(2)), ks, 0
    rslot = res_mapping if res_mapping is not None else slot_mapping
    _rope_kv_write_quant_kernel[(T,)](
        q, k, v, positions, slot_mapping, rslot, cos, sin, kc, vc, ks, vs, res,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), *k_s,
        *(vs_s if f.static else (vs.stride(0), vs.stride(1), vs.stride(2))), res_h, PAGE=f.block_size,
        NUM_HEADS=H, NUM_KV_HEADS=KVH, HEAD_DIM=D, BLOCK_H=triton.next_power_of_2(H),
        BLOCK_KH=triton.next_power_of_2(KVH), FMT=fmt_code(f), BITS=f.bits, GROUP=f.group,
        QMAX=_qmax(f), TINY=MIN_SCALE, WRITE_K=rotate_k_inplace, SOFT_FP8=soft_fp8, STATIC=f.static,
        VD=vc.stride(3), ROT=f.rotate_keys, LOG_D=D.bit_length() - 1, RSQRT_D=1.0 / math.sqrt(D),
        num_warps=4, enable_fp_fusion=False)


# -- the fast path: one scale per token and head (the default group) --------------------------
@triton.jit
def _codes(c, FMT: tl.constexpr, CT: tl.constexpr):
    """8-bit codes as loaded (fp8: their bytes, uint8; int8) -> values in ``CT``."""
    if FMT == 1:
        return c.to(tl.float8e4nv, bitcast=True).to(CT)
    return c.to(CT)


@triton.jit
def _parts(x, PER: tl.constexpr):
    """x [M, D] -> its channels in ``PER`` parts [M, D // PER], part k holding channels
    PER * j + k: the order in which a byte packs its codes (``_code_parts``)."""
    M: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    if PER == 2:
        return tl.split(tl.reshape(x, [M, D // 2, 2]))
    else:  # 4: channel 4j + 2 * k1 + k0
        e, o = tl.split(tl.reshape(x, [M, D // 4, 2, 2]))  # k0 = 0 / 1
        x0, x2 = tl.split(e)
        x1, x3 = tl.split(o)
        return x0, x1, x2, x3


@triton.jit
def _magic(c, DT: tl.constexpr):
    """Codes c (int16; 4/2-bit, so 0..15; bf16's mantissa holds 0..127) as ``DT`` values
    OFF + c, by writing them into the mantissa of the offset: logic ops, where an
    integer-to-float conversion runs at a quarter of the rate. float32: c itself."""
    if DT == tl.bfloat16:
        return (c | 0x4300).to(tl.bfloat16, bitcast=True)  # 128 + c (bf16's ulp at 128 is 1)
    elif DT == tl.float16:
        return (c | 0x6400).to(tl.float16, bitcast=True)  # 1024 + c
    else:
        return c.to(DT)


@triton.jit
def _code_parts(b, BITS: tl.constexpr, DT: tl.constexpr):
    """Packed bytes [N, D // per] -> the codes in ``per`` parts [N, D // per] (``_parts``'
    order), each as ``_magic`` values. No interleave: the dots take the parts one by one."""
    c = b.to(tl.int16)
    if BITS == 4:
        return _magic(c & 15, DT), _magic(c >> 4, DT)
    else:
        return _magic(c & 3, DT), _magic((c >> 2) & 3, DT), _magic((c >> 4) & 3, DT), _magic(c >> 6, DT)


@triton.jit
def _kivi_dot(a, b, PER: tl.constexpr, PREC: tl.constexpr):
    """sum over channels of a [M, D] times packed codes b [N, D // per]: a's parts times the
    codes' parts (``_magic`` values), one dot each. Returns [M, N] float32."""
    DT: tl.constexpr = a.dtype
    if PER == 2:
        a0, a1 = _parts(a, 2)
        c0, c1 = _code_parts(b, 4, DT)
        return tl.dot(a0, tl.trans(c0), input_precision=PREC) + tl.dot(a1, tl.trans(c1), input_precision=PREC)
    else:
        a0, a1, a2, a3 = _parts(a, 4)
        c0, c1, c2, c3 = _code_parts(b, 2, DT)
        return (tl.dot(a0, tl.trans(c0), input_precision=PREC) + tl.dot(a1, tl.trans(c1), input_precision=PREC)
                + tl.dot(a2, tl.trans(c2), input_precision=PREC) + tl.dot(a3, tl.trans(c3), input_precision=PREC))


@triton.jit
def _kivi_pv(p, b, PER: tl.constexpr, PREC: tl.constexpr):
    """p [M, N] times packed value codes b [N, D // per] (``_magic`` values): one dot per part,
    the parts' results interleaved back into channel order. Returns [M, D] float32."""
    DT: tl.constexpr = p.dtype
    if PER == 2:
        c0, c1 = _code_parts(b, 4, DT)
        return tl.interleave(tl.dot(p, c0, input_precision=PREC), tl.dot(p, c1, input_precision=PREC))
    else:
        c0, c1, c2, c3 = _code_parts(b, 2, DT)
        return tl.interleave(tl.interleave(tl.dot(p, c0, input_precision=PREC), tl.dot(p, c2, input_precision=PREC)),
                             tl.interleave(tl.dot(p, c1, input_precision=PREC), tl.dot(p, c3, input_precision=PREC)))


@triton.jit
def tile_scales(KS, VS, tile_page, within, nmask, kvh, tile_sealed, s_ksb, s_kst, s_ksh, s_vsb, s_vst, s_vsh,
                FMT: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The scales of one key tile of the fast path, as loaded (fp16), for ``compressed_tile``.
    Apart from the codes, so that the decode loop can fetch them a tile ahead: Triton does not
    pipeline 2-byte loads, and waited for in the tile that uses them they cost a memory latency
    per tile. Returns (keys', values'): KIVI: the tile's block's key (scale, min) per channel
    [D, 2] (zeros unless ``tile_sealed``) and the values' (scale, min) per token [N, 2], each
    loaded as pairs; 8-bit: the key and the value scale per token, [N] each."""
    if FMT == 3:
        pair = tl.arange(0, 2)[None, :]
        ks = tl.load(KS + tile_page * s_ksb + kvh * s_ksh + tl.arange(0, HEAD_DIM)[:, None] * 2 + pair,
                     mask=tile_sealed, other=0.0)
        vs = tl.load(VS + tile_page * s_vsb + within[:, None] * s_vst + kvh * s_vsh + pair, mask=nmask[:, None],
                     other=0.0)
    else:
        ks = tl.load(KS + tile_page * s_ksb + within * s_kst + kvh * s_ksh, mask=nmask, other=0.0)
        vs = tl.load(VS + tile_page * s_vsb + within * s_vst + kvh * s_vsh, mask=nmask, other=0.0)
    return ks, vs


@triton.jit
def compressed_tile(q, m_i, l_i, acc, KC, VC, RES, within, n, nmask, valid, kvh, tile_page, tile_end, full_end,
                    res_row, ks, vs, s_kcb, s_kct, s_kch, s_vcb, s_vct, s_vch, s_rt, s_rh, scale_log2,
                    FMT: tl.constexpr, BITS: tl.constexpr, HEAD_DIM: tl.constexpr, PREC: tl.constexpr,
                    DT: tl.constexpr, VD: tl.constexpr):
    """One key tile of attention over a compressed cache whose scales are per token and head
    (or per layer and head), folded around the dots instead of applied to every element: keys
    scale the scores per column (KIVI: per channel, into q, since a tile lies in one block), values
    scale p per column (KIVI: plus a per-row offset). The tile lies in block ``tile_page`` (the
    launchers see to it); its scales ``ks, vs`` come from ``tile_scales``. q: [M, D];
    within/n/nmask: [N]; valid: [M, N]. Returns the updated (m_i, l_i, acc)."""
    PER: tl.constexpr = 8 // BITS
    OFF: tl.constexpr = 128.0 if DT == tl.bfloat16 else (1024.0 if DT == tl.float16 else 0.0)  # (_magic's)
    # 8-bit codes enter the dots as fp16 in a 16-bit model: e4m3 pairs convert to fp16 in one
    # instruction (to bf16 it takes three per element), and int8 is exact in either
    CT: tl.constexpr = tl.float16 if DT.primitive_bitwidth == 16 else DT
    d = tl.arange(0, HEAD_DIM)
    dp = tl.arange(0, HEAD_DIM // PER)
    wi = within[:, None]
    if FMT == 3:  # (split where used: a split moves the pairs through shared memory, a wait)
        ka, kb = tl.split(ks.to(tl.float32))
        va, vb = tl.split(vs.to(tl.float32))
    else:
        ka = ks.to(tl.float32)
        va = vs.to(tl.float32)
    if FMT == 3:
        sealed = nmask & (n < full_end)
        kcode = tl.load(KC + tile_page * s_kcb + wi * s_kct + kvh * s_kch + dp[None, :], mask=sealed[:, None],
                        other=0)
        qf = q.to(tl.float32)
        qs = (qf * ka[None, :]).to(DT)
        # the codes come as OFF + c: their dot carries OFF * sum(qs), taken off with the mins' term
        corr = tl.sum(qf * kb[None, :], 1) - OFF * tl.sum(qs.to(tl.float32), 1)
        qk = _kivi_dot(qs, kcode, PER, PREC) + corr[:, None]
        if tile_end > full_end:  # the sequence's unsealed last block: full-precision keys
            rm = nmask & (n >= full_end)
            r = tl.load(RES + res_row + (n - full_end)[:, None] * s_rt + kvh * s_rh + d[None, :],
                        mask=rm[:, None], other=0.0).to(DT)
            qk = tl.where(rm[None, :], tl.dot(q, tl.trans(r), input_precision=PREC), qk)
    else:
        kc = _codes(tl.load(KC + tile_page * s_kcb + wi * s_kct + kvh * s_kch + d[None, :], mask=nmask[:, None],
                            other=0), FMT, CT)
        qk = tl.dot(q.to(CT), tl.trans(kc), input_precision=PREC) * ka[None, :]
    qk = tl.where(valid, qk, float("-inf"))
    m_new, l_i, p, alpha = online_softmax_probs(qk, m_i, l_i, scale_log2)
    if FMT == 3:
        vcode = tl.load(VC + tile_page * s_vcb + wi * s_vct + kvh * s_vch + dp[None, :], mask=nmask[:, None],
                        other=0)
        pa = (p * va[None, :]).to(DT)
        corr = tl.sum(p * vb[None, :], 1) - OFF * tl.sum(pa.to(tl.float32), 1)
        pv = _kivi_pv(pa, vcode, PER, PREC) + corr[:, None]
    else:
        # Value codes are channel-major (VD = block size): the product's operand is read with the
        # keys contiguous, in words (a token-major tile is read from shared memory byte by byte:
        # Triton 3.6, sm90). Unmasked, or the loads would not vectorise: a key past the end reads
        # its block's stale codes, which are finite (the cache starts zeroed and only the
        # quantizer writes it, clamped) and meet p * scale = 0.
        vc = _codes(tl.load(VC + tile_page * s_vcb + wi * s_vct + kvh * s_vch + d[None, :] * VD), FMT, CT)
        # p times the value scales, divided by the tile's largest: in [0, 1], where fp16 is exact
        vmax = tl.maximum(tl.max(va, 0), 1e-30)
        pv = tl.dot((p * (va * (1.0 / vmax))[None, :]).to(CT), vc, input_precision=PREC) * vmax
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc

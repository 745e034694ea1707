"""Weight-only quantized products on the integer tensor cores: ``y = x @ dequant(W).T (+ bias)``
for many rows of x, with x split into two int8 halves so that the weight's codes go into the
product as they are, with no decoding (formats: ``wq_gemm.py``).

At a few hundred rows a product is bound by its multiply-adds, and a kernel that decodes each
weight tile to bfloat16 beside the tensor cores (``wq_gemm.wq_mm_wx``) spends instructions and
pipeline slots that cuBLAS's bfloat16 GEMM does not. The integer tensor cores multiply int8 at
twice bfloat16's rate, so two int8 products cost what one bfloat16 product costs, and they read
the codes straight from shared memory:

    split     per row m of x: s_m = max_k |x[m, k]| / 32639, q = round(x / s_m), a 16-bit
              integer, written as hi = (q + 128) >> 8 and lo = q - 256 hi, both in [-128, 127]
              (``split_rows``); a format with mins also keeps each group's sum of x
    product   acc_hi = W_codes @ hi^T and acc_lo = W_codes @ lo^T in int32, exact (|code| <= 128,
              so K up to 2^31 / 2^14 = 131,072 columns cannot overflow); then
              int8 per channel   y = s_m * scale[n] * (256 acc_hi + acc_lo)
              grouped, group j   y = s_m * sum_j (scale[n, j] * (256 acc_hi_j + acc_lo_j)
                                            + min[n, j] * (sum over group j of x[m, :] / s_m))

x is held to 16 bits per row, 2^-16 of the row's largest magnitude, where the weight's own
rounding is 2^-8 of its row's; the weights are the same codes the other kernels read. On the
default model the split moved int8's and int4's perplexity by under 0.01%. Groups (int4's, GGUF
Q8_0's) cost a rescale of the int32 sums per group of columns, which decoding the weight to
bfloat16 does not.

The engine's rule sends it int8 per channel only (``dispatched``: the decoder's projections on
a GPU of compute capability 8.0 or later, not the int8 output head, whose shape was not
measured), from ``KernelConfig.wq_s8_min_rows`` to ``wq_s8_max_rows`` rows (64 to 512 by
default). On an H100, at Llama-3-8B's shapes, int8 per channel at the best tile beat the rule's
other products from 64 to 512 rows of x and lost to dequantize-then-cuBLAS at 2,048, and the
engine's int8 offline throughput rose 3.9% at 256 requests and 1.9% at 1,024. Grouped int4
lost to the other products at every row count, and an engine run with it was slower
(BENCHMARKS.md, "Many-row products on the integer tensor cores").

A program owns BLOCK_N weight rows by BLOCK_M rows of x, the programs of one weight tile
adjacent in launch order (the x tiles vary fastest), so each weight byte is read from memory
about once and x stays in L2. K is split over programs where the tiles alone leave the GPU idle,
as the other products split it (``wq_gemm.split_k``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels import wq_gemm
from kvserve.kernels.common import capability

SPLIT_RANGE = 32639.0  # |q| <= this: (q + 128) >> 8 stays in [-127, 127], q - 256 hi in [-128, 127]
_ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: v + this - this rounds v half to even for |v| < 2^22
_SPLIT_RANGE = tl.constexpr(SPLIT_RANGE)
_SPLIT_BLOCK_K = 1024


@triton.jit
def _split_rows_kernel(X, Q, S, XG, M, K, stride_xm, GROUP: tl.constexpr, HAS_SUM: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """Row m of x: its scale S[m], its 16-bit codes as Q[0, m] (hi) and Q[1, m] (lo), and with
    HAS_SUM its groups' float32 sums XG[m, :] in the codes' unit (x / S[m], unrounded; 0 for a
    row of zeros). Two passes over the row: its largest magnitude, then the codes."""
    m = tl.program_id(0).to(tl.int64)
    row = X + m * stride_xm
    rk = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(row + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
        # (NaN kept: its row's scale is NaN, so the row's outputs are, as any other product's)
        amax = tl.maximum(amax, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
    amax_row = tl.max(amax, axis=0)
    amax_row = tl.where(tl.sum((amax != amax).to(tl.int32), axis=0) > 0, float("nan"), amax_row)
    # Correctly rounded divisions (CUDA's plain one is not), so that the codes are a function of
    # x alone, as PyTorch computes them (``split_rows_ref``).
    rng = tl.full([], _SPLIT_RANGE, tl.float32)
    inv = tl.where(amax_row > 0, tl.math.div_rn(rng, tl.maximum(amax_row, 1e-30)), 0.0)
    tl.store(S + m, tl.math.div_rn(amax_row, rng))
    for k0 in range(0, K, BLOCK_K):
        ok = k0 + rk < K
        x = tl.load(row + k0 + rk, mask=ok, other=0.0).to(tl.float32)
        q = ((x * inv + _ROUND) - _ROUND).to(tl.int32)
        hi = (q + 128) >> 8
        lo = q - hi * 256
        tl.store(Q + m * K + k0 + rk, hi.to(tl.int8), mask=ok)
        tl.store(Q + (M + m) * K + k0 + rk, lo.to(tl.int8), mask=ok)
        if HAS_SUM:  # BLOCK_K is a multiple of GROUP and K of GROUP: whole groups, zeros past K
            NG: tl.constexpr = BLOCK_K // GROUP
            g = tl.sum(tl.reshape(x * inv, [NG, GROUP]), axis=1)
            rg = tl.arange(0, NG)
            tl.store(XG + m * (K // GROUP) + k0 // GROUP + rg, g, mask=k0 + rg * GROUP < K)


def split_rows(x: torch.Tensor, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [M, K] -> (codes [2, M, K] int8: hi then lo, scales [M] float32, and with ``group_size``
    the groups' sums of x / scale [M, K / group_size] float32, else None); see the module
    docstring."""
    M, K = x.shape
    q = torch.empty(2, M, K, dtype=torch.int8, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    xg = torch.empty(M, K // group_size, dtype=torch.float32, device=x.device) if group_size else None
    if M:
        _split_rows_kernel[(M,)](x, q, s, xg if xg is not None else s, M, K, x.stride(0), GROUP=group_size or 1,
                                 HAS_SUM=xg is not None, BLOCK_K=_SPLIT_BLOCK_K, num_warps=4)
    return q, s, xg


def split_rows_ref(x: torch.Tensor, group_size: int = 0):
    """``split_rows`` in PyTorch (the same float32 operations; a Python number over a tensor
    would be its reciprocal times the number, another rounding)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1)
    rng = torch.full_like(amax, SPLIT_RANGE)
    inv = torch.where(amax > 0, rng / amax.clamp_min(1e-30), torch.zeros_like(amax))
    q = torch.round(xf * inv[:, None]).to(torch.int32)
    hi = torch.div(q + 128, 256, rounding_mode="floor")
    lo = q - hi * 256
    xg = (xf * inv[:, None]).view(x.shape[0], -1, group_size).sum(dim=2) if group_size else None
    return torch.stack((hi, lo)).to(torch.int8), amax / rng, xg


@triton.jit
def _s8_kernel(Q, SX, XG, W, S, Z, B, Y, M, N, K, K_TILES, stride_wn, stride_sn, stride_ym, stride_ys,
               INT4: tl.constexpr, GROUPED: tl.constexpr, HAS_MIN: tl.constexpr, GROUP: tl.constexpr,
               HAS_BIAS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (tile, s): Y^T's tile [BLOCK_N, BLOCK_M] from column step s K_TILES on (Y's slice s
    when K is split). Grouped (int4, group-wise int8): BLOCK_K is the group (one scale a row a
    step)."""
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    rn, rn_safe, rm, rm_safe = wq_gemm.weight_left_tile(pid, M, N, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    hi_ptrs = Q + rm_safe[:, None] * K + rk[None, :]
    lo_ptrs = hi_ptrs + M.to(tl.int64) * K
    acc_hi = tl.zeros([BLOCK_N, BLOCK_M], tl.int32)
    acc_lo = tl.zeros([BLOCK_N, BLOCK_M], tl.int32)
    accf = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    k_lo = pid_k * K_TILES * BLOCK_K
    for k0 in range(k_lo, tl.minimum(K, k_lo + K_TILES * BLOCK_K), BLOCK_K):
        if INT4:
            b = wq_gemm._int4_bytes(W, rn_safe, k0, K, stride_wn, BLOCK_K, True)
            w = tl.interleave(b & 15, b >> 4).to(tl.int8)
        else:
            w = tl.load(W + rn_safe[:, None] * stride_wn + k0 + rk[None, :])
        xh = tl.load(hi_ptrs + k0)
        xl = tl.load(lo_ptrs + k0)
        if GROUPED:
            h = tl.dot(w, tl.trans(xh), out_dtype=tl.int32)
            lo = tl.dot(w, tl.trans(xl), out_dtype=tl.int32)
            g = k0 // GROUP
            s = tl.load(S + rn_safe * stride_sn + g).to(tl.float32)
            accf += s[:, None] * (h.to(tl.float32) * 256.0 + lo.to(tl.float32))
            if HAS_MIN:
                z = tl.load(Z + rn_safe * stride_sn + g).to(tl.float32)
                xg = tl.load(XG + rm_safe * (K // GROUP) + g)
                accf += z[:, None] * xg[None, :]
        else:
            acc_hi = tl.dot(w, tl.trans(xh), acc_hi, out_dtype=tl.int32)
            acc_lo = tl.dot(w, tl.trans(xl), acc_lo, out_dtype=tl.int32)
    sx = tl.load(SX + rm_safe)
    if GROUPED:
        y = accf * sx[None, :]
    else:
        y = (acc_hi.to(tl.float32) * 256.0 + acc_lo.to(tl.float32)) * sx[None, :]
        y = y * tl.load(S + rn_safe).to(tl.float32)[:, None]
    if HAS_BIAS:
        y += tl.load(B + rn_safe).to(tl.float32)[:, None]
    out = Y + pid_k.to(tl.int64) * stride_ys + rm[None, :].to(tl.int64) * stride_ym + rn[:, None]
    tl.store(out, y.to(Y.dtype.element_ty), mask=(rm < M)[None, :] & (rn < N)[:, None])


def s8_config(rows: int) -> dict:
    # The best of S8_CONFIGS (benchmarks/weight_quant.py, section s8) for int8 per channel on
    # Llama-3-8B's projections, one H100: 64 x 64 up to 64 rows, 128 weight rows by 64 rows of x
    # with 8 warps from 128 to 2,048 rows, where 64 x 128 took 20-39% longer.
    if rows <= 64:
        return {"BLOCK_N": 64, "BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_N": 128, "BLOCK_M": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3}


MIN_BLOCK_K = 32  # the integer tensor cores' K step for int8


def supports(qweight: torch.Tensor, group_size: int, K: int) -> bool:
    """The product takes this weight: int4, or int8 per channel with K a multiple of 32 or in
    groups of 32 to 128 (GGUF's Q8_0); a grouped weight's column step is its group."""
    if qweight.dtype not in (torch.uint8, torch.int8):
        return False
    if group_size:
        return group_size in (32, 64, 128)
    return qweight.dtype == torch.int8 and K % MIN_BLOCK_K == 0


def dispatched(qweight: torch.Tensor, group_size: int, K: int) -> bool:
    """The engine's rule sends this weight's many-row products here: int8 per channel only, on a
    GPU of compute capability 8.0 or later (the tiles' shared memory and int8 tensor cores were
    measured on 9.0; older GPUs keep the other products). The grouped formats are supported but
    lost to the weight-left GEMM and dequantize-then-cuBLAS at every row count measured (int4
    g128 from 64 to 2,048 rows, one H100): each group's rescale of the float accumulator costs
    more than the integer products save."""
    if qweight.is_cuda and capability(qweight.device) < 8:
        return False
    return group_size == 0 and supports(qweight, group_size, K)


def wq_mm_s8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
             group_size: int = 0, bias: torch.Tensor | None = None, config: dict | None = None,
             split: bool = True) -> torch.Tensor:
    """``wq_gemm.wq_mm``'s product on the integer tensor cores (module docstring), for weights
    ``supports`` takes. ``split``: K split as ``wq_gemm.split_k`` says (a config's ``SPLIT_K``
    overrides it)."""
    N, K, int4 = wq_gemm._check(x, qweight, scales, mins, group_size)
    assert supports(qweight, group_size, K), "the int8 tensor-core product takes int4 and int8 weights (groups >= 32)"
    M = x.shape[0]
    cfg = dict(config or s8_config(M))
    block_m, block_n, block_k = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    if group_size:
        block_k = group_size
    while K % block_k:  # (halved down to 32 at most: ``supports``)
        block_k //= 2
    if M == 0:
        return torch.empty(M, N, dtype=x.dtype, device=x.device)
    q, sx, xg = split_rows(x, group_size if mins is not None else 0)
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    parts, k_tiles = wq_gemm._parts(cfg, tiles, K // block_k, x, int4, split)
    y, out, bias_in = wq_gemm._outputs(x, M, N, parts, bias)
    _s8_kernel[(tiles, parts)](q, sx, xg if xg is not None else sx, qweight, scales,
                               scales if mins is None else mins, bias_in if bias_in is not None else scales,
                               out, M, N, K, k_tiles, qweight.stride(0), scales.stride(0),
                               out.stride(-2), out.stride(0) if parts > 1 else 0,
                               INT4=int4, GROUPED=group_size > 0, HAS_MIN=mins is not None, GROUP=group_size or 1,
                               HAS_BIAS=bias_in is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                               **cfg)
    return wq_gemm._sum_parts(out, bias, y) if parts > 1 else y

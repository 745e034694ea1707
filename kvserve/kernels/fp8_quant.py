"""Per-token e4m3 quantization of activations, the input of an FP8 W8A8 product
(``layers/fp8_linear.py``), in one kernel: for each row r of x [R, K]

    s[r] = max(max_k |x[r, k]| / 448, tiny)          q[r, k] = e4m3(clamp(x[r, k] / s[r], -448, 448))

448 is e4m3's largest finite value. The same numbers as ``fp8_linear.quantize_rows`` (both
divisions rounded to nearest, the codes to the nearest e4m3 value, ties to even), which in plain PyTorch takes six
passes over x, three of them writing float32 copies; here x is read twice per row (its maximum,
then its codes: the second read comes from L2) and the codes and scales written once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_MAX = tl.constexpr(448.0)
_TINY = tl.constexpr(torch.finfo(torch.float32).tiny)
_MAX_BLOCK = 4096  # columns a program reads at a time


@triton.jit
def _round_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still float32, so
    the conversion that follows is exact whatever rounding it does (Triton's interpreter, which
    CI runs, truncates some). Normals (|v| >= 2^-6) keep 3 of float32's 23 mantissa bits, a
    carry moving into the exponent; subnormals are multiples of 2^-9, which adding and taking
    away 1.5 * 2^14 (whose float32 spacing is 2^-9) rounds to."""
    b = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    sub = ((a + 24576.0) - 24576.0).to(tl.int32, bitcast=True) | (b & -0x80000000)  # (-0 stays -0)
    nrm = (b + 0x7FFFF + ((b >> 20) & 1)) & -0x100000
    return tl.where(a < 0.015625, sub, nrm).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows_kernel(X, Q, S, K, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    xr = X + row * stride_x
    qr = Q + row * stride_q
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(xr + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), E4M3_MAX), _TINY)
    for k0 in range(0, K, BLOCK):
        ok = k0 + offs < K
        x = tl.load(xr + k0 + offs, mask=ok, other=0.0).to(tl.float32)
        q = _round_e4m3(tl.clamp(tl.math.div_rn(x, scale), -E4M3_MAX, E4M3_MAX))
        tl.store(qr + k0 + offs, q.to(Q.dtype.element_ty), mask=ok)
    tl.store(S + row, scale)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, K] (unit column stride) -> (e4m3 codes [R, K], float32 scales [R, 1])."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [R, K] with unit column stride"
    R, K = x.shape
    q = torch.empty(R, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(R, 1, dtype=torch.float32, device=x.device)
    if R and K:
        block = min(_MAX_BLOCK, triton.next_power_of_2(K))
        _quantize_rows_kernel[(R,)](x, q, s, K, x.stride(0), q.stride(0), BLOCK=block,
                                    num_warps=8 if block >= 2048 else 4)
    elif R:
        s.fill_(torch.finfo(torch.float32).tiny)
    return q, s

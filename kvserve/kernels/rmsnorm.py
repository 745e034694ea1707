"""Fused residual add + RMSNorm: ``s = x + residual; y = norm(s) * w``, one read of each input.

Rounding follows the PyTorch reference exactly: the sum is rounded to the activation dtype
(the residual stream is stored in it), the normalised value is rounded before the weight
multiply, as ``RMSNorm`` in ``layers/norm.py`` does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.common import pdl_kw, wait_inputs


@triton.jit
def _rmsnorm_kernel(X, R, W, Y, stride_x, stride_r, stride_y, N, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(r.dtype)
        tl.store(R + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / N
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(W + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None, pdl: bool = True) -> torch.Tensor:
    """x: [T, N]. With ``residual``, it is updated in place to ``x + residual`` and the norm of
    that is returned (``(y, residual)`` in the caller's terms). ``pdl``: launch with programmatic
    dependent launch where the GPU has it."""
    assert x.dim() == 2 and x.stride(-1) == 1, "rmsnorm expects a [T, N] row-major tensor"
    T, N = x.shape
    y = torch.empty_like(x)
    if T == 0:
        return y
    r = residual if residual is not None else x
    assert r.stride(-1) == 1
    _rmsnorm_kernel[(T,)](x, r, weight, y, x.stride(0), r.stride(0), y.stride(0), N, eps,
                          HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(N),
                          num_warps=4 if N <= 4096 else 8, **pdl_kw(x, pdl))
    return y


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """Plain PyTorch, same rounding points. Returns (y, new_residual or None)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed, (x if residual is not None else None)

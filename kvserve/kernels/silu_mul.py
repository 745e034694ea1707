"""Fused SiLU-and-multiply: ``silu(gate) * up`` for ``x = [gate | up]``; one read, one write."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.common import pdl_kw, wait_inputs


@triton.jit
def silu_mul_rounded(g, u, DTYPE: tl.constexpr):
    """silu(g) * u in float32 from ``DTYPE`` values, with silu rounded to ``DTYPE`` first, as
    F.silu's output is (also the skinny GEMM's fused epilogue)."""
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(DTYPE)
    return act.to(tl.float32) * u.to(tl.float32)


@triton.jit
def _silu_mul_kernel(X, Y, stride_x, stride_y, N, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    u = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0)
    tl.store(Y + row * stride_y + cols, silu_mul_rounded(g, u, g.dtype).to(Y.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, pdl: bool = True) -> torch.Tensor:
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0
    T, N2 = x.shape
    N = N2 // 2
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    BLOCK = min(2048, triton.next_power_of_2(N))
    _silu_mul_kernel[(T, triton.cdiv(N, BLOCK))](x, y, x.stride(0), y.stride(0), N, BLOCK=BLOCK, num_warps=4,
                                                 **pdl_kw(x, pdl))
    return y


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up

"""Linear layers whose few-row products on CUDA take the skinny-GEMM kernel (``kernels/gemv.py``).

A decode step with a handful of sequences multiplies a few rows by every weight matrix: the step
is the weights streamed once, and cuBLAS's GEMM tiles read them well below the bandwidth the
skinny kernel reaches. Larger batches (prefill, busy decode) keep cuBLAS.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels

# Rows up to which the skinny kernel beats cuBLAS on the H200 (benchmarks/gemv_tune.py): every
# matrix at one row; the wide logits matrix up to 16 rows; the fused gate/up + SiLU up to 32 (in
# the engine's decode step at batch 32). The benchmarks set them to 0 to measure cuBLAS in the
# same process.
GEMV_MAX_ROWS = {"linear": 1, "gate_up_silu": 32, "logits": 16}


def takes_gemv(x: torch.Tensor, weight: torch.Tensor, kind: str = "linear") -> bool:
    return (x.dim() == 2 and 1 <= x.shape[0] <= GEMV_MAX_ROWS[kind] and kernels.available(x)
            and weight.stride(-1) == 1 and x.stride(-1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           kind: str = "linear") -> torch.Tensor:
    if takes_gemv(x, weight, kind):
        from kvserve.kernels.gemv import gemv
        return gemv(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def gate_up_silu(x: torch.Tensor, gate_up: nn.Linear) -> torch.Tensor:
    """``silu(x W_g.T) * (x W_u.T)`` for the merged [gate | up] matrix: one kernel for few rows."""
    if gate_up.bias is None and takes_gemv(x, gate_up.weight, "gate_up_silu"):
        from kvserve.kernels.gemv import gemv
        return gemv(x, gate_up.weight, silu_mul=True)
    from kvserve.layers.activation import silu_and_mul
    return silu_and_mul(gate_up(x))

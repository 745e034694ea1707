"""Linear layers whose few-row products on CUDA take the skinny-GEMM kernel (``kernels/gemv.py``).

A decode step with a handful of sequences multiplies a few rows by every weight matrix: the step
is the weights streamed once, and cuBLAS's GEMM tiles read them well below the bandwidth the
skinny kernel reaches. Larger batches (prefill, busy decode) keep cuBLAS. The row limits per kind
of product (``KernelConfig.gemv_max_rows_*``: every matrix at one row, the wide logits matrix up
to 16, the fused gate/up + SiLU up to 32, as tuned on an H200 with ``benchmarks/gemv_tune.py``)
come from the step's ``ForwardContext``, as everything per step does: the model code carries no
configuration.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels
from kvserve.config import KernelConfig
from kvserve.layers.forward_context import kernel_config
from kvserve.layers.weight_init import initialising


def takes_gemv(x: torch.Tensor, weight: torch.Tensor, kind: str = "linear", kernel: KernelConfig | None = None) -> bool:
    """Whether ``x @ weight.T`` runs in the skinny-GEMM kernel: a product of ``kind`` ("linear",
    "gate_up_silu", "logits") of at most ``kernel``'s row limit (None: the step's), on CUDA."""
    rows = (kernel or kernel_config()).gemv_max_rows(kind)
    return (x.dim() == 2 and 1 <= x.shape[0] <= rows and kernels.available(x)
            and weight.stride(-1) == 1 and x.stride(-1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           kind: str = "linear") -> torch.Tensor:
    kernel = kernel_config()
    if takes_gemv(x, weight, kind, kernel):
        from kvserve.kernels.gemv import gemv
        return gemv(x, weight, bias, pdl=kernel.pdl)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def reset_parameters(self) -> None:
        if initialising():  # not while building for weights loaded next (layers/weight_init.py)
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def gate_up_silu(x: torch.Tensor, gate_up: nn.Module) -> torch.Tensor:
    """``silu(x W_g.T) * (x W_u.T)`` for the merged [gate | up] matrix: one kernel for few rows
    (a quantized matrix: its product, then the activation)."""
    kernel = kernel_config()
    if isinstance(gate_up, nn.Linear) and gate_up.bias is None and takes_gemv(x, gate_up.weight, "gate_up_silu",
                                                                              kernel):
        from kvserve.kernels.gemv import gemv
        return gemv(x, gate_up.weight, silu_mul=True, pdl=kernel.pdl)
    from kvserve.layers.activation import silu_and_mul
    return silu_and_mul(gate_up(x))

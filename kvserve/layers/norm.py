import torch
from torch import nn

from kvserve import kernels
from kvserve.layers.forward_context import kernel_config


class RMSNorm(nn.Module):
    """RMSNorm computed in float32; ``forward(x, residual)`` fuses the residual add first.

    On CUDA one Triton kernel does both and updates ``residual`` in place; elsewhere plain
    PyTorch with the same rounding points."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dim() == 2 and kernels.available(x):
            from kvserve.kernels.rmsnorm import rmsnorm
            y = rmsnorm(x, self.weight, self.eps, residual, pdl=kernel_config().pdl)
            return y if residual is None else (y, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

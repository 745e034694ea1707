import torch
import torch.nn.functional as F

from kvserve import kernels
from kvserve.layers.forward_context import kernel_config


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dimension (one fused Triton
    kernel on CUDA)."""
    if x.dim() == 2 and kernels.available(x):
        from kvserve.kernels.silu_mul import silu_and_mul as fused
        return fused(x, pdl=kernel_config().pdl)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

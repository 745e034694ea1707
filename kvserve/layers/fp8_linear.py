"""FP8 W8A8 linear layers: e4m3 weights with one scale per output channel, activations quantized
to e4m3 per token at run time, one ``torch._scaled_mm`` for the product.

    weights      w[n, k] ~ qw[n, k] * sw[n],   sw[n] = max_k |w[n, k]| / 448    (at load)
    activations  x[m, k] ~ qx[m, k] * sx[m],   sx[m] = max_k |x[m, k]| / 448    (every product)
    product      y[m, n] = sx[m] * sw[n] * sum_k qx[m, k] qw[n, k]  (+ bias)

448 is e4m3's largest finite value, so the largest element of a row or channel lands on it and
nothing saturates. ``_scaled_mm`` takes these row-wise scales on Hopper (bfloat16 out) and on
the CPU in PyTorch 2.13 (older CPU builds take one scale per tensor); elsewhere the layer
multiplies the dequantized operands in x's dtype (``fp8_mm_ref``, the same math) so every
device runs it. On CUDA the activations are quantized in one kernel (``kernels/fp8_quant.py``,
the same numbers as ``quantize_rows``).

On a GPU a product of few rows (decode steps, up to the kernel config's ``wq_skinny_max_rows``)
reads each weight once and does little arithmetic: there the e4m3 weights meet the activations
unquantized (W8A16) in the kernels of the other weight-only formats (``kernels/wq_gemm.py``; one
row in ``kernels/wq_gemv.py``, as int8's), which decode them in registers; more rows take
``_scaled_mm``.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from kvserve import kernels
from kvserve.layers.forward_context import kernel_config

E4M3_MAX = 448.0
_TINY = torch.finfo(torch.float32).tiny


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, K] -> (e4m3 codes [R, K], float32 scales [R, 1]), one scale per row."""
    amax = t.detach().abs().amax(dim=-1, keepdim=True).float()
    # Over a tensor, not a Python number: CUDA divides by a number as a product with its
    # reciprocal, which can land an ulp off the rounded quotient (the CPU's, the kernel's).
    scale = (amax / amax.new_tensor(E4M3_MAX)).clamp(min=_TINY)
    q = (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_mm_ref(x: torch.Tensor, qweight: torch.Tensor, wscale: torch.Tensor,
               dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Plain PyTorch: x quantized per token, both operands dequantized to ``dtype``, multiplied."""
    qx, sx = quantize_rows(x)
    return (qx.to(dtype) * sx.to(dtype)) @ (qweight.to(dtype) * wscale.to(dtype)[:, None]).t()


def scaled_mm_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``_scaled_mm`` takes row-wise scales here: the CPU where this PyTorch's does
    (``cpu_rowwise_scaled_mm``), or a CUDA GPU of compute capability 9.0+ with bfloat16 out."""
    if device.type == "cpu":
        return cpu_rowwise_scaled_mm()
    return (device.type == "cuda" and dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device) >= (9, 0))


@torch.compiler.assume_constant_result
def cpu_rowwise_scaled_mm() -> bool:
    """This PyTorch's CPU ``_scaled_mm`` takes a scale per row of each operand (2.13 does; 2.11's
    takes one scale per tensor and fails an internal assert otherwise). A compiled step takes the
    answer as a constant (it never changes in a process) rather than tracing the cached trial,
    whose ``functools.cache`` wrapper the compiler would trace through."""
    return _cpu_rowwise_trial()


@functools.cache
def _cpu_rowwise_trial() -> bool:
    """``cpu_rowwise_scaled_mm``'s answer: tried once, on a tiny product."""
    a = torch.zeros(2, 16, dtype=torch.float8_e4m3fn)
    b = torch.zeros(16, 16, dtype=torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 16), out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


class Fp8Linear(nn.Module):
    """``x @ W.T + bias`` in FP8 W8A8 (see the module's docstring)."""

    def __init__(self, in_features: int, out_features: int, qweight: torch.Tensor, wscale: torch.Tensor,
                 bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", qweight)  # [N, K] e4m3
        self.register_buffer("wscale", wscale)  # [N] float32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, layer: nn.Linear) -> Fp8Linear:
        q, s = quantize_rows(layer.weight)
        return cls(layer.in_features, layer.out_features, q, s.view(-1), layer.bias)

    def extra_repr(self) -> str:
        return f"fp8 e4m3, in_features={self.in_features}, out_features={self.out_features}"

    def silu_mul_one_row(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(x W_gate.T) * (x W_up.T) of this merged [gate | up] layer for x of one row on CUDA
        in the one-row kernel, as ``QuantLinear.silu_mul_one_row``; None where it does not apply."""
        if not (self.bias is None and self.out_features % 2 == 0):
            return None
        from kvserve.kernels import wq_gemv
        kernel = kernel_config()
        if not (kernel.wq_fused_silu and kernel.wq_skinny_max_rows >= 1 and wq_gemv.takes(self.qweight, 0)):
            return None
        return wq_gemv.wq_gemv(x.contiguous(), self.qweight, self.wscale, None, 0, None, self.out_features // 2,
                               self.in_features, False, pdl=kernel.pdl, silu_mul=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        if kernels.available(x) and x.shape[0] <= kernel_config().wq_skinny_max_rows:
            from kvserve.kernels.wq_gemm import wq_mm
            y = wq_mm(x.contiguous(), self.qweight, self.wscale, bias=self.bias)
            return y.view(*shape[:-1], self.out_features)
        if scaled_mm_supported(x.device, x.dtype):
            if kernels.available(x):  # one kernel instead of six passes over x
                from kvserve.kernels.fp8_quant import quantize_rows as quantize_rows_cuda
                qx, sx = quantize_rows_cuda(x.contiguous())
            else:
                qx, sx = quantize_rows(x)
            y = torch._scaled_mm(qx, self.qweight.t(), scale_a=sx, scale_b=self.wscale.view(1, -1),
                                 out_dtype=x.dtype)
        else:
            y = fp8_mm_ref(x, self.qweight, self.wscale, x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def check_device(device: torch.device) -> None:
    """Refuse FP8 on a GPU without FP8 arithmetic (before compute capability 8.9)."""
    from kvserve.errors import ConfigError
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ConfigError("quantization", f"fp8 needs a GPU with FP8 support (compute capability 8.9 or "
                          f"later); {torch.cuda.get_device_name(device)} is {major}.{minor}: use int8 or int4")

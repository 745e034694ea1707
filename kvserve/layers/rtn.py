"""Round-to-nearest (RTN) weight quantization: the stored formats of the quantized linear layers.

    int8  q [N, K] int8, symmetric per output channel:   w[n, k] ~ q[n, k] * scale[n]
          scale = max|w[n, :]| / 127, q in [-127, 127]
    int4  q [N, K // 2] uint8, two columns per byte (column 2j in the low nibble, 2j + 1 in the
          high one), asymmetric per group of ``g`` input columns, with the group's minimum as
          the offset (GGUF's Q4_1 and PyTorch's tinygemm keep the same information):
                                                         w[n, k] ~ q[n, k] * scale[n, k // g] + min[n, k // g]
          scale = (max - min) / 15, q in [0, 15]

Scales and minimums are stored in the model's dtype and rounded to it before the weights are
rounded, so the codes are chosen against the scales the kernels will use.
"""
from __future__ import annotations

import torch


def _stored(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in the stored dtype, kept away from zero (an all-zero row or group)."""
    return t.to(dtype).clamp(min=torch.finfo(dtype).tiny)


def quantize_int8(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scale [N] in ``dtype``)."""
    w = w.float()
    scale = _stored(w.abs().amax(dim=1) / 127, dtype)
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(w: torch.Tensor, group_size: int, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] (``group_size`` divides K) -> (q uint8 [N, K // 2], scale and min [N, K // g] in
    ``dtype``)."""
    N, K = w.shape
    assert K % group_size == 0 and group_size % 2 == 0, (K, group_size)
    wg = w.float().view(N, K // group_size, group_size)
    lo = wg.amin(dim=-1).to(dtype)
    scale = _stored((wg.amax(dim=-1) - lo.float()) / 15, dtype)
    q = torch.round((wg - lo.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.uint8)
    return pack_int4(q.view(N, K)), scale, lo


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in [0, 15] -> [N, K // 2] uint8, column 2j low, 2j + 1 high."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K // 2] uint8 -> codes [N, K] uint8."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).view(packed.shape[0], -1)

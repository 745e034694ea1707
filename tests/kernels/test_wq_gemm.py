"""The weight-only quantized kernels (``kvserve/kernels/wq_gemm.py``) against dequantize-then-matmul
in float64, on weights quantized by ``kvserve/layers/rtn.py``.

Covers one row (the elementwise path), 2..32 rows (the skinny ``tl.dot`` path) and more (the tiled
GEMM, several row tiles, the last partial), int8, e4m3 (an FP8 layer's weights, decoded from their
bits in the kernel) and int4 with every group size, K a multiple of the
tile and not (the last tile masked in whole groups), N that the tile does not divide, bias, and the
``dequantize`` kernel that feeds cuBLAS at large batches. The output is poisoned first so an
unwritten element fails.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernelutil import needs_cuda  # noqa: E402

from kvserve.kernels.wq_gemm import dequantize, dequantize_ref, wq_mm, wq_mm_ref  # noqa: E402
from kvserve.layers.fp8_linear import quantize_rows  # noqa: E402
from kvserve.layers.rtn import quantize_int4, quantize_int8  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter internals

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _case(M, N, K, method, group, dtype, device, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * K ** -0.5 + 0.01  # groups not centred on zero
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    b = torch.randn(N, generator=g).to(dtype).to(device) if bias else None
    if method == "int8":
        q, s = quantize_int8(w.to(device), dtype)
        return x, (q, s, None, 0), b
    if method == "fp8":  # (the FP8 layer's own quantizer: e4m3 codes, one float32 scale a row)
        q, s = quantize_rows(w.to(device))
        return x, (q, s.view(-1), None, 0), b
    q, s, z = quantize_int4(w.to(device), group, dtype)
    return x, (q, s, z, group), b


def _check(M, N, K, method, group, dtype, device, seed, config=None, bias=False):
    x, packed, b = _case(M, N, K, method, group, dtype, device, seed, bias)
    y = wq_mm(x, *packed, bias=b, config=config)
    ref = wq_mm_ref(x, *packed, bias=b)
    assert y.shape == (M, N) and y.dtype == dtype
    assert not y.isnan().any()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], err


FORMATS = [("int8", 0), ("fp8", 0), ("int4", 32), ("int4", 64), ("int4", 128)]


@pytest.mark.parametrize("method,group", FORMATS)
@pytest.mark.parametrize("N,K", [(37, 256), (64, 384), (5, 1152)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_one_row(method, group, N, K, dtype, device):
    """K of one tile, of a partial tile (384 < 1024) and of one full and one partial tile."""
    _check(1, N, K, method, group, dtype, device, seed=N + K + group, bias=N == 37)


@pytest.mark.parametrize("method,group", FORMATS)
@pytest.mark.parametrize("M", [2, 7, 16, 32])
@pytest.mark.parametrize("N,K", [(37, 384), (70, 256)])
def test_few_rows(method, group, M, N, K, device):
    _check(M, N, K, method, group, torch.float32, device, seed=M * 11 + N + group, bias=M == 7)


@pytest.mark.parametrize("method,group", FORMATS)
@pytest.mark.parametrize("M", [33, 100])
def test_tiled(method, group, M, device):
    """Row tiles of 32 (smaller than the default, so M spans several) over N and K tiles, the
    last of each partial."""
    cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}
    _check(M, 45, 384, method, group, torch.float32, device, seed=M + group, config=cfg, bias=True)


@pytest.mark.parametrize("method,group", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_dequantize(method, group, dtype, device):
    _, (q, s, z, gs), _ = _case(1, 37, 384, method, group, dtype, device, seed=group + 3)
    w = dequantize(q, s, z, gs, dtype=dtype)
    ref = dequantize_ref(q, s, z, gs)
    assert w.dtype == dtype and w.shape == ref.shape
    # Exact in half precision. In float32 the GPU may contract q * s + m into one fused
    # multiply-add where the reference rounds the product first: up to an ulp of the product, which
    # is absolute (the sum can cancel to near zero), so the bound is an ulp of the largest weight.
    atol = 2.0**-22 * ref.abs().max().item() if dtype == torch.float32 else 0.0
    torch.testing.assert_close(w.float(), ref.to(dtype).float(), rtol=0, atol=atol)


@pytest.mark.parametrize("method,group", [f for f in FORMATS if f[0] != "fp8"])
def test_rtn_error_is_half_a_step(method, group):
    """Each weight comes back within half a quantization step of the original (float32 scales)."""
    g = torch.Generator().manual_seed(group + 1)
    w = torch.randn(24, 256, generator=g) * 0.05 + 0.02
    if method == "int8":
        q, s = quantize_int8(w, torch.float32)
        step = s[:, None]
        assert q.dtype == torch.int8 and q.abs().max() == 127
    else:
        q, s, z = quantize_int4(w, group, torch.float32)
        step = s.repeat_interleave(group, dim=1)
        assert q.dtype == torch.uint8 and q.shape == (24, 128)
    err = (dequantize_ref(q, s, None if method == "int8" else z, group) - w).abs()
    assert (err <= step * 0.5 * (1 + 1e-5) + 1e-7).all()


@needs_cuda
@pytest.mark.parametrize("method,group", FORMATS)
@pytest.mark.parametrize("M", [1, 4, 16, 24, 64, 256])
def test_real_size_bf16(method, group, M):
    """Llama-3-8B's down projection in bfloat16 at every shape of program."""
    _check(M, 4096, 14336, method, group, torch.bfloat16, torch.device("cuda"), seed=M + group)

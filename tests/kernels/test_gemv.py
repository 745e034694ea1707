"""The skinny-GEMM kernel (``kvserve/kernels/gemv.py``) against PyTorch's linear in float64.

Covers one row (the elementwise path), 2..16 rows (the ``tl.dot`` path) and 17..32 (the weights
on the product's M side), K that the tile divides and K that it does not, N that the tile does not
divide (the last program's rows are clamped reads whose results must be dropped), bias, the fused
SiLU-and-mul epilogue and strided rows of x. The output is poisoned first so an unwritten element fails.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernelutil import DTYPE_NO, needs_cuda  # noqa: E402

from kvserve.kernels.gemv import gemv, gemv_ref

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter internals

# bfloat16 elementwise math is fine in the interpreter; its tl.dot is not (kernelutil).
_bf16_dot = pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 tl.dot: CUDA only")
# bfloat16 keeps 8 bits: the fused SiLU path rounds four times (g, u, silu(g), the product)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _case(M, N, K, dtype, device, seed, silu=False, bias=False, x_stride=None):
    g = torch.Generator().manual_seed(seed)
    xs = torch.full((M, x_stride or K), float("nan"))
    xs[:, :K] = torch.randn(M, K, generator=g)
    x = xs.to(dtype).to(device)[:, :K]
    w = (torch.randn(2 * N if silu else N, K, generator=g) * K ** -0.5).to(dtype).to(device)
    b = (torch.randn(N, generator=g)).to(dtype).to(device) if bias else None
    return x, w, b


def _check(M, N, K, dtype, device, seed, config=None, **kw):
    silu = kw.get("silu", False)
    x, w, b = _case(M, N, K, dtype, device, seed, **kw)
    y = gemv(x, w, b, silu_mul=silu, config=config)
    ref = gemv_ref(x.double(), w.double(), None if b is None else b.double(), silu_mul=silu)
    assert y.shape == (M, N) and y.dtype == dtype
    assert not y.isnan().any()
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
# (131, 4096) repeats what (130, 1536) and (37, 2048) show at twice the interpreter's time: CI only.
@pytest.mark.parametrize("N,K", [(96, 256), (37, 100), (130, 1536), (37, 2048),
                                 pytest.param(131, 4096, marks=pytest.mark.slow)])
@pytest.mark.parametrize("silu,bias", [(False, False), (False, True), (True, False)])
def test_one_row(dtype, N, K, silu, bias, device):
    """K a multiple of the tile (unmasked loads, one or several tiles) and not; N=37 and 131
    end in a partial row block."""
    _check(1, N, K, dtype, device, seed=N + K + DTYPE_NO[dtype], silu=silu, bias=bias)


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("N,K,silu", [(37, 100, False), (131, 1536, True), (96, 2048, False)])
def test_one_row_prefetch_depth(prefetch, N, K, silu, device):
    """One and two weight tiles asked for ahead, over K of one tile, of several, and not a
    multiple of the tile (the tiles ahead run past K: masked)."""
    cfg = {"BLOCK_N": 2, "BLOCK_K": 256, "PREFETCH": prefetch, "num_warps": 4, "num_stages": 1}
    _check(1, N, K, torch.float32, device, seed=N + K + prefetch, config=cfg, silu=silu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=_bf16_dot)], ids=str)
@pytest.mark.parametrize("M", [2, 5, 16])
@pytest.mark.parametrize("N,K,silu,bias", [(64, 256, False, True), (37, 100, True, False), (70, 96, False, False)])
def test_few_rows(dtype, M, N, K, silu, bias, device):
    _check(M, N, K, dtype, device, seed=M * 7 + N + DTYPE_NO[dtype], silu=silu, bias=bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=_bf16_dot)], ids=str)
@pytest.mark.parametrize("M", [17, 32])
@pytest.mark.parametrize("N,K,silu,bias", [(130, 256, False, True), (37, 100, True, False), (70, 96, False, False)])
def test_rows_on_n(dtype, M, N, K, silu, bias, device):
    """17 to 32 rows: the tile of W is the product's first operand (y^T = W x^T), x padded to 32
    rows; tiles smaller than the default so K spans several, N ends in a partial block."""
    cfg = {"BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2, "W_ON_M": True}
    _check(M, N, K, dtype, device, seed=M * 7 + N + DTYPE_NO[dtype], config=cfg, silu=silu, bias=bias)
    _check(M, N, K, dtype, device, seed=M * 7 + N + 1, silu=silu, bias=bias)  # the default tile


def test_strided_rows(device):
    _check(3, 48, 128, torch.float32, device, seed=5, x_stride=160)
    _check(1, 48, 128, torch.float32, device, seed=6, x_stride=160)


def test_bad_input(device):
    x = torch.randn(17, 64, device=device)
    with pytest.raises(AssertionError, match="1..32 rows"):
        gemv(torch.randn(33, 64, device=device), torch.randn(32, 64, device=device))
    with pytest.raises(AssertionError, match="row-major"):
        gemv(x[:2], torch.randn(32, 48, device=device))


@needs_cuda
@pytest.mark.parametrize("M", [1, 4, 16, 17, 32])
@pytest.mark.parametrize("N,K,silu", [(6144, 4096, False), (4096, 14336, False), (14336, 4096, True),
                                      (128256, 4096, False)])
def test_real_size(M, N, K, silu):
    _check(M, N, K, torch.bfloat16, torch.device("cuda"), seed=M + N, silu=silu)

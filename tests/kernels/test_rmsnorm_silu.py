"""Fused residual-add + RMSNorm (``kvserve/kernels/rmsnorm.py``) and SiLU-and-mul
(``kvserve/kernels/silu_mul.py``) against their PyTorch references.

In float16/bfloat16 both kernels round at the same points as the references, so the results
agree bit for bit except where the float32 intermediate (a variance summed in another order, an
exp of another library) lands within an ulp of a rounding boundary: rare last-place differences
(measured on the CPU in float16: about 1 element in 50,000 for rmsnorm, 1 in 7,000 for silu).
A kernel that rounds at other points differs in about a quarter of the elements, so the checks
are: at most 0.5% of elements differ, none by more than 2 ulps. The residual sum is one rounded
add: exact in every dtype. float32 differs in the last bits: relative error < 1e-6.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernelutil import DTYPE_NO, needs_cuda  # noqa: E402
from kernelutil import ROUNDING_DTYPES as DTYPES  # noqa: E402

from kvserve.kernels.rmsnorm import rmsnorm, rmsnorm_ref
from kvserve.kernels.silu_mul import silu_and_mul, silu_and_mul_ref

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter internals


def assert_matches(out: torch.Tensor, ref: torch.Tensor):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any()
    o, r = out.double(), ref.double()
    if out.dtype == torch.float32:
        assert ((o - r).norm() / r.norm()).item() < 1e-6
        return
    differ = out != ref
    assert differ.double().mean().item() <= 0.005, f"{int(differ.sum())} of {differ.numel()} differ"
    eps = torch.finfo(out.dtype).eps  # one ulp of x is at most eps * |x|
    assert ((o - r).abs() <= 2 * eps * r.abs()).all(), (o - r).abs().max().item()


def _rows(gen, T, N, dtype, device, stride=None, scale=3.0):
    """[T, N] random rows; with ``stride``, a view into wider rows (its tail columns NaN)."""
    x = torch.full((T, stride or N), float("nan"))
    x[:, :N] = torch.randn(T, N, generator=gen) * scale
    return x.to(dtype).to(device)[:, :N]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,N,stride", [(7, 96, None), (3, 256, 320), (2, 4100, None)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm(device, T, N, stride, dtype, with_residual):
    """N: not a power of two (masked lanes), strided rows, and one past 4096 (8 warps)."""
    gen = torch.Generator().manual_seed(N * 10 + T + 1000 * DTYPE_NO[dtype] + with_residual)
    x = _rows(gen, T, N, dtype, device, stride)
    x0 = x.clone()
    w = (torch.rand(N, generator=gen) + 0.5).to(dtype).to(device)
    eps = 1e-6 if N != 256 else 1e-5
    if with_residual:
        res = _rows(gen, T, N, dtype, device, stride, scale=1.0)
        res0 = res.clone()
        y = rmsnorm(x, w, eps, residual=res)
        y_ref, res_ref = rmsnorm_ref(x0, w, eps, residual=res0)
        assert torch.equal(res, res_ref)  # updated in place to x + residual, one rounding: exact
        if stride:
            assert res._base[:, N:].isnan().all()  # nothing written past the row's end
    else:
        y = rmsnorm(x, w, eps)
        y_ref, res_ref = rmsnorm_ref(x0, w, eps)
        assert res_ref is None
    assert torch.equal(x, x0)  # x itself is never written
    assert_matches(y, y_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,N,stride", [(5, 96, None), (3, 2500, None), (4, 64, 200)])
def test_silu_and_mul(device, T, N, stride, dtype):
    """N: not a power of two; 2500 takes two column blocks of 2048, the second partial; strided
    rows (the columns past 2N are NaN: read, they would show)."""
    gen = torch.Generator().manual_seed(N * 10 + T + 1000 * DTYPE_NO[dtype])
    x = _rows(gen, T, 2 * N, dtype, device, stride)
    x0 = x.clone()
    y = silu_and_mul(x)
    assert torch.equal(x, x0)
    assert_matches(y, silu_and_mul_ref(x0))


def test_empty(device):
    x = torch.empty(0, 64, device=device)
    assert rmsnorm(x, torch.ones(64, device=device), 1e-6).shape == (0, 64)
    assert silu_and_mul(x).shape == (0, 32)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("N", [4096, 8192])
def test_rmsnorm_real_size(device, dtype, N):
    gen = torch.Generator().manual_seed(N + DTYPE_NO[dtype])
    x = _rows(gen, 4096, N, dtype, device)
    res = _rows(gen, 4096, N, dtype, device, scale=1.0)
    w = (torch.rand(N, generator=gen) + 0.5).to(dtype).to(device)
    res0 = res.clone()
    y = rmsnorm(x, w, 1e-5, residual=res)
    y_ref, res_ref = rmsnorm_ref(x, w, 1e-5, residual=res0)
    assert torch.equal(res, res_ref)
    assert_matches(y, y_ref)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_silu_and_mul_real_size(device, dtype):
    gen = torch.Generator().manual_seed(14336 + DTYPE_NO[dtype])
    x = _rows(gen, 2048, 2 * 14336, dtype, device)
    assert_matches(silu_and_mul(x), silu_and_mul_ref(x))

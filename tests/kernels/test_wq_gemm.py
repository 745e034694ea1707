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

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kernelutil import needs_cuda  # noqa: E402

from kvserve.config import KernelConfig  # noqa: E402
from kvserve.errors import ConfigError  # noqa: E402
from kvserve.kernels import wq_gemm, wq_gemv  # noqa: E402
from kvserve.kernels.wq_gemm import dequantize, dequantize_ref, wq_mm, wq_mm_ref, wq_mm_wx, wx_block_k  # noqa: E402
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
    if method.startswith("int8g"):  # group-wise int8, as GGUF's Q8_0 / Q6_K repack (with mins: "int8gm")
        wg = w.view(N, K // group, group)
        s = wg.abs().amax(dim=2).clamp_min(1e-8) / 127
        q = (wg / s[..., None]).round().clamp(-128, 127).to(torch.int8).view(N, K)
        z = (torch.randn(N, K // group, generator=g) * 0.01).to(dtype).to(device) if method == "int8gm" else None
        return x, (q.to(device), s.to(dtype).to(device), z, group), b
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


FORMATS = [("int8", 0), ("fp8", 0), ("int4", 32), ("int4", 64), ("int4", 128), ("int8g", 16), ("int8gm", 32)]


@pytest.mark.parametrize("method,group", FORMATS)
@pytest.mark.parametrize("N,K", [(37, 256), (64, 384), (5, 1152)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_one_row(method, group, N, K, dtype, device):
    """K of one tile, of a partial tile (384 < 1024) and of one full and one partial tile."""
    _check(1, N, K, method, group, dtype, device, seed=N + K + group, bias=N == 37)


@pytest.mark.parametrize("method,group", FORMATS)
@pytest.mark.parametrize("cfg", [{"KIND": "triton", "BLOCK_N": 2, "TILE_BYTES": 128, "PREFETCH": 1, "num_warps": 2},
                                 {"KIND": "triton", "BLOCK_N": 8, "TILE_BYTES": 256, "PREFETCH": 2, "num_warps": 4}],
                         ids=["p1", "p2"])
@pytest.mark.parametrize("N,K", [(19, 1152), (6, 640)])
def test_one_row_tiles(method, group, cfg, N, K, device):
    """The one-row word kernel's tiles smaller than K, so that a row spans several (K = 1152:
    4.5 tiles of 256 int8 columns; 640: an int8 row of 160 words, per channel 2.5 tiles of 64),
    both prefetch depths, and N below and past BLOCK_N."""
    _check(1, N, K, method, group, torch.float32, device, seed=N + K + group, config=cfg, bias=N == 19)


@pytest.mark.parametrize("method,group", FORMATS)
@pytest.mark.parametrize("N,K,cfg", [
    (37, 256, None),  # N: an odd number of outputs, not a multiple of a program's
    (64, 1152, {"KIND": "triton", "BLOCK_N": 2, "TILE_BYTES": 128, "PREFETCH": 2, "num_warps": 2}),
    (5, 640, {"KIND": "triton", "BLOCK_N": 8, "TILE_BYTES": 256, "PREFETCH": 1, "num_warps": 4}),
], ids=["default", "p2", "p1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_row_silu_mul(method, group, N, K, cfg, dtype, device):
    """The fused SiLU-and-multiply of the merged [gate | up] weight (2N rows): silu(x W_g.T) *
    (x W_u.T) as PyTorch computes it from the exact product (float64, rounded to x's dtype as the
    unfused product's output is), each output checked, none left unwritten."""
    if dtype == torch.bfloat16 and device.type == "cpu":
        dtype = torch.float16  # (the interpreter has no bfloat16 conversion of its own)
    x, (q, s, z, g), _ = _case(1, 2 * N, K, method, group, dtype, device, seed=2 * N + K + group)
    y = wq_gemv.wq_gemv(x, q, s, z, g, None, N, K, method == "int4", cfg, silu_mul=True)
    h = wq_mm_ref(x, q, s, z, g).to(dtype)
    ref = (F.silu(h[:, :N].float()).to(dtype).float() * h[:, N:].float()).to(dtype)
    assert y.shape == (1, N) and y.dtype == dtype and not y.isnan().any()
    err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < TOL[dtype], err
    # each output is its own gate and up row's: a swap or a shifted row would show here
    tol = 4 * TOL[dtype]
    torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())


# (a CPU QuantLinear keeps int4 in PyTorch's CPU layout, which the CUDA kernels do not read)
@pytest.mark.parametrize("method", ["int8", "int8-act-order", pytest.param("int4", marks=needs_cuda), "fp8"])
def test_one_row_silu_mul_in_the_layer(monkeypatch, method, device):
    """A CUDA quantized layer (QuantLinear, Fp8Linear) of the merged gate/up weight at one row
    takes the fused kernel (and gives the unfused product's activation), unless
    ``KernelConfig.wq_fused_silu`` is off or the row count is not one. An act-order layer (its
    input columns permuted, as GPTQ's) permutes x first."""
    from kvserve import kernels
    from kvserve.config import QuantConfig
    from kvserve.layers import fp8_linear, linear, quant_linear
    from kvserve.layers.activation import silu_and_mul
    torch.manual_seed(5)
    dense = torch.nn.Linear(256, 2 * 48, bias=False)
    layer = (fp8_linear.Fp8Linear.from_linear(dense) if method == "fp8" else
             quant_linear.QuantLinear.from_linear(dense.to(device), QuantConfig(
                 method.removesuffix("-act-order"), group_size=32 if method == "int4" else None)))
    layer = layer.to(device)
    if method.endswith("act-order"):
        layer.perm = torch.randperm(256, device=device)
    monkeypatch.setattr(kernels, "available", lambda t: True)  # the CUDA path (the interpreter's on a CPU)
    calls = []
    real = wq_gemv.wq_gemv
    monkeypatch.setattr(wq_gemv, "wq_gemv", lambda *a, **k: calls.append(k.get("silu_mul", False)) or real(*a, **k))
    for rows, fused, expect in ((1, True, [True]), (1, False, []), (2, True, [])):
        for module in (quant_linear, fp8_linear):
            monkeypatch.setattr(module, "kernel_config", lambda fused=fused: KernelConfig(wq_fused_silu=fused))
        x = torch.randn(rows, 256, device=device)
        calls.clear()
        y = linear.gate_up_silu(x, layer)
        assert [c for c in calls if c] == expect, (rows, fused, calls)
        ref = silu_and_mul(layer(x))
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_one_row_config_is_refused_elsewhere(device):
    """A one-row tile (``KIND``) given to a product of several rows, or of FP8 codes whose rows are
    not whole words, is a clear error, not a missing key deep in the launcher."""
    x, packed, _ = _case(2, 8, 64, "int8", 0, torch.float32, device, seed=1)
    cfg = {"KIND": "triton", "BLOCK_N": 4, "TILE_BYTES": 64, "PREFETCH": 1, "num_warps": 2}
    with pytest.raises(AssertionError, match="one-row config"):
        wq_mm(x, *packed, config=cfg)
    x, packed, _ = _case(1, 8, 66, "fp8", 0, torch.float32, device, seed=1)
    with pytest.raises(AssertionError, match="one-row config"):
        wq_mm(x, *packed, config=cfg)


def test_one_row_strided_rows(device):
    """Rows that do not start on 4-byte boundaries (a column slice of a wider int8 weight) still
    compute right: such weights take the byte-tile kernel."""
    x, (q, s, _, _), _ = _case(1, 9, 128, "int8", 0, torch.float32, device, seed=4)
    wide = torch.zeros(9, 131, dtype=torch.int8, device=q.device)
    wide[:, :128] = q
    y = wq_mm(x, wide[:, :128], s)
    ref = wq_mm_ref(x, q, s)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_one_row_code_extremes(device):
    """Every int8 code (-128..127) and int4 code (0..15) decodes exactly: a weight that holds each
    one, against x = one-hot columns, gives the codes times the scale."""
    K = 256
    q8 = torch.arange(-128, 128, dtype=torch.int8).view(1, K).repeat(3, 1)
    s8 = torch.tensor([1.0, 0.5, 2.0])
    x = torch.eye(K)
    ys = torch.cat([wq_mm(x[i:i + 1].to(device), q8.to(device), s8.to(device)) for i in range(K)])
    torch.testing.assert_close(ys.cpu(), (q8.float() * s8[:, None]).t(), rtol=0, atol=0)
    codes = torch.arange(K) % 16
    q4 = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).view(1, K // 2)
    s4, z4 = torch.full((1, K // 32), 0.25), torch.full((1, K // 32), -1.0)
    ys = torch.cat([wq_mm(x[i:i + 1].to(device), q4.to(device), s4.to(device), z4.to(device), 32)
                    for i in range(0, K, 7)])
    torch.testing.assert_close(ys.cpu().view(-1), codes[0::7].float() * 0.25 - 1.0, rtol=0, atol=0)


def test_one_row_fp8_codes(device):
    """Every e4m3 code but NaN (normals, subnormals, both zeros, ±448) decodes exactly in the
    one-row kernels: a weight that holds each one, against x = one-hot columns, gives its value
    (PyTorch's float8_e4m3fn conversion) times the row's scale."""
    codes = torch.arange(256, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaNs
    w = codes.to(torch.uint8).view(torch.float8_e4m3fn).view(1, 256).repeat(3, 1)
    s = torch.tensor([1.0, 0.5, 2.0])
    x = torch.eye(256)
    cols = list(range(0, 256, 3)) + [1, 2, 7, 8, 0x7E, 0x80, 0x81, 0x87, 0xFE]
    ys = torch.cat([wq_mm(x[i:i + 1].to(device), w.to(device), s.to(device)) for i in cols])
    ref = (w.float() * s[:, None]).t()[cols]
    torch.testing.assert_close(ys.cpu(), ref, rtol=0, atol=0)


def test_weight_left_int8_code_extremes(device):
    """The weight-left GEMM reads int8 codes without a conversion instruction (each byte under
    2^23's exponent): every code -128..127, per channel and in groups of 32 with mins (GGUF's
    Q8_0 with a min), against x = the identity, gives each code times its scale (plus min)."""
    K = 256
    q8 = torch.arange(-128, 128, dtype=torch.int8).view(1, K).repeat(3, 1)
    q8[1] = q8[1].flip(0)
    x = torch.eye(K).to(device)
    s8 = torch.tensor([1.0, 0.5, 2.0])
    y = wq_gemm.wq_mm_wx(x, q8.to(device), s8.to(device))
    torch.testing.assert_close(y.cpu(), (q8.float() * s8[:, None]).t(), rtol=0, atol=0)
    sg = torch.tensor([0.25, 0.5, 1.0, 2.0] * 6).view(3, K // 32)
    zg = torch.tensor([-1.0, 0.5, 3.0] * 8).view(3, K // 32)
    y = wq_gemm.wq_mm_wx(x, q8.to(device), sg.to(device), zg.to(device), 32)
    want = q8.float() * sg.repeat_interleave(32, 1) + zg.repeat_interleave(32, 1)
    torch.testing.assert_close(y.cpu(), want.t(), rtol=0, atol=0)


@pytest.mark.parametrize("method,group", FORMATS)
@pytest.mark.parametrize("M", [2, 7, 16, 32])
@pytest.mark.parametrize("N,K", [(37, 384), (70, 256)])
def test_few_rows(method, group, M, N, K, device):
    _check(M, N, K, method, group, torch.float32, device, seed=M * 11 + N + group, bias=M == 7)


@pytest.mark.parametrize("M", [7, 33])
def test_int4_tiles_in_float16(M, device):
    """int4 tiles read their nibbles as subnormal floats and scale them by 2^100; float16, whose
    range is narrower than bfloat16's, takes the path that scales the codes before the
    multiply-add: the skinny, tiled and weight-left shapes against the reference (bfloat16's
    path: ``test_real_size*`` on the GPU; the interpreter has no bfloat16 product)."""
    dtype = torch.float16
    x, packed, b = _case(M, 40, 256, "int4", 64, dtype, device, seed=M + 3, bias=True)
    ref = wq_mm_ref(x, *packed, bias=b)
    for y in (wq_mm(x, *packed, bias=b),
              wq_mm_wx(x, *packed, bias=b, config={"BLOCK_N": 32, "BLOCK_M": 32, "BLOCK_K": 64, "num_warps": 4,
                                                    "num_stages": 2})):
        assert y.dtype == dtype and not y.isnan().any()
        assert ((y.double() - ref).norm() / ref.norm()).item() < TOL[dtype]


@pytest.mark.parametrize("method,group", FORMATS)
@pytest.mark.parametrize("M", [33, 100])
def test_tiled(method, group, M, device):
    """Row tiles of 32 (smaller than the default, so M spans several) over N and K tiles, the
    last of each partial."""
    cfg = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}
    _check(M, 45, 384, method, group, torch.float32, device, seed=M + group, config=cfg, bias=True)


@pytest.mark.parametrize("method,group", [f for f in FORMATS if f[0] != "fp8"])
@pytest.mark.parametrize("M,N", [(33, 45), (100, 64)])
def test_weight_left_gemm(method, group, M, N, device):
    """The large-batch GEMM with the weight as the left operand: tiles of 32 x 32 over N and M (the
    last of each partial), a column step of 64 cut to the group where it is smaller, bias."""
    x, packed, b = _case(M, N, 384, method, group, torch.float32, device, seed=M + N + group, bias=M == 33)
    cfg = {"BLOCK_N": 32, "BLOCK_M": 32, "BLOCK_K": 64, "num_warps": 4, "num_stages": 2}
    y = wq_mm_wx(x, *packed, bias=b, config=cfg)
    ref = wq_mm_ref(x, *packed, bias=b)
    assert y.shape == (M, N) and not y.isnan().any()
    assert ((y.double() - ref).norm() / ref.norm()).item() < TOL[torch.float32]


@pytest.mark.parametrize("method,group", FORMATS)
@pytest.mark.parametrize("parts", [2, 3, 8])
def test_split_over_k(method, group, parts, device):
    """K summed in parts, each into its own float32 slice, then added and rounded once with the
    bias: the skinny and tiled shapes and the weight-left GEMM, against the reference. Five
    column steps make parts of 3 + 2, 2 + 2 + 1, and 8 parts become 5 of one step each; the
    per-channel K (600) ends in a partial step, masked."""
    K = 600 if group == 0 else 640
    cfgs = [({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}, 5),
            ({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 2}, 45)]
    for dtype in (torch.float32, torch.float16):
        for cfg, M in cfgs:
            x, packed, b = _case(M, 40, K, method, group, dtype, device, seed=M + parts + group, bias=True)
            ref = wq_mm_ref(x, *packed, bias=b)
            ys = [wq_mm(x, *packed, bias=b, config={**cfg, "SPLIT_K": parts})]
            if method != "fp8" and wx_block_k(packed[0], group, K, 128):
                ys.append(wq_mm_wx(x, *packed, bias=b, config={**cfg, "SPLIT_K": parts}))
            for y in ys:
                assert y.shape == (M, 40) and y.dtype == dtype and not y.isnan().any()
                assert ((y.double() - ref).norm() / ref.norm()).item() < TOL[dtype]


def test_split_rule():
    """``split_k``: no split where the tiles fill the GPU or x has more rows than SPLIT_MAX_ROWS
    (int8's and int4's own); otherwise doubled, never past SPLIT_MAX, each part keeping
    SPLIT_MIN_TILES column steps; more parts for fewer tiles."""
    sms = 132
    for int4, rows in wq_gemm.SPLIT_MAX_ROWS.items():
        assert wq_gemm.split_k(1, 1000, sms, rows, int4) == wq_gemm.SPLIT_MAX
        assert wq_gemm.split_k(1, 1000, sms, rows + 1, int4) == 1
    assert wq_gemm.split_k(2 * sms, 1000, sms, 16, False) == 1
    assert wq_gemm.split_k(1, 1000, sms, 16, False) == wq_gemm.SPLIT_MAX
    assert wq_gemm.split_k(8, 2 * wq_gemm.SPLIT_MIN_TILES - 1, sms, 16, False) == 1
    for tiles in (1, 16, 64, 96, 200, 448):
        for k_tiles in (4, 16, 32, 56, 112):
            parts = wq_gemm.split_k(tiles, k_tiles, sms, 16, False)
            assert parts & (parts - 1) == 0 and parts <= wq_gemm.SPLIT_MAX
            assert parts == 1 or (k_tiles // parts >= wq_gemm.SPLIT_MIN_TILES
                                  and tiles * parts // 2 < wq_gemm.SPLIT_WAVES * sms)
            assert parts >= wq_gemm.split_k(2 * tiles, k_tiles, sms, 16, False)
    with pytest.raises(ConfigError, match="wq_split_k"):
        KernelConfig(wq_split_k="no")


def test_weight_left_gemm_column_step():
    q8, q4 = torch.zeros(8, 384, dtype=torch.int8), torch.zeros(8, 192, dtype=torch.uint8)
    assert wx_block_k(q8, 0, 384, 64) == 64 and wx_block_k(q8, 0, 400, 64) == 16 and wx_block_k(q8, 0, 392, 64) == 0
    assert wx_block_k(q4, 32, 384, 64) == 32 and wx_block_k(q4, 128, 384, 64) == 64
    assert wx_block_k(q8.view(torch.float8_e4m3fn), 0, 384, 64) == 0  # e4m3 keeps its own paths


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


@pytest.mark.parametrize("method,group", [f for f in FORMATS if f[0] in ("int8", "int4")])
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


@needs_cuda
@pytest.mark.parametrize("method,group", [f for f in FORMATS if f[0] != "fp8"])
@pytest.mark.parametrize("M", [64, 200, 512])
def test_real_size_weight_left_bf16(method, group, M):
    """The weight-left GEMM at its default tile on Llama-3-8B's down projection, bfloat16."""
    x, packed, _ = _case(M, 4096, 14336, method, group, torch.bfloat16, torch.device("cuda"), seed=M + group)
    y = wq_mm_wx(x, *packed)
    ref = wq_mm_ref(x, *packed)
    assert ((y.double() - ref).norm() / ref.norm()).item() < TOL[torch.bfloat16]


_COMPILE = r"""
import sys
import traceback
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kvserve.kernels.wq_gemv import _gl_row_kernel as K
names = K.arg_names


def counts(fmt, group):
    fmt, _, silu = fmt.partition("+")
    int4, fp8 = fmt == "int4", fmt == "fp8"
    ptr = dict(X="*bf16", W="*i32", S="*fp32" if fp8 else "*bf16", Z="*bf16", B="*bf16", Y="*bf16")
    const = dict(INT4=int4, FP8=fp8, GROUPED=group > 0, HAS_MIN=int4, HAS_BIAS=False,
                 WPG=group // (8 if int4 else 4) or 1, BLOCK_N=8, VEC=4, NUM_WARPS=4, PREFETCH=1, USE_PDL=True,
                 SILU_MUL=bool(silu))
    sig = {n: "constexpr" if n in const else ptr.get(n, "i32") for n in names}
    div = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in const}
    src = GluonASTSource(fn=K, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=div)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = k.asm["ptx"]
    loop = ptx[ptx.index("griddepcontrol.wait"):]
    ints = ("s8", "u8", "s16", "u16", "s32", "u32")
    return (ptx.count("ld.local") + ptx.count("st.local"), sum(loop.count(f"cvt.rn.f32.{t}") for t in ints),
            ptx.count("ld.global.v4.b32") + ptx.count("ld.global.nc.v4.b32"), ptx.count("griddepcontrol.wait"),
            ptx.count(".ftz"), loop.count("cvt.rn.f16x2.e4m3x2"))


for case in sys.argv[1:]:  # one line each; a case that fails to compile says why on stderr
    fmt, group = case.split(":")
    try:
        print(case, *counts(fmt, int(group)), flush=True)
    except Exception:
        print(case, traceback.format_exc(), file=sys.stderr, flush=True)
"""
GLUON_ROW_CASES = [("int4", 128), ("int4", 32), ("int8", 0), ("int8", 32), ("fp8", 0),
                   ("int4+silu", 128), ("int8+silu", 0), ("fp8+silu", 0)]  # +silu: the fused activation


@pytest.fixture(scope="module")
def gluon_row_ptx():
    """Each case's counts from its PTX, all compiled in one subprocess (its imports once)."""
    p = subprocess.run([sys.executable, "-c", _COMPILE, *(f"{f}:{g}" for f, g in GLUON_ROW_CASES)],
                       capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "0"})
    cases = {f"{f}:{g}" for f, g in GLUON_ROW_CASES}
    counts = {words[0]: tuple(map(int, words[1:])) for words in map(str.split, p.stdout.splitlines())
              if len(words) == 7 and words[0] in cases}
    return counts, p


@pytest.mark.parametrize("fmt,group", GLUON_ROW_CASES)
def test_gluon_row_kernel_compiles_for_sm90(gluon_row_ptx, fmt, group):
    """The CUDA one-row kernel, compiled for sm90 in a subprocess (no GPU): nothing spilled to local
    memory, no integer-to-float conversion instruction on the codes (their bits are read as
    subnormal floats), no float operation that flushes subnormals to zero (which would zero every
    code), the weights read as 16-byte vectors, and the wait on the previous kernel present once
    (programmatic dependent launch). FP8's codes take the paired e4m3 conversion, the others none;
    the fused SiLU-and-multiply (+silu) keeps all of it."""
    counts, p = gluon_row_ptx
    assert f"{fmt}:{group}" in counts, f"exit {p.returncode}: {p.stderr[-2000:]}"
    spills, conversions, vector_loads, waits, flushes, e4m3_pairs = counts[f"{fmt}:{group}"]
    assert spills == 0 and conversions == 0 and waits == 1 and flushes == 0
    assert vector_loads >= 1
    assert (e4m3_pairs > 0) == fmt.startswith("fp8")


@pytest.mark.parametrize("method, group, expect", [
    # int8 per channel: the integer tensor cores from 64 rows to 512 (kernels/wq_s8.py)
    ("int8", 0, {16: "skinny", 17: "tiled", 63: "tiled", 64: "s8", 512: "s8", 513: "dequant"}),
    ("int4", 128, {32: "skinny", 33: "weight-left", 256: "weight-left", 257: "dequant"}),
    # groups the weight-left GEMM's column step of 128 does not divide: no weight-left, no int4 exception
    ("int4", 64, {16: "skinny", 17: "tiled", 64: "dequant", 256: "dequant"}),
])
def test_cuda_dispatch_by_rows(monkeypatch, method, group, expect):
    """Which product a CUDA QuantLinear takes for x of each row count, under the default
    KernelConfig (the rule its comments give; the kernels themselves are tested above)."""
    from kvserve.config import KernelConfig, QuantConfig
    from kvserve.kernels import wq_gemm, wq_s8
    from kvserve.layers.quant_linear import QuantLinear
    torch.manual_seed(0)
    layer = QuantLinear.from_linear(torch.nn.Linear(256, 64, bias=False),
                                    QuantConfig(method=method, group_size=group or None))
    taken = []
    monkeypatch.setattr(wq_gemm, "wq_mm", lambda x, *a, **k: taken.append("skinny" if a[5] is None else "tiled"))
    monkeypatch.setattr(wq_gemm, "wq_mm_wx", lambda *a, **k: taken.append("weight-left"))
    monkeypatch.setattr(wq_gemm, "dequantize", lambda *a, **k: taken.append("dequant") or torch.zeros(64, 256))
    monkeypatch.setattr(wq_s8, "wq_mm_s8", lambda *a, **k: taken.append("s8"))
    for rows, path in expect.items():
        taken.clear()
        layer._cuda(torch.randn(rows, 256), KernelConfig())
        assert taken == [path], (rows, taken)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_each_named_product_runs_its_kernel(method, device):
    """``run_cuda_product`` (what a CUDA QuantLinear and the benchmarks launch for the rule's
    choice): each product it names, s8 included for int8, gives x times the weight dequantized
    in PyTorch, with the bias, at the row counts the rule would send it."""
    from kvserve.kernels import wq_s8
    from kvserve.layers.quant_linear import run_cuda_product
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 256, generator=gen) * 0.05
    bias = torch.randn(96, generator=gen).to(device)
    if method == "int8":
        packed = (*quantize_int8(w, torch.float32), None, 0)
    else:
        packed = (*quantize_int4(w, 64, torch.float32), 64)
    packed = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in packed)
    ref_w = dequantize_ref(*packed).float()
    products = {"skinny": 3, "tiled": 20, "weight-left": 64, "dequant": 70}
    if wq_s8.dispatched(packed[0], packed[3], 256):
        products["s8"] = 65
    for how, rows in products.items():
        x = torch.randn(rows, 256, generator=gen).to(device)
        got = run_cuda_product(how, x, *packed, bias, KernelConfig())
        want = x @ ref_w.T + bias
        assert ((got.float() - want).norm() / want.norm()).item() < 1e-2, how
    assert method == "int4" or "s8" in products

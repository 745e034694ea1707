"""Per-token e4m3 quantization (``kvserve/kernels/fp8_quant.py``) against the same math in plain
PyTorch (``layers/fp8_linear.quantize_rows``: PyTorch's own division and e4m3 conversion):
codes and scales bit for bit, over rows of very different magnitudes, a row of zeros, K of one
block, of several with a partial last one, and each input dtype."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels.fp8_quant import quantize_rows  # noqa: E402
from kvserve.layers.fp8_linear import quantize_rows as quantize_rows_ref  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter internals


@pytest.mark.parametrize("K", [1, 100, 4096, 9000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_quantize_rows_equals_pytorch(K, dtype, device):
    g = torch.Generator().manual_seed(K)
    R = 6
    x = torch.randn(R, K, generator=g) * torch.logspace(-6, 4, R)[:, None]  # 1e-6 .. 1e4 a row
    x[2] = 0.0
    x = x.to(dtype).to(device)
    q, s = quantize_rows(x)
    q_ref, s_ref = quantize_rows_ref(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (R, K) and s.shape == (R, 1)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert q.float().abs().amax(dim=1)[[0, 1, 3, 4, 5]].eq(448).all()  # each row's largest lands on 448
    assert not q[2].float().any()


def test_quantize_rows_strided_and_empty(device):
    """A row stride wider than K (a column slice) reads only each row's K elements; no rows and
    no columns give empty codes without a launch."""
    x = torch.randn(5, 80, generator=torch.Generator().manual_seed(1)).to(device)
    q, s = quantize_rows(x[:, :64])
    q_ref, s_ref = quantize_rows_ref(x[:, :64])
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert quantize_rows(x[:0])[0].shape == (0, 80)
    q0, s0 = quantize_rows(x[:, :0])
    assert q0.shape == (5, 0) and s0.eq(torch.finfo(torch.float32).tiny).all()  # (the reference refuses K = 0)


def test_ties_and_boundaries(device):
    """A row whose largest value is 448 has scale 1, so its codes are its values rounded: ties
    between two e4m3 values go to the even one, in the normals (17 -> 16, 19 -> 20, 232 -> 224)
    and the subnormals (2^-10 -> 0, 1.5 * 2^-9 -> 2^-8, 7.5 * 2^-9 -> 2^-6, the smallest
    normal), a carry into the exponent (31.5 -> 32), negatives and -0 alike."""
    vals = [448.0, 17.0, 19.0, 232.0, 31.5, 447.0, 2.0 ** -10, 1.5 * 2 ** -9, 7.5 * 2 ** -9, 2.0 ** -6,
            0.3, 1e-30, 0.0]
    x = torch.tensor([vals + [-v for v in vals]], dtype=torch.float32, device=device)
    q, s = quantize_rows(x)
    q_ref, s_ref = quantize_rows_ref(x)
    assert s.item() == 1.0 and torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert q[0, :6].float().tolist() == [448.0, 16.0, 20.0, 224.0, 32.0, 448.0]
    assert q[0, 6:9].float().tolist() == [0.0, 2.0 ** -8, 2.0 ** -6]


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvserve.kernels.fp8_quant import _quantize_rows_kernel as K
names = K.arg_names
sig = dict(X="*bf16", Q="*fp8e4nv", S="*fp32", K="i32", stride_x="i32", stride_q="i32", BLOCK="constexpr")
src = ASTSource(fn=K, signature=sig, constexprs={(names.index("BLOCK"),): 4096},
                attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n != "BLOCK"})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
print(ptx.count("ld.local") + ptx.count("st.local"), ptx.count("div.rn.f32"), ptx.count("div.full"),
      ptx.count("div.approx"), ptx.count("cvt.rn.satfinite.e4m3x2.f32"))
"""


def test_compiles_for_sm90():
    """The kernel compiled for sm90 in a subprocess (no GPU): nothing spilled to local memory,
    divisions rounded to nearest (an approximate one would change codes the interpreter's test
    says are right), and the codes converted by the e4m3 instruction."""
    p = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True,
                       env={**os.environ, "TRITON_INTERPRET": "0"})
    assert p.returncode == 0, p.stderr[-2000:]
    spills, exact, full, approx, converts = map(int, p.stdout.split())
    assert spills == 0 and exact >= 1 and full == 0 and approx == 0 and converts >= 1

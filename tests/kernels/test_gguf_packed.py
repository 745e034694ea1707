"""GGUF blocks kept packed (``kvserve/layers/gguf_blocks.py``) against the ``gguf`` library's own
``gguf.quants.dequantize``, for Q4_0, Q4_1, Q8_0, Q4_K and Q6_K:

* the repacked codes, scales and mins give ``gguf``'s values to the bit;
* the Triton kernels (``wq_mm`` at one row, a few rows and tiled; ``dequantize``) on the
  repacked blocks equal x times ``gguf``'s dequantized matrix in float64 (interpreter on CPU
  tensors, small shapes);
* the CPU layer (``QuantLinear.from_gguf``: PyTorch's int4 kernel for the 4-bit formats, a tiled
  dequantize-and-multiply for the 8-bit ones) likewise, at a real layer size;
* a fused projection whose parts differ in type (llama.cpp's mixes) repacks into one layout
  that gives every part's values to the bit, and the kernels and the CPU layer compute with it;
* rows of the wrong length are refused.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("triton")

from kernelutil import gguf_tensor  # noqa: E402

from kvserve.kernels.wq_gemm import dequantize, dequantize_ref, wq_mm  # noqa: E402
from kvserve.layers.gguf_blocks import FORMATS, repack, repack_parts, unpack  # noqa: E402
from kvserve.layers.quant_linear import QuantLinear  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter internals

TYPES = list(FORMATS)


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("cpu", [True, False], ids=["cpu-params", "cuda-params"])
def test_repacked_blocks_equal_gguf_dequantize(qtype, cpu):
    raw, ref = gguf_tensor(qtype, 11, 512, seed=len(qtype) + cpu)
    method, q, s, m, g = repack(torch.from_numpy(raw), qtype, 512, cpu)
    assert method == FORMATS[qtype][2] and g == FORMATS[qtype][3]
    assert q.dtype == (torch.uint8 if method == "int4" else torch.int8)
    w = dequantize_ref(q, s, m, g)
    assert torch.equal(w, torch.from_numpy(ref)), (w - torch.from_numpy(ref)).abs().max()
    assert w.abs().amax() > 0


def test_scales_kept_in_float16_only_where_exact():
    for qtype, narrow in (("Q4_1", True), ("Q8_0", True), ("Q4_K", False), ("Q6_K", False)):
        raw, _ = gguf_tensor(qtype, 4, 256, seed=1)
        s = repack(torch.from_numpy(raw), qtype, 256, cpu=False)[2]
        assert s.dtype == (torch.float16 if narrow else torch.float32), qtype


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("M", [1, 3, 40])
def test_kernel_on_repacked_blocks(qtype, M, device):
    N, K = 19, 512
    raw, ref = gguf_tensor(qtype, N, K, seed=M)
    _, q, s, m, g = repack(torch.from_numpy(raw).to(device), qtype, K, cpu=False)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(device)
    cfg = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 4, "num_stages": 1} if M == 40 else None
    y = wq_mm(x, q, s, m, g, config=cfg)
    exact = x.double() @ torch.from_numpy(ref).double().to(device).T
    assert _rel(y, exact) < 1e-5
    w = dequantize(q, s, m, g, dtype=torch.float32)
    assert torch.equal(w.cpu(), torch.from_numpy(ref))


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("M,bias", [(1, False), (7, True), (96, False)])
def test_cpu_layer(qtype, M, bias):
    """A SmolLM2 MLP's shape (1536 x 576 with K-quants' 256-column blocks: 1536 x 768)."""
    N, K = 1536, 768
    raw, ref = gguf_tensor(qtype, N, K, seed=M + 5)
    gen = torch.Generator().manual_seed(M)
    b = torch.randn(N, generator=gen) if bias else None
    layer = QuantLinear.from_gguf(qtype, torch.from_numpy(raw), K, b)
    assert layer.fmt == f"gguf {qtype}" and not any(p.dim() == 2 for p in layer.parameters())
    x = torch.randn(M, K, generator=gen)
    y = layer(x)
    exact = torch.nn.functional.linear(x.double(), torch.from_numpy(ref).double(), None if b is None else b.double())
    assert y.shape == (M, N) and _rel(y, exact) < 1e-5


@pytest.mark.parametrize("qtype", TYPES)
def test_wrong_row_length(qtype):
    raw, _ = gguf_tensor(qtype, 2, 256, seed=0)
    with pytest.raises(ValueError, match=qtype):
        unpack(torch.from_numpy(raw[:, :-1]), qtype, 256)
    with pytest.raises(ValueError, match=qtype):
        unpack(torch.from_numpy(raw), qtype, 512)


# (parts' types, the layout they share): 4-bit only -> int4 g32; with an 8-bit part -> int8 at
# the smallest group, with mins if any part has them
MIXES = [(("Q4_K", "Q4_K", "Q4_0"), "int4", 32), (("Q4_K", "Q4_K", "Q6_K"), "int8", 16),
         (("Q8_0", "Q6_K"), "int8", 16), (("Q4_1", "Q8_0"), "int8", 32)]


def _mix(qtypes, rows, K, seed):
    parts = [gguf_tensor(q, n, K, seed=seed + i) for i, (q, n) in enumerate(zip(qtypes, rows))]
    raws = [(q, torch.from_numpy(raw)) for q, (raw, _) in zip(qtypes, parts)]
    return raws, torch.cat([torch.from_numpy(ref) for _, ref in parts])


@pytest.mark.parametrize("qtypes,method,group", MIXES, ids=["+".join(m[0]) for m in MIXES])
@pytest.mark.parametrize("cpu", [True, False], ids=["cpu-params", "cuda-params"])
def test_mixed_parts_repack_to_gguf_values(qtypes, method, group, cpu):
    raws, ref = _mix(qtypes, (16, 8, 8)[:len(qtypes)], 512, seed=3)
    m, q, s, z, g = repack_parts(raws, 512, cpu)
    assert (m, g) == (method, group)
    assert (z is None) == all(t in ("Q8_0", "Q6_K") for t in qtypes)
    w = dequantize_ref(q, s, z, g)
    assert w.shape == ref.shape and torch.equal(w, ref), (w - ref).abs().max()


@pytest.mark.parametrize("qtypes,method,group", MIXES[:2], ids=["+".join(m[0]) for m in MIXES[:2]])
@pytest.mark.parametrize("M", [1, 3])
def test_kernel_on_mixed_parts(qtypes, method, group, M, device):
    raws, ref = _mix(qtypes, (16, 8, 8), 512, seed=M)
    _, q, s, z, g = repack_parts([(t, r.to(device)) for t, r in raws], 512, cpu=False)
    x = torch.randn(M, 512, generator=torch.Generator().manual_seed(M)).to(device)
    assert _rel(wq_mm(x, q, s, z, g), x.double() @ ref.double().to(device).T) < 1e-5


@pytest.mark.parametrize("qtypes,method,group", MIXES, ids=["+".join(m[0]) for m in MIXES])
def test_cpu_layer_on_mixed_parts(qtypes, method, group):
    raws, ref = _mix(qtypes, (256, 64, 64)[:len(qtypes)], 768, seed=11)
    layer = QuantLinear.from_gguf_parts(raws, 768)
    assert layer.fmt == "gguf " + "+".join(qtypes) and layer.method == method and layer.out_features == ref.shape[0]
    x = torch.randn(5, 768, generator=torch.Generator().manual_seed(2))
    assert _rel(layer(x), x.double() @ ref.double().T) < 1e-5

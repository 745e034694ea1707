"""The integer tensor-core product (``kvserve/kernels/wq_s8.py``): x split into two int8 halves,
against the definition of the split and against dequantize-then-matmul in float64 on weights
quantized by ``kvserve/layers/rtn.py``; int8 per channel and in groups (with and without mins),
int4 in every group size, M and N that the tiles do not divide, bias, K split over programs;
and one case the product must get exactly, where x is integers the split holds without
rounding."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernelutil import needs_cuda  # noqa: E402

from kvserve.kernels.wq_gemm import wq_mm_ref  # noqa: E402
from kvserve.kernels.wq_s8 import SPLIT_RANGE, dispatched, s8_config, split_rows, split_rows_ref, supports, wq_mm_s8  # noqa: E402
from kvserve.layers.rtn import quantize_int4, quantize_int8  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter internals

# Relative L2 error against float64. The split rounds each element to 2^-16 of its row's largest
# magnitude: about 1e-5 of the product for Gaussian rows, up to 4e-4 where a few columns are 100x
# the rest (``_x``'s outliers); bfloat16's output rounding (2^-9 an element) is larger still.
# Losing the low half would cost 2^-8 of the largest magnitude: 256 times the split's error.
TOL = {torch.float32: 1e-3, torch.bfloat16: 6e-3}


def _x(M, K, dtype, device, seed, outliers=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    if outliers:  # a few columns 100x the rest, as LLM activations have
        x[:, torch.randperm(K, generator=g)[:3]] *= 100
    if M > 2:
        x[1] = 0  # a row of zeros: scale 0, codes 0
    return x.to(dtype).to(device)


@pytest.mark.parametrize("M,K", [(1, 128), (5, 1000), (3, 2304)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_split_rows(M, K, dtype, device):
    """The codes and scales are PyTorch's float32 arithmetic bit for bit; hi and lo in int8's
    range; s * (256 hi + lo) within half a unit of x; the group sums those of x / s."""
    x = _x(M, K, dtype, device, seed=M + K, outliers=True)
    group = 8 if K % 8 == 0 else 0
    q, s, xg = split_rows(x, group)
    q_ref, s_ref, xg_ref = split_rows_ref(x.cpu(), group)
    assert torch.equal(q.cpu(), q_ref) and torch.equal(s.cpu(), s_ref)
    hi, lo = q.cpu().int()
    assert hi.abs().max() <= 127 and lo.min() >= -128 and lo.max() <= 127
    xf = x.cpu().double()
    back = s.cpu().double()[:, None] * (256 * hi + lo).double()
    assert ((back - xf).abs() <= s.cpu().double()[:, None] * 0.51).all()  # (+ float32 roundings of inv, s)
    amax = xf.abs().amax(dim=1)
    assert ((256 * hi + lo).abs().amax(dim=1)[amax > 0] == SPLIT_RANGE).all()  # the range is used whole
    if group:
        unit = torch.where((amax > 0)[:, None], xf / s.cpu().double()[:, None].clamp_min(1e-300), 0.0)
        torch.testing.assert_close(xg.cpu().double(), unit.view(M, -1, group).sum(-1), rtol=1e-5, atol=1e-2)


def _case(M, N, K, method, group, dtype, device, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * K ** -0.5 + 0.01  # groups not centred on zero
    b = torch.randn(N, generator=g).to(dtype).to(device) if bias else None
    if method == "int8":
        return (*quantize_int8(w.to(device), dtype), None, 0), b
    if method.startswith("int8g"):  # group-wise int8, as GGUF's Q8_0 repacks (with mins: "int8gm")
        wg = w.view(N, K // group, group)
        s = wg.abs().amax(dim=2).clamp_min(1e-8) / 127
        q = (wg / s[..., None]).round().clamp(-128, 127).to(torch.int8).view(N, K)
        z = (torch.randn(N, K // group, generator=g) * 0.01).to(dtype).to(device) if method == "int8gm" else None
        return (q.to(device), s.to(dtype).to(device), z, group), b
    return quantize_int4(w.to(device), group, dtype) + (group,), b


FORMATS = [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128), ("int8g", 32), ("int8gm", 64)]


SHAPES = [(70, 100, 384), (3, 64, 256), (130, 37, 128), (9, 20, 576)]  # 576: int8 in steps of 64


@pytest.mark.parametrize("method,group,M,N,K", [(m, g, *shape) for m, g in FORMATS for shape in SHAPES
                                                if not g or shape[2] % g == 0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_product(method, group, M, N, K, dtype, device):
    x = _x(M, K, dtype, device, seed=M * N + K + group, outliers=M == 70)
    packed, b = _case(M, N, K, method, group, dtype, device, seed=N + group, bias=N == 37)
    y = torch.full((M, N), float("nan"), dtype=dtype, device=device)
    y.copy_(wq_mm_s8(x, *packed, bias=b, config={"BLOCK_N": 32, "BLOCK_M": 32, "BLOCK_K": 128}))
    ref = wq_mm_ref(x, *packed, bias=b)
    assert not y.isnan().any()
    if M > 2:
        assert torch.equal(y[1].cpu().double(), (torch.zeros(N, dtype=torch.float64) if b is None
                                                 else b.cpu().double()))
    err = ((y.double() - ref).norm() / ref.norm()).item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("M", [64, 70])
def test_product_at_the_default_tiles(M, device):
    """int8 per channel at the tiles the rule uses (``s8_config``: 64 x 64 up to 64 rows, 128
    weight rows by 64 rows of x above), N and M they do not divide."""
    N, K = 200, 384
    x = _x(M, K, torch.float32, device, seed=M, outliers=True)
    packed, b = _case(M, N, K, "int8", 0, torch.float32, device, seed=5, bias=True)
    y = wq_mm_s8(x, *packed, bias=b, config={**s8_config(M), "SPLIT_K": 1})
    ref = wq_mm_ref(x, *packed, bias=b)
    assert ((y.double() - ref).norm() / ref.norm()).item() < TOL[torch.float32]


@pytest.mark.parametrize("method,group", [("int8", 0), ("int4", 64)])
def test_split_k(method, group, device):
    """K summed in 3 parts (4 column steps over 3 programs: one part shorter), bias added once."""
    M, N, K = 20, 48, 512
    x = _x(M, K, torch.float32, device, seed=7)
    packed, b = _case(M, N, K, method, group, torch.float32, device, seed=8, bias=True)
    cfg = {"BLOCK_N": 16, "BLOCK_M": 16, "BLOCK_K": 128, "SPLIT_K": 3}
    y = wq_mm_s8(x, *packed, bias=b, config=cfg)
    ref = wq_mm_ref(x, *packed, bias=b)
    assert ((y.double() - ref).norm() / ref.norm()).item() < TOL[torch.float32]


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning")  # (the interpreter's NaN)
@pytest.mark.parametrize("method,group", [("int8", 0), ("int4", 64)])
def test_nan_stays_in_its_row(method, group, device):
    """A NaN in one row of x makes that row's outputs NaN, as any product does, and leaves the
    other rows' alone."""
    M, N, K = 6, 32, 256
    x = _x(M, K, torch.float32, device, seed=11)
    x[3, 17] = float("nan")
    packed, _ = _case(M, N, K, method, group, torch.float32, device, seed=12)
    y = wq_mm_s8(x, *packed, config={"BLOCK_N": 16, "BLOCK_M": 16, "BLOCK_K": 128}).cpu()
    assert y[3].isnan().all()
    keep = [0, 1, 2, 4, 5]
    ref = wq_mm_ref(x[keep], *packed)
    assert not y[keep].isnan().any()
    assert ((y[keep].double() - ref.cpu()).norm() / ref.norm()).item() < TOL[torch.float32]


def test_exact_int8(device):
    """x of integers with a row maximum of 32639 is split without rounding (scale 1), so the
    product is the integer sum times the weight's scale up to the float32 roundings of the
    recombination (a few units in the last place of the largest term): the halves recombine
    right, where any slip would cost at least 2^-16 of a term."""
    M, N, K = 9, 40, 640
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-32639, 32640, (M, K), generator=g).float()
    x[:, 5] = 32639
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    s = torch.rand(N, generator=g) + 0.5
    y = wq_mm_s8(x.to(device), q.to(device), s.to(device), config={"BLOCK_N": 16, "BLOCK_M": 16, "BLOCK_K": 128})
    exact = (x.double() @ q.double().t()) * s.double()
    bound = 2.0 ** -22 * (x.double().abs() @ q.double().abs().t()) * s.double()
    assert ((y.cpu().double() - exact).abs() <= bound).all()


def test_supports():
    K = 4096
    assert supports(torch.empty(8, K, dtype=torch.int8), 0, K)
    assert supports(torch.empty(8, K, dtype=torch.int8), 32, K)  # group-wise int8 (GGUF Q8_0)
    assert not supports(torch.empty(8, K, dtype=torch.int8), 16, K)  # (Q6_K's 16: below the K step)
    assert supports(torch.empty(8, 576, dtype=torch.int8), 0, 576)  # (steps of 64 columns)
    assert not supports(torch.empty(8, 528, dtype=torch.int8), 0, 528)  # 32 does not divide K
    assert not supports(torch.empty(8, K, dtype=torch.float8_e4m3fn), 0, K)
    assert supports(torch.empty(8, K // 2, dtype=torch.uint8), 128, K)


def test_dispatched_takes_int8_per_channel_only():
    K = 4096
    assert dispatched(torch.empty(8, K, dtype=torch.int8), 0, K)
    assert not dispatched(torch.empty(8, 528, dtype=torch.int8), 0, 528)  # not supported at all
    assert not dispatched(torch.empty(8, K, dtype=torch.int8), 32, K)  # supported, slower in groups
    assert not dispatched(torch.empty(8, K // 2, dtype=torch.uint8), 128, K)


@needs_cuda
@pytest.mark.parametrize("method,group", [("int8", 0), ("int4", 128)])
@pytest.mark.parametrize("M", [64, 200, 512])
def test_real_size_s8(method, group, M):
    """Llama-3-8B's down projection at the default tiles, bfloat16, activations with outliers."""
    dev = torch.device("cuda")
    x = _x(M, 14336, torch.bfloat16, dev, seed=M, outliers=True)
    packed, _ = _case(M, 4096, 14336, method, group, torch.bfloat16, dev, seed=M + group)
    y = wq_mm_s8(x, *packed)
    ref = wq_mm_ref(x, *packed)
    assert ((y.double() - ref).norm() / ref.norm()).item() < TOL[torch.bfloat16]


def test_rule_takes_s8_from_its_rows():
    from kvserve.config import KernelConfig
    from kvserve.layers.quant_linear import cuda_product
    on = KernelConfig(wq_s8_min_rows=64, wq_s8_max_rows=256)
    assert cuda_product(64, on, False, True, s8=True) == "s8"
    assert cuda_product(256, on, True, True, s8=True) == "s8"
    assert cuda_product(63, on, False, True, s8=True) != "s8"
    assert cuda_product(257, on, False, True, s8=True) == "dequant"
    assert cuda_product(4096, on, True, True, s8=False) == "dequant"  # a weight it does not take
    # by default int8 per channel from 64 to 512 rows (the weight-left GEMM below, then cuBLAS)
    assert cuda_product(63, KernelConfig(), False, True, s8=True) == "tiled"
    assert cuda_product(64, KernelConfig(), False, True, s8=True) == "s8"
    assert cuda_product(512, KernelConfig(), False, True, s8=True) == "s8"
    assert cuda_product(513, KernelConfig(), False, True, s8=True) == "dequant"
    assert cuda_product(128, KernelConfig(wq_s8_min_rows=0), False, True, s8=True) == "weight-left"  # off


@needs_cuda
@pytest.mark.parametrize("method,group", [("int8", 0), ("int4", 64)])
def test_layer_on_s8(method, group):
    """A quantized layer of SmolLM2's shape (K = 576: int8 in steps of 64 columns) with the rule
    taking s8 from 2 rows (int8; int4 stays on the rule's other products): at 2 to 300 rows its
    product is x times the weight dequantized in PyTorch, within bfloat16's rounding; one row
    keeps the one-row kernel."""
    from kvserve.config import KernelConfig, QuantConfig
    from kvserve.kernels.wq_gemm import dequantize_ref
    from kvserve.layers.quant_linear import QuantLinear
    gen = torch.Generator(device="cuda").manual_seed(1)
    dense = torch.nn.Linear(576, 1536, bias=True, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        dense.weight.normal_(0.0, 0.04, generator=gen)
    layer = QuantLinear.from_linear(dense, QuantConfig(method, group_size=group or None))
    assert layer._s8 == (method == "int8")  # int4 keeps the other products (``dispatched``)
    w = dequantize_ref(layer.qweight, layer.scales, layer.mins, layer.group_size).float()
    kernel = KernelConfig(wq_s8_min_rows=2, wq_s8_max_rows=1 << 20)
    with torch.inference_mode():
        for rows in (1, 2, 40, 300):
            x = torch.randn(rows, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
            want = x.float() @ w.T + dense.bias.float()
            got = layer._cuda(x, kernel).float()
            assert ((got - want).norm() / want.norm()).item() < 1e-2, rows


def test_rule_keeps_the_head_and_older_gpus_off_s8(monkeypatch):
    """The rule's weights (``QuantLinear._s8``): an int8 per-channel projection, not the int8 output
    head that ``quantization_head`` builds (its shape was not measured there), and none on a GPU
    before compute capability 8.0."""
    from types import SimpleNamespace

    from kvserve.config import QuantConfig
    from kvserve.kernels import wq_s8
    from kvserve.layers.linear import Linear
    from kvserve.layers.quant_linear import QuantLinear, _quantize_head
    torch.manual_seed(0)
    proj = QuantLinear.from_linear(torch.nn.Linear(256, 64, bias=False), QuantConfig("int8"))
    assert proj._s8
    model = torch.nn.Module()
    model.lm_head = Linear(256, 96, bias=False)
    torch.nn.init.normal_(model.lm_head.weight)
    assert _quantize_head(model)
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.method == "int8"
    assert not model.lm_head._s8
    old_gpu = SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0), dtype=torch.int8)
    monkeypatch.setattr(wq_s8, "capability", lambda device: 7)
    assert not wq_s8.dispatched(old_gpu, 0, 256)
    monkeypatch.setattr(wq_s8, "capability", lambda device: 9)
    assert wq_s8.dispatched(old_gpu, 0, 256)

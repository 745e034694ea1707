"""The Gluon KIVI int4 decode kernel (``kvserve/kernels/kivi_decode.py``).

On CUDA: against float64 attention over the dequantized cache (the reference writer fills it;
``test_kv_quant``'s helpers), bf16 and fp16, GQA groups of 1, 4 and 8, 64- and 128-token blocks,
one split and many; sequences of one token (residual keys only), exactly full blocks, an
unsealed tail, and a long one. The kernel runs neither in the interpreter nor on the CPU; there
the tests compile it for sm90 and check what its design rests on: no shared memory, no spills.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from kernelutil import needs_cuda
from test_kv_quant import _compressed_batch

from kvserve.kernels import kivi_decode
from kvserve.kernels.decode_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
)
from kvserve.layers import kv_format as kf


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,KVH,bs,splits", [(32, 8, 64, 1), (32, 8, 64, 5), (8, 8, 128, 3), (16, 2, 64, 16)])
def test_kivi4_decode_against_reference(dtype, H, KVH, bs, splits, monkeypatch):
    gen = torch.Generator().manual_seed(7 + H + bs + splits)
    D = 128
    f = kf.KVFormat("int4", KVH, D, bs, dtype)
    assert kivi_decode.fmt_supported(f)
    # (cached, new): 1 token (residual only), a full block, an unsealed tail, a long context
    batch = [(0, 1), (bs - 1, 1), (2 * bs + 40, 1), (1500, 1)]
    nb = sum(math.ceil((c + n) / bs) for c, n in batch) + 3
    views, tables, kd, vd, rs = _compressed_batch(gen, f, batch, H, nb)
    q = torch.randn(len(batch), H, D, generator=gen).to("cuda", dtype)
    assert kivi_decode.supported(views, q)
    seq_lens = torch.tensor([c + n for c, n in batch], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    kivi_decode.kivi4_decode(q, views, tables, seq_lens, rs, D ** -0.5, splits, out)
    ref = paged_decode_attention_ref(q, kd, vd, tables, seq_lens, D ** -0.5)
    # fp16 products: q times the channel scales and p times the value scales round to fp16
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    # the Triton kernel on the same cache agrees as closely
    from kvserve.kernels import decode_attention
    monkeypatch.setattr(decode_attention, "KIVI_GLUON", False)
    other = paged_decode_attention(q, views, None, tables, seq_lens, D ** -0.5, splits=splits, res_slots=rs)
    torch.testing.assert_close(out.double(), other.double(), rtol=2e-2, atol=2e-2)


@needs_cuda
def test_kivi4_decode_zero_length_and_padding():
    """A graph-padding sequence of length 0 gets zeros; the others are unaffected."""
    gen = torch.Generator().manual_seed(3)
    H, KVH, D, bs = 32, 8, 128, 64
    f = kf.KVFormat("int4", KVH, D, bs, torch.bfloat16)
    batch = [(300, 1), (70, 1)]
    views, tables, kd, vd, rs = _compressed_batch(gen, f, batch, H, 16)
    q = torch.randn(len(batch), H, D, generator=gen).to("cuda", torch.bfloat16)
    seq_lens = torch.tensor([301, 0], dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    kivi_decode.kivi4_decode(q, views, tables, seq_lens, rs, D ** -0.5, 4, out)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = paged_decode_attention_ref(q, kd, vd, tables, seq_lens, D ** -0.5)
    torch.testing.assert_close(out[0].double(), ref[0], rtol=1e-2, atol=1e-2)


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kvserve.kernels.kivi_decode import _kivi4_decode_kernel as K
names = K.arg_names
ptr = dict(Q="*bf16", KC="*i32", VC="*i32", KS="*i32", VS="*i32", RES="*bf16", BT="*i32", SEQ_LENS="*i32",
           RSLOTS="*i32", O="*bf16", OP="*fp32", LSEP="*fp32")
import torch
from kvserve.kernels.kivi_decode import cache_strides
from kvserve.layers import kv_format as kf
f = kf.KVFormat("int4", 8, 128, 64, torch.bfloat16)
views = f.views(torch.zeros(2, f.block_bytes, dtype=torch.uint8), torch.zeros(2, 64, 8, 128, dtype=torch.bfloat16))
const = dict(GROUP=4, PAGE=64, NUM_SPLITS=8, L2_AHEAD=2)
const.update(zip(["s_kcb", "s_kct", "s_kch", "s_vcb", "s_vct", "s_vch", "s_ksb", "s_ksh", "s_vsb", "s_vst", "s_vsh"],
                 cache_strides(views)))
sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "scale_log2" else "i32") for n in names}
div = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in const and n != "scale_log2"}
src = GluonASTSource(fn=K, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=div)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
ptx = k.asm["ptx"]
print(k.metadata.shared, ptx.count("ld.local") + ptx.count("st.local"), ptx.count("mma.sync"))
"""


def test_kivi4_decode_compiles_for_sm90_without_shared_memory():
    """The codes go from global memory straight into the products' registers: the kernel uses no
    shared memory (every layout conversion is a register renaming or a shuffle) and nothing is
    spilled; its two products are tensor-core mma.sync. Compiled for sm90 in a subprocess (no GPU)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (the tests' conftest sets it)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, check=False, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    shared, local, mma = map(int, r.stdout.split())
    assert shared == 0 and local == 0
    assert mma > 0


def test_kivi4_splits_never_exceed_two_waves(monkeypatch):
    """The engine launches ``kivi_decode`` with at most ``PER_SM`` one-warp programs per SM, rounded
    down (a small part wave runs as long as a whole one: at batch 32 x 32k on an H200, 5 splits
    took 0.463 ms against 0.333 for 4 and 0.337 for 8); other formats keep rounding up."""
    from kvserve.kernels import decode_attention as da
    monkeypatch.setattr(da, "_sm_count", lambda device: 132)
    dev = torch.device("cuda")
    f = kf.KVFormat("int4", 8, 128, 64, torch.bfloat16)
    for batch in (1, 3, 8, 16, 32, 33, 64, 100, 256, 512):
        splits = da.decode_splits(f, batch, 8, dev)
        programs = batch * 8 * splits
        assert 1 <= splits <= 32
        assert programs <= kivi_decode.PER_SM * 132 or splits == 1, (batch, splits)
        assert splits == 32 or batch * 8 * (splits + 1) > kivi_decode.PER_SM * 132, (batch, splits)
    assert da.decode_splits(f, 32, 8, dev) == 8
    bf16 = kf.KVFormat("auto", 8, 128, 16, torch.bfloat16)
    assert da.decode_splits(bf16, 32, 8, dev) == da.num_splits(32, 8, dev, 2) == 2  # ceil(2 * 132 / 256)
    assert da.decode_splits(None, 32, 8, dev) == 2
    fp8 = kf.KVFormat("fp8", 8, 128, kf.default_block_size("fp8"), torch.bfloat16)
    assert da.decode_splits(fp8, 32, 8, dev) == 9  # ceil(16 * 132 / 256)

"""Paged decode attention (``kvserve/kernels/decode_attention.py``) against its float64 reference.

Random non-zero q/K/V, ragged context lengths (0, 1, page and tile multiples and not), GQA
ratios 1/3/4/8, page sizes 1/4/8/16, block tables that are random permutations of the pool, one
split and several (more splits than key tiles too, so some splits are empty), and ``out``
poisoned with NaN. Slots no sequence owns are NaN (see ``build_paged_kv``).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernelutil import ATTENTION_DTYPES as DTYPES  # noqa: E402
from kernelutil import ATTENTION_TOL as TOL  # noqa: E402
from kernelutil import DTYPE_NO, needs_cuda  # noqa: E402

from kvserve.kernels.decode_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
)

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # interpreter internals
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]  # -inf - -inf, masked

# (q heads, kv heads, head_dim, page): GQA ratios 1, 3, 4, 8; pages 1, 4, 8, 16; one head_dim
# that is not a power of two (48: masked lanes of BLOCK_D = 64).
SHAPES = [(2, 2, 32, 1), (9, 3, 16, 4), (4, 1, 48, 8), (8, 1, 64, 16)]
# Context lengths: ragged, empty (graph padding), a single key, a multiple of every page and
# key tile size (64), and the longest spanning 7 key tiles of 16.
SEQ_LENS = [37, 0, 1, 100, 64]


def _run(gen, device, paged_kv, H, KVH, D, page, dtype, seq_lens, splits, block_n=None, counters=None):
    k_cache, v_cache, bt = paged_kv(gen, seq_lens, page, KVH, D, dtype, device)
    q = (torch.randn(len(seq_lens), H, D, generator=gen) * 1.5).to(dtype).to(device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    got = paged_decode_attention(q, k_cache, v_cache, bt, sl, D ** -0.5, splits=splits, out=out,
                                 block_n=block_n, counters=counters)
    assert got is out
    ref = paged_decode_attention_ref(q, k_cache, v_cache, bt, sl, D ** -0.5)
    return out, ref


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("splits", [1, 5])  # 5: some splits of the short sequences are empty
@pytest.mark.parametrize("H,KVH,D,page", SHAPES)
def test_decode_matches_reference(device, paged_kv, rel, H, KVH, D, page, splits, dtype):
    gen = torch.Generator().manual_seed(H * 1000 + page * 10 + splits + 100_000 * DTYPE_NO[dtype])
    out, ref = _run(gen, device, paged_kv, H, KVH, D, page, dtype, SEQ_LENS, splits)
    assert not out.isnan().any()
    assert rel(out, ref) < TOL[dtype]
    for b, L in enumerate(SEQ_LENS):  # each sequence on its own, so no long one hides a short one
        if L:
            assert rel(out[b], ref[b]) < TOL[dtype], (b, L)
        else:
            assert (out[b] == 0).all()


@pytest.mark.parametrize("splits", [None, 2, 32])
def test_decode_default_and_many_splits(device, paged_kv, rel, splits):
    """splits=None picks num_splits(batch); 32 splits on one tile leaves 31 of them empty."""
    gen = torch.Generator().manual_seed(11 + (splits or 0))
    seq_lens = [3, 0, 29]
    out, ref = _run(gen, device, paged_kv, 4, 1, 32, 4, torch.float32, seq_lens, splits)
    assert rel(out, ref) < 1e-5
    assert (out[1] == 0).all()


@pytest.mark.parametrize("page,block_n", [(16, 16), (32, 16), (4, 32), (2, 64)])
def test_decode_block_n_vs_page(device, paged_kv, rel, page, block_n):
    """Key tiles of one page, smaller than a page, and spanning several pages."""
    gen = torch.Generator().manual_seed(page * 100 + block_n)
    seq_lens = [70, 0, 2]
    for splits in (1, 3):
        out, ref = _run(gen, device, paged_kv, 4, 1, 32, page, torch.float32, seq_lens, splits, block_n)
        assert rel(out, ref) < 1e-5, splits
        assert (out[1] == 0).all()


@pytest.mark.parametrize("splits", [1, 4])
def test_decode_strided_q_and_out(device, paged_kv, rel, splits):
    """q as the model passes it (a view into the packed qkv rows), out a view into a larger
    buffer: the launcher must use the strides, and write nothing outside the view."""
    gen = torch.Generator().manual_seed(5 + splits)
    H, KVH, D, page = 8, 2, 32, 8
    seq_lens = [45, 9, 0]
    k_cache, v_cache, bt = paged_kv(gen, seq_lens, page, KVH, D, torch.float32, device)
    qkv = torch.randn(len(seq_lens), (H + 2 * KVH) * D, generator=gen).to(device)
    q = qkv.split([H * D, KVH * D, KVH * D], dim=-1)[0].view(-1, H, D)
    assert not q.is_contiguous()
    buf = torch.full((len(seq_lens), H + 2, D), float("nan"), device=device)
    out = buf[:, 1:H + 1]
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    paged_decode_attention(q, k_cache, v_cache, bt, sl, D ** -0.5, splits=splits, out=out)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, bt, sl, D ** -0.5)
    assert rel(out, ref) < 1e-5
    assert (out[2] == 0).all()
    assert buf[:, 0].isnan().all() and buf[:, H + 1].isnan().all()


def test_decode_empty_batch(device):
    q = torch.empty(0, 4, 16, device=device)
    kc = torch.zeros(2, 4, 2, 16, device=device)
    out = paged_decode_attention(q, kc, kc, torch.zeros(0, 1, dtype=torch.int32, device=device),
                                 torch.zeros(0, dtype=torch.int32, device=device), 0.25)
    assert out.shape == (0, 4, 16)


# Real sizes (CUDA only): head_dim 128, 32 q / 8 kv heads, pages of 16, contexts of thousands.
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("splits", [None, 1, 16])
def test_decode_real_size(device, paged_kv, rel, dtype, splits):
    gen = torch.Generator().manual_seed(1234 + (splits or 0))
    seq_lens = [4097, 1, 0, 2048, 1000, 3333, 16, 777]
    out, ref = _run(gen, device, paged_kv, 32, 8, 128, 16, dtype, seq_lens, splits)
    assert not out.isnan().any()
    assert rel(out, ref) < TOL[dtype]
    assert (out[2] == 0).all()


@needs_cuda
@pytest.mark.parametrize("H,KVH,D,page", [(64, 8, 128, 16), (28, 4, 128, 32), (16, 16, 64, 16), (32, 8, 256, 16)])
def test_decode_real_size_shapes(device, paged_kv, rel, H, KVH, D, page):
    """Other real head layouts (GQA 8 and 7, MHA, head_dim 256 takes block_n 32), big batch."""
    gen = torch.Generator().manual_seed(H * 1000 + D)
    seq_lens = torch.randint(0, 3000, (48,), generator=gen).tolist()
    seq_lens[5] = 0
    out, ref = _run(gen, device, paged_kv, H, KVH, D, page, torch.bfloat16, seq_lens, None)
    assert not out.isnan().any()
    assert rel(out, ref) < 1e-2
    assert (out[5] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("splits", [1, 3, 32])
@pytest.mark.parametrize("H,KVH,D,page", [(8, 2, 64, 16), (9, 3, 48, 4)])
@pytest.mark.parametrize("grid_order", ["forward", "reversed"])
def test_decode_fused_rope_kv_write(device, paged_kv, rel, H, KVH, D, page, splits, dtype, grid_order,
                                    monkeypatch):
    """``rope=``: the step's token enters unrotated; the kernel rotates q in registers (q in
    memory untouched), and the split holding the last key rotates k and stores k and v at the
    slot. Each split reads its first tile before that (before the PDL wait), so the split that
    holds the key patches it in from registers; later tiles are read after the store. Against
    ``rope_kv_write_ref`` then the float64 reference: the caches bit for bit (the token's slot
    was NaN before; a padding sequence, slot -1 and length 0, writes nothing), the output within
    the attention tolerance. The interpreter runs the
    programs one after another; ``reversed`` runs them last first, so a store by another split
    than the one that reads the key (a race on a GPU) leaves that split reading NaN."""
    import builtins

    from kvserve.kernels.common import RopeWrite
    from kvserve.kernels.rope_kv_write import rope_kv_write_ref
    from kvserve.layers.rotary import RotaryEmbedding
    if grid_order == "reversed":
        if device.type != "cpu":
            pytest.skip("grid order is the interpreter's")
        import triton.runtime.interpreter as interp
        monkeypatch.setattr(interp, "range", lambda *a: reversed(builtins.range(*a)), raising=False)
    gen = torch.Generator().manual_seed(H * 100 + splits + 10_000 * DTYPE_NO[dtype])
    seq_lens = [37, 0, 1, 100, 64, 129]
    kc, vc, bt = paged_kv(gen, seq_lens, page, KVH, D, dtype, device)
    B = len(seq_lens)
    rope = RotaryEmbedding(D, 256, 10000.0).to(device)
    positions = torch.tensor([max(L - 1, 0) for L in seq_lens], device=device)
    slots = torch.tensor([int(bt[b, (L - 1) // page]) * page + (L - 1) % page if L else -1
                          for b, L in enumerate(seq_lens)], device=device)
    keep = slots >= 0
    kc.view(-1, KVH, D)[slots[keep]] = float("nan")  # the step's keys and values are not in yet
    vc.view(-1, KVH, D)[slots[keep]] = float("nan")
    qkv = (torch.randn(B, (H + 2 * KVH) * D, generator=gen) * 2).to(dtype).to(device)
    q, k, v = (t.view(B, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], dim=-1))
    q0 = q.clone()
    kc_ref, vc_ref = kc.clone(), vc.clone()
    qr, _ = rope_kv_write_ref(q.clone(), k.clone(), v.clone(), positions, slots, rope.cos, rope.sin, kc_ref, vc_ref)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, kc, vc, bt, sl, D ** -0.5, splits=splits, out=out,
                           rope=RopeWrite(positions, slots, k, v, rope.cos, rope.sin))
    assert torch.equal(q, q0)
    assert torch.equal(kc.isnan(), kc_ref.isnan()) and torch.equal(kc.nan_to_num(), kc_ref.nan_to_num())
    assert torch.equal(vc.isnan(), vc_ref.isnan()) and torch.equal(vc.nan_to_num(), vc_ref.nan_to_num())
    ref = paged_decode_attention_ref(qr, kc_ref, vc_ref, bt, sl, D ** -0.5)
    assert not out.isnan().any()
    for b, L in enumerate(seq_lens):
        if L:
            assert rel(out[b], ref[b]) < TOL[dtype], (b, L)
        else:
            assert (out[b] == 0).all()


_COMPILE_FUSED_PTX = """
import sys, triton
from triton.backends.compiler import GPUTarget
from kvserve.kernels.decode_attention import ROPE_LAUNCH, _decode_split_kernel as K
const = dict(GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_D=128, PAGE=16, BLOCK_N=64, NUM_SPLITS=4, PREC="tf32",
             FMT=0, BITS=16, QGROUP=1, FAST=False, VD=1, HEADS=4, MERGE_S=4, ROPE=True, USE_PDL=False,
             SINK=0, STREAM=False)
ptrs = {"POS": "*i64", "SLOT": "*i64", "COS": "*fp32", "SIN": "*fp32", "OP": "*fp32", "LSEP": "*fp32",
        "COUNTS": "*i32", "BT": "*i32", "SEQ_LENS": "*i32", "RECENT": "*i32", "RSLOTS": "*i32"}
pointer = {"Q", "KC", "VC", "KS", "VS", "RES", "O", "KN", "VN", *ptrs}
names = K.arg_names
sig = {n: "constexpr" if n in const else ptrs.get(n, "*bf16") if n in pointer
       else ("fp32" if n == "scale_log2" else "i32") for n in names}
src = triton.compiler.ASTSource(fn=K, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **ROPE_LAUNCH})
sys.stdout.write(k.asm["ptx"])
"""


def test_decode_fused_rope_rounding_not_contracted():
    """The fused rotation rounds each product before the sum (``rope_rotate``), which holds only if
    the compiler fuses no multiply into an add there: compiled for sm90 (no GPU needed; in a
    process of its own, outside the interpreter) in bf16 with the launcher's options, the code
    before the first barrier (the rotation and the KV write) has no ``fma`` (17 with contraction)."""
    import os
    import subprocess
    import sys
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _COMPILE_FUSED_PTX], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    head = r.stdout.split("bar.sync")[0]
    assert "st.global" in head  # the KV write comes before the barrier
    assert "fma.rn" not in head


def test_register_caps(monkeypatch):
    """The launch caps registers where the H200 measured it right (``register_cap``): the fused
    RoPE path at the engine's batch-32 grid (8 KV heads, ``num_splits`` for 132 SMs) is capped at
    128, its batch-1 grid is not; 8-bit caches at 2 warps take 160; the plain kernel nothing."""
    from kvserve.kernels import decode_attention as da
    from kvserve.kernels.decode_attention import register_cap
    sms, kvh = 132, 8
    monkeypatch.setattr(da, "sm_count", lambda device: sms)
    grid = {b: b * kvh * da.num_splits(b, kvh, torch.device("cpu")) for b in (1, 32, 256)}
    assert grid[1] == 256 and grid[32] == 512 and grid[256] == 2048
    assert register_cap(False, True, 4, grid[1], sms) is None
    assert register_cap(False, True, 4, grid[32], sms) == 128 and register_cap(False, True, 4, grid[256], sms) == 128
    assert register_cap(True, False, 2, 2304, sms) == 160 and register_cap(True, False, 4, 2304, sms) is None
    assert register_cap(False, False, 4, grid[32], sms) is None


def test_split_merge_in_rounds(device, paged_kv, rel):
    """The merge takes the splits a few at a time (``merge_splits``: 2 per round for a group of 8
    heads of 128 channels at 4 warps): 800 keys in 13 splits of one 64-key tile merge in 7 rounds,
    the last one partial. A group of 3 pads to 4 heads, the fourth masked, 8 splits per round:
    700 keys in 11 splits, 2 rounds. A group of 32 (multi-query) merges 8 heads per pass, 4
    passes. (Counts for the interpreter's grid; on a GPU the small-grid rule may take more.)"""
    from kvserve.kernels.common import merge_splits
    assert merge_splits(8, 128, 4) == (8, 2) and merge_splits(3, 64, 4) == (4, 8)
    assert merge_splits(8, 128, 4, small_grid=True) == (8, 8) and merge_splits(32, 128, 4) == (8, 2)
    gen = torch.Generator().manual_seed(21)
    for H, KVH, D, seq_lens in ((16, 2, 128, [800, 300, 17, 0, 129]), (6, 2, 64, [700, 3, 0, 65]),
                                (32, 1, 128, [450, 0, 70])):
        out, ref = _run(gen, device, paged_kv, H, KVH, D, 16, torch.float32, seq_lens, 13)
        assert not out.isnan().any()
        assert rel(out, ref) < 1e-5, (H, D)
        for b, L in enumerate(seq_lens):
            if L:
                assert rel(out[b], ref[b]) < 1e-5, (H, D, b, L)
            else:
                assert (out[b] == 0).all()


def test_split_merge_counters_reset(device, paged_kv, rel):
    """The last split of each (sequence, KV head) merges the others and zeroes its counter again,
    so launch after launch on the same counters (as a graph replays) stays right and leaves every
    counter at 0."""
    from kvserve.kernels.common import SplitCounters
    gen = torch.Generator().manual_seed(7)
    counters = SplitCounters()
    buffer = counters.get(device, 1)
    for splits in (3, 5, 3, 2):
        out, ref = _run(gen, device, paged_kv, 8, 2, 32, 4, torch.float32, [45, 0, 9, 61], splits, counters=counters)
        assert rel(out, ref) < 1e-5, splits
        assert counters.get(device, 1) is buffer and (buffer == 0).all()

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

from kvserve import kv_format as kf
from kvserve.kernels import kivi_decode
from kvserve.kernels.decode_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H,KVH,bs,splits", [(32, 8, 64, 1), (32, 8, 64, 5), (8, 8, 128, 3), (16, 2, 64, 16),
                                             (32, 8, 64, 32)])
def test_kivi4_decode_against_reference(dtype, H, KVH, bs, splits):
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
    kivi_decode.kivi4_decode(q, views, tables, seq_lens, rs, D ** -0.5, out, max_splits=splits)
    ref = paged_decode_attention_ref(q, kd, vd, tables, seq_lens, D ** -0.5)
    # fp16 products: q times the channel scales and p times the value scales round to fp16
    torch.testing.assert_close(out.double(), ref, rtol=1e-2, atol=1e-2)
    # the Triton kernel on the same cache agrees as closely
    other = paged_decode_attention(q, views, None, tables, seq_lens, D ** -0.5, splits=splits, res_slots=rs)
    torch.testing.assert_close(out.double(), other.double(), rtol=2e-2, atol=2e-2)


@needs_cuda
@pytest.mark.parametrize("max_splits", [1, 3, 32])
def test_kivi4_decode_many_sequences_shared_out(max_splits):
    """40 sequences of mixed lengths (empty ones among them), in at most 1, 3 or 32 splits each,
    as ``_work`` cuts them: against float64 attention, the empty ones zeros."""
    gen = torch.Generator().manual_seed(11 + max_splits)
    H, KVH, D, bs = 32, 8, 128, 64
    f = kf.KVFormat("int4", KVH, D, bs, torch.bfloat16)
    rng = torch.Generator().manual_seed(max_splits)
    lens = [int(x) for x in torch.randint(0, 2500, (40,), generator=rng)]
    lens[3] = lens[17] = 0
    lens[5] = 64
    batch = [(n - 1, 1) if n else (0, 0) for n in lens]
    nb = sum(math.ceil((c + n) / bs) for c, n in batch) + 3
    views, tables, kd, vd, rs = _compressed_batch(gen, f, batch, H, nb)
    q = torch.randn(len(batch), H, D, generator=gen).to("cuda", torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.full_like(q, float("nan"))
    # the step's plan: made for the first layer, read by the next
    plan = kivi_decode.split_plan(seq_lens, tables, KVH, bs, max_splits)
    assert plan.items == kivi_decode.work_items(len(lens), KVH, q.device, max_splits)
    kivi_decode.kivi4_decode(q, views, tables, seq_lens, rs, D ** -0.5, out, max_splits=max_splits, plan=plan)
    ref = paged_decode_attention_ref(q, kd, vd, tables, seq_lens, D ** -0.5)
    some = [i for i, n in enumerate(lens) if n]
    assert torch.equal(out[[3, 17]], torch.zeros_like(out[[3, 17]]))
    torch.testing.assert_close(out[some].double(), ref[some], rtol=1e-2, atol=1e-2)
    # a second layer (another query) on the step's plan: as with a plan of its own
    q2 = torch.randn(len(batch), H, D, generator=gen).to("cuda", torch.bfloat16)
    own, shared = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
    kivi_decode.kivi4_decode(q2, views, tables, seq_lens, rs, D ** -0.5, own, max_splits=max_splits)
    kivi_decode.kivi4_decode(q2, views, tables, seq_lens, rs, D ** -0.5, shared, max_splits=max_splits, plan=plan)
    assert torch.equal(own, shared)


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
    kivi_decode.kivi4_decode(q, views, tables, seq_lens, rs, D ** -0.5, out, max_splits=4)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    ref = paged_decode_attention_ref(q, kd, vd, tables, seq_lens, D ** -0.5)
    torch.testing.assert_close(out[0].double(), ref[0], rtol=1e-2, atol=1e-2)


_COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kvserve.kernels.kivi_decode import _kivi4_decode_kernel as K
names = K.arg_names
ptr = dict(Q="*bf16", KC="*i32", VC="*i32", KS="*i32", VS="*i32", RES="*bf16", BT="*i32",
           RSLOTS="*i32", O="*bf16", OP="*fp32", LSEP="*fp32", PLAN="*i32", SLOT="*i64",
           RMAP="*i64", KN="*bf16", VN="*bf16", COS="*fp32", SIN="*fp32")
import torch
from kvserve.kernels.kivi_decode import cache_strides
from kvserve import kv_format as kf
f = kf.KVFormat("int4", 8, 128, 64, torch.bfloat16)
views = f.views(torch.zeros(2, f.block_bytes, dtype=torch.uint8), torch.zeros(2, 64, 8, 128, dtype=torch.bfloat16))
const = dict(GROUP=4, PAGE=64, L2_AHEAD=2, ROPE=sys.argv[1] == "1", SEAL=sys.argv[1] == "1", TINY=1e-6)
const.update(zip(["s_kcb", "s_kct", "s_kch", "s_vcb", "s_vct", "s_vch", "s_ksb", "s_ksh", "s_vsb", "s_vst", "s_vsh"],
                 cache_strides(views)))
sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "scale_log2" else "i32") for n in names}
div = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ptr}
src = GluonASTSource(fn=K, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=div)
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
ptx = k.asm["ptx"]
print(k.metadata.shared, ptx.count("ld.local") + ptx.count("st.local"), ptx.count("mma.sync"),
      ptx.count("mul.rn.f32"))
"""


@pytest.mark.parametrize("rope", [False, True])
def test_kivi4_decode_compiles_for_sm90_without_shared_memory(rope):
    """The codes go from global memory straight into the products' registers: the kernel uses no
    shared memory (every layout conversion is a register renaming or a shuffle) and nothing is
    spilled; its two products are tensor-core mma.sync. With the fused RoPE + KV write, the
    rotations' products are ``mul.rn`` (never contracted into an FMA: ``rope_rotate``'s rounding).
    Compiled for sm90 in a subprocess (no GPU)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (the tests' conftest sets it)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _COMPILE, str(int(rope))], env=env, check=False, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    shared, local, mma, mul_rn = map(int, r.stdout.split())
    assert shared == 0 and local == 0
    assert mma > 0
    assert (mul_rn > 0) == rope


def test_kivi4_work_items_are_one_wave(monkeypatch):
    """The grid is one wave of ``WAVE`` one-warp programs per SM (a part wave runs as long as a
    whole one), at least one work item per sequence and at most ``max_splits``; another wave
    size (``KernelConfig.kivi_wave``) scales it."""
    monkeypatch.setattr(kivi_decode, "sm_count", lambda device: 132)
    dev = torch.device("cuda")
    for kvh in (1, 2, 8):
        for batch in (1, 3, 8, 16, 32, 33, 64, 100, 131, 132, 256, 512):
            nw = kivi_decode.work_items(batch, kvh, dev)
            assert batch <= nw <= batch * kivi_decode.MAX_SPLITS
            assert nw * kvh <= kivi_decode.WAVE * 132 or nw == batch, (kvh, batch, nw)
            assert nw == batch * kivi_decode.MAX_SPLITS or (nw + 1) * kvh > kivi_decode.WAVE * 132 or nw == batch
    assert kivi_decode.work_items(32, 8, dev) == 132
    assert kivi_decode.work_items(2, 8, dev, max_splits=4) == 8
    assert kivi_decode.work_items(32, 8, dev, wave=4) == 66 and kivi_decode.work_items(32, 8, dev, wave=1) == 32


def test_decode_splits_of_the_other_formats(monkeypatch):
    """What the engine launches for the Triton decode kernel: bf16 2 programs per SM, 8-bit 16,
    KIVI 2 (a layer ``kivi_decode`` turns away takes the Triton kernel at these), rounded up."""
    from kvserve.kernels import decode_attention as da
    monkeypatch.setattr(da, "sm_count", lambda device: 132)
    dev = torch.device("cuda")
    bf16 = kf.KVFormat("auto", 8, 128, 16, torch.bfloat16)
    assert da.decode_splits(bf16, 32, 8, dev) == da.num_splits(32, 8, dev, 2) == 2  # ceil(2 * 132 / 256)
    assert da.decode_splits(None, 32, 8, dev) == 2
    fp8 = kf.KVFormat("fp8", 8, 128, kf.default_block_size("fp8"), torch.bfloat16)
    assert da.decode_splits(fp8, 32, 8, dev) == 9  # ceil(16 * 132 / 256)
    int4 = kf.KVFormat("int4", 8, 128, 64, torch.bfloat16)
    assert da.decode_splits(int4, 32, 8, dev) == 2
    for batch in (1, 3, 33, 512):
        assert 1 <= da.decode_splits(int4, batch, 8, dev) <= 32


def _plan(lens: list[int], nw: int, max_splits: int) -> list[tuple[int, ...]]:
    """``kivi_decode._work`` for each of ``nw`` work items, run on the GPU: (b, split, splits,
    first, tiles per split)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def plan_kernel(SEQ_LENS, OUT, B, NW, MAXS: gl.constexpr, BPAD: gl.constexpr):
        w = gl.program_id(0)
        b, split, n, first, per = kivi_decode._work(SEQ_LENS, B, w, NW, MAXS, BPAD)
        i = gl.arange(0, 32, layout=gl.BlockedLayout([1], [32], [1], [0]))
        v = gl.where(i == 0, b, gl.where(i == 1, split, gl.where(i == 2, n, gl.where(i == 3, first, per))))
        gl.store(OUT + w * 5 + i, v, mask=i < 5)

    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out = torch.full((nw, 5), -1, dtype=torch.int32, device="cuda")
    plan_kernel[(nw,)](seq_lens, out, len(lens), nw, MAXS=max_splits,
                       BPAD=max(32, 1 << (len(lens) - 1).bit_length()), num_warps=1)
    return [tuple(r) for r in out.tolist()]


@needs_cuda
@pytest.mark.parametrize("lens,nw,max_splits", [
    ([32769] * 32, 132, 32),  # uniform: 4 splits each, 128 of the 132 programs
    ([32769] + [1000] * 31, 132, 32),  # a long one among short ones gets the splits
    ([0, 1, 64, 65, 300, 70000, 5, 128], 40, 32),  # empty (graph padding), tiny, exact blocks
    ([100000, 2000], 64, 8),  # the cap on splits of one sequence
    (list(range(0, 40000, 157)), 300, 32),  # 255 sequences, every length class
])
def test_kivi4_work_split_the_batch_evenly(lens, nw, max_splits):
    """``_work``'s plan covers each sequence's 64-key tiles once, in 1 to ``max_splits``
    consecutive work items of ``nw``, none empty but an empty sequence's one; and its splits are
    no longer than the shortest uniform split length C whose splits fit in ``nw`` (found here by
    trying every C), but where a sequence hit the cap; the work items past them have no sequence."""
    plan = _plan(lens, nw, max_splits)
    B = len(lens)
    tiles = [math.ceil(n / 64) for n in lens]

    def count(c):
        return sum(min(max(math.ceil(t / c), 1), max_splits) for t in tiles)
    best = next(c for c in range(1, max(tiles) + 1) if count(c) <= nw)
    w = 0
    for b in range(B):
        n, first, per = plan[w][2], plan[w][3], plan[w][4]
        assert first == w and 1 <= n <= max_splits
        assert [p[:2] for p in plan[w:w + n]] == [(b, s) for s in range(n)]
        assert all(p[2:] == (n, first, per) for p in plan[w:w + n])
        assert (n - 1) * per < tiles[b] <= n * per or tiles[b] == 0 == n - 1
        assert per <= best or math.ceil(tiles[b] / best) > max_splits, (b, per, best, n)  # (or capped)
        w += n
    assert w <= nw and all(p[0] >= B for p in plan[w:])
    if len(set(lens)) == 1:
        assert w == 4 * B and plan[0][2] == 4


@needs_cuda
@pytest.mark.parametrize("lens,nw,max_splits,page", [
    ([32769] * 32, 132, 32, 64),
    ([0, 1, 64, 65, 300, 70000, 5, 128], 40, 32, 128),
    (list(range(0, 40000, 157)), 300, 32, 64),
])
def test_kivi4_step_plan_rows(lens, nw, max_splits, page):
    """``_plan_kernel``'s rows (what every layer's programs read instead of planning) are
    ``_work``'s plan spelled out: the work item's sequence, its key range, the sequence's length
    and splits, the split, and the block of its first key (through a shuffled block table); the
    rows past the plan name no sequence; WORK holds each sequence's (first item, splits)."""
    B = len(lens)
    g = torch.Generator().manual_seed(3)
    width = max(math.ceil(n / page) for n in lens) + 1
    tables = torch.randperm(B * width, generator=g).view(B, width).to(torch.int32).cuda()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    plan = torch.full((nw, kivi_decode.PLAN_W.value), -7, dtype=torch.int32, device="cuda")
    work = torch.full((B, 2), -7, dtype=torch.int32, device="cuda")
    kivi_decode._plan_kernel[(nw,)](seq_lens, tables, plan, work, B, nw, tables.stride(0), MAXS=max_splits,
                                    BPAD=max(32, 1 << (B - 1).bit_length()), PAGE=page, num_warps=1)
    expect = _plan(lens, nw, max_splits)
    rows, work, tables = plan.tolist(), work.tolist(), tables.tolist()
    for w, (b, split, n, first, per) in enumerate(expect):
        if b >= B:
            assert rows[w][0] >= B
            continue
        start = split * per * 64
        assert rows[w][:6] == [b, start, min(start + per * 64, lens[b]), lens[b], n, split], w
        assert rows[w][6] == tables[b][start // page]
        assert work[b] == [first, n]


def _clone_cache(f, views):
    """A copy of a layer's bytes (codes and scales of every block) and residual, with its views."""
    data = torch.empty(0, dtype=torch.uint8, device=views.k_codes.device).set_(views.k_codes.untyped_storage())
    data = data.view(-1, f.block_bytes).clone()
    return data, f.views(data, views.residual.clone())


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs", [64, 128])
def test_kivi4_fused_rope_write_as_separate_kernels(dtype, bs):
    """The kernel doing the step's RoPE + KV write itself (``rope=``; with 64-token blocks the seal
    of the block a key fills too) leaves every byte of the cache and the residual as ``seal_keys`` +
    ``rope_kv_write_quant`` leave them, q, k and v untouched in
    memory, and returns what the kernel returns after them, bit for bit; that output matches
    float64 attention over the dequantized cache with the rotated q. Sequences: a first token
    (residual only), tokens that fill a block (sealed this step: the key through ``seal_keys``, the
    value through this kernel), an unsealed tail, a long one over many splits, and a graph-padding
    row (length 0, slot -1). The new tokens' places start as garbage."""
    from kvserve.kernels.common import RopeWrite
    from kvserve.kernels.kv_quant import rope_kv_write_quant, seal_keys
    from kvserve.layers.rotary import RotaryEmbedding
    gen = torch.Generator().manual_seed(5 + bs)
    H, KVH, D = 32, 8, 128
    f = kf.KVFormat("int4", KVH, D, bs, dtype)
    ctx = [0, bs - 1, 2 * bs + 40, 1500, 3 * bs - 1]
    nb = sum(math.ceil((c + 1) / bs) for c in ctx) + 3
    views, tables, _, _, rs = _compressed_batch(gen, f, [(c, 1) for c in ctx], H, nb)
    B = len(ctx) + 1  # + the padding row
    tables = torch.cat((tables, torch.zeros_like(tables[:1])))
    rs = torch.cat((rs, torch.zeros_like(rs[:1])))
    slots = [int(tables[i, c // bs]) * bs + c % bs for i, c in enumerate(ctx)] + [-1]
    rmap = [int(rs[i]) * bs + c % bs if (c + 1) % bs else -1 for i, c in enumerate(ctx)] + [-1]
    # garbage where this step writes: the new value's codes and scale, the new key's residual row
    for i, c in enumerate(ctx):
        blk, off = slots[i] // bs, slots[i] % bs
        views.v_codes[blk, off] = torch.randint(0, 256, views.v_codes[blk, off].shape, generator=gen,
                                                dtype=torch.uint8).to("cuda")
        views.v_scales[blk, off] = torch.rand(views.v_scales[blk, off].shape, generator=gen).to("cuda", torch.float16)
        views.residual[rs[i], c % bs] = torch.randn(KVH, D, generator=gen).to("cuda", dtype)
    seq_lens = torch.tensor([c + 1 for c in ctx] + [0], dtype=torch.int32, device="cuda")
    positions = torch.tensor(ctx + [0], device="cuda")
    slots, rmap = torch.tensor(slots, device="cuda"), torch.tensor(rmap, device="cuda")
    cu_q = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    max_seal = max((c + 1) // bs - c // bs for c in ctx)
    rope = RotaryEmbedding(D, 4096, 500000.0).to("cuda")
    qkv = torch.randn(B, (H + 2 * KVH) * D, generator=gen).to("cuda", dtype)

    def split(t):  # strided views of the packed projection, as the model hands them over
        q, k, v = t.split([H * D, KVH * D, KVH * D], -1)
        return q.view(B, H, D), k.view(B, KVH, D), v.view(B, KVH, D)
    runs = []
    for fused in (False, True):
        data, vw = _clone_cache(f, views)
        x = qkv.clone()
        q, k, v = split(x)
        if not (fused and kivi_decode.seals(f)):  # (64-token blocks: the fused kernel seals them)
            seal_keys(k, rope.cos, rope.sin, cu_q, seq_lens, tables, rs, vw, max_seal)
        if not fused:
            rope_kv_write_quant(q, k, v, positions, slots, rmap, rope.cos, rope.sin, vw)
        out = torch.full_like(q, float("nan"))
        write = RopeWrite(positions, slots, k, v, rope.cos, rope.sin, res_mapping=rmap)
        kivi_decode.kivi4_decode(q, vw, tables, seq_lens, rs, D ** -0.5, out, rope=write if fused else None)
        runs.append((data, vw, x, out))
    (data_a, vw_a, x_a, out_a), (data_b, vw_b, x_b, out_b) = runs
    assert torch.equal(data_b, data_a), (data_b != data_a).nonzero()[:8]
    assert torch.equal(vw_b.residual, vw_a.residual)
    assert torch.equal(x_b, qkv)
    assert torch.equal(out_b, out_a)
    assert torch.equal(out_b[-1], torch.zeros_like(out_b[-1]))
    q_rot = split(x_a)[0]  # (rotated in place by rope_kv_write_quant: test_kv_quant checks it)
    for i, c in enumerate(ctx):
        keys, vals = kf.read_kv(vw_b, tables[i], c + 1, int(rs[i]))
        keys, vals = (t.double().repeat_interleave(H // KVH, dim=1) for t in (keys, vals))  # [L, H, D]
        att = torch.einsum("hd,lhd->hl", q_rot[i].double(), keys) * D ** -0.5
        ref = torch.einsum("hl,lhd->hd", att.softmax(-1), vals)
        torch.testing.assert_close(out_b[i].double(), ref, rtol=1e-2, atol=1e-2)

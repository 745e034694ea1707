"""Compressed KV cache (``kvserve/kv_format.py``, ``kvserve/kernels/kv_quant.py``).

* round trip: quantize -> dequantize against float64, within each format's error bound;
* the quantizing write kernel (fused with RoPE) writes the same codes and scales as the
  PyTorch reference, and nothing outside the step's slots (the cache starts as 0xFF bytes);
* KIVI: the seal kernel quantizes the blocks a step fills exactly like the reference, with the
  earlier keys of a block taken from the residual (chunk boundaries inside blocks);
* the attention kernels reading compressed caches match float64 attention over the
  dequantized values (decode with splits, prefill with prefix context and chunk boundaries).
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kernelutil import needs_cuda  # noqa: E402

from kvserve import kv_format as kf
from kvserve.errors import ConfigError
from kvserve.kernels import kivi_decode
from kvserve.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from kvserve.kernels.kv_quant import rope_kv_write_quant, seal_keys
from kvserve.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from kvserve.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter internals

FORMATS = ["fp8", "int8", "int4", "int2"]
# fp8/int8 with calibrated (static) scales: one per layer and KV head, none stored per token
# (and with scale groups smaller than the head: the kernels' general, unfolded path)
KERNEL_FORMATS = FORMATS + ["fp8-static", "int8-static", "int8-g16", "int4-g16"]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _fmt(name, kvh=2, D=32, bs=8, dtype=torch.float32, group=0):
    base, static = name.removesuffix("-static"), name.endswith("-static")
    if base.endswith("-g16"):
        base, group = base.removesuffix("-g16"), 16
    bs = max(bs, 16)  # a compressed attention tile lies in one block (and GPU dots need >= 16)
    return kf.KVFormat(base, kvh, D, bs, dtype, group, static=static)


def _outliers(x: torch.Tensor, gen) -> torch.Tensor:
    """Real keys have a few large channels: scale some channels up."""
    D = x.shape[-1]
    ch = torch.randperm(D, generator=gen)[:max(1, D // 16)]
    x = x.clone()
    x[..., ch] *= 8
    return x


# -- turned keys -------------------------------------------------------------------------------
@pytest.mark.parametrize("D", [32, 64, 128])
def test_hadamard_is_orthonormal_and_keeps_scores(D):
    """The reference transform against Sylvester's matrix built here in float64: the same
    product, its own inverse, and q . k unchanged when both are turned."""
    gen = torch.Generator().manual_seed(D)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < D:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    h /= math.sqrt(D)
    x = torch.randn(5, 3, D, generator=gen) * 4
    q = torch.randn(5, 3, D, generator=gen)
    torch.testing.assert_close(kf.hadamard(x).double(), x.double() @ h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kf.hadamard(kf.hadamard(x)), x, rtol=1e-5, atol=1e-5)
    scores = (q.double() * x.double()).sum(-1)
    torch.testing.assert_close((kf.hadamard(q).double() * kf.hadamard(x).double()).sum(-1), scores,
                               rtol=1e-5, atol=1e-4)
    # which formats turn: the 8-bit ones (calibrated too); not KIVI, not uncompressed
    assert kf.KVFormat("fp8", 2, D, 16, torch.float32).rotate_keys
    assert kf.KVFormat("int8", 2, D, 16, torch.float32).rotate_keys
    assert kf.KVFormat("fp8", 2, D, 16, torch.float32, static=True).rotate_keys
    assert not kf.KVFormat("int4", 2, D, 16, torch.float32).rotate_keys
    assert not kf.KVFormat("auto", 2, D, 16, torch.float32).rotate_keys


# -- round trip ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("group", [0, 16])
def test_round_trip_error_bounds(name, group):
    gen = torch.Generator().manual_seed(hash((name, group)) % 2**31)
    f = _fmt(name, kvh=3, D=64, bs=16, group=group)
    x = _outliers(torch.randn(16, 3, 64, generator=gen, dtype=torch.float64) * 3, gen)
    x[2, 1] = 0.0  # an all-zero group quantizes to zeros, not NaN
    if f.kivi:
        kp, kparams = kf.quantize_keys_kivi(x.float(), f)
        k = kf.dequantize_keys_kivi(kp, kparams, f).double()
        vp, vparams = kf.quantize_values_kivi(x.float(), f)
        v = kf.dequantize_values_kivi(vp, vparams, f).double()
        step_k = (x.amax(0) - x.amin(0)) / ((1 << f.bits) - 1)  # per channel
        g = x.view(16, 3, f.num_groups, f.group)
        step_v = ((g.amax(-1) - g.amin(-1)) / ((1 << f.bits) - 1)).repeat_interleave(f.group, -1)
        # half a step, plus the fp16 rounding of scale and min
        assert ((k - x).abs() <= step_k * 0.5 * (1 + 2e-3) + x.abs().amax(0) * 2e-3 + 1e-6).all()
        assert ((v - x).abs() <= step_v * 0.5 * (1 + 2e-3) + x.abs().amax() * 2e-3 + 1e-6).all()
        assert torch.equal(v[2, 1], torch.zeros_like(v[2, 1]))
        return
    codes, scales = kf.quantize_sym(x.float(), f)
    y = kf.dequantize_sym(codes, scales, f).double()
    g = x.view(16, 3, f.num_groups, f.group).abs().amax(-1).repeat_interleave(f.group, -1)
    if name == "int8":
        bound = g / 127 * 0.5 * (1 + 2e-3) + g * 2e-3
    else:  # e4m3: 3 mantissa bits (relative 2^-4), subnormals below 2^-6 of the scale
        bound = x.abs() * 2.0 ** -4 + g / 448 * 2.0 ** -9 + g * 2e-3
    assert ((y - x).abs() <= bound + 1e-7).all()
    assert torch.equal(y[2, 1], torch.zeros_like(y[2, 1]))
    # and the error is not trivially zero: the codes really are compressed
    assert (y - x).abs().max() > 0


def test_bad_group_and_dtype_are_config_errors():
    with pytest.raises(ConfigError, match="kv_group_size"):
        _fmt("int4", D=64, group=24)
    with pytest.raises(ConfigError, match="kv_group_size"):
        _fmt("int2", D=64, group=2)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        _fmt("int3")
    # an attention tile lies in one block, and tiles are at least 16 keys: every compressed format
    for name in FORMATS:
        with pytest.raises(ConfigError, match=r"block_size >= 16 \(default 64\), got 8"):
            kf.KVFormat(name, 2, 32, 8, torch.float32)
    assert kf.KVFormat("fp8", 2, 32, 16, torch.float32).block_size == 16  # the smallest allowed
    assert kf.KVFormat("auto", 2, 32, 8, torch.float32).block_size == 8  # uncompressed: any


def test_layout_names_and_scale_strides():
    """A layout change must change ``KVFormat.layout``, which keys chunks that outlive the process
    (KV tiers): a chunk of another layout is then not found, never misread. Pinned here with
    the byte layout it names: per-token scales head-major in the block, a tile's contiguous; KIVI
    codes head-major too, a head's rows of a block one contiguous run."""
    bs, kvh, D = 16, 4, 32
    expect = {"auto": "", "fp8": "vT+h+sH", "int8": "vT+h+sH", "int4": "sH+cH", "int2": "sH+cH"}
    for name, lay in expect.items():
        assert kf.KVFormat(name, kvh, D, bs, torch.float32).layout == lay, name
    assert kf.KVFormat("fp8", kvh, D, bs, torch.float32, static=True).layout == "vT+h"  # no per-token scales
    for name in ("fp8", "int4"):
        f = kf.KVFormat(name, kvh, D, bs, torch.float32)
        v = f.views(torch.zeros(3, f.block_bytes, dtype=torch.uint8))
        vs = v.v_scales  # [nb, bs, kvh, G(, 2)]
        per = 2 if f.kivi else 1
        assert vs.stride(1) == f.num_groups * per and vs.stride(2) == bs * f.num_groups * per, name
        if not f.kivi:
            assert v.k_scales.stride(1) == f.num_groups and v.k_scales.stride(2) == bs * f.num_groups
        dp = D // f.per
        for c in (v.k_codes, v.v_codes) if f.kivi else (v.k_codes,):  # [nb, bs, kvh, dp]
            token, head = (dp, bs * dp) if f.kivi else (kvh * dp, dp)
            assert (c.stride(1), c.stride(2), c.stride(3)) == (token, head, 1), name


def test_bytes_per_block_count_scales():
    f16 = kf.KVFormat("auto", 8, 128, 16, torch.bfloat16)
    f8 = kf.KVFormat("fp8", 8, 128, 16, torch.bfloat16)
    i4 = kf.KVFormat("int4", 8, 128, 64, torch.bfloat16)
    assert f16.block_bytes == 2 * 16 * 8 * 128 * 2
    assert f8.block_bytes == 2 * 16 * 8 * (128 + 2)  # codes + one fp16 scale per token and head
    # int4: 64 B codes per token-head for K and V; K: (scale, min) per channel per 64-token block;
    # V: (scale, min) per token and head
    assert i4.block_bytes == 2 * 64 * 8 * 64 + 8 * 128 * 4 + 64 * 8 * 4
    # Llama-3-8B: 140 bytes per token and head against bf16's 512 (3.66x); int2: 76 (6.7x)
    assert i4.block_bytes / 64 / 8 == 140
    assert kf.KVFormat("int2", 8, 128, 64, torch.bfloat16).block_bytes / 64 / 8 == 76
    # calibrated 8-bit: codes only, exactly half of bf16
    assert kf.KVFormat("fp8", 8, 128, 16, torch.bfloat16, static=True).block_bytes * 2 == f16.block_bytes


# -- the write kernel and the seal kernel ---------------------------------------------------------
def _step(gen, batch, bs, nb):
    """(ctx, new) per sequence -> block tables (random permutation), positions, slots."""
    perm = torch.randperm(nb, generator=gen)
    tables, used, positions, slots = [], 0, [], []
    width = max(math.ceil((c + n) / bs) for c, n in batch)
    for c, n in batch:
        npg = math.ceil((c + n) / bs)
        t = perm[used:used + npg]
        used += npg
        tables.append(torch.cat((t, torch.zeros(width - npg, dtype=t.dtype))))
        for p in range(c, c + n):
            positions.append(p)
            slots.append(int(t[p // bs]) * bs + p % bs)
    return torch.stack(tables).int(), torch.tensor(positions), torch.tensor(slots)


def _views(f, nb, slots=4, fill=0xFF):
    """``fill``: a byte, or "stale": random bytes as a reused block holds (finite codes: e4m3's
    NaN patterns 0x7F/0xFF never occur, the writers clamp)."""
    if fill == "stale":
        data = torch.randint(0, 256, (nb, f.block_bytes), generator=torch.Generator().manual_seed(nb),
                             dtype=torch.uint8)
        data[(data & 0x7F) == 0x7F] = 0
        data = data.to(DEV)
    else:
        data = torch.full((nb, f.block_bytes), fill, dtype=torch.uint8, device=DEV)
    res = torch.randn(slots, f.block_size, f.num_kv_heads, f.head_dim, device=DEV).to(f.model_dtype) if f.kivi else None
    scales = None
    if f.static:  # calibrated-looking: max |x| of the test data over the code range, per head
        qmax = kf.FP8_MAX if f.name == "fp8" else kf.INT8_MAX
        gen = torch.Generator().manual_seed(nb)
        scales = ((torch.rand(2, f.num_kv_heads, generator=gen) + 1.0) * 12 / qmax).to(DEV)
    return data, f.views(data, res, scales)


@pytest.mark.parametrize("name", KERNEL_FORMATS)
@pytest.mark.parametrize("rotate_k", [False, True])
def test_write_kernel_matches_reference(name, rotate_k):
    gen = torch.Generator().manual_seed(7 + KERNEL_FORMATS.index(name))
    H, KVH, D, bs = 4, 2, 32, 8
    f = _fmt(name, KVH, D, bs, group=16 if name in ("int8", "int4", "int2") else 0)
    bs = f.block_size
    # ctx 5 + 14 new: the step fills block 0 (sealed from residual + new) and block 1, and
    # leaves 3 keys in block 2; ctx 16 + 1: decode starting a block; ctx 6 + 2: fills block 0
    batch = [(5, 14), (16, 1), (6, 2)]
    nb = 12 if bs == 8 else 8
    tables, positions, slots = _step(gen, batch, bs, nb)
    T = positions.shape[0]
    rope = RotaryEmbedding(D, 64, 10000.0).to(DEV)
    qkv = (_outliers(torch.randn(T, (H + 2 * KVH) * D, generator=gen), gen) * 2).to(DEV)
    q, k, v = (t.view(T, -1, D) for t in qkv.split([H * D, KVH * D, KVH * D], -1))
    data, views = _views(f, nb)
    data_ref, views_ref = _views(f, nb)
    if f.static:
        assert torch.equal(views.k_scales, views_ref.k_scales)
    if f.kivi:
        views_ref.residual.copy_(views.residual)
    res_slots = [2, 0, 3]
    seq_lens = [c + n for c, n in batch]
    cu = [0]
    for _, n in batch:
        cu.append(cu[-1] + n)
    res_map = []
    for i, (c, n) in enumerate(batch):
        full = (c + n) // bs * bs
        res_map += [res_slots[i] * bs + p % bs if p >= full else -1 for p in range(c, c + n)]

    # the reference
    qr_ref, kr_ref = rope(positions.to(DEV), q.clone(), k.clone())
    qr_ref, kr_ref = kf.rotate_qk(qr_ref, f), kf.rotate_qk(kr_ref, f)  # turned (8-bit, per-token scales)
    if f.kivi:
        for i in range(len(batch)):
            kf.write_keys_kivi(views_ref, kr_ref, cu[i], cu[i + 1] - cu[i], seq_lens[i], tables[i], res_slots[i])
    kf.write_tokens(views_ref, kr_ref, v, slots.to(DEV))

    # the kernels (seal first: it reads the residual rows the write kernel then refills)
    k_raw = k.clone()
    if f.kivi:
        max_seal = max((c + n) // bs - c // bs for c, n in batch)
        seal_keys(k, rope.cos, rope.sin, torch.tensor(cu, dtype=torch.int32, device=DEV),
                  torch.tensor(seq_lens, dtype=torch.int32, device=DEV), tables.to(DEV),
                  torch.tensor(res_slots, dtype=torch.int32, device=DEV), views, max_seal)
    rope_kv_write_quant(q, k, v, positions.to(DEV), slots.to(DEV), torch.tensor(res_map, device=DEV),
                        rope.cos, rope.sin, views, rotate_k_inplace=rotate_k)
    torch.testing.assert_close(q, qr_ref, rtol=0, atol=0)
    torch.testing.assert_close(k, kr_ref if rotate_k else k_raw, rtol=0, atol=0)
    # every byte, codes and scales, and the untouched 0xFF elsewhere
    assert torch.equal(data, data_ref), (data != data_ref).nonzero()[:8]
    if f.kivi:
        assert torch.equal(views.residual, views_ref.residual)
        # the keys left unsealed are in the residual, rotated
        tail = kr_ref[cu[0] + 16 - 5:cu[1]]  # sequence 0 (ctx 5): positions 16..18
        assert torch.equal(views.residual[2, :3], tail.to(views.residual.dtype))


# -- attention over compressed caches ----------------------------------------------------------
def _compressed_batch(gen, f, batch, H, nb, slots_per_seq=None):
    """Fill a compressed cache through the reference writer (each sequence's context, then this
    step's tokens), return views, tables, dequantized dense caches for the reference kernels."""
    bs, KVH, D = f.block_size, f.num_kv_heads, f.head_dim
    data, views = _views(f, nb, slots=len(batch) + 1, fill="stale")  # past each end: a reused block's codes
    tables, _, _ = _step(gen, batch, bs, nb)
    res_slots = list(range(1, len(batch) + 1))
    for i, (c, n) in enumerate(batch):
        L = c + n
        k = _outliers(torch.randn(L, KVH, D, generator=gen), gen).to(DEV).to(f.model_dtype)
        v = torch.randn(L, KVH, D, generator=gen).to(DEV).to(f.model_dtype)
        pos = torch.arange(L)
        sl = (tables[i][pos // bs].long() * bs + pos % bs).to(DEV)
        for lo, hi in ((0, c), (c, L)):  # two steps: the context, then the new tokens
            if hi > lo:
                if f.kivi:
                    kf.write_keys_kivi(views, k, lo, hi - lo, hi, tables[i], res_slots[i])
                kf.write_tokens(views, k[lo:hi], v[lo:hi], sl[lo:hi])
    # dense dequantized copies for the float64 references
    kd = torch.zeros(nb, bs, KVH, D, dtype=torch.float64, device=DEV)
    vd = torch.zeros_like(kd)
    for i, (c, n) in enumerate(batch):
        L = c + n
        kk, vv = kf.read_kv(views, tables[i].to(DEV), L, res_slots[i])
        npg = math.ceil(L / bs)
        pad = npg * bs - L
        kk = torch.cat((kk.double(), torch.zeros(pad, KVH, D, dtype=torch.float64, device=DEV)))
        vv = torch.cat((vv.double(), torch.zeros(pad, KVH, D, dtype=torch.float64, device=DEV)))
        kd[tables[i][:npg].long()] = kk.view(npg, bs, KVH, D)
        vd[tables[i][:npg].long()] = vv.view(npg, bs, KVH, D)
    return views, tables.to(DEV), kd, vd, torch.tensor(res_slots, dtype=torch.int32, device=DEV)


def test_e4m3_codes_read_as_pytorch_converts_them():
    """``codes_float`` (e4m3 by its bits on the CPU) against PyTorch's own float8 conversion:
    every one of the 256 codes, NaN where PyTorch gives NaN, and in a shape of the cache's."""
    every = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    got, want = kf.codes_float(every), every.float()
    assert torch.equal(got.isnan(), want.isnan()) and int(want.isnan().sum()) == 2
    ok = ~want.isnan()
    assert torch.equal(got[ok], want[ok])
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 16, 2, 32, generator=gen) * 50).to(torch.float8_e4m3fn)
    assert torch.equal(kf.codes_float(x), x.float())
    assert kf.codes_float(x[:0]).shape == (0, 16, 2, 32)


@pytest.mark.parametrize("name", ["fp8", "int8-static", "int4"])
def test_sequences_read_together_equal_each_read_alone(name, monkeypatch):
    """``read_kv_many`` (the CPU path's read of a step's sequences, their blocks gathered and
    dequantized together, split where they pass ``READ_TOKENS``) gives each sequence exactly
    ``read_kv``'s K and V, KIVI's unsealed keys from its own residual row."""
    if DEV != "cpu":
        pytest.skip("the CPU reference path")
    gen = torch.Generator().manual_seed(7)
    f = _fmt(name)
    batch = [(5, 3), (40, 1), (0, 16), (17, 2), (31, 1)]
    views, tables, _, _, rs = _compressed_batch(gen, f, batch, 4, nb=24)
    lens = [c + n for c, n in batch]
    alone = [kf.read_kv(views, tables[i], L, int(rs[i])) for i, L in enumerate(lens)]
    for budget in (10_000, 40, 1):  # one gather; a few; one sequence each
        monkeypatch.setattr(kf, "READ_TOKENS", budget)
        together = list(kf.read_kv_many(views, list(tables), lens, [int(r) for r in rs]))
        assert len(together) == len(batch)
        for (k, v), (ka, va), L in zip(together, alone, lens):
            assert k.shape == (L, f.num_kv_heads, f.head_dim)
            assert torch.equal(k, ka) and torch.equal(v, va)


def _decode_against_ref(gen, f, batch, H, nb, tol, gluon=False, **launch):
    """Decode attention over a cache filled by ``_compressed_batch`` (the output poisoned first)
    against float64 attention over the dequantized cache. q in the format's model dtype.
    ``gluon``: also the Gluon KIVI int4 kernel where it takes the layer (the engine's choice)."""
    views, tables, kd, vd, rs = _compressed_batch(gen, f, batch, H, nb=nb)
    D = f.head_dim
    q = torch.randn(len(batch), H, D, generator=gen).to(DEV, f.model_dtype)
    seq_lens = torch.tensor([c + n for c, n in batch], dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, views, None, tables, seq_lens, D ** -0.5, out=out, res_slots=rs, **launch)
    ref = paged_decode_attention_ref(q, kd, vd, tables, seq_lens, D ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    if gluon and kivi_decode.supported(views, q):
        out = torch.full_like(q, float("nan"))
        kivi_decode.kivi4_decode(q, views, tables, seq_lens, rs, D ** -0.5, out)
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def _prefill_against_ref(gen, f, batch, H, nb, tol, **launch):
    """The same for the prefill kernel: ``batch`` is (cached keys, new tokens) per sequence."""
    views, tables, kd, vd, rs = _compressed_batch(gen, f, batch, H, nb=nb)
    D = f.head_dim
    q = torch.randn(sum(n for _, n in batch), H, D, generator=gen).to(DEV, f.model_dtype)
    cu = torch.tensor([0] + list(torch.tensor([n for _, n in batch]).cumsum(0)), dtype=torch.int32, device=DEV)
    seq_lens = torch.tensor([c + n for c, n in batch], dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, views, None, tables, cu, seq_lens, max(n for _, n in batch), D ** -0.5, out=out,
                            res_slots=rs, **launch)
    ref = paged_prefill_attention_ref(q, kd, vd, tables, cu, seq_lens, D ** -0.5)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", KERNEL_FORMATS)
@pytest.mark.parametrize("splits,block_n", [(1, None), (3, None), (3, 64)])
def test_decode_attention_compressed(name, splits, block_n):
    """block_n 64 over 16-token blocks: the launcher must bring a compressed tile into one block."""
    gen = torch.Generator().manual_seed(31 + KERNEL_FORMATS.index(name) + 10 * splits)
    H, KVH, D, bs = 4, 2, 32, 8
    f = _fmt(name, KVH, D, bs)
    batch = [(20, 1), (7, 1), (31, 1), (0, 1)]  # keys 21 (5 unsealed), 8 (one full block), 32, 1
    _decode_against_ref(gen, f, batch, H, 24, 1e-4, splits=splits, block_n=block_n)


@pytest.mark.parametrize("bs,block_n", [(16, None), (32, None), (64, 16)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", KERNEL_FORMATS)
def test_decode_attention_compressed_half(name, dtype, bs, block_n):
    """A 16-bit model: 8-bit codes enter the dots as fp16; 4/2-bit ones as OFF + c in the
    model's dtype (written into the mantissa of 1024 in fp16, of 128 in bf16: ``_magic``), with
    q times KIVI's channel scales and p times the value scales rounded to that dtype. Heads of
    64: 2-bit codes in four parts of 16 channels take the fast path. 16-token blocks: 16-key
    tiles (4/2-bit ones were wrong on the H200 when the codes were interleaved back into channel
    order before one dot); 16-key tiles in 64-token blocks: tiles starting mid-block, the
    unsealed block's tiles in the residual."""
    if dtype == torch.bfloat16 and DEV == "cpu":
        pytest.skip("bfloat16 case: needs CUDA (Triton 3.6's interpreter computes bf16 dots wrong, any input)")
    gen = torch.Generator().manual_seed(71 + KERNEL_FORMATS.index(name))
    H, KVH, D = 4, 2, 64
    f = _fmt(name, KVH, D, bs, dtype)
    batch = [(40, 1), (7, 1), (63, 1), (0, 1)]
    tol = 5e-3 if dtype == torch.float16 else 2e-2  # (bf16 rounds q * scale and p * scale to 8 bits)
    _decode_against_ref(gen, f, batch, H, 24, tol, splits=2, block_n=block_n)


@pytest.mark.parametrize("name,D,dtype", [("int2", 64, torch.float32), ("int4", 64, torch.float32),
                                          ("int2", 32, torch.float16)])
def test_decode_attention_kivi_parts(name, D, dtype):
    """Which path a KIVI cache takes, and that both are right: heads whose parts have >= 16
    channels (int4 from 32, int2 from 64) take the fast path, here in float32 (codes as
    themselves, no offset); int2 over 32-channel heads the general path, here in float16."""
    from kvserve.kernels.kv_quant import fast_path
    kw = dict(FMT=3, BITS=2 if name == "int2" else 4, GROUP=D)
    assert fast_path(kw, D) == (D // (8 // kw["BITS"]) >= 16)
    assert fast_path(dict(kw, GROUP=16), D) is False and fast_path(dict(FMT=1, BITS=8, GROUP=D), D)
    gen = torch.Generator().manual_seed(D + kw["BITS"])
    H, KVH = 4, 2
    f = _fmt(name, KVH, D, 32, dtype)
    batch = [(40, 1), (7, 1), (63, 1), (95, 1)]
    _decode_against_ref(gen, f, batch, H, 24, 1e-4 if dtype == torch.float32 else 5e-3, splits=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", KERNEL_FORMATS)
def test_prefill_attention_compressed_half(name, dtype):
    """The prefill kernel over a compressed cache in a 16-bit model, 16-token blocks: prompts
    after a prefix hit, mid-block chunks, a decode row."""
    if dtype == torch.bfloat16 and DEV == "cpu":
        pytest.skip("bfloat16 case: needs CUDA (Triton 3.6's interpreter computes bf16 dots wrong, any input)")
    gen = torch.Generator().manual_seed(97 + KERNEL_FORMATS.index(name))
    H, KVH, D = 4, 2, 64
    f = _fmt(name, KVH, D, 16, dtype)
    batch = [(16, 21), (13, 9), (0, 30), (40, 1)]
    tol = 1e-2 if dtype == torch.float16 else 4e-2  # (p rounded to the model's dtype before the values' dot)
    _prefill_against_ref(gen, f, batch, H, 40, tol)


@pytest.mark.parametrize("name", KERNEL_FORMATS)
@pytest.mark.parametrize("block_n", [None, 64])
def test_prefill_attention_compressed(name, block_n):
    gen = torch.Generator().manual_seed(53 + KERNEL_FORMATS.index(name))
    H, KVH, D, bs = 4, 2, 32, 8
    f = _fmt(name, KVH, D, bs)
    # a prompt after a prefix hit (ctx a whole block), a chunk starting mid-block, a plain prompt
    # ending mid-block, a decode row riding along
    batch = [(16, 21), (13, 9), (0, 30), (40, 1)]
    _prefill_against_ref(gen, f, batch, H, 40, 1e-4, block_n=block_n)


@needs_cuda
@pytest.mark.parametrize("name", KERNEL_FORMATS)
def test_decode_attention_compressed_real_size(name):
    gen = torch.Generator().manual_seed(97)
    H, KVH, D = 32, 8, 128
    f = _fmt(name, KVH, D, kf.default_block_size(name.split("-")[0]), torch.bfloat16)
    batch = [(1000, 1), (4095, 1), (77, 1)]
    nb = sum(math.ceil((c + n) / f.block_size) for c, n in batch) + 3
    # bf16: the dequantized keys/values (or q times the KIVI channel scales) round to bf16 first
    _decode_against_ref(gen, f, batch, H, nb, 3e-2, gluon=True)

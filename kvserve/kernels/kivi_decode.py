"""Decode attention over a KIVI int4 cache in Gluon (Triton's explicit-layout dialect): the packed
codes go from global memory straight into the tensor-core operands' registers.

Why a second kernel: the Triton kernel (``decode_attention`` through ``kv_quant.compressed_tile``)
leaves the codes' placement to the compiler, which moves them through shared memory byte by byte
into the products' operand layout: at long contexts it is bound by instruction issue, not memory,
and slower than bf16's attention, which reads four times the bytes.

**The layout.** Both products are ``mma.m16n8k16``: ``S^T = K q^T`` with the keys on M, ``O^T =
V^T P^T`` with the channels on M, and the GQA group's queries on N (8 columns, so a group of 4
pads 2x, not the 4x of queries on M). A thread of the A operand holds fixed rows and, per k step
of 16, the columns {2t, 2t+1, 2t+8, 2t+9}. Which channel sits in which column is free (a dot
product does not care about the order of its terms, as long as both sides agree), so the columns
are numbered such that a thread's 32 key channels are the 16 contiguous bytes it loads, and a
thread's 16 value channels its 8 contiguous bytes (``_key_channel``, ``_value_channel``). q and
the key scales are read in the columns' order; the output is stored through the inverse. The load
layouts are the operands' own up to register order, so the codes never touch shared memory (the
kernel uses none): an inline-PTX unpack writes each code into the mantissa of fp16 1024 (``OFF +
c``, one ``lop3`` per pair; an odd code is taken where it lies, 4 bits up, as ``OFF + 16 c``, the
16 folded into its channel's q or divided out of its output channel).

**The scales** are folded around the products as in ``compressed_tile``: per channel into q (a
tile lies in one block, whose keys share a (scale, min) per channel), per token into p; the mins
and the offsets become a per-query correction. The keys' is computed by two small products (rows
of mins times q, rows of -OFF times the scaled q: exact products, fp32 sums); the values' is kept
as two running sums beside ``l_i``. Products run in fp16 for bf16 models too: fp16 holds the
offset codes exactly and rounds q * scale and p * scale to 11 bits instead of 8.

**The loop** asks for the next tile's codes and scales before working on this one (one warp per
program holds both in registers: about 240 of them), and for a tile further ahead into L2 (its
own codes and scales, ``l2_ahead`` tiles ahead): with 8 warps per SM, a register prefetch alone
leaves too few bytes in flight.
A tile's addresses are one base per thread plus immediates (the cache strides are compile-time
constants, ``cache_strides``, and ``_hint`` keeps the loads 16 and 8 bytes wide); sealed tiles
are whole, so unmasked; the softmax's three running sums stay per lane (``_lane_sum``) until the
end. The newest keys of a sequence (its unsealed block) come from the full-precision residual,
after the loop.

**The splits** follow the lengths (``_work``): one wave of programs (``wave`` per SM), the
batch's keys cut into splits of about equal length, so a sequence gets splits in proportion to
its length and no program waits on a longer one. The plan is made once a step, for every layer
(``split_plan``): a program's first load is its row (sequence, key range, the first tile's
block), then the first tile. Their merge is ``common.merge_group``, in a small second kernel.

**The step's token** (``rope=``, the engine's decode steps): every program rotates q in registers;
the split that reads the sequence's last key first writes this step's key into the residual and
quantizes its value, and with 64-token blocks seals the block that key fills, all operation for
operation as ``rope_kv_write_quant`` and ``seal_keys`` (the same bytes); then a barrier, then its
reads. Two kernels a layer fewer. The first tile is asked for before q is loaded and rotated.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kvserve.kernels import interpreting
from kvserve.kernels.common import LOG2E, RopeWrite, capability, merge_group, merge_splits, sm_count
from kvserve.kv_format import MIN_SCALE

BLOCK_N = gl.constexpr(64)  # keys per tile
QN = gl.constexpr(8)  # the N side of the products: the GQA group's queries, padded
OFF = gl.constexpr(1024.0)  # the codes enter the products as fp16 OFF + c (or OFF + 16 c)
# The launcher's defaults (``KernelConfig.kivi_l2_ahead``, ``kivi_wave``): tiles ahead that each
# program asks into L2 (sm90's bulk prefetch; further ahead, L2 thrashes), and the programs per SM
# of the grid's one wave (the one-warp programs of ~240 registers an SM holds at once)
L2_AHEAD = 2
WAVE = 8
MAX_SPLITS = 32  # splits of one sequence at most (the merge's)
PLAN_W = gl.constexpr(8)  # int32 words per work item of the step's plan (``_plan_kernel``)

_MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
_A = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=_MMA.value, k_width=2))
_B = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=_MMA.value, k_width=2))
# Key words [64 keys, 16 words of 8 codes]: lanes -> words +4, +8 (the A operand's t) and keys
# +1, +2, +4 (its g); registers -> words +1, +2 (16 contiguous bytes: one 128-bit load), keys +8,
# +16, +32
_KW = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0], [16, 0], [32, 0]],
                                              lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                              warp_bases=[], block_bases=[], shape=[64, 16]))
# Value words [64 keys, 16 words]: lanes -> keys +2, +4 (t), words +2, +4, +8 (g); registers ->
# words +1 (8 contiguous bytes: one 64-bit load), keys +1, +8, +16, +32. The unpack takes keys
# (2t, 2t + 1) together, as consecutive registers: _VW2 is the same layout with keys +1 first.
_VW = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[0, 1], [1, 0], [8, 0], [16, 0], [32, 0]],
                                              lane_bases=[[2, 0], [4, 0], [0, 2], [0, 4], [0, 8]],
                                              warp_bases=[], block_bases=[], shape=[64, 16]))
_VW2 = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[1, 0], [0, 1], [8, 0], [16, 0], [32, 0]],
                                               lane_bases=[[2, 0], [4, 0], [0, 2], [0, 4], [0, 8]],
                                               warp_bases=[], block_bases=[], shape=[64, 16]))
# A block's key (scale, min) words, one per channel, in channel order: lanes -> channels +32, +64
# (t; the other lanes hold copies), registers -> 32 contiguous channels
_KSW = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[1], [2], [4], [8], [16]],
                                               lane_bases=[[32], [64], [0], [0], [0]],
                                               warp_bases=[], block_bases=[], shape=[128]))
# Per-lane partial sums [8, 8 queries] over a tile's keys (``_lane_sum``): lanes -> queries +2, +4
# (t), rows +1, +2, +4 (g); a register -> queries +1, as the products' accumulators hold them
_P = gl.constexpr(gl.DistributedLinearLayout(reg_bases=[[0, 1]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                             warp_bases=[], block_bases=[], shape=[8, 8]))
# Residual keys [64 keys, 128 channels] in channel order: the key words' lanes, a register per
# channel (32 contiguous channels per thread)
_RW = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [0, 16], [8, 0], [16, 0], [32, 0]],
    lane_bases=[[0, 32], [0, 64], [1, 0], [2, 0], [4, 0]], warp_bases=[], block_bases=[], shape=[64, 128]))

# Codes -> fp16 OFF + c, by writing c into the mantissa of 1024 (0x6400): lop3's (a & b) | c
# (0xEA). An odd code j is taken where it lies, 4 bits up: OFF + 16 c (the 16 is folded into its
# channel's q, or divided out of its output channel). Keys: a word at a time, the register
# pairs (code j, code j + 4); values: two words (keys 2t, 2t + 1) at a time, the pairs (code j of
# one, code j of the other).
_KEY_ASM = gl.constexpr("""{
.reg .b32 t, u;
lop3.b32 t, $8, 0x000F000F, 0x64006400, 0xEA;
mov.b32 {$0, $4}, t;
lop3.b32 t, $8, 0x00F000F0, 0x64006400, 0xEA;
mov.b32 {$1, $5}, t;
shr.u32 u, $8, 8;
lop3.b32 t, u, 0x000F000F, 0x64006400, 0xEA;
mov.b32 {$2, $6}, t;
lop3.b32 t, u, 0x00F000F0, 0x64006400, 0xEA;
mov.b32 {$3, $7}, t;
}""")
_VALUE_ASM = gl.constexpr("""{
.reg .b32 lo, hi, t;
prmt.b32 lo, $8, $9, 0x5410;
prmt.b32 hi, $8, $9, 0x7632;
lop3.b32 $0, lo, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $1, lo, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 t, lo, 8;
lop3.b32 $2, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $3, t, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 $4, hi, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $5, hi, 0x00F000F0, 0x64006400, 0xEA;
shr.u32 t, hi, 8;
lop3.b32 $6, t, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $7, t, 0x00F000F0, 0x64006400, 0xEA;
}""")


# One lane asks for ``size`` bytes at an address to be brought into L2 (sm90's bulk prefetch)
_L2_ASM = gl.constexpr("""{
.reg .pred p;
setp.eq.s32 p, $2, 0;
setp.gt.and.s32 p, $3, 0, p;
@p cp.async.bulk.prefetch.L2.global [$1], $3;
mov.b32 $0, 0;
}""")
_LANE = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))
# One head's 128 channels, 4 per lane (``_write_token``'s key); its value as [16 words, 8 codes],
# a word per lane (the other 16 lanes hold copies)
_CH = gl.constexpr(gl.BlockedLayout([4], [32], [1], [0]))
_VQ = gl.constexpr(gl.BlockedLayout([1, 8], [32, 1], [1, 1], [1, 0]))
# A block of keys being sealed, 32 channels of it: [64 keys, 4 words, 8 codes], a thread 8 keys of
# a word's 8 channels (its codes pack in registers; the (scale, min) over keys: 8 lanes)
_SB = gl.constexpr(gl.BlockedLayout([8, 1, 8], [8, 4, 1], [1, 1, 1], [2, 1, 0]))


@gluon.jit
def _join8(c0, c1, c2, c3, c4, c5, c6, c7):
    """Eight [R, 16] tensors -> [R, 16, 2, 2, 2], ``cj`` at [.., j & 1, (j >> 1) & 1, j >> 2]."""
    return gl.join(gl.join(gl.join(c0, c1), gl.join(c2, c3)), gl.join(gl.join(c4, c5), gl.join(c6, c7)))


@gluon.jit
def _key_operand(words):
    """A tile's key words [64, 16] -> the first product's A operand [64 keys, 128 columns]: word
    4 t + 2 a1 + a0, code j = 4 j2 + 2 j1 + j0 at column 64 a1 + 32 a0 + 16 j1 + 8 j0 + 2 t + j2
    (``_key_channel``)."""
    c0, c1, c2, c3, c4, c5, c6, c7 = gl.inline_asm_elementwise(
        _KEY_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [words], dtype=[gl.float16] * 8, is_pure=True, pack=1)
    x = gl.reshape(_join8(c0, c1, c2, c3, c4, c5, c6, c7), [BLOCK_N, 4, 2, 2, 2, 2, 2])  # key t a1 a0 j0 j1 j2
    x = gl.permute(x, [0, 2, 3, 5, 4, 1, 6])  # key, a1, a0, j1, j0, t, j2
    return gl.convert_layout(gl.reshape(x, [BLOCK_N, 128]), _A)


@gluon.jit
def _value_operand(words):
    """A tile's value words [64, 16] -> the second product's A operand [128 rows, 64 keys]: word
    2 g + x, code j = 4 j2 + 2 j1 + j0 at row 64 x + 32 j2 + 16 j1 + 8 j0 + g (``_value_channel``)."""
    c0, c1, c2, c3, c4, c5, c6, c7 = gl.inline_asm_elementwise(
        _VALUE_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [gl.convert_layout(words, _VW2)], dtype=[gl.float16] * 8,
        is_pure=True, pack=2)
    x = gl.reshape(_join8(c0, c1, c2, c3, c4, c5, c6, c7), [BLOCK_N, 8, 2, 2, 2, 2])  # key, g, x, j0, j1, j2
    x = gl.permute(x, [2, 5, 4, 3, 1, 0])  # x, j2, j1, j0, g, key
    return gl.convert_layout(gl.reshape(x, [128, BLOCK_N]), _A)


@gluon.jit
def _sealed_tile(kw, vw, ksw, vsw, q16, m_i, l_i, acc, c1, c2, scale_log2):
    """One tile of sealed keys: the block's (scale, min) words per channel ``ksw`` (channel order)
    put in the columns' order; the scales (with the odd codes' 1/16, exact) folded into q (fp16:
    the product of two fp16 values rounds once either way), the mins and the codes' OFF taken off
    as a per-query correction computed by two small products (exact products, fp32 sums): rows of
    mins times q, rows of -OFF times qs. The correction is where the scores' product starts."""
    ksp = gl.reshape(ksw, [4, 2, 2, 2, 2, 2])  # t, a1, a0, j2, j1, j0
    ksp = gl.reshape(gl.permute(ksp, [1, 2, 4, 5, 0, 3]), [128])  # a1, a0, j1, j0, t, j2
    ksp = gl.convert_layout(ksp, gl.SliceLayout(1, _B))
    odd = ((gl.arange(0, 128, layout=gl.SliceLayout(1, _B)) >> 3) & 1) == 1  # (a register's, fixed)
    sc = _half(ksp & 0xFFFF)
    qs = q16 * gl.expand_dims(gl.where(odd, sc * 0.0625, sc), 1)
    kb = _half(ksp >> 16)
    kb_rows = gl.broadcast(gl.expand_dims(gl.convert_layout(kb, gl.SliceLayout(0, _A)), 0),
                           gl.full([16, 128], 0.0, gl.float16, layout=_A))[0]
    kc = mma_v2(kb_rows, q16, gl.zeros([16, QN], gl.float32, layout=_MMA))
    kc = mma_v2(gl.full([16, 128], -OFF, gl.float16, layout=_A), qs, kc)  # [16, 8], its rows equal
    # the first product's accumulator starts at the correction: kc's rows, four times over
    kc = gl.join(gl.join(kc, kc), gl.join(kc, kc))  # [16, 8, 2, 2]
    kc = gl.convert_layout(gl.reshape(gl.permute(kc, [2, 3, 0, 1]), [BLOCK_N, QN]), _MMA)
    return _attend(_key_operand(kw), qs, kc, vw, vsw, None, m_i, l_i, acc, c1, c2, scale_log2)


@gluon.jit
def _tile_words(KC, VC, KS, VS, page, within, kvh, kkey, kword, vkey, vword, kch, skey,
                s_kcb, s_kct, s_kch, s_vcb, s_vct, s_vch, s_ksb, s_ksh, s_vsb, s_vst, s_vsh):
    """A sealed tile's words: key and value codes, the block's key (scale, min) per channel and the
    values' (scale, min) per token. Unmasked: a split's sealed keys start and end on 64-key tile
    boundaries (64 divides the block size), so its tiles are whole."""
    kw = gl.load((KC + (page * s_kcb + within * s_kct + kvh * s_kch) + _hint(kkey, 7, s_kct, kword, 12, -4))
                 + _hint(kkey, 56, s_kct, kword, 3, 4))
    vw = gl.load((VC + (page * s_vcb + within * s_vct + kvh * s_vch) + _hint(vkey, 6, s_vct, vword, 14, -2))
                 + _hint(vkey, 57, s_vct, vword, 1, 2))
    ksw = gl.load((KS + (page * s_ksb + kvh * s_ksh) + gl.max_constancy(gl.multiple_of(kch & 96, 32), 32))
                  + gl.max_contiguous(gl.multiple_of(kch & 31, 32), 32))
    vsw = gl.load((VS + (page * s_vsb + within * s_vst + kvh * s_vsh) + (skey & 7) * s_vst) + (skey & 56) * s_vst)
    return kw, vw, ksw, vsw


@gluon.jit
def _hint(row, rmask: gl.constexpr, stride: gl.constexpr, word, wmask: gl.constexpr, vec: gl.constexpr):
    """The part ``(row & rmask) * stride + (word & wmask)`` of a tile's word offsets. The lanes'
    part and the registers' part are added to the pointer separately, so each register's address
    is one per-thread base plus an immediate; the hints give back what the masks hide: runs of
    ``vec`` contiguous words (the registers' part), or constant (-``vec`` of them: the lanes'
    part)."""
    off = (row & rmask) * stride + (word & wmask)
    if vec > 0:
        return gl.max_contiguous(gl.multiple_of(off, [1, vec]), [1, vec])
    else:
        return gl.max_constancy(gl.multiple_of(off, [1, -vec]), [1, -vec])


@gluon.jit
def _key_channel(col):
    """The channel at column ``col`` of the first product (``_key_operand``)."""
    j = 4 * (col & 1) + 2 * ((col >> 4) & 1) + ((col >> 3) & 1)
    return 8 * (4 * ((col >> 1) & 3) + 2 * ((col >> 6) & 1) + ((col >> 5) & 1)) + j


@gluon.jit
def _value_channel(row):
    """The channel at row ``row`` of the second product (``_value_operand``)."""
    j = ((row >> 3) & 1) + 2 * ((row >> 4) & 1) + 4 * ((row >> 5) & 1)
    return 16 * (row & 7) + 8 * ((row >> 6) & 1) + j


@gluon.jit
def _half(bits):
    """The fp16 in the low 16 bits of int32 ``bits``."""
    return bits.to(gl.int16).to(gl.float16, bitcast=True)


@gluon.jit
def _attend(k_op, qs, st0, vw, vsw, valid, m_i, l_i, acc, c1, c2, scale_log2):
    """One tile into the online softmax: scores S^T = k_op qs + st0 ([64 keys, 8 queries]; keys
    outside ``valid`` masked, None for a whole tile), then the values (words ``vw``; (scale, min) words ``vsw``, a pair
    per token) with the scale folded into p. The product's OFF offsets and the mins are kept
    apart, as running sums rescaled like ``l_i``: c1 = sum(pa) (rounded as the product saw it),
    c2 = sum(p * min). The three sums are kept per lane (``_P``: over the keys a thread holds, so
    no shuffles) until the end. Returns the new (m_i, l_i, acc, c1, c2)."""
    st = mma_v2(k_op, qs, st0)
    if valid is not None:
        st = gl.where(gl.expand_dims(valid, 1), st, float("-inf"))
    # online softmax over the keys (rows), as online_softmax_probs
    m_new = gl.maximum(m_i, gl.max(st, 0) * scale_log2)
    m_safe = gl.where(m_new > float("-inf"), m_new, 0.0)
    p = gl.exp2(st * scale_log2 - gl.expand_dims(m_safe, 0))
    alpha = gl.exp2(m_i - m_safe)
    pa = (p * gl.expand_dims(_half(vsw & 0xFFFF).to(gl.float32), 1)).to(gl.float16)
    alpha_p = gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(0, _P)), 0)
    c1 = c1 * alpha_p + _lane_sum(pa.to(gl.float32))
    c2 = c2 * alpha_p + _lane_sum(p * gl.expand_dims(_half(vsw >> 16).to(gl.float32), 1))
    acc = mma_v2(_value_operand(vw), gl.convert_layout(pa, _B), acc * gl.expand_dims(alpha, 0))
    return m_new, l_i * alpha_p + _lane_sum(p), acc, c1, c2


@gluon.jit
def _lane_sum(x):
    """[64 keys, 8 queries] (``_MMA``) -> [8, 8] (``_P``): the sums over the keys each lane holds
    (key = 16 m + 8 h + g: m and h in registers, g the lane's), registers only."""
    return gl.convert_layout(gl.sum(gl.sum(gl.reshape(x, [4, 2, 8, QN]), 0), 0), _P)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _work(SEQ_LENS, B, w, NW, MAXS: gl.constexpr, BPAD: gl.constexpr):
    """Work item ``w`` of the ``NW`` (>= B) of a KV head: which sequence, which of its splits, how
    many splits it has and the first work item of its splits. Each sequence's 64-key tiles are cut
    into splits of at most C tiles, C the smallest for which all the sequences' splits (at least
    one each, at most ``MAXS``) fit in ``NW``: a binary search over C on the whole batch's lengths
    (a few hundred instructions; none when NW == B), once a step (``_plan_kernel``). Splits of equal
    length over the whole batch, in one wave: a long sequence among short ones gets more of them,
    and no program of the wave waits on a longer one. Returns (b, split, n_splits, first, per):
    ``per`` tiles per split; b >= B for a work item beyond the batch's."""
    L: gl.constexpr = gl.BlockedLayout([BPAD // 32], [32], [1], [0])
    idx = gl.arange(0, BPAD, layout=L)
    valid = idx < B
    tiles = gl.cdiv(gl.load(SEQ_LENS + idx, mask=valid, other=0), BLOCK_N)
    hi = gl.maximum(gl.max(tiles, 0), 1)  # (one split each: B <= NW)
    lo = gl.where(NW > B, 1, hi)
    while lo < hi:
        mid = (lo + hi) // 2
        n = gl.sum(gl.where(valid, gl.minimum(gl.maximum(gl.cdiv(tiles, mid), 1), MAXS), 0), 0)
        fits = (n <= NW).to(gl.int32)
        hi = fits * mid + (1 - fits) * hi
        lo = fits * lo + (1 - fits) * (mid + 1)
    per = gl.maximum(gl.cdiv(tiles, gl.minimum(gl.maximum(gl.cdiv(tiles, lo), 1), MAXS)), 1)
    n_splits = gl.where(valid, gl.maximum(gl.cdiv(tiles, per), 1), 0)  # (an empty sequence: one, of zeros)
    ends = gl.associative_scan(n_splits, 0, _add)
    b = gl.sum((ends <= w).to(gl.int32), 0)
    pick = idx == b
    first = gl.sum(gl.where(pick, ends - n_splits, 0), 0)
    return (b, w - first, gl.sum(gl.where(pick, n_splits, 0), 0), first, gl.sum(gl.where(pick, per, 0), 0))


@gluon.jit
def _mul_rn(a, b):
    """a * b in fp32, rounded once and never contracted into an FMA: ``kv_quant.rope_rotate``'s
    products (that kernel is compiled without contraction; here only these products need it)."""
    return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.float32, is_pure=True,
                                     pack=1)


@gluon.jit
def _rotate(X, off, d, COS, SIN, cs_off, mask, DT: gl.constexpr):
    """NeoX rotation of a head of 128 at ``X + off + d`` (channel ``d``, its partner d ^ 64) by
    the cos/sin row at ``cs_off``, rounded as ``kv_quant.rope_rotate``: cos and sin in ``DT``, each
    product to ``DT``, then their sum."""
    cos = gl.load(COS + cs_off + d).to(DT).to(gl.float32)
    sin = gl.load(SIN + cs_off + d).to(DT).to(gl.float32)
    x = gl.load(X + off + d, mask=mask, other=0.0).to(gl.float32)
    xp = gl.load(X + off + (d ^ 64), mask=mask, other=0.0).to(gl.float32)
    sp = gl.where(d < 64, -sin, sin)
    return (_mul_rn(x, cos).to(DT).to(gl.float32) + _mul_rn(xp, sp).to(DT).to(gl.float32)).to(DT)


@gluon.jit
def _codes4(x, mn, mx, AXIS: gl.constexpr, TINY: gl.constexpr):
    """KIVI's 4-bit codes of ``x`` whose min and max over ``AXIS`` (-1: over all of x, scalars)
    are ``mn`` and ``mx``, as ``kv_quant``'s writers make them: the min rounded to fp16, the scale
    (max - min) / 15 correctly rounded, then rounded to fp16. Returns (codes, scale, min), the
    scale and min shaped as ``mn``."""
    mn = mn.to(gl.float16).to(gl.float32)
    sc = gl.maximum(gl.div_rn(mx - mn, 15.0), TINY).to(gl.float16).to(gl.float32)
    if AXIS >= 0:
        y = gl.div_rn(x - gl.expand_dims(mn, AXIS), gl.expand_dims(sc, AXIS))
    else:
        y = gl.div_rn(x - mn, sc)
    return gl.minimum(gl.maximum(gl.floor(y + 0.5), 0.0), 15.0).to(gl.int32), sc, mn


@gluon.jit
def _query(Q, COS, SIN, b, kvh, pos, stride_qb, stride_qh, stride_cos, GROUP: gl.constexpr, ROPE: gl.constexpr,
           DT: gl.constexpr):
    """q^T as the first product's B operand [128 columns, 8 queries] in fp16, channels in the
    columns' order (``_key_channel``); ``ROPE``: rotated here at ``pos``."""
    qcol = gl.arange(0, 128, layout=gl.SliceLayout(1, _B))
    qn = gl.arange(0, QN, layout=gl.SliceLayout(0, _B))
    qmask = gl.expand_dims(qn < GROUP, 0) & gl.expand_dims(qcol < 128, 1)
    qoff = b.to(gl.int64) * stride_qb + gl.expand_dims((kvh * GROUP + qn) * stride_qh, 0)
    qch = gl.expand_dims(_key_channel(qcol), 1)
    if ROPE:
        q = _rotate(Q, qoff, qch, COS, SIN, pos * stride_cos, qmask, DT)
    else:
        q = gl.load(Q + qoff + qch, mask=qmask, other=0.0)
    return q.to(gl.float32).to(gl.float16)


@gluon.jit
def _write_token(KN, VN, COS, SIN, RES, res_row, KC, KS, VC, VS, b, kvh, pos, slot, rmap, stride_knt, stride_knh,
                 stride_vnt, stride_vnh, stride_cos, s_rt, s_rh, s_kcb: gl.constexpr, s_kct: gl.constexpr,
                 s_kch: gl.constexpr, s_ksb: gl.constexpr, s_ksh: gl.constexpr, s_vcb: gl.constexpr,
                 s_vct: gl.constexpr, s_vch: gl.constexpr, s_vsb: gl.constexpr, s_vst: gl.constexpr,
                 s_vsh: gl.constexpr, PAGE: gl.constexpr, DT: gl.constexpr, TINY: gl.constexpr, SEAL: gl.constexpr):
    """``rope_kv_write_quant``'s work for one KV head of one decode token, operation for operation
    (the same codes, scales and residual): the key rotated into the residual at ``rmap`` (< 0: the
    key fills its block, sealed here with ``SEAL``, else by ``seal_keys`` before this kernel), the
    value quantized per token (fp16 (scale, min) over the head, 4-bit codes, eight to a word) at
    ``slot`` (< 0: padding, nothing written)."""
    if slot >= 0:
        page = slot // PAGE
        within = slot % PAGE
        kn_off = b.to(gl.int64) * stride_knt + kvh * stride_knh
        if rmap >= 0:
            d = gl.arange(0, 128, layout=_CH)
            k = _rotate(KN, kn_off, d, COS, SIN, pos * stride_cos, d < 128, DT)
            gl.store(RES + rmap * s_rt + kvh * s_rh + d, k)
        elif SEAL:
            _seal_block(KN, kn_off, COS, SIN, pos * stride_cos, res_row, KC, KS, page, kvh, s_rt, s_kcb, s_kct,
                        s_kch, s_ksb, s_ksh, DT, TINY)
        word = gl.arange(0, 16, layout=gl.SliceLayout(1, _VQ))
        nib = gl.arange(0, 8, layout=gl.SliceLayout(0, _VQ))
        v = gl.load(VN + b.to(gl.int64) * stride_vnt + kvh * stride_vnh + gl.expand_dims(word * 8, 1)
                    + gl.expand_dims(nib, 0)).to(gl.float32)  # [16 words, 8 channels]
        code, sc, mn = _codes4(v, gl.min(gl.min(v, 1), 0), gl.max(gl.max(v, 1), 0), -1, TINY)
        words = gl.sum(code << gl.expand_dims(nib * 4, 0), 1)  # disjoint bits: the sum is the or
        gl.store(VC + page * s_vcb + within * s_vct + kvh * s_vch + word, words)
        lane = gl.arange(0, 32, layout=_LANE)
        pair = (_bits(sc + lane * 0.0) & 0xFFFF) | (_bits(mn + lane * 0.0) << 16)  # (scale, min) as fp16s
        gl.store(VS + page * s_vsb + within * s_vst + kvh * s_vsh + lane * 0, pair, mask=lane == 0)


@gluon.jit
def _seal_block(KN, kn_off, COS, SIN, cs_off, res_row, KC, KS, page, kvh, s_rt, s_kcb: gl.constexpr,
                s_kct: gl.constexpr, s_kch: gl.constexpr, s_ksb: gl.constexpr, s_ksh: gl.constexpr,
                DT: gl.constexpr, TINY: gl.constexpr):
    """The block of 64 keys this step's key completes, quantized per channel as
    ``_seal_keys_kernel`` does it: the first 63 keys from the sequence's residual row, the last
    this step's, rotated here; 32 channels at a time ([64 keys, 4 words, 8 codes])."""
    key = gl.expand_dims(gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, _SB))), 1), 2)
    wd = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, _SB))), 0), 2)
    nib = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, _SB))), 0), 1)
    key2 = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, _SB))), 1)  # [64, 4]
    wd2 = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, _SB))), 0)
    ch2 = (gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(0, _SB))), 1) * 8
           + gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(0, _SB))), 0))  # [4, 8]
    for c0 in range(0, 128, 32):
        ch = c0 + wd * 8 + nib  # [1, 4, 8]
        old = gl.load(res_row + key * s_rt + ch, mask=(key < 63) & (ch < 128), other=0.0)
        x = gl.where(key == 63, _rotate(KN, kn_off, ch, COS, SIN, cs_off, ch < 128, DT), old).to(gl.float32)
        code, sc, mn = _codes4(x, gl.min(x, 0), gl.max(x, 0), 0, TINY)  # per channel: [4, 8]
        words = gl.sum(code << (nib * 4), 2)  # [64, 4]
        gl.store(KC + page * s_kcb + key2 * s_kct + kvh * s_kch + (c0 // 8 + wd2), words)
        gl.store(KS + page * s_ksb + kvh * s_ksh + (c0 + ch2), (_bits(sc) & 0xFFFF) | (_bits(mn) << 16))


@gluon.jit
def _l2(ptr, lane, size: gl.constexpr):
    """Lane 0 asks for ``size`` bytes at ``ptr`` (the same for every lane) to be brought into L2."""
    gl.inline_asm_elementwise(_L2_ASM, "=r,l,r,r", [ptr + lane * 0, lane, lane * 0 + size], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _plan_kernel(SEQ_LENS, BT, PLAN, WORK, B, NW, stride_bt, MAXS: gl.constexpr, BPAD: gl.constexpr,
                 PAGE: gl.constexpr):
    """The step's split plan, once for every layer: work item w's row of PLAN [NW, PLAN_W]
    (b, first key, end key, the sequence's length, its splits, this split, the first key's block)
    and, for the merge, WORK [B, 2] (first work item, splits) of each sequence. Grid (NW,)."""
    w = gl.program_id(0)
    b, split, active, first, per = _work(SEQ_LENS, B, w, NW, MAXS, BPAD)
    i = gl.arange(0, PLAN_W, layout=_LANE)
    if b < B:
        seq_len = gl.load(SEQ_LENS + b)
        start = split * per * BLOCK_N
        end = gl.minimum(start + per * BLOCK_N, seq_len)
        page0 = gl.load(BT + b.to(gl.int64) * stride_bt + start // PAGE)
        row = gl.where(i == 0, b, gl.where(i == 1, start, gl.where(i == 2, end, gl.where(
            i == 3, seq_len, gl.where(i == 4, active, gl.where(i == 5, split, gl.where(i == 6, page0, 0)))))))
        gl.store(PLAN + w * PLAN_W + i, row, mask=i < PLAN_W)
        if split == 0:
            gl.store(WORK + 2 * b + i, gl.where(i == 0, first, active), mask=i < 2)
    else:
        gl.store(PLAN + w * PLAN_W + i, B + i * 0, mask=i < PLAN_W)


@gluon.jit
def _bits(x):
    """The fp16 bits of float32 ``x`` (exact in fp16) in the low half of an int32 (sign-extended)."""
    return x.to(gl.float16).to(gl.int16, bitcast=True).to(gl.int32)


@gluon.jit
def _kivi4_decode_kernel(Q, KC, VC, KS, VS, RES, BT, RSLOTS, O, OP, LSEP, PLAN, B,
                         SLOT, RMAP, KN, VN, COS, SIN, stride_knt, stride_knh, stride_vnt, stride_vnh,
                         stride_cos,
                         stride_qb, stride_qh, s_kcb: gl.constexpr, s_kct: gl.constexpr, s_kch: gl.constexpr,
                         s_vcb: gl.constexpr, s_vct: gl.constexpr, s_vch: gl.constexpr, s_ksb: gl.constexpr,
                         s_ksh: gl.constexpr, s_vsb: gl.constexpr, s_vst: gl.constexpr, s_vsh: gl.constexpr,
                         s_rt, s_rh, stride_bt,
                         stride_ob, stride_oh, stride_ps, stride_ph, stride_lh,
                         scale_log2, GROUP: gl.constexpr, PAGE: gl.constexpr, L2_AHEAD: gl.constexpr,
                         ROPE: gl.constexpr, SEAL: gl.constexpr, TINY: gl.constexpr):
    """Q: [B, H, 128]; KC, VC: int32 words [nb, PAGE, kvh, 16] (head-major in memory); KS: int32
    (scale, min) words [nb, kvh, 128]; VS: [nb, PAGE, kvh] words; RES: [slots, PAGE, kvh, 128] (the
    model's dtype). Grid (kvh, NW), one warp: work item w, row w of the step's PLAN
    (``_plan_kernel``). A split's partial output goes to OP [NW, H, 128] at row w, its log-sum-exp
    to LSEP [H, NW]. ``ROPE``: Q, KN, VN are this step's q, k, v
    before RoPE, its token the sequence's last key (position seq_len - 1); q is rotated in registers
    and the sequence's last split writes its KV head's k and v before it reads the cache
    (``_write_token``: at ``SLOT``, the key in the residual at ``RMAP``), and with ``SEAL`` (blocks
    of one tile) quantizes the block that key fills (``_seal_block``)."""
    kvh = gl.program_id(0)
    w = gl.program_id(1)
    pw = PLAN + w * PLAN_W  # the step's plan (``_plan_kernel``): the first tile's loads wait on this one
    b = gl.load(pw)
    if b >= B:
        return  # (fewer splits than work items)
    start = gl.load(pw + 1)
    end = gl.load(pw + 2)
    seq_len = gl.load(pw + 3)
    active = gl.load(pw + 4)
    split = gl.load(pw + 5)
    page0 = gl.load(pw + 6).to(gl.int64)
    DT: gl.constexpr = Q.dtype.element_ty
    full_end = (seq_len // PAGE) * PAGE  # sealed keys end here; later ones are in the residual
    bt_row = BT + b.to(gl.int64) * stride_bt
    res_row = RES + gl.load(RSLOTS + b).to(gl.int64) * PAGE * s_rt + kvh * s_rh
    pos = gl.maximum(seq_len - 1, 0).to(gl.int64)  # (ROPE: this step's token's)
    if ROPE:
        if split == active - 1:  # this step's token is the sequence's last key: its split writes it
            _write_token(KN, VN, COS, SIN, RES, res_row, KC, KS, VC, VS, b, kvh, pos, gl.load(SLOT + b),
                         gl.load(RMAP + b), stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cos, s_rt, s_rh,
                         s_kcb, s_kct, s_kch, s_ksb, s_ksh, s_vcb, s_vct, s_vch, s_vsb, s_vst, s_vsh, PAGE, DT,
                         TINY, SEAL)
            gl.thread_barrier()  # (every load of the cache comes after its stores)

    kkey = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _KW)), 1)
    kword = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, _KW)), 0)
    vkey = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _VW)), 1)
    vword = gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, _VW)), 0)
    kch = gl.arange(0, 128, layout=_KSW)
    skey = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _MMA))
    m_i = gl.full([QN], float("-inf"), gl.float32, layout=gl.SliceLayout(0, _MMA))
    l_i = gl.zeros([8, QN], gl.float32, layout=_P)  # per lane, as _lane_sum's
    c1 = gl.zeros([8, QN], gl.float32, layout=_P)
    c2 = gl.zeros([8, QN], gl.float32, layout=_P)
    acc = gl.zeros([128, QN], gl.float32, layout=_MMA)
    sealed_end = gl.minimum(end, full_end)
    if start < sealed_end:
        # the first tile's codes and scales, asked for before q (their wait then covers q's); each
        # iteration asks for the next tile's first
        kw, vw, ksw, vsw = _tile_words(KC, VC, KS, VS, page0, start % PAGE,
                                       kvh, kkey, kword, vkey, vword, kch, skey, s_kcb, s_kct, s_kch,
                                       s_vcb, s_vct, s_vch, s_ksb, s_ksh, s_vsb, s_vst, s_vsh)
        q16 = _query(Q, COS, SIN, b, kvh, pos, stride_qb, stride_qh, stride_cos, GROUP, ROPE, DT)
        last = ((sealed_end - 1) // BLOCK_N) * BLOCK_N  # (a prefetch past it re-reads it)
        lane = gl.arange(0, 32, layout=_LANE)
        for s in range(start, sealed_end, BLOCK_N):
            s1 = gl.minimum(s + BLOCK_N, last)
            if L2_AHEAD:  # the tile L2_AHEAD ahead, into L2: this program's own codes and scales (not a
                # share of a block that its neighbours ask for the rest of: one that runs behind
                # would leave this program's tile not yet asked for)
                s2 = gl.minimum(s + L2_AHEAD * BLOCK_N, last)
                page2 = gl.load(bt_row + s2 // PAGE).to(gl.int64)
                w2 = s2 % PAGE
                _l2(KC + (page2 * s_kcb + w2 * s_kct + kvh * s_kch), lane, BLOCK_N * s_kct * 4)
                _l2(VC + (page2 * s_vcb + w2 * s_vct + kvh * s_vch), lane, BLOCK_N * s_vct * 4)
                _l2(KS + (page2 * s_ksb + kvh * s_ksh), lane, s_ksh * 4)
                _l2(VS + (page2 * s_vsb + w2 * s_vst + kvh * s_vsh), lane, BLOCK_N * s_vst * 4)
            kw1, vw1, ksw1, vsw1 = _tile_words(KC, VC, KS, VS, gl.load(bt_row + s1 // PAGE).to(gl.int64), s1 % PAGE,
                                               kvh, kkey, kword, vkey, vword, kch, skey, s_kcb, s_kct,
                                               s_kch, s_vcb, s_vct, s_vch, s_ksb, s_ksh, s_vsb, s_vst, s_vsh)
            m_i, l_i, acc, c1, c2 = _sealed_tile(kw, vw, ksw, vsw, q16, m_i, l_i, acc,
                                                 c1, c2, scale_log2)
            kw, vw, ksw, vsw = kw1, vw1, ksw1, vsw1
    else:
        q16 = _query(Q, COS, SIN, b, kvh, pos, stride_qb, stride_qh, stride_cos, GROUP, ROPE, DT)
    # the unsealed block's keys: full precision, from the residual
    rkey = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, _RW)), 1)
    rch = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, _RW)), 0)
    zero = gl.zeros([BLOCK_N, QN], gl.float32, layout=_MMA)
    for s in range(gl.maximum(start, full_end), end, BLOCK_N):
        page = gl.load(bt_row + s // PAGE).to(gl.int64)
        within = s % PAGE
        vw = gl.load(VC + page * s_vcb + (within + vkey) * s_vct + kvh * s_vch + vword)
        vsw = gl.load(VS + page * s_vsb + (within + skey) * s_vst + kvh * s_vsh, mask=s + skey < end, other=0)
        r = gl.load(res_row + (within + rkey) * s_rt + rch).to(gl.float16)  # [64, 128], channel order
        r = gl.reshape(r, [BLOCK_N, 4, 2, 2, 2, 2, 2])  # key, t, a1, a0, j2, j1, j0
        r = gl.convert_layout(gl.reshape(gl.permute(r, [0, 2, 3, 5, 6, 1, 4]), [BLOCK_N, 128]), _A)
        m_i, l_i, acc, c1, c2 = _attend(r, q16, zero, vw, vsw, s + skey < end, m_i, l_i, acc,
                                        c1, c2, scale_log2)

    l_i = gl.convert_layout(gl.sum(l_i, 0), gl.SliceLayout(0, _MMA))
    c1 = gl.convert_layout(gl.sum(c1, 0), gl.SliceLayout(0, _MMA))
    c2 = gl.convert_layout(gl.sum(c2, 0), gl.SliceLayout(0, _MMA))
    # out[query, channel] = ((acc - OFF c1) / (16 for the odd codes' rows) + c2) / l
    orow = gl.arange(0, 128, layout=gl.SliceLayout(1, _MMA))
    on = gl.arange(0, QN, layout=gl.SliceLayout(0, _MMA))
    rf = gl.expand_dims(gl.where(((orow >> 3) & 1) == 1, 0.0625, 1.0), 1)
    has = l_i > 0
    inv_l = 1.0 / gl.where(has, l_i, 1.0)
    out = ((acc - gl.expand_dims(OFF * c1, 0)) * rf + gl.expand_dims(c2, 0)) * gl.expand_dims(inv_l, 0)
    heads = kvh * GROUP + on
    omask = gl.expand_dims(on < GROUP, 0) & gl.expand_dims(orow < 128, 1)
    ochan = gl.expand_dims(_value_channel(orow), 1)
    if active <= 1:  # the only split with keys: its output is final
        gl.store(O + b.to(gl.int64) * stride_ob + gl.expand_dims(heads * stride_oh, 0) + ochan,
                 out.to(O.dtype.element_ty), mask=omask)
    else:
        gl.store(OP + w * stride_ps + gl.expand_dims(heads * stride_ph, 0) + ochan, out, mask=omask)
        lse = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
        gl.store(LSEP + heads * stride_lh + w, lse, mask=on < GROUP)


@triton.jit
def _merge_kernel(WORK, OP, LSEP, O, stride_ps, stride_ph, stride_lh, stride_ob, stride_oh, GROUP: tl.constexpr,
                  HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, MERGE_S: tl.constexpr):
    """The splits' merge (``common.merge_group``) for one (sequence, KV head) whose keys took more
    than one split (``WORK``: its first work item and splits); grid (B, kvh). A kernel of its own,
    not the last split to finish (as ``decode_attention`` does): there the counter's round trip
    and the partials' reads would sit on the Gluon kernel's tail."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    first = tl.load(WORK + 2 * b)
    n = tl.load(WORK + 2 * b + 1)
    if n > 1:
        merge_group(OP + first * stride_ps, LSEP + first, O, b.to(tl.int64), kvh, n, 0, stride_ph, stride_ps, 0,
                    stride_lh, stride_ob, stride_oh, GROUP, HEADS, HEAD_DIM, HEAD_DIM, MERGE_S)


def fmt_supported(f) -> bool:
    """The formats ``kivi4_decode`` reads: KIVI int4, one scale group per head of 128 channels,
    blocks of a multiple of 64 tokens, a 16-bit model."""
    return (f.kivi and f.bits == 4 and f.head_dim == 128 and f.group == 128 and f.block_size % 64 == 0
            and f.model_dtype in (torch.float16, torch.bfloat16))


def supported(views, q: torch.Tensor) -> bool:
    """Whether ``kivi4_decode`` takes this layer and query: ``fmt_supported``, a GQA group of at
    most 8 query heads, a CUDA GPU of compute capability 8.0 or later (``mma.sync`` m16n8k16),
    not the interpreter."""
    f = views.fmt
    return (fmt_supported(f) and q.is_cuda and not interpreting() and q.dtype == f.model_dtype
            and q.shape[1] % f.num_kv_heads == 0 and q.shape[1] // f.num_kv_heads <= QN
            and views.residual is not None and capability(q.device) >= 8)


def _words(views):
    """A layer's codes and scales as int32 words: key and value codes [nb, bs, kvh, 16], the keys'
    (scale, min) per channel [nb, kvh, D, 1], the values' per token [nb, bs, kvh, 1, 1]."""
    return (views.k_codes.view(torch.int32), views.v_codes.view(torch.int32), views.k_scales.view(torch.int32),
            views.v_scales.view(torch.int32))


def cache_strides(views) -> tuple[int, ...]:
    """The kernel's cache strides (words; compile-time constants, fixed by the format, so the
    tile's addresses are immediates): codes (block, token, head) for keys and values, the keys'
    scales (block, head), the values' (block, token, head)."""
    kc, vc, ks, vs = _words(views)
    return (kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
            ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), vs.stride(2))


def work_items(batch: int, num_kv_heads: int, device: torch.device, max_splits: int = MAX_SPLITS,
               wave: int = WAVE) -> int:
    """Work items per KV head (the grid's second axis): a wave of ``wave`` programs per SM, at
    least one per sequence, at most ``max_splits`` per sequence."""
    return max(batch, min(batch * max_splits, wave * sm_count(device) // num_kv_heads))


class SplitPlan(NamedTuple):
    """A step's split plan (``_plan_kernel``), the same for every layer: the lengths and block
    tables are every layer's. The attention backend keeps it on the step's metadata."""
    rows: torch.Tensor  # [items, PLAN_W] int32: each work item's row
    work: torch.Tensor  # [B, 2] int32: each sequence's first work item and splits (the merge's)
    max_splits: int

    @property
    def items(self) -> int:
        return self.rows.shape[0]


def split_plan(seq_lens: torch.Tensor, block_tables: torch.Tensor, num_kv_heads: int, page: int,
               max_splits: int = MAX_SPLITS, wave: int = WAVE) -> SplitPlan:
    """The split plan of a step's batch (``seq_lens`` [B], ``block_tables``) for a cache of
    ``num_kv_heads`` heads and ``page``-token blocks: ``work_items`` work items per KV head."""
    B = seq_lens.shape[0]
    nw = work_items(B, num_kv_heads, seq_lens.device, max_splits, wave)
    rows = torch.empty(nw, PLAN_W.value, dtype=torch.int32, device=seq_lens.device)
    work = torch.empty(B, 2, dtype=torch.int32, device=seq_lens.device)
    _plan_kernel[(nw,)](seq_lens, block_tables, rows, work, B, nw, block_tables.stride(0), MAXS=max_splits,
                        BPAD=max(32, triton.next_power_of_2(B)), PAGE=page, num_warps=1)
    return SplitPlan(rows, work, max_splits)


def seals(fmt) -> bool:
    """Whether the fused decode path (``kivi4_decode(rope=...)``) seals the key block its token
    fills itself: blocks of one 64-key tile, which the sequence's last split reads alone. Larger
    blocks keep ``seal_keys`` (a block's tiles may lie in two splits)."""
    return fmt.block_size == BLOCK_N


def kivi4_decode(q: torch.Tensor, views, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 res_slots: torch.Tensor, scale: float, out: torch.Tensor, max_splits: int = MAX_SPLITS,
                 rope: RopeWrite | None = None, plan: SplitPlan | None = None, l2_ahead: int = L2_AHEAD,
                 wave: int = WAVE) -> torch.Tensor:
    """Decode attention over a KIVI int4 layer (``supported``); arguments as
    ``paged_decode_attention``'s; a sequence's keys in at most ``max_splits`` splits, the splits
    of equal length over the batch (``_work``), ``wave`` programs per SM. ``rope``: this step's
    tokens (``slots``, ``res_mapping``, ``k``, ``v``, ``cos``, ``sin``; the positions are
    ``seq_lens - 1``), q, k and v before RoPE: ``rope_kv_write_quant``'s work done in this kernel
    (q rotated in registers and left as it is in memory; k and v written by the split that reads
    the sequence's last key), and where ``seals(fmt)`` ``seal_keys``' too (else it runs before
    this). ``plan``: the step's ``split_plan`` (None: made here). ``l2_ahead``: tiles ahead asked
    into L2 on sm90 and later (0: none). Returns ``out``."""
    B, H, D = q.shape
    f = views.fmt
    KVH = f.num_kv_heads
    group = H // KVH
    kc, vc, ks, vs = _words(views)
    res = views.residual
    assert q.stride(-1) == 1 and res.stride(-1) == 1 and kc.stride(-1) == 1 and ks.stride(2) == 1
    assert res.stride(0) == f.block_size * res.stride(1)
    assert 1 <= max_splits <= MAX_SPLITS and l2_ahead >= 0
    if B == 0:
        return out
    if plan is None:
        plan = split_plan(seq_lens, block_tables, KVH, f.block_size, max_splits, wave)
    assert plan.max_splits == max_splits and plan.work.shape[0] == B
    nw = plan.items
    split = nw > B
    op = torch.empty(nw, H, D, dtype=torch.float32, device=q.device) if split else out  # (else unused)
    lsep = torch.empty(H, nw, dtype=torch.float32, device=q.device) if split else out
    if rope is not None:
        k_new, v_new, cos, sin = rope.k, rope.v, rope.cos, rope.sin
        assert k_new.shape == v_new.shape == (B, KVH, D) and k_new.stride(-1) == v_new.stride(-1) == 1
        assert rope.res_mapping is not None and rope.slots.shape == rope.res_mapping.shape == (B,)
        assert cos.shape == sin.shape and cos.stride() == sin.stride() and cos.stride(-1) == 1
        rope_args = (rope.slots, rope.res_mapping, k_new, v_new, cos, sin, k_new.stride(0), k_new.stride(1),
                     v_new.stride(0), v_new.stride(1), cos.stride(0))
    else:
        rope_args = (seq_lens, seq_lens, q, q, q, q, 0, 0, 0, 0, 0)  # (placeholders)
    _kivi4_decode_kernel[(KVH, nw)](
        q, kc, vc, ks, vs, res, block_tables, res_slots, out, op, lsep, plan.rows, B, *rope_args,
        q.stride(0), q.stride(1), *cache_strides(views), res.stride(1), res.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), H * D, D, nw, scale * LOG2E,
        GROUP=group, PAGE=f.block_size, num_warps=1,
        L2_AHEAD=l2_ahead if kc.stride(0) % 4 == 0 and capability(q.device) >= 9 else 0,
        ROPE=rope is not None, SEAL=rope is not None and seals(f), TINY=MIN_SCALE)
    if split:
        heads, merge_s = merge_splits(group, D, 4)
        _merge_kernel[(B, KVH)](plan.work, op, lsep, out, H * D, D, nw, out.stride(0), out.stride(1), GROUP=group,
                                HEADS=heads, HEAD_DIM=D, MERGE_S=min(merge_s, triton.next_power_of_2(max_splits)),
                                num_warps=4)
    return out

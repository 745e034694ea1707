"""One-row weight-only quantized products, ``y = x @ dequant(W).T (+ bias)`` for x [1, K]: a
batch-1 decode step's projections, where the packed weights stream once through the SMs and the
product is bound by instruction issue unless each code costs very few instructions (formats:
``wq_gemm.py``: int8, int4 and FP8's e4m3 codes with a scale per row).

**Codes to float32 without a conversion instruction**, which Hopper issues at a quarter of its
float rate. int8 (and the Triton kernel's int4): the code's bits go under the mantissa of 2^23
(integer shift and mask), the word is read as a float32 (2^23 + code, exact) and 2^23 comes off
with one subtraction. The Gluon kernel's int4 needs no subtraction: a nibble masked where it lies
in its word, read as a float32, is code * 16^j * 2^-149 exactly (a subnormal, or below 2^24 with
exponent field 1), so x's column is scaled by 16^-j * 2^64 and the sums by 2^85, powers of two
that leave every product the same float:

    int4  nibble j of a 32-bit word is column 8 w + j:  w & (0xF << 4j)       (j = 6, 7: of w >> 24)
    int8  byte j is column 4 w + j, two's complement:   byte_j(w ^ 0x80808080) | 0x4B000000 - (2^23 + 128)

(the xor adds 128 to every signed byte of the word at once; a byte permute then places each
under the exponent). Per code, int4: one and an eighth integer instructions and the fused
multiply-add with x; int8: one and a quarter, a subtraction and the multiply-add. FP8's e4m3
codes have no such reading (a sign bit apart from the magnitude): the Gluon kernel converts two
at a time to float16 (``cvt.rn.f16x2.e4m3x2``, compute capability 8.9 on) and widens each to
float32, both exact; the Triton kernel moves the bits under float16's (``_e4m3``).

**The Gluon kernel** (CUDA) fixes the layout Triton would not: a thread holds 16 contiguous
bytes (4 words) of every one of the program's ``BLOCK_N`` rows, and the 32 (int4) or 16 (int8)
values of x those bytes meet, read as 16-byte vectors: the x it converts serves every row, and a
thread's sums over its columns stay in its registers, so the loop has no shuffles, no shared
memory and no barriers; a group's scale (and min times the group's sum of x) is applied once a
thread's 4 words (groups of at least 4 words: int4 g >= 32, int8 g >= 16; per channel at the
end). Words go through inline PTX (``_INT4_ASM``, ``_INT8_ASM``), x is split into its columns in
registers. Tiles asked for ``PREFETCH`` ahead; the first ones, weights and scales, before waiting
on the previous kernel (programmatic dependent launch: weights are never written while the
engine runs, x is read only after the wait).

**The Triton kernel** (``_wq_row_kernel``: the interpreter, and rows that are not whole 16-byte
vectors) does the same arithmetic on byte tiles whose layout the compiler chooses.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from kvserve.kernels import interpreting
from kvserve.kernels.common import capability, launch_pdl, pdl_kw, wait_inputs
from kvserve.kernels.silu_mul import silu_mul_rounded

# What comes off a code placed under 2^23's exponent (bits 0x4B000000): 2^23 for int4, 2^23 + 128
# for int8 (stored plus 128); shared by both kernels.
INT4_OFF = tl.constexpr(8388608.0)
INT8_OFF = tl.constexpr(8388736.0)
FP8_UNIT = tl.constexpr(256.0)  # what ``_e4m3``'s codes are multiplied by (in the scale) to give e4m3 values


@triton.jit
def _e4m3(b):
    """e4m3 bytes (W passed as uint8) -> their values / 256 in float32. The byte's exponent and
    mantissa bits, moved under float16's, read as a float16 (exponent bias 15 instead of 7,
    subnormals alike) give the value times 2^-8; the 2^8 goes into the scale (``FP8_UNIT``).
    A few integer operations, and no conversion instruction the interpreter lacks."""
    h = b.to(tl.uint16)
    h = ((h & 0x7F) << 7) | ((h & 0x80) << 8)
    return h.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _btile(W, S, Z, rn, k0, K, stride_wn, stride_sn, rb, rg, INT4: tl.constexpr, GROUPED: tl.constexpr,
           HAS_MIN: tl.constexpr, GROUP: tl.constexpr, MASKED: tl.constexpr):
    """The bytes [BLOCK_N, BLOCK_B] of the tile at column ``k0`` and, grouped, its scales and mins
    [BLOCK_N, groups] (float32; past K read as 0)."""
    b0 = k0 // 2 if INT4 else k0
    kb = K // 2 if INT4 else K
    ptrs = W + rn[:, None] * stride_wn + (b0 + rb)[None, :]
    if MASKED:
        b = tl.load(ptrs, mask=((b0 + rb) < kb)[None, :], other=0)
    else:
        b = tl.load(ptrs)
    if GROUPED:
        g = k0 // GROUP + rg
        ok = (g * GROUP < K)[None, :]
        soff = rn[:, None] * stride_sn + g[None, :]
        s = tl.load(S + soff, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(Z + soff, mask=ok, other=0.0).to(tl.float32) if HAS_MIN else s
    else:
        s = b
        z = b
    return b, s, z


@triton.jit
def _bdecode(b, INT4: tl.constexpr, FP8: tl.constexpr):
    """Bytes (uint8) -> their codes as exact float32: int4, [..., 2] (a byte's low and high nibble,
    its two columns, side by side); int8, the byte read as two's complement; FP8, the e4m3 value
    / 256 (``_e4m3``)."""
    if FP8:
        q = _e4m3(b)
    elif INT4:
        lo = ((b & 15).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - INT4_OFF
        hi = ((b >> 4).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - INT4_OFF
        q = tl.join(lo, hi)
    else:
        q = (b.to(tl.int32) ^ 0x4B000080).to(tl.float32, bitcast=True) - INT8_OFF
    return q


@triton.jit
def _rows(pid, j, N, BLOCK_N: tl.constexpr, SILU_MUL: tl.constexpr):
    """The weight rows of program ``pid``'s outputs ``j`` (int64; past the end, the last row again:
    valid memory, results dropped). With the fused SiLU, N is the output width and the weight
    [gate | up] has 2N rows: output j takes gate row n = pid * BLOCK_N / 2 + j // 2 (j even) or
    up row N + n (j odd), so each gate row lies beside its up row in the program's results."""
    if SILU_MUL:
        n = tl.minimum(pid * (BLOCK_N // 2) + j // 2, N - 1) + (j % 2) * N
    else:
        n = tl.minimum(pid * BLOCK_N + j, N - 1)
    return n.to(tl.int64)


@triton.jit
def _wq_row_kernel(X, W, S, Z, B, Y, N, K, stride_wn, stride_sn,
                   INT4: tl.constexpr, FP8: tl.constexpr, GROUPED: tl.constexpr, HAS_MIN: tl.constexpr,
                   HAS_BIAS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                   EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
                   SILU_MUL: tl.constexpr = False):
    tl.static_assert(PREFETCH == 1 or PREFETCH == 2, "PREFETCH: 1 or 2 tiles ahead")
    rn_safe = _rows(tl.program_id(0), tl.arange(0, BLOCK_N), N, BLOCK_N, SILU_MUL)
    rb = tl.arange(0, BLOCK_K // 2 if INT4 else BLOCK_K)
    NG: tl.constexpr = BLOCK_K // GROUP
    rg = tl.arange(0, NG)
    rk = tl.arange(0, BLOCK_K)
    b, s, z = _btile(W, S, Z, rn_safe, 0, K, stride_wn, stride_sn, rb, rg, INT4, GROUPED, HAS_MIN, GROUP,
                     not EVEN_K)
    if PREFETCH == 2:
        b1, s1, z1 = _btile(W, S, Z, rn_safe, BLOCK_K, K, stride_wn, stride_sn, rb, rg, INT4, GROUPED, HAS_MIN,
                            GROUP, True)
    wait_inputs(USE_PDL)
    acc = tl.zeros([BLOCK_N, NG] if GROUPED else [BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        bn, sn, zn = _btile(W, S, Z, rn_safe, k0 + PREFETCH * BLOCK_K, K, stride_wn, stride_sn, rb, rg, INT4,
                            GROUPED, HAS_MIN, GROUP, True)
        if EVEN_K:
            x = tl.load(X + k0 + rk).to(tl.float32)
        else:
            x = tl.load(X + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
        if INT4:  # [BN, BK/2, 2]: a byte's two codes meet x's pairs
            qx = _bdecode(b, INT4, FP8) * tl.reshape(x, [BLOCK_K // 2, 2])[None, :, :]
        else:
            qx = _bdecode(b, INT4, FP8) * x[None, :]
        if GROUPED:
            acc += tl.sum(tl.reshape(qx, [BLOCK_N, NG, GROUP]), axis=2) * s
            if HAS_MIN:
                acc += z * tl.sum(tl.reshape(x, [NG, GROUP]), axis=1)[None, :]
        else:
            acc += tl.reshape(qx, [BLOCK_N, BLOCK_K])
        if PREFETCH == 2:
            b, s, z, b1, s1, z1 = b1, s1, z1, bn, sn, zn
        else:
            b, s, z = bn, sn, zn
    y = tl.sum(acc, axis=1)
    if not GROUPED:
        y = y * tl.load(S + rn_safe).to(tl.float32)
        if FP8:
            y = y * FP8_UNIT
    if HAS_BIAS:
        y += tl.load(B + rn_safe).to(tl.float32)
    if SILU_MUL:  # rows (gate, up) side by side -> silu(gate) * up, half as many
        g, u = tl.split(tl.reshape(y, [BLOCK_N // 2, 2]))
        y = silu_mul_rounded(g.to(Y.dtype.element_ty), u.to(Y.dtype.element_ty), Y.dtype.element_ty)
        rn = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(Y + rn, y.to(Y.dtype.element_ty), mask=rn < N)


# -- the Gluon one-row kernel (CUDA; the interpreter runs ``_wq_row_kernel`` above) ----------------
@gluon.jit
def _pdl_wait(USE_PDL: gl.constexpr):
    if USE_PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _gl_tile(W, S, Z, rn, v0, KV, stride_wn, stride_sn, t, vv, GROUPED: gl.constexpr,
             HAS_MIN: gl.constexpr, WPG: gl.constexpr, VEC: gl.constexpr, MASKED: gl.constexpr):
    """Words [BLOCK_N, NT, VEC] of the tile whose first 16-byte vector is ``v0`` (vectors at or past
    ``KV`` read as 0), and each thread's group scale and min [BLOCK_N, NT] (float32)."""
    vec = v0 + t  # [NT]
    off = gl.expand_dims(gl.expand_dims(rn * stride_wn, 1), 2) + \
        gl.expand_dims(gl.expand_dims(gl.multiple_of(vec * VEC, VEC), 0), 2) + gl.expand_dims(gl.expand_dims(vv, 0), 1)
    if MASKED:
        ok = gl.expand_dims(gl.expand_dims(vec < KV, 0), 2)
        w = gl.load(W + off, mask=ok, other=0)
    else:
        w = gl.load(W + off)
    if GROUPED:
        g = (v0 + t) * VEC // WPG
        soff = gl.expand_dims(rn * stride_sn, 1) + gl.expand_dims(g, 0)
        sok = gl.expand_dims(v0 + t < KV, 0)
        s = gl.load(S + soff, mask=sok, other=0.0).to(gl.float32)
        if HAS_MIN:
            z = gl.load(Z + soff, mask=sok, other=0.0).to(gl.float32)
        else:
            z = s
    else:
        s = 0.0
        z = 0.0
    return w, s, z


# int4: a word's codes -> the float32 whose bits are the code where it lies, code * 16^j' (nibble
# j' of the word; j' = j for j < 6, j - 6 after one shift by 24): below 2^24, such bits read as a
# float are exactly their integer times 2^-149 (a subnormal, or exponent 1, whose implicit bit is
# bit 23). One instruction a code and none to subtract: x's column is scaled by 16^-j' * 2^64
# (powers of two: each product is code * x * 2^-85, exact in the fused multiply-add) and the
# sums by 2^85. The kernels never flush subnormals (no .ftz in the PTX: tested). x keeps full
# precision for |x| in (2^-41, 2^64).
_INT4_ASM = gl.constexpr("""{
.reg .b32 t;
and.b32 $0, $8, 0xF;
and.b32 $1, $8, 0xF0;
and.b32 $2, $8, 0xF00;
and.b32 $3, $8, 0xF000;
and.b32 $4, $8, 0xF0000;
and.b32 $5, $8, 0xF00000;
shr.u32 t, $8, 24;
and.b32 $6, t, 0xF;
shr.u32 $7, t, 4;
}""")
# The scale on each int4 product: 2^-149 from the codes' reading, 2^64 on x; the sums take 2^85.
UNSCALE = gl.constexpr(2.0 ** 85)
# int8: a word's codes -> float32 2^23 + 128 + code (exact), as raw bits; the caller takes the
# offset off. The word's bytes are xor-ed with 0x80 once (two's complement + 128), then each byte
# is put under 2^23's exponent by one byte permute (byte j, then 0, 0, 0x4B). (int4's reading,
# each byte masked in place with the 128 taken off per group, measured 1% slower per channel and
# 5% slower in groups of 32 on an H100: int8's product is bound by its bytes, not instructions.)
_INT8_ASM = gl.constexpr("""{
.reg .b32 t, c;
xor.b32 t, $4, 0x80808080;
mov.b32 c, 0x4B000000;
prmt.b32 $0, t, c, 0x7540;
prmt.b32 $1, t, c, 0x7541;
prmt.b32 $2, t, c, 0x7542;
prmt.b32 $3, t, c, 0x7543;
}""")
# FP8: a word's four e4m3 codes -> their float32 values (exact): each half-word's two codes to a
# float16 pair in one conversion (the upper byte to the upper half), each half widened.
_FP8_ASM = gl.constexpr("""{
.reg .b16 l, h, a0, a1, b0, b1;
.reg .b32 a, b;
mov.b32 {l, h}, $4;
cvt.rn.f16x2.e4m3x2 a, l;
cvt.rn.f16x2.e4m3x2 b, h;
mov.b32 {a0, a1}, a;
mov.b32 {b0, b1}, b;
cvt.f32.f16 $0, a0;
cvt.f32.f16 $1, a1;
cvt.f32.f16 $2, b0;
cvt.f32.f16 $3, b1;
}""")


@gluon.jit
def _gl_fma(acc, c, xj, OFF: gl.constexpr, LW: gl.constexpr):
    """acc + (c - OFF) * x: c the raw bits of OFF + code (int8), or the code read as it lies (int4,
    OFF 0)."""
    q = c - OFF if OFF != 0.0 else c
    return acc + q * gl.expand_dims(gl.convert_layout(xj, gl.SliceLayout(0, LW)), 0)


@gluon.jit
def _gl_dot_words(w, x, INT4: gl.constexpr, FP8: gl.constexpr, LW: gl.constexpr):
    """sum over each thread's words and codes of code * x: words [BLOCK_N, NT, VEC], x [NT, VEC, P]
    (float32, in the registers of the thread holding the words) -> [BLOCK_N, NT]. x splits into
    its P columns in registers (column p = 4a + 2b + c, split c first), one per code position."""
    NT: gl.constexpr = x.shape[0]
    VEC: gl.constexpr = x.shape[1]
    if INT4:
        c0, c1, c2, c3, c4, c5, c6, c7 = gl.inline_asm_elementwise(
            _INT4_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w], dtype=[gl.float32] * 8, is_pure=True, pack=1)
        x0, x1 = gl.split(gl.reshape(x, [NT, VEC, 2, 2, 2]))  # c
        x00, x01 = gl.split(x0)  # b
        x10, x11 = gl.split(x1)
        x000, x001 = gl.split(x00)  # a: x{c}{b}{a} is column 4a + 2b + c
        x010, x011 = gl.split(x01)
        x100, x101 = gl.split(x10)
        x110, x111 = gl.split(x11)
        t = c0 * gl.expand_dims(gl.convert_layout(x000, gl.SliceLayout(0, LW)), 0)
        t = _gl_fma(t, c1, x100, 0.0, LW)
        t = _gl_fma(t, c2, x010, 0.0, LW)
        t = _gl_fma(t, c3, x110, 0.0, LW)
        t = _gl_fma(t, c4, x001, 0.0, LW)
        t = _gl_fma(t, c5, x101, 0.0, LW)
        t = _gl_fma(t, c6, x011, 0.0, LW)
        t = _gl_fma(t, c7, x111, 0.0, LW)
    else:  # int8 or FP8: four codes a word
        OFF: gl.constexpr = 0.0 if FP8 else INT8_OFF
        c0, c1, c2, c3 = gl.inline_asm_elementwise(
            _FP8_ASM if FP8 else _INT8_ASM, "=r,=r,=r,=r,r", [w], dtype=[gl.float32] * 4, is_pure=True, pack=1)
        x0, x1 = gl.split(gl.reshape(x, [NT, VEC, 2, 2]))  # c
        x00, x01 = gl.split(x0)  # b: x{c}{b} is column 2b + c
        x10, x11 = gl.split(x1)
        t = (c0 - OFF if OFF != 0.0 else c0) * gl.expand_dims(gl.convert_layout(x00, gl.SliceLayout(0, LW)), 0)
        t = _gl_fma(t, c1, x10, OFF, LW)
        t = _gl_fma(t, c2, x01, OFF, LW)
        t = _gl_fma(t, c3, x11, OFF, LW)
    return gl.sum(t, axis=2)


@gluon.jit
def _gl_row_kernel(X, W, S, Z, B, Y, N, KV, stride_wn, stride_sn,
                   INT4: gl.constexpr, FP8: gl.constexpr, GROUPED: gl.constexpr, HAS_MIN: gl.constexpr,
                   HAS_BIAS: gl.constexpr, WPG: gl.constexpr, BLOCK_N: gl.constexpr, VEC: gl.constexpr,
                   NUM_WARPS: gl.constexpr, PREFETCH: gl.constexpr, USE_PDL: gl.constexpr,
                   SILU_MUL: gl.constexpr = False):
    gl.static_assert(PREFETCH == 1 or PREFETCH == 2, "PREFETCH: 1 or 2 tiles ahead")
    P: gl.constexpr = 8 if INT4 else 4  # codes a word
    NT: gl.constexpr = 32 * NUM_WARPS  # threads: each holds VEC words (16 bytes) of every row
    # [rows, threads, words, codes]: a thread's codes and rows all in its registers, so the sums
    # over a thread's columns need no shuffles and each x it loads serves every row
    L4: gl.constexpr = gl.BlockedLayout([BLOCK_N, 1, VEC, P], [1, 32, 1, 1], [1, NUM_WARPS, 1, 1], [3, 2, 1, 0])
    LW: gl.constexpr = gl.SliceLayout(3, L4)  # words [BLOCK_N, NT, VEC]
    LX: gl.constexpr = gl.SliceLayout(0, L4)  # x [NT, VEC, P]
    LA: gl.constexpr = gl.SliceLayout(2, LW)  # [BLOCK_N, NT]
    pid = gl.program_id(0)
    j = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LA))
    if SILU_MUL:  # the rows of ``_rows``: each gate row beside its up row
        rn = (gl.minimum(pid * (BLOCK_N // 2) + j // 2, N - 1) + (j % 2) * N).to(gl.int64)
    else:
        rn = gl.minimum(pid * BLOCK_N + j, N - 1).to(gl.int64)
    t = gl.arange(0, NT, layout=gl.SliceLayout(0, LA))
    vv = gl.arange(0, VEC, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))
    tx = gl.arange(0, NT, layout=gl.SliceLayout(1, gl.SliceLayout(2, LX)))
    vx = gl.arange(0, VEC, layout=gl.SliceLayout(0, gl.SliceLayout(2, LX)))
    px = gl.arange(0, P, layout=gl.SliceLayout(0, gl.SliceLayout(1, LX)))
    xoff = (gl.expand_dims(gl.expand_dims(tx * VEC, 1), 2) + gl.expand_dims(gl.expand_dims(vx, 0), 2)) * P + \
        gl.expand_dims(gl.expand_dims(px, 0), 1)
    if INT4:  # column p's x scale, 2^(64 - 4j') (_INT4_ASM), as a float's exponent bits
        xe = gl.where(px < 6, 64 - 4 * px, 64)
        xm = gl.expand_dims(gl.expand_dims(((127 + xe) << 23).to(gl.float32, bitcast=True), 0), 1)
    w, s, z = _gl_tile(W, S, Z, rn, 0, KV, stride_wn, stride_sn, t, vv, GROUPED, HAS_MIN, WPG, VEC, True)
    if PREFETCH == 2:
        w1, s1, z1 = _gl_tile(W, S, Z, rn, NT, KV, stride_wn, stride_sn, t, vv, GROUPED, HAS_MIN, WPG,
                              VEC, True)
    _pdl_wait(USE_PDL)
    acc = gl.zeros([BLOCK_N, NT], gl.float32, layout=LA)
    for v0 in range(0, KV, NT):
        wn, sn, zn = _gl_tile(W, S, Z, rn, v0 + PREFETCH * NT, KV, stride_wn, stride_sn, t, vv,
                              GROUPED, HAS_MIN, WPG, VEC, True)
        xk = v0 * VEC * P + xoff
        x = gl.load(X + xk, mask=xk < KV * VEC * P, other=0.0).to(gl.float32)
        part = _gl_dot_words(w, x * xm if INT4 else x, INT4, FP8, LW)
        if GROUPED:
            acc += part * (s * UNSCALE) if INT4 else part * s
            if HAS_MIN:
                xs = gl.convert_layout(gl.sum(gl.sum(x, axis=2), axis=1), gl.SliceLayout(0, LA))
                acc += z * gl.expand_dims(xs, 0)
        else:
            acc += part * UNSCALE if INT4 else part
        if PREFETCH == 2:
            w, s, z, w1, s1, z1 = w1, s1, z1, wn, sn, zn
        else:
            w, s, z = wn, sn, zn
    y = gl.sum(acc, axis=1)
    if not GROUPED:
        y = y * gl.load(S + rn).to(gl.float32)
    if HAS_BIAS:
        y += gl.load(B + rn).to(gl.float32)
    if SILU_MUL:  # (gate, up) pairs -> silu(gate) * up, rounded as ``silu_mul_rounded`` rounds
        LY: gl.constexpr = gl.BlockedLayout([BLOCK_N // 2, 2], [32, 1], [NUM_WARPS, 1], [1, 0])
        g, u = gl.split(gl.convert_layout(gl.reshape(y, [BLOCK_N // 2, 2]), LY))
        g = g.to(Y.dtype.element_ty).to(gl.float32)
        act = (g / (1.0 + gl.exp(-g))).to(Y.dtype.element_ty).to(gl.float32)
        y = act * u.to(Y.dtype.element_ty).to(gl.float32)
        rows = pid * (BLOCK_N // 2) + gl.arange(0, BLOCK_N // 2, layout=y.type.layout)
    else:
        rows = pid * BLOCK_N + j
    gl.store(Y + rows, y.to(Y.dtype.element_ty), mask=rows < N)


def takes(qweight: torch.Tensor, group_size: int) -> bool:
    """This kernel takes the packed weight: int4, or int8 (or FP8's e4m3 codes, one scale a row)
    whose rows are whole words."""
    if qweight.dtype == torch.uint8:
        return True
    if qweight.dtype == torch.float8_e4m3fn:
        return qweight.shape[1] % 4 == 0 and group_size == 0
    return qweight.dtype == torch.int8 and qweight.shape[1] % 4 == 0 and (group_size == 0 or group_size % 4 == 0)


@functools.cache
def _fp8_conversions(index: int) -> bool:
    """The GPU converts e4m3 to float16 in one instruction (compute capability 8.9 on)."""
    return torch.cuda.get_device_capability(index) >= (8, 9)


def gluon_takes(x: torch.Tensor, qweight: torch.Tensor, K: int, int4: bool) -> bool:
    """The Gluon kernel's conditions: a CUDA GPU of compute capability 8.0 or later (it is built
    and measured on 9.0; 8.9 or later for FP8's conversion), not the interpreter, rows of whole
    16-byte vectors, each row starting on a 4-byte boundary (read as 32-bit words)."""
    ok = (x.is_cuda and not interpreting() and capability(x.device) >= 8 and K % (32 if int4 else 16) == 0
          and qweight.stride(0) % 4 == 0 and qweight.storage_offset() % 4 == 0)
    if ok and qweight.dtype == torch.float8_e4m3fn:
        return _fp8_conversions(x.device.index if x.device.index is not None else torch.cuda.current_device())
    return ok


def default_config(x: torch.Tensor, qweight: torch.Tensor, K: int, int4: bool, group_size: int) -> dict:
    """CUDA, rows of whole 16-byte vectors: the Gluon kernel, 8 rows a program (4 for group-wise
    int8, whose scales cost registers), 4 warps, the next tile asked for ahead (from the sweep of
    ``benchmarks/weight_quant.py --only step --step-sweep`` on the H200). Otherwise the Triton
    kernel: 4 rows by 1 KiB of each row a tile, the next tile asked for ahead."""
    if gluon_takes(x, qweight, K, int4):
        return {"KIND": "gluon", "BLOCK_N": 4 if group_size and not int4 else 8, "PREFETCH": 1, "num_warps": 4}
    return {"KIND": "triton", "BLOCK_N": 4, "TILE_BYTES": 1024, "PREFETCH": 1, "num_warps": 4}


def wq_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
            group_size: int, bias: torch.Tensor | None, N: int, K: int, int4: bool,
            config: dict | None = None, pdl: bool = True, silu_mul: bool = False) -> torch.Tensor:
    """x [1, K] (unit stride) times the packed weight's transpose -> [1, N]; arguments checked by
    ``wq_gemm.wq_mm``, which calls this for one row when ``takes`` says so. ``config``: ``KIND``
    ("gluon": K a multiple of 32 for int4, 16 for int8; or "triton"), ``BLOCK_N``, ``PREFETCH`` (1
    or 2), ``num_warps`` and for Triton ``TILE_BYTES`` (None: ``default_config``). ``silu_mul``:
    the weight is the merged [gate | up] (2N rows, no bias) and the result silu(x W_gate.T) *
    (x W_up.T) [1, N], rounded as the unfused product and ``silu_and_mul`` round it; a program
    takes ``BLOCK_N`` / 2 gate rows and their up rows."""
    cfg = dict(config or default_config(x, qweight, K, int4, group_size))
    block_n, kind, prefetch, nw = cfg.pop("BLOCK_N"), cfg.pop("KIND"), cfg.pop("PREFETCH"), cfg.pop("num_warps")
    assert not silu_mul or (bias is None and block_n >= 2 and qweight.shape[0] == 2 * N), \
        "the fused SiLU: the [gate | up] weight of 2N rows, no bias, BLOCK_N >= 2"
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(N, block_n // 2 if silu_mul else block_n),)
    bias_arg, mins_arg = bias if bias is not None else scales, scales if mins is None else mins
    fp8 = qweight.dtype == torch.float8_e4m3fn
    flags = dict(INT4=int4, FP8=fp8, GROUPED=group_size > 0, HAS_MIN=mins is not None, HAS_BIAS=bias is not None,
                 BLOCK_N=block_n, PREFETCH=prefetch, SILU_MUL=silu_mul, num_warps=nw)
    if kind == "gluon":
        per_word = 8 if int4 else 4
        assert gluon_takes(x, qweight, K, int4), "the Gluon kernel: CUDA 8.0+, rows of whole 16-byte vectors"
        w32 = qweight.view(torch.int32)
        pdl_on = launch_pdl(x, pdl)
        _gl_row_kernel[grid](x, w32, scales, mins_arg, bias_arg, y, N, K // per_word // 4, w32.stride(0),
                             scales.stride(0), WPG=group_size // per_word if group_size else 1, VEC=4,
                             NUM_WARPS=nw, USE_PDL=pdl_on, **({"launch_pdl": True} if pdl_on else {}), **flags)
        return y
    assert kind == "triton", f"KIND is 'gluon' or 'triton', got {kind!r}"
    group = group_size or 1
    block_k = max(group, min(cfg.pop("TILE_BYTES") * (2 if int4 else 1), triton.next_power_of_2(K)))
    _wq_row_kernel[grid](x, qweight.view(torch.uint8), scales, mins_arg, bias_arg, y, N, K, qweight.stride(0),
                         scales.stride(0), GROUP=group, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
                         **pdl_kw(x, pdl), **flags)
    return y

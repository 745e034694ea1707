"""Weight-only quantized products ``y = x @ dequant(W).T (+ bias)``: the weights stay packed in
memory and are dequantized in registers, tile by tile (formats: ``kvserve/layers/rtn.py``).

    int8  W [N, K] int8, scale [N]:            y[m, n] = scale[n] * sum_k x[m, k] q[n, k]
          or scale [N, K/g] and optionally min [N, K/g] (group-wise: GGUF's Q8_0 and Q6_K, and
          fused projections of mixed GGUF types, ``layers/gguf_blocks.py``)
    fp8   W [N, K] float8_e4m3fn, scale [N]: as int8 (an FP8 layer's few-row products,
          ``layers/fp8_linear.py``: its weights times unquantized activations)
    int4  W [N, K/2] uint8 (2 codes a byte),   y[m, n] = sum_groups scale[n, j] * sum_(k in j) x[m, k] q[n, k]
          scale, min [N, K/g]                                  + min[n, j] * sum_(k in j) x[m, k]

One kernel, three shapes of program, by the rows of x (one row whose weight rows are whole
words goes to ``wq_gemv.py``, which decodes the codes with few instructions; here one row is a
caller's explicit tile, or an FP8 weight of another width):

    rows = 1     each program owns BLOCK_N output features and streams their packed rows over K
                 (as ``gemv.py``): codes times x elementwise, summed per group, then scaled;
                 the int8 scale is applied once at the end.
    rows <= 32   the same grid with x padded to 16/32 rows: each W tile is dequantized to x's
                 dtype and goes through ``tl.dot`` (the tensor cores idle either way).
    more         a tiled GEMM: programs over (N, M) tiles, the W tile dequantized in registers.

A product whose tiles leave multiprocessors idle (few weight rows a program, few programs) splits
K over several programs, each summing its part into a float32 slice that a second kernel adds
up in a fixed order (``split_k``).

``dequantize`` writes a whole matrix back to x's dtype for the other large-batch choice,
dequantize-then-cuBLAS. Which one a product takes is ``KernelConfig``'s rule (``layers/quant_linear``).

The group of an int4 tile: BLOCK_K is a multiple of the group size g, so a tile's codes reshape
to [BLOCK_N, BLOCK_K / g, g] and meet one scale and one min per group; K is a multiple of g, so a
tile past K is masked in whole groups (codes, x, scales and mins read as 0).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvserve.kernels import wq_gemv
from kvserve.kernels.common import dot_precision
from kvserve.kernels.wq_gemv import FP8_UNIT, _e4m3

MAX_SKINNY_ROWS = 32  # rows the one-wave skinny shape takes; more: the tiled GEMM


@triton.jit
def _codes(W, rn_safe, k0, rk, K, stride_wn, INT4: tl.constexpr, FP8: tl.constexpr, BLOCK_K: tl.constexpr,
           EVEN_K: tl.constexpr, MAGIC: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] codes of W at column k0, as float32 (int4: 0..15; int8: -127..127;
    FP8: the e4m3 value / 256, exact, see ``_e4m3``). ``MAGIC``: int8 codes without the
    conversion instruction (below)."""
    if INT4:
        b = _int4_bytes(W, rn_safe, k0, K, stride_wn, BLOCK_K, EVEN_K)
        return tl.interleave(b & 15, b >> 4).to(tl.float32)
    ptrs = W + rn_safe[:, None] * stride_wn + k0 + rk[None, :]
    if EVEN_K:
        b = tl.load(ptrs)
    else:
        b = tl.load(ptrs, mask=(k0 + rk < K)[None, :], other=0)
    if FP8:
        return _e4m3(b)
    if MAGIC:
        # the code + 128 under 2^23's exponent, read as a float32, less 2^23 + 128 (exact): an
        # integer operation and a subtraction for the conversion instruction, which runs at a
        # quarter of the float rate. The weight-left GEMM, which decodes each tile once per tile
        # of x rows beside the tensor cores, gains from it; the few-row kernels, bound by their
        # bytes, do not (BENCHMARKS.md, "Weight quantization").
        return ((b.to(tl.int32) & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True) - _INT8_OFF
    return b.to(tl.float32)


@triton.jit
def _int4_bytes(W, rn_safe, k0, K, stride_wn, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K / 2] bytes of an int4 tile at column k0 (past K read as 0)."""
    rkh = tl.arange(0, BLOCK_K // 2)
    ptrs = W + rn_safe[:, None] * stride_wn + k0 // 2 + rkh[None, :]
    if EVEN_K:
        b = tl.load(ptrs)
    else:
        b = tl.load(ptrs, mask=(k0 + 2 * rkh < K)[None, :], other=0)
    return b


@triton.jit
def _int4_tile(W, rn_safe, k0, K, stride_wn, s, z, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
               DOWN: tl.constexpr):
    """The int4 tile at column k0 dequantized, times 2^-DOWN: [BLOCK_N, BLOCK_K] float32. ``s``
    and ``z``: the scales and mins, [BLOCK_N, groups] for the tile's groups or [BLOCK_N, 1] for
    one. A byte's nibbles are masked where they lie and read as float32: q * 2^-149 and
    16 q * 2^-149 exactly (subnormals; Triton never flushes them), so no conversion instruction
    (a quarter of the float rate) and no shift; one fused multiply-add by s * 2^(149 - DOWN) (over
    16 for the high nibble) and z * 2^-DOWN puts each where it goes. DOWN is 0 or 49 (the caller
    multiplies its sums back by 2^49): 49 keeps s * 2^100 within float32 and the weights normal
    in bfloat16 and tf32, whose exponents are float32's; float16's narrow range takes 0, at one
    multiplication more a code."""
    b = _int4_bytes(W, rn_safe, k0, K, stride_wn, BLOCK_K, EVEN_K).to(tl.int32)
    lo = (b & 15).to(tl.float32, bitcast=True)
    hi = (b & 0xF0).to(tl.float32, bitcast=True)
    BN: tl.constexpr = lo.shape[0]
    NG: tl.constexpr = s.shape[1]
    if DOWN == 0:
        lo, hi = lo * _TWO_100, hi * _TWO_100
        s = s * _TWO_49
    else:
        s = s * _TWO_100
        z = z * _TWO_M49
    lo = tl.reshape(lo, [BN, NG, BLOCK_K // 2 // NG]) * s[:, :, None] + z[:, :, None]
    hi = tl.reshape(hi, [BN, NG, BLOCK_K // 2 // NG]) * (s * 0.0625)[:, :, None] + z[:, :, None]
    return tl.interleave(tl.reshape(lo, [BN, BLOCK_K // 2]), tl.reshape(hi, [BN, BLOCK_K // 2]))


_INT8_OFF = tl.constexpr(8388736.0)  # 2^23 + 128 (``_codes``)
_TWO_100 = tl.constexpr(2.0 ** 100)
_TWO_49 = tl.constexpr(2.0 ** 49)
_TWO_M49 = tl.constexpr(2.0 ** -49)


@triton.jit
def _group_params(S, Z, rn_safe, k0, K, stride_sn, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                  HAS_MIN: tl.constexpr):
    """The tile's group scales and mins, [BLOCK_N, BLOCK_K / GROUP] each, float32 (0 past K;
    mins all 0 without HAS_MIN)."""
    rg = tl.arange(0, BLOCK_K // GROUP)
    ok = (k0 + rg * GROUP < K)[None, :]
    off = rn_safe[:, None] * stride_sn + k0 // GROUP + rg[None, :]
    s = tl.load(S + off, mask=ok, other=0.0).to(tl.float32)
    if HAS_MIN:
        z = tl.load(Z + off, mask=ok, other=0.0).to(tl.float32)
    else:
        z = tl.zeros_like(s)
    return s, z


@triton.jit
def _wq_mm_kernel(X, W, S, Z, B, Y, M, N, K, K_TILES, stride_xm, stride_wn, stride_sn, stride_ym, stride_ys,
                  INT4: tl.constexpr, FP8: tl.constexpr, GROUPED: tl.constexpr, HAS_MIN: tl.constexpr,
                  GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr):
    """``wq_mm``'s kernel. Program (n, m, s) sums K_TILES column steps from s K_TILES BLOCK_K on
    into Y's slice s (split over K, ``split_k``); with one split, Y is the output."""
    pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    k_lo = pid_k * K_TILES * BLOCK_K  # (a multiple of BLOCK_K the compiler can see: wide loads)
    k_hi = tl.minimum(K, k_lo + K_TILES * BLOCK_K)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past N read row N - 1 (valid memory, results dropped): the weight loads stay unmasked.
    rn_safe = tl.minimum(rn, N - 1).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    NG: tl.constexpr = BLOCK_K // GROUP
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, NG] if GROUPED else [BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            q = _codes(W, rn_safe, k0, rk, K, stride_wn, INT4, FP8, BLOCK_K, EVEN_K, False)
            if EVEN_K:
                x = tl.load(X + k0 + rk).to(tl.float32)
            else:
                x = tl.load(X + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            if GROUPED:
                s, z = _group_params(S, Z, rn_safe, k0, K, stride_sn, GROUP, BLOCK_K, HAS_MIN)
                qx = tl.sum(tl.reshape(q * x[None, :], [BLOCK_N, NG, GROUP]), axis=2)
                if HAS_MIN:
                    xg = tl.sum(tl.reshape(x, [NG, GROUP]), axis=1)
                    acc += qx * s + z * xg[None, :]
                else:
                    acc += qx * s
            else:
                acc += q * x[None, :]
        y = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = rm < M
        x_ptrs = X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        DOWN: tl.constexpr = 0 if X.dtype.element_ty == tl.float16 else 49  # (_int4_tile)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs + k0, mask=m_ok[:, None], other=0.0)
            else:
                x = tl.load(x_ptrs + k0, mask=m_ok[:, None] & (k0 + rk < K)[None, :], other=0.0)
            if INT4:
                s, z = _group_params(S, Z, rn_safe, k0, K, stride_sn, GROUP, BLOCK_K, HAS_MIN)
                w = _int4_tile(W, rn_safe, k0, K, stride_wn, s, z, BLOCK_K, EVEN_K, DOWN)
            elif GROUPED:
                q = _codes(W, rn_safe, k0, rk, K, stride_wn, INT4, FP8, BLOCK_K, EVEN_K, False)
                s, z = _group_params(S, Z, rn_safe, k0, K, stride_sn, GROUP, BLOCK_K, HAS_MIN)
                w = tl.reshape(q, [BLOCK_N, NG, GROUP]) * s[:, :, None]
                if HAS_MIN:
                    w += z[:, :, None]
                w = tl.reshape(w, [BLOCK_N, BLOCK_K])
            else:
                w = _codes(W, rn_safe, k0, rk, K, stride_wn, INT4, FP8, BLOCK_K, EVEN_K, False)
            acc = tl.dot(x, tl.trans(w.to(X.dtype.element_ty)), acc, input_precision=PRECISION)
        y = acc
        if INT4 and DOWN != 0:
            y = y * _TWO_49
    if not GROUPED:
        y = y * tl.load(S + rn_safe).to(tl.float32)[None, :]
        if FP8:
            y = y * FP8_UNIT
    if HAS_BIAS:
        y += tl.load(B + rn_safe).to(tl.float32)[None, :]
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    out = Y + pid_k.to(tl.int64) * stride_ys + rows[:, None] * stride_ym + rn[None, :]
    tl.store(out, y.to(Y.dtype.element_ty), mask=(rows < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _dequant_kernel(W, S, Z, Out, N, K, stride_wn, stride_sn, stride_on,
                    INT4: tl.constexpr, FP8: tl.constexpr, GROUPED: tl.constexpr, HAS_MIN: tl.constexpr,
                    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_safe = tl.minimum(rn, N - 1).to(tl.int64)
    k0 = tl.program_id(1) * BLOCK_K
    rk = tl.arange(0, BLOCK_K)
    q = _codes(W, rn_safe, k0, rk, K, stride_wn, INT4, FP8, BLOCK_K, False, False)
    if GROUPED:
        NG: tl.constexpr = BLOCK_K // GROUP
        s, z = _group_params(S, Z, rn_safe, k0, K, stride_sn, GROUP, BLOCK_K, HAS_MIN)
        w = tl.reshape(tl.reshape(q, [BLOCK_N, NG, GROUP]) * s[:, :, None] + z[:, :, None], [BLOCK_N, BLOCK_K])
    else:
        w = q * tl.load(S + rn_safe).to(tl.float32)[:, None]
        if FP8:
            w = w * FP8_UNIT
    out = Out + rn_safe[:, None] * stride_on + k0 + rk[None, :]
    tl.store(out, w.to(Out.dtype.element_ty), mask=(rn < N)[:, None] & (k0 + rk < K)[None, :])


@triton.jit
def weight_left_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``pid``'s weight rows and rows of x in a weight-left grid, whose programs of one
    weight tile are adjacent (the x tiles vary fastest): (rn, rn clamped to N - 1, rm, rm clamped
    to M - 1), the clamped ones int64. Rows past N and M read the last (valid memory, results
    dropped), so the loads stay unmasked."""
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % num_m, pid // num_m
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return rn, tl.minimum(rn, N - 1).to(tl.int64), rm, tl.minimum(rm, M - 1).to(tl.int64)


@triton.jit
def _wq_wx_kernel(X, W, S, Z, B, Y, M, N, K, K_TILES, stride_xm, stride_wn, stride_sn, stride_ym, stride_ys,
                  INT4: tl.constexpr, GROUPED: tl.constexpr, HAS_MIN: tl.constexpr, GROUP: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  PRECISION: tl.constexpr):
    """The large-batch GEMM with the weight as the tensor cores' left operand: a program computes
    Y^T's tile [BLOCK_N, BLOCK_M] = dequant(W's rows) @ X's rows^T, decoding each weight tile in
    registers straight into that operand. BLOCK_K divides the group, so a tile meets one scale
    (and min) per row: a broadcast, no regrouping of the codes. Per-channel int8 codes go into
    the product as they are (exact in 16-bit floats) and the scale comes once at the end. The
    programs of one weight tile are adjacent in launch order (the M tiles vary fastest), so each
    weight byte is read from memory about once; x is small and stays in L2. Split over K as
    ``_wq_mm_kernel`` (the split is the grid's second axis)."""
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    rn, rn_safe, rm, rm_safe = weight_left_tile(pid, M, N, BLOCK_M, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    DOWN: tl.constexpr = 0 if X.dtype.element_ty == tl.float16 else 49  # (_int4_tile)
    k_lo = pid_k * K_TILES * BLOCK_K
    for k0 in range(k_lo, tl.minimum(K, k_lo + K_TILES * BLOCK_K), BLOCK_K):
        if INT4:  # K % BLOCK_K == 0; one group a tile
            g = k0 // GROUP
            s = tl.load(S + rn_safe * stride_sn + g).to(tl.float32)[:, None]
            z = tl.load(Z + rn_safe * stride_sn + g).to(tl.float32)[:, None]
            w = _int4_tile(W, rn_safe, k0, K, stride_wn, s, z, BLOCK_K, True, DOWN)
        else:
            w = _codes(W, rn_safe, k0, rk, K, stride_wn, INT4, False, BLOCK_K, True, True)
            if GROUPED:
                g = k0 // GROUP
                w = w * tl.load(S + rn_safe * stride_sn + g).to(tl.float32)[:, None]
                if HAS_MIN:
                    w += tl.load(Z + rn_safe * stride_sn + g).to(tl.float32)[:, None]
        x = tl.load(X + rm_safe[:, None] * stride_xm + k0 + rk[None, :])
        acc = tl.dot(w.to(X.dtype.element_ty), tl.trans(x), acc, input_precision=PRECISION)
    if INT4 and DOWN != 0:
        acc = acc * _TWO_49
    if not GROUPED:
        acc = acc * tl.load(S + rn_safe).to(tl.float32)[:, None]
    if HAS_BIAS:
        acc += tl.load(B + rn_safe).to(tl.float32)[:, None]
    y = tl.trans(acc)
    out = Y + pid_k.to(tl.int64) * stride_ys + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(out, y.to(Y.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


# The weight-left GEMM's column step (``wq_mm_wx``), and its tile by the rows of x: 64 weight
# rows by 64 rows of x (4 stages) up to 64 rows, by 128 (3 stages) above, 4 warps; int8 and int4
# alike (the fastest of the sweep's eleven tiles at 64 to 512 rows, Llama-3-8B's layers, H100).
WX_BLOCK_K = 128


def wx_config(rows: int) -> dict:
    small = rows <= 64
    return {"BLOCK_N": 64, "BLOCK_M": 64 if small else 128, "BLOCK_K": WX_BLOCK_K, "num_warps": 4,
            "num_stages": 4 if small else 3}


def wx_block_k(qweight: torch.Tensor, group_size: int, K: int, block_k: int) -> int:
    """The weight-left GEMM's column step for this weight: ``block_k`` halved until it divides the
    group (grouped formats) and K; 0 where none of at least 16 does (that product goes elsewhere)."""
    if qweight.dtype == torch.float8_e4m3fn:
        return 0
    while block_k >= 16 and (K % block_k or group_size and group_size % block_k):
        block_k //= 2
    return block_k if block_k >= 16 else 0


def wq_mm_wx(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
             group_size: int = 0, bias: torch.Tensor | None = None, config: dict | None = None,
             split: bool = True) -> torch.Tensor:
    """``wq_mm``'s product by the weight-left GEMM (``_wq_wx_kernel``), for many rows of x; int8
    and int4 weights whose K and group a column step of 16 or more divides (``wx_block_k``).
    ``split``: K split as ``split_k`` says (a config's ``SPLIT_K`` overrides it)."""
    N, K, int4 = _check(x, qweight, scales, mins, group_size)
    M = x.shape[0]
    cfg = dict(config or wx_config(x.shape[0]))
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    block_k = wx_block_k(qweight, group_size, K, cfg.pop("BLOCK_K"))
    assert block_k, f"no column step divides K={K} and the group {group_size}"
    if M == 0:
        return torch.empty(M, N, dtype=x.dtype, device=x.device)
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    parts, k_tiles = _parts(cfg, tiles, triton.cdiv(K, block_k), x, int4, split)
    y, out, bias_in = _outputs(x, M, N, parts, bias)
    _wq_wx_kernel[(tiles, parts)](x, qweight, scales, scales if mins is None else mins,
                                  bias_in if bias_in is not None else scales,
                                  out, M, N, K, k_tiles, x.stride(0), qweight.stride(0), scales.stride(0),
                                  out.stride(-2), out.stride(0) if parts > 1 else 0,
                                  INT4=int4, GROUPED=group_size > 0, HAS_MIN=mins is not None,
                                  GROUP=group_size or 1, HAS_BIAS=bias_in is not None, BLOCK_M=block_m,
                                  BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision(x.dtype), **cfg)
    return _sum_parts(out, bias, y) if parts > 1 else y


# Split over K (``split_k``): a product whose tiles leave multiprocessors idle (Llama-3-8B's o and
# down projections give 64 programs of 64 weight rows, on an H100's 132) has each program sum
# only part of K into a float32 slice of its own; a second kernel adds the slices in a fixed order
# (deterministic, unlike atomics), adds the bias and rounds once. Measured per projection on an
# H100 (``benchmarks/weight_quant.py --only split``): doubling the parts until the programs fill
# one wave came within about 5 us of the fastest split of every projection at 2 to 128 rows
# (down at 48 rows: int4 113 -> 53 us, int8 135 -> 43). Past that the slices' traffic costs more
# than the idle multiprocessors save: int8 lost at 256 rows, int4 (more instructions a weight)
# still gained there.
SPLIT_WAVES = 1  # programs wanted per multiprocessor before K is split no further
SPLIT_MIN_TILES = 4  # column steps a part keeps at least
SPLIT_MAX = 8
SPLIT_MAX_ROWS = {False: 128, True: 256}  # rows of x up to which K is split: int8 / FP8, int4


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k(tiles: int, k_tiles: int, multiprocessors: int, rows: int, int4: bool) -> int:
    """How many parts a product of ``rows`` rows of x is summed in: one past SPLIT_MAX_ROWS;
    else doubled from 1 while its ``tiles`` programs times the parts stay under SPLIT_WAVES per
    multiprocessor and each part keeps SPLIT_MIN_TILES of its ``k_tiles`` column steps, at most
    SPLIT_MAX."""
    if rows > SPLIT_MAX_ROWS[int4]:
        return 1
    parts = 1
    while (parts < SPLIT_MAX and tiles * parts < SPLIT_WAVES * multiprocessors
           and k_tiles >= 2 * parts * SPLIT_MIN_TILES):
        parts *= 2
    return parts


def _parts(cfg: dict, tiles: int, k_tiles: int, x: torch.Tensor, int4: bool, split: bool) -> tuple[int, int]:
    """(parts, column steps a part) for a product: the config's ``SPLIT_K`` (popped) if it has
    one, else ``split_k``'s on CUDA where ``split``, else one part."""
    parts = cfg.pop("SPLIT_K", None)
    if parts is None:
        ok = split and x.device.type == "cuda"
        parts = split_k(tiles, k_tiles, _multiprocessors(x.device), x.shape[0], int4) if ok else 1
    per = triton.cdiv(k_tiles, max(1, min(parts, k_tiles)))
    return triton.cdiv(k_tiles, per), per


def _outputs(x: torch.Tensor, M: int, N: int, parts: int, bias: torch.Tensor | None):
    """(y, what the kernel writes, the bias it adds): with parts, float32 slices [parts, M, N]
    and no bias (``_sum_parts`` adds it)."""
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if parts == 1:
        return y, y, bias
    assert parts * M * N < 2**31, "the slices are indexed in 32 bits (``_sum_parts_kernel``)"
    return y, torch.empty(parts, M, N, dtype=torch.float32, device=x.device), None


@triton.jit
def _sum_parts_kernel(P, B, Y, MN, N, PARTS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(P + offs, mask=ok, other=0.0)
    for p in tl.static_range(1, PARTS):
        acc += tl.load(P + p * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


def _sum_parts(parts: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """y [M, N] = the parts' sum (+ bias), rounded once to y's dtype."""
    P, M, N = parts.shape
    block = 1024
    _sum_parts_kernel[(triton.cdiv(M * N, block),)](parts, bias if bias is not None else parts, y, M * N, N,
                                                    PARTS=P, HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return y


def default_config(M: int, N: int, K: int, int4: bool) -> dict:
    """Tiles per row count. One row: 4 output features per program, 1,024 columns a tile (1 KiB
    of int8, 512 B of int4 per row). Up to 16 rows: 64 features by 256 columns, x padded to 16
    rows; up to 32: 16 features by 256 columns, x padded to 32 rows (with 64 features the
    program's registers ran short: one H100, Llama-3-8B's layers at 32 rows, int4 g128 177
    against 213 us, int8 153 against 186). More: 64 x 128 output tiles over 64 columns, 8 warps,
    3 stages (a starting point; the sweep in ``benchmarks/weight_quant.py`` reports what each row
    count gets)."""
    if M == 1:
        return {"BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 1024, "num_warps": 4, "num_stages": 1}
    if M <= MAX_SKINNY_ROWS:
        return {"BLOCK_M": max(16, triton.next_power_of_2(M)), "BLOCK_N": 64 if M <= 16 else 16, "BLOCK_K": 256,
                "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128 if int4 else 64, "num_warps": 8, "num_stages": 3}


def _check(x: torch.Tensor | None, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
           group_size: int) -> tuple[int, int, bool]:
    """(N, K, int4) of a packed weight, its parameters checked against each other and x. Group-wise
    int8 (``group_size`` > 0) takes groups of 16 or more and mins optionally."""
    int4 = qweight.dtype == torch.uint8
    assert int4 or qweight.dtype in (torch.int8, torch.float8_e4m3fn), \
        f"packed weights are int8, float8_e4m3fn or uint8 (int4), got {qweight.dtype}"
    assert qweight.dim() == 2 and qweight.stride(1) == 1, "the packed weight must be row-major [N, K(/2)]"
    N = qweight.shape[0]
    K = qweight.shape[1] * 2 if int4 else qweight.shape[1]
    if int4:
        assert group_size in (32, 64, 128) and K % group_size == 0, f"int4: group {group_size} must divide K={K}"
        assert mins is not None and scales.shape == mins.shape == (N, K // group_size), \
            f"int4 scales/mins must be [{N}, {K // group_size}], got {tuple(scales.shape)}"
        assert scales.stride(1) == 1 and mins.stride() == scales.stride()
    elif group_size:
        assert group_size in (16, 32, 64, 128) and K % group_size == 0, f"int8: group {group_size} must divide K={K}"
        assert scales.shape == (N, K // group_size) and scales.stride(1) == 1, \
            f"group-wise int8 scales must be [{N}, {K // group_size}], got {tuple(scales.shape)}"
        assert mins is None or (mins.shape == scales.shape and mins.stride() == scales.stride())
    else:
        assert scales.shape == (N,) and scales.is_contiguous(), f"int8 scales must be [{N}], got {tuple(scales.shape)}"
    assert qweight.dtype != torch.float8_e4m3fn or not group_size, "e4m3 weights take one scale per row"
    if x is not None:
        assert x.dim() == 2 and x.shape[1] == K and x.stride(1) == 1, f"x must be [M, {K}] with unit column stride"
    return N, K, int4


def wq_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
          group_size: int = 0, bias: torch.Tensor | None = None, config: dict | None = None,
          pdl: bool = True, split: bool = True) -> torch.Tensor:
    """x [M, K] times the dequantized weight's transpose -> [M, N] in x's dtype. ``qweight``: int8
    [N, K] with ``scales`` [N] (``group_size`` 0) or [N, K/g] (and optional ``mins``), or uint8
    [N, K/2] (int4) with ``scales``/``mins`` [N, K/g];
    ``config``: the tile (None: ``default_config``, or ``wq_gemv``'s for one row of a format it
    takes; a config with ``KIND`` is ``wq_gemv``'s); ``pdl``: programmatic dependent launch
    where the GPU has it (one-row kernel); ``split``: K split over several programs where the
    tiles alone leave the GPU idle (``split_k``; a config's ``SPLIT_K`` overrides it)."""
    N, K, int4 = _check(x, qweight, scales, mins, group_size)
    M = x.shape[0]
    if bias is not None:
        assert bias.shape == (N,) and bias.is_contiguous()
    if M == 1 and (config is None or "KIND" in config) and wq_gemv.takes(qweight, group_size):
        return wq_gemv.wq_gemv(x, qweight, scales, mins, group_size, bias, N, K, int4, config, pdl)
    assert config is None or "KIND" not in config, \
        "a one-row config (KIND) takes one row of int8, int4 or FP8 in whole words; this product does not"
    if M == 0:
        return torch.empty(M, N, dtype=x.dtype, device=x.device)
    cfg = dict(config or default_config(M, N, K, int4))
    block_m, block_n, block_k = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    assert block_m == 1 or block_m >= 16, "BLOCK_M: 1 (the elementwise path) or a tl.dot tile of 16+"
    group = group_size or 1
    block_k = max(group, min(block_k, triton.next_power_of_2(K)))
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
    if block_m == 1:  # (one row of FP8 or a caller's tile: K in one part)
        cfg.pop("SPLIT_K", None)
        parts, k_tiles = 1, triton.cdiv(K, block_k)
    else:
        parts, k_tiles = _parts(cfg, grid[0] * grid[1], triton.cdiv(K, block_k), x, int4, split)
    y, out, bias_in = _outputs(x, M, N, parts, bias)
    fp8 = qweight.dtype == torch.float8_e4m3fn
    _wq_mm_kernel[(*grid, parts)](x, qweight.view(torch.uint8) if fp8 else qweight, scales,
                                  scales if mins is None else mins, bias_in if bias_in is not None else scales, out,
                                  M, N, K, k_tiles, x.stride(0), qweight.stride(0), scales.stride(0),
                                  out.stride(-2), out.stride(0) if parts > 1 else 0,
                                  INT4=int4, FP8=fp8, GROUPED=group_size > 0, HAS_MIN=mins is not None, GROUP=group,
                                  HAS_BIAS=bias_in is not None, EVEN_K=K % block_k == 0,
                                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                  PRECISION=dot_precision(x.dtype), **cfg)
    return _sum_parts(out, bias, y) if parts > 1 else y


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
               group_size: int = 0, dtype: torch.dtype = torch.bfloat16,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The packed weight as a [N, K] matrix of ``dtype`` (into ``out`` if given)."""
    N, K, int4 = _check(None, qweight, scales, mins, group_size)
    if out is None:
        out = torch.empty(N, K, dtype=dtype, device=qweight.device)
    assert out.shape == (N, K) and out.stride(1) == 1
    group = group_size or 1
    block_n, block_k = 32, max(group, min(256, triton.next_power_of_2(K)))
    grid = (triton.cdiv(N, block_n), triton.cdiv(K, block_k))
    fp8 = qweight.dtype == torch.float8_e4m3fn
    _dequant_kernel[grid](qweight.view(torch.uint8) if fp8 else qweight, scales, scales if mins is None else mins,
                          out, N, K, qweight.stride(0), scales.stride(0), out.stride(0), INT4=int4, FP8=fp8,
                          GROUPED=group_size > 0,
                          HAS_MIN=mins is not None, GROUP=group,
                          BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


def dequantize_ref(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
                   group_size: int = 0) -> torch.Tensor:
    """Plain PyTorch, float32: the formats' definitions."""
    if qweight.dtype in (torch.int8, torch.float8_e4m3fn) and not group_size:
        return qweight.float() * scales.float()[:, None]
    N = qweight.shape[0]
    q = qweight if qweight.dtype == torch.int8 else torch.stack((qweight & 15, qweight >> 4), dim=-1)
    q = q.reshape(N, -1, group_size).float() * scales.float()[..., None]
    return (q if mins is None else q + mins.float()[..., None]).view(N, -1)


def wq_mm_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None,
              group_size: int = 0, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize, then matmul, in float64."""
    w = dequantize_ref(qweight, scales, mins, group_size).double()
    return torch.nn.functional.linear(x.double(), w, None if bias is None else bias.double())

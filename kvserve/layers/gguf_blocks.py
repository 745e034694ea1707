"""GGUF's block formats, repacked at load into the layouts the quantized kernels read.

Every format kept packed is codes times a scale (plus a minimum) per group of input columns, so
it repacks without loss into one of two layouts of ``kernels/wq_gemm.py`` (same bits, regrouped):

    type  block (bytes)                            repacked (per row of K columns)
    Q4_0  32 w: d f16, 16 B of nibbles (18)        int4 g32: q in 0..15, scale d, min -8 d
    Q4_1  32 w: d, m f16, 16 B of nibbles (20)     int4 g32: scale d, min m
    Q4_K  256 w: d, dmin f16, 12 B of 6-bit        int4 g32: scale d * sc_j, min -(dmin * m_j)
          (sc, m) pairs, 128 B of nibbles (144)
    Q8_0  32 w: d f16, 32 int8 (34)                int8 g32: scale d
    Q6_K  256 w: 128 B low nibbles, 64 B high       int8 g16: q - 32 in -32..31, scale d * sc_j
          2-bit pairs, 16 int8 sc, d f16 (210)

Within a block GGUF puts column j in the low nibble and j + 16 (Q4_0/1; j + 32 within each 64
columns of Q4_K) in the high one; the repacked int4 rows put column 2j low and 2j + 1 high
(``rtn.pack_int4``). Scales and minimums are float32 products of the file's float16 values and
small integers, as ``gguf.quants.dequantize`` forms them, so ``q * scale + min`` is its value to
the bit; they are stored in float16 where that holds every one of them exactly.

A fused projection whose parts differ in type (``repack_parts``) takes the layout that holds
them all without loss: int4 g32 if every part is 4-bit, else group-wise int8 at the smallest
group (4-bit codes as int8: with Q6_K's groups of 16 and float32 scales and mins, about 12 bits a
weight for a Q4_K part, against 4.5 in the file and 16 dequantized to bfloat16).

Bytes per weight against the file: Q4_0/Q4_1 and Q8_0 the same or less (4 + 32/32, 8 + 16/32
bits), Q4_K 6 bits instead of 4.5 and Q6_K 10 instead of 6.6 where the scales need float32.
"""
from __future__ import annotations

import torch

from kvserve.layers.rtn import pack_int4

# type name -> (columns per block, bytes per block, repacked codes: "int4" | "int8", group)
FORMATS = {"Q4_0": (32, 18, "int4", 32), "Q4_1": (32, 20, "int4", 32), "Q4_K": (256, 144, "int4", 32),
           "Q8_0": (32, 34, "int8", 32), "Q6_K": (256, 210, "int8", 16)}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per block [B, 2] -> their float16 value as float32 [B, 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(b: torch.Tensor, run: int) -> torch.Tensor:
    """Bytes [B, n] whose low nibbles are ``run`` columns and high nibbles the next ``run``, run
    after run -> codes [B, 2n] in column order."""
    b = b.reshape(b.shape[0], -1, 1, run)
    return torch.cat((b & 15, b >> 4), dim=2).reshape(b.shape[0], -1)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, [B, 8] each:
    bytes 0-3 hold sc 0-3 (low 6 bits), 4-7 m 0-3; 8-11 hold sc 4-7 (low nibble) and m 4-7
    (high nibble), whose top two bits are the top bits of bytes 0-3 and 4-7."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=1)
    return sc.float(), mn.float()


def unpack(raw: torch.Tensor, qtype: str, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """A GGUF tensor's rows [N, bytes per row] (uint8) -> (codes [N, K]: uint8 0..15 for int4,
    int8 otherwise; scales [N, K/g] float32; mins [N, K/g] float32 or None; g)."""
    cols, nbytes, _, group = FORMATS[qtype]
    N = raw.shape[0]
    if K % cols or raw.shape[1] != K // cols * nbytes:
        raise ValueError(f"{qtype} rows of {K} columns take {K // cols * nbytes} bytes, got {raw.shape[1]}")
    b = raw.reshape(-1, nbytes)  # one block per row
    mins = None
    if qtype == "Q4_0":
        d = _f16(b[:, 0:2])
        codes, scales, mins = _nibbles(b[:, 2:], 16), d, -8 * d
    elif qtype == "Q4_1":
        codes, scales, mins = _nibbles(b[:, 4:], 16), _f16(b[:, 0:2]), _f16(b[:, 2:4])
    elif qtype == "Q8_0":
        codes, scales = b[:, 2:].contiguous().view(torch.int8), _f16(b[:, 0:2])
    elif qtype == "Q4_K":
        sc, mn = _k_scale_min(b[:, 4:16])
        codes, scales, mins = _nibbles(b[:, 16:], 32), _f16(b[:, 0:2]) * sc, -(_f16(b[:, 2:4]) * mn)
    else:  # Q6_K: of each 128 columns, ql's 64 bytes give 0-31 / 64-95 (low / high nibbles of the
        # first 32 bytes) and 32-63 / 96-127 (of the next 32); qh's 32 bytes, the top 2 bits
        # of 0-31, 32-63, 64-95, 96-127 in bit pairs 0, 2, 4, 6.
        ql = b[:, :128].reshape(-1, 2, 1, 64)
        ql = torch.cat((ql & 15, ql >> 4), dim=2).reshape(-1, 2, 4, 32)
        qh = b[:, 128:192].reshape(-1, 2, 1, 32)
        qh = torch.cat([(qh >> s) & 3 for s in (0, 2, 4, 6)], dim=2)
        codes = ((ql | (qh << 4)).to(torch.int16) - 32).to(torch.int8).reshape(-1, 256)
        scales = _f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()
    groups = K // group
    scales = scales.reshape(N, groups)
    mins = None if mins is None else mins.reshape(N, groups)
    return codes.reshape(N, K), scales, mins, group


def compact(t: torch.Tensor | None, *others: torch.Tensor | None) -> list[torch.Tensor | None]:
    """``t`` and ``others`` in float16 if float16 holds every value of all of them exactly, else
    float32."""
    ts = [x for x in (t, *others) if x is not None]
    exact = all(bool(torch.equal(x.half().float(), x)) for x in ts)
    return [None if x is None else (x.half() if exact else x.float()) for x in (t, *others)]


def repack(raw: torch.Tensor, qtype: str, K: int, cpu: bool
           ) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """(method, qweight, scales, mins, group) of ``QuantLinear`` for a GGUF tensor's rows. The CPU
    kernels take float32 parameters; CUDA ones the narrowest exact dtype."""
    codes, scales, mins, group = unpack(raw, qtype, K)
    method = FORMATS[qtype][2]
    if not cpu:
        scales, mins = compact(scales, mins)
    return method, (pack_int4(codes) if method == "int4" else codes), scales, mins, group


def repack_parts(parts: list[tuple[str, torch.Tensor]], K: int, cpu: bool
                 ) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """``repack`` for a fused projection whose parts (rows stacked in order) are of different
    types, as llama.cpp's mixes store them (e.g. Q4_K q and k with a Q6_K v). Without loss: every
    4-bit format repacks to int4 groups of 32, so 4-bit parts stay int4; with an 8-bit part the
    whole projection becomes group-wise int8 at the smallest group of its parts, the 4-bit codes
    (0..15) kept as int8 and each part's scales and mins repeated over the finer groups (a part
    without mins gets zeros when another has them)."""
    unpacked = [unpack(raw, qtype, K) for qtype, raw in parts]
    if all(FORMATS[qtype][2] == "int4" for qtype, _ in parts):
        method, group = "int4", 32
        codes = torch.cat([c for c, _, _, _ in unpacked])
        scales = torch.cat([sc for _, sc, _, _ in unpacked])
        mins = torch.cat([m for _, _, m, _ in unpacked])
    else:
        method, group = "int8", min(g for _, _, _, g in unpacked)
        has_min = any(m is not None for _, _, m, _ in unpacked)
        codes, scales, mins = [], [], []
        for c, sc, m, g in unpacked:
            codes.append(c.to(torch.int8))
            scales.append(sc.repeat_interleave(g // group, dim=1))
            if has_min:
                mins.append(torch.zeros_like(scales[-1]) if m is None else m.repeat_interleave(g // group, dim=1))
        codes, scales = torch.cat(codes), torch.cat(scales)
        mins = torch.cat(mins) if has_min else None
    if not cpu:
        scales, mins = compact(scales, mins)
    return method, (pack_int4(codes) if method == "int4" else codes), scales, mins, group

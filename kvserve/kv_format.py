"""KV-cache formats: what one KV block holds, byte by byte, and the plain-PyTorch
reference of quantizing into it and reading back out of it.

``auto`` keeps K and V in the model dtype (the uncompressed layout of ``KVCache``). Every other
format stores a block as one run of bytes per layer::

    [ K codes | V codes | K scales | V scales ]

* ``fp8``  - e4m3 codes, one fp16 scale per (token, head, group of ``group`` channels), symmetric.
* ``int8`` - int8 codes in [-127, 127], the same per-(token, head, group) fp16 scale.

  The 8-bit formats store V codes channel-major, ``[kvh, D, block_size]`` (K codes token-major,
  ``[block_size, kvh, D]``): the attention kernels' second product then finds a channel's codes
  for a tile of tokens contiguous, as its first product does a token's (``KVFormat.views`` hides
  the difference). Per-token scales (all formats) are stored head-major, ``[kvh, block_size, G]``:
  a tile's scales for one head are contiguous.
* ``int4`` / ``int2`` - KIVI (Liu et al., 2024): keys per *channel*, values per *token*. Values are
  quantized as they are written: per (token, head, group) an fp16 (scale, min) pair, codes packed
  two (int4) or four (int2) to a byte. Keys have outlier channels, so a key block is quantized
  channel by channel over its ``block_size`` tokens, with one (scale, min) pair per (head, channel)
  - which is only possible once the block is full. Until then a sequence's newest keys live in
  full precision in a small per-sequence *residual* buffer (one block of keys per running
  sequence), and the block is sealed (quantized) by the step that fills it. KIVI codes (K and V)
  are stored head-major, ``[kvh, block_size, D // per]``: a head's row of int4 codes is 64 bytes,
  half a 128-byte line, so token-major rows would share each line with another head's program;
  head-major, a tile of one head is one run.

The codes of channel ``d`` sit in byte ``d // per`` at bit ``(d % per) * bits`` (``per = 8 //
bits``). Dequantization is ``code * scale`` (symmetric) or ``code * scale + min`` (asymmetric).

**Rotated keys** (fp8 and int8, ``KVFormat.rotate_keys``): after RoPE, queries
and keys are both turned by the orthonormal Hadamard matrix of the head size (``hadamard``), so
q . k is unchanged and the cache holds the turned keys. A few channels of real keys and queries
are large together, and an 8-bit error in such a channel weighs on every score; turned, each
channel is a mix of all of them and the error spreads evenly. Values are not turned: their
error's weight does not depend on the basis.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.errors import ConfigError

KV_DTYPES = ("auto", "fp8", "int8", "int4", "int2")
_BITS = {"fp8": 8, "int8": 8, "int4": 4, "int2": 2}
FP8_MAX = 448.0  # e4m3fn
INT8_MAX = 127.0
SCALE_DTYPE = torch.float16
MIN_SCALE = 1e-6  # smallest scale stored: a group of zeros quantizes to codes 0 with a finite scale


def default_group(kv_dtype: str, head_dim: int) -> int:
    """Channels per scale along the head dimension when the user gives none: the whole head,
    one scale (KIVI: scale and min) per token and head. Smaller groups trade capacity for
    accuracy (``--kv-group-size``)."""
    return head_dim


def default_block_size(kv_dtype: str) -> int:
    """KIVI's key groups are the blocks: 64 tokens keeps the per-channel (scale, min) pairs at
    1/16 of the codes. The 8-bit formats' attention tiles lie in one block (channel-major value
    codes), so their blocks are 64 tokens too. Uncompressed caches use the engine's usual 16."""
    return 16 if kv_dtype == "auto" else 64


@dataclass(frozen=True)
class KVFormat:
    name: str  # one of KV_DTYPES
    num_kv_heads: int
    head_dim: int
    block_size: int
    model_dtype: torch.dtype
    group: int = 0  # channels per scale (values; keys too for 8-bit); 0: default_group
    # fp8/int8 with calibrated scales (kvserve/calibrate.py): one per layer and KV head, none stored
    static: bool = False

    def __post_init__(self):
        if self.name not in KV_DTYPES:
            raise ConfigError("kv_cache_dtype", f"must be one of {', '.join(KV_DTYPES)}; got {self.name!r}")
        if self.group == 0:
            object.__setattr__(self, "group", default_group(self.name, self.head_dim))
        if not self.quantized:
            return
        if self.static:
            if self.kivi:
                raise ConfigError("kv_scales", f"calibrated scales apply to fp8 and int8; {self.name} keeps its "
                                  f"scales per block (use kv_scales='off')")
            object.__setattr__(self, "group", self.head_dim)
        if self.block_size < 16:  # KIVI: keys per channel over a block; all: a kernel tile in one block
            raise ConfigError("block_size", f"{self.name} needs block_size >= 16 (default 64), got {self.block_size}")
        if self.head_dim & (self.head_dim - 1):
            raise ConfigError("kv_cache_dtype", f"{self.name} needs a power-of-two head size, the model has "
                              f"{self.head_dim}; use auto")
        g = self.group
        if g < self.per or self.head_dim % g or g & (g - 1):
            raise ConfigError("kv_group_size", f"must be a power of two that divides the head size "
                              f"{self.head_dim} and is >= {self.per} for {self.name}; got {g}")

    # -- shape of the formats ----------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    @property
    def kivi(self) -> bool:
        return self.name in ("int4", "int2")

    @property
    def bits(self) -> int:
        return _BITS.get(self.name, 8 * self.model_dtype.itemsize)

    @property
    def per(self) -> int:  # codes per byte
        return max(1, 8 // self.bits)

    @property
    def code_dtype(self) -> torch.dtype:
        return {"fp8": torch.float8_e4m3fn, "int8": torch.int8}.get(self.name, torch.uint8)

    @property
    def rotate_keys(self) -> bool:
        """Keys stored turned by a Hadamard matrix, queries turned to match (module docstring):
        the 8-bit formats, calibrated ones too (``kvserve calibrate-kv`` measures turned keys)."""
        return self.quantized and not self.kivi

    @property
    def layout(self) -> str:
        """Names a byte layout that changed, for keys of blocks that outlive the process (KV
        tiers: a chunk written in another layout must not be found): "vT" values channel-major,
        "h" keys turned (the 8-bit formats), "sH" per-token scales head-major in the block (every
        format that stores them), "cH" codes head-major (KIVI); "" for the original layout (bf16)."""
        if not self.quantized:
            return ""
        if self.kivi:
            return "sH+cH"
        return "vT+h" if self.static else "vT+h+sH"

    @property
    def num_groups(self) -> int:
        return self.head_dim // self.group

    @property
    def code_bytes(self) -> int:  # K or V codes of one block
        return self.block_size * self.num_kv_heads * self.head_dim // self.per

    @property
    def k_scale_elems(self) -> int:  # fp16 elements of K scales per block
        if self.static:
            return 0
        if self.kivi:
            return self.num_kv_heads * self.head_dim * 2
        return self.block_size * self.num_kv_heads * self.num_groups

    @property
    def v_scale_elems(self) -> int:
        if self.static:
            return 0
        return self.block_size * self.num_kv_heads * self.num_groups * (2 if self.kivi else 1)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer, K and V with their scales (rounded up to 16)."""
        if not self.quantized:
            return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.model_dtype.itemsize
        n = 2 * self.code_bytes + 2 * (self.k_scale_elems + self.v_scale_elems)
        return -(-n // 16) * 16

    def residual_bytes(self, num_slots: int) -> int:
        """Full-precision key buffer of ``num_slots`` sequences, per layer (KIVI only)."""
        if not self.kivi:
            return 0
        return num_slots * self.block_size * self.num_kv_heads * self.head_dim * self.model_dtype.itemsize

    def describe(self) -> str:
        if not self.quantized:
            return f"{self.model_dtype} (uncompressed)"
        if self.kivi:
            return (f"{self.name}: keys per channel over {self.block_size}-token blocks, values per token in "
                    f"groups of {self.group}, fp16 scale+min")
        if self.static:
            return f"{self.name}: calibrated scales per layer and KV head"
        return f"{self.name}: per token, groups of {self.group} channels, fp16 scale"

    # -- views of one layer's bytes ---------------------------------------------------------
    def views(self, layer: torch.Tensor, residual: torch.Tensor | None = None,
              scales: torch.Tensor | None = None) -> KVViews:
        """``layer``: [num_blocks, block_bytes] uint8; ``residual``: this layer's KIVI key buffer
        [slots, block_size, kvh, D]; ``scales``: calibrated [2, kvh] float32 (static formats).
        Returns typed views of the parts."""
        nb = layer.shape[0]
        bs, kvh, D = self.block_size, self.num_kv_heads, self.head_dim
        dp = D // self.per
        cb = self.code_bytes
        if self.kivi:  # codes head-major: [nb, kvh, bs, dp] bytes, seen as [nb, bs, kvh, dp]
            kc = layer[:, :cb].view(self.code_dtype).view(nb, kvh, bs, dp).permute(0, 2, 1, 3)
            vc = layer[:, cb:2 * cb].view(self.code_dtype).view(nb, kvh, bs, dp).permute(0, 2, 1, 3)
        else:  # 8-bit: keys token-major; values channel-major, [nb, kvh, D, bs] bytes, seen as [nb, bs, kvh, D]
            kc = layer[:, :cb].view(self.code_dtype).view(nb, bs, kvh, dp)
            vc = layer[:, cb:2 * cb].view(self.code_dtype).view(nb, kvh, D, bs).permute(0, 3, 1, 2)
        ks_end = 2 * cb + 2 * self.k_scale_elems
        ks = layer[:, 2 * cb:ks_end].view(SCALE_DTYPE)
        vs = layer[:, ks_end:ks_end + 2 * self.v_scale_elems].view(SCALE_DTYPE)
        if self.static:
            ks, vs = scales[0], scales[1]
        elif self.kivi:
            ks = ks.view(nb, kvh, D, 2)
            vs = vs.view(nb, kvh, bs, self.num_groups, 2).permute(0, 2, 1, 3, 4)
        else:
            ks = ks.view(nb, kvh, bs, self.num_groups).permute(0, 2, 1, 3)
            vs = vs.view(nb, kvh, bs, self.num_groups).permute(0, 2, 1, 3)
        return KVViews(self, kc, vc, ks, vs, residual)


@dataclass
class KVViews:
    """One layer of a compressed cache, as the attention backends receive it."""
    fmt: KVFormat
    k_codes: torch.Tensor  # [nb, bs, kvh, D // per]
    v_codes: torch.Tensor
    k_scales: torch.Tensor  # 8-bit: [nb, bs, kvh, G]; KIVI: [nb, kvh, D, 2]
    v_scales: torch.Tensor  # 8-bit: [nb, bs, kvh, G]; KIVI: [nb, bs, kvh, G, 2]
    residual: torch.Tensor | None = None  # KIVI: [slots, bs, kvh, D] newest keys, model dtype


# -- plain-PyTorch quantization (reference for the kernels, and the CPU path) ------------------
def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x times the orthonormal Hadamard matrix (Sylvester's, symmetric, its own inverse) along the
    last dimension (a power of two), in float32: the fast transform's butterflies, stride 1 first,
    then the 1/sqrt(D) - the order the write kernel adds in, so both round alike."""
    D = x.shape[-1]
    x = x.float()
    s = 1
    while s < D:
        y = x.reshape(*x.shape[:-1], D // (2 * s), 2, s)
        a, b = y[..., 0, :], y[..., 1, :]
        x = torch.stack((a + b, a - b), -2).reshape(*x.shape[:-1], D)
        s *= 2
    return x * (1.0 / math.sqrt(D))


def rotate_qk(x: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """Queries or keys (after RoPE) in the basis the cache stores keys in (``rotate_keys``)."""
    return hadamard(x).to(x.dtype) if fmt.rotate_keys else x


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [..., D] integers in [0, 2^bits); returns [..., D // per] uint8."""
    per = 8 // bits
    c = codes.to(torch.int32).view(*codes.shape[:-1], codes.shape[-1] // per, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    c = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return c.view(*packed.shape[:-1], packed.shape[-1] * per)


def quantize_sym(x: torch.Tensor, fmt: KVFormat,
                 static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., kvh, D] -> (codes [..., D] in fmt.code_dtype, scales [..., G] fp16) for fp8/int8;
    with ``static`` ([kvh] float32 calibrated scales) those are used and returned instead."""
    g = x.float().view(*x.shape[:-1], fmt.num_groups, fmt.group)
    qmax = FP8_MAX if fmt.name == "fp8" else INT8_MAX
    if static is not None:
        scale = static.view(-1, 1)  # [kvh, 1], broadcast over the (single) group
    else:
        amax = g.abs().amax(-1)
        # a tensor divisor: PyTorch divides by a Python scalar as a multiply by its reciprocal on
        # CUDA, one ulp off the kernels' correctly rounded division
        scale = (amax / torch.full_like(amax, qmax)).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
    # NaN to 0, +-inf to +-qmax, as the write kernel does: no NaN code ever enters a block (the
    # attention kernels read the stale codes past a sequence's end, times a zero weight)
    y = torch.nan_to_num(g / scale.float()[..., None], nan=0.0).clamp(-qmax, qmax)
    if fmt.name == "fp8":
        codes = y.to(torch.float8_e4m3fn)
    else:
        codes = torch.floor(y + 0.5).to(torch.int8)
    return codes.view(*x.shape), scale


def codes_float(codes: torch.Tensor) -> torch.Tensor:
    """Symmetric codes as float32. e4m3 on the CPU by its bits: PyTorch converts float8 there one
    element at a time (about 5 ns a code on an AVX2 core); the code's exponent and mantissa moved
    under float16's read as its value times 2^-8 (bias 15 instead of 7, subnormals alike), a
    handful of vectorized integer operations (about 1 ns), exact. e4m3fn's NaN (S.1111.111)
    reads as +-480, past its largest finite value (448): looked for in one pass, made NaN again."""
    if codes.dtype != torch.float8_e4m3fn or codes.device.type != "cpu":
        return codes.float()
    b = codes.view(torch.uint8).to(torch.int16)
    h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
    x = h.view(torch.float16).float().mul_(256.0)
    if x.numel():
        lo, hi = torch.aminmax(x)
        if hi > 448 or lo < -448:
            x.masked_fill_(x.abs() == 480, float("nan"))
    return x


def dequantize_sym(codes: torch.Tensor, scales: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    c = codes_float(codes).view(*codes.shape[:-1], fmt.num_groups, fmt.group)
    if fmt.static:  # [kvh] per layer
        return c.view(codes.shape) * scales.float().view(-1, 1)
    return (c * scales.float()[..., None]).view(codes.shape)


def quantize_asym(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric ``bits``-bit codes of x with a (scale, min) pair per slice reduced over ``dim``.
    Returns (codes, same shape as x, int32; params with ``dim`` reduced to size 1 and a trailing
    axis of 2, fp16)."""
    x = x.float()
    mn = x.amin(dim, keepdim=True).to(SCALE_DTYPE)
    mx = x.amax(dim, keepdim=True)
    span = mx - mn.float()
    scale = (span / torch.full_like(span, (1 << bits) - 1)).clamp_min(MIN_SCALE).to(SCALE_DTYPE)
    codes = torch.floor((x - mn.float()) / scale.float() + 0.5).clamp(0, (1 << bits) - 1).to(torch.int32)
    return codes, torch.stack((scale, mn), -1)


def quantize_values_kivi(v: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """v: [..., D] -> (packed [..., D // per] uint8, params [..., G, 2] fp16), per token group."""
    g = v.view(*v.shape[:-1], fmt.num_groups, fmt.group)
    codes, params = quantize_asym(g, fmt.bits, -1)
    return _pack(codes.view(v.shape), fmt.bits), params.squeeze(-2)


def dequantize_values_kivi(packed: torch.Tensor, params: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    c = _unpack(packed, fmt.bits).float()
    c = c.view(*c.shape[:-1], fmt.num_groups, fmt.group)
    p = params.float()
    return (c * p[..., 0:1] + p[..., 1:2]).view(*c.shape[:-2], fmt.head_dim)


def quantize_keys_kivi(k: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """k: [block_size, kvh, D] (one full block) -> (packed [bs, kvh, D // per] uint8, params
    [kvh, D, 2] fp16), per channel over the block's tokens."""
    codes, params = quantize_asym(k, fmt.bits, 0)
    return _pack(codes, fmt.bits), params.squeeze(0)


def dequantize_keys_kivi(packed: torch.Tensor, params: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
    """packed: [..., bs, kvh, D // per], params [..., kvh, D, 2] -> [..., bs, kvh, D] float32."""
    c = _unpack(packed, fmt.bits).float()
    p = params.float().unsqueeze(-4)
    return c * p[..., 0] + p[..., 1]


def dequantize_blocks(views: KVViews, blocks: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``blocks`` ([n] block ids) as float32 [n, bs, kvh, D] (KIVI keys of a block that
    is not sealed yet come out as garbage: callers take those from the residual)."""
    kc, vc = views.k_codes[blocks], views.v_codes[blocks]
    if fmt.static:
        return dequantize_sym(kc, views.k_scales, fmt), dequantize_sym(vc, views.v_scales, fmt)
    ks, vs = views.k_scales[blocks], views.v_scales[blocks]
    if fmt.kivi:
        return dequantize_keys_kivi(kc, ks, fmt), dequantize_values_kivi(vc, vs, fmt)
    return dequantize_sym(kc, ks, fmt), dequantize_sym(vc, vs, fmt)


# -- the reference cache path: write a step's K/V, read a sequence's K/V ------------------------
def write_tokens(views: KVViews, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantize rotated keys (8-bit formats) and values at their slots (< 0: padding, skipped).
    KIVI keys go through ``write_keys_kivi`` instead."""
    f = views.fmt
    keep = slots >= 0
    slots, k, v = slots[keep], k[keep], v[keep]
    blk, off = slots // f.block_size, slots % f.block_size
    if f.kivi:
        codes, params = quantize_values_kivi(v, f)
        views.v_codes[blk, off] = codes
        views.v_scales[blk, off] = params
        return
    for x, c, s in ((k, views.k_codes, views.k_scales), (v, views.v_codes, views.v_scales)):
        codes, scales = quantize_sym(x, f, s if f.static else None)
        c[blk, off] = codes
        if not f.static:
            s[blk, off] = scales


def write_keys_kivi(views: KVViews, k: torch.Tensor, q_start: int, q_len: int, seq_len: int,
                    table: torch.Tensor, res_slot: int) -> None:
    """One sequence's rotated keys of this step (``k[q_start:q_start + q_len]``): seal every block
    they fill, per channel (earlier keys of the first one come from the residual), and stash the
    rest - the unsealed last block - in the residual row."""
    f = views.fmt
    bs = f.block_size
    new = k[q_start:q_start + q_len]
    res = views.residual[res_slot]
    ctx = seq_len - q_len
    full = seq_len // bs
    first = ctx // bs
    if full > first:  # seal blocks first..full-1, all at once
        lo = first * bs
        old = res[:ctx - lo].to(new.dtype)
        keys = torch.cat((old, new[:full * bs - ctx]), 0).view(full - first, bs, *new.shape[1:])
        codes, params = quantize_asym(keys, f.bits, 1)
        blks = table[first:full].long()
        views.k_codes[blks] = _pack(codes, f.bits)
        views.k_scales[blks] = params.squeeze(1)
    tail = max(full * bs, ctx)
    if seq_len > tail:
        res[tail - full * bs:seq_len - full * bs] = new[tail - ctx:].to(res.dtype)


def read_kv(views: KVViews, table: torch.Tensor, seq_len: int, res_slot: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """A sequence's K and V as float32 [seq_len, kvh, D], dequantized from its blocks only (KIVI:
    the unsealed last block's keys from the residual row)."""
    return next(read_kv_many(views, [table], [seq_len], [res_slot]))


# Sequences dequantized together: blocks of at most this many tokens at once (float32 K and V
# of 16,384 tokens of 8 KV heads of 128: 128 MiB).
READ_TOKENS = 16384


def read_kv_many(views: KVViews, tables: list[torch.Tensor], seq_lens: list[int], res_slots: list[int]):
    """``read_kv`` of each sequence in turn, a generator: the blocks of consecutive sequences are
    gathered and dequantized in one call (up to ``READ_TOKENS`` tokens), which on a decode step
    of many short sequences is most of the work's Python and launch cost."""
    f = views.fmt
    bs = f.block_size
    counts = [-(-L // bs) for L in seq_lens]  # each sequence's blocks
    i = 0
    while i < len(tables):
        j, tokens = i + 1, counts[i] * bs
        while j < len(tables) and tokens + counts[j] * bs <= READ_TOKENS:
            tokens += counts[j] * bs
            j += 1
        blocks = torch.cat([tables[s][:counts[s]] for s in range(i, j)]).long()
        k, v = dequantize_blocks(views, blocks, f)
        kvh, D = k.shape[2], k.shape[3]
        b0 = 0
        for s in range(i, j):
            L, n = seq_lens[s], counts[s]
            ks, vs = k[b0:b0 + n].reshape(-1, kvh, D)[:L], v[b0:b0 + n].reshape(-1, kvh, D)[:L]
            b0 += n
            full = L // bs * bs
            if f.kivi and L > full:
                ks = ks.clone()
                ks[full:] = views.residual[res_slots[s], :L - full].float()
            yield ks, vs
        i = j

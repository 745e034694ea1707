"""Weight-only quantized linear layers: the weights stay packed (int8 or int4, ``rtn.py``; GGUF's
blocks repacked as either, ``gguf_blocks.py``) on every device and are dequantized inside the
product, never to a whole matrix at rest.

    CUDA  the kernels of ``kernels/wq_gemm.py``, picked per product by the rows of x and the
          step's ``KernelConfig``:
              one row (int8, int4)               ``kernels/wq_gemv.py``, codes decoded by integer ops
              rows <= wq_skinny_max_rows         skinny kernel, dequantized in registers
              rows <  wq_dequant_min_rows        tiled GEMM, dequantized in registers
              rows <= wq_weight_left_max_rows    the GEMM that decodes the weight into the
                                                 tensor cores' left operand (K and the group
                                                 in steps of 128)
              otherwise                          dequantize to x's dtype, then cuBLAS
              wq_s8_min_rows..wq_s8_max_rows     (min 0: off; checked first, never one row) int8
                                                 per channel on the integer tensor cores, x
                                                 split in two int8 halves (``kernels/wq_s8.py``)
          int4 in groups of 128 or more skips the tiled GEMM: the skinny kernel up to
          ``wq_int4_skinny_max_rows``, then the weight-left GEMM. The skinny, tiled and
          weight-left products split K over programs where their tiles alone leave the GPU
          idle (``KernelConfig.wq_split_k``, ``wq_gemm.split_k``). (At large batches a product
          is bound by compute, and cuBLAS's bf16 GEMM beats a Triton GEMM that unpacks; the
          extra pass over the weight is small beside it.)
    CPU   PyTorch's packed CPU kernels: ``_weight_int8pack_mm`` (int8 [N, K], scale [N]) and
          ``_weight_int4pack_mm_for_cpu`` (its own int4 layout, converted once at load, with
          [K/g, N, 2] (scale, zero) pairs where zero = min + 8 * scale, as it computes
          (q - 8) * scale + zero); from ``_CPU_DEQUANT_MIN_ROWS`` rows on (prefill), the int4
          weight dequantized to x's dtype and one matmul where this module reads PyTorch's
          layout (``_CPU_INT4_LAYOUTS``: it follows the CPU's vector width). Both kernels are
          vectorized for bfloat16 only: in float32 (the CPU's reference mode, and its dtype
          where bfloat16 is not native) they run scalar code, 2.5x (int8) to 20x (int4) a
          dequantized product's time at one row and growing with the rows, so there int8
          takes the tiles below and int4 is dequantized from 2 rows on. int8 by tiles
          (group-wise: GGUF's Q8_0, Q6_K, fused projections of mixed GGUF types, which neither
          kernel takes; per channel in float32): ``_CPU_TILE_ROWS`` rows of codes at a time
          converted to x's dtype, so no whole float matrix exists.

``quantize_model`` replaces the decoder layers' projections (q/k/v, o, gate/up, down) with these
(or with ``fp8_linear.Fp8Linear``) at load, and the output head with an int8 one where
``QuantConfig.head`` asks (a head tied to the embedding gets its own quantized copy: the lookups
keep reading the embedding in the model's dtype).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels
from kvserve.config import INT4_GROUP_SIZES, KernelConfig, QuantConfig
from kvserve.errors import ConfigError
from kvserve.layers.forward_context import kernel_config
from kvserve.layers.linear import Linear, unpack_cpu_weights
from kvserve.layers.rtn import quantize_int4, quantize_int8

_CPU_INT4_INNER_K_TILES = 2  # the CPU int4 layout's inner tiling (2, 4 or 8: the same numbers)
_CPU_TILE_ROWS = 512  # rows of an int8 weight converted at a time on the CPU (``_cpu_int8_tiles``)
# From this many rows of x on (a prefill chunk), an int4 product on the CPU dequantizes the weight
# to x's dtype and multiplies once: PyTorch's int4 kernel is bound by its unpacking, its time
# grows with the rows at about 2.5x a bfloat16 GEMM's, and the dequantization (a few passes over
# the weight) is repaid from a few hundred rows on. In float32 (any dtype but bfloat16) the kernel
# runs scalar code, slower than the dequantization from two rows on.
_CPU_DEQUANT_MIN_ROWS = 512
_CPU_FLOAT32_DEQUANT_MIN_ROWS = 2


def cuda_product(rows: int, kernel: KernelConfig, int4: bool, wide: bool, s8: bool = False) -> str:
    """Which CUDA product a weight-only layer takes for ``rows`` rows of x (the module's table):
    "skinny", "tiled", "weight-left", "s8" or "dequant". ``wide``: the weight-left GEMM's column
    step divides the layer's K and group; ``s8``: the integer tensor-core product takes the weight."""
    if s8 and kernel.wq_s8_min_rows and kernel.wq_s8_min_rows <= rows <= kernel.wq_s8_max_rows:
        return "s8"
    if int4 and wide:  # no tiled GEMM
        if rows <= kernel.wq_int4_skinny_max_rows:
            return "skinny"
    elif rows < kernel.wq_dequant_min_rows:
        return "skinny" if rows <= kernel.wq_skinny_max_rows else "tiled"
    return "weight-left" if wide and rows <= kernel.wq_weight_left_max_rows else "dequant"


# PyTorch's CPU int4 layouts (``_convert_weight_to_int4pack_for_cpu``), which follow the vector
# width its kernels were dispatched for, as rows per block of output rows:
#   "avx512" 64: for each 64 rows, [K/2, 64] bytes; byte (k // 2, n % 32 + 32 * (k % 2)) holds row
#                n's code k, in its low nibble for n % 64 < 32, else in its high one.
#   "avx2"   32: for each 32 rows, [K, 16] bytes; byte (k, n % 16) holds row n's code k, in its
#                low nibble for n % 32 < 16, else in its high one.
#   "scalar" 32: for each 32 rows, [K, 16] bytes; byte (k, (n % 32) // 2) holds row n's code k,
#                in its low nibble for even n, else in its high one.
_CPU_INT4_LAYOUTS = {"avx512": 64, "avx2": 32, "scalar": 32}


def _cpu_int4_codes(packed: torch.Tensor, N: int, K: int, layout: str) -> torch.Tensor:
    """The codes [N, K] (uint8) packed in ``layout`` (``_CPU_INT4_LAYOUTS``)."""
    if layout == "avx512":
        b = packed.view(N // 64, K // 2, 64)
        lo, hi = b & 15, b >> 4
        even = torch.cat((lo[..., :32], hi[..., :32]), dim=-1)  # codes 2j of the 64 rows
        odd = torch.cat((lo[..., 32:], hi[..., 32:]), dim=-1)
        return torch.stack((even, odd), dim=2).view(N // 64, K, 64).transpose(1, 2).reshape(N, K)
    b = packed.view(N // 32, K, 16)
    if layout == "avx2":
        q = torch.cat((b & 15, b >> 4), dim=-1)
    else:
        q = torch.stack((b & 15, b >> 4), dim=-1).view(N // 32, K, 32)
    return q.transpose(1, 2).reshape(N, K)


@functools.cache
def _cpu_int4_layout() -> str | None:
    """The layout this process's PyTorch packs int4 weights in for the CPU, found by packing
    random codes and reading them back with each known one; None where none reads them back (the
    int4 kernel then takes every product)."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 256), generator=g, dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _CPU_INT4_INNER_K_TILES)
    for layout in _CPU_INT4_LAYOUTS:
        try:
            if torch.equal(_cpu_int4_codes(packed, 64, 256, layout).int(), codes):
                return layout
        except RuntimeError:  # (not that layout's size)
            pass
    return None


class QuantLinear(nn.Module):
    """``x @ dequant(W).T + bias`` with W packed for its device (see the module's docstring)."""

    def __init__(self, method: str, in_features: int, out_features: int, group_size: int,
                 qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 bias: torch.Tensor | None, fmt: str | None = None, perm: torch.Tensor | None = None):
        super().__init__()
        self.method, self.in_features, self.out_features = method, in_features, out_features
        self.group_size = group_size  # int8: 0 per output channel, else group-wise
        self.fmt = fmt or method  # what the weights came as, e.g. "gguf Q4_K"
        self.cpu = qweight.device.type == "cpu"
        self._cpu_layout: str | None = None  # a CPU int4 weight's, where this module reads it
        if self.cpu and method == "int4":
            codes = torch.stack((qweight & 15, qweight >> 4), dim=-1).view(out_features, in_features)
            qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32),
                                                                         _CPU_INT4_INNER_K_TILES)
            layout = _cpu_int4_layout()
            if layout and out_features % _CPU_INT4_LAYOUTS[layout] == 0:
                self._cpu_layout = layout  # (else the prefill products stay in PyTorch's kernel)
            # (q - 8) * s + (min + 8 s): equal to q * s + min up to float32 rounding
            scales = torch.stack((scales, mins + 8 * scales), dim=-1).transpose(0, 1).contiguous()
            mins = None
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        # GPTQ's act-order: the input columns in the order the packed weight holds them
        self.register_buffer("perm", perm)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.tp = None  # a row-parallel layer's group: the products are summed over its ranks
        # Many-row products may take the integer tensor cores where the rule sends the weight
        # there (``_s8``); False for the int8 output head, whose shape was not measured there.
        self.s8_products = True
        # The scales in x's dtype, the key they were converted under, and that dtype: see _scales_as
        self._cast: torch.Tensor | None = None
        self._cast_key: tuple | None = None
        self._cast_dtype: torch.dtype | None = None

    @classmethod
    def from_linear(cls, layer: nn.Linear, quant: QuantConfig) -> QuantLinear:
        """``layer``'s weight quantized by round-to-nearest, on its device, in its dtype."""
        w = layer.weight.detach()
        N, K = w.shape
        if quant.method == "int8":
            q, s = quantize_int8(w, w.dtype)
            out = cls("int8", K, N, 0, q, s, None, layer.bias)
        else:
            q, s, m = quantize_int4(w, quant.group_size, w.dtype)
            out = cls("int4", K, N, quant.group_size, q, s, m, layer.bias)
        out.tp = getattr(layer, "tp", None)
        return out

    @classmethod
    def from_gguf(cls, qtype: str, raw: torch.Tensor, in_features: int, bias: torch.Tensor | None = None
                  ) -> QuantLinear:
        """A GGUF tensor's rows (uint8 [N, bytes per row], on the target device), repacked."""
        return cls.from_gguf_parts([(qtype, raw)], in_features, bias)

    @classmethod
    def from_gguf_parts(cls, parts: list[tuple[str, torch.Tensor]], in_features: int,
                        bias: torch.Tensor | None = None) -> QuantLinear:
        """A projection from its GGUF parts ((type, rows) in row order, on the target device; a
        fused projection has several), repacked: parts of one type as one tensor
        (``gguf_blocks.repack``), of different types into the layout that holds them all
        (``gguf_blocks.repack_parts``)."""
        from kvserve.layers.gguf_blocks import repack, repack_parts
        cpu = parts[0][1].device.type == "cpu"
        qtypes = [qtype for qtype, _ in parts]
        if len(set(qtypes)) == 1:
            raw = torch.cat([r for _, r in parts]) if len(parts) > 1 else parts[0][1]
            method, q, s, m, g = repack(raw, qtypes[0], in_features, cpu)
            fmt = f"gguf {qtypes[0]}"
        else:
            method, q, s, m, g = repack_parts(parts, in_features, cpu)
            fmt = "gguf " + "+".join(qtypes)
        return cls(method, in_features, sum(r.shape[0] for _, r in parts), g, q, s, m, bias, fmt=fmt)

    def extra_repr(self) -> str:
        g = f", group_size={self.group_size}" if self.group_size else ""
        return f"{self.fmt}, in_features={self.in_features}, out_features={self.out_features}{g}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        if kernels.available(x):
            y = self._cuda(x.contiguous(), kernel_config())
        else:
            y = self._cpu(x.contiguous())
        if self.tp is not None:
            y = self.tp.all_reduce(y)
        return y.view(*shape[:-1], self.out_features)

    def _cpu(self, x: torch.Tensor) -> torch.Tensor:
        if self.method == "int8" and (self.group_size or x.dtype != torch.bfloat16):
            y = self._cpu_int8_tiles(x)
        elif self.method == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self._scales_as(x.dtype))
        elif self._cpu_layout and x.shape[0] >= (_CPU_DEQUANT_MIN_ROWS if x.dtype == torch.bfloat16
                                                 else _CPU_FLOAT32_DEQUANT_MIN_ROWS):
            y = F.linear(x, self._cpu_int4_dequantized(x.dtype))
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, self.group_size,
                                                           self._scales_as(x.dtype))
        return y if self.bias is None else y + self.bias

    def _cpu_int4_dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The int4 weight [N, K] in ``dtype``, from the CPU kernel's layout (``_cpu_int4_codes``)
        and the scales it applies: q * scale + (zero - 8 * scale), one rounding to ``dtype`` more
        than the kernel's."""
        N, K, g = self.out_features, self.in_features, self.group_size
        q = _cpu_int4_codes(self.qweight, N, K, self._cpu_layout).view(N, K // g, g)
        sz = self._scales_as(dtype).float()  # [K/g, N, 2]: (scale, zero)
        scale = sz[..., 0].t().contiguous()[..., None]  # [N, K/g, 1]
        shift = sz[..., 1].t().contiguous()[..., None] - 8 * scale
        return torch.addcmul(shift.to(dtype), q.to(dtype), scale.to(dtype)).view(N, K)

    def drop_derived(self) -> None:
        """Forget the converted scales (sleep mode frees the weights they came from)."""
        self._cast = self._cast_key = self._cast_dtype = None

    def _scales_as(self, dtype: torch.dtype) -> torch.Tensor:
        """The scales in ``dtype``, which the packed CPU kernels require of them: converted once
        and kept, not per product, where the conversion took longer than the int4 product itself.
        The key follows the buffer, so a reloaded or rewritten one is converted anew."""
        if torch.compiler.is_compiling() and self._cast_dtype == dtype:
            # A compiled model: an eager step converted them. Only the dtype is read (and so
            # guarded on): a guard on the key would hold each engine's data_ptr.
            return self._cast
        s = self.scales
        key = (dtype, s.data_ptr(), 0 if s.is_inference() else s._version)
        if self._cast_key != key:
            self._cast, self._cast_key, self._cast_dtype = s.to(dtype), key, dtype
        return self._cast

    def _cpu_int8_tiles(self, x: torch.Tensor) -> torch.Tensor:
        """int8 by tiles of ``_CPU_TILE_ROWS`` weight rows: the codes converted to x's dtype
        (exact), group scales (and mins) applied to the tile, a per-channel scale to the tile's
        columns of the product."""
        N, K, g = self.out_features, self.in_features, self.group_size
        y = torch.empty(x.shape[0], N, dtype=x.dtype)
        for n0 in range(0, N, _CPU_TILE_ROWS):
            q = self.qweight[n0:n0 + _CPU_TILE_ROWS]
            n = q.shape[0]
            if not g:
                torch.mul(x @ q.to(x.dtype).t(), self._scales_as(x.dtype)[n0:n0 + n], out=y[:, n0:n0 + n])
                continue
            w = q.view(n, K // g, g).to(x.dtype) * self.scales[n0:n0 + n, :, None].to(x.dtype)
            if self.mins is not None:
                w += self.mins[n0:n0 + n, :, None].to(x.dtype)
            y[:, n0:n0 + n] = x @ w.view(n, K).t()
        return y

    @functools.cached_property
    def _s8(self) -> bool:
        """The rule sends this weight's many-row products to the integer tensor cores
        (``kernels/wq_s8.py``: ``dispatched``)."""
        from kvserve.kernels import wq_s8
        return self.s8_products and wq_s8.dispatched(self.qweight, self.group_size, self.in_features)

    @functools.cached_property
    def _wide(self) -> bool:
        """The weight-left GEMM takes this weight: its measured column step divides K and the group."""
        from kvserve.kernels import wq_gemm
        return wq_gemm.wx_block_k(self.qweight, self.group_size, self.in_features,
                                  wq_gemm.WX_BLOCK_K) == wq_gemm.WX_BLOCK_K

    def silu_mul_one_row(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(x W_gate.T) * (x W_up.T) of this merged [gate | up] layer in one kernel, the one-row
        product's, for x of one row on CUDA (``linear.gate_up_silu`` asks only then) where the
        rule sends it there (``KernelConfig``: ``wq_fused_silu``, the skinny product at one row);
        None elsewhere (the caller runs the product, then the activation)."""
        if not (self.bias is None and self.tp is None and self.out_features % 2 == 0):
            return None
        from kvserve.kernels import wq_gemv
        kernel = kernel_config()
        int4 = self.method == "int4"
        if not (kernel.wq_fused_silu and cuda_product(1, kernel, int4, self._wide) == "skinny"
                and wq_gemv.takes(self.qweight, self.group_size)):
            return None
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        return wq_gemv.wq_gemv(x.contiguous(), self.qweight, self.scales, self.mins, self.group_size, None,
                               self.out_features // 2, self.in_features, int4, pdl=kernel.pdl, silu_mul=True)

    def _cuda(self, x: torch.Tensor, kernel: KernelConfig) -> torch.Tensor:
        how = cuda_product(x.shape[0], kernel, self.method == "int4", self._wide, x.shape[0] > 1 and self._s8)
        return run_cuda_product(how, x, self.qweight, self.scales, self.mins, self.group_size, self.bias, kernel)


def run_cuda_product(how: str, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     mins: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
                     kernel: KernelConfig) -> torch.Tensor:
    """x times a packed weight (``wq_gemm``'s layout) through the product ``how`` names
    (``cuda_product``'s choice), launched as ``kernel`` says."""
    from kvserve.kernels import wq_gemm
    if how == "s8":
        from kvserve.kernels import wq_s8
        return wq_s8.wq_mm_s8(x, qweight, scales, mins, group_size, bias, split=kernel.wq_split_k)
    if how in ("skinny", "tiled"):
        int4 = qweight.dtype == torch.uint8  # (two codes a byte: wq_gemm's int4)
        cfg = None if how == "skinny" else wq_gemm.default_config(wq_gemm.MAX_SKINNY_ROWS + 1, qweight.shape[0],
                                                                  x.shape[1], int4)
        return wq_gemm.wq_mm(x, qweight, scales, mins, group_size, bias, cfg, pdl=kernel.pdl,
                             split=kernel.wq_split_k)
    if how == "weight-left":
        return wq_gemm.wq_mm_wx(x, qweight, scales, mins, group_size, bias, split=kernel.wq_split_k)
    return F.linear(x, wq_gemm.dequantize(qweight, scales, mins, group_size, x.dtype), bias)


QUANTIZED_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_model(model: nn.Module, quant: QuantConfig) -> int:
    """Replace the decoder layers' projections with ``QuantLinear``s, in place; returns how many.
    Raises ``ConfigError`` for a model that is already quantized or a layer whose input width the
    group size does not divide."""
    targets = [(name, mod) for name, mod in model.named_modules()
               if name.rsplit(".", 1)[-1] in QUANTIZED_LAYERS]
    from kvserve.layers.fp8_linear import Fp8Linear, check_device
    if any(isinstance(mod, (QuantLinear, Fp8Linear)) for _, mod in targets):
        raise ConfigError("quantization", "the model's weights are already quantized")
    unpack_cpu_weights(model)  # quantized from the dense weights
    if quant.method == "fp8" and targets:
        check_device(targets[0][1].weight.device)
    if quant.method == "int4":
        for name, mod in targets:
            if mod.in_features % quant.group_size:
                fits = [g for g in INT4_GROUP_SIZES if all(m.in_features % g == 0 for _, m in targets)]
                hint = (f"choose one that divides every layer's: {', '.join(map(str, fits))}" if fits else
                        f"none of {', '.join(map(str, INT4_GROUP_SIZES))} divides every layer's: use int8")
                raise ConfigError("quantization_group_size",
                                  f"{quant.group_size} does not divide {name}'s {mod.in_features} input "
                                  f"features; {hint}")
    for name, mod in targets:
        assert isinstance(mod, Linear), f"{name} is {type(mod).__name__}, not a Linear"
        parent, _, attr = name.rpartition(".")
        with torch.no_grad():
            new = Fp8Linear.from_linear(mod) if quant.method == "fp8" else QuantLinear.from_linear(mod, quant)
            setattr(model.get_submodule(parent), attr, new)
    return len(targets) + (quant.head == "int8" and _quantize_head(model))


def _quantize_head(model: nn.Module) -> bool:
    """The output head as an int8 ``QuantLinear`` (per vocabulary row) in ``model.lm_head``; a tied
    head's from the embedding's weight, which stays for the lookups. False where the model has
    no head of its own to quantize (a draft sharing its target's)."""
    head = getattr(model, "lm_head", False)
    if head is None:  # tied: the embedding's rows (this rank's, split across ranks)
        emb = getattr(model, "embed_tokens", None)
        if emb is None:
            return False
        head = nn.Linear(emb.weight.shape[1], emb.weight.shape[0], bias=False, device="meta")
        head.weight = emb.weight
    elif type(head) is not Linear:
        return False
    with torch.no_grad():
        model.lm_head = QuantLinear.from_linear(head, QuantConfig("int8"))
    model.lm_head.s8_products = False
    return True

"""Linear layers whose few-row products on CUDA take the skinny-GEMM kernel (``kernels/gemv.py``).

A decode step with a handful of sequences multiplies a few rows by every weight matrix: the step
is the weights streamed once, and cuBLAS's GEMM tiles read them well below the bandwidth the
skinny kernel reaches. Larger batches (prefill, busy decode) keep cuBLAS. The row limits per kind
of product (``KernelConfig.gemv_max_rows_*``: every matrix at one row, the wide logits matrix up
to 16, the fused gate/up + SiLU up to 32, as tuned on an H200 with ``benchmarks/gemv_tune.py``)
come from the step's ``ForwardContext``, as everything per step does: the model code carries no
configuration.

On CPU the float32 projections (and bfloat16 ones, where the CPU multiplies bfloat16 natively)
run in oneDNN on the weight packed once into its blocked layout (``pack_cpu_weights``; the
packed copy replaces the dense one). ``F.linear`` on a dense CPU
weight takes two to three times as long for two to sixteen rows (a few sequences, a draft's
verification) as for one, though the bytes read are the same; on the packed weight they cost
about as much as one row, and one row runs faster too (benchmarks/cpu_linear.py).
"""
from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import kernels
from kvserve.config import KernelConfig
from kvserve.layers.forward_context import kernel_config
from kvserve.layers.weight_init import initialising


def takes_gemv(x: torch.Tensor, weight: torch.Tensor, kind: str = "linear", kernel: KernelConfig | None = None) -> bool:
    """Whether ``x @ weight.T`` runs in the skinny-GEMM kernel: a product of ``kind`` ("linear",
    "gate_up_silu", "logits") of at most ``kernel``'s row limit (None: the step's), on CUDA.
    The step's kernel choices are read on CUDA only: a model compiled for the CPU
    (``engine/cpu_compile.py``) cannot trace the context they live in."""
    if not (x.dim() == 2 and kernels.available(x) and weight.stride(-1) == 1 and x.stride(-1) == 1):
        return False
    return 1 <= x.shape[0] <= (kernel or kernel_config()).gemv_max_rows(kind)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           kind: str = "linear") -> torch.Tensor:
    if takes_gemv(x, weight, kind):
        from kvserve.kernels.gemv import gemv
        return gemv(x, weight, bias, pdl=kernel_config().pdl)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    packed: torch.Tensor | None = None  # oneDNN's packed weight on CPU; ``weight`` is then empty

    def reset_parameters(self) -> None:
        if initialising():  # not while building for weights loaded next (layers/weight_init.py)
            super().reset_parameters()

    def __deepcopy__(self, memo):
        # A packed weight has no storage to copy: copy the rest as usual and pack the copy anew.
        packed, self.packed = self.packed, None
        try:
            new = copy._reconstruct(self, memo, *self.__reduce_ex__(4))
        finally:
            self.packed = packed
        if packed is not None:
            new.packed = _pack(packed.to_dense())
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return _packed_product(x, self.packed, self.bias)
        return linear(x, self.weight, self.bias)


def _pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` reordered into oneDNN's blocked layout (an opaque tensor, no storage)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def cpu_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def cpu_bf16_native() -> bool:
    """The CPU has bfloat16 dot-product instructions (x86's AVX512-BF16 or AMX-BF16, Arm's BF16)
    and oneDNN takes bfloat16. (oneDNN's own check also says yes on AVX512 CPUs without them,
    where it emulates bfloat16 through float32 at several times the cost.)"""
    if not cpu_packing_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        with open("/proc/cpuinfo") as f:
            words = set(f.read().split())
    except OSError:  # not Linux: no way to tell here, so no
        return False
    return bool(words & {"avx512_bf16", "amx_bf16", "bf16"})


def pack_cpu_weights(model: nn.Module) -> int:
    """Pack every float32 ``Linear`` on the CPU for oneDNN (and every bfloat16 one where oneDNN
    multiplies bfloat16 natively), dropping its dense weight (memory stays one copy); returns how
    many. The output head too (``head_logits``): its product is a batch-1 step's largest. A head
    tied to the embedding keeps the dense weight for the lookups, so its packed copy is a second
    vocab x hidden matrix. Whoever needs the dense weights again, or writes weights, calls
    ``unpack_cpu_weights`` first (a packed copy does not follow writes to the embedding)."""
    if not cpu_packing_available():
        return 0
    dtypes = (torch.float32, torch.bfloat16) if cpu_bf16_native() else (torch.float32,)

    def packable(w: torch.Tensor) -> bool:
        return w.device.type == "cpu" and w.dtype in dtypes and w.numel() > 0

    n = 0
    for mod in model.modules():
        if type(mod) is not Linear or mod.packed is not None or not packable(mod.weight):
            continue
        w = mod.weight
        mod.packed = _pack(w)
        mod.weight = nn.Parameter(w.new_empty(0), requires_grad=False)
        n += 1
    emb = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", False) is None and emb is not None and packable(emb.weight):
        emb.packed_head = PackedCopy(emb.weight)
        n += 1
    return n


class PackedCopy:
    """oneDNN's packed copy of a weight whose dense tensor stays in use (an output head tied to
    the embedding, whose lookups read rows). A deep copy packs anew: the packed tensor has no
    storage to copy."""

    def __init__(self, weight: torch.Tensor):
        self.packed = _pack(weight)

    def __deepcopy__(self, memo) -> PackedCopy:
        return PackedCopy(self.packed.to_dense())


def head_logits(hidden: torch.Tensor, embed_tokens: nn.Module, lm_head: nn.Module | None) -> torch.Tensor:
    """``hidden @ W.T`` for the output head W: ``lm_head``'s weight, or the embedding's when the
    two are tied; through the packed copy where ``pack_cpu_weights`` made one; a quantized head
    (``quant_linear.quantize_model``) computes its own product."""
    if lm_head is not None and not isinstance(lm_head, nn.Linear):
        return lm_head(hidden)
    if lm_head is None:
        packed = getattr(embed_tokens, "packed_head", None)
        packed = None if packed is None else packed.packed
    else:
        packed = lm_head.packed
    if packed is not None:
        return _packed_product(hidden, packed)
    return linear(hidden, (embed_tokens if lm_head is None else lm_head).weight, kind="logits")


def dense_parameters(model: nn.Module):
    """``model.named_parameters()``, each packed ``Linear``'s weight given back dense (a copy)."""
    packed = {f"{n}.weight" if n else "weight": m.packed for n, m in model.named_modules()
              if type(m) is Linear and m.packed is not None}
    for name, p in model.named_parameters():
        yield name, (packed[name].to_dense() if name in packed else p)


def unpack_cpu_weights(model: nn.Module) -> None:
    """Give every packed ``Linear`` its dense weight back (exactly: packing only reorders)."""
    for mod in model.modules():
        if type(mod) is Linear and mod.packed is not None:
            mod.weight = nn.Parameter(mod.packed.to_dense(), requires_grad=False)
            mod.packed = None
        if getattr(mod, "packed_head", None) is not None:
            mod.packed_head = None


def gate_up_silu(x: torch.Tensor, gate_up: nn.Module) -> torch.Tensor:
    """``silu(x W_g.T) * (x W_u.T)`` for the merged [gate | up] matrix: one kernel for few rows
    (a quantized matrix: one kernel for one row where its layer says so, else its product, then
    the activation)."""
    if isinstance(gate_up, nn.Linear) and gate_up.bias is None and takes_gemv(x, gate_up.weight, "gate_up_silu"):
        from kvserve.kernels.gemv import gemv
        return gemv(x, gate_up.weight, silu_mul=True, pdl=kernel_config().pdl)
    fused = getattr(gate_up, "silu_mul_one_row", None)
    if fused is not None and x.dim() == 2 and x.shape[0] == 1 and kernels.available(x):
        y = fused(x)
        if y is not None:
            return y
    from kvserve.layers.activation import silu_and_mul
    return silu_and_mul(gate_up(x))

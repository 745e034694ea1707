"""The per-step context the layers read: the step's attention metadata, each layer's KV cache and
the attention backend (whose ``KernelConfig`` the other CUDA layers follow too).

The runner sets it with ``forward_context`` around the model's forward; model code sees no
requests. Tokens of all sequences are packed along one axis:

    tokens        | seq0 chunk (q=5) | seq1 (q=1) | seq2 (q=1) |
    query_start   0                  5            6            7
    seq_lens      ctx0 + 5           ctx1 + 1     ctx2 + 1       (keys after this step)
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.config import KernelConfig
from kvserve.kv_format import KVViews

_DEFAULT_KERNELS = KernelConfig()


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32 (padded with 0)
    seq_lens: list[int]  # keys per sequence after this step
    query_lens: list[int]  # new tokens per sequence this step
    query_start: list[int]  # B + 1 offsets into the token axis
    block_size: int
    # Built by the backend's prepare(), once per step, shared by all layers.
    seq_tables: list[torch.Tensor] | None = None  # torch: each sequence's own blocks
    seq_lens_t: torch.Tensor | None = None  # triton: [B] int32 on the device
    cu_q: torch.Tensor | None = None  # triton: [B + 1] int32 on the device
    max_query_len: int = 0
    num_splits: int = 1  # triton decode: context splits per sequence
    # KIVI-compressed caches (int4/int2): each sequence's row of the full-precision key residual,
    # each token's place in it (row * block_size + offset, -1: its block is sealed this step),
    # and the most key blocks any sequence fills (and seals) this step.
    res_slots: list[int] | None = None
    res_slots_t: torch.Tensor | None = None
    res_mapping: torch.Tensor | None = None
    max_seal: int = 0
    # The work plan of the step's decode kernel where it plans the step (KIVI int4's splits:
    # ``kivi_decode.SplitPlan``), made by the first layer and read by the rest: the lengths and
    # block tables are every layer's.
    decode_plan: Any = None
    # Decode rows of one sequence (``engine/decode_rows.py``): a row reads keys that other rows
    # write in the same step, so every row's K/V is written before the attention kernel runs
    # (no RoPE + KV write fused into it, which stores only its own row's).
    decode_rows: bool = False
    # Streaming KV eviction (``engine/kv_cache_manager.py``): each sequence's ``kv_budget`` (None:
    # every key); a query sees the sink blocks and its recent blocks only. None: no sequence has one.
    kv_budgets: list[int | None] | None = None
    # triton: ``kv_budgets`` as the kernels take them (``kernels.common.Streaming``), or None.
    streaming: Any = None
    # Scored eviction (SnapKV, H2O): per sequence (None: not scored) ``(kept, lo, hi, acc)``: the
    # table indices of its kept blocks (the rest are NULL); the queries at positions [lo, hi)
    # add their softmax rows, summed over heads, into ``acc`` [keys] at each key's position
    # (acc None: none do).
    kv_scored: list[tuple[torch.Tensor, int, int, torch.Tensor | None] | None] | None = None


@dataclass
class ForwardContext:
    attn: AttentionMetadata | None
    # per layer (K, V): [blocks, bs, kvh, d]; a compressed cache: (KVViews, None)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor] | tuple[KVViews, None]]
    backend: Any  # the attention backend of this step (``layers.attention.get_backend``)
    # KV groups (``engine/kv_groups.py``): layer i's metadata (its group's block tables and
    # slots); None: ``attn`` for every layer.
    layer_attn: list[AttentionMetadata] | None = None

    def attn_of(self, layer_idx: int) -> AttentionMetadata | None:
        return self.attn if self.layer_attn is None else self.layer_attn[layer_idx]

    @property
    def kernel(self) -> KernelConfig:
        """The step's kernel choices: the backend's."""
        return getattr(self.backend, "kernel", _DEFAULT_KERNELS)


_CTX: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar("kvserve_fwd", default=None)


@contextlib.contextmanager
def forward_context(ctx: ForwardContext):
    token = _CTX.set(ctx)
    try:
        yield ctx
    finally:
        _CTX.reset(token)


def get_forward_context() -> ForwardContext:
    ctx = _CTX.get()
    if ctx is None:
        raise RuntimeError("attention called outside forward_context()")
    return ctx


def kernel_config() -> KernelConfig:
    """The kernel choices of the step running now; the defaults outside a step (the runner's
    logits, a test calling a layer directly)."""
    ctx = _CTX.get()
    return _DEFAULT_KERNELS if ctx is None else ctx.kernel

"""Paged attention: the per-step context, the backend interface and the PyTorch reference.

The runner sets an ``AttentionMetadata`` for the step with ``forward_context``; layers read it.
Tokens of all sequences are packed along one axis:

    tokens        | seq0 chunk (q=5) | seq1 (q=1) | seq2 (q=1) |
    query_start   0                  5            6            7
    seq_lens      ctx0 + 5           ctx1 + 1     ctx2 + 1       (keys after this step)

Each layer first rotates q/k and writes the step's K/V into the cache at ``slot_mapping``,
then every query attends causally to its sequence's keys, all read back through the block table.
A backend takes q, k, v before RoPE so that it can fuse the rotation with the cache write.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvserve.layers import kv_format
from kvserve.layers.kv_format import KVViews


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
    # Work plans of the step's decode kernels (KIVI int4's splits), made by the first layer that
    # needs one and read by the rest: the step's lengths are every layer's.
    plans: dict = field(default_factory=dict)


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    # per layer (K, V): [blocks, bs, kvh, d]; a compressed cache: (KVViews, None)
    kv_caches: list[tuple[torch.Tensor, torch.Tensor] | tuple[KVViews, None]]
    backend: type = None  # the attention backend class for this step

    def __post_init__(self):
        if self.backend is None:
            self.backend = TorchPagedAttention


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


class TorchPagedAttention:
    """Reference backend: plain PyTorch, any device."""

    name = "torch"

    @staticmethod
    def prepare(meta: AttentionMetadata, device: torch.device) -> None:
        bs = meta.block_size
        meta.seq_tables = [meta.block_tables[i, : -(-L // bs)] for i, L in enumerate(meta.seq_lens)]

    @staticmethod
    def forward(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] before RoPE; caches: [num_blocks, bs, KVH, D].
        Returns [T, H, D].

        One SDPA call per sequence over exactly its keys, gathered with index_select: on the
        CPU this beats one padded, masked call for the batch (masks force a slow path)."""
        q, k = rope(positions, q, k)
        if isinstance(k_cache, KVViews):
            return _forward_compressed(q, k, v, k_cache, meta, scale)
        nb, bs, kvh, d = k_cache.shape
        k_cache.view(nb * bs, kvh, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(nb * bs, kvh, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        # On the CPU the half-precision SDPA kernels are several times slower than float32
        # (and less exact): gather K/V straight into float32 there.
        acc = torch.float32 if q.device.type == "cpu" else q.dtype
        q = q.to(acc)
        for i, table in enumerate(meta.seq_tables):
            s, e = meta.query_start[i], meta.query_start[i + 1]
            L = meta.seq_lens[i]
            keys = k_cache.index_select(0, table).view(-1, kvh, d)[:L].to(acc)
            vals = v_cache.index_select(0, table).view(-1, kvh, d)[:L].to(acc)
            out[s:e] = _attend(q[s:e], keys, vals, L, scale).to(out.dtype)
        return out


def _attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, L: int, scale: float) -> torch.Tensor:
    """q: [ql, H, D] (the last ql of L positions), keys/vals: [L, KVH, D] -> [ql, H, D]."""
    ql = q.shape[0]
    qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, ql, D]
    keys, vals = keys.transpose(0, 1).unsqueeze(0), vals.transpose(0, 1).unsqueeze(0)
    if ql == 1 or ql == L:  # one query sees every key; or a whole prompt, plainly causal
        o = F.scaled_dot_product_attention(qs, keys, vals, is_causal=ql > 1, scale=scale, enable_gqa=True)
    else:  # a chunk after cached context: causal, offset by the context
        qpos = torch.arange(L - ql, L, device=q.device)
        mask = torch.arange(L, device=q.device)[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _forward_compressed(q, k, v, views: KVViews, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The reference path for a compressed cache (``layers/kv_format.py``): quantize the step's
    K/V into it, then attend over each sequence's dequantized blocks. As in the Triton backend, a
    lone whole prompt attends to its own keys in full precision (it computed them just now)."""
    f = views.fmt
    q, k = kv_format.rotate_qk(q, f), kv_format.rotate_qk(k, f)
    if f.kivi:
        for i, table in enumerate(meta.seq_tables):
            s, e = meta.query_start[i], meta.query_start[i + 1]
            kv_format.write_keys_kivi(views, k, s, e - s, meta.seq_lens[i], table, meta.res_slots[i])
    kv_format.write_tokens(views, k, v, meta.slot_mapping)
    out = torch.empty_like(q)
    acc = torch.float32 if q.device.type == "cpu" else q.dtype
    plain_prompt = len(meta.seq_lens) == 1 and meta.query_lens[0] == meta.seq_lens[0] > 1
    for i, table in enumerate(meta.seq_tables):
        s, e = meta.query_start[i], meta.query_start[i + 1]
        L = meta.seq_lens[i]
        if plain_prompt:
            keys, vals = k[s:e], v[s:e]
        else:
            keys, vals = kv_format.read_kv(views, table, L, meta.res_slots[i] if f.kivi else -1)
        out[s:e] = _attend(q[s:e].to(acc), keys.to(acc), vals.to(acc), L, scale).to(out.dtype)
    return out


def get_backend(name: str = "torch"):
    """Backends load lazily by name so the CPU path never imports what it cannot run."""
    if name == "torch":
        return TorchPagedAttention
    if name == "triton":
        from kvserve.layers.triton_attention import TritonPagedAttention
        return TritonPagedAttention
    raise ValueError(f"unknown attention backend {name!r}; available: torch, triton")

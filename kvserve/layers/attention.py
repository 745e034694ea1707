"""Paged attention: the per-step context, the backend interface and the PyTorch reference.

The runner sets an ``AttentionMetadata`` for the step with ``forward_context``; layers read it.
Tokens of all sequences are packed along one axis:

    tokens        | seq0 chunk (q=5) | seq1 (q=1) | seq2 (q=1) |
    query_start   0                  5            6            7
    seq_lens      ctx0 + 5           ctx1 + 1     ctx2 + 1       (keys after this step)

Each layer first writes the step's K/V into the cache at ``slot_mapping``, then every query
attends causally to its sequence's keys, all read back through the block table.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padded with 0)
    seq_lens: list[int]  # keys per sequence after this step
    query_lens: list[int]  # new tokens per sequence this step
    query_start: list[int]  # B + 1 offsets into the token axis
    block_size: int
    decode_seqs: list[int]  # sequences with exactly one new token
    prefill_seqs: list[int]  # the others
    # Derived tensors for batched decode, built once per step and shared by all layers.
    decode_token_idx: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None  # [Bd, 1, 1, L] bool
    decode_tables: torch.Tensor | None = None


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V): [blocks, bs, kvh, d]


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
    """Reference backend: plain PyTorch, any device. Decode sequences are batched into one
    masked SDPA call; each prompt chunk gets its own call with a causal mask offset by its
    cached context."""

    name = "torch"

    @staticmethod
    def prepare(meta: AttentionMetadata, device: torch.device) -> None:
        if not meta.decode_seqs:
            return
        idx = meta.decode_seqs
        meta.decode_token_idx = torch.tensor([meta.query_start[i] for i in idx], device=device)
        lens = torch.tensor([meta.seq_lens[i] for i in idx], device=device)
        max_len = int(max(meta.seq_lens[i] for i in idx))
        n_blocks = -(-max_len // meta.block_size)
        meta.decode_tables = meta.block_tables[torch.tensor(idx, device=device), :n_blocks]
        pos = torch.arange(n_blocks * meta.block_size, device=device)
        meta.decode_mask = (pos[None, :] < lens[:, None])[:, None, None, :]

    @staticmethod
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_blocks, bs, KVH, D]. Returns [T, H, D]."""
        nb, bs, kvh, d = k_cache.shape
        k_cache.view(nb * bs, kvh, d).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(nb * bs, kvh, d).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        if meta.decode_seqs:
            tables = meta.decode_tables
            b = tables.shape[0]
            keys = k_cache[tables].reshape(b, -1, kvh, d).transpose(1, 2)
            vals = v_cache[tables].reshape(b, -1, kvh, d).transpose(1, 2)
            qd = q[meta.decode_token_idx].unsqueeze(2)  # [B, H, 1, D]
            o = F.scaled_dot_product_attention(qd, keys.to(q.dtype), vals.to(q.dtype),
                                               attn_mask=meta.decode_mask, scale=scale, enable_gqa=True)
            out[meta.decode_token_idx] = o.squeeze(2)
        for i in meta.prefill_seqs:
            s, e = meta.query_start[i], meta.query_start[i + 1]
            L, ql = meta.seq_lens[i], e - s
            n_blocks = -(-L // bs)
            table = meta.block_tables[i, :n_blocks]
            keys = k_cache[table].reshape(-1, kvh, d)[:L].transpose(0, 1).unsqueeze(0)
            vals = v_cache[table].reshape(-1, kvh, d)[:L].transpose(0, 1).unsqueeze(0)
            qs = q[s:e].transpose(0, 1).unsqueeze(0)  # [1, H, ql, D]
            if ql == L:
                o = F.scaled_dot_product_attention(qs, keys.to(q.dtype), vals.to(q.dtype),
                                                   is_causal=True, scale=scale, enable_gqa=True)
            else:
                qpos = torch.arange(L - ql, L, device=q.device)
                mask = torch.arange(L, device=q.device)[None, :] <= qpos[:, None]
                o = F.scaled_dot_product_attention(qs, keys.to(q.dtype), vals.to(q.dtype),
                                                   attn_mask=mask, scale=scale, enable_gqa=True)
            out[s:e] = o.squeeze(0).transpose(0, 1)
        return out


_BACKENDS = {"torch": TorchPagedAttention}


def get_backend(name: str = "torch"):
    """Backends load lazily by name so the CPU path never imports what it cannot run."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name]

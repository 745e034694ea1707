"""Paged attention: the backend interface and the PyTorch reference backend.

Each layer first rotates q/k and writes the step's K/V into the cache at ``slot_mapping``, then
every query attends causally to its sequence's keys, all read back through the block table (the
step's ``AttentionMetadata``, ``layers/forward_context.py``). A backend takes q, k, v before RoPE
so that it can fuse the rotation with the cache write.

A backend is an object with ``name``, ``kernel`` (the ``KernelConfig`` the step's CUDA layers
follow), ``prepare(meta, device)`` (once per step) and ``forward(positions, q, k, v, rope,
k_cache, v_cache, meta, scale, window=None)`` (per layer; ``window``: each query sees only the
last ``window`` keys up to itself); ``get_backend`` makes one by name.
"""
from __future__ import annotations

import itertools
import weakref

import torch
import torch.nn.functional as F

from kvserve import kv_format
from kvserve.config import KernelConfig
from kvserve.kv_eviction import SINK_BLOCKS, recent_start, streaming_mask
from kvserve.kv_format import KVViews
from kvserve.layers.forward_context import AttentionMetadata, ForwardContext, forward_context, get_forward_context  # noqa: F401


class TorchPagedAttention:
    """Reference backend: plain PyTorch, any device."""

    name = "torch"

    def __init__(self, kernel: KernelConfig | None = None):
        self.kernel = kernel or KernelConfig()  # (the other layers' kernels on CUDA)

    @staticmethod
    def prepare(meta: AttentionMetadata, device: torch.device) -> None:
        bs = meta.block_size
        meta.seq_tables = [meta.block_tables[i, : -(-L // bs)] for i, L in enumerate(meta.seq_lens)]

    @staticmethod
    def forward(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, window: int | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KVH, D] before RoPE; caches: [num_blocks, bs, KVH, D];
        ``window``: each query sees only the last ``window`` keys up to itself (None: all).
        Returns [T, H, D].

        One SDPA call per sequence over exactly its keys, gathered with index_select: on the
        CPU this beats one padded, masked call for the batch (masks force a slow path). With a
        window, the blocks before the chunk's first visible key are not read."""
        q, k = rope(positions, q, k)
        if isinstance(k_cache, KVViews):
            return _forward_compressed(q, k, v, k_cache, meta, scale, window)
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
            if meta.kv_scored is not None and meta.kv_scored[i] is not None:
                out[s:e] = _attend_scored(q[s:e], k_cache, v_cache, table, L, bs, scale,
                                          meta.kv_scored[i]).to(out.dtype)
                continue
            if meta.kv_budgets is not None and meta.kv_budgets[i] is not None:
                out[s:e] = _attend_streaming(q[s:e], k_cache, v_cache, table, L, meta.kv_budgets[i], bs,
                                             scale).to(out.dtype)
                continue
            lo = 0 if window is None else max(0, L - (e - s) - window + 1)  # first key any query sees
            b0 = lo // bs
            keys = k_cache.index_select(0, table[b0:]).view(-1, kvh, d)[lo - b0 * bs:L - b0 * bs].to(acc)
            vals = v_cache.index_select(0, table[b0:]).view(-1, kvh, d)[lo - b0 * bs:L - b0 * bs].to(acc)
            out[s:e] = _attend(q[s:e], keys, vals, L, scale, window).to(out.dtype)
        return out


def _attend(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, L: int, scale: float,
            window: int | None = None) -> torch.Tensor:
    """q: [ql, H, D] (the last ql of L positions), keys/vals: [n, KVH, D], the last n of the L
    keys -> [ql, H, D]."""
    ql, n = q.shape[0], keys.shape[0]
    qs = q.transpose(0, 1).unsqueeze(0)  # [1, H, ql, D]
    keys, vals = keys.transpose(0, 1).unsqueeze(0), vals.transpose(0, 1).unsqueeze(0)
    in_window = window is None or n <= window  # no key is too far back for any query
    if in_window and (ql == 1 or ql == n == L):
        # one query sees every key; or a whole prompt, plainly causal
        o = F.scaled_dot_product_attention(qs, keys, vals, is_causal=ql > 1, scale=scale, enable_gqa=True)
        return o.squeeze(0).transpose(0, 1)
    # a chunk after cached context (causal, offset by the context), or a window
    qpos = torch.arange(L - ql, L, device=q.device)[:, None]
    kpos = torch.arange(L - n, L, device=q.device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _attend_streaming(q, k_cache, v_cache, table, L: int, kv_budget: int, bs: int, scale: float):
    """The last ``q.shape[0]`` of ``L`` queries over the sink blocks and the blocks from the first
    query's recent start on: the blocks between were freed (their table entries are NULL)."""
    ql, (_, _, kvh, d) = q.shape[0], k_cache.shape
    b0 = recent_start(kv_budget, bs, L - ql)
    nb = table.shape[0]
    blocks = table if b0 <= SINK_BLOCKS else torch.cat([table[:SINK_BLOCKS], table[b0:]])
    kpos = torch.arange(nb * bs, device=q.device)
    if b0 > SINK_BLOCKS:
        kpos = torch.cat([kpos[:SINK_BLOCKS * bs], kpos[b0 * bs:]])
    n = int((kpos < L).sum())
    keys = k_cache.index_select(0, blocks).view(-1, kvh, d)[:n].to(q.dtype)
    vals = v_cache.index_select(0, blocks).view(-1, kvh, d)[:n].to(q.dtype)
    mask = streaming_mask(torch.arange(L - ql, L, device=q.device), kpos[:n], kv_budget, bs)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0),
                                       vals.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale,
                                       enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)


def _attend_scored(q, k_cache, v_cache, table, L: int, bs: int, scale: float, spec, tile: int = 256):
    """The last ``q.shape[0]`` of ``L`` queries over the keys of the table's kept blocks (at
    indices ``kept``), causally by position, with the softmax written out so the rows of the
    queries at positions ``[lo, hi)`` can be summed into ``acc`` per key (``spec = (kept, lo,
    hi, acc)``). ``tile`` queries at a time: [heads, tile, keys] scores at most, never [L, L]."""
    ql, h, d = q.shape
    kvh = k_cache.shape[2]
    kept, lo, hi, acc = spec
    kpos = (kept[:, None] * bs + torch.arange(bs, device=q.device)).reshape(-1)
    inside = kpos < L
    keys = k_cache.index_select(0, table[kept]).view(-1, kvh, d)[inside].to(q.dtype)
    vals = v_cache.index_select(0, table[kept]).view(-1, kvh, d)[inside].to(q.dtype)
    kpos = kpos[inside]
    out = torch.empty_like(q)
    qg = q.view(ql, kvh, h // kvh, d)
    for t0 in range(0, ql, tile):
        t1 = min(ql, t0 + tile)
        qpos = torch.arange(L - ql + t0, L - ql + t1, device=q.device)
        s = torch.einsum("qkgd,nkd->kgqn", qg[t0:t1], keys) * scale
        s.masked_fill_(kpos[None, None, None, :] > qpos[None, None, :, None], float("-inf"))
        p = s.softmax(-1)
        out[t0:t1] = torch.einsum("kgqn,nkd->qkgd", p, vals).reshape(t1 - t0, h, d)
        r0, r1 = max(lo, int(qpos[0])) - int(qpos[0]), min(hi, int(qpos[-1]) + 1) - int(qpos[0])
        if acc is not None and r0 < r1:
            acc.index_add_(0, kpos, p[:, :, r0:r1].sum((0, 1, 2)).to(acc.dtype))
    return out


def _forward_compressed(q, k, v, views: KVViews, meta: AttentionMetadata, scale: float,
                        window: int | None = None) -> torch.Tensor:
    """The reference path for a compressed cache (``kvserve/kv_format.py``): quantize the step's
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
    if len(meta.seq_lens) == 1 and meta.query_lens[0] == meta.seq_lens[0] > 1:
        stored = iter([(k, v)])  # a plain prompt
    else:
        stored = kv_format.read_kv_many(views, meta.seq_tables, meta.seq_lens,
                                        meta.res_slots if f.kivi else [-1] * len(meta.seq_lens))
    for i, (keys, vals) in enumerate(stored):
        s, e = meta.query_start[i], meta.query_start[i + 1]
        out[s:e] = _attend(q[s:e].to(acc), keys.to(acc), vals.to(acc), meta.seq_lens[i], scale,
                           window).to(out.dtype)
    return out


def attend(layer, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           window: int | None = None) -> torch.Tensor:
    """The step's paged attention for ``layer`` (an attention module: its ``layer_idx``, ``rope``
    and ``scale``) through the step's backend. Inside a compiled model (``engine/cpu_compile.py``)
    the call is one opaque op: the step's context is read when it runs, not when it is traced."""
    if torch.compiler.is_compiling():  # (the layer registered by ``compiled_layers``)
        q, k = layer.rope(positions, q, k)  # in the graph, fused with what comes before
        return torch.ops.kvserve.paged_attention(positions, q, k, v, layer.compiled_key, window)
    return _attend_layer(layer, layer.rope, positions, q, k, v, window)


def _attend_layer(layer, rope, positions, q, k, v, window):
    ctx = get_forward_context()
    k_cache, v_cache = ctx.kv_caches[layer.layer_idx]
    return ctx.backend.forward(positions, q, k, v, rope, k_cache, v_cache, ctx.attn_of(layer.layer_idx),
                               layer.scale, window=window)


_COMPILED_LAYERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_COMPILED_MODELS = itertools.count()


def compiled_layers(model: torch.nn.Module) -> int:
    """Let a compiled ``model``'s attention ops find their layers by a key, the ops' argument:
    the model's number among those compiled in this process, then the layer's index. The key
    is part of the graph, so a process's first compiled model has the same graph in every
    process, and inductor's on-disk cache serves it (an object's id would make it new each time).
    Returns the model's number."""
    number = next(_COMPILED_MODELS)
    for m in model.modules():
        if hasattr(m, "layer_idx") and hasattr(m, "rope"):
            m.compiled_key = (number << 16) + m.layer_idx
            _COMPILED_LAYERS[m.compiled_key] = m
    return number


# It writes the layer's KV cache, which is no input of the op: each layer's call depends on the
# one before it through its input, so a compiled graph keeps them in order.
@torch.library.custom_op("kvserve::paged_attention", mutates_args=())
def _paged_attention(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                     window: int | None) -> torch.Tensor:
    return _attend_layer(_COMPILED_LAYERS[layer], _rotated, positions, q, k, v, window)


def _rotated(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """The rope of a compiled graph's attention op: q and k come rotated."""
    return q, k


@_paged_attention.register_fake
def _(positions, q, k, v, layer, window):
    return q.new_empty(q.shape)


def get_backend(name: str = "torch", kernel: KernelConfig | None = None):
    """A backend by name, with its kernel choices (None: the defaults). Backends load lazily so
    the CPU path never imports what it cannot run."""
    if name == "torch":
        return TorchPagedAttention(kernel)
    if name == "triton":
        from kvserve.layers.triton_attention import TritonPagedAttention
        return TritonPagedAttention(kernel)
    raise ValueError(f"unknown attention backend {name!r}; available: torch, triton")

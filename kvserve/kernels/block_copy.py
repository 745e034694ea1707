"""Copy KV blocks between two pools: ``dst[:, :, d] = src[:, :, s]`` for each pair ``(s, d)``
of ``ids`` (``[2, n]``: the sources, then the destinations).

A pool is ``[page, kv, num_blocks, ...]`` (kvserve/engine/kv_cache.py), so one block is
``page * kv`` strided pieces. Advanced indexing (``dst[:, :, d] = src[:, :, s]``) gathers into a
temporary and scatters it: two copies. Here each program copies one piece of one block, so every
byte is read once and written once, whatever the block numbers. Used to land a prompt's blocks
from a producer's pool mapped with CUDA IPC into the consumer's (kvserve/kvtier/ipc.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_blocks_kernel(S, D, IDS, N, NB_S, NB_D, E, BLOCK: tl.constexpr):
    p = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(IDS + p).to(tl.int64)
    d = tl.load(IDS + N + p).to(tl.int64)
    mask = cols < E
    x = tl.load(S + (row * NB_S + s) * E + cols, mask=mask)
    tl.store(D + (row * NB_D + d) * E + cols, x, mask=mask)


def _rows(pool: torch.Tensor) -> torch.Tensor:
    """``[page * kv, num_blocks, E]`` over the pool's bytes, in 4-byte words where they divide."""
    assert pool.is_contiguous() and pool.dim() >= 3
    flat = pool.view(pool.shape[0] * pool.shape[1], pool.shape[2], -1).view(torch.uint8)
    return flat.view(torch.int32) if flat.shape[-1] % 4 == 0 else flat


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, block: int = 1024,
                num_warps: int = 8) -> None:
    """``ids``: int64 ``[2, n]``, the source blocks then their destinations, on the pools'
    device (two lists, which the host builds by concatenation: no per-pair work). The pools may
    differ in their number of blocks, not in anything else. ``block``: words a program copies at
    most (a power of two)."""
    assert src.dtype == dst.dtype and src.shape[:2] == dst.shape[:2] and src.shape[3:] == dst.shape[3:]
    s, d = _rows(src), _rows(dst)
    n, (rows, _, e) = ids.shape[1], s.shape
    if n == 0:
        return
    block = min(block, triton.next_power_of_2(e))
    _copy_blocks_kernel[(n, rows, triton.cdiv(e, block))](s, d, ids.contiguous(), n, s.shape[1], d.shape[1], e,
                                                          BLOCK=block, num_warps=num_warps)


def copy_blocks_ref(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor) -> None:
    for s, d in ids.t().tolist():
        dst[:, :, d] = src[:, :, s]

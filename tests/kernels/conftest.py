"""Shared fixtures for the Triton kernel tests.

Without a GPU, ``tests/conftest.py`` sets ``TRITON_INTERPRET=1`` before triton is imported, so
the kernels run in Triton's interpreter on CPU tensors (small shapes: the interpreter is slow).
With a GPU the same tests run on CUDA tensors, plus the ``needs_cuda`` real-size cases.

Helpers are handed out as fixtures (factories) rather than imported, so the files work under any
pytest import mode.
"""
from __future__ import annotations

import math

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (NaN if out holds a NaN)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


def build_paged_kv(gen: torch.Generator, seq_lens: list[int], page: int, num_kv_heads: int,
                   head_dim: int, dtype: torch.dtype, device: torch.device, spare_pages: int = 2):
    """A K/V page pool holding ``seq_lens[b]`` random keys for each sequence, reached through a
    block table whose pages are a random permutation of the pool (never contiguous runs).

    Every cache slot that no sequence owns (spare pages, the tail of each sequence's last page)
    is NaN, and the table's columns past a sequence's last page point at a spare, all-NaN page:
    a kernel that reads one key too many, or multiplies a masked-off value by 0, gives NaN.
    Returns (k_cache, v_cache, block_tables int32 [B, max_pages])."""
    pages_needed = [math.ceil(L / page) for L in seq_lens]
    num_blocks = sum(pages_needed) + spare_pages
    perm = torch.randperm(num_blocks, generator=gen)
    trap = int(perm[-1])  # owned by no sequence
    max_pages = max(pages_needed + [0]) + 1  # at least one padding column everywhere
    bt = torch.full((len(seq_lens), max_pages), trap, dtype=torch.int32)
    shape = (num_blocks, page, num_kv_heads, head_dim)
    k = torch.full(shape, float("nan"))
    v = torch.full(shape, float("nan"))
    used = 0
    for b, (L, n) in enumerate(zip(seq_lens, pages_needed)):
        bt[b, :n] = perm[used:used + n].to(torch.int32)
        used += n
        pos = torch.arange(L)
        pages, within = bt[b, pos // page].long(), pos % page
        k[pages, within] = torch.randn(L, num_kv_heads, head_dim, generator=gen)
        v[pages, within] = torch.randn(L, num_kv_heads, head_dim, generator=gen)
    return k.to(dtype).to(device), v.to(dtype).to(device), bt.to(device)


@pytest.fixture(scope="session")
def paged_kv():
    return build_paged_kv


@pytest.fixture(scope="session")
def rel():
    return rel_err

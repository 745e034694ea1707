"""Block copies between two KV pools (``kvserve/kernels/block_copy.py``) against its reference,
PyTorch's own indexing one block at a time: every pair's block lands bit for bit, and no other
block of the destination changes.
The pools differ in size and the blocks are scattered (never contiguous runs), so a kernel that
mixed up the two pools' block strides, or copied a neighbour, fails."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernelutil import needs_cuda  # noqa: E402

from kvserve.kernels.block_copy import copy_blocks, copy_blocks_ref

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # interpreter internals


def pools(gen, shape_src, shape_dst, dtype, device):
    if dtype == torch.uint8:  # a compressed format's byte pool
        src = torch.randint(0, 256, shape_src, generator=gen, dtype=torch.uint8)
        dst = torch.randint(0, 256, shape_dst, generator=gen, dtype=torch.uint8)
    else:
        src, dst = torch.randn(shape_src, generator=gen).to(dtype), torch.randn(shape_dst, generator=gen).to(dtype)
    return src.to(device), dst.to(device)


def check(src, dst, n, gen):
    s = torch.randperm(src.shape[2], generator=gen)[:n]
    d = torch.randperm(dst.shape[2], generator=gen)[:n]
    ids = torch.stack([s, d]).to(src.device)
    want = dst.clone()
    copy_blocks_ref(src, want, ids)
    copy_blocks(src, dst, ids)
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
@pytest.mark.parametrize("page,kv,rest", [(3, 2, (4, 2, 8)), (2, 1, (37,)), (1, 2, (16, 1, 5))])
def test_copy_blocks_matches_indexing(dtype, page, kv, rest, device):
    gen = torch.Generator().manual_seed(7)
    src, dst = pools(gen, (page, kv, 11) + rest, (page, kv, 6) + rest, dtype, device)
    check(src, dst, 5, gen)


def test_no_pairs_changes_nothing(device):
    gen = torch.Generator().manual_seed(1)
    src, dst = pools(gen, (2, 2, 4, 8), (2, 2, 3, 8), torch.float32, device)
    before = dst.clone()
    copy_blocks(src, dst, torch.zeros(2, 0, dtype=torch.int64, device=device))
    assert torch.equal(dst, before)


@needs_cuda
def test_copy_blocks_llama_8b_blocks():
    """Real size: 512 blocks of the Llama-3-8B shape (32 layers, 8 KV heads of 128, 16 tokens)."""
    gen = torch.Generator().manual_seed(3)
    src = torch.randn(32, 2, 600, 16, 8, 128, generator=gen).to(torch.bfloat16).cuda()
    dst = torch.randn(32, 2, 700, 16, 8, 128, generator=gen).to(torch.bfloat16).cuda()
    check(src, dst, 512, gen)

"""Paged varlen prefill attention (``kvserve/kernels/prefill_attention.py``) against its float64
reference.

Each batch mixes plain prompts, prompts after cached context (prefix hits / later chunks of a
chunked prefill, with the context not a multiple of the page or of the tiles), q_len=1 rows
(decode riding along) and a sequence with no new token. Block tables are random permutations
of the pool, slots no sequence owns are NaN (see ``build_paged_kv``) and ``out`` is poisoned
with NaN. GQA ratios 1/3/4/8, pages 1/4/8/16, and the tile shapes of both the CPU and the GPU.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernelutil import ATTENTION_DTYPES as DTYPES  # noqa: E402
from kernelutil import ATTENTION_TOL as TOL  # noqa: E402
from kernelutil import DTYPE_NO, needs_cuda  # noqa: E402

from kvserve.kernels.prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # interpreter internals
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]  # -inf - -inf, masked

# (q heads, kv heads, head_dim, page): GQA ratios 1, 3, 4, 8; pages 1, 4, 8, 16; head_dim 48
# is not a power of two (masked lanes of BLOCK_D = 64).
SHAPES = [(2, 2, 32, 1), (6, 2, 16, 4), (4, 1, 48, 8), (8, 1, 64, 16)]
# (cached context, new tokens) per sequence. CPU tiles are 16 x 16.
BATCH = [
    (0, 37),   # plain prompt over three query tiles, the last one partial
    (13, 20),  # prefix hit: context off every page and tile boundary
    (45, 1),   # a decode row in the mixed batch
    (16, 16),  # next chunk after a context of exactly one tile
    (0, 1),    # a one-token prompt
    (6, 0),    # no new token this step
    (29, 30),  # context and end both ragged; queries straddle a key tile boundary
]


def _run(gen, device, paged_kv, H, KVH, D, page, dtype, batch, q=None, out=None, **tiles):
    q_lens = [n for _, n in batch]
    seq_lens = [c + n for c, n in batch]
    k_cache, v_cache, bt = paged_kv(gen, seq_lens, page, KVH, D, dtype, device)
    cu = torch.zeros(len(batch) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    cu = cu.to(device)
    if q is None:
        q = (torch.randn(sum(q_lens), H, D, generator=gen) * 1.5).to(dtype).to(device)
    if out is None:
        out = torch.full_like(q, float("nan"))
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    got = paged_prefill_attention(q, k_cache, v_cache, bt, cu, sl, max(q_lens), D ** -0.5, out=out, **tiles)
    assert got is out
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, bt, cu, sl, D ** -0.5)
    return out, ref, cu.tolist()


def _check(out, ref, cu, tol):
    assert not out.isnan().any()
    assert (out - ref).norm() / ref.norm() < tol
    for b in range(len(cu) - 1):  # each sequence on its own, so no long one hides a short one
        s, e = cu[b], cu[b + 1]
        if e > s:
            r = ref[s:e]
            assert (out[s:e].double() - r).norm() / r.norm() < tol, b


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("H,KVH,D,page", SHAPES)
def test_prefill_matches_reference(device, paged_kv, H, KVH, D, page, dtype):
    gen = torch.Generator().manual_seed(H * 1000 + page * 10 + 100_000 * DTYPE_NO[dtype])
    out, ref, cu = _run(gen, device, paged_kv, H, KVH, D, page, dtype, BATCH)
    _check(out, ref, cu, TOL[dtype])


@pytest.mark.parametrize("block_m,block_n", [(16, 32), (32, 16), (64, 64), (128, 64)])
def test_prefill_tile_shapes(device, paged_kv, block_m, block_n):
    """Key tiles wider and narrower than query tiles, and the GPU's defaults (64/64 and
    128/64 for long prompts), so the CPU also covers the GPU's tiling of the same batch."""
    gen = torch.Generator().manual_seed(block_m * 1000 + block_n)
    batch = [(0, 37), (13, 20), (45, 1), (61, 3), (29, 30), (100, 0)]
    out, ref, cu = _run(gen, device, paged_kv, 4, 2, 32, 4, torch.float32, batch,
                        block_m=block_m, block_n=block_n)
    _check(out, ref, cu, 1e-5)


@pytest.mark.parametrize("page,block_n", [(32, 16), (16, 64), (1, 16)])
def test_prefill_page_against_tile(device, paged_kv, page, block_n):
    """The two ways a key tile finds its pages: a tile of whole pages takes one table entry per
    page and 32-bit offsets; a page wider than the tile, one entry per key and 64-bit offsets."""
    gen = torch.Generator().manual_seed(page * 100 + block_n)
    batch = [(0, 70), (40, 33), (77, 1), (5, 90)]
    out, ref, cu = _run(gen, device, paged_kv, 8, 2, 32, page, torch.float32, batch,
                        block_m=16, block_n=block_n)
    _check(out, ref, cu, 1e-5)


def test_prefill_chunked_equals_whole(device, paged_kv):
    """The same prompt, whole and as chunks after cached context, gives the reference both ways
    (the chunks in one batch, each seeing all keys up to itself)."""
    gen = torch.Generator().manual_seed(77)
    H, KVH, D, page = 4, 2, 32, 8
    L = 53
    chunks = [(0, 21), (21, 17), (38, 15)]  # chunk boundaries off the page and tile grid
    # One shared cache: every chunk's table points at the same pages (a prefix-cache hit).
    k_cache, v_cache, bt = paged_kv(gen, [L], page, KVH, D, torch.float32, device)
    q = torch.randn(L, H, D, generator=gen).to(device)
    sl = torch.tensor([c + n for c, n in chunks], dtype=torch.int32, device=device)
    cu = torch.tensor([0, 21, 38, 53], dtype=torch.int32, device=device)
    out_chunks = paged_prefill_attention(q, k_cache, v_cache, bt.expand(3, -1).contiguous(), cu, sl, 21,
                                         D ** -0.5, out=torch.full_like(q, float("nan")))
    out_whole = paged_prefill_attention(q, k_cache, v_cache, bt, cu[[0, 3]], sl[2:], L, D ** -0.5,
                                        out=torch.full_like(q, float("nan")))
    ref = paged_prefill_attention_ref(q, k_cache, v_cache, bt, cu[[0, 3]], sl[2:], D ** -0.5)
    assert (out_chunks.double() - ref).norm() / ref.norm() < 1e-5
    assert (out_whole.double() - ref).norm() / ref.norm() < 1e-5


def test_prefill_strided_q_and_out(device, paged_kv):
    """q as the model passes it (a view into packed qkv rows), out a view into a larger buffer:
    the launcher must use the strides, and write nothing outside the view."""
    gen = torch.Generator().manual_seed(3)
    H, KVH, D, page = 4, 2, 32, 4
    batch = [(10, 19), (0, 5), (3, 1)]
    T = sum(n for _, n in batch)
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=gen).to(device)
    q = qkv.split([H * D, KVH * D, KVH * D], dim=-1)[0].view(T, H, D)
    assert not q.is_contiguous()
    buf = torch.full((T, H + 2, D), float("nan"), device=device)
    out, ref, cu = _run(gen, device, paged_kv, H, KVH, D, page, torch.float32, batch, q=q, out=buf[:, 1:H + 1])
    _check(out, ref, cu, 1e-5)
    assert buf[:, 0].isnan().all() and buf[:, H + 1].isnan().all()


def test_prefill_empty(device):
    q = torch.empty(0, 4, 16, device=device)
    kc = torch.zeros(2, 4, 2, 16, device=device)
    out = paged_prefill_attention(q, kc, kc, torch.zeros(1, 1, dtype=torch.int32, device=device),
                                  torch.zeros(2, dtype=torch.int32, device=device),
                                  torch.zeros(1, dtype=torch.int32, device=device), 0, 0.25)
    assert out.shape == (0, 4, 16)


# Real sizes (CUDA only): head_dim 128, 32 q / 8 kv heads, pages of 16, thousands of tokens.
REAL_BATCHES = {
    "long": [(0, 2000), (1500, 700), (3, 1), (4000, 1), (333, 517), (0, 1), (4095, 129)],  # block_m 128
    "short": [(1000, 64), (17, 1), (2047, 33), (0, 64), (5000, 7)],  # max q_len 64: block_m 64
}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("which", list(REAL_BATCHES))
def test_prefill_real_size(device, paged_kv, dtype, which):
    gen = torch.Generator().manual_seed(4321 + DTYPE_NO[dtype] + len(which))
    out, ref, cu = _run(gen, device, paged_kv, 32, 8, 128, 16, dtype, REAL_BATCHES[which])
    _check(out, ref, cu, TOL[dtype])


@needs_cuda
@pytest.mark.parametrize("H,KVH,D,page", [(64, 8, 128, 16), (28, 4, 128, 32), (16, 16, 64, 16), (12, 2, 80, 16)])
def test_prefill_real_size_shapes(device, paged_kv, H, KVH, D, page):
    """Other real head layouts: GQA 8 and 7, MHA, head_dim 80."""
    gen = torch.Generator().manual_seed(H * 1000 + D)
    batch = [(0, 1100), (700, 300), (2, 1), (129, 77), (3000, 1)]
    out, ref, cu = _run(gen, device, paged_kv, H, KVH, D, page, torch.bfloat16, batch)
    _check(out, ref, cu, 1e-2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="SDPA's fused GPU backends: needs CUDA"))])
@pytest.mark.parametrize("T", [1, 37, 300, 1000, 4096])
@pytest.mark.parametrize("strided", [False, True])
def test_sdpa_plain_prompt_path(T, strided, device):
    """The backend's plain-prompt path (SDPA, cuDNN first; padded to ``sdpa_padded_len``) on the
    layouts the model hands it: q/k/v as views of one packed qkv tensor. Reference: float64
    causal attention over the real tokens only. (The CPU checks the padding, at float32.)"""
    from kvserve.layers.triton_attention import _sdpa_causal
    H, KVH, D = (32, 8, 128) if device == "cuda" else (6, 2, 32)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(T)
    qkv = torch.randn(T, (H + 2 * KVH) * D, device=device, dtype=dtype, generator=gen)
    q, k, v = qkv.split([H * D, KVH * D, KVH * D], dim=-1)
    q, k, v = q.view(T, H, D), k.view(T, KVH, D), v.view(T, KVH, D)
    if not strided:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = _sdpa_causal(q, k, v, D ** -0.5)
    assert out.shape == (T, H, D)
    kk = k.double().repeat_interleave(H // KVH, dim=1)
    vv = v.double().repeat_interleave(H // KVH, dim=1)
    att = torch.einsum("qhd,khd->hqk", q.double(), kk) * D ** -0.5
    att = att.masked_fill(torch.ones(T, T, device=device, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", att.softmax(-1), vv)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < (1e-2 if device == "cuda" else 1e-5), f"T={T} strided={strided}: rel err {err:.3e}"


def test_sdpa_padded_lengths_are_few_and_close():
    """At most 1/8 (or 64 tokens) longer than the prompt, never shorter, and eight lengths per
    doubling: cuDNN builds a plan per length it meets."""
    from kvserve.layers.triton_attention import sdpa_padded_len
    lens = [sdpa_padded_len(t) for t in range(1, 8193)]
    assert all(p >= t and p - t <= max(63, t // 8) for t, p in zip(range(1, 8193), lens))
    assert len(set(lens)) <= 40 and max(lens) == 8192
    assert len({sdpa_padded_len(t) for t in range(8193, 16385)}) == 8

"""Sliding-window paged attention: the decode and prefill kernels with a ``window`` against their
float64 references (each query sees its last ``window`` keys, itself included).

Besides the NaN traps of ``build_paged_kv`` (slots no sequence owns), every key before the first
key tile a kernel may read is NaN too: a key before the window that enters the sum, or (prefill)
a whole tile before the window read without a mask, gives NaN."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvserve.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402
from kvserve.kernels.prefill_attention import paged_prefill_attention, paged_prefill_attention_ref  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # interpreter internals
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]  # -inf - -inf, masked

BLOCK_N = 16


def _poison_before(k_cache, v_cache, bt, b: int, first: int, page: int) -> None:
    """NaN in sequence ``b``'s keys and values before position ``first``."""
    pos = torch.arange(first)
    pages, within = bt[b, pos // page].long(), pos % page
    k_cache[pages, within] = float("nan")
    v_cache[pages, within] = float("nan")


@pytest.mark.parametrize("window", [1, 5, 16, 37])
@pytest.mark.parametrize("H,KVH,page,splits", [(4, 1, 4, 1), (4, 2, 8, 3), (2, 2, 16, 5)])
def test_decode_window_matches_reference(device, paged_kv, rel, window, H, KVH, page, splits):
    gen = torch.Generator().manual_seed(window * 100 + page + splits)
    D, seq_lens = 32, [37, 0, 1, 100, 64, 20]
    k_cache, v_cache, bt = paged_kv(gen, seq_lens, page, KVH, D, torch.float32, device)
    for b, L in enumerate(seq_lens):  # the keys before the window's first tile never count
        _poison_before(k_cache, v_cache, bt, b, max(0, L - window) // BLOCK_N * BLOCK_N, page)
    q = (torch.randn(len(seq_lens), H, D, generator=gen) * 1.5).to(device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(q, k_cache, v_cache, bt, sl, D ** -0.5, splits=splits, block_n=BLOCK_N,
                                 out=torch.full_like(q, float("nan")), window=window)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, bt, sl, D ** -0.5, window=window)
    assert not ref.isnan().any()  # (the reference reads only the window)
    for b, L in enumerate(seq_lens):
        if L:
            assert rel(out[b], ref[b]) < 1e-5, (b, L)
        else:
            assert (out[b] == 0).all()
    if window < 37:  # the window changes the answer
        full = paged_decode_attention_ref(q, k_cache.nan_to_num(), v_cache.nan_to_num(), bt, sl, D ** -0.5)
        assert rel(out[0], full[0]) > 1e-3


# (cached context, new tokens): a plain prompt, chunks after context (off the page and tile
# grid), a decode row riding along, an empty row.
BATCH = [(0, 45), (13, 20), (70, 1), (29, 30), (6, 0), (50, 17)]


@pytest.mark.parametrize("window", [1, 7, 16, 40])
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (16, 32), (32, 16)])
def test_prefill_window_matches_reference(device, paged_kv, window, block_m, block_n):
    gen = torch.Generator().manual_seed(window * 1000 + block_m + block_n)
    H, KVH, D, page = 4, 2, 32, 8
    seq_lens = [c + n for c, n in BATCH]
    k_cache, v_cache, bt = paged_kv(gen, seq_lens, page, KVH, D, torch.float32, device)
    for b, (ctx, _) in enumerate(BATCH):  # before the first query's window, rounded to a key tile
        _poison_before(k_cache, v_cache, bt, b, max(0, ctx - window + 1) // block_n * block_n, page)
    q_lens = [n for _, n in BATCH]
    cu = torch.zeros(len(BATCH) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = (torch.randn(sum(q_lens), H, D, generator=gen) * 1.5).to(device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = paged_prefill_attention(q, k_cache, v_cache, bt, cu.to(device), sl, max(q_lens), D ** -0.5,
                                  out=torch.full_like(q, float("nan")), block_m=block_m, block_n=block_n,
                                  window=window)
    ref = paged_prefill_attention_ref(q, k_cache.nan_to_num(), v_cache.nan_to_num(), bt, cu, sl, D ** -0.5,
                                      window=window)
    assert not out.isnan().any()
    for b in range(len(BATCH)):
        s, e = int(cu[b]), int(cu[b + 1])
        if e > s:
            r = ref[s:e]
            assert (out[s:e].double() - r).norm() / r.norm() < 1e-5, b
    if window < 40:  # the window changes the answer
        full = paged_prefill_attention_ref(q, k_cache.nan_to_num(), v_cache.nan_to_num(), bt, cu, sl, D ** -0.5)
        assert (out.double() - full).norm() / full.norm() > 1e-3


def test_window_reference_matches_sdpa(device):
    """The references' window against PyTorch's SDPA with a sliding mask built from positions."""
    gen = torch.Generator().manual_seed(5)
    H, D, L, window = 2, 16, 40, 9
    q, k, v = (torch.randn(L, H, D, generator=gen).to(device) for _ in range(3))
    pos = torch.arange(L, device=device)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                            v.transpose(0, 1), attn_mask=mask).transpose(0, 1)
    bt = torch.arange(L, dtype=torch.int32, device=device)[None, :]  # pages of one key
    cu = torch.tensor([0, L], dtype=torch.int32)
    sl = torch.tensor([L], dtype=torch.int32)
    got = paged_prefill_attention_ref(q, k.reshape(L, 1, H, D), v.reshape(L, 1, H, D),
                                      bt, cu, sl, D ** -0.5, window=window)
    assert (got - want.double()).abs().max() < 1e-5
    last = paged_decode_attention_ref(q[-1:], k.reshape(L, 1, H, D), v.reshape(L, 1, H, D), bt, sl, D ** -0.5,
                                      window=window)
    assert (last[0] - want[-1].double()).abs().max() < 1e-5

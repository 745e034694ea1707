"""Streaming KV eviction in the paged decode and prefill kernels (``streaming=``) against a
float64 softmax over exactly the keys each query keeps under its ``kv_budget``: the sink blocks
and the blocks from ``kv_eviction.recent_start`` of its position on, causally.

The evicted blocks' table entries point at a spare page that is all NaN (as the engine's NULL
entries name no block of the request's): a kernel that reads an evicted key's value, even to
mask it, gives NaN. A batch mixes budgets with sequences that have none, so one launch serves
both; budgets of one to a few recent blocks put the evicted span inside one key tile, across
tiles and next to the sinks."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernelutil import ATTENTION_TOL as TOL  # noqa: E402
from kernelutil import needs_cuda  # noqa: E402

from kvserve.kernels.decode_attention import paged_decode_attention  # noqa: E402
from kvserve.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from kvserve.kv_eviction import SINK_BLOCKS, recent_start  # noqa: E402
from kvserve.layers.triton_attention import streaming_spans  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # interpreter internals
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]  # -inf - -inf, masked


def budget_of(recent: int | None, page: int) -> int | None:
    """The budget that keeps ``recent`` blocks beside the sinks (None: no budget); the extra
    token checks that the kernels round it down to whole blocks as the cache manager does."""
    return None if recent is None else (SINK_BLOCKS + recent) * page + 1


def kept_ref(q, k_cache, v_cache, table, L: int, budget: int | None, page: int, scale: float):
    """q: [ql, H, D], the last ql of L positions: each query's softmax over the keys it keeps,
    in float64, gathered through ``table`` (the sequence's blocks before any eviction)."""
    ql, H, D = q.shape
    kvh = k_cache.shape[2]
    n = torch.arange(L, device=q.device)
    k = k_cache[table[n // page].long(), n % page].double().repeat_interleave(H // kvh, dim=1)
    v = v_cache[table[n // page].long(), n % page].double().repeat_interleave(H // kvh, dim=1)
    qpos = list(range(L - ql, L))
    keep = n[None, :] <= torch.tensor(qpos, device=q.device)[:, None]
    if budget is not None:
        first = torch.tensor([recent_start(budget, page, p) for p in qpos], device=q.device)
        keep &= ((n // page)[None, :] < SINK_BLOCKS) | ((n // page)[None, :] >= first[:, None])
    att = torch.einsum("qhd,lhd->hql", q.double(), k) * scale
    att = att.masked_fill(~keep[None], float("-inf"))
    return torch.einsum("hql,lhd->qhd", att.softmax(-1), v)


def evict(bt: torch.Tensor, b: int, budget: int | None, pos: int, page: int) -> int:
    """Point sequence ``b``'s blocks that the query at ``pos`` (and every later one) no longer
    sees at the table's last column, an all-NaN spare page (``build_paged_kv``). Returns how
    many."""
    if budget is None:
        return 0
    stop = recent_start(budget, page, pos)
    bt[b, SINK_BLOCKS:stop] = bt[b, -1]
    return max(0, stop - SINK_BLOCKS)


def run_decode(device, paged_kv, H, KVH, D, page, seq_lens, recents, dtype=torch.float32, **launch):
    gen = torch.Generator().manual_seed(H * 100 + page * 10 + len(seq_lens))
    budgets = [budget_of(r, page) for r in recents]
    k_cache, v_cache, bt = paged_kv(gen, seq_lens, page, KVH, D, dtype, device)
    full_bt = bt.clone()
    evicted = sum(evict(bt, b, budgets[b], L - 1, page) for b, L in enumerate(seq_lens) if L)
    q = (torch.randn(len(seq_lens), H, D, generator=gen) * 1.5).to(dtype).to(device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(q, k_cache, v_cache, bt, sl, D ** -0.5, out=torch.full_like(q, float("nan")),
                                 streaming=streaming_spans(budgets, page, device), **launch)
    refs = [kept_ref(q[b:b + 1], k_cache, v_cache, full_bt[b], L, budgets[b], page, D ** -0.5)[0] if L else None
            for b, L in enumerate(seq_lens)]
    return out, refs, evicted


# (q heads, kv heads, head_dim, page, splits, key tile): GQA 4 and 1; the sink block smaller
# than a tile (page 4), a tile of its own (page 16) and half of one (page 8); one split and
# several (more than some sequences have tiles); tiles of several pages.
DECODE = [(4, 1, 32, 4, 1, 16), (4, 2, 32, 4, 3, 16), (2, 2, 16, 8, 5, 16), (4, 2, 32, 16, 2, 16),
          (4, 2, 32, 4, 2, 32)]
# Context lengths with recent blocks kept per sequence (None: no budget): ragged, empty, a single
# key, page and tile multiples, a budget that evicts nothing yet.
SEQ_LENS = [37, 0, 1, 100, 64, 20, 45, 9, 130]
RECENTS = [1, None, 2, 3, 1, 2, None, 1, 4]


@pytest.mark.parametrize("H,KVH,D,page,splits,block_n", DECODE)
def test_decode_streaming_matches_kept_keys(device, paged_kv, rel, H, KVH, D, page, splits, block_n):
    out, refs, evicted = run_decode(device, paged_kv, H, KVH, D, page, SEQ_LENS, RECENTS, splits=splits,
                                    block_n=block_n)
    assert evicted > 0
    for b, ref in enumerate(refs):
        if ref is None:
            assert (out[b] == 0).all()
        else:
            assert not ref.isnan().any()
            assert rel(out[b], ref) < 1e-5, (b, SEQ_LENS[b], RECENTS[b])


def test_decode_streaming_fused_rope_write(device, paged_kv, rel):
    """The fused RoPE + KV write (``rope=``) with streaming: the split holding the last key is
    the last one, after the skipped span; it stores the step's key and value and reads them."""
    from kvserve.kernels.common import RopeWrite
    from kvserve.kernels.rope_kv_write import rope_kv_write_ref
    from kvserve.layers.rotary import RotaryEmbedding
    gen = torch.Generator().manual_seed(77)
    H, KVH, D, page = 4, 2, 32, 4
    seq_lens, recents = [37, 0, 100, 21], [1, None, 2, None]
    budgets = [budget_of(r, page) for r in recents]
    kc, vc, bt = paged_kv(gen, seq_lens, page, KVH, D, torch.float32, device)
    full_bt = bt.clone()
    B = len(seq_lens)
    rope = RotaryEmbedding(D, 256, 10000.0).to(device)
    positions = torch.tensor([max(L - 1, 0) for L in seq_lens], device=device)
    slots = torch.tensor([int(bt[b, (L - 1) // page]) * page + (L - 1) % page if L else -1
                          for b, L in enumerate(seq_lens)], device=device)
    for b, L in enumerate(seq_lens):
        if L:
            evict(bt, b, budgets[b], L - 1, page)
    keep = slots >= 0
    kc.view(-1, KVH, D)[slots[keep]] = float("nan")  # the step's keys and values are not in yet
    vc.view(-1, KVH, D)[slots[keep]] = float("nan")
    q, k, v = ((torch.randn(B, n, D, generator=gen) * 2).to(device) for n in (H, KVH, KVH))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    qr, _ = rope_kv_write_ref(q.clone(), k.clone(), v.clone(), positions, slots, rope.cos, rope.sin, kc_ref, vc_ref)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = torch.full_like(q, float("nan"))
    for splits in (1, 3):
        paged_decode_attention(q, kc, vc, bt, sl, D ** -0.5, splits=splits, out=out, block_n=16,
                               rope=RopeWrite(positions, slots, k, v, rope.cos, rope.sin),
                               streaming=streaming_spans(budgets, page, device))
        assert torch.equal(kc.nan_to_num(), kc_ref.nan_to_num()) and torch.equal(vc.nan_to_num(), vc_ref.nan_to_num())
        for b, L in enumerate(seq_lens):
            if L:
                ref = kept_ref(qr[b:b + 1], kc_ref, vc_ref, full_bt[b], L, budgets[b], page, D ** -0.5)[0]
                assert rel(out[b], ref) < 1e-5, (splits, b)
            else:
                assert (out[b] == 0).all()


def run_prefill(device, paged_kv, H, KVH, D, page, batch, recents, dtype=torch.float32, **tiles):
    """batch: (cached context, new tokens) per sequence. The blocks evicted before the step are
    those the first new query no longer sees (``KVCacheManager.evict_streaming``)."""
    gen = torch.Generator().manual_seed(H * 1000 + page * 10 + len(batch))
    budgets = [budget_of(r, page) for r in recents]
    q_lens = [n for _, n in batch]
    seq_lens = [c + n for c, n in batch]
    k_cache, v_cache, bt = paged_kv(gen, seq_lens, page, KVH, D, dtype, device)
    full_bt = bt.clone()
    evicted = sum(evict(bt, b, budgets[b], c, page) for b, (c, n) in enumerate(batch) if n)
    cu = torch.zeros(len(batch) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = (torch.randn(sum(q_lens), H, D, generator=gen) * 1.5).to(dtype).to(device)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    out = paged_prefill_attention(q, k_cache, v_cache, bt, cu.to(device), sl, max(q_lens), D ** -0.5,
                                  out=torch.full_like(q, float("nan")),
                                  streaming=streaming_spans(budgets, page, device), **tiles)
    cu = cu.tolist()
    refs = [kept_ref(q[cu[b]:cu[b + 1]], k_cache, v_cache, full_bt[b], L, budgets[b], page, D ** -0.5)
            if cu[b + 1] > cu[b] else None for b, L in enumerate(seq_lens)]
    return out, refs, cu, evicted


# (cached context, new tokens) with recent blocks kept: a plain prompt whose later queries lose
# their early keys, chunks after evicted context (off the page and tile grid), a decode row
# riding along, a sequence without a budget, an empty row, a short prompt inside its budget, and
# a recent span long enough that query tiles read whole key tiles after its edge.
BATCH = [(0, 45), (13, 20), (70, 1), (29, 30), (6, 0), (50, 17), (0, 9), (64, 40)]
BATCH_RECENTS = [2, 1, 3, None, 1, 4, 1, 10]


@pytest.mark.parametrize("page", [4, 8])
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (16, 32), (32, 16)])
def test_prefill_streaming_matches_kept_keys(device, paged_kv, rel, page, block_m, block_n):
    out, refs, cu, evicted = run_prefill(device, paged_kv, 4, 2, 32, page, BATCH, BATCH_RECENTS,
                                         block_m=block_m, block_n=block_n)
    assert evicted > 0
    for b, ref in enumerate(refs):
        if ref is not None:
            assert not ref.isnan().any()
            assert rel(out[cu[b]:cu[b + 1]], ref) < 1e-5, (b, BATCH[b], BATCH_RECENTS[b])


def test_streaming_changes_the_answer(device, paged_kv, rel):
    """The kept-key reference is not full attention: a budget changes the output."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, bt = paged_kv(gen, [60], 4, 2, 32, torch.float32, device)
    q = torch.randn(10, 4, 32, generator=gen).to(device)
    kept = kept_ref(q, k_cache, v_cache, bt[0], 60, budget_of(2, 4), 4, 32 ** -0.5)
    full = kept_ref(q, k_cache, v_cache, bt[0], 60, None, 4, 32 ** -0.5)
    assert rel(kept, full) > 1e-2


def test_lone_prompt_past_its_budget_takes_the_prefill_kernel():
    """SDPA's causal kernel serves a lone whole prompt only while every query sees every key."""
    from kvserve.layers.forward_context import AttentionMetadata
    from kvserve.layers.triton_attention import sdpa_kernel, step_phase
    if sdpa_kernel is None:
        pytest.skip("this torch has no sdpa_kernel: every prompt takes the prefill kernel")

    def phase(L, budget):
        meta = AttentionMetadata(torch.zeros(L), torch.zeros(1, 8), [L], [L], [0, L], 4, kv_budgets=[budget])
        meta.max_query_len = L
        return step_phase(meta)
    assert phase(8, 9) == "prompt" and phase(9, 9) == "prefill"  # 9 // 4 = 2 blocks of full attention
    assert phase(30, None) == "prompt" and phase(30, 33) == "prompt" and phase(33, 33) == "prefill"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("splits", [None, 1, 16])
def test_decode_streaming_real_size(device, paged_kv, rel, dtype, splits):
    seq_lens = [4097, 1, 0, 2048, 1000, 3333, 16, 777]
    recents = [31, 3, None, 63, 7, None, 1, 15]  # budgets of 512 .. 1024 tokens over 16-token blocks
    launch = {} if splits is None else {"splits": splits}
    out, refs, evicted = run_decode(device, paged_kv, 32, 8, 128, 16, seq_lens, recents, dtype, **launch)
    assert evicted > 0
    for b, ref in enumerate(refs):
        if ref is None:
            assert (out[b] == 0).all()
        else:
            assert rel(out[b], ref) < TOL[dtype], b


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_prefill_streaming_real_size(device, paged_kv, rel, dtype):
    """The GPU's tiles (128 x 128 for long chunks, 64 x 64 otherwise) and 16-token blocks."""
    batch = [(0, 1500), (3000, 512), (1200, 1), (777, 300), (0, 64)]
    recents = [31, 15, 63, None, 3]
    out, refs, cu, evicted = run_prefill(device, paged_kv, 32, 8, 128, 16, batch, recents, dtype)
    assert evicted > 0
    for b, ref in enumerate(refs):
        if ref is not None:
            assert rel(out[cu[b]:cu[b + 1]], ref) < TOL[dtype], b

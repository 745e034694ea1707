"""Paged prefill attention for a variable-length batch: FlashAttention-style tiles with an
online softmax, causal, reading every key through the block table.

Sequence ``b`` brings ``q_len = cu_q[b+1] - cu_q[b]`` new tokens and has ``seq_len`` keys after
this step (its K/V already written to the cache); the new tokens sit at positions
``seq_len - q_len ..`` and each sees every key up to its own position. So one kernel serves a
plain prompt, a prompt chunk after earlier chunks (chunked prefill) and a prompt whose prefix
came from the prefix cache. Decode rows (q_len 1) may ride along in a mixed batch.

Grid ``(query tiles, batch, heads)``. Key tiles that lie wholly before the tile's first query
run without a mask; only the diagonal tiles are masked. With a sliding ``window`` (each query
sees its last ``window`` keys, itself included) a query tile skips the key tiles before its
first query's window and masks those its queries see only in part:

    keys   0 ........ lo ....... edge ........ unmasked_end ...... kv_end
           skipped    | window edge | whole tiles |    diagonal      |
                        (masked)                     (causal + window)

With streaming eviction (``common.Streaming``: each query sees the sink keys and a recent span
that starts on a page boundary) the sink tiles come first, masked, then the same layout from the
tile holding the first query's first recent key; the evicted span between is skipped, and its
keys in the edge tiles are masked out of the loads too (their table entries may name no block):

    keys   0 .. SINK ........ lo ....... edge ........ unmasked_end ...... kv_end
           sinks | skipped    | recent edge | whole tiles |   diagonal       |
         (masked)               (masked)                    (causal + streaming)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.common import LOG2E, Streaming, dot_precision, online_softmax_step
from kvserve.kernels.kv_quant import compressed_tile, fast_path, fit_tile, kernel_args, load_kv_tile, tile_scales


# The block tables' width changes from step to step; specialized, each new value that is 1 or a
# multiple of 16 would compile the kernel again in a request's time.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(Q, KC, VC, KS, VS, RES, O, BT, CU_Q, SEQ_LENS, RECENT, RSLOTS,
                    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh,
                    s_ksb, s_kst, s_ksh, s_vsb, s_vst, s_vsh, s_rt, s_rh,
                    stride_ot, stride_oh, stride_bt,
                    scale_log2,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PREC: tl.constexpr, FMT: tl.constexpr, BITS: tl.constexpr, QGROUP: tl.constexpr,
                    FAST: tl.constexpr, VD: tl.constexpr, IDX32: tl.constexpr, WINDOW: tl.constexpr,
                    SINK: tl.constexpr, STREAM: tl.constexpr):
    # Query tiles in reverse: the causal tiles with the most keys start first and the light ones
    # fill the tail.
    mt = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start = tl.load(CU_Q + b)
    q_len = tl.load(CU_Q + b + 1) - q_start
    if mt * BLOCK_M >= q_len:
        return
    seq_len = tl.load(SEQ_LENS + b)
    ctx = seq_len - q_len
    kvh = h // GROUP
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    d = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:  # a constant mask: the loads stay unpredicated and vectorised
        dmask = tl.full([BLOCK_D], 1, tl.int1)
    else:
        dmask = d < HEAD_DIM
    tok = (q_start + rows).to(tl.int64)
    q = tl.load(Q + tok[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    qpos = ctx + rows
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = BT + b.to(tl.int64) * stride_bt
    full_end = (seq_len // PAGE) * PAGE  # compressed KIVI keys: later ones are in the residual
    res_row = 0
    if FMT == 3:
        res_row = tl.load(RSLOTS + b).to(tl.int64) * PAGE * s_rt
    DT = Q.dtype.element_ty

    first_q = ctx + mt * BLOCK_M
    kv_end = tl.minimum(seq_len, first_q + BLOCK_M)
    unmasked_end = (first_q // BLOCK_N) * BLOCK_N  # key tiles every query of the tile sees whole
    lo = 0  # the first key tile any query of the tile sees (after the sinks, streaming)
    edge = 0  # from here on, up to unmasked_end, every query of the tile sees whole key tiles
    recent = 0
    r_first = 0
    if STREAM:
        # Query p sees the keys before SINK and from (p // PAGE + 1) * PAGE - recent on. The sink
        # tiles before the diagonal come first (masked: the last may reach into the evicted
        # span); then the tiles from the one holding the first query's first recent key (its
        # keys before that are masked, and unloaded: their blocks may be evicted) to the one
        # from which every query of the tile sees whole tiles; the tiles between are skipped.
        recent = tl.load(RECENT + b)
        r_first = tl.maximum((first_q // PAGE + 1) * PAGE - recent, SINK)
        last_q = tl.minimum(first_q + BLOCK_M, seq_len) - 1
        r_last = tl.maximum((last_q // PAGE + 1) * PAGE - recent, SINK)
        sink_end = tl.minimum((SINK + BLOCK_N - 1) // BLOCK_N * BLOCK_N, unmasked_end)
        for s in range(0, sink_end, BLOCK_N):
            m_i, l_i, acc = _masked_step(
                q, m_i, l_i, acc, KC, VC, KS, VS, RES, bt_row, s, qpos, kv_end, d, dmask, kvh, full_end, res_row,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, s_ksb, s_kst, s_ksh, s_vsb, s_vst,
                s_vsh, s_rt, s_rh, scale_log2, FMT, BITS, QGROUP, HEAD_DIM, PAGE, BLOCK_N, PREC, DT, VD, FAST,
                WINDOW, recent, r_first, SINK, STREAM)
        lo = tl.maximum(sink_end, (r_first // BLOCK_N) * BLOCK_N)
        edge = tl.minimum(tl.cdiv(r_last, BLOCK_N) * BLOCK_N, unmasked_end)
        for s in range(lo, edge, BLOCK_N):
            m_i, l_i, acc = _masked_step(
                q, m_i, l_i, acc, KC, VC, KS, VS, RES, bt_row, s, qpos, kv_end, d, dmask, kvh, full_end, res_row,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, s_ksb, s_kst, s_ksh, s_vsb, s_vst,
                s_vsh, s_rt, s_rh, scale_log2, FMT, BITS, QGROUP, HEAD_DIM, PAGE, BLOCK_N, PREC, DT, VD, FAST,
                WINDOW, recent, r_first, SINK, STREAM)
    if WINDOW > 0:
        lo = (tl.maximum(first_q - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
        last_q = tl.minimum(first_q + BLOCK_M, seq_len) - 1
        edge = tl.minimum(tl.cdiv(tl.maximum(last_q - WINDOW + 1, 0), BLOCK_N) * BLOCK_N, unmasked_end)
        for s in range(lo, edge, BLOCK_N):
            m_i, l_i, acc = _masked_step(
                q, m_i, l_i, acc, KC, VC, KS, VS, RES, bt_row, s, qpos, kv_end, d, dmask, kvh, full_end, res_row,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, s_ksb, s_kst, s_ksh, s_vsb, s_vst,
                s_vsh, s_rt, s_rh, scale_log2, FMT, BITS, QGROUP, HEAD_DIM, PAGE, BLOCK_N, PREC, DT, VD, FAST,
                WINDOW, recent, r_first, SINK, STREAM)
    for s in range(tl.maximum(edge, lo), unmasked_end, BLOCK_N):
        n = s + tl.arange(0, BLOCK_N)
        if FAST:  # (the tile lies in one block: its entry is read in _compressed_step)
            m_i, l_i, acc = _compressed_step(
                q, m_i, l_i, acc, KC, VC, KS, VS, RES, bt_row, s, (n % PAGE).to(tl.int64), n, n >= 0,
                (n >= 0)[None, :], kvh, full_end, res_row, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                stride_vh, s_ksb, s_kst, s_ksh, s_vsb, s_vst, s_vsh, s_rt, s_rh, scale_log2, FMT, BITS, HEAD_DIM,
                PAGE, BLOCK_N, PREC, DT, VD)
        else:
            if IDX32:
                # One table entry per page of the tile, broadcast to its keys, and 32-bit offsets
                # (the launcher checks the cache fits): the key/value addresses cost a third fewer
                # integer ops on the tensor cores' warps.
                pg = tl.load(bt_row + s // PAGE + tl.arange(0, BLOCK_N // PAGE))
                page = tl.reshape(tl.broadcast_to(pg[:, None], [BLOCK_N // PAGE, PAGE]), [BLOCK_N])
                within = n % PAGE
            else:
                page = tl.load(bt_row + n // PAGE).to(tl.int64)
                within = (n % PAGE).to(tl.int64)
            kmask = dmask[None, :]  # whole tiles: every key is valid
            k, v = load_kv_tile(KC, VC, KS, VS, RES, page, within, n, kvh, d, kmask, full_end, res_row,
                                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, s_ksb, s_kst,
                                s_ksh, s_vsb, s_vst, s_vsh, s_rt, s_rh, FMT, BITS, QGROUP, DT, VD)
            qk = tl.dot(q, tl.trans(k), input_precision=PREC)
            m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, scale_log2, PREC)
    for s in range(unmasked_end, kv_end, BLOCK_N):  # the diagonal: causal mask
        m_i, l_i, acc = _masked_step(
            q, m_i, l_i, acc, KC, VC, KS, VS, RES, bt_row, s, qpos, kv_end, d, dmask, kvh, full_end, res_row,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, s_ksb, s_kst, s_ksh, s_vsb, s_vst,
            s_vsh, s_rt, s_rh, scale_log2, FMT, BITS, QGROUP, HEAD_DIM, PAGE, BLOCK_N, PREC, DT, VD, FAST, WINDOW,
            recent, r_first, SINK, STREAM)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(O + tok[:, None] * stride_ot + h * stride_oh + d[None, :], out.to(O.dtype.element_ty),
             mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _masked_step(q, m_i, l_i, acc, KC, VC, KS, VS, RES, bt_row, s, qpos, kv_end, d, dmask, kvh, full_end, res_row,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, s_ksb, s_kst, s_ksh, s_vsb, s_vst,
                 s_vsh, s_rt, s_rh, scale_log2, FMT: tl.constexpr, BITS: tl.constexpr, QGROUP: tl.constexpr,
                 HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
                 DT: tl.constexpr, VD: tl.constexpr, FAST: tl.constexpr, WINDOW: tl.constexpr,
                 recent, r_first, SINK: tl.constexpr, STREAM: tl.constexpr):
    """The key tile at ``s`` that some queries of the tile see only in part: each query sees the
    keys up to its position ``qpos`` (and after ``qpos - WINDOW`` with a window; streaming, those
    before ``SINK`` and from its recent span's start on, which is at ``r_first`` or later)."""
    n = s + tl.arange(0, BLOCK_N)
    nmask = n < kv_end
    within = (n % PAGE).to(tl.int64)
    if STREAM:  # no query of the tile sees the evicted keys: they are not loaded
        nmask = nmask & ((n < SINK) | (n >= r_first))
    seen = (n[None, :] <= qpos[:, None]) & nmask[None, :]
    if WINDOW > 0:
        seen = seen & (n[None, :] > qpos[:, None] - WINDOW)
    if STREAM:
        seen = seen & ((n[None, :] < SINK) | (n[None, :] >= ((qpos // PAGE + 1) * PAGE - recent)[:, None]))
    if FAST:
        m_i, l_i, acc = _compressed_step(
            q, m_i, l_i, acc, KC, VC, KS, VS, RES, bt_row, s, within, n, nmask, seen, kvh,
            full_end, res_row, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            s_ksb, s_kst, s_ksh, s_vsb, s_vst, s_vsh, s_rt, s_rh, scale_log2, FMT, BITS, HEAD_DIM, PAGE,
            BLOCK_N, PREC, DT, VD)
    else:
        page = tl.load(bt_row + n // PAGE, mask=nmask, other=0).to(tl.int64)
        kmask = nmask[:, None] & dmask[None, :]
        k, v = load_kv_tile(KC, VC, KS, VS, RES, page, within, n, kvh, d, kmask, full_end, res_row,
                            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, s_ksb, s_kst,
                            s_ksh, s_vsb, s_vst, s_vsh, s_rt, s_rh, FMT, BITS, QGROUP, DT, VD)
        qk = tl.dot(q, tl.trans(k), input_precision=PREC)
        qk = tl.where(seen, qk, float("-inf"))
        m_i, l_i, acc = online_softmax_step(qk, v, m_i, l_i, acc, scale_log2, PREC)  # padding rows may see no key
    return m_i, l_i, acc


@triton.jit
def _compressed_step(q, m_i, l_i, acc, KC, VC, KS, VS, RES, bt_row, s, within, n, nmask, valid, kvh, full_end,
                     res_row, s_kcb, s_kct, s_kch, s_vcb, s_vct, s_vch, s_ksb, s_kst, s_ksh, s_vsb, s_vst, s_vsh,
                     s_rt, s_rh, scale_log2, FMT: tl.constexpr, BITS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     PAGE: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, DT: tl.constexpr,
                     VD: tl.constexpr):
    """The compressed fast path's tile at key ``s`` (it lies in one block), its scales loaded
    in place (a prefill tile's dots hide their latency; decode fetches them a tile ahead)."""
    tp = tl.load(bt_row + s // PAGE).to(tl.int64)
    ks, vs = tile_scales(KS, VS, tp, within, nmask, kvh, s + BLOCK_N - 1 < full_end,
                         s_ksb, s_kst, s_ksh, s_vsb, s_vst, s_vsh, FMT, HEAD_DIM)
    return compressed_tile(q, m_i, l_i, acc, KC, VC, RES, within, n, nmask, valid, kvh, tp, s + BLOCK_N, full_end,
                           res_row, ks, vs, s_kcb, s_kct, s_kch, s_vcb, s_vct, s_vch, s_rt, s_rh,
                           scale_log2, FMT, BITS, HEAD_DIM, PREC, DT, VD)


def paged_prefill_attention(q: torch.Tensor, k_cache, v_cache, block_tables: torch.Tensor,
                            cu_q: torch.Tensor, seq_lens: torch.Tensor,
                            max_query_len: int, scale: float, out: torch.Tensor | None = None,
                            block_m: int | None = None, block_n: int | None = None,
                            num_warps: int | None = None, num_stages: int | None = None,
                            res_slots: torch.Tensor | None = None, window: int | None = None,
                            streaming: Streaming | None = None) -> torch.Tensor:
    """q: [T, H, D] packed by ``cu_q`` ([B + 1] int32); seq_lens: [B] int32 (keys after this
    step); caches as for ``paged_decode_attention`` (a compressed layer's ``KVViews`` as
    ``k_cache``); ``window``: each query sees only its last ``window`` keys (None: all);
    ``streaming``: the sinks and recent spans of streaming KV eviction (uncompressed caches, no
    window; None: every key). Returns [T, H, D]."""
    assert window is None or window >= 1
    assert streaming is None or (window is None and isinstance(k_cache, torch.Tensor))
    T, H, D = q.shape
    views = None if isinstance(k_cache, torch.Tensor) else k_cache
    cache_args, fmt_kw = kernel_args(views, k_cache, v_cache)
    if views is not None:
        page, KVH = views.fmt.block_size, views.fmt.num_kv_heads
    else:
        nb, page, KVH, _ = k_cache.shape
    B = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if T == 0:
        return out
    on_gpu = q.is_cuda
    if block_m is None:
        block_m = 128 if on_gpu and max_query_len > 64 else (64 if on_gpu else 16)
    if block_n is None:  # 128: the fastest on an H200 for heads of 128
        block_n = (128 if D <= 128 and max_query_len > 64 and q.element_size() == 2 else 64) if on_gpu else 16
    fast = fast_path(fmt_kw, D)
    block_n = fit_tile(views, block_n, fast)
    if num_warps is None:
        num_warps = 8 if block_m >= 128 else 4
    if num_stages is None:
        num_stages = 3 if on_gpu else 1
    # 32-bit key offsets and whole pages per tile: an uncompressed cache whose farthest element
    # lies under 2^31 elements from its start (strided views included)
    idx32 = (views is None and block_n % page == 0 and _last_offset(k_cache) < 2 ** 31
             and _last_offset(v_cache) < 2 ** 31)
    grid = (triton.cdiv(max_query_len, block_m), B, H)
    kc, vc, ks, vs, res, *strides = cache_args
    rs = res_slots if res_slots is not None else seq_lens
    recent = streaming.recent if streaming is not None else seq_lens  # (a placeholder without)
    _prefill_kernel[grid](
        q, kc, vc, ks, vs, res, out, block_tables, cu_q, seq_lens, recent, rs,
        q.stride(0), q.stride(1), *strides, out.stride(0), out.stride(1),
        block_tables.stride(0), scale * LOG2E,
        GROUP=H // KVH, HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D), PAGE=page,
        BLOCK_M=block_m, BLOCK_N=block_n, PREC=dot_precision(q.dtype), FMT=fmt_kw["FMT"],
        BITS=fmt_kw["BITS"], QGROUP=fmt_kw["GROUP"], FAST=fast, VD=fmt_kw["VD"],
        IDX32=idx32, WINDOW=window or 0, SINK=streaming.sink if streaming is not None else 0,
        STREAM=streaming is not None, num_warps=num_warps, num_stages=num_stages)
    return out


def _last_offset(t: torch.Tensor) -> int:
    return sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


def paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, cu_q, seq_lens, scale, window=None):
    """Plain PyTorch in float64, one sequence at a time."""
    T, H, D = q.shape
    page, KVH = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(T, H, D, dtype=torch.float64, device=q.device)
    for b in range(seq_lens.shape[0]):
        s, e, L = int(cu_q[b]), int(cu_q[b + 1]), int(seq_lens[b])
        ql = e - s
        if ql == 0:
            continue
        n = torch.arange(L, device=q.device)
        pages = block_tables[b, n // page].long()
        k = k_cache[pages, n % page].double().repeat_interleave(H // KVH, dim=1)
        v = v_cache[pages, n % page].double().repeat_interleave(H // KVH, dim=1)
        att = torch.einsum("qhd,lhd->hql", q[s:e].double(), k) * scale
        qpos = torch.arange(L - ql, L, device=q.device)
        hidden = n[None, None, :] > qpos[None, :, None]
        if window is not None:
            hidden |= n[None, None, :] <= qpos[None, :, None] - window
        att = att.masked_fill(hidden, float("-inf"))
        out[s:e] = torch.einsum("hql,lhd->qhd", att.softmax(-1), v)
    return out

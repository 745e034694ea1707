"""Paged decode attention, flash-decoding style: one query token per sequence.

Grid ``(batch, kv_heads, num_splits)``. A program owns one KV head of one sequence and one
slice of its context: it reads each K/V page of that slice once for all the query heads that
share the KV head (GQA: the group is the M side of the dot), keeps an online softmax, and writes
a partial output and its log-sum-exp; the last program of a (sequence, KV head) to finish
merges the splits (an atomic counter per pair says which), so one kernel does it all. With one
split the program writes the output directly.

With a sliding ``window`` (each query sees its last ``window`` keys, itself included) the splits
cut only the key tiles from the one holding the window's first key: the keys before are never
read, and those of that first tile before the window are masked. With streaming eviction
(``common.Streaming``) they cut the sink tiles and the tiles from the one holding the recent
span's first key, skipping those between: an evicted key is never read, and those of the tiles
at the span's edges are masked.

Splitting the context lets a small batch with long contexts fill the GPU; the split count is a
function of the batch size alone (``num_splits``), so a CUDA graph captured for a batch size
serves every context length. A sequence of length 0 (graph padding) yields zeros.
"""
from __future__ import annotations

import math
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from kvserve.kernels.common import (
    LOG2E,
    RopeWrite,
    SplitCounters,
    Streaming,
    dot_precision,
    merge_group,
    merge_splits,
    online_softmax_step,
    pdl_kw,
    sm_count,
    wait_inputs,
)
from kvserve.kernels.kv_quant import (
    compressed_tile,
    fast_path,
    fit_tile,
    kernel_args,
    load_kv_tile,
    rope_rotate,
    tile_scales,
)

# Launch options with the fused RoPE + KV write: no FMA contraction, or the rotation would round
# once fewer than ``rope_kv_write`` does (``rope_rotate``)
ROPE_LAUNCH = MappingProxyType({"enable_fp_fusion": False})


@triton.jit
def _split_range(SEQ_LENS, RECENT, b, split, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                 WINDOW: tl.constexpr, PAGE: tl.constexpr, SINK: tl.constexpr, STREAM: tl.constexpr):
    """Sequence ``b``'s length, its splits with keys (``active``: a short context leaves the rest
    empty), split ``split``'s key range [start, end), the first key the query sees after the
    sinks, and (streaming) where the skipped span starts (``hole``) and its length (``gap``).
    Streaming, the splits cut the key tiles with the span cut out: ``start`` and ``end`` count
    keys before ``hole`` as they are and the later ones ``gap`` keys earlier (``_tile_keys``)."""
    seq_len = tl.load(SEQ_LENS + b)
    first = 0
    if WINDOW > 0:
        first = tl.maximum(seq_len - WINDOW, 0)
    lo = (first // BLOCK_N) * BLOCK_N
    hole = 0
    gap = 0
    if STREAM:
        # The query (at seq_len - 1) sees [0, SINK) and [first, seq_len); the tiles wholly
        # between, from the sinks' last tile on, are skipped (none when the two overlap).
        first = tl.maximum(((seq_len - 1) // PAGE + 1) * PAGE - tl.load(RECENT + b), SINK)
        hole = (SINK + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        gap = tl.maximum((first // BLOCK_N) * BLOCK_N - hole, 0)
    n_chunks = tl.cdiv(seq_len - gap - lo, BLOCK_N)
    per = tl.maximum(tl.cdiv(n_chunks, NUM_SPLITS), 1)
    start = lo + split * per * BLOCK_N
    end = tl.minimum(start + per * BLOCK_N, seq_len - gap)
    return seq_len, tl.cdiv(n_chunks, per), start, end, first, hole, gap


@triton.jit
def _tile_keys(s, w, end, first, hole, gap, SINK: tl.constexpr, STREAM: tl.constexpr):
    """The keys of the tile at ``s`` (in ``_split_range``'s count) and which the query sees:
    from ``first`` on (the window's or the recent span's start) and, streaming, the sinks."""
    n = s + w
    nmask = (n < end) & (n >= first)
    if STREAM:
        n = n + tl.where(s >= hole, gap, 0)  # (a tile lies wholly before or after the hole)
        nmask = (s + w < end) & ((n >= first) | (n < SINK))
    return n, nmask


@triton.jit
def _attend_tile(q, k, v, nmask, m_i, l_i, acc, scale_log2, PREC: tl.constexpr):
    """One tile of keys and values ([N, D]; keys outside ``nmask`` masked) into the online softmax."""
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)
    qk = tl.where(nmask[None, :], qk, float("-inf"))
    return online_softmax_step(qk, v, m_i, l_i, acc, scale_log2, PREC)


@triton.jit
def _decode_split_kernel(Q, KC, VC, KS, VS, RES, BT, SEQ_LENS, RECENT, RSLOTS, O, OP, LSEP, COUNTS,
                         POS, SLOT, KN, VN, COS, SIN, stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cos,
                         stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
                         stride_vb, stride_vs, stride_vh,
                         s_ksb, s_kst, s_ksh, s_vsb, s_vst, s_vsh, s_rt, s_rh, stride_bt,
                         stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                         scale_log2,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, PREC: tl.constexpr,
                         FMT: tl.constexpr, BITS: tl.constexpr, QGROUP: tl.constexpr, FAST: tl.constexpr,
                         VD: tl.constexpr, HEADS: tl.constexpr, MERGE_S: tl.constexpr,
                         ROPE: tl.constexpr, USE_PDL: tl.constexpr, WINDOW: tl.constexpr,
                         SINK: tl.constexpr, STREAM: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    w = tl.arange(0, BLOCK_N)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    bt_row = BT + b.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if ROPE:
        # RoPE + KV write fused in (uncompressed caches). The previous kernel wrote only q, k, v
        # of this step: the lengths, tables, positions (the host's) and the cache (this kernel
        # is the only writer of its layer's) are read before waiting for it, the split's first
        # tile included, so a short context's loads overlap the QKV product's tail. The step's
        # own key is patched into that tile from registers; later tiles are read after its
        # store.
        DT: tl.constexpr = Q.dtype.element_ty
        seq_len, active, start, end, first, hole, gap = _split_range(SEQ_LENS, RECENT, b, split, BLOCK_N,
                                                                     NUM_SPLITS, WINDOW, PAGE, SINK, STREAM)
        if split >= tl.maximum(active, 1):
            return
        n0, nmask0 = _tile_keys(start, w, end, first, hole, gap, SINK, STREAM)
        page0 = tl.load(bt_row + n0 // PAGE, mask=nmask0, other=0).to(tl.int64)
        tile_k, tile_v = load_kv_tile(KC, VC, KS, VS, RES, page0, n0 % PAGE, n0, kvh, d,
                                      nmask0[:, None] & dmask[None, :], 0, 0, stride_kb, stride_ks, stride_kh,
                                      stride_vb, stride_vs, stride_vh, s_ksb, s_kst, s_ksh, s_vsb, s_vst, s_vsh,
                                      s_rt, s_rh, FMT, BITS, QGROUP, DT, VD)  # (plain: no residual, 0s)
        pos = tl.load(POS + b).to(tl.int64)
        partner = (d + HEAD_DIM // 2) % HEAD_DIM
        sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
        cos = tl.load(COS + pos * stride_cos + d, mask=dmask, other=0.0).to(DT).to(tl.float32)
        sin = tl.load(SIN + pos * stride_cos + d, mask=dmask, other=0.0).to(DT).to(tl.float32)
        wait_inputs(USE_PDL)
        q = rope_rotate(Q, b.to(tl.int64) * stride_qb, heads[:, None] * stride_qh, d[None, :], partner[None, :],
                        sign[None, :], cos[None, :], sin[None, :], gmask[:, None] & dmask[None, :], DT)
        if split == active - 1:  # this step's token is the last key: its split stores it
            slot = tl.load(SLOT + b).to(tl.int64)
            if slot >= 0:
                k_new = rope_rotate(KN, b.to(tl.int64) * stride_knt, kvh * stride_knh, d, partner, sign, cos, sin,
                                    dmask, DT).to(KC.dtype.element_ty)
                v_new = tl.load(VN + b.to(tl.int64) * stride_vnt + kvh * stride_vnh + d, mask=dmask,
                                other=0.0).to(VC.dtype.element_ty)
                slot_page, slot_within = slot // PAGE, slot % PAGE
                tl.store(KC + slot_page * stride_kb + slot_within * stride_ks + kvh * stride_kh + d, k_new,
                         mask=dmask)
                tl.store(VC + slot_page * stride_vb + slot_within * stride_vs + kvh * stride_vh + d, v_new,
                         mask=dmask)
                mine = (n0 == seq_len - 1)[:, None]  # (the tile was read before the store)
                tile_k = tl.where(mine, k_new[None, :], tile_k)
                tile_v = tl.where(mine, v_new[None, :], tile_v)
                if end - start > BLOCK_N:
                    tl.debug_barrier()  # (the later tiles' loads come after the store)
        m_i, l_i, acc = _attend_tile(q, tile_k, tile_v, nmask0, m_i, l_i, acc, scale_log2, PREC)
        loop_start = start + BLOCK_N
    else:
        wait_inputs(USE_PDL)
        # q is asked for with the length (not after it): one memory latency less on a short
        # context's critical path; an empty split's load is wasted, and cheap
        q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
        seq_len, active, start, end, first, hole, gap = _split_range(SEQ_LENS, RECENT, b, split, BLOCK_N,
                                                                     NUM_SPLITS, WINDOW, PAGE, SINK, STREAM)
        if split >= tl.maximum(active, 1):
            return  # an empty split: no partial, no vote (split 0 of an empty sequence writes zeros)
        loop_start = start

    full_end = (seq_len // PAGE) * PAGE  # compressed KIVI keys: later ones are in the residual
    res_row = 0
    if FMT == 3:
        res_row = tl.load(RSLOTS + b).to(tl.int64) * PAGE * s_rt
    if FAST:  # (never with ROPE)
        # Compressed, a scale per token and head (per channel for KIVI keys): the scales are
        # folded around the dots. A tile lies in one block. The loop fetches the next tile's
        # scales, and the block of the one after, while it works on this one: Triton pipelines
        # no 2-byte load, and waited for in their own tile they cost a memory latency per tile.
        # The codes' block is read again in the loop, from the table: the pipeliner prefetches
        # loads addressed through an in-loop load, and does not prefetch the codes when their
        # block comes from the previous iteration.
        tp = tl.load(bt_row + start // PAGE, mask=start < end, other=0).to(tl.int64)
        ks, vs = tile_scales(KS, VS, tp, start % PAGE + w, start + w < end, kvh, start + BLOCK_N - 1 < full_end,
                             s_ksb, s_kst, s_ksh, s_vsb, s_vst, s_vsh, FMT, HEAD_DIM)
        tp1 = tl.load(bt_row + (start + BLOCK_N) // PAGE, mask=start + BLOCK_N < end, other=0).to(tl.int64)
        for s in range(start, end, BLOCK_N):
            n = s + w
            nmask = (n < end) & (n >= first)
            s1 = s + BLOCK_N
            s2 = s1 + BLOCK_N
            tp2 = tl.load(bt_row + s2 // PAGE, mask=s2 < end, other=0).to(tl.int64)
            ks1, vs1 = tile_scales(KS, VS, tp1, s1 % PAGE + w, s1 + w < end, kvh, s2 - 1 < full_end,
                                   s_ksb, s_kst, s_ksh, s_vsb, s_vst, s_vsh, FMT, HEAD_DIM)
            m_i, l_i, acc = compressed_tile(
                q, m_i, l_i, acc, KC, VC, RES, n % PAGE, n, nmask, nmask[None, :], kvh,
                tl.load(bt_row + s // PAGE).to(tl.int64), s1, full_end, res_row, ks, vs,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, s_rt, s_rh,
                scale_log2, FMT, BITS, HEAD_DIM, PREC, Q.dtype.element_ty, VD)
            ks, vs, tp1 = ks1, vs1, tp2
    else:
        for s in range(loop_start, end, BLOCK_N):
            n, nmask = _tile_keys(s, w, end, first, hole, gap, SINK, STREAM)
            page = tl.load(bt_row + n // PAGE, mask=nmask, other=0).to(tl.int64)
            within = (n % PAGE).to(tl.int64)
            kmask = nmask[:, None] & dmask[None, :]
            k, v = load_kv_tile(KC, VC, KS, VS, RES, page, within, n, kvh, d, kmask, full_end, res_row,
                                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, s_ksb, s_kst,
                                s_ksh, s_vsb, s_vst, s_vsh, s_rt, s_rh, FMT, BITS, QGROUP, Q.dtype.element_ty, VD)
            m_i, l_i, acc = _attend_tile(q, k, v, nmask, m_i, l_i, acc, scale_log2, PREC)
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    omask = gmask[:, None] & dmask[None, :]
    o_ptrs = O + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :]
    if NUM_SPLITS == 1:  # (compile-time: the partial buffers are placeholders then)
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=omask)
    elif active <= 1:  # the only split with keys: its output is final
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=omask)
    else:
        tl.store(OP + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :],
                 out, mask=omask)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(LSEP + b.to(tl.int64) * stride_lb + heads * stride_lh + split, lse, mask=gmask)
        # The last split of (sequence, kv head) to finish merges them all, so no second kernel:
        # the barrier orders every thread's stores before the counter's release, the acquire
        # makes the other splits' stores visible, and the merger resets the counter for the
        # next launch.
        tl.debug_barrier()
        counter = COUNTS + b * tl.num_programs(1) + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel") == active - 1:
            merge_group(OP, LSEP, O, b.to(tl.int64), kvh, active, stride_pb, stride_ph, stride_ps, stride_lb,
                        stride_lh, stride_ob, stride_oh, GROUP, HEADS, HEAD_DIM, BLOCK_D, MERGE_S)
            tl.atomic_xchg(counter, 0)


def register_cap(eight_bit: bool, fused: bool, num_warps: int, programs: int, sms: int) -> int | None:
    """Registers per thread to cap a CUDA launch at (None: ptxas's choice), tuned on an H200.
    8-bit caches at 2 warps: 160, a little under ptxas's choice and faster. The fused RoPE + KV
    write in a grid of more than two programs per SM: 128. Uncapped, the write takes ptxas to 154
    registers, 3 programs of 4 warps fit an SM instead of 4, and a grid of more than one wave runs
    in two; capped (an 8-byte spill) the fused kernel is as fast as the separate write kernel plus
    attention, or faster. Smaller grids (batch 1) need no more than 2 programs per SM."""
    if eight_bit and num_warps == 2:
        return 160
    if fused and programs > 2 * sms:
        return 128
    return None


def split_per_sm(fmt) -> int:
    """Programs per SM to aim for (``num_splits``) with a cache of format ``fmt`` (a KVFormat;
    None: uncompressed). 8-bit caches: 16, their small programs (2 warps) hide the dequantizing
    loads' latency by numbers; otherwise 2. (``kivi_decode`` cuts its splits itself, from the
    lengths.)"""
    if fmt is None or not fmt.quantized or fmt.kivi:
        return 2
    return 16


def num_splits(batch: int, num_kv_heads: int, device: torch.device, per_sm: int = 2) -> int:
    """Enough programs to fill the GPU ``per_sm`` times over (``split_per_sm``); a function of the
    batch only (graph-safe)."""
    return max(1, min(32, math.ceil(per_sm * sm_count(device) / max(1, batch * num_kv_heads))))


def decode_splits(fmt, batch: int, num_kv_heads: int, device: torch.device) -> int:
    """The splits the engine launches for a decode batch over a cache of format ``fmt`` (a
    KVFormat; None: uncompressed): ``num_splits`` at ``split_per_sm(fmt)``. The KIVI int4 layers
    that ``kivi_decode`` takes ignore them (its splits follow the lengths, ``kivi_decode._work``);
    one it turns away at run time (a GQA group over 8) takes the Triton kernel at these."""
    return num_splits(batch, num_kv_heads, device, split_per_sm(fmt))


def paged_decode_attention(q: torch.Tensor, k_cache, v_cache, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, splits: int | None = None,
                           out: torch.Tensor | None = None, block_n: int | None = None,
                           res_slots: torch.Tensor | None = None, num_warps: int | None = None,
                           num_stages: int = 2, maxnreg: int | None = None, rope: RopeWrite | None = None,
                           pdl: bool = True, counters: SplitCounters | None = None,
                           window: int | None = None, streaming: Streaming | None = None) -> torch.Tensor:
    """q: [B, H, D]; caches: [num_blocks, page, KVH, D], or a compressed layer's ``KVViews`` as
    ``k_cache`` (``v_cache`` None; KIVI formats also need ``res_slots`` [B] int32);
    block_tables: [B, max_pages] int; seq_lens: [B] int (keys per sequence, this step's token
    included); ``block_n``, ``num_warps``, ``num_stages``, ``maxnreg`` (registers per thread):
    the launch, None for the tuned defaults. ``rope`` (uncompressed caches): this step's tokens,
    unrotated: ``rope_kv_write``'s work done in this kernel (q rotated in registers, left as it
    is in memory; k rotated and k, v stored at each slot >= 0 by the split that reads that key,
    which must be the sequence's last, ``seq_lens - 1``). ``pdl``: programmatic dependent launch
    where the GPU has it. ``counters``: the splits' counters (the caller's, kept across launches
    and graph captures; None: fresh ones for this launch). ``window``: each query sees only its
    last ``window`` keys (None: all). ``streaming``: the sinks and recent spans of streaming
    KV eviction (uncompressed caches, no window; None: every key). Returns [B, H, D]."""
    assert window is None or window >= 1
    assert streaming is None or (window is None and isinstance(k_cache, torch.Tensor))
    B, H, D = q.shape
    views = None if isinstance(k_cache, torch.Tensor) else k_cache
    cache_args, fmt_kw = kernel_args(views, k_cache, v_cache)
    if views is not None:
        page, KVH = views.fmt.block_size, views.fmt.num_kv_heads
        k_cache = views.k_codes
    else:
        nb, page, KVH, Dk = k_cache.shape
        assert Dk == D
    assert H % KVH == 0 and q.stride(-1) == 1
    group = H // KVH
    if splits is None:
        splits = num_splits(B, KVH, q.device)
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_G = max(16, triton.next_power_of_2(group))
    fast = fast_path(fmt_kw, D)
    eight_bit = fast and fmt_kw["FMT"] != 3
    # 8-bit on CUDA: 64-key tiles (a block's worth by default), 2 warps, 2 stages, 160 registers
    # (and split_per_sm's 16 programs per SM): the best on an H200 (batch 32 x 32k, GQA 32/8).
    # Larger blocks keep 64-key tiles: 2 warps hold a tile in registers.
    if block_n is None and eight_bit and q.is_cuda:
        block_n = 64 if D <= 128 else 32
    elif block_n is None:
        block_n = max(16, min(64, page * 4)) if D <= 128 else 32
    if num_warps is None:  # (the compressed fast path, KIVI too: 2 warps are faster than 4)
        num_warps = 2 if fast and q.is_cuda else 4
    programs, sms = B * KVH * splits, sm_count(q.device)
    if maxnreg is None and q.is_cuda:
        maxnreg = register_cap(eight_bit, rope is not None, num_warps, programs, sms)
    block_n = fit_tile(views, block_n, fast)
    small_grid = programs <= 2 * sms and maxnreg is None
    heads, merge_s = merge_splits(group, BLOCK_D, num_warps, small_grid)
    merge_s = min(merge_s, triton.next_power_of_2(splits))
    if splits > 1:
        op = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
        lsep = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
        counts = (counters or SplitCounters()).get(q.device, B * KVH)
    else:
        op, lsep, counts = out, seq_lens, seq_lens  # unused placeholders
    kc, vc, ks, vs, res, *strides = cache_args
    rs = res_slots if res_slots is not None else seq_lens
    recent = streaming.recent if streaming is not None else seq_lens  # (a placeholder without)
    if rope is not None:
        assert views is None, "the fused RoPE + KV write takes an uncompressed cache"
        k_new, v_new, cos, sin = rope.k, rope.v, rope.cos, rope.sin
        assert k_new.shape == v_new.shape == (B, KVH, D) and k_new.stride(-1) == v_new.stride(-1) == 1
        assert D % 2 == 0 and cos.shape == sin.shape and cos.stride() == sin.stride() and cos.stride(-1) == 1
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        rope_args = [rope.positions, rope.slots, k_new, v_new, cos, sin,
                     k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), cos.stride(0)]
    else:
        rope_args = [seq_lens, seq_lens, q, q, q, q, 0, 0, 0, 0, 0]  # (placeholders)
    _decode_split_kernel[(B, KVH, splits)](
        q, kc, vc, ks, vs, res, block_tables, seq_lens, recent, rs, out, op, lsep, counts, *rope_args,
        q.stride(0), q.stride(1), *strides, block_tables.stride(0),
        out.stride(0), out.stride(1),
        op.stride(0) if splits > 1 else 0, op.stride(1) if splits > 1 else 0,
        op.stride(2) if splits > 1 else 0,
        lsep.stride(0) if splits > 1 else 0, lsep.stride(1) if splits > 1 else 0,
        scale * LOG2E,
        GROUP=group, BLOCK_G=BLOCK_G, HEAD_DIM=D, BLOCK_D=BLOCK_D, PAGE=page, BLOCK_N=block_n,
        NUM_SPLITS=splits, PREC=dot_precision(q.dtype),
        FMT=fmt_kw["FMT"], BITS=fmt_kw["BITS"], QGROUP=fmt_kw["GROUP"], FAST=fast, VD=fmt_kw["VD"],
        HEADS=heads, MERGE_S=merge_s, ROPE=rope is not None, WINDOW=window or 0,
        SINK=streaming.sink if streaming is not None else 0, STREAM=streaming is not None, num_warps=num_warps,
        num_stages=num_stages,
        **({'maxnreg': maxnreg} if maxnreg else {}), **pdl_kw(q, pdl), **(ROPE_LAUNCH if rope is not None else {}))
    return out


def paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale, window=None):
    """Plain PyTorch in float64: gather each sequence's keys through its table (its last
    ``window`` with a window); zeros for len 0."""
    B, H, D = q.shape
    page, KVH = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(B, H, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        L = int(seq_lens[b])
        if L == 0:
            continue
        n = torch.arange(0 if window is None else max(0, L - window), L, device=q.device)
        pages = block_tables[b, n // page].long()
        k = k_cache[pages, n % page].double().repeat_interleave(H // KVH, dim=1)  # [L, H, D]
        v = v_cache[pages, n % page].double().repeat_interleave(H // KVH, dim=1)
        att = torch.einsum("hd,lhd->hl", q[b].double(), k) * scale
        out[b] = torch.einsum("hl,lhd->hd", att.softmax(-1), v)
    return out

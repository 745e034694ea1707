"""What the kernels share: launch options (exact float32 dots, programmatic dependent launch), the
device's facts (compute capability and SM count, each cached per device), the device functions
several kernels inline (PDL's wait, the online-softmax step, the merge of split partials), the
split kernels' counters, and the arguments of a RoPE + KV write done inside a decode kernel.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kvserve.kernels import interpreting

LOG2E = 1.4426950408889634


def dot_precision(dtype: torch.dtype) -> str:
    """float32 operands get exact products (``ieee``), not Triton's default tf32: the fp32 path
    exists to be exact."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def capability(device: torch.device) -> int:
    """The CUDA device's compute capability, major version."""
    return _capability(_index(device))


def sm_count(device: torch.device) -> int:
    """The device's SMs (4 for the CPU's interpreter runs)."""
    if device.type != "cuda":
        return 4
    return _sm_count(_index(device))


# -- programmatic dependent launch ------------------------------------------------------------
# (Hopper and later): a kernel launched with it may start while the kernel before it in the
# stream is finishing. Every such kernel calls ``wait_inputs`` before it reads anything an earlier
# kernel writes, or writes anything one reads (only read-only weights may be touched earlier), so
# overlapping is safe with any neighbour.
def launch_pdl(t: torch.Tensor, pdl: bool = True) -> bool:
    return pdl and t.is_cuda and not interpreting() and capability(t.device) >= 9


def pdl_kw(t: torch.Tensor, pdl: bool = True) -> dict:
    """Launch options of a kernel that takes ``USE_PDL``: PDL only where it applies (asked for,
    Hopper or later; the interpreter's launcher has no such option)."""
    return {"USE_PDL": True, "launch_pdl": True} if launch_pdl(t, pdl) else {"USE_PDL": False}


@triton.jit
def wait_inputs(USE_PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible,
    then let the next kernel launch (it waits in turn before touching our output)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# -- the online softmax of the attention kernels ------------------------------------------------
@triton.jit
def online_softmax_probs(qk, m_i, l_i, scale):
    """The softmax half of a step: for raw scores ``qk`` ([M, N], masked keys at -inf) and
    ``scale`` (> 0: the softmax scale times log2(e)) returns the new running max (of the scaled
    scores), the new sum, the tile's probabilities ``p`` and the factor ``alpha`` that rescales
    what was accumulated so far. The scale is applied inside exp2's argument (one FMA per score;
    the row max commutes with a positive scale). A row that has seen no key yet (all -inf) keeps
    p = 0 instead of turning NaN."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale)
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp2(qk * scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def online_softmax_step(qk, v, m_i, l_i, acc, scale, PREC: tl.constexpr):
    """Fold one tile of raw scores ``qk`` and its values ``v`` ([N, D]) into the running max
    ``m_i``, sum ``l_i`` and output ``acc``."""
    m_new, l_i, p, alpha = online_softmax_probs(qk, m_i, l_i, scale)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


# -- split decode: the merge of the partials and its counters ----------------------------------
@triton.jit
def merge_group(OP, LSEP, O, b, kvh, n_splits, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob,
                stride_oh, GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                BLOCK_D: tl.constexpr, MERGE_S: tl.constexpr):
    """Combine the ``n_splits`` partials of KV head ``kvh``'s query heads by their log-sum-exps,
    ``HEADS`` heads at a time (all of a group up to 1,024 channels): (head, channel) flattened
    into one axis, the splits taken ``MERGE_S`` at a time with an online softmax over them, so a
    short context's merge is a round trip to L2 or a few, not one per head. Each column loads its
    head's log-sum-exp itself (a broadcast load). Loads bypass L1 (``.cg``): the other splits
    wrote them from other SMs."""
    c = tl.arange(0, HEADS * BLOCK_D)
    dd = c % BLOCK_D
    s = tl.arange(0, MERGE_S)
    for h0 in range(0, GROUP, HEADS):
        hi = h0 + c // BLOCK_D
        h = kvh * GROUP + hi
        cmask = (hi < GROUP) & (dd < HEAD_DIM)
        m = tl.full([HEADS * BLOCK_D], float("-inf"), tl.float32)
        total = tl.zeros([HEADS * BLOCK_D], tl.float32)
        acc = tl.zeros([HEADS * BLOCK_D], tl.float32)
        for s0 in range(0, n_splits, MERGE_S):
            ok = ((s0 + s) < n_splits)[:, None] & cmask[None, :]
            lse = tl.load(LSEP + b * stride_lb + h[None, :] * stride_lh + (s0 + s)[:, None], mask=ok,
                          other=float("-inf"), cache_modifier=".cg")
            parts = tl.load(OP + b * stride_pb + h[None, :] * stride_ph + (s0 + s)[:, None] * stride_ps
                            + dd[None, :], mask=ok, other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, tl.max(lse, 0))
            base = tl.where(m_new > float("-inf"), m_new, 0.0)  # (a column with no keys yet stays at zero)
            alpha = tl.where(m > float("-inf"), tl.exp2(m - base), 0.0)
            w = tl.where(lse > float("-inf"), tl.exp2(lse - base[None, :]), 0.0)
            total = total * alpha + tl.sum(w, 0)
            acc = acc * alpha + tl.sum(parts * w, 0)
            m = m_new
        out = acc / tl.where(total > 0, total, 1.0)
        tl.store(O + b * stride_ob + h * stride_oh + dd, out.to(O.dtype.element_ty), mask=cmask)


def merge_splits(group: int, block_d: int, num_warps: int, small_grid: bool = False) -> tuple[int, int]:
    """(HEADS, MERGE_S) of ``merge_group``: heads per pass (the group padded to a power of two, at
    most 1,024 channels: a large group, as in multi-query attention, takes several passes), and
    splits per round such that each [MERGE_S, HEADS * BLOCK_D] tile holds 16 values per thread
    (more raises the split kernel's registers above what its loop needs), or 64 in a grid of at
    most 2 programs per SM with no register cap (``small_grid``: small batches, where registers
    limit nothing and a 16-split merge takes one round instead of four). Under the 8-bit formats'
    register cap 64 would spill."""
    heads = min(triton.next_power_of_2(group), max(1, 1024 // block_d))
    return heads, max(1, (64 if small_grid else 16) * 32 * num_warps // (heads * block_d))


class SplitCounters:
    """Zeroed int32 counters, one per (sequence, KV head), that the split decode kernel leaves
    zeroed: the last split of a pair to finish merges the others and resets its counter. One
    buffer per device, made outside any graph capture (the graphs' warm-up runs first) and
    replaced by a larger one for a larger batch; the outgrown one stays alive for the graphs
    captured with it. The attention backend holds one, so two engines never share counters."""

    def __init__(self):
        self._buffers: dict[torch.device, list[torch.Tensor]] = {}

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        have = self._buffers.get(device)
        if have is None or have[-1].numel() < n:
            assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), \
                "split counters must exist before graph capture"
            self._buffers.setdefault(device, []).append(torch.zeros(max(n, 1 << 16), dtype=torch.int32,
                                                                    device=device))
        return self._buffers[device][-1]


class RopeWrite(NamedTuple):
    """The step's RoPE + KV write, done by a decode attention kernel itself (its ``rope=``): each
    sequence brings one token, whose key is the sequence's last (position ``seq_len - 1``). q, k
    and v come before RoPE; q is rotated in registers and left as it is in memory, k and v are
    stored by the split that reads the sequence's last key."""
    positions: torch.Tensor  # [B] the tokens' positions
    slots: torch.Tensor  # [B] their cache slots (< 0: padding, nothing written)
    k: torch.Tensor  # [B, KVH, D]
    v: torch.Tensor  # [B, KVH, D]
    cos: torch.Tensor  # [max_positions, D], halves duplicated
    sin: torch.Tensor
    res_mapping: torch.Tensor | None = None  # [B] KIVI: the key's place in the residual (< 0: sealed now)


KEEP_ALL = 2 ** 30  # a ``Streaming.recent`` that hides no key (a sequence without a budget)


class Streaming(NamedTuple):
    """Streaming KV eviction in the attention kernels (``kvserve/kv_eviction.py``): the query at
    position ``p`` of sequence ``b`` sees the key at ``n <= p`` iff ``n < sink`` or
    ``n >= (p // page + 1) * page - recent[b]`` (``page``: the cache's block size). The keys
    between, the evicted span, are contiguous and their table entries may name no block of
    theirs: the kernels skip the key tiles wholly inside it and mask its keys out of the loads of
    the tiles at its edges, so no evicted entry's block is ever read. ``recent[b] >= KEEP_ALL``
    hides nothing (a sequence without a budget in a batch with some)."""
    sink: int  # leading keys every query keeps (the sink blocks)
    recent: torch.Tensor  # [B] int32: each sequence's recent span in keys (whole pages)

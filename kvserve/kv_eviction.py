"""KV eviction: which keys a request under a ``kv_budget`` keeps (StreamingLLM, SnapKV, H2O).

Streaming: a request keeps its first ``SINK_BLOCKS`` blocks (the attention sinks) and, per query, the last
``R = kv_budget // block_size - SINK_BLOCKS`` blocks up to the query's own; the query at position
``p`` sees the sinks and the blocks from ``recent_start(p) = max(SINK_BLOCKS, p // bs - R + 1)``:

    blocks   0 | 1  2  3  4 | 5  6  7        (kv_budget = 4 blocks, p in block 7)
             sink  freed     recent R=3

So between steps at most ``kv_budget`` tokens' KV is held (page-granular). Keys keep the
rotation of their original positions (no re-rotation). The cache manager frees the blocks before
``recent_start``; the torch attention backend masks with ``streaming_mask``, the Triton kernels
skip the freed span's key tiles and mask its edges (``kvserve.kernels.common.Streaming``). The
rule is positional; SnapKV and H2O (below) score the blocks by attention instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

SINK_BLOCKS = 1  # leading blocks a request under a budget always keeps


def kv_budget_min(block_size: int) -> int:
    """The smallest ``kv_budget``: the sink block, one recent block and the step's token."""
    return (SINK_BLOCKS + 1) * block_size + 1


def recent_start(kv_budget: int, block_size: int, pos: int) -> int:
    """The first block after the sinks that the query at ``pos`` sees under ``kv_budget``."""
    recent = kv_budget // block_size - SINK_BLOCKS
    return max(SINK_BLOCKS, pos // block_size - recent + 1)


def recent_tokens(kv_budget: int, block_size: int) -> int:
    """The recent blocks' span in tokens: the query at ``p`` sees the keys from
    ``(p // block_size + 1) * block_size - recent_tokens`` on, besides the sinks (the Triton
    kernels' form of ``recent_start``, ``kvserve.kernels.common.Streaming``)."""
    return (kv_budget // block_size - SINK_BLOCKS) * block_size


def full_attention_blocks(kv_budget: int, block_size: int) -> int:
    """Leading blocks whose every query sees every earlier key (their KV is full attention's)."""
    return kv_budget // block_size


def streaming_mask(qpos: torch.Tensor, kpos: torch.Tensor, kv_budget: int, block_size: int) -> torch.Tensor:
    """[len(qpos), len(kpos)] bool: the keys each query sees (causal, and in the sinks or from
    its ``recent_start`` block on)."""
    recent = kv_budget // block_size - SINK_BLOCKS
    start = torch.clamp(qpos // block_size - recent + 1, min=SINK_BLOCKS) * block_size
    return (kpos[None, :] <= qpos[:, None]) & ((kpos[None, :] < SINK_BLOCKS * block_size)
                                               | (kpos[None, :] >= start[:, None]))


# -- scored eviction (SnapKV, H2O) -----------------------------------------------------------
#
# A request under a budget of ``B = kv_budget // block_size`` blocks keeps its last
# ``recent_blocks`` table entries and, of the blocks before them, those with the highest score;
# the rest become NULL (their references dropped, the pool takes the block back):
#
#     blocks   0  1  2  3  4  5  6 | 7  8      (B = 6, recent 2, the step writes block 8)
#     score    9  1  7  0  8  2  5 |
#     table    k  -  k  -  k  -  k | k  k      (kept: the 3 best of 0..6, then the recent 2)
#
# Keys keep the rotation of their original positions (no re-rotation); a query attends to the
# kept keys only, causally by position. Evicting happens before a step, only when the step needs
# a block and the request holds ``B`` (or, for SnapKV, when the prompt is done): then
# ``held == B - 1`` before a step that opens a block and ``B`` otherwise, so held blocks never
# exceed ``B``. Once at the budget a step never crosses more than one block boundary
# (``KVCacheManager.step_cap``), so every eviction happens at a block boundary with the scores of
# all queries before it, however the scheduler chunks the request: recomputing after preemption
# evicts what decoding evicted.
#
# Scores (the torch attention backend accumulates them while it attends, from each query's
# softmax row; no N x N matrix is kept): summed over every global layer (every layer of a model
# without sliding windows; a sliding-window layer keeps its window, ``engine/kv_evict.py``), KV
# head and the query heads sharing it, so one kept set serves every such layer and head.
#   h2o     every query of the request adds its attention (prompt and decode); a block scores the
#           sum over its tokens; recent = B // 2 (the heavy-hitter half and the recent half).
#   snapkv  the last ``OBS_WINDOW`` prompt queries add theirs; the prompt is held whole until its
#           last token is computed, then compressed to the budget (peak: max(prompt, budget));
#           decode adds nothing. Token scores are average-pooled over ``POOL_KERNEL`` positions
#           and a block scores its best token, so a block holding a top position is kept; the
#           recent blocks cover the window. Generated tokens score 0, so past the recent blocks
#           they go first (a sliding window over the output, the prompt's selection kept).
# Block granularity is the approximation: the papers keep single tokens (per head, for SnapKV);
# a page keeps ``block_size`` neighbours of a chosen token, and the ranking is shared by heads.

SCORED = ("snapkv", "h2o")
OBS_WINDOW = 32  # SnapKV's observation window (the last prompt queries that vote)
POOL_KERNEL = 7  # SnapKV's pooling of votes over neighbouring positions


def budget_blocks(kv_budget: int, block_size: int) -> int:
    return kv_budget // block_size


def recent_blocks(policy: str, kv_budget: int, block_size: int) -> int:
    """Trailing table entries a scored request never evicts (at most ``B - 1``: one heavy block
    fits beside them)."""
    b = budget_blocks(kv_budget, block_size)
    if policy == "h2o":
        return max(1, b // 2)
    return max(1, min(-(-OBS_WINDOW // block_size), b - 1))


def score_rows(policy: str, start: int, num_new: int, num_prompt: int) -> tuple[int, int]:
    """Positions ``[lo, hi)`` of a step's queries (``start .. start + num_new``) whose attention
    adds to the request's scores (empty: ``lo >= hi``)."""
    end = start + num_new
    if policy == "h2o":
        return start, end
    return max(start, num_prompt - OBS_WINDOW), min(end, num_prompt)


def block_scores(policy: str, token_scores: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """[num_blocks] scores from per-position scores (positions past the tensor score 0)."""
    t = torch.zeros(num_blocks * block_size, dtype=torch.float32)
    n = min(len(token_scores), len(t))
    t[:n] = token_scores[:n]
    if policy == "h2o":
        return t.view(num_blocks, block_size).sum(1)
    pooled = F.avg_pool1d(t[None, None], POOL_KERNEL, stride=1, padding=POOL_KERNEL // 2,
                          count_include_pad=False)[0, 0]
    return pooled.view(num_blocks, block_size).amax(1)


def pick_victims(scores: torch.Tensor, candidates: list[int], n: int) -> list[int]:
    """The ``n`` candidate blocks (table indices) of lowest score, the oldest first on ties."""
    order = sorted(candidates, key=lambda i: (float(scores[i]), i))
    return sorted(order[:n])

"""Streaming KV eviction (StreamingLLM): which keys a request under a ``kv_budget`` keeps.

A request keeps its first ``SINK_BLOCKS`` blocks (the attention sinks) and, per query, the last
``R = kv_budget // block_size - SINK_BLOCKS`` blocks up to the query's own; the query at position
``p`` sees the sinks and the blocks from ``recent_start(p) = max(SINK_BLOCKS, p // bs - R + 1)``:

    blocks   0 | 1  2  3  4 | 5  6  7        (kv_budget = 4 blocks, p in block 7)
             sink  freed     recent R=3

So between steps at most ``kv_budget`` tokens' KV is held (page-granular). Keys keep the
rotation of their original positions (no re-rotation). The cache manager frees the blocks before
``recent_start``; the attention backend masks with ``streaming_mask``. Scoring which tokens to
keep (SnapKV, H2O) is not done: the rule is positional.
"""
from __future__ import annotations

import torch

SINK_BLOCKS = 1  # leading blocks a request under a budget always keeps


def kv_budget_min(block_size: int) -> int:
    """The smallest ``kv_budget``: the sink block, one recent block and the step's token."""
    return (SINK_BLOCKS + 1) * block_size + 1


def recent_start(kv_budget: int, block_size: int, pos: int) -> int:
    """The first block after the sinks that the query at ``pos`` sees under ``kv_budget``."""
    recent = kv_budget // block_size - SINK_BLOCKS
    return max(SINK_BLOCKS, pos // block_size - recent + 1)


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

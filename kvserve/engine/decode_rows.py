"""Steps of a few tokens per sequence run as decode steps: one row per token.

A step where sequence i brings q_i tokens after ctx_i cached ones (a speculative verify step:
its last known token and its drafts) is the same computation as a decode step of sum(q_i) rows,
row j of sequence i being one query at position ctx_i + j that sees ctx_i + j + 1 keys through
sequence i's block table:

    tokens      | a0 a1 a2 (ctx 7) | b0 b1 (ctx 4) |        prefill-shaped: 2 sequences
    query_start   0                  3               5
    seq_lens      10                 6

    rows        | a0 | a1 | a2 | b0 | b1 |                   decode-shaped: 5 rows
    positions     7    8    9    4    5                        (the same slots, the same order)
    seq_lens      8    9    10   5    6
    tables        Ta   Ta   Ta   Tb   Tb

Causality needs no mask: every layer writes all rows' K/V into the cache before any row
attends, and a row reads only up to its own length. A sliding window starts at each row's own
position, as it does for the same query in the prefill shape. The hidden states come out in
the same token order, so the logits rows (sampling, verification, prompt log-probs) are
unchanged. So the step can replay a decode CUDA graph captured by rows.

The price is KV reads: each row reads its sequence's context again, q_i times in all, where the
prefill kernel reads it once. At small batches the step is bound by weights and launches, not
by KV, so that is cheap; the speculation policy gives a sequence many drafts only at small
batches (``B * (k + 1)`` within ``verify_token_budget``), and ``MAX_TOKENS`` admits every verify
step. At long contexts and large batches the extra reads can outweigh the launches the graph
saves: ``benchmarks/speculative.py --verify-cost --context N`` measures both shapes.

KIVI caches keep the prefill shape: a token that fills a block seals it from the residual row
(``kv_cache.py``) before the step's tokens are written there, which one row cannot see of the
rows before it, and rows past the block's end would overwrite the residual its earlier rows read.
"""
from __future__ import annotations

import numpy as np

from kvserve.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from kvserve.engine.spec.policy import SpecPolicy

# The most tokens a sequence may bring for its step to run as decode rows: a verify step's
# last known token and its drafts.
MAX_TOKENS = MAX_SPECULATIVE_TOKENS + 1


def eligible(seqs: list[tuple[int, int, list[int]]]) -> bool:
    """Whether a step of ``seqs`` (num_computed, num_new, block_table) runs as decode rows: some
    sequence brings more than one token (else it is a decode step already), none more than
    ``MAX_TOKENS``, and every one has cached context (a fresh prompt keeps the prompt kernel)."""
    return (any(n > 1 for _, n, _ in seqs)
            and all(n <= MAX_TOKENS and c > 0 for c, n, _ in seqs))


def expand(positions: np.ndarray, query_start: np.ndarray,
           tables: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The decode rows of a step's host metadata (``ModelRunner._host_metadata``): the rows'
    seq_lens, query_start and block tables. Positions and slots stay as they are, per token."""
    qlens = np.diff(query_start)
    return positions + 1, np.arange(len(positions) + 1, dtype=np.int64), np.repeat(tables, qlens, axis=0)


def max_verify_rows(spec: SpeculativeConfig, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """The most rows a verify step can bring: B decoding requests with up to the policy's k
    drafts each (``SpecPolicy.k_for_batch``), within the step's token budget."""
    policy = SpecPolicy(spec)
    return max((min(b * (policy.k_for_batch(b) + 1), max_num_batched_tokens)
                for b in range(1, min(spec.max_batch, max_num_seqs) + 1)), default=0)

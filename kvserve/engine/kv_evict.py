"""Eviction of a request's blocks under its ``kv_budget``, mixed into ``KVCacheManager``.

Streaming eviction (``kv_eviction.py``): before each step, the blocks of a request with a
``kv_budget`` between its sinks and its next query's ``recent_start`` become ``NULL``: its
references are dropped, so a block shared with another request stays until its count reaches 0.
Only the first ``full_attention_blocks`` (computed before any key was hidden, so equal to full
attention's KV) enter the prefix cache, and a request is offered no more cached blocks than that.

On a model with sliding-window layers (Gemma 3) the budget bounds the global layers' KV:
group 0's table (global) decides, every other global group drops the same entries, and the local
groups keep their window (``kv_groups.py``), whatever the budget.

Scored eviction (SnapKV, H2O; ``kv_eviction.py``): before a step, a request with a ``kv_budget``
over it drops its references to its lowest-scored blocks before its recent ones (NULL entries
anywhere before them). Scores come from the runner after each step (``record_scores``). Only the
blocks fully computed before the request's first eviction enter the prefix cache (``_exact``):
a block written after it holds KV of queries that saw fewer keys than full attention, so its
hash is never registered and no other request can hit it. H2O requests take no prefix hits
(their scores need every query's attention); SnapKV requests take hits before their
observation window only. ``step_tokens`` caps a budgeted request's step so its held blocks stay
within the budget, which is also what admission asks the pool for.
"""
from __future__ import annotations

import torch

from kvserve.engine.kv_groups import NULL, held_before
from kvserve.engine.request import Request
from kvserve.kv_eviction import SINK_BLOCKS, block_scores, budget_blocks, pick_victims, recent_blocks, recent_start


class BlockEviction:
    """``tables``, ``group_tables``, ``global_groups``, ``pool``, ``block_size``, ``eviction``,
    ``_scores`` and ``_exact`` are the manager's."""

    def record_scores(self, req: Request, scores: torch.Tensor) -> None:
        """Add a step's attention scores (per key position) to ``req``'s."""
        acc = self._scores.get(req.request_id)
        if acc is None or len(acc) < len(scores):
            grown = torch.zeros(max(len(scores), 2 * len(acc) if acc is not None else 0))
            if acc is not None:
                grown[:len(acc)] = acc
            self._scores[req.request_id] = acc = grown
        acc[:len(scores)] += scores

    def evict_scored(self, req: Request) -> int:
        """Drop ``req``'s references to its lowest-scored blocks before its recent ones until it
        holds ``B - 1`` blocks before a step that opens one, ``B`` otherwise (SnapKV: only once
        its prompt is computed). Returns how many were dropped."""
        table = self.tables.get(req.request_id)
        budget, c = req.params.kv_budget, req.num_computed_tokens
        if budget is None or not table or (self.eviction == "snapkv" and c < req.num_prompt_tokens):
            return 0
        bs = self.block_size
        target = budget_blocks(budget, bs) - (1 if len(table) * bs <= c else 0)
        held = [i for i, b in enumerate(table) if b != NULL]
        if len(held) <= target:
            return 0
        protect = len(table) - recent_blocks(self.eviction, budget, bs)
        rid = req.request_id
        scores = block_scores(self.eviction, self._scores.get(rid, torch.zeros(0)), len(table), bs)
        victims = pick_victims(scores, [i for i in held if i < protect], len(held) - target)
        self._exact.setdefault(rid, c // bs)
        return self._drop(req, victims[::-1])

    def _evict(self, req: Request) -> int:
        return self.evict_streaming(req) if self.eviction == "streaming" else self.evict_scored(req)

    def _drop(self, req: Request, entries: list[int]) -> int:
        """Drop ``req``'s references to its table ``entries`` (held, in the order they are freed)
        in every global group: they hold the same entries (a model whose global layers span
        several groups, e.g. Gemma-3-27B's ten in five). Returns how many entries."""
        freed = []
        for g in self.global_groups:
            table = self.group_tables[g][req.request_id]
            freed += [table[i] for i in entries]
            for i in entries:
                table[i] = NULL
        self.pool.free(freed)
        return len(entries)

    def evict_streaming(self, req: Request) -> int:
        """Drop ``req``'s references to the blocks between its sinks and the first recent block
        its next query sees. Returns how many were dropped."""
        table = self.tables.get(req.request_id)
        if req.params.kv_budget is None or not table:
            return 0
        stop = min(recent_start(req.params.kv_budget, self.block_size, req.num_computed_tokens), len(table))
        return self._drop(req, held_before(table, stop, SINK_BLOCKS))

"""How many drafts to propose: per step from the batch, per request from its acceptance.

A decode step reads every weight to produce one token per request; a verify step with ``k``
drafts carries ``B * (k + 1)`` tokens for about the same cost while those tokens are few enough
that reading the weights still dominates. So:

- batch: ``k_batch = min(k_max, verify_token_budget // B - 1)``, and no drafts at all above
  ``max_batch`` decoding requests (``disable_by_batch_size``, by default
  ``verify_token_budget // 2``: the batch where even one draft each leaves the budget);
- request: the j-th draft is only used if the j - 1 before it are accepted, with probability
  ``a^j`` for a per-draft acceptance rate ``a`` (tracked as a moving average per request).
  Drafts stop where that falls below ``MIN_DRAFT_GAIN``; at least one is always proposed, so
  the rate keeps being measured and recovers when the text turns repetitive again.
"""
from __future__ import annotations

import math

from kvserve.config import SpeculativeConfig
from kvserve.engine.request import Request

MIN_DRAFT_GAIN = 0.2  # expected tokens a draft must bring to be proposed
EMA_WEIGHT = 0.3  # weight of the latest step in a request's acceptance rate


class SpecPolicy:
    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def k_for_batch(self, num_decoding: int) -> int:
        c = self.config
        if num_decoding == 0 or num_decoding > c.max_batch:
            return 0
        return max(1, min(c.num_speculative_tokens, c.verify_token_budget // num_decoding - 1))

    @staticmethod
    def k_for_request(req: Request, k_batch: int) -> int:
        a = req.spec_acceptance
        if a >= 1.0:
            return k_batch
        if a <= 0.0:
            return min(1, k_batch)
        return max(min(1, k_batch), min(k_batch, int(math.log(MIN_DRAFT_GAIN) / math.log(a))))

    @staticmethod
    def observe(req: Request, num_drafts: int, num_accepted: int) -> None:
        """A verify step kept ``num_accepted`` of ``num_drafts``: update the per-draft rate."""
        # The drafts checked are the accepted ones plus the first rejected one, if any.
        checked = num_accepted + (num_accepted < num_drafts)
        rate = num_accepted / checked
        req.spec_acceptance += EMA_WEIGHT * (rate - req.spec_acceptance)

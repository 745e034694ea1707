"""Speculative decoding: proposers (n-gram lookup, a draft model), the verification of drafts
(greedy and rejection sampling) and the batch-aware policy that picks how many to propose.

Drafts are more tokens behind ``num_computed_tokens``: the scheduler schedules ``1 + k`` tokens
for a request with ``k`` drafts, the runner computes logits at all ``k + 1`` positions and
verifies them, and ``Scheduler.update`` keeps the accepted run and rolls the counter back past
the rejected slots.
"""

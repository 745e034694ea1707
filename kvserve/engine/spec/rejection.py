"""Verification of drafts: which of a request's ``k`` draft tokens the target model keeps.

The target's logits at the ``k + 1`` positions of a verify step give ``p_0 .. p_k``: ``p_j`` is
the distribution of the token after the last known token and drafts ``d_1 .. d_j``, after the
request's own processing (penalties, logit_bias, min_tokens, temperature, top-k/top-p/min-p).

- Greedy: keep ``d_{j+1}`` while it equals ``argmax p_j``; the first mismatch (or, all kept, the
  position after the last draft) contributes the target's argmax. Token-identical to decoding
  without drafts.
- Sampled (Leviathan et al. 2023, Chen et al. 2023): keep ``d_{j+1}`` with probability
  ``min(1, p_j(d) / q_j(d))``; on the first rejection draw from ``max(0, p_j - q_j)``
  renormalised and stop; all kept, draw one more from ``p_k``. Each emitted token is then
  distributed exactly as ``p``. An n-gram draft is a point mass (``q_j(d) = 1``): keep it with
  probability ``p_j(d)``, on rejection draw from ``p_j`` with ``d`` removed.

Draws come from the request's own generator when seeded, so its tokens are reproducible.
"""
from __future__ import annotations

import torch

from kvserve.engine.sampler import SamplingRow, apply_logit_bias, apply_penalties, apply_top_k_top_p_min_p
from kvserve.sampling_params import MIN_TEMPERATURE


def processed_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The sampler's steps before the temperature: penalties, logit_bias, banned tokens."""
    logits = logits.float().clone()
    if any(r.repetition_penalty != 1.0 or r.presence_penalty or r.frequency_penalty for r in rows):
        apply_penalties(logits, rows)
    if any(r.logit_bias for r in rows):
        apply_logit_bias(logits, rows)
    vocab = logits.shape[-1]
    for i, r in enumerate(rows):
        if r.banned_tokens:
            logits[i, [t for t in r.banned_tokens if t < vocab]] = float("-inf")
    return logits


def target_probs(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Rows of ``processed_logits`` (all of one request) -> the distributions it samples from."""
    vocab = logits.shape[-1]
    n = logits.shape[0]
    k = min(row.top_k, vocab) if row.top_k > 0 else vocab
    dev = logits.device
    scaled = apply_top_k_top_p_min_p(
        logits / row.temperature, torch.full((n,), k, device=dev), torch.full((n,), row.top_p, device=dev),
        torch.full((n,), row.min_p, device=dev), max_k=k if k < vocab else 0,
        any_top_p=row.top_p < 1, any_min_p=row.min_p > 0)
    return scaled.softmax(dim=-1)


def accept_greedy(drafts: list[int], best: list[int]) -> list[int]:
    """Greedy verification from the target's argmax at each of the ``k + 1`` positions."""
    m = 0
    while m < len(drafts) and drafts[m] == best[m]:
        m += 1
    return drafts[:m] + [best[m]]


def verify_request(logits: torch.Tensor, row: SamplingRow, drafts: list[int],
                   draft_probs: torch.Tensor | None, generator: torch.Generator) -> list[int]:
    """The tokens a request emits from one verify step: the accepted drafts, then one token of
    the target's. ``logits``: [k + 1, vocab] after ``processed_logits``; ``row``: the request's
    temperature and truncation; ``draft_probs``: [k, vocab] of a sampled draft model, None for a
    point-mass draft (n-gram, or a greedy draft model)."""
    k = len(drafts)
    if row.temperature < MIN_TEMPERATURE:
        return accept_greedy(drafts, logits.argmax(dim=-1).tolist())
    p = target_probs(logits, row).cpu()
    q = None if draft_probs is None else draft_probs.float().cpu()
    u = torch.rand(k, generator=generator).tolist() if k else []
    for j, d in enumerate(drafts):
        pd = float(p[j, d])
        qd = 1.0 if q is None else float(q[j, d])
        if qd > 0 and u[j] * qd < pd:  # u < min(1, p/q), without dividing
            continue
        if q is None:
            residual = p[j].clone()
            residual[d] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_(min=0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p is (numerically) q itself: rejecting was a rounding event
            residual = p[j]
        tok = int(torch.multinomial(residual, 1, generator=generator))
        return drafts[:j] + [tok]
    return drafts + [int(torch.multinomial(p[k], 1, generator=generator))]


def logprob_entry(row: torch.Tensor, tok: int, num: int) -> tuple[float, int, list[tuple[int, float]]]:
    """A token's log-prob as the sampler reports it, from one row of raw log-probs."""
    lp = row[tok]
    top = []
    if num > 0:
        vals, ids = row.topk(num)
        top = list(zip(ids.tolist(), vals.tolist()))
    return float(lp), int((row > lp).sum()) + 1, top

"""Sampler: logits of the rows being sampled -> token ids (+ log-probs), on the logits' device.

Order: penalties -> logit_bias -> min_tokens mask -> grammar mask -> greedy rows (temperature
below ``MIN_TEMPERATURE``) take the argmax; the others are divided by their temperature, masked
by top-k, top-p and min-p, and drawn by the exponential race (``argmax(p / q)``, q ~ Exp(1)),
which equals drawing from ``p``. A seeded row draws its noise from its own generator, so its
tokens do not depend on the rest of the batch.

Log-probs are the model's own (a log-softmax of the raw logits), before penalties, logit_bias and
the grammar mask change anything: what vLLM returns by default.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve import structured
from kvserve.sampling_params import MIN_TEMPERATURE


@dataclass
class SamplingRow:
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    generator: torch.Generator | None
    num_logprobs: int | None
    # Penalties: all tokens seen (prompt + output) and output tokens, only when used.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seen_tokens: list[int] | None = None
    output_tokens: list[int] | None = None
    banned_tokens: tuple[int, ...] = ()  # stop tokens masked until min_tokens is reached
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row, when asked: (logprob of the sampled token, its rank, [(id, logprob)] top-k)
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[-1]
    for i, r in enumerate(rows):
        if r.repetition_penalty != 1.0 and r.seen_tokens:
            ids = torch.tensor(sorted(set(r.seen_tokens)), device=logits.device)
            ids = ids[ids < vocab]
            v = logits[i, ids]
            logits[i, ids] = torch.where(v > 0, v / r.repetition_penalty, v * r.repetition_penalty)
        if (r.presence_penalty or r.frequency_penalty) and r.output_tokens:
            counts = torch.bincount(torch.tensor(r.output_tokens, device=logits.device), minlength=vocab)[:vocab]
            logits[i] -= r.frequency_penalty * counts.to(logits.dtype)
            logits[i] -= r.presence_penalty * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """All rows' biases in one scatter-add on the logits' device."""
    r_idx, t_idx, vals = [], [], []
    for i, r in enumerate(rows):
        if r.logit_bias:
            r_idx.extend([i] * len(r.logit_bias))
            t_idx.extend(r.logit_bias.keys())
            vals.extend(r.logit_bias.values())
    dev = logits.device
    logits.index_put_((torch.tensor(r_idx).to(dev, non_blocking=True), torch.tensor(t_idx).to(dev, non_blocking=True)),
                      torch.tensor(vals, dtype=logits.dtype).to(dev, non_blocking=True), accumulate=True)


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor, max_k: int | None = None, any_top_p: bool | None = None,
                            any_min_p: bool | None = None) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p and min-p exclude. top_k <= 0 / top_p == 1 / min_p == 0
    leave a row alone. ``logits`` are already divided by the temperature. The caller may pass
    what it knows on the host (the largest top-k below the vocabulary, 0 if none; whether any row
    uses top-p / min-p) so that no device value has to be read back."""
    vocab = logits.shape[-1]
    neg = torch.finfo(logits.dtype).min
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    if max_k is None:
        max_k = int(k.max()) if bool((k < vocab).any()) else 0
    if any_top_p is None:
        any_top_p = bool((top_p < 1).any())
    if any_min_p is None:
        any_min_p = bool((min_p > 0).any())
    if max_k:
        kth = logits.topk(max_k, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, neg)
    if any_top_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens before it already cover top_p; the first always stays.
        drop = (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
        drop[:, 0] = False
        drop &= (top_p < 1).unsqueeze(1)  # a cumsum rounding past 1.0 must not touch p == 1 rows
        logits = logits.masked_fill(drop.scatter(1, order, drop), neg)
    if any_min_p:
        probs = logits.softmax(dim=-1)
        thresh = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < thresh, neg)
    return logits


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, copy_ahead: bool = False):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # Async scheduling: the ids start for the host as soon as they are sampled, so that
        # ``finish`` waits for this step only, not for the next step queued behind it.
        self.copy_ahead = copy_ahead and device.type == "cuda"

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 bitmask: tuple[torch.Tensor, list[int]] | None = None) -> SamplerOutput:
        return self.finish(self.launch(logits, rows, bitmask))

    def launch(self, logits: torch.Tensor, rows: list[SamplingRow],
               bitmask: tuple[torch.Tensor, list[int]] | None = None):
        """Queue the sampling on the logits' device; ``finish`` reads the ids back (the step's
        one host synchronisation). ``bitmask``: the grammar's allowed tokens (on the device) and
        the rows it constrains."""
        logits = logits.float()
        n, vocab = logits.shape
        want_lp = [r.num_logprobs is not None for r in rows]
        raw_logprobs = logits.log_softmax(dim=-1) if any(want_lp) else None
        if any(r.repetition_penalty != 1.0 or r.presence_penalty or r.frequency_penalty for r in rows):
            apply_penalties(logits, rows)
        if any(r.logit_bias for r in rows):
            apply_logit_bias(logits, rows)
        for i, r in enumerate(rows):
            if r.banned_tokens:
                ids = [t for t in r.banned_tokens if t < vocab]
                logits[i, ids] = float("-inf")
        if bitmask is not None:
            structured.apply_bitmask(logits, *bitmask)
        greedy = [r.temperature < MIN_TEMPERATURE for r in rows]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            dev = logits.device
            temps = torch.tensor([1.0 if g else r.temperature for r, g in zip(rows, greedy)]).to(dev, non_blocking=True)
            ks = [min(r.top_k, vocab) if r.top_k > 0 else vocab for r in rows]  # a larger top-k is off
            scaled = apply_top_k_top_p_min_p(
                logits / temps.unsqueeze(1),
                torch.tensor(ks).to(dev, non_blocking=True),
                torch.tensor([r.top_p for r in rows]).to(dev, non_blocking=True),
                torch.tensor([r.min_p for r in rows]).to(dev, non_blocking=True),
                max_k=max(ks) if min(ks) < vocab else 0,
                any_top_p=any(r.top_p < 1 for r in rows), any_min_p=any(r.min_p > 0 for r in rows))
            probs = scaled.softmax(dim=-1)
            q = torch.empty_like(probs).exponential_(generator=self.generator)
            for i, r in enumerate(rows):
                if r.generator is not None and not greedy[i]:
                    q[i] = torch.empty(vocab).exponential_(generator=r.generator).to(q.device)
            sampled = (probs / q).argmax(dim=-1)
            tokens = torch.where(torch.tensor(greedy).to(dev, non_blocking=True), logits.argmax(dim=-1), sampled)
        ahead = None
        if self.copy_ahead:
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
            ahead = (host, done)
        return tokens, raw_logprobs, rows, ahead

    def finish(self, pending) -> SamplerOutput:
        tokens, raw_logprobs, rows, ahead = pending
        n = len(rows)
        if ahead is not None:
            ahead[1].synchronize()
            token_list = ahead[0].tolist()
        else:
            token_list = tokens.tolist()
        lps: list = [None] * n
        if raw_logprobs is not None:
            for i, r in enumerate(rows):
                if r.num_logprobs is None:
                    continue
                row = raw_logprobs[i]
                tok = token_list[i]
                lp = row[tok]
                rank = int((row > lp).sum()) + 1
                top = []
                if r.num_logprobs > 0:
                    vals, ids = row.topk(r.num_logprobs)
                    top = list(zip(ids.tolist(), vals.tolist()))
                lps[i] = (float(lp), rank, top)
        return SamplerOutput(token_list, lps)

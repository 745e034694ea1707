"""A request's sampling row (its parameters as the sampler takes them), its prompt log-probs, and
sampling row by row when a batch's sampling raised (the fault stays with its request)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.engine.faults import is_device_fault
from kvserve.engine.request import Request
from kvserve.engine.sampler import Sampler, SamplingRow
from kvserve.engine.step import RawPromptLogprob, ScheduledRequest

# Sampled in place of a failed request's row: the batch keeps its shape (a step launched ahead
# reads each request's token by row), and the token is thrown away with the request.
PLACEHOLDER_ROW = SamplingRow(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0, generator=None, num_logprobs=None)


def sampling_row(r: Request, draw: int, drafted: list[int] = ()) -> SamplingRow:
    """``drafted``: draft tokens before the position sampled (verification), counted as output.

    A request's own row (draw 0, no drafts, nothing banned) is the same object from step to
    step: it reads the parameters and the request's token lists (which grow in place), and its
    first generator, which is checked. It is made once and kept on the request."""
    p = r.params
    banned = ()
    # Under a grammar, the grammar decides where the output ends: banning its stop token
    # could leave a row with nothing allowed.
    if r.num_output_tokens + len(drafted) < p.min_tokens and r.grammar is None:
        banned = tuple(p.stop_token_ids or ()) + (() if p.ignore_eos else r.eos_token_ids)
    elif draw == 0 and not drafted:
        row, gens = r.own_row, r.generators
        if row is None or row.generator is not (None if gens is None else gens[0]):
            row = r.own_row = _row(r, 0, (), ())
        return row
    return _row(r, draw, drafted, banned)


def _row(r: Request, draw: int, drafted: list[int], banned: tuple[int, ...]) -> SamplingRow:
    p = r.params
    penal = p.needs_penalties
    return SamplingRow(
        temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
        generator=None if r.generators is None else r.generators[draw],
        num_logprobs=p.logprobs,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        seen_tokens=(r.all_token_ids + list(drafted) if drafted else r.all_token_ids) if penal else None,
        output_tokens=(r.output_token_ids + list(drafted) if drafted else r.output_token_ids) if penal else None,
        banned_tokens=banned, logit_bias=p.logit_bias)


def prompt_logprobs(logits_of: Callable[[torch.Tensor], torch.Tensor], r: Request, s: ScheduledRequest,
                    hidden: torch.Tensor, q_start: int) -> list[RawPromptLogprob]:
    """Log-prob of each prompt token given those before it, for positions computed now."""
    start = r.num_computed_tokens
    end = min(start + s.num_new_tokens, r.num_prompt_tokens - 1)  # position p predicts p + 1
    if end <= start:
        return []
    logits = logits_of(hidden[q_start:q_start + end - start])
    lps = logits.log_softmax(dim=-1)
    targets = torch.tensor(r.all_token_ids[start + 1:end + 1], device=lps.device)
    chosen = lps.gather(1, targets[:, None]).squeeze(1)
    ranks = (lps > chosen[:, None]).sum(dim=1) + 1
    k = r.params.prompt_logprobs
    top_v, top_i = (lps.topk(k) if k else (None, None))
    out = []
    for j in range(end - start):
        top = list(zip(top_i[j].tolist(), top_v[j].tolist())) if k else []
        out.append((int(targets[j]), float(chosen[j]), int(ranks[j]), top))
    return out


def sample_one_by_one(sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow], sample_of: list[int],
                      failed: dict[int, BaseException], bitmask=None):
    """The batch's sampling raised: sample each row alone, so that the fault stays with the
    request whose row raises (in ``failed``; its row becomes a placeholder) and the others
    get their tokens. Returns what ``Sampler.launch`` would have."""
    logits = logits.float()
    tokens = []
    masked = set() if bitmask is None else set(bitmask[1])  # rows under a grammar
    for k, row in enumerate(rows):
        mine = (bitmask[0][k:k + 1], [0]) if k in masked else None
        try:
            tokens.append(sampler.launch(logits[k:k + 1].clone(), [row], mine)[0])
        except Exception as e:  # noqa: BLE001 - this request's fault, unless the device's
            if is_device_fault(e):
                raise
            failed.setdefault(sample_of[k], e)
            rows[k] = PLACEHOLDER_ROW
            tokens.append(logits[k:k + 1].argmax(dim=-1))
    want_lp = any(r.num_logprobs is not None for r in rows)
    return torch.cat(tokens), logits.log_softmax(dim=-1) if want_lp else None, rows, None

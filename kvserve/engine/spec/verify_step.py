"""The verify half of a speculative step in the runner: the logits at each drafted position,
and the tokens rejection sampling keeps."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.request import Request
from kvserve.engine.sampling_rows import sampling_row
from kvserve.engine.spec import rejection
from kvserve.engine.step import ScheduledRequest
from kvserve.sampling_params import MIN_TEMPERATURE


@dataclass
class VerifyLogits:
    logits: list[torch.Tensor]  # [k + 1, vocab] per verifying request
    sizes: list[int]  # k + 1 per verifying request
    best: torch.Tensor | None  # every row's argmax, on the device; None if no request is plain greedy


def plain_greedy(r: Request) -> bool:
    """Greedy with nothing that changes the argmax or asks for more than it: no penalties, bias,
    log-probs, grammar, or stop tokens banned by ``min_tokens`` (a ban only lifts as tokens are
    added, so a request free of it before its drafts is free of it at every drafted position)."""
    p = r.params
    return (p.temperature < MIN_TEMPERATURE and p.logprobs is None and not p.needs_penalties
            and not p.logit_bias and r.grammar is None and r.num_output_tokens >= p.min_tokens)


class VerifyStep:
    """ModelRunner's verification (the runner holds ``_logits``, ``device`` and ``_spec_generator``)."""

    def _verify_logits(self, hidden: torch.Tensor, query_start: list[int], sched: list[ScheduledRequest],
                       verifying: list[int]) -> VerifyLogits:
        """The logits at every position of each request with drafts (its last known token and
        its drafts), in one LM-head product, and their argmax, launched here for the greedy
        requests that need nothing else."""
        idx, sizes = [], []
        for i in verifying:
            end = query_start[i + 1]
            n = len(sched[i].draft_token_ids) + 1
            idx.extend(range(end - n, end))
            sizes.append(n)
        if idx[-1] - idx[0] + 1 == len(idx):  # one run of rows (rising, no repeats): a view, no gather
            rows = hidden[idx[0]:idx[-1] + 1]
        else:
            rows = hidden[torch.tensor(idx).to(self.device, non_blocking=True)]
        logits = self._logits(rows)
        plain = any(plain_greedy(sched[i].request) for i in verifying)
        return VerifyLogits(list(logits.split(sizes)), sizes, logits.argmax(dim=-1) if plain else None)

    def _verify_all(self, sched: list[ScheduledRequest], verifying: list[int], v: VerifyLogits):
        """(row, tokens, log-probs) per verifying request, or (row, exception) for a request whose
        verification failed. The greedy requests share one copy of their argmax to the host: a
        per-request ``argmax().tolist()`` would wait on the device once for each of them."""
        best = v.best.tolist() if v.best is not None else None
        start = 0
        for i, logits, n in zip(verifying, v.logits, v.sizes):
            s = sched[i]
            try:
                if best is not None and plain_greedy(s.request):
                    toks = rejection.accept_greedy(s.draft_token_ids, best[start:start + n])
                    yield i, toks, [None] * len(toks)
                else:
                    yield i, *self._verify(s, logits)
            except Exception as e:  # noqa: BLE001 - the caller decides whose fault it is
                yield i, e, None
            start += n

    def _verify(self, s: ScheduledRequest, logits: torch.Tensor):
        """One request's tokens (accepted drafts + the target's) and their log-probs, if asked."""
        r, drafts = s.request, s.draft_token_ids
        rows = [sampling_row(r, 0, drafts[:j]) for j in range(len(drafts) + 1)]
        processed = rejection.processed_logits(logits, rows)
        gen = r.generator if r.generator is not None else self._spec_generator
        toks = rejection.verify_request(processed, rows[0], drafts, r.spec_draft_probs, gen)
        n_lp = r.params.logprobs
        if n_lp is None:
            return toks, [None] * len(toks)
        raw = logits.float().log_softmax(dim=-1)
        return toks, [rejection.logprob_entry(raw[j], t, n_lp) for j, t in enumerate(toks)]

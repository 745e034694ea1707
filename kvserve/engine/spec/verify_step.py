"""The verify half of a speculative step in the runner: the logits at each drafted position,
and the tokens rejection sampling keeps."""
from __future__ import annotations

import torch

from kvserve.engine.sampling_rows import sampling_row
from kvserve.engine.spec import rejection
from kvserve.engine.step import ScheduledRequest


class VerifyStep:
    """ModelRunner's verification (the runner holds ``_logits``, ``device`` and ``_spec_generator``)."""

    def _verify_logits(self, hidden: torch.Tensor, query_start: list[int], sched: list[ScheduledRequest],
                       verifying: list[int]) -> list[torch.Tensor]:
        """The logits at every position of each request with drafts (its last known token and
        its drafts), in one LM-head product; one [k + 1, vocab] tensor per request."""
        idx, sizes = [], []
        for i in verifying:
            end = query_start[i + 1]
            n = len(sched[i].draft_token_ids) + 1
            idx.extend(range(end - n, end))
            sizes.append(n)
        logits = self._logits(hidden[torch.tensor(idx).to(self.device, non_blocking=True)])
        return list(logits.split(sizes))

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

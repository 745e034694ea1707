"""Speculator: proposes each step's drafts and learns from what the verification kept.

    propose(running)       before Scheduler.schedule(): ``req.spec_token_ids`` for decoding requests
    observe(out, result)   after the step: acceptance per request (policy) and the counters (stats)

A request gets no drafts while it is prefilling, is under a grammar (its matcher would have to
accept and roll back drafts; it decodes one token a step instead) or has one token left to go.
"""
from __future__ import annotations

from kvserve.config import SpeculativeConfig
from kvserve.engine.request import Request
from kvserve.engine.spec.ngram import propose_ngram
from kvserve.engine.spec.policy import SpecPolicy
from kvserve.engine.stats import SpecDecodingStats
from kvserve.engine.step import ModelRunnerOutput, SchedulerOutput


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft=None):
        self.config = config
        self.policy = SpecPolicy(config)
        self.draft = draft  # kvserve.engine.spec.draft.DraftModel for method "draft_model"
        self.stats = SpecDecodingStats(config.num_speculative_tokens)

    def propose(self, running: list[Request]) -> None:
        for r in running:  # drafts of a step that preempted the request before taking them are stale
            r.spec_token_ids, r.spec_draft_probs = [], None
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        k_batch = self.policy.k_for_batch(len(decoding))
        if k_batch == 0:
            return
        want: list[tuple[Request, int]] = []
        for r in decoding:
            if r.grammar is not None or r.pending_forks:
                continue
            k = min(self.policy.k_for_request(r, k_batch), r.max_tokens - r.num_output_tokens - 1)
            if k > 0:
                want.append((r, k))
        if self.draft is not None:
            self.draft.propose(want, running)
            return
        c = self.config
        for r, k in want:
            r.spec_token_ids = propose_ngram(r.all_token_ids, k, c.prompt_lookup_min, c.prompt_lookup_max)

    def drop_request(self, request_id: str) -> None:
        if self.draft is not None:
            self.draft.drop(request_id)

    def observe(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        for i, (s, toks) in enumerate(zip(out.scheduled, result.sampled_token_ids)):
            if not s.draft_token_ids or not toks or i in result.failed:
                continue
            n, accepted = len(s.draft_token_ids), len(toks) - 1
            self.stats.record(n, accepted)
            self.policy.observe(s.request, n, accepted)

"""Speculator: proposes each step's drafts and learns from what the verification kept.

    plan(running)          whether the next step will draft (one that does not may be launched
                           ahead, before this step's tokens are known: async scheduling)
    propose(running)       before Scheduler.schedule(): ``req.spec_token_ids`` for decoding requests
    skip(running)          instead of propose, for a step launched ahead: no drafts
    observe(out, result, launched)
                           after the step: acceptance per request (policy), the counters (stats)
                           and the step's time per token (``DraftOrPlain``)

A request gets no drafts while it is prefilling, is under a grammar (its matcher would have to
accept and roll back drafts; it decodes one token a step instead) or has one token left to go.
"""
from __future__ import annotations

from kvserve.config import SpeculativeConfig
from kvserve.engine.request import Request
from kvserve.engine.spec.ngram import propose_ngram
from kvserve.engine.spec.policy import DraftOrPlain, SpecPolicy
from kvserve.engine.stats import SpecDecodingStats
from kvserve.engine.step import ModelRunnerOutput, SchedulerOutput


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft=None):
        self.config = config
        self.policy = SpecPolicy(config)
        self.draft = draft  # kvserve.engine.spec.draft.DraftModel for method "draft_model"
        self.stats = SpecDecodingStats(config.num_speculative_tokens)
        self.choice = DraftOrPlain()
        self._next: bool | None = None  # what plan() decided for the next step

    @staticmethod
    def _decoding(running: list[Request]) -> list[Request]:
        return [r for r in running if r.num_tokens - r.num_computed_tokens == 1]

    @staticmethod
    def _can_draft(r: Request) -> bool:
        return r.grammar is None and not r.pending_forks and r.max_tokens - r.num_output_tokens > 1

    def _decide(self, decoding: list[Request]) -> bool:
        if not decoding or self.policy.k_for_batch(len(decoding)) == 0:
            return False
        if not any(self._can_draft(r) for r in decoding):
            return False  # a step that cannot draft is a plain one: the next may be launched ahead
        if any(r.generators is not None and not r.params.greedy for r in decoding):
            return True  # a seeded draw: the rule alone decides, so the seed reproduces
        return self.choice.drafts(len(decoding))

    def plan(self, running: list[Request]) -> bool:
        self._next = self._decide(self._decoding(running))
        return self._next

    def skip(self, running: list[Request]) -> None:
        self._next = None
        for r in running:
            r.spec_token_ids, r.spec_draft_probs = [], None

    def propose(self, running: list[Request]) -> None:
        for r in running:  # drafts of a step that preempted the request before taking them are stale
            r.spec_token_ids, r.spec_draft_probs = [], None
        decoding = self._decoding(running)
        drafts, self._next = (self._next if self._next is not None else self._decide(decoding)), None
        if not drafts:
            return
        k_batch = self.policy.k_for_batch(len(decoding))
        want: list[tuple[Request, int]] = []
        for r in decoding:
            k = min(self.policy.k_for_request(r, k_batch), r.max_tokens - r.num_output_tokens - 1)
            if self._can_draft(r) and k > 0:
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

    def observe(self, out: SchedulerOutput, result: ModelRunnerOutput, launched: float) -> None:
        pure, drafted, tokens = not result.failed, False, 0
        for s, toks in zip(out.scheduled, result.sampled_token_ids):
            n = len(s.draft_token_ids)
            pure = pure and s.num_new_tokens == n + 1 and len(toks) >= 1
            tokens += len(toks)
            if not n or not toks:
                continue
            drafted, accepted = True, len(toks) - 1
            self.stats.record(n, accepted)
            self.policy.observe(s.request, n, accepted)
        self.choice.record(len(out.scheduled), drafted, tokens, launched, pure)

"""Grammar rows in a step: which sampling rows a grammar constrains, and the token bitmask
filled on the filler's thread beside the forward. A step launched ahead of the one in flight
holds its sampling (``DeferredSampling``) until the matchers have seen the tokens in flight."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future

import torch

from kvserve import structured
from kvserve.engine.request import Request
from kvserve.engine.step import ScheduledRequest


@dataclasses.dataclass
class DeferredSampling:
    """The sampling of a step launched ahead with grammar rows: the forward and the LM head are
    queued, the mask waits for the step in flight's tokens to reach the matchers."""
    sample: Callable[[Future | None], None]  # launches the sampling with the mask applied
    fill: Callable[[], Future]  # starts filling the mask from the matchers as they stand
    mask_job: Future | None = None


class GrammarMasks:
    """ModelRunner's grammar rows (the runner holds ``_bitmask``, ``_deferred``, ``arch`` and
    ``device``)."""

    @staticmethod
    def _grammar_rows(sched: list[ScheduledRequest]) -> tuple[list[int], list[Request], int]:
        """The sampling rows under a grammar, their requests, and the step's number of sampling
        rows, in the order ``launch`` samples them (a request owing forks draws its siblings'
        first tokens from its own matcher)."""
        rows, reqs, n = [], [], 0
        for s in sched:
            if not s.samples or s.draft_token_ids:
                continue
            r = s.request
            for _ in range(r.pending_forks + 1):
                if r.grammar is not None:
                    rows.append(n)
                    reqs.append(r)
                n += 1
        return rows, reqs, n

    def _fill_masks(self, num_rows: int, rows: list[int], reqs: list[Request]):
        """Start filling the rows' mask on the filler's thread. A request that finished since the
        launch (stopped, refused by its grammar, aborted) is left out: its token is dropped."""
        if self._bitmask is None:
            self._bitmask = structured.BitmaskFiller(self.arch.vocab_size, self.device)
        live = [(k, r.grammar) for k, r in zip(rows, reqs) if not r.is_finished]
        return self._bitmask.start(num_rows, [k for k, _ in live], [g for _, g in live])

    def start_mask_fill(self) -> None:
        """The step before the one launched ahead has been folded in, so the grammar rows'
        matchers have seen every token: start filling the waiting step's mask on the host (the
        device is still busy with its forward). Nothing to do for other steps."""
        d = self._deferred
        if d is not None and d.mask_job is None:
            d.mask_job = d.fill()

    @torch.inference_mode()
    def launch_sampling(self) -> None:
        """Launch the held sampling of the step launched ahead, its mask applied (waiting for
        the fill). ``launch`` of the next step and the step's own result call it."""
        d, self._deferred = self._deferred, None
        if d is not None:
            d.sample(d.mask_job if d.mask_job is not None else d.fill())

"""Async scheduling: the next step is scheduled and launched before this one's tokens are known.

    step N launched ─► advance(N) ─► schedule + launch N+1 ─► N's results ─► update(N, advanced)
                                     (N+1's inputs: N's sampled ids, read on the device)

Invariants:
- ``advance`` moves each scheduled request's ``num_computed_tokens`` as the step's results would,
  and gives each request that samples in the step a ``PENDING_TOKEN`` placeholder for its token;
  ``Scheduler.update(..., advanced=True)`` then only fills the placeholders in
  (``Request.resolve_pending``).
- A request has at most one pending token, always its last; only the step that sampled it
  resolves it, and the runner feeds it to the next step from the device.
- If a step's results never come (it failed), ``rollback`` undoes ``advance``: the requests stand
  where the step found them, as after a failed synchronous step; the step launched ahead on top
  of it is discarded.
- A step that verifies drafts, forks, samples with penalties (they read the tokens on the host), wants prompt
  log-probs (read from its hidden states) or moves KV to or from the tiers (their copies run
  beside the compute stream) is never looked past (``can_look_ahead``).
- Grammar rows are looked past: the step launched ahead queues its forward and LM head and
  holds its sampling until this step's tokens have reached the matchers (``update``). Its mask
  is then filled on a worker thread while the host folds this step in and schedules the next,
  and the device runs that forward; the sampling, mask applied, is launched when the step after
  it is (its inputs are these tokens) or when its own results are asked for
  (``ModelRunner.start_mask_fill``, ``ModelRunner.launch_sampling``).

    host:   launch N+1 ─► N's ids ─► update N ─► outputs N, advance, schedule N+2 ─► sample N+1, launch N+2
    worker:                                  └─ fill N+1's mask ───────────────┘
    device: [N sample][N+1 forward + LM head ............................][N+1 sample][N+2 forward ...
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvserve.engine.request import PENDING_TOKEN
from kvserve.engine.step import ModelRunnerOutput, SchedulerOutput


@dataclass
class InFlight:
    """A step whose device work is queued: ``result()`` waits for it."""
    out: SchedulerOutput
    result: Callable[[], ModelRunnerOutput]
    t0: float
    io0: float
    kv_usage: tuple[int, int]
    advanced: bool = False  # counters moved and placeholders appended before the results came
    num_prompt_tokens: int = 0  # prompt tokens it computed (counted when advanced)


def can_look_ahead(out: SchedulerOutput, tiers_on: bool) -> bool:
    if tiers_on or out.is_empty:
        return False
    for s in out.scheduled:
        r = s.request
        if s.samples and (r.pending_forks or r.params.needs_penalties):
            return False
        if s.draft_token_ids:  # how many of its tokens it keeps is known only once it ends
            return False
        if r.wants_prompt_logprobs and r.num_computed_tokens < r.num_prompt_tokens:
            return False
    return True


def advance(step: InFlight) -> None:
    """Move the step's counters now, as its results would."""
    step.advanced = True
    for s in step.out.scheduled:
        req = s.request
        if req.is_finished:  # aborted since the launch
            continue
        if req.num_computed_tokens < req.num_prompt_tokens:
            step.num_prompt_tokens += min(s.num_new_tokens, req.num_prompt_tokens - req.num_computed_tokens)
        req.num_computed_tokens += s.num_new_tokens
        if s.samples:
            req.append_token(PENDING_TOKEN)


def rollback(step: InFlight) -> None:
    """Undo ``advance`` for a step whose results never came."""
    for s in step.out.scheduled:
        req = s.request
        if req.is_finished:
            continue
        if s.samples and req.token_pending:
            req.drop_pending()
        req.num_computed_tokens -= s.num_new_tokens

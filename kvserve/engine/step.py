"""The step contract: what passes between the scheduler, the model runner and the outputs.

    Scheduler.schedule()                 -> SchedulerOutput    which requests run, how many tokens each
    ModelRunner.execute(SchedulerOutput) -> ModelRunnerOutput  the tokens each request got
    Scheduler.update(SchedulerOutput, ModelRunnerOutput)
                                         -> EngineCoreOutputs  counters moved, tokens appended, forks,
                                                               finished requests freed
    OutputProcessor.process(EngineCoreOutputs) -> RequestOutputs  text, stop strings, log-probs

Everything a request's lists index is in ``SchedulerOutput.scheduled`` order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.engine.request import Request, RequestStatus
from kvserve.outputs import RequestMetrics

# A token's log-prob as the sampler reports it: (logprob, rank, [(top id, top logprob), ...]).
RawLogprob = tuple[float, int, list[tuple[int, float]]]
# A prompt position's: (token id, logprob, rank, top).
RawPromptLogprob = tuple[int, float, int, list[tuple[int, float]]]


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_table: list[int]
    samples: bool = False  # the step reaches the end of the known tokens, so a token is sampled
    # Speculative decoding: the last ``len(draft_token_ids)`` of the step's tokens are drafts
    # after the known tokens, verified by the runner (``kvserve.engine.spec``).
    draft_token_ids: list[int] = field(default_factory=list)
    # With several KV groups (``kv_groups.py``): the request's table in each (``block_table`` is
    # group 0's); else None.
    group_tables: list[list[int]] | None = None

    def __post_init__(self):
        r = self.request
        self.samples = r.num_computed_tokens + self.num_new_tokens - len(self.draft_token_ids) == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks
    swap_out: dict[str, list[int]] = field(default_factory=dict)  # request id -> device blocks
    swap_in: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[str] = field(default_factory=list)
    # KV tiers: blocks whose KV leaves for the tiers before this step writes anything (evicted
    # from the prefix cache), and chunks to copy into freshly allocated blocks.
    offloads: list[tuple[int, bytes]] = field(default_factory=list)  # (block, key)
    loads: list[tuple[list[int], list]] = field(default_factory=list)  # (blocks, store run) per request
    # Blocks this step fills (their hash registered): written through to disk/Redis after it.
    writes: list[tuple[int, bytes]] = field(default_factory=list)  # (block, key)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    """Per scheduled request: the tokens it got this step. A request whose step does not reach
    the end of its known tokens (a prompt chunk) gets none; a request owing forks (``n > 1``,
    its first token) gets one token per sibling, its own first; any other request gets the
    tokens it accepted, in order (one, or several with speculative decoding)."""
    sampled_token_ids: list[list[int]]
    logprobs: list[list[RawLogprob | None]]  # per token in sampled_token_ids
    prompt_logprobs: list[list[RawPromptLogprob]]  # per prompt position computed this step
    # Requests (by index) whose own sampling or prompt log-probs failed: they got no tokens and
    # are to be aborted (``faults``).
    failed: dict[int, BaseException] = field(default_factory=dict)
    # Scored KV eviction (``kv_eviction.py``): requests (by index) -> the attention their scored
    # queries gave each key position this step (a CPU tensor), summed over layers and heads.
    kv_scores: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def empty(cls, n: int) -> ModelRunnerOutput:
        return cls([[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)])


@dataclass(slots=True)
class EngineCoreOutput:
    """What changed for one request in a step, as plain data: the output processor needs
    nothing else (it keeps its own text state), so it can run away from the engine's thread."""
    request_id: str
    group_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[RawLogprob | None] = field(default_factory=list)
    # Prompt log-probs computed this step, for positions from ``prompt_logprobs_start + 1`` on
    # (a chunk recomputed after preemption overwrites what was reported).
    prompt_logprobs: list[RawPromptLogprob] = field(default_factory=list)
    prompt_logprobs_start: int = 0
    status: RequestStatus = RequestStatus.RUNNING
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None
    num_output_tokens: int = 0  # after this step

    @property
    def finished(self) -> bool:
        return self.status.is_finished


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    forks: list[tuple[Request, Request]] = field(default_factory=list)  # (parent, child): runner state to copy
    finished: list[Request] = field(default_factory=list)  # freed this step
    num_prompt_tokens: int = 0  # prompt tokens computed (prefix hits excluded)
    num_generated_tokens: int = 0

"""Request: one sequence being generated, owning all of its state.

A user request with ``n > 1`` starts as one Request (index 0). Once its prompt is computed it
samples ``n`` tokens and forks into ``n`` Requests that share the prompt's KV blocks; all of
them report under the same ``group_id``.
"""
from __future__ import annotations

import enum
import time

import torch

from kvserve.outputs import RequestMetrics
from kvserve.sampling_params import SamplingParams

# With async scheduling a step is scheduled before the previous step's tokens are known: each
# request that samples in the step in flight holds this in place of its new token until the
# results arrive (the runner feeds the model the sampled id straight from the device).
PENDING_TOKEN = -1


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= _FIRST_FINISHED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort"}.get(int(self))


# Read once per request per step: a plain int, since looking an enum member up costs far more
# than comparing with it.
_FIRST_FINISHED = int(RequestStatus.FINISHED_STOPPED)


def _child_seed(seed: int, index: int) -> int:
    return seed if index == 0 else (seed * 1_000_003 + index * 7919) % (2**63)


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        max_model_len: int = 1 << 30,
        prompt: str | None = None,
        arrival_time: float | None = None,
        group_id: str | None = None,
        index: int = 0,
    ):
        self.request_id = request_id
        self.group_id = group_id if group_id is not None else request_id
        self.index = index
        self.prompt = prompt
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        budget = max_model_len - self.num_prompt_tokens
        self.max_tokens = budget if params.max_tokens is None else min(params.max_tokens, budget)
        # Chained content hashes of this request's full blocks (kept by the KV cache manager).
        self.block_hashes: list[bytes] = []
        # Forks still owed: n - 1 until the first token is sampled.
        self.pending_forks = params.n - 1 if index == 0 else 0
        self.generators: list[torch.Generator] | None = None
        if params.seed is not None:
            n_gens = params.n if index == 0 else 1
            self.generators = [torch.Generator().manual_seed(_child_seed(params.seed, index + i))
                               for i in range(n_gens)]
        self.swapped_out = False  # KV lives in CPU swap space while preempted
        self.prefetch_state: str | None = None  # tiered store: None, "pending", "done"
        self.prefetch_token = 0
        # Disaggregated decode: when waiting for the prefill instance's KV stops (-1: stopped).
        self.kv_transfer_until: float | None = None
        self.session_id: str | None = None
        self.cache_salt: str | None = None  # scopes its prefix-cache keys (kv_cache_manager.salt_root)
        self.stop_reason: int | None = None  # the stop token that ended it
        # Structured outputs: the matcher of this sequence's grammar (kvserve.structured.GrammarState),
        # holding every output token so far; it outlives preemption with the request.
        self.grammar = None
        # Speculative decoding: drafts proposed for the next step (the scheduler takes them), and
        # the running rate at which this request's drafts are accepted (the policy's k follows it).
        self.spec_token_ids: list[int] = []
        self.spec_acceptance = 0.5
        self.spec_draft_probs = None  # a sampling draft model's q for those drafts, [k, vocab]
        self.own_row = None  # its sampling row once nothing is banned (sampling_rows.sampling_row)
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.time(),
                                      num_prompt_tokens=self.num_prompt_tokens)

    # -- derived ---------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= _FIRST_FINISHED

    @property
    def length_reached(self) -> bool:
        """The one length rule: ``max_tokens`` is already capped at what ``max_model_len`` leaves."""
        return self.num_output_tokens >= self.max_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt log-probs are computed for the first sibling only (forks share the prompt)."""
        return self.index == 0 and self.params.prompt_logprobs is not None

    @property
    def token_pending(self) -> bool:
        return bool(self.all_token_ids) and self.all_token_ids[-1] == PENDING_TOKEN

    def resolve_pending(self, token_id: int) -> None:
        """The in-flight step's token is known: it replaces the placeholder."""
        assert self.token_pending, "no token of this request is pending"
        self.all_token_ids[-1] = token_id
        self.output_token_ids[-1] = token_id

    def drop_pending(self) -> None:
        """The in-flight step failed: its placeholder goes, as if it was never launched."""
        assert self.token_pending, "no token of this request is pending"
        self.all_token_ids.pop()
        self.output_token_ids.pop()

    @property
    def generator(self) -> torch.Generator | None:
        return None if self.generators is None else self.generators[0]

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def fork(self, index: int) -> Request:
        """A sibling sharing everything computed so far; only the parent ever forks."""
        child = Request.__new__(Request)
        child.__dict__.update(self.__dict__)
        child.request_id = f"{self.group_id}#{index}"
        child.index = index
        child.all_token_ids = list(self.all_token_ids)
        child.output_token_ids = list(self.output_token_ids)
        child.block_hashes = list(self.block_hashes)
        child.pending_forks = 0
        child.generators = None if self.generators is None else [self.generators[index]]
        child.grammar = None if self.grammar is None else self.grammar.fork()
        child.own_row = None  # the parent's reads the parent's lists and generator
        child.metrics = RequestMetrics(**vars(self.metrics))
        return child

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")

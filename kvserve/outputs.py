"""What generate() returns, in vLLM's shape: RequestOutput.outputs[i].text / .token_ids / ..."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely token
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass(frozen=True)
class RequestKVPolicy:
    """The KV policy a request ran under."""
    kv_format: str  # what the pool stores: the model dtype ("float32", "bfloat16"), or int8/int4/fp8
    eviction: str  # the engine's --kv-eviction when the request set kv_budget, else "none" (full KV)
    kv_budget: int | None = None  # tokens of KV held at most, None: no bound
    reason: str | None = None  # why a budget: the request's own, or kv_policy auto's share


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_loaded_tokens: int = 0  # prompt tokens loaded from the tiered KV store (CPU/disk/Redis)
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    kv_policy: RequestKVPolicy | None = None  # None: the engine did not report it

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default=None)  # type: ignore[assignment]
    # Prompt tokens whose KV was reused instead of computed: GPU prefix-cache hits plus tokens
    # loaded from the KV tiers (vLLM's name). None: the engine did not report it.
    num_cached_tokens: int | None = None
    # Disaggregated prefill (vLLM's name): what a decode instance's request passes on to find
    # this prompt's KV, set by a kv_producer when the request finishes.
    kv_transfer_params: dict | None = None

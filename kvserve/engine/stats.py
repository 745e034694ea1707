"""Per-step and whole-run statistics of the engine."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass
class StepStats:
    step: int
    num_running: int
    num_waiting: int
    num_batched_tokens: int
    num_prompt_tokens: int  # of the batched tokens, those that were prompt (prefill) tokens
    num_generated_tokens: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int  # blocks holding a reusable prefix (in use or free)
    kv_slots_allocated: int
    kv_slots_filled: int
    prefix_hit_rate: float  # cumulative, over prompt tokens looked up
    num_preemptions: int  # cumulative
    step_time: float

    @property
    def kv_waste(self) -> float:
        """Allocated token slots not holding a token, over allocated slots."""
        a = self.kv_slots_allocated
        return 0.0 if a == 0 else 1.0 - self.kv_slots_filled / a


@dataclass
class SpecDecodingStats:
    """Speculative decoding counters, with vLLM's names."""
    num_speculative_tokens: int
    spec_decode_num_drafts: int = 0  # verify steps of a request (each with >= 1 draft)
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    # [j]: drafts accepted at position j (the j-th draft of a step, from 0)
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.spec_decode_num_accepted_tokens_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_decode_num_drafts += 1
        self.spec_decode_num_draft_tokens += num_drafts
        self.spec_decode_num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.spec_decode_num_accepted_tokens_per_pos[j] += 1

    def copy(self) -> SpecDecodingStats:
        c = dataclasses.replace(self)
        c.spec_decode_num_accepted_tokens_per_pos = list(self.spec_decode_num_accepted_tokens_per_pos)
        return c

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verify step emits on average: the accepted drafts plus the target's own."""
        d = self.spec_decode_num_drafts
        return 1.0 + self.spec_decode_num_accepted_tokens / d if d else 0.0

    @property
    def acceptance_rate(self) -> float:
        t = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / t if t else 0.0


@dataclass
class EngineStats:
    num_steps: int = 0
    num_requests_finished: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    generation_tokens: int = 0
    busy_time: float = 0.0  # seconds spent inside step()
    slots_allocated_sum: int = 0  # summed over steps, for the time-averaged KV waste
    slots_filled_sum: int = 0
    peak_kv_blocks_used: int = 0
    last: StepStats | None = None
    spec: SpecDecodingStats | None = None  # with speculative decoding on

    def record(self, s: StepStats) -> None:
        self.num_steps += 1
        self.prompt_tokens += s.num_prompt_tokens
        self.generation_tokens += s.num_generated_tokens
        self.busy_time += s.step_time
        self.slots_allocated_sum += s.kv_slots_allocated
        self.slots_filled_sum += s.kv_slots_filled
        self.peak_kv_blocks_used = max(self.peak_kv_blocks_used, s.kv_blocks_used)
        self.last = s

    @property
    def mean_kv_waste(self) -> float:
        a = self.slots_allocated_sum
        return 0.0 if a == 0 else 1.0 - self.slots_filled_sum / a

    @property
    def generation_tokens_per_s(self) -> float:
        return self.generation_tokens / self.busy_time if self.busy_time else 0.0

    def summary(self) -> str:
        last = self.last
        hit = last.prefix_hit_rate if last else 0.0
        pre = last.num_preemptions if last else 0
        return (f"{self.num_requests_finished} requests, {self.num_steps} steps, "
                f"{self.prompt_tokens} prompt + {self.generation_tokens} generated tokens in "
                f"{self.busy_time:.2f}s "
                f"({(self.prompt_tokens + self.generation_tokens) / max(self.busy_time, 1e-9):.1f} tok/s, "
                f"{self.generation_tokens_per_s:.1f} generated tok/s) | prefix-cache hit rate {hit:.1%} | "
                f"preemptions {pre} | KV waste {self.mean_kv_waste:.2%} (time-averaged) | "
                f"peak KV blocks {self.peak_kv_blocks_used}" + self._spec_summary())

    def _spec_summary(self) -> str:
        sp = self.spec
        if sp is None:
            return ""
        return (f" | speculative: mean acceptance length {sp.mean_acceptance_length:.2f}, "
                f"{sp.spec_decode_num_accepted_tokens}/{sp.spec_decode_num_draft_tokens} drafts accepted")

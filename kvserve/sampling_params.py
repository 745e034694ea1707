"""SamplingParams: how one prompt is continued. Names follow vLLM's, which users know."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.errors import InvalidRequestError

MAX_LOGPROBS = 20


@dataclass
class StructuredOutputsParams:
    json: dict | str | None = None      # a JSON schema (dict or JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None          # EBNF
    json_object: bool = False


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k log-probs returned per sampled token (plus the sampled one)
    prompt_logprobs: int | None = None  # log-prob of each prompt token (plus top-k)
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        def bad(name, allowed):
            raise InvalidRequestError(name, f"must be {allowed}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "an integer >= 1")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"<= max_tokens ({self.max_tokens})")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                bad(name, "a number")
        if not self.temperature >= 0:  # also rejects NaN
            bad("temperature", ">= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "-1 (off), 0 (off) or a positive integer")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if not 0 < self.repetition_penalty <= 100:
            bad("repetition_penalty", "in (0, 100]")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", "in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", "in [-2, 2]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "an integer or None")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                bad(name, f"None or an integer in [0, {MAX_LOGPROBS}]")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            bad("stop", "a list of non-empty strings")
        self._stop_list = stops
        if self.stop_token_ids is not None and any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of non-negative integers")

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

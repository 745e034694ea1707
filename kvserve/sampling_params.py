"""SamplingParams: how one prompt is continued. Names follow vLLM's, which users know."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

from kvserve.errors import InvalidRequestError

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values: [-100, 100]


@dataclass
class StructuredOutputsParams:
    """What the output must match: exactly one of these. The grammar is compiled when the
    request is admitted, so a spec that does not compile is refused there, naming the field."""
    json: dict | str | None = None  # a JSON schema (dict or JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar / GBNF style)
    json_object: bool = False  # any JSON object

    def __post_init__(self):
        def bad(name, allowed):
            got = repr(getattr(self, name))  # a spec can be large: the message shows its start
            raise InvalidRequestError(f"structured_outputs.{name}", f"must be {allowed}, got {got[:200]}")

        if not isinstance(self.json_object, bool):
            bad("json_object", "a boolean")
        given = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs", "give exactly one of json, regex, choice, grammar "
                                      f"or json_object, got {given or 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except ValueError as e:
                    bad("json", f"a JSON schema (a dict or JSON text): {e}")
                if not isinstance(schema, (dict, bool)):
                    bad("json", "a JSON schema (a JSON object)")
            elif not isinstance(self.json, dict):
                bad("json", "a JSON schema (a dict or JSON text)")
            else:
                try:
                    json.dumps(self.json)
                except (TypeError, ValueError) as e:
                    bad("json", f"a JSON schema of JSON values: {e}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                bad(name, "a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            bad("choice", "a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        """The field that is set: json, regex, choice, grammar or json_object."""
        return next(f.name for f in fields(self) if getattr(self, f.name) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """The spec in canonical text: what compiled grammars are cached under."""
        k = self.kind
        v = getattr(self, k)
        if k == "json":
            v = json.dumps(json.loads(v) if isinstance(v, str) else v, sort_keys=True, separators=(",", ":"))
        elif k == "choice":
            v = json.dumps(v)
        elif k == "json_object":
            v = ""
        return k, v


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
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
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
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            bad("structured_outputs", "None or a StructuredOutputsParams")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias", "a map of token ids to numbers in [-100, 100]")
            for t, v in self.logit_bias.items():
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    raise InvalidRequestError("logit_bias", f"keys must be token ids (integers >= 0), got {t!r}")
                if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                        or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS):
                    raise InvalidRequestError("logit_bias", f"values must be numbers in [-100, 100], got {v!r} "
                                              f"for token {t}")

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

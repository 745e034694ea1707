"""SamplingParams: how one prompt is continued. Names follow vLLM's, which users know.

Every field is range-checked here, whoever builds it (the server or an offline caller), so that
nothing reaching the sampler can overflow a tensor or a generator: integers are bounded by what
an int32 token count or an int64 seed holds, floats by OpenAI's ranges (which also exclude NaN
and the infinities). Checks that need the model (token ids within the vocabulary, lengths within
the context) are the engine's (``LLMEngine.validate``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields

from kvserve.errors import InvalidRequestError

MAX_LOGPROBS = 20  # OpenAI's limit for logprobs / top_logprobs
MAX_N = 128  # OpenAI's limit for n
MAX_COUNT = 2**31 - 1  # token counts (max_tokens, min_tokens, top_k): an int32 holds them
SEED_RANGE = (-2**63, 2**63 - 1)  # an int64, as OpenAI defines seed; torch.Generator.manual_seed takes it
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_STOP_CHARS = 256  # per stop string: the stream holds back this many characters at most
MAX_STOP_TOKEN_IDS = 256
# Temperatures below this decode greedily, as vLLM does: dividing logits by 1e-40 overflows to
# inf, and softmax over infinities is NaN, so "almost greedy" would sample garbage.
MIN_TEMPERATURE = 1e-5


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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


_KV_TRANSFER_FLAGS = ("do_remote_prefill", "do_remote_decode")


def _check_kv_transfer_params(p) -> None:
    if p is None:
        return
    if not isinstance(p, dict):
        raise InvalidRequestError("kv_transfer_params", f"must be an object or null, got {type(p).__name__}")
    for k, v in p.items():
        if k in _KV_TRANSFER_FLAGS:
            ok, allowed = isinstance(v, bool), "true or false"
        elif k == "transfer_id":
            ok = isinstance(v, str) and 0 < len(v) <= 64 and v.isascii() and v.isalnum()
            allowed = "an alphanumeric string of 1 to 64 characters"
        elif k == "num_blocks":
            ok, allowed = _is_int(v) and 0 <= v <= MAX_COUNT, f"an integer in [0, {MAX_COUNT}]"
        else:
            raise InvalidRequestError("kv_transfer_params", f"unknown field {str(k)[:50]!r}; known: "
                                      "do_remote_prefill, do_remote_decode, transfer_id, num_blocks")
        if not ok:
            raise InvalidRequestError(f"kv_transfer_params.{k}", f"must be {allowed}, got {v!r}"[:300])


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    temperature: float = 1.0  # below MIN_TEMPERATURE: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off; values >= the vocabulary size are off too
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
    # Tokens of KV the request may hold with KV eviction (``--kv-eviction streaming|snapkv|h2o``,
    # ``kv_eviction.py``); the range needing the model is the engine's check.
    kv_budget: int | None = None
    # Disaggregated prefill/decode (vLLM's name): {"do_remote_prefill": true, "transfer_id": ...}
    # as a prefill instance's output returned it, or {"do_remote_decode": true} for a kv_both one.
    kv_transfer_params: dict | None = None
    _stop_list: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        def bad(name, allowed):
            raise InvalidRequestError(name, f"must be {allowed}, got {getattr(self, name)!r}"[:500])

        def int_in(name, lo, hi, optional=False):
            v = getattr(self, name)
            if not (optional and v is None) and not (_is_int(v) and lo <= v <= hi):
                bad(name, f"{'None or ' if optional else ''}an integer in [{lo}, {hi}]")

        def number_in(name, lo, hi, lo_open=False):
            v = getattr(self, name)
            if not _is_number(v) or not (lo < v if lo_open else lo <= v) or not v <= hi:  # NaN fails both
                bad(name, f"a number in {'(' if lo_open else '['}{lo}, {hi}]")

        int_in("n", 1, MAX_N)
        int_in("max_tokens", 1, MAX_COUNT, optional=True)
        int_in("min_tokens", 0, MAX_COUNT)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"<= max_tokens ({self.max_tokens})")
        number_in("temperature", 0, 2)
        number_in("top_p", 0, 1, lo_open=True)
        if not (_is_int(self.top_k) and -1 <= self.top_k <= MAX_COUNT):
            bad("top_k", f"-1 (off), 0 (off) or a positive integer <= {MAX_COUNT} (values >= the vocabulary "
                "size are off)")
        number_in("min_p", 0, 1)
        number_in("repetition_penalty", 0, 100, lo_open=True)
        number_in("presence_penalty", -2, 2)
        number_in("frequency_penalty", -2, 2)
        int_in("seed", *SEED_RANGE, optional=True)
        int_in("logprobs", 0, MAX_LOGPROBS, optional=True)
        int_in("prompt_logprobs", 0, MAX_LOGPROBS, optional=True)
        int_in("kv_budget", 1, MAX_COUNT, optional=True)
        _check_kv_transfer_params(self.kv_transfer_params)
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is None:
            stops = []
        if not isinstance(stops, (list, tuple)) or len(stops) > MAX_STOP or any(
                not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS for s in stops):
            bad("stop", f"a string or a list of at most {MAX_STOP} strings, each of 1 to {MAX_STOP_CHARS} "
                "characters (non-empty)")
        self._stop_list = list(stops)
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or len(ids) > MAX_STOP_TOKEN_IDS
                                or any(not _is_int(t) or not 0 <= t <= MAX_COUNT for t in ids)):
            bad("stop_token_ids", f"a list of at most {MAX_STOP_TOKEN_IDS} non-negative integers (token ids "
                "within the vocabulary)")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "true or false")
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
        return self.temperature < MIN_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

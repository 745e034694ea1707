"""OpenAI request bodies, as pydantic models (the responses are in responses.py).

Requests forbid unknown fields: a parameter the engine does not implement is refused with a 400
naming it, never silently ignored. Fields OpenAI defines that we cannot honour are simply absent.
An explicit null for an optional field means its default, as in OpenAI's API. Numbers are typed
with ``int_in`` / ``number_in``: strict (no strings, no booleans, no NaN or infinities), bounded
(OpenAI's ranges, else what the engine's tensors hold), and an error that states the range. A
model validator raises InvalidRequestError, so that the 400 names its field.
"""
from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator, model_validator
from pydantic_core import PydanticCustomError

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import (
    MAX_COUNT,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_STOP_TOKEN_IDS,
    SEED_RANGE,
    SamplingParams,
    StructuredOutputsParams,
)


def _bounded(kind: type, lo, hi, lo_open: bool = False) -> Any:
    allowed = f"{'an integer' if kind is int else 'a number'} in {'(' if lo_open else '['}{lo}, {hi}]"

    def one_message(v, handler):
        try:
            return handler(v)
        except ValidationError:  # wrong type, NaN, out of range: one message with the whole range
            raise PydanticCustomError("out_of_range", "must be {allowed}", {"allowed": allowed}) from None

    bounds = {"gt": lo} if lo_open else {"ge": lo}
    finite = {} if kind is int else {"allow_inf_nan": False}
    return Annotated[kind, Field(strict=True, le=hi, **bounds, **finite), WrapValidator(one_message)]


def int_in(lo: int, hi: int) -> Any:
    """An integer field in [lo, hi]; JSON 1.0, "1" and true are refused."""
    return _bounded(int, lo, hi)


def number_in(lo: float, hi: float, lo_open: bool = False) -> Any:
    """A finite number in [lo, hi] (or (lo, hi]); integers are accepted."""
    return _bounded(float, lo, hi, lo_open)


def _nullable_optionals(schema: dict, _cls) -> None:
    """The schema says what the validator accepts: null for every optional field."""
    required = set(schema.get("required", ()))
    for name, prop in schema.get("properties", {}).items():
        alts = prop.get("anyOf", [prop])
        if name in required or any(a.get("type") == "null" for a in alts):
            continue
        outer = {k: prop[k] for k in ("title", "default", "description") if k in prop}
        inner = {k: v for k, v in prop.items() if k not in outer}
        schema["properties"][name] = {**outer, "anyOf": [inner, {"type": "null"}]}

# Session ids, the same in bodies and URLs: short, and safe in a path segment and a log line.
SESSION_ID_PATTERN = r"^[A-Za-z0-9._:@-]{1,256}$"


def check_session_id(session_id: str) -> str:
    """A session id from a URL, held to the body's rule."""
    if not re.fullmatch(SESSION_ID_PATTERN, session_id):
        raise InvalidRequestError("session_id", f"must be 1 to 256 characters, each one of A-Z a-z 0-9 . _ : @ - "
                                  f"(got {len(session_id)} characters)")
    return session_id


def _not_unicode(data: dict) -> str | None:
    """The path of a string or key in ``data`` that UTF-8 cannot carry, or None. Every string of
    a request is checked here, once for each model holding it, rather than field by field."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                key = f"{path}.{k}" if path else str(k)
                stack.append((k, path or "body"))
                stack.append((x, key))
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{i}]") for i, x in enumerate(v) if isinstance(x, (str, dict, list)))
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_nullable_optionals)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        if isinstance(data, dict):
            where = _not_unicode(data)
            if where is not None:
                raise InvalidRequestError(where, "is not valid Unicode (a lone surrogate: JSON can carry one, "
                                          "UTF-8 cannot)")
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}
        return data


Bool = Annotated[bool, Field(strict=True)]  # true or false: JSON 1 and "yes" are refused, as OpenAI does
TokenId = Annotated[int, Field(strict=True)]  # JSON true and 1.0 are refused; the vocabulary bounds it later
SchemaName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]  # as OpenAI's


class StreamOptions(_Request):
    include_usage: Bool = False


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
TokenCount = int_in(1, MAX_COUNT)
NumLogprobs = int_in(0, MAX_LOGPROBS)


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: SchemaName
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: Bool | None = None  # the output always follows the schema: strict or not


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's ``structured_outputs``: exactly one of these."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: Bool | None = None


_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))
_TOKEN_ID = re.compile(r"[0-9]{1,19}")  # ASCII digits only: int() would also read other scripts' digits


class _SamplingFields(_Request):
    """Parameters shared by completions and chat; OpenAI's names plus vLLM-style extras."""
    model: str
    n: int_in(1, MAX_N) = 1
    temperature: number_in(0, 2) = 1.0
    top_p: number_in(0, 1, lo_open=True) = 1.0
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    seed: int_in(*SEED_RANGE) | None = None
    presence_penalty: number_in(-2, 2) = 0.0
    frequency_penalty: number_in(-2, 2) = 0.0
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extras
    session_id: str | None = Field(None, pattern=SESSION_ID_PATTERN)  # kvserve: the conversation (KV tiers)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)  # vLLM's: shares KV only with the same salt
    top_k: int_in(-1, MAX_COUNT) = -1  # -1 or 0: off; values >= the vocabulary size are off too
    min_p: number_in(0, 1) = 0.0
    repetition_penalty: number_in(0, 100, lo_open=True) = 1.0
    ignore_eos: Bool = False
    min_tokens: int_in(0, MAX_COUNT) = 0
    stop_token_ids: list[int_in(0, MAX_COUNT)] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    kv_budget: TokenCount | None = None  # kvserve: KV tokens held with KV eviction
    kv_transfer_params: dict | None = None  # vLLM's: disaggregated prefill/decode (kvserve disagg-proxy)
    logit_bias: dict[str, number_in(-100, 100)] | None = None  # OpenAI: token id (as a string) -> [-100, 100]
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's spelling
    guided_json: dict | str | None = None  # vLLM's older spellings of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises InvalidRequestError naming the field as the client sent it."""
        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
                top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
                stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
                structured_outputs=self._structured_outputs(), logit_bias=self._logit_bias(),
                kv_budget=self.kv_budget, kv_transfer_params=self.kv_transfer_params)
        except InvalidRequestError as e:
            raise self.as_sent(e) from None

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        bias = {}
        for k, v in self.logit_bias.items():
            if not _TOKEN_ID.fullmatch(k):
                raise InvalidRequestError("logit_bias", f"keys must be token ids (decimal integers), got {k!r}")
            bias[int(k)] = v
        return bias

    def _structure_asked(self) -> list[tuple[str, dict]]:
        """(the request's field, StructuredOutputsParams arguments) for each way structure is asked."""
        asked = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise InvalidRequestError("response_format.json_schema.schema", "is required with type json_schema")
            asked.append(("response_format", {"json": rf.json_schema.schema_}))
        so = self.structured_outputs
        if so is not None:
            asked.append(("structured_outputs", {"json": so.json_, "regex": so.regex, "choice": so.choice,
                                                 "grammar": so.grammar, "json_object": bool(so.json_object)}))
        for name, key in _GUIDED:
            if getattr(self, name) is not None:
                asked.append((name, {key: getattr(self, name)}))
        return asked

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        asked = self._structure_asked()
        if len(asked) > 1:
            raise InvalidRequestError(asked[1][0], "give one of response_format (json_object or json_schema), "
                                      f"structured_outputs or guided_*, got {', '.join(n for n, _ in asked)}")
        return StructuredOutputsParams(**asked[0][1]) if asked else None

    def _sent_names(self) -> dict[str, str]:
        """SamplingParams' name -> the name this request gave the same value, where they differ."""
        return {}

    def _structured_field(self, field: str) -> str:
        """The request's own name for a structured-outputs field: structured_outputs.json given as
        a response_format is response_format.json_schema.schema, given as guided_json guided_json."""
        if not field.startswith("structured_outputs") or self.structured_outputs is not None:
            return field  # (a request that sent structured_outputs itself knows it by that name)
        rf = self.response_format
        if rf is not None and rf.type == "json_schema":
            return "response_format.json_schema.schema" if field == "structured_outputs.json" else "response_format"
        if rf is not None and rf.type == "json_object":
            return "response_format"
        for name, key in _GUIDED:
            if getattr(self, name) is not None and field in ("structured_outputs", f"structured_outputs.{key}"):
                return name
        return field

    def as_sent(self, e: InvalidRequestError) -> InvalidRequestError:
        """``e`` (raised by SamplingParams or the engine) with the field named as the client sent it."""
        name = self._sent_names().get(e.field) or self._structured_field(e.field)
        if name == e.field:
            return e
        return InvalidRequestError(name, re.sub(rf"\b{re.escape(e.field)}\b", name, e.message), e.code)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: TokenCount | None = 16  # OpenAI's default for completions
    logprobs: NumLogprobs | None = None
    echo: Bool = False  # the prompt before the completion (with logprobs: the prompt's too)
    best_of: int_in(1, MAX_N) | None = None  # sample this many, return the n with the highest cumulative logprob

    @property
    def num_samples(self) -> int:
        """How many completions the engine samples per prompt: best_of, or n."""
        if self.best_of is None:
            return self.n
        if self.best_of < max(self.n, 1):
            raise InvalidRequestError("best_of", f"must be an integer >= n ({self.n}), got {self.best_of}")
        if self.stream:
            raise InvalidRequestError("best_of", "cannot be used with stream=true")
        return self.best_of

    def _sent_names(self) -> dict[str, str]:
        return {"n": "best_of"} if self.best_of is not None else {}  # the engine samples best_of

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p) if p else [p]  # an empty list reaches the engine, which names the field


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None: no parameters
    strict: Bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(min_length=1)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this is the result of

    @model_validator(mode="after")
    def _has_content(self):  # only an assistant turn that called tools may leave it out (as OpenAI)
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise InvalidRequestError("content", "is required" + " (or tool_calls)" * (self.role == "assistant"))
        return self

    @property
    def text(self) -> str:
        c = self.content
        return c if isinstance(c, str) else "".join(p.text for p in c or [])

    def as_template_dict(self) -> dict:
        d = {"role": "system" if self.role == "developer" else self.role, "content": self.text}
        if self.tool_calls:
            d["tool_calls"] = [{"id": t.id, "type": "function",
                                "function": {"name": t.function.name, "arguments": _arguments(t.function.arguments)}}
                               for t in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            d["name"] = self.name
        return d


def _arguments(text: str) -> dict | str:
    """Chat templates (Qwen2.5's, Llama 3.1's) expect the arguments of past calls as a mapping."""
    try:
        v = json.loads(text)
    except ValueError:
        return text
    return v if isinstance(v, dict) else text


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: TokenCount | None = None  # None: up to the context length
    max_completion_tokens: TokenCount | None = None
    logprobs: Bool = False
    top_logprobs: NumLogprobs | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables, e.g. enable_thinking
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: Bool = True

    @model_validator(mode="after")
    def _check(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise InvalidRequestError("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
        return self

    def _sent_names(self) -> dict[str, str]:
        names = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit


class EmbeddingRequest(_Request):
    model: str
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # only the model's own width: we do not truncate
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        if isinstance(x, str) or (x and isinstance(x[0], int)):
            return [x]
        if not x:
            raise InvalidRequestError("input", "must not be empty")
        if len(x) > MAX_EMBEDDING_INPUTS:
            raise InvalidRequestError("input", f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(x)}")
        return list(x)


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: Bool = True

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("prompt", "give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]

"""OpenAI request and response bodies, as pydantic models.

Requests forbid unknown fields: a parameter the engine does not implement is refused with a 400
naming it, never silently ignored. Fields OpenAI defines that we cannot honour are simply absent.
"""
from __future__ import annotations

import re
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(max_length=256)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema: strict or not


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
    json_object: bool | None = None


_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))
_TOKEN_ID = re.compile(r"[0-9]{1,19}")  # ASCII digits only: int() would also read other scripts' digits


class _SamplingFields(_Request):
    """Parameters shared by completions and chat; OpenAI's names plus vLLM-style extras."""
    model: str
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # extras
    session_id: str | None = Field(None, max_length=256)  # kvserve: the conversation (KV tiers, idle offload)
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None  # OpenAI: token id (as a string) -> [-100, 100]
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's spelling
    guided_json: dict | str | None = None  # vLLM's older spellings of structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises InvalidRequestError naming the field for out-of-range values."""
        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, temperature=self.temperature,
                top_p=self.top_p, top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
                stop=self.stop, ignore_eos=self.ignore_eos, logprobs=logprobs,
                structured_outputs=self._structured_outputs(), logit_bias=self._logit_bias())
        except InvalidRequestError as e:
            raise self.api_error(e) from None

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

    def api_field(self, field: str) -> str:
        """The request's own name for an engine field: structured_outputs.json given as a
        response_format is response_format.json_schema.schema, given as guided_json guided_json."""
        if not field.startswith("structured_outputs"):
            return field
        rf = self.response_format
        if rf is not None and rf.type == "json_schema":
            return "response_format.json_schema.schema" if field == "structured_outputs.json" else "response_format"
        if rf is not None and rf.type == "json_object":
            return "response_format"
        for name, key in _GUIDED:
            if getattr(self, name) is not None and field in ("structured_outputs", f"structured_outputs.{key}"):
                return name
        return field

    def api_error(self, e: InvalidRequestError) -> InvalidRequestError:
        """``e`` under the request's own field name."""
        name = self.api_field(e.field)
        if name == e.field:
            return e
        msg = str(e)
        return InvalidRequestError(name, msg[len(e.field) + 2:] if msg.startswith(f"{e.field}: ") else msg)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: Literal[False] = False  # accepted only as "off": echo is not implemented

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p) if p else [p]  # an empty list reaches the engine, which names the field


class ContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict:
        c = self.content
        text = c if isinstance(c, str) else "".join(p.text for p in c or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to the context length
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def engine_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs", "needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# -- responses -------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV was reused (GPU prefix cache or a KV tier)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None

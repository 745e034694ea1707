"""The Responses API's request body and its input items (OpenAI's shapes), checked field by field.

`input` is a string (one user message) or a list of items:

    message               {"role": user|system|developer|assistant, "content": str | [part]}
                          parts: {"type": "input_text"|"output_text", "text": str}
    function_call         {"call_id", "name", "arguments"}       a call the model made earlier
    function_call_output  {"call_id", "output"}                  its result

Items are checked by hand rather than as a pydantic union, so a bad one gets a 400 naming its
exact place (`input[3].content[0].type`) instead of one error per union member. Checked items
are normalised to the form GET .../input_items returns and the store keeps; `to_messages` turns
a conversation of them into chat messages for the model's template.
"""
from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import Field, model_validator

from kvserve.errors import InvalidRequestError
from kvserve.sampling_params import MAX_COUNT
from kvserve.server.protocol import Bool, ChatMessage, FunctionCall, SchemaName, ToolCall, _Request, int_in, number_in

MAX_INPUT_ITEMS = 2048
MAX_METADATA = 16  # OpenAI's limits on metadata: 16 pairs, keys <= 64 characters, values <= 512
ROLES = ("user", "system", "developer", "assistant")
ITEM_TYPES = ("message", "function_call", "function_call_output")
STATUSES = ("in_progress", "completed", "incomplete")
# Output items a client sends back as input may carry these (OpenAI's output fields); they are ignored.
_MESSAGE_KEYS = {"type", "role", "content", "id", "status", "phase"}
_PART_KEYS = {"type", "text", "annotations", "logprobs"}
_CALL_KEYS = {"type", "call_id", "name", "arguments", "id", "status", "namespace", "caller", "async"}
_OUTPUT_KEYS = {"type", "call_id", "output", "id", "status"}


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: SchemaName | None = None  # required with json_schema
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: Bool | None = None


class TextOptions(_Request):
    format: TextFormat | None = None


class FunctionTool(_Request):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: Bool | None = None


class FunctionToolChoice(_Request):
    type: Literal["function"]
    name: str


class MemoryOptions(_Request):
    """kvserve: build the prompt from memory (memory/assembler.py) instead of the whole history."""
    budget_tokens: int_in(1, MAX_COUNT)
    last_turns: int_in(0, 1000) = 4  # recent turns kept verbatim
    top_k: int_in(0, 100) = 4  # past turns retrieved by similarity


class ResponsesRequest(_Request):
    model: str
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    store: Bool = True
    max_output_tokens: int_in(1, MAX_COUNT) | None = None  # None: up to the context length
    temperature: number_in(0, 2) = 1.0
    top_p: number_in(0, 1, lo_open=True) = 1.0
    metadata: dict[str, str] | None = None
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: Bool = True
    stream: Bool = False
    user: str | None = None
    memory: MemoryOptions | None = None

    @model_validator(mode="after")
    def _check(self):
        md = self.metadata or {}
        if len(md) > MAX_METADATA:
            raise InvalidRequestError("metadata", f"at most {MAX_METADATA} pairs, got {len(md)}")
        for k, v in md.items():
            if not 1 <= len(k) <= 64 or len(v) > 512:
                raise InvalidRequestError(f"metadata.{k[:64]}", "keys must be 1 to 64 characters and values at "
                                          "most 512")
        return self

    def items(self) -> list[dict]:
        """This request's input items, checked and normalised."""
        return parse_input(self.input)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _str(item: dict, key: str, where: str, empty_ok: bool = True) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise InvalidRequestError(f"{where}.{key}", f"must be a string, got {_kind(v)}")
    if not empty_ok and not v:
        raise InvalidRequestError(f"{where}.{key}", "must not be empty")
    return v


def _kind(v) -> str:
    return "null" if v is None else type(v).__name__


def _unknown(item: dict, allowed: set, where: str) -> None:
    for k in item:
        if k not in allowed:
            raise InvalidRequestError(f"{where}.{k}", f"is not a field of this item (allowed: {sorted(allowed)})")


def _echoed(item: dict, where: str) -> None:
    """The output fields a client may send back (id, status): ignored, but of their types."""
    if "id" in item and not isinstance(item["id"], str):
        raise InvalidRequestError(f"{where}.id", f"must be a string, got {_kind(item['id'])}")
    if "status" in item and item["status"] not in STATUSES:
        raise InvalidRequestError(f"{where}.status", f"must be one of {', '.join(STATUSES)}, got {item['status']!r}")


def _content(content, role: str, where: str) -> list[dict]:
    if isinstance(content, str):
        content = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content", f"must be a string or a list of parts, got {_kind(content)}")
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise InvalidRequestError(at, f"must be an object, got {_kind(part)}")
        kind = part.get("type")
        if kind not in ("input_text", "output_text"):
            raise InvalidRequestError(f"{at}.type", f"must be input_text or output_text, got {kind!r}")
        _unknown(part, _PART_KEYS, at)
        text = _str(part, "text", at)
        parts.append({"type": kind, "text": text, "annotations": []} if kind == "output_text"
                     else {"type": kind, "text": text})
    return parts


def parse_input(x) -> list[dict]:
    """Input items, normalised: every item has its type, an id and status "completed"."""
    if not x:
        raise InvalidRequestError("input", "must not be empty")
    if isinstance(x, str):
        x = [{"role": "user", "content": x}]
    if len(x) > MAX_INPUT_ITEMS:
        raise InvalidRequestError("input", f"at most {MAX_INPUT_ITEMS} items, got {len(x)}")
    items = []
    for i, item in enumerate(x):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(where, f"must be an object, got {_kind(item)}")
        kind = item.get("type", "message")
        _echoed(item, where)
        if kind == "message":
            _unknown(item, _MESSAGE_KEYS, where)
            role = item.get("role")
            if role not in ROLES:
                raise InvalidRequestError(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}")
            items.append({"id": _new_id("msg"), "type": "message", "role": role,
                          "content": _content(item.get("content"), role, where), "status": "completed"})
        elif kind == "function_call":
            _unknown(item, _CALL_KEYS, where)
            items.append({"id": _new_id("fc"), "type": "function_call",
                          "call_id": _str(item, "call_id", where, empty_ok=False),
                          "name": _str(item, "name", where, empty_ok=False),
                          "arguments": _str(item, "arguments", where), "status": "completed"})
        elif kind == "function_call_output":
            _unknown(item, _OUTPUT_KEYS, where)
            items.append({"id": _new_id("fco"), "type": "function_call_output",
                          "call_id": _str(item, "call_id", where, empty_ok=False),
                          "output": _str(item, "output", where), "status": "completed"})
        else:
            raise InvalidRequestError(f"{where}.type", f"must be one of {', '.join(ITEM_TYPES)}, got {kind!r}")
    return items


def message_item(text: str, status: str = "completed", mid: str | None = None) -> dict:
    return {"id": mid or f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed", fid: str | None = None) -> dict:
    return {"id": fid or f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def check_calls(history: list[dict], items: list[dict]) -> None:
    """Every function_call_output answers a call made earlier in the conversation."""
    known = {it["call_id"] for it in history if it["type"] == "function_call"}
    own: set[str] = set()
    for i, it in enumerate(items):
        if it["type"] == "function_call":
            if it["call_id"] in own:
                raise InvalidRequestError(f"input[{i}].call_id", f"{it['call_id']!r} is the call_id of an earlier "
                                          "function_call of this input; each call has its own")
            own.add(it["call_id"])
            known.add(it["call_id"])
        elif it["type"] == "function_call_output" and it["call_id"] not in known:
            raise InvalidRequestError(f"input[{i}].call_id", f"no function_call with call_id {it['call_id']!r} "
                                      "precedes this output in the conversation")


def to_messages(instructions: str | None, items: list[dict]) -> list[ChatMessage]:
    """Chat messages for the model's template: instructions first (as a system message), calls
    folded into the assistant message they follow, outputs as tool messages."""
    out = [ChatMessage(role="system", content=instructions)] if instructions else []
    for it in items:
        if it["type"] == "message":
            role = "system" if it["role"] == "developer" else it["role"]
            out.append(ChatMessage(role=role, content="".join(p["text"] for p in it["content"])))
        elif it["type"] == "function_call":
            call = ToolCall(id=it["call_id"], function=FunctionCall(name=it["name"], arguments=it["arguments"]))
            if out and out[-1].role == "assistant":
                out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            out.append(ChatMessage(role="tool", tool_call_id=it["call_id"], content=it["output"]))
    return out

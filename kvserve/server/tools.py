"""Tool calling for chat: checking `tools` and `tool_choice`, putting tools into the prompt, and
turning a forced call's JSON into OpenAI `tool_calls`.

    tool_choice   prompt has tools   output                          read by
    none          no                 free text                       -
    auto          yes                free text, maybe calls          the model's parser (tool_parsers.py)
    required      yes                JSON: [{"name", "parameters"}]  assemble_forced (anyOf over the tools)
    named         yes                JSON: that function's arguments assemble_forced

`required` and named calls are constrained by structured outputs (`forced_schema`), so the JSON
is valid against the schema; without the constraint a reply that does not parse stays content.
A template without tool support (SmolLM2's own, for one) gets the tools as a system-prompt
section in SmolLM2's function-calling format, past calls and results as text (`fallback_messages`).
"""
from __future__ import annotations

import json
import uuid

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from kvserve.errors import InvalidRequestError
from kvserve.server.protocol import ChatCompletionRequest, ChatTool, FunctionCall, NamedToolChoice, ToolCall

_NO_PARAMETERS = {"type": "object", "properties": {}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parameters(tool: ChatTool) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else _NO_PARAMETERS


def mode(req: ChatCompletionRequest) -> str | None:
    """None (tools off), "auto", "required" or the forced function's name; raises for a bad pair
    of tools and tool_choice, naming the field."""
    tools, choice = req.tools or [], req.tool_choice
    seen: dict[str, int] = {}
    for i, t in enumerate(tools):
        if t.function.name in seen:
            raise InvalidRequestError(f"tools[{i}].function.name", f"{t.function.name!r} is already the name of "
                                      f"tools[{seen[t.function.name]}]; tool names must be unique")
        seen[t.function.name] = i
        if t.function.parameters is not None:
            try:
                Draft202012Validator.check_schema(t.function.parameters)
            except SchemaError as e:
                where = "".join(f"[{p!r}]" for p in e.path)
                raise InvalidRequestError(f"tools[{i}].function.parameters",
                                          f"is not a JSON schema: {e.message}{' at ' + where if where else ''}"
                                          ) from None
    if choice is None:
        return "auto" if tools else None
    if choice == "none":
        return None
    if not tools:
        if choice == "auto":
            return None
        raise InvalidRequestError("tool_choice", f"{_choice_str(choice)} needs tools; none were given")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in seen:
            raise InvalidRequestError("tool_choice.function.name", f"{choice.function.name!r} is not one of the "
                                      f"tools: {sorted(seen)}")
        return choice.function.name
    return choice


def _choice_str(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def check_messages(req: ChatCompletionRequest) -> None:
    for i, m in enumerate(req.messages):
        if m.role == "tool" and not m.tool_call_id:
            raise InvalidRequestError(f"messages[{i}].tool_call_id", "a tool message needs the id of the call "
                                      "it answers")
        if m.tool_calls and m.role != "assistant":
            raise InvalidRequestError(f"messages[{i}].tool_calls", "only assistant messages carry tool calls")
        if m.tool_call_id is not None and m.role != "tool":
            raise InvalidRequestError(f"messages[{i}].tool_call_id", "only tool messages answer a tool call")


def forced_schema(req: ChatCompletionRequest, how: str) -> dict:
    """The JSON schema a `required` or named reply is constrained to (vLLM's shapes): named, the
    function's parameters; required, a non-empty array of {"name", "parameters"}, one item per
    call (at most one when parallel_tool_calls is false)."""
    tools = req.tools or []
    if how != "required":
        return next(parameters(t) for t in tools if t.function.name == how)
    # Each tool's parameters go under the array's $defs, their local references ("#/$defs/X", as
    # pydantic writes nested models, or "#" itself) rebased there: inside the array they would
    # point into the array's schema instead of the tool's.
    defs = {f"tool_{i}": _rebased(parameters(t), f"#/$defs/tool_{i}") for i, t in enumerate(tools)}
    items = {"type": "object",
             "anyOf": [{"properties": {"name": {"type": "string", "enum": [t.function.name]},
                                       "parameters": {"$ref": f"#/$defs/tool_{i}"}},
                        "required": ["name", "parameters"]} for i, t in enumerate(tools)]}
    schema = {"type": "array", "minItems": 1, "items": items, "$defs": defs}
    if not req.parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


_LITERALS = ("const", "enum", "default", "examples")  # values, not schemas: a "$ref" key in them stays
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema


def _rebased(schema, base: str):
    """``schema`` with every local ``$ref`` ("#...") moved under ``base``."""
    if isinstance(schema, list):
        return [_rebased(x, base) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "$ref" and isinstance(v, str) and v.startswith("#"):
            out[k] = base + v[1:]
        elif k in _LITERALS:
            out[k] = v
        elif k in _NAMED and isinstance(v, dict):  # a property may be called "$ref" or "enum"
            out[k] = {name: _rebased(x, base) for name, x in v.items()}
        else:
            out[k] = _rebased(v, base)
    return out


def assemble_forced(text: str, how: str) -> list[ToolCall] | None:
    """The tool calls in a constrained reply, or None if it is not the expected JSON."""
    try:
        v = json.loads(text)
    except ValueError:
        return None
    if how != "required":
        if not isinstance(v, dict):
            return None
        return [ToolCall(id=new_call_id(), function=FunctionCall(name=how, arguments=json.dumps(v)))]
    if not isinstance(v, list) or not v or not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                   and isinstance(c.get("parameters"), dict) for c in v):
        return None
    return [ToolCall(id=new_call_id(), function=FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"])))
            for c in v]


def template_supports_tools(tokenizer) -> bool:
    t = getattr(tokenizer, "chat_template", None)
    return not isinstance(t, str) or "tools" in t  # several named templates: let transformers pick


def tool_dicts(tools: list[ChatTool]) -> list[dict]:
    return [t.model_dump(exclude_none=True) for t in tools]


_FALLBACK_HEADER = (
    "You can call functions to answer the question. The available functions, as JSON, are "
    "listed between <tools> and </tools>.\n<tools>{tools}</tools>\n"
    "To call functions, reply with nothing but a JSON list of calls between <tool_call> and "
    "</tool_call>, for example:\n"
    '<tool_call>[{{"name": "function_name", "arguments": {{"argument": "value"}}}}]</tool_call>\n'
    "If no function fits, answer in plain text.")


def fallback_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """For templates that know nothing of tools: tools as a system-prompt section, past calls as
    <tool_call> text, results as user turns in <tool_response> (consecutive results merged, so
    templates that insist on alternating roles accept them)."""
    out: list[dict] = []
    if tools:
        section = _FALLBACK_HEADER.format(tools=json.dumps([t["function"] for t in tools]))
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{section}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": section})
    for m in messages:
        if m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool": True})
        elif m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in m["tool_calls"]]
            text = f"<tool_call>{json.dumps(calls)}</tool_call>"
            out.append({"role": "assistant", "content": f"{m['content']}\n{text}" if m["content"] else text})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return [{k: v for k, v in m.items() if k != "_tool"} for m in out]

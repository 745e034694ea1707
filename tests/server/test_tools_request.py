"""Tool definitions and tool_choice: the schema a `required` or named reply is constrained to,
checked with jsonschema on hand-written valid and invalid calls; the calls assembled from such a
reply; bad tools refused naming the field; tools and tool turns in the prompt."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kvserve.errors import InvalidRequestError
from kvserve.server import tools as tl
from kvserve.server.chat import template_ids
from kvserve.server.protocol import ChatCompletionRequest

pytestmark = pytest.mark.unit

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
           "required": ["city"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
         {"type": "function", "function": {"name": "ping"}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _req(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=kw.pop("messages", USER), **kw)


def _valid(schema, value) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_required_schema_accepts_calls_of_the_tools_and_nothing_else():
    schema = tl.forced_schema(_req(tools=TOOLS, tool_choice="required"), "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [
        [{"name": "get_weather", "parameters": {"city": "Paris"}}],
        [{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, {"name": "get_time",
                                                                              "parameters": {"tz": "UTC"}}],
        [{"name": "ping", "parameters": {}}],
    ]
    bad = [
        [],  # at least one call
        [{"name": "get_weather"}],  # parameters missing
        [{"name": "get_weather", "parameters": {"city": 5}}],  # wrong type
        [{"name": "get_weather", "parameters": {"city": "Paris", "days": 0}}],  # out of range
        [{"name": "get_weather", "parameters": {"town": "Paris"}}],  # not allowed, and city missing
        [{"name": "get_time", "parameters": {"city": "Paris"}}],  # another tool's parameters
        [{"name": "get_time", "parameters": {"tz": "PST"}}],  # not in the enum
        [{"name": "send_mail", "parameters": {}}],  # no such tool
        {"name": "ping", "parameters": {}},  # not a list
    ]
    assert all(_valid(schema, g) for g in good)
    assert not any(_valid(schema, b) for b in bad)
    one = tl.forced_schema(_req(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), "required")
    assert _valid(one, good[0]) and not _valid(one, good[1])


def test_named_schema_is_the_function_parameters():
    req = _req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    how = tl.mode(req)
    assert how == "get_weather"
    schema = tl.forced_schema(req, how)
    assert _valid(schema, {"city": "Oslo", "days": 2})
    assert not _valid(schema, {"days": 2}) and not _valid(schema, {"city": ["Oslo"]})
    assert _valid(tl.forced_schema(_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}}),
                                   "ping"), {})


def test_assembled_calls_carry_valid_arguments():
    reply = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}},
                        {"name": "get_time", "parameters": {"tz": "CET"}}])
    calls = tl.assemble_forced(reply, "required")
    params = {t["function"]["name"]: t["function"].get("parameters", {}) for t in TOOLS}
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), params[c.function.name])
    (named,) = tl.assemble_forced('{"city": "Rome"}', "get_weather")
    assert named.function.name == "get_weather" and json.loads(named.function.arguments) == {"city": "Rome"}
    for text, how in [("not json", "required"), ("[]", "required"), ('[{"name": "ping"}]', "required"),
                      ('{"name": "ping", "parameters": {}}', "required"), ("[1]", "get_weather"),
                      ('"Rome"', "get_weather")]:
        assert tl.assemble_forced(text, how) is None, text


def test_mode():
    assert tl.mode(_req()) is None
    assert tl.mode(_req(tools=TOOLS)) == "auto"
    assert tl.mode(_req(tools=TOOLS, tool_choice="none")) is None
    assert tl.mode(_req(tools=TOOLS, tool_choice="required")) == "required"
    assert tl.mode(_req(tool_choice="auto")) is None


@pytest.mark.parametrize("kw, field, words", [
    (dict(tools=[TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]),
     "tools[1].function.parameters", ["not a JSON schema", "objekt"]),
    (dict(tools=[{"type": "function", "function": {"name": "f",
                                                   "parameters": {"properties": {"a": {"minimum": "1"}}}}}]),
     "tools[0].function.parameters", ["not a JSON schema"]),
    (dict(tools=[TOOLS[0], TOOLS[1], TOOLS[0]]), "tools[2].function.name", ["get_weather", "tools[0]", "unique"]),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "send_mail"}}),
     "tool_choice.function.name", ["send_mail", "get_weather"]),
    (dict(tool_choice="required"), "tool_choice", ["required", "needs tools"]),
    (dict(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice", ["needs tools"]),
])
def test_bad_tools_name_the_field(kw, field, words):
    with pytest.raises(InvalidRequestError) as e:
        tl.mode(_req(**kw))
    assert e.value.field == field and all(w in str(e.value) for w in words), str(e.value)


HISTORY = USER + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "CET"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]


@pytest.mark.parametrize("messages, field", [
    ([{"role": "tool", "content": "22 C"}], "messages[0].tool_call_id"),
    ([USER[0], {"role": "user", "content": "x", "tool_call_id": "c"}], "messages[1].tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}], "messages[0].tool_calls"),
])
def test_bad_tool_turns_name_the_field(messages, field):
    with pytest.raises(InvalidRequestError) as e:
        tl.check_messages(_req(messages=messages))
    assert e.value.field == field


def test_template_without_tools_gets_a_system_section(tokenizer):
    assert not tl.template_supports_tools(tokenizer)  # SmolLM2's own template
    req = _req(messages=HISTORY, tools=TOOLS)
    text = tokenizer.decode(template_ids(tokenizer, req.messages, req.tools))
    tools_json = re.search(r"<tools>(\[.*?\])</tools>", text).group(1)
    assert json.loads(tools_json) == [t["function"] for t in TOOLS]
    calls = re.search(r"<\|im_start\|>assistant\n<tool_call>(.*?)</tool_call><\|im_end\|>", text).group(1)
    assert json.loads(calls) == [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                 {"name": "get_time", "arguments": {"tz": "CET"}}]
    # both results in one user turn, so roles still alternate
    assert "<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response>\n<tool_response>\n14:05\n" \
           "</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_template_with_tools_gets_them_as_given(tokenizer, monkeypatch):
    template = ("{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
                "{% for m in messages %}[{{ m.role }}]{% if m.tool_calls %}"
                "{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
                "{% elif m.role == 'tool' %}({{ m.tool_call_id }}){{ m.content }}{% else %}{{ m.content }}{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    monkeypatch.setattr(tokenizer, "chat_template", template)
    assert tl.template_supports_tools(tokenizer)
    req = _req(messages=HISTORY, tools=TOOLS)
    text = tokenizer.decode(template_ids(tokenizer, req.messages, req.tools))
    head, rest = text.split("\n", 1)
    assert json.loads(head[len("<tools>"):-len("</tools>")]) == TOOLS[:2] + [{"type": "function",
                                                                             "function": {"name": "ping"}}]
    assert rest.startswith("[user]Weather in Paris?[assistant]<tool_call>")
    # the template sees past arguments as a mapping, as transformers' chat templates expect
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in rest
    assert rest.endswith("[tool](call_1)22 C, sunny[tool](call_2)14:05[assistant]")


_junk = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6)
                     | st.sampled_from(["object", "string", "type", "properties", "$ref", "#/x", "["]),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                         st.sampled_from(["type", "properties", "required", "items", "enum", "$ref", "pattern",
                                          "minimum", "anyOf", "name"]) | st.text(max_size=4), inner, max_size=3),
                     max_leaves=10)
_tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", "f"]), "parameters": _junk})}), max_size=3)
_choices = st.sampled_from(["none", "auto", "required"]) | st.builds(
    lambda n: {"type": "function", "function": {"name": n}}, st.sampled_from(["f", "g", "h"]))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(tools=_tools, choice=_choices, parallel=st.booleans())
def test_any_tools_either_refused_by_field_or_give_a_schema(tools, choice, parallel):
    """Junk parameters, duplicates and unknown names end in InvalidRequestError (a 400), never
    another exception; what passes gives a forced schema that is itself a valid JSON schema."""
    try:
        req = _req(tools=tools, tool_choice=choice, parallel_tool_calls=parallel)
    except ValidationError:
        return  # pydantic's 400 (parameters not an object)
    try:
        how = tl.mode(req)
    except InvalidRequestError as e:
        assert e.field.startswith(("tools[", "tool_choice")), e.field
        return
    if how not in (None, "auto"):
        jsonschema.Draft202012Validator.check_schema(tl.forced_schema(req, how))


def test_required_schema_keeps_each_tools_own_references():
    """Parameters as pydantic writes nested and recursive models ("$ref": "#/$defs/..."), and a
    schema that refers to itself ("#"): inside the `required` array each reference still means the
    tool's own schema, for jsonschema and for the grammar the reply is decoded under."""
    import xgrammar as xgr
    from pydantic import BaseModel

    from kvserve.structured.grammar import _json_grammar

    class Address(BaseModel):
        city: str
        zip: int

    class Tree(BaseModel):
        label: str
        children: list[Tree] = []

    class Order(BaseModel):
        to: Address
        default: Address | None = None  # a property named like a keyword

    order, tree = Order.model_json_schema(), Tree.model_json_schema()
    assert "$defs" in order and "$ref" in json.dumps(tree)
    nat = {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"],
                                        "additionalProperties": False}]}
    tools = [{"type": "function", "function": {"name": n, "parameters": p}}
             for n, p in (("order", order), ("tree", tree), ("nat", nat))]
    schema = tl.forced_schema(_req(tools=tools, tool_choice="required"), "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    good = [[{"name": "order", "parameters": {"to": {"city": "Oslo", "zip": 150}}}],
            [{"name": "order", "parameters": {"to": {"city": "Oslo", "zip": 1}, "default": {"city": "A", "zip": 2}}}],
            [{"name": "tree", "parameters": {"label": "a", "children": [{"label": "b", "children": []}]}}],
            [{"name": "nat", "parameters": {"next": {"next": None}}}]]
    bad = [[{"name": "order", "parameters": {"to": {"city": "Oslo"}}}],
           [{"name": "order", "parameters": {"to": {"city": "Oslo", "zip": 1}, "default": {"zip": "x"}}}],
           [{"name": "tree", "parameters": {"label": "a", "children": [{"children": []}]}}],
           [{"name": "nat", "parameters": {"next": {"next": 5}}}]]
    for calls in good:  # the tool's own schema agrees
        assert jsonschema.Draft202012Validator(next(t["function"]["parameters"] for t in tools
                                                    if t["function"]["name"] == calls[0]["name"])
                                               ).is_valid(calls[0]["parameters"])
    assert all(_valid(schema, g) for g in good) and not any(_valid(schema, b) for b in bad)
    info = xgr.TokenizerInfo([chr(c) for c in range(32, 127)])
    compiled = xgr.GrammarCompiler(info).compile_grammar(_json_grammar(json.dumps(schema)))

    def accepts(value) -> bool:
        m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        return all(m.accept_string(ch) for ch in json.dumps(value)) and m.is_terminated()
    assert all(accepts(g) for g in good) and not any(accepts(b) for b in bad)

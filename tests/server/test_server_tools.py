"""Tool calling through the server on the default model, driven by the official openai client: a
two-step conversation (the assistant's tool calls, the tool's results, the answer) is rendered
and completed, streamed and not, and bad tool requests get a 400 naming the field. Whether a
135M model decides to call a tool is not asserted; test_tool_parsers.py reads recorded calls."""
from __future__ import annotations

import httpx
import openai
import pytest
from server_proc import ServerProcess

pytestmark = pytest.mark.slow  # a server on the real model

MODEL = "smol"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}}]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"id": "call_abc123", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
SECOND = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                     {"role": "tool", "tool_call_id": "call_abc123",
                      "content": '{"temperature_c": 22, "sky": "clear"}'}]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--served-model-name", MODEL, "--kv-cache-memory", "256MiB")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _streamed(client, **kw):
    """The reply put back together from the chunks, as a client would."""
    content, calls, reason = None, {}, None
    for ch in client.chat.completions.create(model=MODEL, stream=True, **kw):
        (c,) = ch.choices
        if c.delta.content:
            content = (content or "") + c.delta.content
        for d in c.delta.tool_calls or []:
            calls.setdefault(d.index, [d.function.name, ""])[1] += d.function.arguments or ""
        reason = c.finish_reason or reason
    return content, [tuple(v) for _, v in sorted(calls.items())], reason


@pytest.mark.parametrize("messages", [QUESTION, SECOND], ids=["ask", "answer"])
def test_tool_conversation_streamed_and_not(server, client, messages):
    kw = dict(messages=messages, tools=TOOLS, max_tokens=12, temperature=0)
    r = client.chat.completions.create(model=MODEL, **kw)
    (c,) = r.choices
    calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    assert c.message.role == "assistant" and (c.message.content or calls)
    assert c.finish_reason == ("tool_calls" if calls else c.finish_reason) and c.finish_reason in \
        ("stop", "length", "tool_calls")
    assert _streamed(client, **kw) == (c.message.content, calls, c.finish_reason)
    # the tools were rendered into the prompt
    plain = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION}).json()["count"]
    assert r.usage.prompt_tokens > plain + 40


def test_tool_choice_none_renders_no_tools(server, client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, tool_choice="none",
                                       max_tokens=4, temperature=0)
    plain = httpx.post(f"{server.url}/tokenize", json={"messages": QUESTION}).json()["count"]
    assert r.usage.prompt_tokens == plain and not r.choices[0].message.tool_calls


@pytest.mark.parametrize("kw, param", [
    (dict(tools=[TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]),
     "tools[1].function.parameters"),
    (dict(tools=TOOLS + TOOLS), "tools[1].function.name"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "send_mail"}}),
     "tool_choice.function.name"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(messages=SECOND[:2] + [{"role": "tool", "content": "22 C"}]), "messages[2].tool_call_id"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name"),
])
def test_bad_tool_requests_are_400(client, kw, param):
    kw = {"messages": QUESTION, "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, **kw)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body

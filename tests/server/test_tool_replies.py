"""The chat endpoint's tool-call replies, end to end through the official openai client, with the
model's output replaced by recorded text: the engine streams are swapped for ones that replay it
(as the engine does: cumulative text, a character at a time), so what is tested is the prompt,
the constraint handed to the engine, the parsing and the response and stream shapes."""
from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from kvserve.engine.async_engine import AsyncEngine
from kvserve.llm import LLM
from kvserve.outputs import CompletionOutput, RequestOutput
from kvserve.server import streams as st
from kvserve.server.app import build_app

MODEL = "m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "Weather in Paris and the time?"}]
TWO_CALLS = ('Checking.<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
             '{"name": "get_time", "arguments": {}}]</tool_call>')


@pytest.fixture(scope="module")
def app(model_path):
    # random tiny weights (they never run here) with the default model's tokenizer and template
    llm = LLM("dummy:tiny", tokenizer=model_path, kv_cache_memory="16MiB", show_progress=False)
    return build_app(AsyncEngine(llm.engine), MODEL)


@pytest.fixture()
def replay(monkeypatch):
    """replay.text = what the model "writes"; replay.calls records (prompt ids, params) per request."""
    class Replay:
        text = ""
        calls: list = []

    def start(engine, base_id, prompts, params, session_id=None, cache_salt=None):
        Replay.calls.append((prompts[0], params))
        return [Replay.text]

    def output(text: str, done: bool) -> RequestOutput:
        c = CompletionOutput(index=0, text=text, token_ids=list(range(len(text))), cumulative_logprob=None,
                             logprobs=None, finish_reason="stop" if done else None)
        return RequestOutput("r", None, [1], None, [c], done)

    async def merge(streams):
        text = streams[0]
        for n in range(1, len(text) + 1):
            yield 0, output(text[:n], n == len(text))

    async def collect(streams, raw):
        return [output(streams[0], True)]

    monkeypatch.setattr(st, "start", start)
    monkeypatch.setattr(st, "merge", merge)
    monkeypatch.setattr(st, "collect", collect)
    Replay.calls = []
    return Replay


def _ask(app, stream: bool, **kw):
    """(content, [(name, arguments)], finish_reason) as the client sees them."""
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http, max_retries=0)
            r = await client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, stream=stream, **kw)
            if not stream:
                (c,) = r.choices
                calls = [(t.function.name, t.function.arguments, t.id) for t in c.message.tool_calls or []]
                return c.message.content, calls, c.finish_reason
            content, calls, reason = None, {}, None
            async for ch in r:
                for c in ch.choices:
                    if c.delta.content:
                        content = (content or "") + c.delta.content
                    for d in c.delta.tool_calls or []:
                        if d.id:
                            calls[d.index] = [d.function.name, "", d.id]
                        calls[d.index][1] += d.function.arguments or ""
                    reason = c.finish_reason or reason
            return content, [tuple(v) for _, v in sorted(calls.items())], reason
    return asyncio.run(go())


def _without_ids(reply):
    content, calls, reason = reply
    assert all(i.startswith("call_") for *_, i in calls) and len({i for *_, i in calls}) == len(calls)
    return content, [(n, json.loads(a)) for n, a, _ in calls], reason


@pytest.mark.parametrize("text, kw, want", [
    (TWO_CALLS, {}, ("Checking.", [("get_weather", {"city": "Paris"}), ("get_time", {})], "tool_calls")),
    (TWO_CALLS, {"parallel_tool_calls": False}, ("Checking.", [("get_weather", {"city": "Paris"})], "tool_calls")),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', {},
     ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', [], "stop")),
    ("It is sunny.", {}, ("It is sunny.", [], "stop")),
    (TWO_CALLS, {"tool_choice": "none"}, (TWO_CALLS, [], "stop")),
    ('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]', {"tool_choice": "required"},
     (None, [("get_weather", {"city": "Oslo"})], "tool_calls")),
    ('{"city": "Rome"}', {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
     (None, [("get_weather", {"city": "Rome"})], "stop")),
])
def test_replies_streamed_and_not(app, replay, text, kw, want):
    replay.text = text
    for stream in (False, True):
        assert _without_ids(_ask(app, stream, **kw)) == want
    ids, params = replay.calls[-1]
    prompt = app.state.kvserve.engine.engine.tokenizer.decode(ids)
    assert ("<tools>[{" in prompt) == (kw.get("tool_choice") != "none")
    choice = kw.get("tool_choice")
    if choice in (None, "none"):
        assert params.structured_outputs is None
    else:  # the reply the grammar would allow is the one replayed
        jsonschema.validate(json.loads(text), params.structured_outputs.json)

"""Tool-call parsers on model outputs written the way each model family writes calls: text before
a call, several calls, malformed JSON left as content; streamed deltas, put back together as the
official openai client's chunk types describe them, equal the non-streaming reply."""
from __future__ import annotations

import json
import random

import pytest
from openai.types.chat import ChatCompletionChunk

from kvserve.server import tool_parsers as tp

pytestmark = pytest.mark.unit

WEATHER = {"city": "Paris", "unit": "celsius"}
# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [("get_weather", WEATHER)]),
    ("hermes", 'Let me look that up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'
     '\n</tool_call>', "Let me look that up.\n\n", [("get_weather", WEATHER), ("get_time", {"tz": "Europe/Paris"})]),
    # SmolLM2: a JSON list of calls in one block
    ("hermes", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
     '{"name": "get_time", "arguments": {}}]</tool_call>', None, [("get_weather", WEATHER), ("get_time", {})]),
    # the model stopped before the closing tag
    ("hermes", 'Sure. <tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}', "Sure. ",
     [("get_time", {"tz": "UTC"})]),
    # malformed JSON stays content; the well-formed call beside it is still a call
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call> and '
     '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>',
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call> and ', [("get_time", {"tz": "UTC"})]),
    ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
    ("hermes", "The weather in <b>Paris</b> is <tool_ mild: 22°C, no call here.",
     "The weather in <b>Paris</b> is <tool_ mild: 22°C, no call here.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None,
     [("get_weather", WEATHER)]),
    ("llama3_json", 'I will call two tools. {"name": "get_weather", "parameters": {"city": "Paris", "unit": '
     '"celsius"}}; {"name": "get_time", "parameters": {"tz": "UTC"}}', "I will call two tools. ",
     [("get_weather", WEATHER), ("get_time", {"tz": "UTC"})]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"', '{"name": "get_weather", '
     '"parameters": {"city": "Paris"', []),
    ("llama3_json", 'In JSON a set is {"a", "b"} and a map {"name": 1}.', 'In JSON a set is {"a", "b"} and a '
     'map {"name": 1}.', []),
]


def _parser(name):
    return tp.PARSERS[name]()


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_parse(name, text, content, calls):
    got_content, got_calls = tp.parse(_parser(name), text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") and c.type == "function" for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


def _stream(parser, text: str, cuts: list[int], parallel=True) -> list[dict]:
    """The chunks kvserve would send for `text` arriving in pieces ending at `cuts`, as JSON."""
    ts, chunks = tp.ToolStream(parser, parallel), []
    for end in cuts:
        new, deltas = ts.update(text[:end], end == len(text))
        pieces = ([{"content": new}] if new is not None else []) + \
            [{"tool_calls": [d.model_dump()]} for d in deltas]
        chunks += [{"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                    "choices": [{"index": 0, "delta": p, "finish_reason": None}]} for p in pieces]
    return chunks


def _reassemble(chunks: list[dict]):
    """What a client builds from the deltas: content concatenated, calls by index."""
    content, calls = None, {}
    for raw in chunks:
        delta = ChatCompletionChunk.model_validate(raw).choices[0].delta
        if delta.content is not None:
            content = (content or "") + delta.content
        for d in delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name and d.function.arguments == ""
                calls[d.index] = [d.function.name, ""]
            else:
                assert d.id is None and d.function.name is None
                calls[d.index][1] += d.function.arguments
    return content, [(n, a) for _, (n, a) in sorted(calls.items())]


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_streamed_deltas_reassemble_to_the_reply(name, text, content, calls):
    rng = random.Random(len(text))
    ref_content, ref_calls = tp.parse(_parser(name), text)
    ref = (ref_content, [(c.function.name, c.function.arguments) for c in ref_calls])
    every_char = list(range(1, len(text) + 1))
    random_cuts = sorted(set(rng.sample(range(1, len(text)), k=min(8, len(text) - 1))) | {len(text)})
    for cuts in (every_char, random_cuts, [len(text)]):
        assert _reassemble(_stream(_parser(name), text, cuts)) == ref


def test_content_is_never_part_of_a_tag():
    text = 'Checking. <tool_call>{"name": "f", "arguments": {}}</tool_call>'
    chunks = _stream(_parser("hermes"), text, list(range(1, len(text) + 1)))
    sent = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert sent == "Checking. " and "<" not in sent


def test_parallel_tool_calls_false_keeps_the_first():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    _, calls = tp.parse(_parser("hermes"), text, parallel=False)
    assert [c.function.name for c in calls] == ["a"]
    assert _reassemble(_stream(_parser("hermes"), text, list(range(1, len(text) + 1)), parallel=False)) == \
        (None, [("a", "{}")])


def test_forced_reply_is_read_when_complete():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    parser = tp.ForcedParser("required")
    assert parser.scan(text[:-1], False) == ("", [])
    content, calls = tp.parse(parser, text)
    assert content is None and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
    assert _reassemble(_stream(tp.ForcedParser("get_weather"), '{"city": "Rome"}', [3, 9, 16])) == \
        (None, [("get_weather", '{"city": "Rome"}')])


@pytest.mark.parametrize("template, parser", [
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "hermes"),  # no tool support: our prompt's form
    ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}... <tool_call>", "hermes"),
    ("{% if tools %}{{ tools | tojson }}{% endif %}<|python_tag|>", "llama3_json"),
    ('{% if tools %}Respond in the format {"name": function name, "parameters": dict}{% endif %}', "llama3_json"),
])
def test_detect(template, parser):
    assert tp.detect(template) == parser

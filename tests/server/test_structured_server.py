"""Structured outputs and logit_bias over HTTP, through the official openai client, on dummy:tiny
with a byte-level tokenizer: OpenAI's response_format, vLLM's structured_outputs and guided_*,
streamed and not, each output checked with jsonschema / json / re; bad specs are 400s naming the
request's own field."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from byte_tokenizer import build
from server_proc import ServerProcess

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "n": {"type": "integer", "minimum": -3, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
    "required": ["name", "n", "inner"]}
MESSAGES = [{"role": "user", "content": "Give me JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok = build(str(tmp_path_factory.mktemp("byte_tokenizer")))
    s = ServerProcess("--model", "dummy:tiny", "--tokenizer", tok, "--kv-cache-memory", "16MiB",
                      "--served-model-name", MODEL)
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _schema_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}


def test_chat_json_schema(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=6, max_tokens=300,
                                       response_format=_schema_format())
    assert all(c.finish_reason == "stop" for c in r.choices)
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert len({c.message.content for c in r.choices}) > 1


def test_chat_json_schema_streamed(client):
    for _ in range(3):
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=300, stream=True,
                                                response_format=_schema_format())
        text, finish = "", None
        for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        assert finish == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_chat_json_object_and_text(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, seed=5, max_tokens=1000,
                                       response_format={"type": "json_object"})
    assert all(c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict) for c in r.choices)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, response_format={"type": "text"},
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra, allowed", [
    ({"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}}, r"[a-c]{3}-[0-9]{2}"),
    ({"guided_regex": "(yes|no)!"}, r"(yes|no)!"),
    ({"structured_outputs": {"choice": ["alpha", "b\u00eata"]}}, r"alpha|b\u00eata"),
    ({"guided_choice": ["left", "right"]}, r"left|right"),
    ({"guided_grammar": 'root ::= "<" [a-z]{1,4} ">"'}, r"<[a-z]{1,4}>"),
])
def test_completions_regex_choice_grammar(client, extra, allowed):
    r = client.completions.create(model=MODEL, prompt="Answer:", n=6, max_tokens=50, extra_body=extra)
    assert all(c.finish_reason == "stop" and re.fullmatch(allowed, c.text) for c in r.choices), \
        [c.text for c in r.choices]


@pytest.mark.parametrize("extra", [{"structured_outputs": {"json": SCHEMA}}, {"guided_json": json.dumps(SCHEMA)},
                                   {"response_format": _schema_format()}])
def test_completions_json_streamed(client, extra):
    stream = client.completions.create(model=MODEL, prompt="JSON:", n=2, max_tokens=300, stream=True,
                                       extra_body=extra)
    texts = {}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert sorted(texts) == [0, 1]
    for t in texts.values():
        jsonschema.validate(json.loads(t), SCHEMA)


def test_logit_bias(server, client):
    def text_of(ids):
        return httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]

    def ids_of(text):
        return httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False},
                          timeout=30).json()["tokens"]

    kw = dict(model=MODEL, prompt="bias", temperature=0, extra_body={"ignore_eos": True})
    first = client.completions.create(max_tokens=1, **kw).choices[0].text
    (greedy,) = ids_of(first)
    banned = client.completions.create(max_tokens=8, logit_bias={str(greedy): -100}, **kw).choices[0].text
    assert not banned.startswith(first)  # (tests/test_structured.py checks the token ids themselves)
    forced = client.completions.create(model=MODEL, prompt="bias", max_tokens=6, temperature=1,
                                       logit_bias={"300": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == text_of([300] * 6)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": _schema_format({"type": "object", "properties": {"a": {"type": "nope"}}})},
     "response_format.json_schema.schema", ["not a valid JSON schema"]),
    ({"response_format": _schema_format({"$ref": "#/$defs/gone"})}, "response_format.json_schema.schema",
     ["cannot be compiled", "gone"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     ["required"]),
    ({"response_format": {"type": "xml"}}, "response_format.type", []),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}},
     "response_format.json_schema.extra", ["not supported"]),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", ["cannot be compiled", "parenthesis"]),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "structured_outputs.grammar", ["nothing"]),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", ["non-empty"]),
    ({"structured_outputs": {}}, "structured_outputs", ["exactly one"]),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs", ["exactly one"]),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", ["not supported"]),
    ({"guided_json": "{oops"}, "guided_json", ["JSON"]),
    ({"guided_regex": "[z-a]"}, "guided_regex", ["cannot be compiled"]),
    ({"guided_grammar": "root ::= \"a"}, "guided_grammar", ["cannot be compiled"]),
    ({"guided_choice": ["a", 1]}, "guided_choice[1]", []),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", ["one of"]),
    ({"structured_outputs": {"regex": "a+"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     ["give one of", "got response_format, structured_outputs"]),
    ({"logit_bias": {"abc": 1}}, "logit_bias", ["token ids"]),
    ({"logit_bias": {"-1": 1}}, "logit_bias", ["token ids"]),
    ({"logit_bias": {"\u0661\u0662": 1}}, "logit_bias", ["token ids"]),
    ({"logit_bias": {"512": 1}}, "logit_bias", ["[0, 512)"]),
    ({"logit_bias": {"9223372036854775808": 1}}, "logit_bias", ["[0, 512)"]),
    ({"logit_bias": {"99999999999999999999999": 1}}, "logit_bias", ["token ids"]),
    ({"logit_bias": {"5": 100.5}}, "logit_bias.5", ["[-100, 100]"]),
    ({"logit_bias": {"5": None}}, "logit_bias.5", []),
    ({"logit_bias": {"5": "x"}}, "logit_bias.5", []),
    ({"logit_bias": [5]}, "logit_bias", []),
])
def test_bad_input_is_400_naming_the_field(server, body, param, words):
    for path, base in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "x"})):
        r = httpx.post(f"{server.url}{path}", json={"model": MODEL, "max_tokens": 4, **base, **body}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error", (path, err)
        assert all(w in err["message"] for w in words), err["message"]


def test_nan_and_infinity_bias_are_400(server):
    for v in ("NaN", "Infinity", "-Infinity", "1e999"):
        body = f'{{"model": "{MODEL}", "prompt": "x", "max_tokens": 2, "logit_bias": {{"5": {v}}}}}'
        r = httpx.post(f"{server.url}/v1/completions", content=body, headers={"Content-Type": "application/json"},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias.5", (v, r.text)
    # The engine still serves.
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200

"""The Responses API through the official openai client, on dummy:tiny with a byte-level
tokenizer (in process): create / retrieve / delete / input_items, a previous_response_id chain
whose prompt is the chat template (transformers') over the whole conversation and whose output
is the chat endpoint's on that history, streaming events, function tools both ways, text.format,
tenant isolation, bad input; and (a real process) a chain continued after a restart, its KV
loaded from the disk tier."""
from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from byte_tokenizer import build
from fastapi.testclient import TestClient
from server_proc import ServerProcess
from transformers import AutoTokenizer

from kvserve.llm import LLM
from kvserve.server.app import build_app

A, B = "key-of-tenant-a", "key-of-tenant-b"
MODEL = "tiny"
STORY = "The quick brown fox jumps over the lazy dog. " * 4
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["name", "n"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return build(str(tmp_path_factory.mktemp("byte_tokenizer")))


@pytest.fixture(scope="module")
def served(tok_dir):
    def load():
        return LLM("dummy:tiny", tokenizer=tok_dir, kv_cache_memory="16MiB", show_progress=False).engine
    with TestClient(build_app(load, MODEL, api_key=[A, B])) as c:
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine did not load"
            time.sleep(0.05)
        yield c


def _client(c, key=A) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=c, max_retries=0)


def _template_len(tok_dir, messages) -> int:
    tok = AutoTokenizer.from_pretrained(tok_dir)
    return len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"])


def test_chain_rebuilds_the_conversation_and_reuses_its_kv(served, tok_dir):
    cl = _client(served)
    kw = dict(model=MODEL, max_output_tokens=12, temperature=0)
    r1 = cl.responses.create(input=STORY, instructions="Be brief.", metadata={"k": "v"}, **kw)
    assert r1.object == "response" and r1.status in ("completed", "incomplete") and r1.metadata == {"k": "v"}
    assert r1.usage.input_tokens == _template_len(tok_dir, [{"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": STORY}])
    r2 = cl.responses.create(input=[{"role": "user", "content": [{"type": "input_text", "text": "And then?"}]}],
                             previous_response_id=r1.id, instructions="Be brief.", **kw)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": STORY},
               {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "And then?"}]
    assert r2.usage.input_tokens == _template_len(tok_dir, history)
    assert r2.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt blocks
    chat = cl.chat.completions.create(model=MODEL, messages=history, max_tokens=12, temperature=0)
    assert r2.output_text == chat.choices[0].message.content  # same prompt, same greedy output
    # instructions are not inherited: without them the third turn's prompt has no system message
    r3 = cl.responses.create(input="Why?", previous_response_id=r2.id, **kw)
    assert r3.usage.input_tokens == _template_len(tok_dir, history[1:] + [
        {"role": "assistant", "content": r2.output_text}, {"role": "user", "content": "Why?"}])
    got = cl.responses.retrieve(r2.id)
    assert got.id == r2.id and got.output_text == r2.output_text and got.previous_response_id == r1.id
    items = cl.responses.input_items.list(r2.id, order="asc").data
    assert [(i.type, i.role, i.content[0].text) for i in items] == [("message", "user", "And then?")]
    cl.responses.delete(r3.id)
    with pytest.raises(openai.NotFoundError):
        cl.responses.retrieve(r3.id)
    with pytest.raises(openai.NotFoundError):
        cl.responses.delete(r3.id)


def test_store_false_is_not_retrievable(served):
    cl = _client(served)
    r = cl.responses.create(model=MODEL, input="hi", max_output_tokens=4, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        cl.responses.retrieve(r.id)


def test_stream_events_in_order_and_as_stored(served):
    cl = _client(served)
    kw = dict(model=MODEL, input=STORY, max_output_tokens=10, temperature=0)
    plain = cl.responses.create(**kw)
    events = list(cl.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if plain.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text == events[-1].response.output_text
    assert cl.responses.retrieve(events[-1].response.id).output_text == text
    fmt = {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}
    with cl.responses.stream(**{**kw, "max_output_tokens": 200, "temperature": 0.7, "text": fmt}) as s:
        deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    jsonschema.validate(json.loads(deltas), SCHEMA)
    assert final.status == "completed" and final.output_text == deltas


def test_text_format_json_schema(served):
    r = _client(served).responses.create(model=MODEL, input="JSON please", max_output_tokens=200, temperature=0.7,
                                         text={"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
def test_function_tool_round_trip(served, stream):
    cl = _client(served)
    kw = dict(model=MODEL, tools=TOOLS, max_output_tokens=60, temperature=0.8)
    ask = dict(input="Weather in Paris?", tool_choice={"type": "function", "name": "get_weather"}, **kw)
    if stream:
        with cl.responses.stream(**ask) as s:
            kinds = [e.type for e in s]
            r = s.get_final_response()
        assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= set(kinds)
    else:
        r = cl.responses.create(**ask)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    assert cl.responses.retrieve(r.id).output[-1].arguments == calls[0].arguments
    # the result goes back as a function_call_output answering that call
    kw["max_output_tokens"] = 2  # the follow-ups are compared by their prompts
    done = cl.responses.create(previous_response_id=r.id, tool_choice="none", input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature_c": 21}'}], **kw)
    alone = cl.responses.create(input="Weather in Paris?", tool_choice="none", **kw)
    assert done.output[0].type == "message" and done.usage.input_tokens > alone.usage.input_tokens
    # the same turn sent as explicit items instead of a chain: the output items as the client returns them
    items = [{"role": "user", "content": "Weather in Paris?"}, *r.output,
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature_c": 21}'}]
    again = cl.responses.create(input=items, tool_choice="none", **kw)
    assert again.usage.input_tokens == done.usage.input_tokens


def test_tenants_see_only_their_own_responses(served):
    a, b = _client(served, A), _client(served, B)
    r = a.responses.create(model=MODEL, input="secret plans", max_output_tokens=4)
    for call in (lambda: b.responses.retrieve(r.id), lambda: b.responses.delete(r.id),
                 lambda: b.responses.input_items.list(r.id),
                 lambda: b.responses.create(model=MODEL, input="go on", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert a.responses.retrieve(r.id).id == r.id  # B's attempts changed nothing


BAD = [
    ({"input": []}, "input"),
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "text": "x"}]}]}, "input[0].content[0].type"),
    ({"input": ["hi", {"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0]"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "input_text", "text": None}]}]},
     "input[1].content[0].text"),
    ({"input": [{"role": "user", "content": "a", "colour": "red"}]}, "input[0].colour"),
    ({"input": [{"type": "message", "role": "user", "content": "x", "id": 123}]}, "input[0].id"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": "x", "status": "bogus"}]},
     "input[1].status"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "status": 5}]},
     "input[0].status"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, "input[1].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "input[0].call_id"),
    ({"input": 5}, "input"),
    ({"input": None}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 2**63}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 10**9}, "max_output_tokens"),
    ({"input": "x", "temperature": 2.5}, "temperature"),
    ({"input": "x", "top_p": 0}, "top_p"),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a b", "schema": {}}}}, "text.format.name"),
    ({"input": ""}, "input"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"$ref": "#/$defs/gone"}}}},
     "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"not": {}}}}},
     "text.format.schema"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": 5}}]}, "tools[0].parameters"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "g"}, "tools": TOOLS}, "tool_choice.name"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "word " * 5000}, "input"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_a_400_naming_the_field(served, body, param):
    r = served.post("/v1/responses", json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {A}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err


def test_unknown_ids_are_404_in_openai_shape(served):
    h = {"Authorization": f"Bearer {A}"}
    r = served.get("/v1/responses/resp_none/input_items?limit=abc", headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text
    r = served.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_none"},
                    headers=h)
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    nan = served.post("/v1/responses", content='{"model": "tiny", "input": "x", "temperature": NaN}',
                      headers={**h, "Content-Type": "application/json"})
    assert nan.status_code == 400 and nan.json()["error"]["param"] == "temperature"
    lone = served.post("/v1/responses", content='{"model": "tiny", "input": "\\ud800"}',
                       headers={**h, "Content-Type": "application/json"})
    assert lone.status_code == 400 and lone.json()["error"]["param"] == "input", lone.text
    assert served.get("/v1/responses/resp_none", headers=h).status_code == 404


@pytest.mark.slow  # two server processes
def test_chain_survives_a_restart_and_loads_its_kv_from_disk(tmp_path, tok_dir):
    args = ("--model", "dummy:tiny", "--tokenizer", tok_dir, "--kv-cache-memory", "16MiB", "--served-model-name",
            MODEL, "--responses-db", str(tmp_path / "responses.db"), "--disk-kv-dir", str(tmp_path / "kv"),
            "--kv-tier-secret", "s" * 32)
    first = ServerProcess(*args)
    try:
        cl = openai.OpenAI(base_url=f"{first.url}/v1", api_key="none", max_retries=0)
        r1 = cl.responses.create(model=MODEL, input=STORY * 3, max_output_tokens=8, temperature=0)
    finally:
        rc, _ = first.terminate(60)  # SIGTERM: the GPU prefix cache goes to the disk tier
    assert rc == 0
    second = ServerProcess(*args)
    try:
        cl = openai.OpenAI(base_url=f"{second.url}/v1", api_key="none", max_retries=0)
        assert cl.responses.retrieve(r1.id).output_text == r1.output_text
        r2 = cl.responses.create(model=MODEL, input="More.", previous_response_id=r1.id, max_output_tokens=8,
                                 temperature=0)
        assert r2.usage.input_tokens_details.cached_tokens > 0
        history = [{"role": "user", "content": STORY * 3}, {"role": "assistant", "content": r1.output_text},
                   {"role": "user", "content": "More."}]
        ref = httpx.post(f"{second.url}/v1/chat/completions", json={"model": MODEL, "messages": history,
                                                                     "max_tokens": 8, "temperature": 0}, timeout=60)
        assert r2.output_text == ref.json()["choices"][0]["message"]["content"]
    finally:
        second.stop()


def test_memory_keeps_the_prompt_in_budget_and_reports_what_it_found(served):
    a = _client(served)
    kw = dict(model=MODEL, max_output_tokens=4, temperature=0)
    r = a.responses.create(input="Hello. My sister is called Ingrid.", **kw)
    for i in range(5):
        r = a.responses.create(input=f"Tell me about the ocean, part {i}. " * 3, previous_response_id=r.id, **kw)
    ask = dict(input="What is my sister's name?", previous_response_id=r.id, **kw)
    naive = a.responses.create(**ask)
    mem = a.responses.create(**ask, instructions="Be brief.", extra_body={"memory": {"budget_tokens": 80}})
    report = mem.model_extra["memory"]
    assert report["used_tokens"] <= 80 and mem.usage.input_tokens < naive.usage.input_tokens
    assert any(x["kind"] == "fact" and "Ingrid" in x["text"] and x["why"] for x in report["retrieved"])
    assert a.responses.retrieve(mem.id).model_extra["memory"] == report
    b = _client(served, B).responses.create(input="What is my sister's name?",
                                            extra_body={"memory": {"budget_tokens": 80}}, **kw)
    assert b.model_extra["memory"]["retrieved"] == []  # tenant A's memory is not B's
    with pytest.raises(openai.BadRequestError) as e:
        a.responses.create(**ask, instructions="Be brief. " * 40, extra_body={"memory": {"budget_tokens": 20}})
    assert e.value.body["param"] == "memory.budget_tokens"


def test_deleting_a_response_deletes_what_memory_took_from_it(served):
    a = _client(served)
    kw = dict(model=MODEL, max_output_tokens=4, temperature=0)
    first = a.responses.create(input="Hello. My password is hunter2. I live in Porto.", **kw)
    second = a.responses.create(input="Tell me about the sea.", previous_response_id=first.id, **kw)
    ask = dict(input="What is my password?", extra_body={"memory": {"budget_tokens": 200}}, **kw)
    seen = a.responses.create(previous_response_id=second.id, **ask).model_extra["memory"]["retrieved"]
    assert any("hunter2" in x["text"] and x["source"] == first.id for x in seen), seen
    a.responses.delete(first.id)
    left = a.responses.create(**ask).model_extra["memory"]["retrieved"]
    assert not any("hunter2" in x["text"] or x["source"] == first.id for x in left), left

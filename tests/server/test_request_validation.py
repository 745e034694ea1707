"""Request validation through the official openai client, on dummy:tiny in-process: each bad
value is a 400 in OpenAI's shape naming the field as sent and the allowed range, huge integers
included; null means the default; a tiny temperature decodes greedily; and a request that fails
inside the engine fails alone while the engine serves on."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from kvserve.engine import sampler as sampler_mod
from kvserve.engine.async_engine import AsyncEngine
from kvserve.llm import LLM
from kvserve.server.app import build_app

MODEL = "tiny"
MAX_LEN = 64
VOCAB = 512


class _TemplateOnly:
    """A chat template over dummy:tiny's ids (the model has no tokenizer), so that chat requests
    reach the engine's checks."""
    chat_template = "plain"
    eos_token_id = None

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=False, **kwargs):
        return "".join(m["content"] for m in messages)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % VOCAB for c in text] or [1]


class Served:
    def __init__(self):
        self.engine = LLM("dummy:tiny", kv_cache_memory="16MiB", max_model_len=MAX_LEN, max_num_seqs=8,
                          show_progress=False).engine
        self.engine.tokenizer = _TemplateOnly()
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.ae = AsyncEngine(self.engine)
        self.dead: list[BaseException] = []
        app = build_app(self.ae, MODEL, on_engine_dead=self.dead.append)

        async def setup():
            self.ae.start()
            self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
            return openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=self.http, max_retries=0)
        self.client = self.run(setup())

    def run(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def post(self, path: str, body: str | dict) -> httpx.Response:
        raw = body if isinstance(body, str) else json.dumps(body)
        return self.run(self.http.post(path, content=raw, headers={"content-type": "application/json"}))

    def healthy(self) -> bool:
        return self.run(self.http.get("/health")).status_code == 200


@pytest.fixture(scope="module")
def srv():
    s = Served()
    yield s
    assert s.ae.healthy and not s.dead
    s.ae.shutdown()
    s.loop.call_soon_threadsafe(s.loop.stop)


def complete(srv, **kw):
    kw = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, **kw}
    return srv.run(srv.client.completions.create(**kw))


def chat(srv, **kw):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}
    return srv.run(srv.client.chat.completions.create(**kw))


def bad_request(call, srv, **kw) -> dict:
    with pytest.raises(openai.BadRequestError) as ei:
        call(srv, **kw)
    err = ei.value.body
    assert ei.value.status_code == 400 and err["type"] == "invalid_request_error"
    assert set(err) == {"message", "type", "param", "code"}
    return err


def tokens(choice) -> list[str]:
    return choice.logprobs.tokens  # "token_id:N": the model has no tokenizer


# -- numbers the sampler cannot hold ------------------------------------------------------------

def test_huge_top_k_is_400_and_the_engine_serves_on(srv):
    err = bad_request(complete, srv, extra_body={"top_k": 99999999999999999999})
    assert err["param"] == "top_k" and "2147483647" in err["message"]
    assert srv.healthy()
    assert complete(srv).choices[0].finish_reason in ("length", "stop")


def test_top_k_beyond_the_vocabulary_is_off(srv):
    kw = dict(max_tokens=12, seed=4, logprobs=0, extra_body={"ignore_eos": True})
    off = complete(srv, **kw)
    big = complete(srv, **{**kw, "extra_body": {"ignore_eos": True, "top_k": 10**6}})
    assert tokens(big.choices[0]) == tokens(off.choices[0])


@pytest.mark.parametrize("seed", [2**64, 2**63, -2**63 - 1, 10**30])
def test_seed_outside_int64_is_400(srv, seed):
    err = bad_request(complete, srv, seed=seed)
    assert err["param"] == "seed" and str(2**63 - 1) in err["message"]


@pytest.mark.parametrize("seed", [2**63 - 1, -2**63, 0])
def test_seed_at_the_int64_edges_runs(srv, seed):
    a = complete(srv, seed=seed, max_tokens=6, logprobs=0, extra_body={"ignore_eos": True})
    b = complete(srv, seed=seed, max_tokens=6, logprobs=0, extra_body={"ignore_eos": True})
    assert len(tokens(a.choices[0])) == 6 and tokens(a.choices[0]) == tokens(b.choices[0])


@pytest.mark.parametrize("temperature", [1e-40, 1e-7, 5e-324])
def test_tiny_temperature_decodes_greedily(srv, temperature):
    kw = dict(max_tokens=16, logprobs=0, extra_body={"ignore_eos": True})
    greedy = complete(srv, temperature=0, **kw)
    tiny = complete(srv, temperature=temperature, **kw)
    assert tokens(tiny.choices[0]) == tokens(greedy.choices[0])


@pytest.mark.parametrize("value", [2.5, 2.0000001, -0.1, 1e308])
def test_temperature_beyond_openai_range_is_400(srv, value):
    err = bad_request(complete, srv, temperature=value)
    assert err["param"] == "temperature" and "[0, 2]" in err["message"]


@pytest.mark.parametrize("literal", ["Infinity", "-Infinity", "NaN", "1e999", "true", '"1"'])
def test_temperature_not_a_finite_number_is_400(srv, literal):
    r = srv.post("/v1/completions", f'{{"model": "{MODEL}", "prompt": [1], "temperature": {literal}}}')
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "temperature" and "[0, 2]" in r.json()["error"]["message"]


INT_FIELDS = ["n", "max_tokens", "seed", "top_k", "min_tokens", "logprobs"]


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("value", [2**63, 2**64 + 1, -2**63 - 1, 10**400])
def test_huge_integers_anywhere_are_400_naming_the_field(srv, field, value):
    body = json.dumps({"model": MODEL, "prompt": [1, 2], field: value})
    r = srv.post("/v1/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize("field", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p",
                                   "repetition_penalty"])
def test_huge_numbers_in_float_fields_are_400(srv, field):
    r = srv.post("/v1/completions", json.dumps({"model": MODEL, "prompt": [1, 2], field: 10**400}))
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("tokens_", [[1, 2**63], [1, -1], [VOCAB], [2**64]])
def test_prompt_token_ids_outside_the_vocabulary_are_400(srv, tokens_):
    err = bad_request(complete, srv, prompt=tokens_)
    assert err["param"] == "prompt" and f"[0, {VOCAB})" in err["message"]


def test_stop_count_and_length(srv):
    assert bad_request(complete, srv, stop=["a", "b", "c", "d", "e"])["param"] == "stop"
    assert bad_request(complete, srv, stop="x" * 257)["param"] == "stop"
    assert bad_request(complete, srv, stop=[""])["param"] == "stop[0]"
    assert complete(srv, stop=["a", "b", "c", "d"]).choices


# -- field names and codes ------------------------------------------------------------------------

def test_errors_name_the_field_as_sent(srv):
    err = bad_request(chat, srv, logprobs=True, top_logprobs=21)
    assert err["param"] == "top_logprobs" and "[0, 20]" in err["message"]
    err = bad_request(chat, srv, top_logprobs=3)
    assert err["param"] == "top_logprobs" and "logprobs" in err["message"]
    err = bad_request(chat, srv, n=129)
    assert err["param"] == "n" and "[1, 128]" in err["message"]
    err = bad_request(chat, srv, max_tokens=None, max_completion_tokens=MAX_LEN)
    assert err["param"] == "max_completion_tokens" and "max_completion_tokens" in err["message"]
    assert "max_tokens" not in err["message"].replace("max_completion_tokens", "")
    assert err["code"] == "context_length_exceeded"
    err = bad_request(chat, srv, max_tokens=MAX_LEN)
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    err = bad_request(complete, srv, logprobs=21)
    assert err["param"] == "logprobs"


def test_context_length_exceeded_code(srv):
    err = bad_request(complete, srv, prompt=[1] * MAX_LEN)
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded" and str(MAX_LEN) in err["message"]
    err = bad_request(complete, srv, prompt=[1] * 10, max_tokens=MAX_LEN - 9)
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    assert f"<= {MAX_LEN - 10}" in err["message"]


# -- null means the default -----------------------------------------------------------------------

NULLABLE = ["n", "temperature", "top_p", "stop", "presence_penalty", "frequency_penalty", "stream",
            "stream_options", "user", "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens",
            "session_id"]


def test_null_means_the_default(srv):
    base = {"model": MODEL, "prompt": [1, 2, 3], "seed": 11, "logprobs": 0}
    r0 = srv.post("/v1/completions", base)
    r1 = srv.post("/v1/completions", {**base, **dict.fromkeys(NULLABLE + ["max_tokens", "echo"])})
    assert r0.status_code == r1.status_code == 200, r1.text
    c0, c1 = r0.json()["choices"], r1.json()["choices"]
    assert len(c1) == 1 and c1[0]["logprobs"]["tokens"] == c0[0]["logprobs"]["tokens"]
    assert len(c1[0]["logprobs"]["tokens"]) <= 16  # max_tokens: null is OpenAI's default, 16
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi", "name": None}], "seed": 5,
            "max_tokens": 8}
    nulls = dict.fromkeys(NULLABLE + ["max_completion_tokens", "logprobs", "top_logprobs"])
    r0, r1 = srv.post("/v1/chat/completions", base), srv.post("/v1/chat/completions", {**base, **nulls})
    assert r0.status_code == r1.status_code == 200, r1.text
    assert r1.json()["usage"] == r0.json()["usage"]
    # Through the openai client too: None is sent as null.
    assert len(chat(srv, temperature=None, n=None, stop=None, top_p=None).choices) == 1
    # A required field stays required.
    r = srv.post("/v1/completions", {"model": None, "prompt": [1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_schema_says_optional_fields_are_nullable(srv):
    spec = srv.run(srv.http.get("/openapi.json")).json()
    props = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for name in ["n", "temperature", "max_completion_tokens", "top_logprobs", "seed"]:
        assert {"type": "null"} in props[name]["anyOf"], name
    temp = next(a for a in props["temperature"]["anyOf"] if a.get("type") == "number")
    assert (temp["minimum"], temp["maximum"]) == (0, 2)


# -- one request failing inside the engine ----------------------------------------------------------

def test_request_failing_in_the_engine_fails_alone(srv, monkeypatch):
    real = sampler_mod.apply_penalties

    def penalties(logits, rows):
        if any(r.presence_penalty == 1.5 for r in rows):
            raise ValueError("injected sampling fault")
        real(logits, rows)
    good_kw = dict(max_tokens=40, seed=2, logprobs=0, extra_body={"ignore_eos": True})
    alone = complete(srv, **good_kw)
    pool = srv.engine.kv.pool
    free0 = pool.num_free_blocks
    monkeypatch.setattr(sampler_mod, "apply_penalties", penalties)

    async def both():
        good = srv.client.completions.create(model=MODEL, prompt=[1, 2, 3], **good_kw)
        bad = srv.client.completions.create(model=MODEL, prompt=[4, 5], max_tokens=30, presence_penalty=1.5)
        return await asyncio.gather(good, bad, return_exceptions=True)
    good, bad = srv.run(both())
    assert isinstance(bad, openai.InternalServerError), bad
    assert bad.body["code"] == "request_failed" and "injected sampling fault" in bad.body["message"]
    assert tokens(good.choices[0]) == tokens(alone.choices[0])
    assert srv.healthy() and not srv.dead
    assert pool.num_free_blocks == free0
    monkeypatch.setattr(sampler_mod, "apply_penalties", real)
    assert len(tokens(complete(srv, presence_penalty=1.5, logprobs=0).choices[0])) >= 1


def test_lone_surrogate_in_a_message_is_400(srv):
    # "\ud800" is valid JSON but no Unicode string: no tokenizer can encode it.
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}'
    r = srv.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[0].content" and "Unicode" in r.json()["error"]["message"]
    assert srv.healthy()


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": None}], "messages[1].content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant"}], "messages[1].content"),
    ([{"role": "user", "content": []}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image", "text": "b"}]}],
     "messages[0].content[1].type"),
])
def test_a_message_without_content_is_400_naming_it(srv, messages, param):
    err = bad_request(chat, srv, messages=messages)
    assert err["param"] == param and err["message"].startswith(param), err


def test_an_assistant_turn_that_called_tools_needs_no_content():
    from kvserve.server.protocol import ChatCompletionRequest
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call], "content": None},
            {"role": "tool", "tool_call_id": "c1", "content": "1"}]
    req = ChatCompletionRequest.model_validate({"model": MODEL, "messages": msgs})
    assert req.messages[1].content is None and req.messages[1].tool_calls[0].function.name == "f"


@pytest.mark.parametrize("json_schema, param", [
    ({"schema": {"type": "object"}}, "response_format.json_schema.name"),
    ({"name": "", "schema": {"type": "object"}}, "response_format.json_schema.name"),
    ({"name": "has space", "schema": {"type": "object"}}, "response_format.json_schema.name"),
    ({"name": "n" * 65, "schema": {"type": "object"}}, "response_format.json_schema.name"),
])
def test_a_json_schema_needs_a_name(srv, json_schema, param):
    err = bad_request(chat, srv, response_format={"type": "json_schema", "json_schema": json_schema})
    assert err["param"] == param, err


def test_an_engine_error_about_the_samples_names_best_of_when_sent():
    """The engine samples best_of completions where best_of is given: its refusal about "n"
    (e.g. too many samples for the KV pool) names best_of, with best_of's value."""
    from kvserve.errors import InvalidRequestError
    from kvserve.server.protocol import CompletionRequest
    e = InvalidRequestError("n", "the request needs 90 KV blocks (n=8) but the pool holds 17; lower max_tokens or n")
    sent = CompletionRequest(model=MODEL, prompt=[5], n=2, best_of=8).as_sent(e)
    assert sent.field == "best_of" and "best_of=8" in sent.message and "or best_of" in sent.message
    assert CompletionRequest(model=MODEL, prompt=[5], n=8).as_sent(e) is e


def test_one_model_is_retrieved_by_its_name(srv):
    m = srv.run(srv.client.models.retrieve(MODEL))
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        srv.run(srv.client.models.retrieve("no-such-model"))
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as e:  # an oversized name is not echoed whole
        srv.run(srv.client.models.retrieve("m" * 5000))
    assert e.value.body["param"] == "model" and len(e.value.body["message"]) < 400


def test_a_named_tool_choice_without_its_function_names_what_is_missing(srv):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    err = bad_request(chat, srv, tools=tools, tool_choice={"type": "function"})
    assert err["param"] == "tool_choice.function" and "required" in err["message"], err


def test_both_token_limits_name_the_second(srv):
    err = bad_request(chat, srv, max_tokens=3, max_completion_tokens=4)
    assert err["param"] == "max_completion_tokens" and "not both" in err["message"]
    r = srv.post("/tokenize", {"model": MODEL})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "prompt", [True, 2]), ("/v1/completions", "prompt", [1.0, 2]),
    ("/v1/completions", "prompt", [[1, False]]), ("/v1/completions", "echo", 1),
    ("/v1/completions", "stream", "yes"), ("/v1/chat/completions", "logprobs", 1),
    ("/v1/chat/completions", "parallel_tool_calls", "true"), ("/v1/embeddings", "input", [True, False])])
def test_wrong_types_are_not_coerced(srv, path, field, value):
    """A boolean is not a token id, nor 1 a boolean: OpenAI refuses both, so do we."""
    base = {"/v1/completions": {"model": MODEL, "prompt": [1, 2], "max_tokens": 2},
            "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            "/v1/embeddings": {"model": MODEL, "input": [1, 2]}}[path]
    assert srv.post(path, base).status_code == 200
    r = srv.post(path, {**base, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("tokens", [[1.0], [True], [1, "2"]])
def test_detokenize_takes_integers_only(tokens):
    from pydantic import ValidationError

    from kvserve.server.protocol import DetokenizeRequest
    assert DetokenizeRequest.model_validate({"model": MODEL, "tokens": [1, 2]}).tokens == [1, 2]
    with pytest.raises(ValidationError, match="tokens"):
        DetokenizeRequest.model_validate({"model": MODEL, "tokens": tokens})


@pytest.mark.parametrize("field,value,where", [
    ("user", "\ud800", "user"), ("chat_template_kwargs", {"a": ["x", "\udfff"]}, "chat_template_kwargs.a[1]"),
    ("messages", [{"role": "user", "content": "hi", "name": "\ud800"}], "messages[0].name")])
def test_a_lone_surrogate_anywhere_is_a_400_naming_where(srv, field, value, where):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    r = srv.post("/v1/chat/completions", json.dumps(body))  # (the surrogate as JSON's escape)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == where and "Unicode" in r.text

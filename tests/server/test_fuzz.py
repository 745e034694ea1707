"""Fuzzing the server on dummy:tiny. Never a 500, every 4xx in OpenAI's error shape, no request
slower than its timeout, and the engine healthy after every case.

- Hand-made bodies (OpenAI's keys with wrong types and ranges, unknown keys, nested junk, huge
  numbers, NaN/Infinity literals, non-objects) POSTed to an in-process app.
- schemathesis: every endpoint of the server's own OpenAPI schema, values inside and outside it,
  over real HTTP, against a server without and one with --api-key (called with and without the
  key); afterwards no KV block is left in use."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_proc import ServerProcess

from kvserve.engine.async_engine import AsyncEngine
from kvserve.llm import LLM
from kvserve.server.app import build_app

MODEL = "tiny"
TIMEOUT_S = 20.0
KEYS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "stop",
        "seed", "presence_penalty", "frequency_penalty", "stream", "stream_options", "user", "top_k", "min_p",
        "repetition_penalty", "ignore_eos", "min_tokens", "logprobs", "top_logprobs", "echo", "best_of", "tools"]
ODD_NUMBERS = [0, -1, 1, 2**31, 2**63, 2**64 + 1, -2**63 - 1, 10**30, 10**400, 1e308, -1e308, 5e-324, 0.5, -0.0,
               float("nan"), float("inf"), float("-inf")]
ODD_STRINGS = ["", "NaN", "nan", "inf", "-Infinity", "1e999", "null", "tiny", "\x00", "\ud800", "é" * 50, "[DONE]"]

scalars = (st.none() | st.booleans() | st.sampled_from(ODD_NUMBERS) | st.integers()
           | st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(ODD_STRINGS) | st.text(max_size=20))
junk = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8) | st.sampled_from(KEYS), inner, max_size=4), max_leaves=12)
# Shapes close to valid, so the fuzz reaches past the type checks into range checks and the engine.
token_lists = st.lists(st.integers(-3, 600) | st.sampled_from([2**40, -2**63]), max_size=6)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "tool", "x"]),
                                           "content": st.text(max_size=10) | junk}), max_size=3)
COMMON = ["n", "temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "stream",
          "stream_options", "user", "top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "max_tokens"]
ENDPOINT_KEYS = {"/v1/completions": COMMON + ["prompt", "logprobs", "echo"],
                 "/v1/chat/completions": COMMON + ["messages", "max_completion_tokens", "logprobs", "top_logprobs"]}
VALID = {"/v1/completions": {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4},
         "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}
numbers = st.sampled_from(ODD_NUMBERS) | st.integers(-5, 70) | st.floats(-3, 3)
token_lists = st.lists(st.integers(-3, 600) | st.sampled_from([2**40, -2**63]), max_size=6)
field_values = (numbers | numbers | numbers | numbers | token_lists | st.lists(token_lists, max_size=3)
                | st.lists(st.text(max_size=5), max_size=3) | junk)


def _dump(obj) -> bytes:
    return json.dumps(obj).encode("utf-8", "surrogatepass")  # NaN/Infinity stay as the literals


@st.composite
def requests(draw):
    """(path, body): a valid body with a few fields replaced, or junk of any shape."""
    path = draw(st.sampled_from(sorted(ENDPOINT_KEYS)))
    kind = draw(st.sampled_from(["near_valid", "near_valid", "near_valid", "keys", "junk", "bytes"]))
    if kind == "near_valid":
        keys = draw(st.lists(st.sampled_from(ENDPOINT_KEYS[path]), min_size=1, max_size=3, unique=True))
        return path, _dump({**VALID[path], **{k: draw(field_values) for k in keys}})
    if kind == "keys":
        return path, _dump(draw(st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), field_values, max_size=6)))
    if kind == "junk":
        return path, _dump(draw(junk))
    return path, draw(st.binary(max_size=40))


@pytest.fixture(scope="module")
def post():
    """post(path, body bytes) -> httpx.Response, through an app whose loop runs on its own thread."""
    engine = LLM("dummy:tiny", kv_cache_memory="16MiB", max_num_seqs=8, show_progress=False).engine
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    ae = AsyncEngine(engine)
    app = build_app(ae, MODEL)

    async def setup():
        ae.start()
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fuzz")

    client = asyncio.run_coroutine_threadsafe(setup(), loop).result(30)

    def post(path: str, body: bytes) -> httpx.Response:
        coro = asyncio.wait_for(client.post(path, content=body, headers={"content-type": "application/json"}),
                                TIMEOUT_S)
        return asyncio.run_coroutine_threadsafe(coro, loop).result(TIMEOUT_S + 5)

    post.healthy = lambda: ae.healthy
    yield post
    assert ae.healthy, f"the engine died during the fuzz: {ae.error!r}"
    ae.shutdown()
    loop.call_soon_threadsafe(loop.stop)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(req=requests())
def test_no_500_and_openai_shaped_errors(post, req):
    path, body = req
    r = post(path, body)
    assert r.status_code < 500, (r.status_code, body, r.text)
    if r.status_code >= 400:
        _assert_openai_error(r)
    elif r.headers["content-type"].startswith("text/event-stream"):  # "stream" given as 1, "yes", ...
        assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text, r.text
    else:
        assert "choices" in r.json()
    assert post.healthy(), body


@pytest.mark.parametrize("path", sorted(ENDPOINT_KEYS))
@pytest.mark.parametrize("where", ["model", "user", "key"])
def test_a_string_utf8_cannot_carry_is_a_400_naming_it(post, path, where):
    """A lone surrogate (JSON can carry one, UTF-8 cannot) in any string or key of the body."""
    body = dict(VALID[path])
    if where == "key":
        body["\ud800"] = 1
    else:
        body[where] = "\ud800"
    r = post(path, _dump(body))
    assert r.status_code == 400, r.text
    _assert_openai_error(r)
    assert r.json()["error"]["param"] == {"key": "body"}.get(where, where) and "Unicode" in r.text
    assert post(path, _dump(VALID[path])).status_code < 500 and post.healthy()


def test_an_error_message_renders_whatever_it_repeats():
    from kvserve.server.errors import error_response
    r = error_response(404, "The model `\ud800` does not exist", "\udfff")
    body = json.loads(r.body)
    assert body["error"]["message"] == "The model `\\ud800` does not exist" and body["error"]["param"] == "\\udfff"


def test_sleep_without_sleep_mode_is_a_400_naming_the_option(post):
    for path in ("/sleep", "/wake_up"):
        r = post(path, b"")
        assert r.status_code == 400, r.text
        _assert_openai_error(r)
        assert r.json()["error"]["param"] == "enable_sleep_mode"
    assert post.healthy()


def test_an_unexpected_fault_is_a_500_that_keeps_the_connection(post, monkeypatch):
    """A fault no handler knows: a 500 in OpenAI's shape that the app itself answers. Starlette's
    last-resort handler would answer too, then re-raise, and the server would drop the client's
    connection (here the in-process client would raise)."""
    from kvserve.server import completions

    async def fail(*args):
        raise RuntimeError("boom")
    monkeypatch.setattr(completions, "create", fail)
    r = post("/v1/completions", _dump(VALID["/v1/completions"]))
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error" and "boom" in r.text
    _assert_openai_error(r)
    monkeypatch.undo()
    assert post("/v1/completions", _dump(VALID["/v1/completions"])).status_code == 200 and post.healthy()


def _assert_openai_error(r) -> None:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), r.text


# -- schemathesis over the OpenAPI schema ------------------------------------------------------

KEY = "fuzz-key"
OPEN_PATHS = ("/health", "/metrics")
# The schema as the server serves it at /openapi.json; building the app loads nothing.
schema = schemathesis.openapi.from_dict(build_app(lambda: None, MODEL).openapi())
schema.config.generation.update(modes=list(schemathesis.GenerationMode), max_examples=40)
schema.config.phases.update(phases=["examples", "fuzzing"])
VOCAB = 512  # dummy:tiny's


@schema.hook
def map_body(ctx, body):
    """Steer the bodies past the checks that stop most of them before the engine (a random model
    name, text prompts on a model without a tokenizer, token ids outside the vocabulary), keeping
    every other field as drawn."""
    if isinstance(body, dict):
        if "model" in body:
            body["model"] = MODEL
        p = body.get("prompt")
        if isinstance(p, str):
            body["prompt"] = [ord(c) % VOCAB for c in p[:40]] or [1]
        elif isinstance(p, list) and all(type(t) is int for t in p):
            body["prompt"] = [t % VOCAB for t in p[:40]]
    return body


@pytest.fixture(scope="module", params=["open", "api_key"])
def served(request):
    """A `kvserve serve` process with a short context (so accepted requests finish fast); the
    keyed one also has a CPU KV tier, so the session endpoints do their work."""
    args = ["--model", "dummy:tiny", "--served-model-name", MODEL, "--kv-cache-memory", "16MiB",
            "--max-model-len", "64", "--max-num-seqs", "8"]
    if request.param == "api_key":
        args += ["--api-key", KEY, "--cpu-kv-memory", "8MiB"]
    s = ServerProcess(*args)
    s.key = KEY if request.param == "api_key" else None
    yield s
    try:
        m = s.wait_idle()  # every request done: no KV block is referenced any more
        assert m["kvserve_kv_blocks_used"] == 0
        assert httpx.get(f"{s.url}/health", timeout=5).status_code == 200
    finally:
        s.stop()


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_schema_fuzz_no_500_engine_stays_healthy(case, served):
    auth = {"Authorization": f"Bearer {served.key}"} if served.key else None
    if served.key and case.path not in OPEN_PATHS:
        r = case.call(base_url=served.url, timeout=TIMEOUT_S)  # without the key
        assert r.status_code == 401, (case.path, r.status_code, r.text)
        _assert_openai_error(r)
    r = case.call(base_url=served.url, headers=auth, timeout=TIMEOUT_S)
    assert r.status_code < 500, (case.method, case.path, case.body, r.status_code, r.text)
    if r.status_code >= 400:
        _assert_openai_error(r)
    assert httpx.get(f"{served.url}/health", timeout=5).status_code == 200, (case.path, case.body)

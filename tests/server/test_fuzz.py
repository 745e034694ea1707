"""Property-based fuzz of the request schema: arbitrary JSON bodies (OpenAI's keys with wrong
types and ranges, unknown keys, nested junk, huge numbers, NaN/Infinity literals, non-objects)
POSTed to an in-process app on dummy:tiny. Never a 500, every 4xx in OpenAI's error shape, no
request slower than its timeout, and the engine still healthy afterwards."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), r.text
    elif b'"stream": true' not in body:
        assert "choices" in r.json()

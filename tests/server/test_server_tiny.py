"""The server on dummy:tiny (random weights, no tokenizer, loads in a second): errors in OpenAI's
shape, auth, body size, queue overflow, SIGTERM, and an engine fault, through real HTTP."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_proc import ServerProcess

KEY = "test-key"
MODEL = "tiny"
TINY = ["--model", "dummy:tiny", "--kv-cache-memory", "64MiB", "--served-model-name", MODEL]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(*TINY, "--api-key", KEY, "--max-request-bytes", "20000", "--max-waiting", "4",
                      "--max-num-seqs", "2")
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def test_models_and_completion(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=5, n=2, logprobs=2,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.finish_reason == "length" and len(c.logprobs.tokens) == 5 for c in r.choices)
    assert all(len(t) == 2 and all(v <= 0 for v in t.values()) for t in r.choices[0].logprobs.top_logprobs)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 10)


@pytest.mark.parametrize("kwargs, param, words", [
    (dict(temperature=-1), "temperature", ["[0, 2]"]),
    (dict(top_p=2.0), "top_p", ["(0, 1]"]),
    (dict(n=0), "n", ["[1, 128]"]),
    (dict(max_tokens=5000), "max_tokens", ["3", "5000", "2048"]),
    (dict(n=3, extra_body={"best_of": 2}), "best_of", ["best_of", ">= n"]),
    (dict(extra_body={"top_k": "many"}), "top_k", ["top_k"]),
    (dict(prompt="text needs a tokenizer"), "prompt", ["tokenizer"]),
    (dict(prompt=[]), "prompt", ["empty"]),
])
def test_bad_values_are_400_naming_the_param(client, kwargs, param, words):
    kwargs = {"prompt": [1, 2, 3], "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, **kwargs)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error"
    assert all(w in err["message"] for w in words), err["message"]


def test_chat_unsupported_param_and_unknown_model(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"functions": [{"name": "f"}]})
    assert e.value.body["param"] == "functions"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt=[1], max_tokens=1)
    assert e.value.body["code"] == "model_not_found" and "gpt-4" in e.value.body["message"]


def test_auth_and_size(server):
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": [1], "max_tokens": 1})
    assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.url}/health").status_code == 200  # open without a key
    r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "prompt": [1] * 10000, "max_tokens": 1})
    assert r.status_code == 413 and "20000" in r.json()["error"]["message"]

    def chunks():  # a chunked upload has no Content-Length: the limit still holds
        yield b'{"model": "tiny", "prompt": ['
        for _ in range(3000):
            yield b"1, 1, 1, 1, "
        yield b'1], "max_tokens": 1}'
    r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"}, content=chunks())
    assert r.status_code == 413 and "20000" in r.json()["error"]["message"]
    small = iter([b'{"model": "tiny", "prompt": [1, 2], ', b'"max_tokens": 2, "ignore_eos": true}'])
    r = httpx.post(f"{server.url}/v1/completions", content=small,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                   content=b"{not json")
    assert r.status_code == 400 and "error" in r.json()


def test_queue_overflow_is_429_then_serves(server, client):
    def one(_):
        try:
            client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=300, extra_body={"ignore_eos": True})
            return 200
        except openai.RateLimitError as e:
            assert e.body["type"] == "rate_limit_error" and "limit 4" in e.body["message"]
            return 429
    with ThreadPoolExecutor(24) as ex:
        codes = list(ex.map(one, range(24)))
    assert codes.count(429) > 0 and codes.count(200) >= 6, codes
    r = client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=3, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    m = server.wait_idle()
    assert m["kvserve_requests_total{endpoint=completions,status=429}"] == codes.count(429)


def test_disconnects_free_kv(server):
    async def run():
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
        async def gone():
            with pytest.raises(openai.APITimeoutError):
                await c.with_options(timeout=0.3).completions.create(
                    model=MODEL, prompt=[1, 2, 3], max_tokens=2000, extra_body={"ignore_eos": True})
        await asyncio.gather(*[gone() for _ in range(3)])
    asyncio.run(run())
    server.wait_idle(timeout=10)


def test_sigterm_with_requests_in_flight_exits_0():
    s = ServerProcess(*TINY, "--shutdown-timeout", "2")
    try:
        async def stream():
            c = openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0)
            try:
                async for _ in await c.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2040, stream=True,
                                                          extra_body={"ignore_eos": True}):
                    pass
            except (openai.APIError, httpx.HTTPError):
                pass

        async def run():
            tasks = [asyncio.create_task(stream()) for _ in range(3)]
            await asyncio.sleep(0.5)
            assert s.metrics()["kvserve_num_requests_running"] >= 1
            t0 = time.monotonic()
            rc, out = await asyncio.to_thread(s.terminate, 15)
            await asyncio.gather(*tasks)
            return rc, time.monotonic() - t0, out
        rc, dt, out = asyncio.run(run())
        assert rc == 0, out
        assert dt < 2 + 5, (dt, out)
    finally:
        s.stop()

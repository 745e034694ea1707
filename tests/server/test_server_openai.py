"""The server on the default model (SmolLM2), driven by the official openai package: completions,
chat, streaming with usage, n > 1, stop, seeds, logprobs; greedy chat equals the offline engine;
200 concurrent streams with a quarter disconnecting leave the engine idle with no KV in use."""
from __future__ import annotations

import asyncio
import random

import httpx
import openai
import pytest
from server_proc import ServerProcess

MODEL = "smol"
PROMPTS = ["What is the capital of France?", "Write a haiku about memory.", "List three prime numbers.",
           "Say hello in Japanese."]


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--served-model-name", MODEL, "--kv-cache-memory", "512MiB")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def _chat(client, content, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_greedy_chat_equals_offline(client):
    from kvserve import LLM, SamplingParams
    llm = LLM(show_progress=False, kv_cache_memory="256MiB")
    offline = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS[:3]],
                       SamplingParams(max_tokens=24, temperature=0))
    for p, off in zip(PROMPTS[:3], offline):
        r = _chat(client, p, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == off.outputs[0].text
        assert r.choices[0].finish_reason == off.outputs[0].finish_reason
        assert r.usage.prompt_tokens == len(off.prompt_token_ids)


def test_completion_and_tokenize(server, client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens <= 8 and r.choices[0].text
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert back.endswith("The capital of France is")
    two = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=4, n=2, temperature=0)
    assert [c.index for c in sorted(two.choices, key=lambda c: c.index)] == [0, 1, 2, 3]


def test_chat_streaming_with_usage(client):
    full = _chat(client, PROMPTS[1], max_tokens=20, temperature=0).choices[0].message.content
    chunks = list(_chat(client, PROMPTS[1], max_tokens=20, temperature=0, stream=True,
                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.delta.content or "" for c in content) == full
    assert [c.finish_reason for c in content][-1] in ("stop", "length")
    assert all(c.finish_reason is None for c in content[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 20
    assert all("\ufffd" not in (c.delta.content or "") for c in content)


def test_n_seed_and_stop(client):
    a = _chat(client, PROMPTS[1], max_tokens=12, n=3, temperature=1.0, seed=123)
    b = _chat(client, PROMPTS[1], max_tokens=12, n=3, temperature=1.0, seed=123)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1
    full = _chat(client, PROMPTS[0], max_tokens=16, temperature=0).choices[0].message.content
    stop = full.split()[2]
    r = _chat(client, PROMPTS[0], max_tokens=16, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].message.content
    assert full.startswith(r.choices[0].message.content)


def test_logprobs(client):
    r = _chat(client, PROMPTS[2], max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in lp)
    assert all(t.top_logprobs[0].token == t.token for t in lp)  # greedy picks the most likely token
    c = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0, logprobs=2)
    assert len(c.choices[0].logprobs.token_logprobs) == c.usage.completion_tokens
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, "hi", max_tokens=1000000)
    msg = e.value.body["message"]
    assert e.value.body["param"] == "max_tokens" and "1000000" in msg and "max_model_len" in msg


def test_200_streams_quarter_disconnect(server):
    async def run():
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                               http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=250),
                                                             timeout=120))
        ref = {p: (await c.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)).choices[0].text
               for p in PROMPTS}
        rng = random.Random(0)

        async def one(i):
            p = PROMPTS[i % len(PROMPTS)]
            leave_after = rng.randint(0, 6) if i % 4 == 0 else None
            stream = await c.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0, stream=True)
            text, finish = "", None
            async for k, ch in _aenumerate(stream):
                if leave_after is not None and k >= leave_after:
                    await stream.close()
                    return None
                text += ch.choices[0].text
                finish = ch.choices[0].finish_reason or finish
            return text, finish, ref[p]

        results = await asyncio.gather(*[one(i) for i in range(200)])
        done = [r for r in results if r is not None]
        assert len(done) >= 150
        assert all(f in ("stop", "length") for _, f, _ in done)
        assert all(t == want for t, _, want in done)
    asyncio.run(run())
    server.wait_idle(timeout=30)


async def _aenumerate(it):
    k = 0
    async for x in it:
        yield k, x
        k += 1

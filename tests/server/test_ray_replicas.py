"""`kvserve serve --replicas 2` on a local Ray instance (the default model, two CPU replicas of half
a core each), driven by the official openai client: the same answers as the offline engine,
streamed and not; a shared prefix lands on the replica holding it; a replica killed mid-stream
ends its stream with an error while the other's completes, and Ray brings it back."""
from __future__ import annotations

import os
import random
import signal
import time

import openai
import pytest
from ray_proc import ray_server, replica_pids

pytest.importorskip("ray", reason="the ray extra is not installed (pip install kvserve[ray])")

pytestmark = pytest.mark.slow
MODEL, KEY = "smol", "test-key"
REPLICA_HEADER = "x-kvserve-replica"


@pytest.fixture(scope="module")
def cluster():
    with ray_server("--replicas", "2", "--cpus-per-replica", "0.5", "--served-model-name", MODEL, "--api-key", KEY,
                    "--kv-cache-memory", "64MiB", "--max-model-len", "2048") as url:
        yield url


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster}/v1", api_key=KEY, max_retries=0, timeout=120)


def _chat(client, messages, **kw):
    return client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, **kw)


def test_openai_client_through_the_ray_front_end(cluster, client):
    from kvserve import LLM, SamplingParams
    prompts = ["What is the capital of France?"]
    llm = LLM(show_progress=False, kv_cache_memory="64MiB", max_model_len=2048)
    offline = llm.chat([[{"role": "user", "content": p}] for p in prompts], SamplingParams(max_tokens=16,
                                                                                        temperature=0))
    llm.shutdown()
    for p, off in zip(prompts, offline):
        r = _chat(client, [{"role": "user", "content": p}], max_tokens=16, temperature=0).parse()
        assert r.choices[0].message.content == off.outputs[0].text
        assert r.usage.prompt_tokens == len(off.prompt_token_ids)
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                     max_tokens=16, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == off.outputs[0].text
        assert chunks[-1].usage.completion_tokens == len(off.outputs[0].token_ids)
    c = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert c.choices[0].text and c.usage.completion_tokens <= 6
    # The replica's own checks answer, in OpenAI's shape, through the front end.
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2**63)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    bad_key = openai.OpenAI(base_url=f"{cluster}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.completions.create(model=MODEL, prompt="x", max_tokens=2)


def _document(seed: int) -> str:
    rng = random.Random(seed)
    words = ["cache", "block", "token", "replica", "router", "prefix", "engine", "stream", "tensor", "queue"]
    return " ".join(rng.choice(words) for _ in range(300))


def test_shared_prefixes_land_on_the_replica_holding_them(client):
    """Two long system prompts, their turns interleaved: each prompt's turns all go where its first
    went, and every later turn is a prefix hit there (per-replica hits from the replicas' own
    cached_tokens); the two prompts are spread over both replicas."""
    docs = {"a": _document(1), "b": _document(2)}
    home, hits = {}, {}
    for turn in range(4):
        for name, doc in docs.items():
            msgs = [{"role": "system", "content": doc}, {"role": "user", "content": f"Question {turn}: why?"}]
            raw = _chat(client, msgs, max_tokens=2, temperature=0)
            replica, usage = raw.headers[REPLICA_HEADER], raw.parse().usage
            home.setdefault(name, replica)
            assert replica == home[name], f"turn {turn} of {name} went to {replica}, its prefix is on {home[name]}"
            if turn:
                assert usage.prompt_tokens_details.cached_tokens >= 300, usage
            hits[replica] = hits.get(replica, 0) + usage.prompt_tokens_details.cached_tokens
    assert home["a"] != home["b"]
    assert all(hits[r] >= 3 * 300 for r in home.values()), hits


def test_a_replica_killed_mid_stream(cluster, client):
    """Two long streams, one per replica; one replica's process is killed. Its stream ends with an
    OpenAI error event; the other stream finishes; new requests succeed; Ray starts a new replica."""
    streams = []
    for i in range(2):
        s = client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"{_document(10 + i)} Tell a long story."}],
            max_tokens=64, temperature=0, stream=True, extra_body={"ignore_eos": True}).__enter__()
        streams.append((s.headers[REPLICA_HEADER], s, s.parse().__iter__()))
        next(streams[-1][2])  # the role chunk: streaming has begun
    assert streams[0][0] != streams[1][0]
    before = {r for r, _, _ in streams}
    pids = replica_pids()
    assert len(pids) == 2, pids
    os.kill(pids[0], signal.SIGKILL)
    outcomes = []
    for _, s, it in streams:
        try:
            text = "".join(c.choices[0].delta.content or "" for c in it if c.choices)
            outcomes.append(("ok", text))
        except openai.APIError as e:
            outcomes.append(("error", str(e)))
        s.close()
    assert sorted(o for o, _ in outcomes) == ["error", "ok"], outcomes
    assert any(o == "error" and "replica" in m for o, m in outcomes)
    for i in range(3):
        r = _chat(client, [{"role": "user", "content": f"Hello {i}"}], max_tokens=4, temperature=0)
        assert r.parse().choices[0].message.content
    deadline = time.monotonic() + 180
    seen = set()
    while not seen - before:  # a prompt shorter than a block ties on prefix: the emptier replica gets it
        assert time.monotonic() < deadline, f"no new replica; seen {seen}"
        r = client.completions.with_raw_response.create(model=MODEL, prompt=f"Ping {random.random()}", max_tokens=1)
        seen.add(r.headers[REPLICA_HEADER])
        time.sleep(1)

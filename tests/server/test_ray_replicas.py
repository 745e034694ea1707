"""`kvserve serve --replicas 2` on a local Ray instance (the default model, two CPU replicas of half
a core each), driven by the official openai client: the same answers as the offline engine,
streamed and not; a shared prefix lands on the replica holding it; /metrics carries both replicas'
metrics, labelled, and /health counts them; a replica killed mid-stream
ends its stream with an error while the other's completes, and Ray brings it back."""
from __future__ import annotations

import os
import random
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
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


def _samples(text: str) -> dict[str, list]:
    """Samples by family name, through prometheus_client's own parser (it rejects bad HELP/TYPE)."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_metrics_of_every_replica_and_health_counts(cluster, client):
    """Two documents, three questions each (the router keeps each document on one replica, so
    both answer, and four of the six are prefix hits): /metrics parses, its replicas' families carry a replica
    label for each of the two (with the requests each answered), the router's families count the
    same; it needs the key. /health says ok with 2 healthy replicas."""
    seen = {}
    for i in range(6):
        r = client.completions.with_raw_response.create(model=MODEL, prompt=f"{_document(20 + i % 2)} Q{i}?",
                                                        max_tokens=1)
        seen[r.headers[REPLICA_HEADER]] = seen.get(r.headers[REPLICA_HEADER], 0) + 1
    assert len(seen) == 2, seen
    assert httpx.get(f"{cluster}/metrics").status_code == 401
    deadline = time.monotonic() + 30
    while True:  # replicas report every second: wait for both reports to include the requests above
        r = httpx.get(f"{cluster}/metrics", headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        fams = _samples(r.text)
        answered = {}
        for s in fams["kvserve_requests"]:
            if s.name == "kvserve_requests_total" and s.labels["endpoint"] == "completions" and \
                    s.labels["status"] == "200":
                answered[s.labels["replica"]] = answered.get(s.labels["replica"], 0) + s.value
        if set(answered) == set(seen) and all(answered[k] >= n for k, n in seen.items()):
            break
        assert time.monotonic() < deadline, (answered, seen)
        time.sleep(0.5)
    for name in ("kvserve_num_requests_running", "kvserve_time_to_first_token_seconds"):
        assert {s.labels["replica"] for s in fams[name]} == set(seen), name
    routed = {s.labels["replica"]: s.value for s in fams["kvserve_router_requests"] if s.name.endswith("_total")}
    assert all(routed[k] >= n for k, n in seen.items()), (routed, seen)
    assert {s.labels["replica"]: s.value for s in fams["kvserve_router_in_flight"]} == {k: 0 for k in seen}
    decisions = {s.labels["decision"]: s.value for s in fams["kvserve_router_decisions"] if s.name.endswith("_total")}
    assert decisions["prefix_hit"] >= 4 and sum(decisions.values()) >= sum(routed.values()), decisions
    assert {s.labels["state"]: s.value for s in fams["kvserve_router_replicas"]} == {"live": 2, "healthy": 2}
    health = httpx.get(f"{cluster}/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "replicas": 2, "healthy_replicas": 2}


def test_a_replica_killed_mid_stream(cluster, client):
    """Two long streams, one per replica; one replica's process is killed. Its stream ends with an
    OpenAI error event; the other stream finishes; new requests succeed; Ray starts a new replica."""
    def open_stream(i):
        # A system prompt of its own: no block in common with the other stream, so load alone places it.
        s = client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "system", "content": f"Storyteller {i}."},
                                   {"role": "user", "content": f"{_document(10 + i)} Tell a long story."}],
            max_tokens=64, temperature=0, stream=True, extra_body={"ignore_eos": True}).__enter__()
        it = s.parse().__iter__()
        next(it)  # the role chunk: streaming has begun
        return s.headers[REPLICA_HEADER], s, it

    streams = [open_stream(0)]
    # The router sends the second stream to the idle replica, but Ray passes over a replica that
    # misses its queue-length probe deadline (a loaded machine), so a placement may be retried.
    for attempt in range(1, 6):
        second = open_stream(attempt)
        if second[0] != streams[0][0]:
            streams.append(second)
            break
        second[1].close()
    assert len(streams) == 2, "every second stream landed on the first stream's replica"
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

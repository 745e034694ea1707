"""Tenants on one server (dummy:tiny, in process, through the official openai client): prefix-cache
isolation by key, by request and by cache_salt, seen in usage.prompt_tokens_details.cached_tokens
and in the engine's prefix-cache hit counter; sessions owned by the key that made them; /metrics
behind the key, /health without internals; the KV-waste gauge at rest."""
from __future__ import annotations

import random
import time

import openai
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvserve.llm import LLM
from kvserve.server.app import build_app

A, B = "key-of-tenant-a", "key-of-tenant-b"
MODEL = "tiny"
BLOCK = 16
PROMPT = random.Random(0).choices(range(1, 250), k=3 * BLOCK + 5)  # 3 full blocks to share


def _app(keys=(A, B), **kw):
    def load():
        return LLM("dummy:tiny", kv_cache_memory="16MiB", show_progress=False, cpu_kv_memory="8MiB").engine
    return build_app(load, MODEL, api_key=list(keys) or None, **kw)


def _ready(c: TestClient) -> TestClient:
    deadline = time.monotonic() + 60
    while c.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the engine did not load"
        time.sleep(0.05)
    return c


@pytest.fixture(scope="module", params=["none", "key", "request"])
def served(request):
    with TestClient(_app(prefix_cache_isolation=request.param)) as c:
        yield request.param, _ready(c)


def _client(c: TestClient, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=c, max_retries=0)


def _metrics(c: TestClient, key: str = A) -> dict[str, float]:
    text = c.get("/metrics", headers={"Authorization": f"Bearer {key}"}).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def _cached(c: TestClient, key: str, prompt, **extra) -> tuple[int, int]:
    """(usage's cached_tokens, growth of the engine's prefix-cache hit counter) for one request."""
    before = _metrics(c)["kvserve_prefix_cache_hits_total"]
    r = _client(c, key).completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                           extra_body={"ignore_eos": True, **extra})
    hits = _metrics(c)["kvserve_prefix_cache_hits_total"] - before
    return r.usage.prompt_tokens_details.cached_tokens, int(hits)


def test_prefix_sharing_across_keys_follows_the_isolation_mode(served):
    mode, c = served
    prompt = [t + 1 for t in PROMPT]
    assert _cached(c, A, prompt) == (0, 0)
    shared = 3 * BLOCK
    if mode == "none":  # one shared cache, as without isolation
        assert _cached(c, B, prompt) == (shared, shared)
    else:  # another key never hits tenant A's blocks
        assert _cached(c, B, prompt) == (0, 0)
    # the same key again: a hit, except in "request" mode, where an unsalted request shares nothing
    assert _cached(c, A, prompt) == ((0, 0) if mode == "request" else (shared, shared))


def test_cache_salt_sets_requests_apart_in_every_mode(served):
    mode, c = served
    prompt = [t + 2 for t in PROMPT]
    shared = 3 * BLOCK
    assert _cached(c, A, prompt, cache_salt="one") == (0, 0)
    assert _cached(c, A, prompt, cache_salt="two") == (0, 0)
    assert _cached(c, A, prompt) == (0, 0)  # salted blocks are not the unsalted cache's
    assert _cached(c, A, prompt, cache_salt="one") == (shared, shared)
    # the same salt from another key: shared only when keys are not isolated
    assert _cached(c, B, prompt, cache_salt="one") == ((shared, shared) if mode == "none" else (0, 0))


@pytest.mark.parametrize("salt", ["", "x" * 1025, 7, None])
def test_bad_cache_salt_is_400_naming_it(served, salt):
    _, c = served
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1, "cache_salt": salt}
    r = c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {A}"})
    if salt is None:  # null: no salt, as when absent
        assert r.status_code == 200
        return
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text


def test_sessions_belong_to_their_key_and_unknown_ids_are_404(served):
    _, c = served
    a, b = _client(c, A), _client(c, B)
    a.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"session_id": "conv-1"})
    for client in (a, b):
        for method in ("post", "delete"):  # pin, unpin: never seen, or seen only under the other key
            sid = "conv-1" if client is b else "never-seen"
            with pytest.raises(openai.NotFoundError) as e:
                client.post(f"/sessions/{sid}/pin", cast_to=object) if method == "post" else \
                    client.delete(f"/sessions/{sid}/pin", cast_to=object)
            assert e.value.body["param"] == "session_id" and e.value.body["code"] == "session_not_found"
        with pytest.raises(openai.NotFoundError):
            client.post(f"/sessions/{'conv-1' if client is b else 'never-seen'}/offload", cast_to=object)
    assert a.post("/sessions/conv-1/pin", cast_to=object) == {"session_id": "conv-1", "pinned": True}
    assert a.delete("/sessions/conv-1/pin", cast_to=object) == {"session_id": "conv-1", "pinned": False}


@pytest.mark.parametrize("sid", ["x" * 257, "a%20b", "a%2Fb", "caf%C3%A9"])
def test_session_ids_in_urls_follow_the_body_rule(served, sid):
    _, c = served
    auth = {"Authorization": f"Bearer {A}"}
    r = c.post(f"/v1/sessions/{sid}/pin", headers=auth)
    if "%2F" in sid:  # a "/" splits the path: no such endpoint
        assert r.status_code == 404 and "error" in r.json()
    else:
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 1,
            "session_id": sid.replace("%20", " ").replace("%2F", "/").replace("%C3%A9", "é")}
    r = c.post("/v1/completions", json=body, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text


def test_metrics_need_the_key_unless_public():
    with TestClient(_app()) as c:
        _ready(c)
        r = c.get("/metrics")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.get("/metrics", headers={"Authorization": f"Bearer {B}"}).status_code == 200
    with TestClient(_app(metrics_public=True)) as c:
        assert "kvserve_engine_healthy" in _ready(c).get("/metrics").text


def test_health_tells_internals_only_with_the_key():
    with TestClient(_app()) as c:
        ae = _ready(c).app.state.kvserve.engine
        ae.error = RuntimeError("secret detail at /srv/models/weights")
        try:
            r = c.get("/health")
            assert r.status_code == 503 and "secret" not in r.text and "RuntimeError" not in r.text
            r = c.get("/health", headers={"Authorization": f"Bearer {A}"})
            assert r.status_code == 503 and "secret detail" in r.json()["error"]["message"]
        finally:
            ae.error = None


def test_kv_waste_gauge_is_zero_at_rest():
    with TestClient(_app(prefix_cache_isolation="key")) as c:
        _ready(c)
        # 3 prompt + 4 new tokens fill 7 of a block's 16 slots: the last step wasted over half
        _client(c, A).completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4,
                                         extra_body={"ignore_eos": True})
        m = _metrics(c)
        assert m["kvserve_num_requests_running"] == 0 and m["kvserve_kv_blocks_used"] == 0
        assert m["kvserve_kv_waste"] == 0.0


@pytest.mark.parametrize("keys", [(A,), (A, B)])
def test_the_dashboard_shows_requests_only_where_one_tenant_holds_the_keys(keys):
    """Any key opens /dashboard: with several tenants a frame lists no request (not its id, not
    its block table), only how many run; with one, its own requests are listed."""
    import json
    import threading
    with TestClient(_app(keys)) as c:
        _ready(c)
        h = {"Authorization": f"Bearer {A}"}
        done, leave = threading.Event(), threading.Event()

        def long_request():  # streamed, left once the frame is read
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1900, "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/completions", headers=h, json=body) as r:
                for _ in r.iter_lines():
                    if leave.is_set():
                        break
            done.set()
        t = threading.Thread(target=long_request, daemon=True)
        t.start()
        frames, several = [], len(keys) > 1
        with c.stream("GET", "/dashboard/events", headers={"Authorization": f"Bearer {keys[-1]}"}) as r:
            for line in r.iter_lines():  # until a frame shows the request (listed, or counted)
                if line.startswith("data: "):
                    frames.append(json.loads(line[6:]))
                    if frames[-1]["requests_omitted" if several else "requests"] or done.is_set():
                        break
        assert not done.is_set(), "the request ended before any frame showed it"
        if several:
            assert all(f["requests"] == [] for f in frames) and frames[-1]["requests_omitted"] == 1, frames[-1]
        else:
            assert [q["blocks"] > 0 for q in frames[-1]["requests"]] == [True], frames[-1]
        leave.set()
        t.join(30)
        assert done.is_set()

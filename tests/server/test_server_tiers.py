"""The server's KV-tier surface through real HTTP: `session_id` on requests, the session pin and
offload endpoints, /v1/kv_tiers; and clear 400s (the server still serving) when tiers are off or
a session id is too long."""
from __future__ import annotations

import time

import httpx
import pytest
from server_proc import ServerProcess

MODEL = "tiny"
TINY = ["--model", "dummy:tiny", "--kv-cache-memory", "4MiB", "--served-model-name", MODEL]
PROMPT = list(range(1, 200))  # 12 full blocks of 16


def _complete(url, prompt, **extra):
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3,
                                                  "temperature": 0, "ignore_eos": True, **extra}, timeout=60)
    return r


@pytest.fixture(scope="module")
def tiered():
    s = ServerProcess(*TINY, "--cpu-kv-memory", "64MiB", "--idle-offload-seconds", "3600")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain():
    s = ServerProcess(*TINY)
    yield s
    s.stop()


def test_tier_endpoints_without_tiers_are_clear_400s(plain):
    for method, path in (("GET", "/v1/kv_tiers"), ("POST", "/v1/sessions/s1/pin"),
                         ("DELETE", "/v1/sessions/s1/pin"), ("POST", "/v1/sessions/s1/offload")):
        r = httpx.request(method, f"{plain.url}{path}", timeout=10)
        assert r.status_code == 400, (path, r.text)
        msg = r.json()["error"]["message"]
        assert "--cpu-kv-memory" in msg and "--redis-url" in msg, msg
    ok = _complete(plain.url, [1, 2, 3])
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) >= 0


def test_session_id_too_long_is_rejected_and_service_continues(tiered):
    r = _complete(tiered.url, [1, 2, 3], session_id="x" * 257)
    assert r.status_code == 400 and "session_id" in r.text
    assert _complete(tiered.url, [1, 2, 3], session_id="fine").status_code == 200


def test_offload_endpoint_moves_a_session_and_its_next_turn_loads(tiered):
    first = _complete(tiered.url, PROMPT, session_id="conv")
    assert first.status_code == 200
    before = httpx.get(f"{tiered.url}/v1/kv_tiers", timeout=10).json()
    r = httpx.post(f"{tiered.url}/v1/sessions/conv/offload", timeout=10)
    assert r.status_code == 200 and r.json()["session_id"] == "conv"
    deadline = time.monotonic() + 10
    while True:  # the command runs on the engine thread
        stats = httpx.get(f"{tiered.url}/v1/kv_tiers", timeout=10).json()
        if stats["load"]["idle_offloaded_blocks"] > before["load"]["idle_offloaded_blocks"]:
            break
        assert time.monotonic() < deadline, stats["load"]
        time.sleep(0.1)
    assert stats["cpu"]["stores"] >= 12
    again = _complete(tiered.url, PROMPT + [7], session_id="conv")
    assert again.status_code == 200
    after = httpx.get(f"{tiered.url}/v1/kv_tiers", timeout=10).json()
    assert after["load"]["tokens_loaded"]["cpu"] - before["load"]["tokens_loaded"]["cpu"] == 12 * 16


def test_pin_endpoints(tiered):
    assert _complete(tiered.url, [1, 2, 3], session_id="p").status_code == 200
    assert httpx.post(f"{tiered.url}/v1/sessions/p/pin", timeout=10).json() == {"session_id": "p", "pinned": True}
    assert httpx.delete(f"{tiered.url}/v1/sessions/p/pin", timeout=10).json() == {"session_id": "p", "pinned": False}

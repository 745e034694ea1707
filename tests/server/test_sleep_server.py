"""Sleep mode through real HTTP: /sleep, /wake_up and /is_sleeping behind the API key, a request
that arrives while asleep wakes the engine and is served, bad arguments are 400s naming the field,
a sleep with a request in flight is a 409, and --idle-sleep puts an idle server to sleep."""
from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_proc import REPO, ServerProcess

KEY = "sleep-key"
MODEL = "tiny"
TINY = ["--model", "dummy:tiny", "--kv-cache-memory", "64MiB", "--served-model-name", MODEL]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(*TINY, "--api-key", KEY, "--enable-sleep-mode")
    yield s
    s.stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def _complete(client) -> tuple[list[str], list]:
    r = client.completions.create(model=MODEL, prompt=[5, 9, 100, 7], max_tokens=6, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    return c.logprobs.tokens, c.logprobs.token_logprobs


def _post(server, path: str, **params) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", params=params, headers=AUTH, timeout=60)


def _sleeping(server) -> dict:
    r = httpx.get(f"{server.url}/is_sleeping", headers=AUTH, timeout=60)
    assert r.status_code == 200
    return r.json()


@pytest.mark.parametrize("method, path", [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping")])
def test_endpoints_need_the_key(server, method, path):
    r = httpx.request(method, f"{server.url}{path}", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.request(method, f"{server.url}{path}", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert r.status_code == 401


def test_a_request_wakes_the_server_and_is_served(server, client):
    ref = _complete(client)
    assert _sleeping(server) == {"is_sleeping": False, "level": 0}
    for level in (1, 2):
        r = _post(server, "/sleep", level=level)
        assert r.status_code == 200 and r.json() == {"is_sleeping": True, "level": level}
        assert _post(server, "/sleep", level=3 - level).json() == {"is_sleeping": True, "level": level}  # no-op
        assert _sleeping(server) == {"is_sleeping": True, "level": level}
        assert _complete(client) == ref  # queued, not rejected
        assert _sleeping(server)["is_sleeping"] is False
    assert _post(server, "/sleep").json()["level"] == 1  # level 1 by default
    assert _post(server, "/wake_up", tags="kv_cache").json() == {"is_sleeping": True}
    assert _post(server, "/wake_up", tags="weights").json() == {"is_sleeping": False}
    assert _post(server, "/wake_up").json() == {"is_sleeping": False}  # awake already: no-op
    assert _complete(client) == ref


@pytest.mark.parametrize("query", ["level=0", "level=3", "level=-1", "level=abc", "level=1.5", "level=nan",
                                   "level=Infinity", "level=9223372036854775808", "level=", "level=%EF%BC%91",
                                   "level=1&level=2", "level=null"])
def test_bad_levels_are_400(server, query):
    r = httpx.post(f"{server.url}/sleep?{query}", headers=AUTH, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "level" and "must be 1 or 2" in err["message"]
    assert err["type"] == "invalid_request_error"
    assert _sleeping(server)["is_sleeping"] is False


@pytest.mark.parametrize("query", ["tags=gpu", "tags=weights&tags=", "tags=" + "%C3%A9" * 5000])
def test_bad_tags_are_400(server, query):
    r = httpx.post(f"{server.url}/wake_up?{query}", headers=AUTH, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "tags" and "weights, kv_cache" in err["message"]
    assert len(err["message"]) < 400


def test_sleep_with_a_request_in_flight_is_409(server, client):
    stream = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=1900, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    r = _post(server, "/sleep", level=1)
    err = r.json()["error"]
    assert r.status_code == 409 and err["code"] == "engine_busy" and "in flight" in err["message"]
    assert _sleeping(server)["is_sleeping"] is False
    stream.close()  # the request is aborted; then the engine may sleep
    deadline = time.monotonic() + 30
    while (r := _post(server, "/sleep", level=1)).status_code == 409 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.status_code == 200 and _sleeping(server)["is_sleeping"] is True
    assert _post(server, "/wake_up").json() == {"is_sleeping": False}


def test_sleep_mode_off_is_400_naming_it():
    s = ServerProcess(*TINY)
    try:
        for path in ("/sleep", "/wake_up"):
            r = httpx.post(f"{s.url}{path}", timeout=30)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "enable_sleep_mode", err
            assert "--enable-sleep-mode" in err["message"]
        assert httpx.get(f"{s.url}/is_sleeping", timeout=30).json() == {"is_sleeping": False, "level": 0}
    finally:
        s.stop()


def test_idle_sleep_then_a_request_wakes_it():
    s = ServerProcess(*TINY, "--enable-sleep-mode", "--idle-sleep", "1")
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
        deadline = time.monotonic() + 30
        while not httpx.get(f"{s.url}/is_sleeping", timeout=30).json()["is_sleeping"]:
            assert time.monotonic() < deadline, "the idle server did not fall asleep"
            time.sleep(0.2)
        r = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=4, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
    finally:
        s.stop()


@pytest.mark.parametrize("args, message", [
    (["--idle-sleep", "1"], "idle_sleep: needs --enable-sleep-mode"),
    (["--enable-sleep-mode", "--idle-sleep", "nan"], "idle_sleep: must be a number of seconds"),
    (["--enable-sleep-mode", "--idle-sleep", "0"], "idle_sleep: must be a number of seconds"),
    (["--enable-sleep-mode", "--idle-sleep", "inf"], "idle_sleep: must be a number of seconds"),
])
def test_bad_idle_sleep_exits_2_before_loading(args, message):
    p = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", *TINY, *args], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and message in p.stderr, p.stderr

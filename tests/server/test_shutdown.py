"""A real `kvserve serve` on dummy:tiny: what clients and the log see when the server stops with
requests still open past --shutdown-timeout, when the port is taken; how dropped clients are
counted; keys from the command line as tenants."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from server_proc import REPO, ServerProcess

MODEL = "tiny"
TINY = ["--model", "dummy:tiny", "--kv-cache-memory", "64MiB", "--served-model-name", MODEL]
LONG = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True}


def test_requests_open_past_the_shutdown_timeout_end_in_openai_shape():
    s = ServerProcess(*TINY, "--shutdown-timeout", "1")
    lines: list[str] = []
    plain: list[httpx.Response] = []

    def stream():
        with httpx.stream("POST", f"{s.url}/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
            lines.extend(line for line in r.iter_lines() if line)

    def whole():
        plain.append(httpx.post(f"{s.url}/v1/completions", json=LONG, timeout=30))

    try:
        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while s.metrics()["kvserve_num_requests_running"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        rc, out = s.terminate(20)
        for t in threads:
            t.join(10)
    finally:
        s.stop()
    assert rc == 0, out
    assert "Traceback" not in out and "Cancel" not in out, out
    assert lines[-1] == "data: [DONE]", lines[-3:]
    err = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "server_shutting_down", err
    assert len(lines) > 3  # tokens were streamed before the deadline
    (r,) = plain
    assert r.status_code == 503, r.text
    body = r.json()["error"]
    assert body["type"] == "service_unavailable" and body["code"] == "server_shutting_down"


def test_busy_port_is_one_error_line_and_a_nonzero_exit():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), *TINY], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    assert "listening" not in p.stdout + p.stderr and "loaded" not in p.stdout
    errs = p.stderr.strip().splitlines()
    assert len(errs) == 1 and "cannot listen" in errs[0] and str(port) in errs[0], p.stderr


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(*TINY, "--api-key", "k", "k2", "--prefix-cache-isolation", "key", "--max-num-seqs", "4")
    yield s
    s.stop()


def _counts(server) -> dict[str, float]:
    return {k: v for k, v in server.metrics().items() if k.startswith("kvserve_requests_total{endpoint=completions")}


def _wait_counted(server, before: dict, n: int) -> dict[str, float]:
    deadline = time.monotonic() + 15
    while True:
        now = _counts(server)
        new = {k: v - before.get(k, 0) for k, v in now.items() if v != before.get(k, 0)}
        if sum(new.values()) >= n or time.monotonic() > deadline:
            return new
        time.sleep(0.1)


def test_dropped_clients_are_counted_once_as_499(server):
    auth = {"Authorization": "Bearer k"}
    before = _counts(server)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, headers=auth,
                      timeout=30) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # a first event, then the client goes
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server.url}/v1/completions", json=LONG, headers=auth, timeout=0.5)
    server.wait_idle(timeout=15)
    assert _wait_counted(server, before, 2) == {"kvserve_requests_total{endpoint=completions,status=499}": 2}


def test_each_key_given_on_the_command_line_is_a_tenant(server):
    prompt = list(range(10, 60))  # 3 full blocks of 16

    def cached(key):
        c = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
        r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        return r.usage.prompt_tokens_details.cached_tokens

    assert (cached("k"), cached("k2"), cached("k")) == (0, 0, 48)

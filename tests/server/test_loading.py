"""/health is 503 {"status": "loading"} while the model loads, API paths 503 in OpenAI's shape,
then 200; a model that fails to load stops the server with exit code 2."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
from fastapi.testclient import TestClient
from server_proc import REPO, free_port

from kvserve.engine.llm_engine import LLMEngine
from kvserve.server.app import build_app


def _tiny_engine() -> LLMEngine:
    from kvserve.llm import LLM
    return LLM("dummy:tiny", kv_cache_memory="16MiB", show_progress=False).engine


def test_in_process_503_until_loaded():
    release = threading.Event()

    def load():
        assert release.wait(30)
        return _tiny_engine()

    with TestClient(build_app(load)) as c:
        r = c.get("/health")
        assert (r.status_code, r.json()) == (503, {"status": "loading"})
        r = c.post("/v1/completions", json={"model": "dummy:tiny", "prompt": [1], "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert c.get("/v1/models").status_code == 503
        assert "kvserve_engine_healthy 0.0" in c.get("/metrics").text
        release.set()
        deadline = time.monotonic() + 30
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert c.get("/v1/models").json()["data"][0]["id"] == "dummy:tiny"  # the model's own name
        r = c.post("/v1/completions", json={"model": "dummy:tiny", "prompt": [1, 2], "max_tokens": 3,
                                            "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def _serve(*args: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", "--port", str(port), *args], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p, f"http://127.0.0.1:{port}"


def test_server_process_answers_while_loading():
    """Polled from the start: the first answers are 503 loading (the model loads after the port
    opens), then 200; never a 200 before the engine exists. The model is the default one's shape
    with random weights: building it takes about a second, where a tiny model can be ready
    before the first poll connects."""
    p, url = _serve("--model", "dummy:smollm2-135m", "--kv-cache-memory", "64MiB")
    seen = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not seen or seen[-1] != 200):
            assert p.poll() is None, p.stdout.read()
            try:
                r = httpx.get(f"{url}/health", timeout=2)
                seen.append(r.status_code)
                if r.status_code == 503:
                    assert r.json() == {"status": "loading"}
            except httpx.HTTPError:
                time.sleep(0.02)
        assert seen and seen[-1] == 200 and set(seen) <= {200, 503}, seen
        assert 503 in seen, "the port should open before the model is loaded"
        r = httpx.post(f"{url}/v1/completions", json={"model": "dummy:smollm2-135m", "prompt": [1],
                                                       "max_tokens": 2})
        assert r.status_code == 200
    finally:
        p.kill()
        p.wait(10)


def test_load_failure_exits_2():
    p, _ = _serve("--model", "dummy:tiny", "--max-model-len", "999999")
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 2 and "max_model_len" in out, out

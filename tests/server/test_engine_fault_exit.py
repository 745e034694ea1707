"""A device fault stops the engine: the request in flight gets a 500, /health turns 503 and the
server process exits with status 3, so a supervisor restarts it."""
from __future__ import annotations

import subprocess
import sys
import time

import httpx
from server_proc import REPO, free_port

# The server, with the sampler raising a CUDA-style error for rows with presence_penalty 1.5.
SERVE = """
import sys
from kvserve.engine import sampler
real = sampler.apply_penalties
def penalties(logits, rows):
    if any(r.presence_penalty == 1.5 for r in rows):
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
    real(logits, rows)
sampler.apply_penalties = penalties
from kvserve.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_device_fault_makes_the_server_exit_3():
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", SERVE, "serve", "--port", str(port), "--model", "dummy:tiny",
                             "--served-model-name", "tiny", "--kv-cache-memory", "16MiB"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 3}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        r = httpx.post(f"{url}/v1/completions", json={**body, "presence_penalty": 1.5}, timeout=30)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error", r.text
        assert "CUDA error" in r.json()["error"]["message"]
        try:
            assert httpx.get(f"{url}/health", timeout=2).status_code == 503
        except httpx.TransportError:
            pass  # already gone, or going: refused, reset or closed with no answer
        assert proc.wait(timeout=30) == 3
        assert "the engine stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

"""A real `kvserve serve` process on a free loopback port, for the server tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, env: dict | None = None, startup_timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = args[args.index("--api-key") + 1] if "--api-key" in args else None  # /metrics needs it
        cmd = [sys.executable, "-m", "kvserve.cli", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.proc.stdout.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("server did not become healthy in time")

    def metrics(self) -> dict[str, float]:
        """Unlabelled samples by name (labelled ones as name{k=v,...})."""
        headers = {"Authorization": f"Bearer {self.key}"} if self.key else {}
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=5).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
                                if s.labels else "")
                out[key] = s.value
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        """Poll /metrics until nothing runs or waits and no KV block is referenced."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m["kvserve_num_requests_running"] == 0 and m["kvserve_num_requests_waiting"] == 0
                    and m["kvserve_kv_blocks_used"] == 0):
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle after {timeout}s: {m}")
            time.sleep(0.1)

    def terminate(self, timeout: float) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        return rc, self.proc.stdout.read()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

"""Fixtures for the KV tier tests: a private Redis server, engines on the tiny model
(``tierutil.tiny_llm``), the shared-prefix prompts and their reference (recomputed) outputs."""
from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
import time

import pytest
from tierutil import REDIS_SERVER, Prompts, Reference, tiny_llm


# -- Redis ---------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


try:  # Linux: a server whose test process dies without running its finalizers is killed too
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl if sys.platform == "linux" else None
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent() -> None:
    """Runs in the forked child before exec: nothing but one libc call (no imports, no locks)."""
    _prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL


class RedisURL(str):
    """The server's URL (a str), with ``stop()``/``start()`` (same port, empty data: no
    persistence) and ``client()``."""

    def __new__(cls, port: int, workdir: str):
        self = super().__new__(cls, f"redis://127.0.0.1:{port}/0")
        self.port, self.workdir, self.proc = port, workdir, None
        return self

    def start(self) -> None:
        assert self.proc is None, "already running"
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.workdir, "--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.workdir,
            preexec_fn=_die_with_parent if _prctl is not None else None)  # noqa: PLW1509 (see _die_with_parent)
        import redis
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                self.proc = None
                raise RuntimeError(f"redis-server exited at start on port {self.port}")
            try:
                if self.client().ping():
                    return
            except (OSError, redis.exceptions.RedisError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        proc.kill()  # not a clean shutdown: like a crash, nothing saved
        proc.wait(timeout=10)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2)


@pytest.fixture
def redis_server(tmp_path_factory):
    """A private ``redis-server`` on a free loopback port (no persistence), killed at the end.
    Yields its URL; ``redis_server.stop()`` / ``.start()`` restart it on the same port."""
    if not os.path.exists(REDIS_SERVER):
        pytest.fail("redis-server is not installed (scripts/test.sh installs it)")
    url = RedisURL(_free_port(), str(tmp_path_factory.mktemp("redis")))
    url.start()
    try:
        yield url
    finally:
        url.stop()


# -- engines ---------------------------------------------------------------------------------------
@pytest.fixture
def make_llm():
    """``make_llm(**LLM kwargs)``: an engine on the tiny model (float32 on the CPU)."""
    return tiny_llm


@pytest.fixture(scope="session")
def prompts() -> Prompts:
    return Prompts()


# -- references ---------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def reference(prompts) -> Reference:
    ref = Reference(lambda: tiny_llm(kv_cache_memory="4MiB", enable_prefix_caching=False))
    ref(prompts.a, prompts.b, prompts.c)  # one batch for the prompts most tests use
    yield ref
    ref._llm = None

"""Fixtures for the KV tier tests: a private Redis server, a fast way to build engines on the
default model, the shared-prefix prompts and their reference (recomputed) outputs.

The default model's GGUF metadata and dequantized weights are read once per test session and
replayed to every engine these tests build in-process (``make_llm``): the engine code under test
is unchanged, only the seconds of GGUF parsing per engine are saved. Engines started in a
subprocess (the restart tests) load the model the ordinary way.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import subprocess
import sys
import time

import pytest
from tierutil import GREEDY, REDIS_SERVER, Prompts

from kvserve import LLM


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
_loaded: dict = {}


@contextlib.contextmanager
def _replayed_weights(path: str):
    """Inside: ``loader.resolve``/``iter_weights`` and the tokenizer serve what the first load
    of ``path`` read. Outside: untouched."""
    from kvserve.engine import llm_engine
    from kvserve.models import loader
    real_resolve, real_iter, real_tok = loader.resolve, loader.iter_weights, llm_engine.load_tokenizer

    def resolve(model):
        if model != path:
            return real_resolve(model)
        if "src" not in _loaded:
            _loaded["src"] = real_resolve(model)
        return _loaded["src"]

    def iter_weights(src):
        if src is not _loaded.get("src"):
            return real_iter(src)
        if "weights" not in _loaded:
            _loaded["weights"] = list(real_iter(src))
        return iter(_loaded["weights"])

    def load_tokenizer(kind, p, tokenizer=None):
        if p != path or tokenizer is not None:
            return real_tok(kind, p, tokenizer)
        if "tok" not in _loaded:
            _loaded["tok"] = real_tok(kind, p, tokenizer)
        return _loaded["tok"]

    loader.resolve, loader.iter_weights, llm_engine.load_tokenizer = resolve, iter_weights, load_tokenizer
    try:
        yield
    finally:
        loader.resolve, loader.iter_weights, llm_engine.load_tokenizer = real_resolve, real_iter, real_tok


@pytest.fixture(scope="session")
def _weights_cache():
    yield _loaded
    _loaded.clear()


@pytest.fixture
def make_llm(model_path, _weights_cache):
    """``make_llm(**LLM kwargs)``: an engine on the default model (float32 on the CPU)."""
    made = []

    def make(**kw) -> LLM:
        kw.setdefault("show_progress", False)
        kw.setdefault("device", "cpu")
        kw.setdefault("dtype", "float32")
        with _replayed_weights(model_path):
            llm = LLM(model_path, **kw)
        made.append(llm)
        return llm

    yield make
    made.clear()


@pytest.fixture(scope="session")
def prompts(tokenizer) -> Prompts:
    return Prompts(tokenizer)


# -- references ---------------------------------------------------------------------------------------
class Reference:
    """Greedy outputs by plain recomputation: a fresh engine without tiers or prefix caching,
    so every prompt is computed from its first token. Cached per prompt."""

    def __init__(self, make):
        self._make = make
        self._llm = None
        self._out: dict[tuple, list[int]] = {}

    def __call__(self, *token_lists: list[int]) -> list[int] | list[list[int]]:
        missing = [t for t in dict.fromkeys(tuple(x) for x in token_lists) if t not in self._out]
        if missing:
            if self._llm is None:
                self._llm = self._make()
            outs = self._llm.generate([{"prompt_token_ids": list(t)} for t in missing], GREEDY, use_tqdm=False)
            for t, o in zip(missing, outs):
                assert o.metrics.num_cached_tokens == 0 and o.metrics.num_loaded_tokens == 0
                self._out[t] = list(o.outputs[0].token_ids)
        res = [self._out[tuple(x)] for x in token_lists]
        return res[0] if len(res) == 1 else res


@pytest.fixture(scope="session")
def reference(model_path, _weights_cache, prompts) -> Reference:
    def make():
        with _replayed_weights(model_path):
            return LLM(model_path, show_progress=False, device="cpu", dtype="float32", kv_cache_memory="64MiB",
                       enable_prefix_caching=False)
    ref = Reference(make)
    ref(prompts.a, prompts.b, prompts.c)  # one batch for the prompts most tests use
    yield ref
    ref._llm = None

"""Tensor-parallel worker processes: ranks 1 .. N-1 of an engine, each a ModelRunner in lockstep
with rank 0's.

    rank 0 (the engine's process)                 rank r (spawned here)
    scheduler, block tables, sampling             its slice of every layer and of the KV heads
    runner.method(args) ----- send_object ----->  runner.method(args)      (same KV ops, same
            forward: all-reduce per layer <---->  forward                   forward, same graphs)
            logits: gather to rank 0  <---------  its vocabulary slice

Rank 0 sends each step's runner calls that touch rank state (``ModelRunner._MIRRORED``) before
running them itself, so every rank's KV cache holds its heads of the same blocks. Control
messages travel over gloo, the layers' collectives over the device's group (``layers/parallel.py``).

Shutdown: ``close`` (engine closed, LLM shut down or collected) sends a stop message and joins;
a worker that dies makes rank 0's next message or collective fail, which is reported as
``WorkerDiedError`` naming the rank and its exit code, after the other workers are stopped. A
worker whose rank 0 dies sees its sockets close and exits; workers are daemons besides.
"""
from __future__ import annotations

import contextlib
import logging
import os
import weakref

import torch

from kvserve.config import EngineConfig
from kvserve.layers.parallel import TPGroup

log = logging.getLogger(__name__)

_STOP = "stop"
_JOIN_SECONDS = 30.0


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank is gone; the engine cannot step any more."""


class Workers:
    """Rank 0's handle on ranks 1 .. N-1."""

    def __init__(self, config: EngineConfig, max_model_len: int, runner_cls: type):
        """``runner_cls``: the ModelRunner class each worker builds."""
        n = config.tensor_parallel_size
        self.store = TPGroup.make_store(0, n)
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs = [ctx.Process(target=_worker_main, args=(r, self.store.port, config, max_model_len, runner_cls),
                                  name=f"kvserve-tp{r}", daemon=True) for r in range(1, n)]
        for p in self.procs:
            p.start()
        self.tp: TPGroup | None = None  # set by connect
        self.error: WorkerDiedError | None = None
        self._finalizer = weakref.finalize(self, _stop, self.procs, None)

    def connect(self, device: torch.device) -> TPGroup:
        """Rank 0's group, once every worker has joined (a worker that fails to start first is
        reported, not waited for)."""
        import time
        keys = [f"joined{r}" for r in range(1, len(self.procs) + 1)]
        while not self.store.check(keys):
            self._check_alive()
            time.sleep(0.05)
        self.tp = TPGroup(0, len(self.procs) + 1, self.store, device)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.tp)
        return self.tp

    def send(self, name: str, args: tuple) -> None:
        """Every worker runs ``runner.name(*args)`` (rank 0 runs it next, itself)."""
        self._check_alive()
        with self.guard():
            self.tp.send_object((name, args))

    @contextlib.contextmanager
    def guard(self):
        """A collective that fails because a rank is gone raises ``WorkerDiedError``."""
        if self.error is not None:
            raise self.error
        try:
            yield
        except RuntimeError as e:
            if isinstance(e, WorkerDiedError):
                raise
            self._check_alive(wait=2.0)
            self._fail(f"a tensor-parallel collective failed ({type(e).__name__}: {str(e)[:300]})", e)

    def _check_alive(self, wait: float = 0.0) -> None:
        if self.error is not None:
            raise self.error
        for p in self.procs:
            if wait:
                p.join(wait)
            if not p.is_alive():
                self._fail(f"tensor-parallel worker {p.name} (rank {self.procs.index(p) + 1}) exited with "
                           f"code {p.exitcode}")

    def _fail(self, what: str, cause: BaseException | None = None) -> None:
        self.error = WorkerDiedError(f"{what}; the engine is down: start a new one")
        self.close()
        raise self.error from cause

    def close(self) -> None:
        self._finalizer()


def _stop(procs, tp: TPGroup | None) -> None:
    """Stop the workers: a stop message where they can hear it, then terminate what is left."""
    alive = [p for p in procs if p.is_alive()]
    if tp is not None and len(alive) == len(procs):
        try:
            tp.send_object((_STOP, ()))
        except RuntimeError:
            pass
    for p in alive:
        p.join(_JOIN_SECONDS)
        if p.is_alive():
            p.kill()
            p.join(_JOIN_SECONDS)


def _worker_main(rank: int, port: int, config: EngineConfig, max_model_len: int, runner_cls: type) -> None:
    """Rank ``rank``: build its runner (its slice of the model), then run rank 0's calls."""
    from kvserve.models import loader
    n = config.tensor_parallel_size
    store = TPGroup.make_store(rank, n, port)
    store.set(f"joined{rank}", "1")
    runner = runner_cls(config, loader.resolve(config.model), max_model_len, tp_rank=rank, tp_store=store)
    while True:
        name, args = runner.tp.recv_object()
        if name == _STOP:
            # Nothing to flush; the interpreter's teardown (torch's, the groups' with rank 0's still
            # open) would only delay the exit rank 0 is waiting for.
            os._exit(0)
        getattr(runner, name)(*args)

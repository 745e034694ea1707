"""The ModelRunner's tensor-parallel side: its rank's group, its slice of the model's shape, and
the calls rank 0 mirrors to the workers (``tp_workers.py``).

What every rank must run in the same order, because it changes rank state or holds collectives:

    _apply_kv_ops   swaps, copy-on-write copies, preempted requests' residual rows
    _kv             KIVI residual rows handed out / forked / dropped
    _forward        the step's forward (all-reduce per layer; a replayed CUDA graph likewise)
    _logits         the LM head: rank 0 broadcasts the rows, every rank multiplies its vocabulary
                    slice, rank 0 gathers (sampling, log-probs, verification all go through it)
    hidden_states   a chunk of an embedding's forward (each rank keeps the input's scratch cache)
    drop_embedding  an input abandoned between chunks
    allocate        the KV pool of rank 0's plan, each rank's own heads; then its CUDA graphs

Everything else (scheduling, block tables, sampling, grammars) stays on rank 0. With one rank
none of this runs and nothing distributed is imported.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from kvserve.errors import ConfigError


class TensorParallel:
    tp = None  # TPGroup: this rank's, when the model is split across ranks
    workers = None  # tp_workers.Workers: rank 0's handle on the others

    def _start_tp(self, rank: int, store) -> None:
        """Join (rank 0: start) the group and narrow ``self.arch`` to this rank's heads and MLP
        width, which the KV cache and CUDA set-up read."""
        n = self.config.tensor_parallel_size
        if n == 1:
            return
        from kvserve.layers.parallel import TPGroup, check_shape
        a = self.src.arch
        check_shape(n, a.num_heads, a.num_kv_heads, a.intermediate_size, self.device)
        if self.src.kind == "snapshot":
            raise ConfigError("tensor_parallel_size", f"snapshots load on one rank; got {n}: load the model "
                              "it was written from")
        if self.device.type == "cuda":
            self.device = torch.device("cuda", rank)
            torch.cuda.set_device(self.device)
        elif rank > 0:
            torch.set_num_threads(max(1, torch.get_num_threads() // n))  # the host's cores, shared by the ranks
        if rank == 0:
            from kvserve.engine.tp_workers import Workers
            self.workers = Workers(self.config, self.max_model_len, type(self))
            self.tp = self.workers.connect(self.device)
        else:
            self.tp = TPGroup(rank, n, store, self.device)
        self.arch = dataclasses.replace(a, num_heads=a.num_heads // n, num_kv_heads=max(1, a.num_kv_heads // n),
                                        intermediate_size=a.intermediate_size // n)

    def _local_scales(self, scales: torch.Tensor | None) -> torch.Tensor | None:
        """Calibrated KV scales [layers, 2, kv_heads] of this rank's KV heads."""
        if self.tp is None or scales is None:
            return scales
        h = self.tp.heads(self.src.arch.num_kv_heads, 1)
        return scales[:, :, h.start:h.start + h.local].contiguous()

    # -- rank 0 --------------------------------------------------------------------------------
    def _mirror(self, name: str, *args) -> None:
        """Rank 0: every worker runs ``self.name(*args)``; the caller runs it here next."""
        if self.workers is not None:
            self.workers.send(name, args)

    def _tp_guard(self):
        """Around rank 0's collectives: a rank that is gone raises ``WorkerDiedError``."""
        return self.workers.guard() if self.workers is not None else contextlib.nullcontext()

    def _share_rows(self, hidden: torch.Tensor) -> None:
        """Rank 0, before the LM head: the workers get the rows it multiplies."""
        if self.workers is not None:
            self._mirror("_worker_logits", tuple(hidden.shape), hidden.dtype)
            with self._tp_guard():
                self.tp.broadcast(hidden.contiguous())

    def close(self) -> None:
        """Stop the workers (idempotent; a no-op with one rank)."""
        if self.workers is not None:
            self.workers.close()

    # -- workers -------------------------------------------------------------------------------
    def _kv(self, name: str, *args) -> None:
        getattr(self.kv_cache, name)(*args)

    def _worker_logits(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._logits(self.tp.broadcast(torch.empty(shape, dtype=dtype, device=self.device)))

    def _worker_allocate(self, config, plan) -> None:
        """Rank 0's plan (block counts) in this rank's format and scales, under rank 0's final
        config (its batch limits decide the CUDA graphs captured, which must match)."""
        self.config = config
        self.allocate_kv_cache(dataclasses.replace(plan, fmt=self.kv_format, scales=self.kv_scales))

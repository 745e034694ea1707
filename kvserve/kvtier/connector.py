"""TierConnector: the one door between the engine and the tiered KV store.

Scheduler side (host bookkeeping, no device work): whether a request waits for its chunks to
come up from disk/Redis (``awaiting_prefetch``), which run of chunks a new request loads
(``take_run`` / ``release``), which evicted blocks need a copy out (``to_offload``).
Worker side (the device cache ``data``, ``data[:, :, block]`` = one block in every layer):
``offload`` copies blocks out (evictions, idle sessions, session turns, write-through, shutdown:
one path), ``load`` copies chunks into freshly allocated blocks.
"""
from __future__ import annotations

import time

import torch

from kvserve.kvtier.store import TieredStore


class TierConnector:
    def __init__(self, store: TieredStore):
        self.store = store
        self.remote = None  # disaggregated decode: the KV transfer's Consumer (kvtier/transfer.py)

    @property
    def stats(self):
        return self.store.load_stats

    # -- scheduler side ------------------------------------------------------------------
    def awaiting_prefetch(self, req, keys: list[bytes]) -> bool:
        """True while the prefetch thread is fetching ``req``'s chunks from disk/Redis. Started
        once per request, only when there are lower tiers and the first chunk missing from
        memory may be below: otherwise the request goes on now (what is in memory loads, the
        rest is computed)."""
        if self.remote is not None and req.prefetch_state != "done":
            # First the producer's blocks (if it sends any), then the tiers for what is missing.
            if self.remote.waiting(req, keys):
                req.prefetch_state = "pending"
                return True
            if req.prefetch_state == "pending" and req.prefetch_token == 0:  # (no tier prefetch started yet)
                req.prefetch_state = None
        store = self.store
        if not store.lower or req.prefetch_state == "done":
            return False
        if req.prefetch_state is None:
            first_missing = next((k for k in keys if not store.in_memory(k)), None)
            if first_missing is None or not store.may_have_below(first_missing):
                req.prefetch_state = "done"
                return False
            req.prefetch_state = "pending"
            req.prefetch_token = store.start_prefetch(keys)
            return True
        if store.prefetch_done.pop(req.prefetch_token, None) is not None:
            req.prefetch_state = "done"
            return False
        return True

    def forget(self, req) -> None:
        """A request finished: a prefetch still running for it reports to nobody."""
        if req.prefetch_state == "pending":
            self.store.prefetch_done.pop(req.prefetch_token, None)  # (a later finish leaves one int)

    def take_run(self, keys: list[bytes]) -> list:
        return self.store.take_run(keys)

    def release(self, run: list) -> None:
        self.store.release(run)

    def to_offload(self, evicted: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """Of the blocks the prefix cache evicted, those the tiers do not hold yet (keys are
        content hashes: most evicted blocks were loaded from the CPU tier or written there at
        the end of their session's turn, and need no copy)."""
        if not self.store.keeps_spills:
            return []
        out = [(b, k) for b, k in evicted if not self.store.holds(k)]
        self.stats.offloads_skipped += len(evicted) - len(out)
        return out

    @property
    def writes_through(self) -> bool:
        """Disk or Redis on: full blocks are written to them as their KV is computed."""
        return bool(self.store.lower)

    def to_write(self, sealed: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """Of the blocks registered this step, those some lower tier lacks (a block loaded from a
        tier, or computed again while a tier held it, is not written twice)."""
        return [(b, k) for b, k in sealed if not self.store.held_below(k)] if self.store.lower else []

    # -- worker side ---------------------------------------------------------------------
    def offload(self, data: torch.Tensor, blocks: list[tuple[int, bytes]], wait: bool = False,
                defer: bool = False) -> int:
        """Copy these blocks' KV into the tiers (skipping what they hold); ``wait``: block on a
        full write-behind queue instead of dropping the write (shutdown); ``defer``: queue the
        copies behind the step's work without waiting, ``commit`` after the step (write-through).
        Returns blocks copied."""
        if not self.store.keeps_spills:
            return 0
        return self.store.offload(data, blocks, wait=wait, defer=defer)

    def commit(self, ok: bool = True) -> None:
        """The step is done: hand its deferred copies to the writer (``ok`` false: drop them)."""
        self.store.commit(ok)

    def load(self, data: torch.Tensor, loads: list[tuple[list[int], list]], batch: int = 256) -> None:
        """Copy each run of chunks into its blocks. Each (pinned) chunk goes to the device whole,
        one plain copy each, into a staging buffer; one scatter then puts the batch into its
        blocks (a chunk's place in the cache is strided across layers: copied directly, every
        chunk would cost a hidden temporary and an extra kernel)."""
        for blocks, run in loads:
            t0 = time.perf_counter()
            for i in range(0, len(run), batch):
                part, ids = run[i:i + batch], blocks[i:i + batch]
                stage = torch.empty((len(part),) + tuple(part[0][1].shape), dtype=data.dtype, device=data.device)
                for j, (_, kv, _) in enumerate(part):
                    stage[j].copy_(kv, non_blocking=True)
                idx = torch.tensor(ids, device=data.device)
                data[:, :, idx] = stage.movedim(0, 2)
            if data.device.type == "cuda":  # the chunks stay pinned in the CPU tier until copied
                torch.cuda.current_stream(data.device).synchronize()
            self.store.loaded(run, time.perf_counter() - t0)

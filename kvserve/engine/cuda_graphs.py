"""CUDA graphs for decode steps.

A decode step (every sequence brings one token) launches hundreds of small kernels; at small
batches the CPU issuing them, not the GPU, sets the pace. At start-up the model's forward is
captured once per batch-size bucket over static input buffers; a step copies its inputs into
the buffers and replays the graph of the smallest bucket that holds it. Rows past the real
batch are padding: slot -1 (nothing written to the cache) and length 0 (attention yields
zeros), and their outputs are ignored.

The attention split count is a function of the bucket size, so one graph serves every context
length up to the table width it was captured with (``max_model_len``). Steps that do not fit
(a bigger batch, prefill) run eagerly.

When each graph is captured (at start-up, at first use, or in idle gaps) is
``engine/graph_capture.py``'s plan; this class is its ``Capturer``. A step whose graph is not
captured yet runs eagerly through the same buffers and shapes, which is the capture's warm-up.
Every graph records into one memory pool, in whatever order they are captured: a graph's
intermediates may be another's, which holds because graphs replay one at a time on the engine's
stream and a replay's output is read (by the LM head, queued behind it) before the next replay.

Decode rows (``engine/decode_rows.py``: a verify step, several rows per sequence) replay graphs
of their own where the decode graphs fuse the RoPE + KV write into the attention kernel, which
stores only its own row's key before reading the others: the rows' graphs write first. They
share the buffers and the memory pool of the decode graphs.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvserve.kernels.decode_attention import decode_splits
from kvserve.layers.forward_context import AttentionMetadata, ForwardContext, forward_context

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    sizes = {b for b in (1, 2, 4, 8) if b <= max_batch}
    sizes |= set(range(16, max_batch + 1, 16))
    sizes.add(max_batch)
    return sorted(sizes)


class DecodeGraphs:
    def __init__(self, model, kv_layers, backend, device: torch.device, max_batch: int, max_blocks: int,
                 block_size: int, num_kv_heads: int, kivi: bool = False, kv_format=None,
                 async_copies: bool = False, rows: bool = False):
        """``rows``: decode rows replay these graphs too (graphs of their own where the
        backend would fuse the KV write into the decode kernel)."""
        self.model, self.kv_layers, self.backend = model, kv_layers, backend
        self.device, self.block_size, self.num_kv_heads = device, block_size, num_kv_heads
        self.buckets = batch_buckets(max_batch)
        self.max_batch, self.max_blocks = max_batch, max_blocks
        self.kivi = kivi  # KIVI-compressed cache: residual rows and places are inputs too
        self.kv_format = kv_format  # the cache format (None: uncompressed) sets the attention splits
        self.async_copies = async_copies
        with torch.device(device):
            self.input_ids = torch.zeros(max_batch, dtype=torch.long)
            self.positions = torch.zeros(max_batch, dtype=torch.long)
            self.slots = torch.full((max_batch,), -1, dtype=torch.long)
            self.seq_lens = torch.zeros(max_batch, dtype=torch.int32)
            self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32)
            self.cu_q = torch.arange(max_batch + 1, dtype=torch.int32)
            self.res_slots = torch.zeros(max_batch, dtype=torch.int32)
            self.res_mapping = torch.full((max_batch,), -1, dtype=torch.long)
        # One pinned staging row per step: ids, positions, slots, lens (KIVI: residual rows and
        # places) -> one host-to-device copy (with async scheduling the block tables too). Two of
        # each, used in turn: the next step may be staged while this one's copy still waits in
        # the stream.
        rows = 6 if kivi else 4
        self._stages = [torch.zeros(rows, max_batch, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self._table_stages: list[torch.Tensor] = []  # allocated on first use (async scheduling only)
        self._turn = 0
        self._stage_dev = torch.zeros(rows, max_batch, dtype=torch.long, device=device)
        self.rows = rows
        kernel = getattr(backend, "kernel", None)
        # (bucket, rows) -> graph; rows is False for every bucket where one graph serves both
        self.row_variants = (False, True) if rows and not kivi and getattr(kernel, "fused_rope_decode", False) \
            else (False,)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.pool = None  # the graphs' shared memory pool, made by the first capture
        self.capture_seconds = 0.0
        self.memory_bytes = 0

    def _meta(self, bs: int, rows: bool = False) -> AttentionMetadata:
        meta = AttentionMetadata(slot_mapping=self.slots[:bs], block_tables=self.tables[:bs],
                                 seq_lens=[0] * bs, query_lens=[1] * bs, query_start=list(range(bs + 1)),
                                 block_size=self.block_size, decode_rows=rows)
        meta.seq_lens_t, meta.cu_q = self.seq_lens[:bs], self.cu_q[:bs + 1]
        meta.max_query_len = 1
        meta.num_splits = decode_splits(self.kv_format, bs, self.num_kv_heads, self.device)
        if self.kivi:  # one token per sequence: it fills (and seals) at most one block
            meta.res_slots_t, meta.res_mapping, meta.max_seal = self.res_slots[:bs], self.res_mapping[:bs], 1
        return meta

    def _forward(self, bs: int, rows: bool = False) -> torch.Tensor:
        with forward_context(ForwardContext(self._meta(bs, rows), self.kv_layers, self.backend)):
            return self.model(self.input_ids[:bs], self.positions[:bs])

    def keys(self) -> list[tuple[int, bool]]:
        """Every graph's key, largest first: the smaller ones reuse the largest's pool."""
        return [(bs, rows) for bs in reversed(self.buckets) for rows in self.row_variants]

    def key(self, n: int, rows: bool = False) -> tuple[int, bool]:
        """The key of the graph that holds a step of ``n`` rows."""
        return next(b for b in self.buckets if b >= n), rows and True in self.row_variants

    @torch.inference_mode()
    def warm_up(self, key: tuple[int, bool]) -> None:
        """Compile the kernels and warm the allocator outside the capture."""
        self._forward(*key)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def capture(self, key: tuple[int, bool]) -> None:
        """Record ``key``'s forward (warmed up already); every graph shares one memory pool."""
        torch.cuda.synchronize(self.device)  # nothing else runs on the device while it records
        t0 = time.perf_counter()
        before = torch.cuda.memory_allocated(self.device)
        g = torch.cuda.CUDAGraph()
        # thread_local: a tier's copy thread may sync its own stream meanwhile; the engine's
        # stream has nothing in flight (the capture runs between steps, on the engine thread).
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
            out = self._forward(*key)
        self.pool = g.pool()
        self.graphs[key], self.outputs[key] = g, out
        torch.cuda.synchronize(self.device)
        self.capture_seconds += time.perf_counter() - t0
        self.memory_bytes += torch.cuda.memory_allocated(self.device) - before

    def capture_all(self) -> None:
        for key in self.keys():
            self.warm_up(key)
            self.capture(key)

    def fits(self, batch: int, width: int, rows: bool = False) -> bool:
        """Whether a step of ``batch`` rows over tables ``width`` blocks wide replays a graph;
        ``rows``: several rows per sequence, only where captured for them."""
        return batch <= self.max_batch and width <= self.max_blocks and (self.rows or not rows)

    def run(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
            tables: np.ndarray, res: tuple[np.ndarray, np.ndarray] | None = None,
            patch: tuple[torch.Tensor, torch.Tensor] | None = None, rows: bool = False,
            replay: bool = True) -> torch.Tensor:
        """Replay the graph for ``len(ids)`` decode rows; returns their hidden states (a view of
        the graph's output buffer, valid until the next replay). ``patch``: (rows, ids) on the
        device that replace those rows' input ids (tokens not known on the host yet); ``rows``:
        some sequences have several rows (``engine/decode_rows.py``); ``replay`` False: the
        graph is not captured yet, the same forward runs eagerly (and warms its capture)."""
        n = len(ids)
        key = self.key(n, rows)
        bs = key[0]
        self._turn ^= 1
        stage = self._stages[self._turn]
        st = stage.numpy()
        st[0, :n], st[1, :n], st[2, :n], st[3, :n] = ids, positions, slots, seq_lens
        st[2, n:bs], st[3, n:bs] = -1, 0  # padding rows: write nothing, attend to nothing
        st[0, n:bs] = st[1, n:bs] = 0
        if self.kivi:
            st[4, :n], st[5, :n] = res
            st[4, n:bs], st[5, n:bs] = 0, -1
        dev = self._stage_dev[:, :bs]
        dev.copy_(stage[:, :bs], non_blocking=True)
        self.input_ids[:bs].copy_(dev[0])
        if patch is not None:
            self.input_ids[patch[0]] = patch[1]
        self.positions[:bs].copy_(dev[1])
        self.slots[:bs].copy_(dev[2])
        self.seq_lens[:bs].copy_(dev[3])
        if self.kivi:
            self.res_slots[:bs].copy_(dev[4])
            self.res_mapping[:bs].copy_(dev[5])
        w = tables.shape[1]
        if self.async_copies:  # the host must not wait here for the step in flight
            if not self._table_stages:
                self._table_stages = [torch.zeros(self.max_batch * self.max_blocks, dtype=torch.int32,
                                                  pin_memory=True) for _ in range(2)]
            host = self._table_stages[self._turn][:n * w].view(n, w)
            host.numpy()[:] = tables
            self.tables[:n, :w].copy_(host, non_blocking=True)
        else:
            self.tables[:n, :w].copy_(torch.from_numpy(tables), non_blocking=False)
        if not replay:
            return self._forward(*key)[:n]
        self.graphs[key].replay()
        return self.outputs[key][:n]

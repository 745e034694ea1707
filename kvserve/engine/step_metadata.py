"""The attention metadata of a step, built on the host and copied to the device: positions,
KV slots, sequence lengths, query offsets and block tables (KIVI: residual rows), for the
prefill-shaped step or the decode-rows one (``decode_rows.py``)."""
from __future__ import annotations

import numpy as np
import torch

from kvserve.engine import decode_rows
from kvserve.layers.attention import AttentionMetadata


class StepMetadata:
    """ModelRunner's metadata builders (the runner holds ``block_size``, ``device`` and
    ``backend``)."""

    def _host_metadata(self, seqs: list[tuple[int, int, list[int]]]):
        """seqs: (num_computed, num_new, block_table) per sequence, in batch order. Returns numpy
        arrays: positions, slots, seq_lens, query_start, tables [B, max_blocks] int32."""
        bs = self.block_size
        B = len(seqs)
        qlens = np.fromiter((n for _, n, _ in seqs), dtype=np.int64, count=B)
        starts = np.fromiter((c for c, _, _ in seqs), dtype=np.int64, count=B)
        width = max(len(t) for _, _, t in seqs)
        tables = np.zeros((B, width), dtype=np.int32)
        for i, (_, _, t) in enumerate(seqs):
            tables[i, :len(t)] = t
        # NULL entries (blocks freed out of a window) are never read: any valid id will do.
        np.maximum(tables, 0, out=tables)
        query_start = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(qlens, out=query_start[1:])
        row = np.repeat(np.arange(B), qlens)
        positions = starts[row] + (np.arange(int(query_start[-1])) - query_start[row])
        slots = tables[row, positions // bs].astype(np.int64) * bs + positions % bs
        return positions, slots, starts + qlens, query_start, tables

    def _residual_metadata(self, positions: np.ndarray, seq_lens: np.ndarray, query_start: np.ndarray,
                           res_slots: list[int]) -> tuple[np.ndarray, int]:
        """KIVI: each token's place in its sequence's residual row (-1 if its block fills this
        step and is sealed), and the most blocks one sequence fills."""
        bs = self.block_size
        qlens = np.diff(query_start)
        row = np.repeat(np.arange(len(seq_lens)), qlens)
        full_end = (seq_lens // bs * bs)[row]
        slots = np.asarray(res_slots, dtype=np.int64)[row]
        res_map = np.where(positions >= full_end, slots * bs + positions % bs, -1)
        max_seal = int((seq_lens // bs - (seq_lens - qlens) // bs).max()) if len(seq_lens) else 0
        return res_map, max_seal

    def _build_metadata(self, seqs: list[tuple[int, int, list[int]]], res_slots: list[int] | None = None,
                        rows: bool = False, kv_budgets: list[int | None] | None = None):
        """The step's attention metadata and positions on the device; ``rows``: as a decode step
        of one row per token (``decode_rows.py``; not for KIVI caches); ``kv_budgets``: each
        sequence's streaming-eviction budget (None: no sequence has one), set before the
        backend's ``prepare`` so that it can turn them into its own form."""
        positions, slots, seq_lens, query_start, tables = self._host_metadata(seqs)
        if rows:
            seq_lens, query_start, tables = decode_rows.expand(positions, query_start, tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(tables).to(dev, non_blocking=True),
            seq_lens=seq_lens.tolist(), query_lens=np.diff(query_start).tolist(),
            query_start=query_start.tolist(), block_size=self.block_size)
        meta.decode_rows = rows
        meta.kv_budgets = kv_budgets
        if res_slots is not None:
            res_map, meta.max_seal = self._residual_metadata(positions, seq_lens, query_start, res_slots)
            meta.res_slots = res_slots
            meta.res_mapping = torch.from_numpy(res_map).to(dev, non_blocking=True)
        self.backend.prepare(meta, dev)
        return meta, torch.from_numpy(positions).to(dev, non_blocking=True)

"""KVCache: the device tensors of the paged cache, plus CPU swap space for preempted requests.

Uncompressed (``auto``): one tensor ``[layers, 2 (K, V), num_blocks, block_size, kv_heads,
head_dim]``; each layer sees its K and V as ``[num_blocks, block_size, kv_heads, head_dim]``
views. Compressed (``fp8``, ``int8``, ``int4``, ``int2``, see ``kvserve/kv_format.py``): one byte
tensor ``[layers, 1, num_blocks, block_bytes]`` holding each block's codes and scales, and each
layer sees a ``KVViews``; KIVI formats add a per-sequence full-precision key buffer
``[layers, slots, block_size, kv_heads, head_dim]``.

The KIVI key buffer has one row per running sequence: ``residual_row`` hands a sequence its row
on its first step, ``release`` gives it back (finished, aborted, or preempted: a resumed sequence
recomputes from a block boundary), ``fork`` gives a forked child a copy of its parent's row (they
share the unsealed last block). Requests hold rows here and blocks in the ``KVCacheManager``.

Either way ``data[:, :, blocks]`` is every layer's KV of those blocks, which is what block
copies, swapping and the tiers move. With KV groups (``kv_groups.py``) the leading axis is the
``page_layers`` of one group instead of every layer: layer ``i`` reads ``data[layer_slot[i]]``
through its group's block table, and a block belongs to one group at a time. Zero-filled, so
padded reads of unused slots stay finite (a NaN there would poison a masked softmax).
"""
from __future__ import annotations

import torch

from kvserve.engine.kv_groups import KVGroups
from kvserve.kv_format import KVFormat
from kvserve.models.arch import ModelArch


class KVCache:
    def __init__(self, arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, swap_blocks: int = 0, fmt: KVFormat | None = None,
                 residual_slots: int = 0, scales: torch.Tensor | None = None, groups: KVGroups | None = None,
                 alloc=None):
        """``scales``: calibrated [layers, 2, kv_heads] (static fp8/int8 formats); ``groups``:
        None for one group of every layer; ``alloc(shape, dtype, device)``: the zero-filled pool
        tensor (default ``torch.zeros``; a disaggregated producer's is memory its consumer maps)."""
        self.num_blocks, self.block_size, self.dtype, self.device = num_blocks, block_size, dtype, device
        self.fmt = fmt or KVFormat("auto", arch.num_kv_heads, arch.head_dim, block_size, dtype)
        self.residual = None
        n = arch.num_layers
        alloc = alloc or (lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
        page, slot = (n, range(n)) if groups is None else (groups.page_layers, groups.layer_slot)
        if not self.fmt.quantized:
            self.data = alloc((page, 2, num_blocks, block_size, arch.num_kv_heads, arch.head_dim), dtype, device)
            self.layers = [(self.data[slot[i], 0], self.data[slot[i], 1]) for i in range(n)]
        else:
            if self.fmt.kivi and page != n:
                raise ValueError("KIVI formats keep one group of every layer (their key residual is per sequence)")
            self.data = alloc((page, 1, num_blocks, self.fmt.block_bytes), torch.uint8, device)
            if self.fmt.kivi:
                self.residual = torch.zeros(n, max(1, residual_slots), block_size,
                                            arch.num_kv_heads, arch.head_dim, dtype=dtype, device=device)
            self.layers = [(self.fmt.views(self.data[slot[i], 0], None if self.residual is None else self.residual[i],
                                           None if scales is None else scales[i]), None)
                           for i in range(n)]
        self.swap_blocks = swap_blocks
        self.swapped: dict[str, torch.Tensor] = {}
        self._row: dict[str, int] = {}  # request id -> its row of the KIVI key residual
        self._free_rows = list(range(residual_slots - 1, -1, -1))

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block across all layers: ``data[:, :, i]``."""
        return tuple(self.data.shape[:2]) + tuple(self.data.shape[3:])

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        if self.residual is not None:
            n += self.residual.numel() * self.residual.element_size()
        return n

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        self.data[:, :, dst] = self.data[:, :, src]

    # -- KIVI key residual rows ------------------------------------------------------------
    def residual_rows(self, request_ids: list[str]) -> list[int]:
        """Each request's row, a free one for a request on its first step."""
        return [self._row[rid] if rid in self._row else self._take_row(rid) for rid in request_ids]

    def _take_row(self, request_id: str) -> int:
        if not self._free_rows:
            raise RuntimeError(f"no free KV residual row for {request_id}: {len(self._row)} held")
        row = self._row[request_id] = self._free_rows.pop()
        return row

    def release(self, request_id: str) -> None:
        """The request's residual row goes back (its blocks are the block manager's)."""
        row = self._row.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)

    def fork(self, parent_id: str, child_id: str) -> None:
        if self.residual is not None and parent_id in self._row:
            self.residual[:, self._take_row(child_id)] = self.residual[:, self._row[parent_id]]

    def drop(self, request_id: str) -> None:
        """The request has finished: its row and any swapped-out KV go."""
        self.release(request_id)
        self.swapped.pop(request_id, None)

    # -- swap space --------------------------------------------------------------------------

    def swap_out(self, request_id: str, blocks: list[int]) -> None:
        idx = torch.tensor(blocks, device=self.device)
        host = self.data[:, :, idx].to("cpu")
        self.swapped[request_id] = host.pin_memory() if self.device.type == "cuda" else host

    def swap_in(self, request_id: str, blocks: list[int]) -> None:
        idx = torch.tensor(blocks, device=self.device)
        self.data[:, :, idx] = self.swapped.pop(request_id).to(self.device, non_blocking=True)


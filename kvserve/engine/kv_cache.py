"""KVCache: the device tensors of the paged cache, plus CPU swap space for preempted requests.

One tensor ``[layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]``; each layer sees
its K and V as ``[num_blocks, block_size, kv_heads, head_dim]`` views. Zero-filled, so padded
reads of unused slots stay finite (a NaN there would poison a masked softmax).
"""
from __future__ import annotations

import torch

from kvserve.models.arch import ModelArch


class KVCache:
    def __init__(self, arch: ModelArch, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, swap_blocks: int = 0):
        self.num_blocks, self.block_size, self.dtype, self.device = num_blocks, block_size, dtype, device
        self.data = torch.zeros(arch.num_layers, 2, num_blocks, block_size, arch.num_kv_heads,
                                arch.head_dim, dtype=dtype, device=device)
        self.layers = [(self.data[i, 0], self.data[i, 1]) for i in range(arch.num_layers)]
        self.swap_blocks = swap_blocks
        self.swapped: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        self.data[:, :, dst] = self.data[:, :, src]

    def swap_out(self, request_id: str, blocks: list[int]) -> None:
        idx = torch.tensor(blocks, device=self.device)
        host = self.data[:, :, idx].to("cpu")
        self.swapped[request_id] = host.pin_memory() if self.device.type == "cuda" else host

    def swap_in(self, request_id: str, blocks: list[int]) -> None:
        idx = torch.tensor(blocks, device=self.device)
        self.data[:, :, idx] = self.swapped.pop(request_id).to(self.device, non_blocking=True)

    def drop_swapped(self, request_id: str) -> None:
        self.swapped.pop(request_id, None)

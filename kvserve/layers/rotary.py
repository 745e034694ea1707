"""Rotary position embedding (NeoX / Hugging Face half-rotation layout) with cached cos/sin."""
from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.errors import ModelLoadError


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ModelLoadError(f"unsupported rope scaling type {kind!r}; supported: default, linear, llama3")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        self._step: tuple | None = None  # (positions, dtype, cos, signed sin): see _tables

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, KVH, D]; rotated copies are returned."""
        # (a compiled graph gathers the tables once for all its layers itself)
        tables = self._gather if torch.compiler.is_compiling() else self._tables
        cos, sin = tables(positions, q.dtype)
        return q * cos + _swap_halves(q) * sin, k * cos + _swap_halves(k) * sin

    def drop_derived(self) -> None:
        """Forget the step's tables (sleep mode frees what the model holds)."""
        self._step = None

    def _tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions`` [T, 1, D] in ``dtype``, sin's first half negated (the
        rotation's ``-x2 * sin`` as ``x2 * -sin``: the same product, one op fewer). Every layer of
        a step passes the same positions tensor: on the CPU, where each op costs microseconds of
        overhead, the tables are gathered once per step and kept for that tensor (held, so that
        its identity stays unique; the runner makes a step's positions anew and never writes
        them after)."""
        c = self._step
        if c is not None and c[0] is positions and c[1] == dtype:
            return c[2], c[3]
        cos, sin = self._gather(positions, dtype)
        if positions.device.type == "cpu":
            self._step = (positions, dtype, cos, sin)
        return cos, sin

    def _gather(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        half = self.sin.shape[-1] // 2
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _swap_halves(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], x[..., :half]), dim=-1)

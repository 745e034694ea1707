"""Sentence embeddings from the model's final hidden states (after the last norm), pooled over
one prompt's tokens and L2-normalised.

    mean   the average over every token (sentence-transformers' usual pooling)
    last   the last token's state: in a causal model the only one that has seen the whole input
"""
from __future__ import annotations

import torch

POOLINGS = ("mean", "last")


def pool(hidden: torch.Tensor, how: str) -> torch.Tensor:
    """hidden [T, H] -> [H] float32, unit length."""
    if how not in POOLINGS:
        raise ValueError(f"pooling: must be one of {POOLINGS}, got {how!r}")
    h = hidden.float()
    v = h.mean(0) if how == "mean" else h[-1]
    return torch.nn.functional.normalize(v, dim=0)

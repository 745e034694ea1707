"""Sentence embeddings from the model's final hidden states (after the last norm), pooled over
one prompt's tokens and L2-normalised.

    mean   the average over every token (sentence-transformers' usual pooling)
    last   the last token's state: in a causal model the only one that has seen the whole input

An input's forward runs in chunks of at most the step's token budget (max_num_batched_tokens),
one chunk per call (``EmbeddingJob.step``): a server runs its steps between them, so a long
input delays the running requests' next tokens by one chunk's forward at most, as a long
prompt's chunked prefill does, and the forward's activations stay within the budget's.
"""
from __future__ import annotations

import itertools

import torch

POOLINGS = ("mean", "last")


class EmbeddingJob:
    _ids = itertools.count()

    def __init__(self, runner, ids: list[int], how: str, chunk: int):
        if how not in POOLINGS:
            raise ValueError(f"pooling: must be one of {POOLINGS}, got {how!r}")
        self.runner, self.ids, self.how, self.chunk = runner, ids, how, chunk
        self.job = next(self._ids)
        self.done_tokens = 0
        self._sum: torch.Tensor | None = None  # float32 sum of the states so far
        self._last: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self.done_tokens == len(self.ids)

    def step(self) -> None:
        """The next chunk's forward."""
        start, n = self.done_tokens, len(self.ids)
        end = min(start + self.chunk, n)
        try:
            h = self.runner.hidden_states(self.ids[start:end], start, n, self.job).float()
        except BaseException:
            self.close()
            raise
        s = h.sum(0)
        self._sum = s if self._sum is None else self._sum + s
        self._last, self.done_tokens = h[-1], end

    def close(self) -> None:
        """Give up an unfinished input (its scratch cache is freed)."""
        if not self.done:
            self.runner.drop_embedding(self.job)

    def result(self) -> list[float]:
        """The pooled, unit-length embedding (once ``done``)."""
        assert self.done, "the input's forward has chunks left"
        v = self._sum / len(self.ids) if self.how == "mean" else self._last
        return torch.nn.functional.normalize(v, dim=0).tolist()

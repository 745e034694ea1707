"""N-gram drafts (prompt lookup): the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, trying n from ``max_n`` down to ``min_n``.

    tokens  ... a b c d e ... x y a b c      (suffix "a b c", n = 3)
                      ^^^^^ the k tokens after its earlier match are the drafts: d e ...

Plain numpy on the host: one vectorised comparison per n over the request's tokens.
"""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens for the sequence ``tokens``; [] when no suffix recurs."""
    t = np.asarray(tokens, dtype=np.int64)
    L = len(t)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = t[L - n:]
        # Windows starting at 0 .. L - n - 1: every occurrence but the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(t[:L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest match has the most recent continuation
            out = t[start:start + k].tolist()
            # A match overlapping the suffix (a repeating stretch with period L - start): its
            # continuation runs into the end, and goes on with the drafts themselves.
            while len(out) < k:
                out.append(out[len(out) - (L - start)])
            return out
    return []

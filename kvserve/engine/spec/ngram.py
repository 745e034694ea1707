"""N-gram drafts (prompt lookup): the tokens that followed the latest earlier occurrence of the
sequence's last n tokens, trying n from ``max_n`` down to ``min_n``.

    tokens  ... a b c d e ... x y a b c      (suffix "a b c", n = 3)
                      ^^^^^ the k tokens after its earlier match are the drafts: d e ...

Plain numpy on the host, once per decoding request per step, on the critical path of a step
that drafts: one comparison over the sequence finds the earlier positions holding its last token
(the ends of every candidate match), and only those few are extended backwards, up to ``max_n``.
"""
from __future__ import annotations

import numpy as np


def propose_ngram(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` draft tokens for the sequence ``tokens``; [] when no suffix recurs."""
    t = np.asarray(tokens, dtype=np.int64)
    L = len(t)
    max_n = min(max_n, L - 1)
    if max_n < min_n:
        return []
    ends = np.flatnonzero(t[:L - 1] == t[L - 1])  # every earlier match ends at one of these
    if not ends.size:
        return []
    # match[i]: how many tokens up to ends[i] equal the suffix's last ones (at most max_n)
    match = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, max_n):
        alive &= ends >= j
        alive[alive] = t[ends[alive] - j] == t[L - 1 - j]
        if not alive.any():
            break
        match += alive
    for n in range(max_n, min_n - 1, -1):
        hits = ends[match >= n]
        if hits.size:
            start = int(hits[-1]) + 1  # the latest match has the most recent continuation
            out = t[start:start + k].tolist()
            # A match overlapping the suffix (a repeating stretch with period L - start): its
            # continuation runs into the end, and goes on with the drafts themselves.
            while len(out) < k:
                out.append(out[len(out) - (L - start)])
            return out
    return []

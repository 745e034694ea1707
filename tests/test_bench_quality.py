"""The quality benchmarks' reference measures (``kvserve/bench/quality.py``)."""
from __future__ import annotations

import random

import pytest

from kvserve import LLM
from kvserve.bench.quality import recomputed_nll, token_nll

BUDGET, STRIDE = 40, 12


@pytest.fixture(scope="module")
def llm():
    return LLM("dummy:tiny", kv_cache_memory="4MiB", show_progress=False, enable_prefix_caching=False)


@pytest.mark.parametrize("bos", [None, 7])
def test_recomputed_windows_give_each_token_the_budget_span(llm, bos):
    """Each token's log-likelihood equals a fresh forward over the text just before it: all of
    it up to ``BUDGET + STRIDE // 2``, then ``BUDGET - STRIDE // 2 + (t - BUDGET - STRIDE // 2) %
    STRIDE`` tokens (between ``BUDGET - 6`` and ``BUDGET + 5``), after the BOS when the text has
    one."""
    rng = random.Random(3)
    ids = [rng.randrange(8, 512) for _ in range(135)]  # (the last window scores 5 tokens, not 12)
    if bos is not None:
        ids[0] = bos
    got = recomputed_nll(llm, ids, BUDGET, STRIDE, bos_token_id=7)
    assert len(got) == len(ids) - 1
    start = BUDGET + STRIDE // 2
    windowed = set()
    for t in range(1, len(ids)):
        c = t if t < start else BUDGET - STRIDE // 2 + (t - start) % STRIDE
        if t >= start:
            windowed.add(c)
        head = ids[:1] if bos is not None and c < t else []
        want = token_nll(llm, head + ids[t - c:t + 1])[-1]
        assert got[t - 1] == pytest.approx(want, abs=1e-5), t
    assert windowed == set(range(BUDGET - STRIDE // 2, BUDGET + STRIDE // 2))  # the text covers every case
    # (and a token whose text is cut scores differently from one given it all: the model reads it)
    full = token_nll(llm, ids)
    assert sum(abs(got[t - 1] - full[t - 1]) > 1e-4 for t in range(start, len(ids))) > (len(ids) - start) // 2


@pytest.mark.parametrize("budget, stride", [(40, 0), (40, -3), (40, 41), (0, 1), (40, 2**63), (40, True)])
def test_recomputed_windows_refuse_a_stride_outside_the_budget(budget, stride):
    with pytest.raises(ValueError, match="stride"):
        recomputed_nll(None, list(range(10)), budget, stride, None)

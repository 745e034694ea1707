"""The online-softmax step both attention kernels run on every key tile (a device function,
inlined into the kernels that call it)."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_probs(qk, m_i, l_i, scale):
    """The softmax half of a step: for raw scores ``qk`` ([M, N], masked keys at -inf) and
    ``scale`` (> 0: the softmax scale times log2(e)) returns the new running max (of the scaled
    scores), the new sum, the tile's probabilities ``p`` and the factor ``alpha`` that rescales
    what was accumulated so far. The scale is applied inside exp2's argument (one FMA per score;
    the row max commutes with a positive scale). A row that has seen no key yet (all -inf) keeps
    p = 0 instead of turning NaN."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * scale)
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp2(qk * scale - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def online_softmax_step(qk, v, m_i, l_i, acc, scale, PREC: tl.constexpr):
    """Fold one tile of raw scores ``qk`` and its values ``v`` ([N, D]) into the running max
    ``m_i``, sum ``l_i`` and output ``acc``."""
    m_new, l_i, p, alpha = online_softmax_probs(qk, m_i, l_i, scale)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc

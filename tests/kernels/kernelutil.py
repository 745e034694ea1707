"""What every kernel test file shares: CUDA-only marks, dtype lists and tolerances.

(Imported as a plain module, like ``tests/kvtier/tierutil.py``: ``tests/kernels`` has no
``__init__``, so pytest puts this directory on ``sys.path``.)"""
from __future__ import annotations

import pytest
import torch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="real-size case: needs CUDA")
# The interpreter keeps bfloat16 as raw uint16 and its tl.dot multiplies those bits as integers
# (relative error ~1e9), so bfloat16 attention is checked on CUDA only.
_bf16_dot = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="bfloat16 tl.dot is wrong in Triton's interpreter; CUDA only")
# The interpreter casts float32 -> bfloat16 by truncation, not round-to-nearest-even, so its
# bfloat16 results can't round like PyTorch's: bfloat16 runs on CUDA only.
_bf16_rounding = pytest.mark.skipif(not torch.cuda.is_available(),
                                    reason="Triton's interpreter truncates float32->bfloat16 casts; CUDA only")
ATTENTION_DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=_bf16_dot)]
ROUNDING_DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=_bf16_rounding)]
ATTENTION_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
DTYPE_NO = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # seeds differ per dtype


def gguf_tensor(qtype: str, N: int, K: int, seed: int):
    """A random GGUF tensor of ``qtype`` as (rows [N, bytes per row] uint8, its values [N, K]
    float32 by ``gguf.quants.dequantize``). Q4_0/Q4_1/Q8_0: random non-zero weights quantized by
    ``gguf.quants.quantize``; the K-quants, which ``gguf`` cannot quantize: random bytes (every
    bit pattern of their codes and 6-/8-bit scales is valid) with float16 super-block scales
    set to random values in [1e-5, 1e-3]."""
    import gguf
    import numpy as np

    from kvserve.layers.gguf_blocks import FORMATS
    rng = np.random.default_rng(seed)
    t = gguf.GGMLQuantizationType[qtype]
    if qtype in ("Q4_0", "Q4_1", "Q8_0"):
        w = (rng.standard_normal((N, K)) * 0.05 + 0.01).astype(np.float32)
        raw = gguf.quants.quantize(w, t)
    else:
        cols, nbytes = FORMATS[qtype][:2]
        raw = rng.integers(0, 256, (N, K // cols, nbytes), dtype=np.uint8)
        for at in ((0, 2) if qtype == "Q4_K" else (208,)):  # Q4_K: d, dmin; Q6_K: d
            d = (rng.random((N, K // cols, 1)) * 1e-3 + 1e-5).astype(np.float16)
            raw[..., at:at + 2] = d.view(np.uint8)
        raw = raw.reshape(N, -1)
    return raw, gguf.quants.dequantize(raw, t)

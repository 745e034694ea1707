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
